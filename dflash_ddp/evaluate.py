"""Real speculative decoding with a DFlash drafter: acceptance length, speed, and the lossless check.

`python -m dflash_ddp.evaluate --target_model DIR --drafter DIR --data FILE` decodes the first prompts of a
jsonl/json conversation file greedily in five ways, in one run and on the same prompts:

- plain greedy decoding with a KV cache (the baseline and the ground truth);
- our own block-draft/verify loop (`speculative_generate`) with the given drafter;
- the same loop with an UNTRAINED drafter of the same shape (what training must beat);
- transformers' prompt-lookup decoding (a drafter-free baseline);
- transformers' own DFlash support, `target.generate(assistant_model=drafter, speculation_type="dflash")`.

Every speculative output must equal the greedy output token for token; the CLI exits 1 otherwise and 2 on
bad input. tau is the mean number of tokens committed per target verify step, bonus token included.

`python -m dflash_ddp.evaluate --watch RUN_DIR` follows a training run and measures tau at its checkpoints
instead (see watch.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from .chat_template import load_target_tokenizer
from .data import read_conversations
from .export import load_drafter
from .model import DFlashDraftConfig, DFlashDraftModel
from .target import (
    TargetInfo,
    _decoder_layers,
    capture_layer_outputs,
    inspect_target,
    last_layer_norm,
    load_causal_lm,
)

METHODS = ("dflash", "dflash_untrained", "prompt_lookup", "transformers_dflash")
METHOD_LABELS = {
    "greedy": "greedy (baseline)",
    "dflash": "DFlash, this drafter",
    "dflash_untrained": "DFlash, untrained drafter",
    "prompt_lookup": "prompt lookup (transformers)",
    "transformers_dflash": "DFlash in transformers generate",
}


@dataclass
class DecodeResult:
    """One greedy decoding of one prompt."""

    tokens: list[int]  # generated tokens, prompt excluded, ending at the first EOS or at max_new_tokens
    seconds: float  # wall time, prefill included
    target_forwards: int  # calls of the target's forward
    accepted: list[int] = field(default_factory=list)  # tokens committed per verify step (bonus included)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_input(prompt_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).view(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    return ids


def _commit(new: list[int], room: int, eos: set[int]) -> list[int]:
    """The part of `new` a greedy decoder would emit: at most `room` tokens, ending at the first EOS."""
    new = new[:room]
    for i, token in enumerate(new):
        if token in eos:
            return new[: i + 1]
    return new


@torch.inference_mode()
def greedy_generate(
    target: nn.Module, prompt_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = ()
) -> DecodeResult:
    """Plain greedy decoding with a KV cache, one target forward per token, timed."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = target.device
    ids = _as_input(prompt_ids, device)
    eos = set(eos_token_ids)
    cache = DynamicCache(config=target.config)
    _sync(device)
    start = time.perf_counter()
    logits = target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        step = torch.tensor([[tokens[-1]]], device=device)
        logits = target(input_ids=step, cache=cache, use_cache=True).logits
        tokens.append(int(logits[0, -1].argmax()))
    _sync(device)
    return DecodeResult(tokens, time.perf_counter() - start, target_forwards=len(tokens))


@torch.inference_mode()
def speculative_generate(
    target: nn.Module, drafter: nn.Module, prompt_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = ()
) -> DecodeResult:
    """Greedy block-draft/verify decoding (batch size 1), lossless with respect to `greedy_generate`.

    The target prefills the prompt; the outputs of its tapped layers at every prompt position are the first
    context. Each cycle the drafter sees the new context features (positions not yet in its cache) and the block
    `[anchor, MASK, ...]` at positions anchor_pos.. anchor_pos+block_size-1, where the anchor is the last committed
    token; the target's LM head over outputs 1.. gives block_size-1 draft tokens. One target forward verifies
    `[anchor, drafts]`; the longest prefix of drafts equal to the target's own greedy choices is accepted, plus the
    target's next token (the bonus). Both KV caches are cropped back to the committed prefix, and the tapped
    outputs of the committed verified positions (anchor and accepted drafts) become the next new context.

    `drafter` is called as transformers' DFlash candidate generator calls it and needs `config.block_size`,
    `config.mask_token_id` and `config.target_layer_ids`. Returns the generated tokens, the number of tokens
    committed by each verify step (bonus included, cut at EOS / max_new_tokens like the tokens) and wall time.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    config = drafter.config
    block_size, layer_ids = config.block_size, list(config.target_layer_ids)
    device = target.device
    ids = _as_input(prompt_ids, device)
    eos = set(eos_token_ids)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    masks = torch.full((1, block_size - 1), config.mask_token_id, dtype=torch.long, device=device)
    target_cache, drafter_cache = DynamicCache(config=target.config), DynamicCache()
    target_cache.activate_past_recording()  # lets `crop` roll back sliding-window layers too, as in transformers
    accepted: list[int] = []
    _sync(device)
    start = time.perf_counter()
    final_norm = last_layer_norm(target, layer_ids, target.config.get_text_config().num_hidden_layers)
    with capture_layer_outputs(_decoder_layers(target), layer_ids, False, final_norm) as captured:
        logits = target(input_ids=ids, cache=target_cache, use_cache=True, logits_to_keep=1).logits
        context = torch.cat([captured[i] for i in layer_ids], dim=-1)
        context_start = 0  # position of context[:, 0]
        tokens = [int(logits[0, -1].argmax())]
        while len(tokens) < max_new_tokens and tokens[-1] not in eos:
            anchor_pos = ids.shape[1] + len(tokens) - 1  # the anchor's own target features do not exist yet
            anchor = torch.tensor([[tokens[-1]]], device=device)
            positions = torch.arange(context_start, anchor_pos + block_size, device=device)[None]
            hidden = drafter(
                noise_embeds=embed(torch.cat([anchor, masks], dim=1)),
                context_hidden_states=context,
                position_ids=positions,
                cache=drafter_cache,
            ).last_hidden_state
            # The cache must hold context only: the next block is written at new positions with a new anchor.
            drafter_cache.crop(-block_size)
            drafts = head(hidden[:, 1:].to(head.weight.dtype)).argmax(dim=-1)
            verified = target(
                input_ids=torch.cat([anchor, drafts], dim=1), cache=target_cache, use_cache=True
            )
            choices = verified.logits[0].argmax(dim=-1)  # choices[k]: the target's token after verify input k
            num_ok = int((drafts[0] == choices[:-1]).long().cumprod(dim=0).sum())
            new = _commit(choices[: num_ok + 1].tolist(), max_new_tokens - len(tokens), eos)
            accepted.append(len(new))
            tokens += new
            # The anchor and the accepted drafts stay in the target cache; the bonus token is the next anchor.
            target_cache.crop(-(block_size - num_ok - 1))
            context = torch.cat([captured[i] for i in layer_ids], dim=-1)[:, : num_ok + 1]
            context_start = anchor_pos
    _sync(device)
    return DecodeResult(
        tokens, time.perf_counter() - start, target_forwards=1 + len(accepted), accepted=accepted
    )


@torch.inference_mode()
def transformers_generate(
    target: nn.Module, prompt_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = (), **generate_kwargs
) -> DecodeResult:
    """`target.generate(..., do_sample=False)` with extra arguments (an assistant, prompt lookup), timed, with
    the target's forward calls counted: every call after a plain prefill verifies one set of candidates."""
    device = target.device
    ids = _as_input(prompt_ids, device)
    eos = sorted(set(eos_token_ids))
    calls = 0

    def count(_module, _args):
        nonlocal calls
        calls += 1

    handle = target.register_forward_pre_hook(count)
    try:
        _sync(device)
        start = time.perf_counter()
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,  # never used at batch size 1; set to silence a warning
            **generate_kwargs,
        )
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        handle.remove()
    tokens = _commit(out[0, ids.shape[1] :].tolist(), max_new_tokens, set(eos))
    return DecodeResult(tokens, seconds, target_forwards=calls)


def as_transformers_assistant(drafter: DFlashDraftModel, target: nn.Module) -> DFlashDraftModel:
    """The drafter on the target's device and in its dtype, as `target.generate(assistant_model=drafter,
    speculation_type="dflash")` needs: its candidate generator applies the target's LM head to the drafter's
    output without casting it (an fp32 drafter with a bf16 target fails with a dtype error).

    Returns `drafter` itself when it already matches, else a converted copy (the input is never modified).
    Only the weights are cast: `Module.to(dtype)` would also round the fp32 rotary frequency buffer to bf16,
    which shifts RoPE angles at long positions.
    """
    device, dtype = target.device, target.dtype
    if all(p.device == device and p.dtype == dtype for p in drafter.parameters()):
        return drafter
    converted = copy.deepcopy(drafter).to(device)
    for p in converted.parameters():
        p.data = p.data.to(dtype)
    return converted.eval()


def untrained_drafter(config: DFlashDraftConfig, seed: int = 0) -> DFlashDraftModel:
    """A freshly initialised drafter of the same shape (seeded, without touching the global RNG)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DFlashDraftModel(copy.deepcopy(config)).eval()


def check_compatibility(config: DFlashDraftConfig, info: TargetInfo) -> None:
    """Raise ValueError when a drafter with this config cannot run on the target described by `info`."""
    if config.hidden_size != info.hidden_size:
        raise ValueError(
            f"the drafter's hidden_size is {config.hidden_size} but the target's hidden_size is "
            f"{info.hidden_size} ({info.path}): the drafter was built for another target"
        )
    outside = [i for i in config.target_layer_ids if not 0 <= i < info.num_layers]
    if outside:
        raise ValueError(
            f"the drafter's target_layer_ids {list(config.target_layer_ids)} include {outside}, outside the "
            f"target's {info.num_layers} decoder layers (valid ids 0..{info.num_layers - 1})"
        )
    if not 0 <= config.mask_token_id < info.vocab_size:
        raise ValueError(
            f"the drafter's mask_token_id {config.mask_token_id} is outside the target's vocabulary "
            f"(vocab_size {info.vocab_size})"
        )


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: use auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available")
    return device


def load_prompts(
    tokenizer, data_path: str | Path, num_prompts: int, template_kwargs: dict | None = None
) -> list[tuple[str, list[int]]]:
    """The first `num_prompts` rows of a conversation file as (where, prompt ids): each conversation up to its
    last assistant turn, rendered with the tokenizer's chat template and the generation prompt."""
    prompts = []
    for where, messages in read_conversations([str(data_path)])[:num_prompts]:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if last == 0:
            raise ValueError(f"{where}: nothing precedes the assistant turn, so there is no prompt")
        rendered = tokenizer.apply_chat_template(
            messages[:last],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(template_kwargs or {}),
        )
        prompts.append((where, list(rendered["input_ids"])))
    return prompts


def eos_token_ids(tokenizer, target: nn.Module) -> list[int]:
    """EOS ids of the tokenizer and of the target's generation config (either may be a list or missing)."""
    ids = set()
    for value in (tokenizer.eos_token_id, target.generation_config.eos_token_id):
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
    return sorted(ids)


@dataclass
class EvalSetup:
    """Everything loaded and checked before any decoding: bad input fails here, early."""

    target: nn.Module
    drafter: DFlashDraftModel  # on the target's device and dtype
    untrained: DFlashDraftModel
    prompts: list[tuple[str, list[int]]]
    eos: list[int]


def prepare_evaluation(
    target_dir: str | Path,
    drafter: DFlashDraftModel | str | Path,
    data_path: str | Path,
    num_prompts: int,
    device: str,
    chat_template: str = "",
    template_kwargs: dict | None = None,
) -> EvalSetup:
    """Load and cross-check target, tokenizer, drafter and prompts. Bad input raises ValueError.

    `chat_template` (a jinja file) and `template_kwargs` render the prompts as training rendered its data."""
    if num_prompts < 1:
        raise ValueError(f"--num_prompts must be >= 1, got {num_prompts}")
    torch_device = resolve_device(device)
    info = inspect_target(target_dir)
    if not isinstance(drafter, DFlashDraftModel):
        drafter = load_drafter(drafter)
    check_compatibility(drafter.config, info)
    tokenizer = load_target_tokenizer(info.path, chat_template)
    prompts = load_prompts(tokenizer, data_path, num_prompts, template_kwargs)
    # fp32 on CPU (bf16 matmuls are slow there); bf16 on CUDA, as the target is served.
    dtype = torch.bfloat16 if torch_device.type == "cuda" else torch.float32
    target = load_causal_lm(info, torch_device, dtype)
    return EvalSetup(
        target=target,
        drafter=as_transformers_assistant(drafter, target),
        untrained=as_transformers_assistant(untrained_drafter(drafter.config), target),
        prompts=prompts,
        eos=eos_token_ids(tokenizer, target),
    )


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run_evaluation(
    setup: EvalSetup, max_new_tokens: int, on_prompt: Callable[[int, int], None] | None = None
) -> dict:
    """Decode every prompt with every method; return the report (see `evaluate`)."""
    target, eos = setup.target, setup.eos
    block_size = setup.drafter.config.block_size
    lookup_tokens = block_size - 1  # the same largest step as the drafter: block_size tokens per verify
    runs: dict[str, Callable[[list[int], int], DecodeResult]] = {
        "greedy": lambda p, n: greedy_generate(target, p, n, eos),
        "dflash": lambda p, n: speculative_generate(target, setup.drafter, p, n, eos),
        "dflash_untrained": lambda p, n: speculative_generate(target, setup.untrained, p, n, eos),
        "prompt_lookup": lambda p, n: transformers_generate(
            target, p, n, eos, prompt_lookup_num_tokens=lookup_tokens
        ),
        "transformers_dflash": lambda p, n: transformers_generate(
            target, p, n, eos, assistant_model=setup.drafter, speculation_type="dflash"
        ),
    }
    # One short untimed pass per method first, so that one-off costs (CUDA kernels, allocator) are not timed.
    for run in runs.values():
        run(setup.prompts[0][1], min(max_new_tokens, 2 * block_size))

    results: dict[str, list[DecodeResult]] = {name: [] for name in runs}
    mismatched = []
    for index, (where, prompt) in enumerate(setup.prompts):
        for name, run in runs.items():
            results[name].append(run(prompt, max_new_tokens))
        truth = results["greedy"][-1].tokens
        for name in METHODS:
            tokens = results[name][-1].tokens
            if tokens != truth:
                mismatched.append(
                    {"method": name, "prompt": where, "first_difference": _first_difference(tokens, truth)}
                )
        if on_prompt is not None:
            on_prompt(index + 1, len(setup.prompts))
    return _summarise(results, mismatched, setup, max_new_tokens, lookup_tokens)


def _summarise(results, mismatched, setup: EvalSetup, max_new_tokens: int, lookup_tokens: int) -> dict:
    block_size = setup.drafter.config.block_size
    greedy_tokens = sum(len(r.tokens) for r in results["greedy"])
    greedy_rate = greedy_tokens / sum(r.seconds for r in results["greedy"])
    report = {
        "num_prompts": len(setup.prompts),
        "max_new_tokens": max_new_tokens,
        "block_size": block_size,
        "prompt_lookup_num_tokens": lookup_tokens,
        "device": str(setup.target.device),
        "dtype": str(setup.target.dtype).removeprefix("torch."),
        "greedy": {"tokens": greedy_tokens, "tokens_per_s": greedy_rate},
    }
    for name in METHODS:
        runs = results[name]
        tokens = sum(len(r.tokens) for r in runs)
        # Our loop and transformers' DFlash prefill without drafting (the first token is not a verify step);
        # in prompt lookup every target forward verifies candidates, the first one included.
        prefill = 0 if name == "prompt_lookup" else 1
        steps = sum(r.target_forwards - prefill for r in runs)
        rate = tokens / sum(r.seconds for r in runs)
        entry = {
            "tau": (tokens - prefill * len(runs)) / steps if steps else None,  # None: no verify step ran
            "verify_steps": steps,
            "tokens": tokens,
            "tokens_per_s": rate,
            "speedup": rate / greedy_rate,
            "mismatches": sum(m["method"] == name for m in mismatched),
        }
        if name in ("dflash", "dflash_untrained"):
            counts = [0] * block_size
            for r in runs:
                for length in r.accepted:
                    counts[length - 1] += 1
            entry["accept_histogram"] = counts  # entry k-1: verify steps that committed k tokens
        report[name] = entry
    report["mismatched"] = mismatched
    report["lossless"] = not mismatched
    return report


def evaluate(
    target_dir: str | Path,
    drafter: DFlashDraftModel | str | Path,
    data_path: str | Path,
    num_prompts: int = 50,
    max_new_tokens: int = 128,
    device: str = "auto",
    chat_template: str = "",
    template_kwargs: dict | None = None,
) -> dict:
    """Real speculative decoding of the first `num_prompts` prompts of `data_path` with `drafter` (a model,
    which is not modified, or an exported directory) on the target in `target_dir`.

    Returns a JSON-ready dict: `greedy` {tokens, tokens_per_s}; for each of `dflash`, `dflash_untrained`,
    `prompt_lookup`, `transformers_dflash`: {tau, verify_steps, tokens, tokens_per_s, speedup, mismatches}
    (plus `accept_histogram` for the first two); `mismatched` (method, prompt, first differing token index);
    `lossless` (every output equals greedy); and the settings used. Bad input raises ValueError.
    """
    setup = prepare_evaluation(
        target_dir, drafter, data_path, num_prompts, device, chat_template, template_kwargs
    )
    return run_evaluation(setup, max_new_tokens)


def print_report(report: dict, console=None) -> None:
    """The report as rich tables: methods (tau, speed, lossless) and the accepted-length histogram."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(
        title=(
            f"DFlash evaluation: {report['num_prompts']} prompts, max_new_tokens {report['max_new_tokens']}, "
            f"block_size {report['block_size']}, {report['device']} {report['dtype']}"
        )
    )
    for column in ("method", "tau", "tokens/s", "speedup", "equals greedy"):
        table.add_column(column, justify="left" if column == "method" else "right")
    table.add_row(METHOD_LABELS["greedy"], "1.00", f"{report['greedy']['tokens_per_s']:.1f}", "1.00x", "-")
    for name in METHODS:
        entry = report[name]
        ok = report["num_prompts"] - entry["mismatches"]
        verdict = f"{ok}/{report['num_prompts']}" + ("" if entry["mismatches"] == 0 else " MISMATCH")
        table.add_row(
            METHOD_LABELS[name],
            "-" if entry["tau"] is None else f"{entry['tau']:.2f}",
            f"{entry['tokens_per_s']:.1f}",
            f"{entry['speedup']:.2f}x",
            verdict,
            style=None if entry["mismatches"] == 0 else "bold red",
        )
    console.print(table)

    histogram = Table(title="tokens committed per verify step (bonus included)")
    histogram.add_column("accepted", justify="right")
    for name in ("dflash", "dflash_untrained"):
        histogram.add_column(METHOD_LABELS[name], justify="right")
    totals = {name: max(1, sum(report[name]["accept_histogram"])) for name in ("dflash", "dflash_untrained")}
    for length in range(1, report["block_size"] + 1):
        cells = []
        for name in ("dflash", "dflash_untrained"):
            count = report[name]["accept_histogram"][length - 1]
            cells.append(f"{count} ({100 * count / totals[name]:.1f}%)")
        histogram.add_row(str(length), *cells)
    console.print(histogram)

    for m in report["mismatched"]:
        console.print(
            f"[bold red]{m['method']} differs from greedy on {m['prompt']} at token {m['first_difference']}"
        )
    console.print("lossless: every output equals greedy" if report["lossless"] else "[bold red]NOT lossless")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def json_object(text: str) -> dict:
    """argparse type of --chat_template_kwargs: a JSON object, or a usage error showing one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"enable_thinking\": false}}', got {text!r}"
        )
    return value


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 when every speculative output equals greedy, 1 on a mismatch, 2 on bad input.

    With --watch RUN_DIR it follows a training run instead and evaluates its checkpoints (watch.py)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--watch" or a.startswith("--watch=") for a in argv):
        from .watch import main as watch_main  # watch.py builds on this module

        return watch_main(argv)
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ddp.evaluate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--target_model", required=True, help="Hugging Face model directory of the target")
    parser.add_argument(
        "--drafter", required=True, help="exported drafter directory (config.json + model.safetensors)"
    )
    parser.add_argument("--data", required=True, help="jsonl/json file of conversations ('messages')")
    parser.add_argument("--num_prompts", type=_positive_int, default=50)
    parser.add_argument("--max_new_tokens", type=_positive_int, default=128)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--chat_template", default="", help="jinja file replacing the tokenizer's template")
    parser.add_argument(
        "--chat_template_kwargs", type=json_object, default={}, help="e.g. '{\"enable_thinking\": false}'"
    )
    parser.add_argument("--json", help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    try:
        setup = prepare_evaluation(
            args.target_model,
            args.drafter,
            args.data,
            args.num_prompts,
            args.device,
            args.chat_template,
            args.chat_template_kwargs,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = run_evaluation(
        setup, args.max_new_tokens, lambda i, n: print(f"prompt {i}/{n}", file=sys.stderr)
    )
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["lossless"] else 1


if __name__ == "__main__":
    sys.exit(main())
