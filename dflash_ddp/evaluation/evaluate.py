"""Real speculative decoding with a drafter of any family: acceptance length, speed, and the lossless check.

`python -m dflash_ddp.evaluate --target_model DIR --drafter DIR --data FILE` decodes the first prompts of a
jsonl/json conversation file greedily in five ways, in one run and on the same prompts:

- plain greedy decoding with a KV cache (the baseline and the ground truth);
- our own block-draft/verify loop (`speculative_generate`) with the given drafter;
- the same loop with an UNTRAINED drafter of the same shape (what training must beat);
- transformers' prompt-lookup decoding (a drafter-free baseline);
- transformers' own DFlash support, `target.generate(assistant_model=drafter, speculation_type="dflash")`
  (DFlash drafters only: transformers runs no DFlash2 drafter, and the report says so).

Every speculative output must equal the greedy output token for token; the CLI exits 1 otherwise and 2 on
bad input. tau is the mean number of tokens committed per target verify step, bonus token included.

`python -m dflash_ddp.evaluate --watch RUN_DIR` follows a training run and measures tau at its checkpoints
instead (see watch.py, in this folder).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from dflash_ddp.checkpoint.layout import resolve_checkpoint
from dflash_ddp.data.chat_template import load_target_tokenizer, row_template_kwargs
from dflash_ddp.data.sources import read_conversations
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.engines import EngineClient, EngineServer, SamplingRequest
from dflash_ddp.evaluation.arguments import argument_error, parse_arguments
from dflash_ddp.evaluation.decoding import (
    DecodeResult,
    as_transformers_assistant,
    greedy_generate,
    speculative_generate,
    tau_by_context,
    transformers_generate,
    untrained_drafter,
)
from dflash_ddp.evaluation.engine import engine_decode, engine_evaluation, engine_report
from dflash_ddp.evaluation.report import METHOD_LABELS, OWN_DECODING, methods, print_report
from dflash_ddp.evaluation.row_notes import (
    SAMPLED_ROW,
    assisted_decoding_note,
    generation_note,
    hyper_connection_note,
    past_positions_note,
    position_ids_note,
    sampled_row_note,
    transformers_note,
)
from dflash_ddp.evaluation.sampling import Sampling
from dflash_ddp.evaluation.ties import ULPS, cache_divergence, logit_gap
from dflash_ddp.hub import resolve_data
from dflash_ddp.parallel.devices import resolve_device
from dflash_ddp.serving.export import check_trained_for, load_drafter
from dflash_ddp.target_model.info import TargetInfo
from dflash_ddp.target_model.loading import eos_token_ids, load_causal_lm, whole_target


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


def load_prompts(
    tokenizer, data_path: str | Path, num_prompts: int, template_kwargs: dict | None = None
) -> list[tuple[str, list[int]]]:
    """The first `num_prompts` rows of a conversation file as (where, prompt ids): each conversation up to its
    last assistant turn (whole when it ends with another turn), rendered with the tokenizer's chat template
    and the generation prompt (a row's own template arguments over `template_kwargs`)."""
    prompts = []
    paths = resolve_data(str(data_path))[0]
    for where, messages, row_kwargs in read_conversations(paths, require_assistant=False, limit=num_prompts):
        # up to the last answer; a conversation that ends with a question (or holds none) is all prompt
        last = len(messages) - 1 if messages[-1]["role"] == "assistant" else len(messages)
        if last == 0:
            raise ValueError(f"{where}: nothing precedes the assistant turn, so there is no prompt")
        rendered = tokenizer.apply_chat_template(
            messages[:last],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **row_template_kwargs(template_kwargs or {}, row_kwargs, where),
        )
        prompts.append((where, list(rendered["input_ids"])))
    return prompts


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
    info = whole_target(target_dir)
    if not isinstance(drafter, DFlashDraftModel):
        drafter = load_checked_drafter(Path(drafter), info.path)
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


def load_checked_drafter(path: Path, target: Path) -> DFlashDraftModel:
    """The drafter at `path` (an export, a checkpoint, or a run: its latest), refused when it was trained with
    another tokenizer than `target`'s."""
    path = resolve_checkpoint(path)
    check_trained_for(path, target)
    return load_drafter(path)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run_evaluation(
    setup: EvalSetup,
    max_new_tokens: int,
    on_prompt: Callable[[int, int], None] | None = None,
    sampling: Sampling | None = None,
    confidence_threshold: float = 0.0,
) -> dict:
    """Decode every prompt with every method; return the report (see `evaluate`). With `sampling`, the
    target samples alone and with the drafters (speculative sampling), prompt i with seed `sampling.seed + i`;
    transformers' comparisons are greedy only and left out. `confidence_threshold`: this drafter's drafts are
    verified up to its confidence head's first position below it (DSpark; 0: all)."""
    target, eos = setup.target, setup.eos
    block_size = setup.drafter.config.block_size
    lookup_tokens = block_size - 1  # the same largest step as the drafter: block_size tokens per verify
    if sampling is not None:
        return _run_sampled(setup, max_new_tokens, on_prompt, sampling, confidence_threshold)
    runs: dict[str, Callable[[list[int], int], DecodeResult]] = {
        "greedy": lambda p, n: greedy_generate(target, p, n, eos),
        "dflash": lambda p, n: speculative_generate(
            target, setup.drafter, p, n, eos, None, confidence_threshold
        ),
        "dflash_untrained": lambda p, n: speculative_generate(target, setup.untrained, p, n, eos),
        "prompt_lookup": lambda p, n: transformers_generate(
            target, p, n, eos, prompt_lookup_num_tokens=lookup_tokens
        ),
        "transformers_dflash": lambda p, n: transformers_generate(
            target, p, n, eos, assistant_model=setup.drafter, speculation_type="dflash"
        ),
    }
    if transformers_note(setup.drafter.config):
        del runs["transformers_dflash"]
    if hyper_connection_note(target) or position_ids_note(target):
        runs.pop("transformers_dflash", None)
    if assisted_decoding_note(target, block_size) or generation_note(target):
        runs.pop("transformers_dflash", None)
        runs.pop("prompt_lookup")
    sampled_row = sampled_row_note(setup.drafter.config) is None
    # One short untimed pass per method first, so that one-off costs (CUDA kernels, allocator) are not timed.
    for run in runs.values():
        run(setup.prompts[0][1], min(max_new_tokens, 2 * block_size))

    results: dict[str, list[DecodeResult]] = {name: [] for name in runs}
    mismatched = []
    for index, (where, prompt) in enumerate(setup.prompts):
        for name, run in runs.items():
            results[name].append(run(prompt, max_new_tokens))
        if sampled_row:
            seeded = replace(SAMPLED_ROW, seed=SAMPLED_ROW.seed + index)
            sampled = speculative_generate(
                target, setup.drafter, prompt, max_new_tokens, eos, seeded, confidence_threshold
            )
            results.setdefault("dflash_sampled", []).append(sampled)
        truth = results["greedy"][-1].tokens
        for name in [m for m in methods(results) if m != "dflash_sampled"]:  # a sample: not token for token
            tokens = results[name][-1].tokens
            if tokens != truth:
                first = _first_difference(tokens, truth)
                gap = logit_gap(target, prompt, truth, tokens, first) or {"near_tie": False}
                if not gap["near_tie"] and name in OWN_DECODING:  # the target's own doing only up to there
                    divergence = cache_divergence(target, prompt, truth)
                    if divergence is not None and divergence <= first:
                        gap["target_cache_differs_at"] = divergence
                mismatched.append({"method": name, "prompt": where, "first_difference": first} | gap)
        if on_prompt is not None:
            on_prompt(index + 1, len(setup.prompts))
    return _summarise(results, mismatched, setup, max_new_tokens, lookup_tokens)


def _run_sampled(
    setup: EvalSetup, max_new_tokens: int, on_prompt, sampling: Sampling, threshold: float
) -> dict:
    """`run_evaluation` at temperature > 0: each output is a sample, so there is no token-for-token check;
    speculative sampling is lossless in distribution (its test: tests/test_sampling.py)."""
    target, eos = setup.target, setup.eos
    results: dict[str, list[DecodeResult]] = {"greedy": [], "dflash": [], "dflash_untrained": []}
    drafters = {"dflash": setup.drafter, "dflash_untrained": setup.untrained}
    for index, (_, prompt) in enumerate(setup.prompts):
        seeded = replace(sampling, seed=sampling.seed + index)
        results["greedy"].append(greedy_generate(target, prompt, max_new_tokens, eos, seeded))
        for name, drafter in drafters.items():
            cut = threshold if name == "dflash" else 0.0
            results[name].append(
                speculative_generate(target, drafter, prompt, max_new_tokens, eos, seeded, cut)
            )
        if on_prompt is not None:
            on_prompt(index + 1, len(setup.prompts))
    report = _summarise(results, [], setup, max_new_tokens, setup.drafter.config.block_size - 1)
    report.update(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed, lossless=None)
    report["notes"].append(
        f"sampled at temperature {sampling.temperature:g}, top_p {sampling.top_p:g}, seed {sampling.seed}: each "
        "output is a sample, lossless in distribution (speculative sampling's rejection rule), not token for "
        "token; transformers' comparisons run greedy only"
    )
    return report


def confidence_calibration(runs: list[DecodeResult], block_size: int) -> list[dict]:
    """By block position: the confidence head's mean predicted acceptance against the observed acceptance, over
    the positions the decoding reached (every draft before them accepted)."""
    rows = []
    for position in range(1, block_size):
        seen = [(p, ok) for r in runs for k, p, ok in r.calibration if k == position]
        if seen:
            rows.append(
                {
                    "position": position,
                    "predicted": sum(p for p, _ in seen) / len(seen),
                    "observed": sum(ok for _, ok in seen) / len(seen),
                    "reached": len(seen),
                }
            )
    return rows


def _summarise(results, mismatched, setup: EvalSetup, max_new_tokens: int, lookup_tokens: int) -> dict:
    block_size, family = setup.drafter.config.block_size, setup.drafter.config.family
    greedy_tokens = sum(len(r.tokens) for r in results["greedy"])
    greedy_rate = greedy_tokens / sum(r.seconds for r in results["greedy"])
    report = {
        "drafter": family,
        "num_prompts": len(setup.prompts),
        "max_new_tokens": max_new_tokens,
        "block_size": block_size,
        "prompt_lookup_num_tokens": lookup_tokens,
        "device": str(setup.target.device),
        "dtype": str(setup.target.dtype).removeprefix("torch."),
        "greedy": {"tokens": greedy_tokens, "tokens_per_s": greedy_rate},
        "notes": [
            n
            for n in (
                transformers_note(setup.drafter.config),
                sampled_row_note(setup.drafter.config),
                assisted_decoding_note(setup.target, block_size),
                generation_note(setup.target),
                hyper_connection_note(setup.target),
                position_ids_note(setup.target),
                past_positions_note(setup.target, setup.prompts, max_new_tokens),
            )
            if n
        ],
    }
    for name in methods(results):
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
            "speedup": None if name == "dflash_sampled" else rate / greedy_rate,  # its answers differ
            "mismatches": sum(m["method"] == name for m in mismatched),
        }
        if name in ("dflash", "dflash_untrained"):
            counts = [0] * block_size
            for r in runs:
                for length in r.accepted:
                    counts[length - 1] += 1
            entry["accept_histogram"] = counts  # entry k-1: verify steps that committed k tokens
            # tau by the tokens before the block (prompt and generated): where a drafter stops paying off
            entry["tau_by_context"], entry["verify_steps_by_context"] = tau_by_context(runs)
            entry["drafts_skipped"] = sum(r.drafts_skipped for r in runs)  # below --confidence_threshold
            if any(r.calibration for r in runs):
                entry["confidence_calibration"] = confidence_calibration(runs, block_size)
        report[name] = entry
    report["tau"] = report["dflash"]["tau"]  # this drafter's, as the eval.jsonl records name it
    report["tau_by_context"] = report["dflash"]["tau_by_context"]
    report["mismatched"] = mismatched
    # the verdict is this project's decoding; transformers' own speculative paths are comparisons, and where
    # one of them is not lossless on a target (prompt lookup on some hybrid caches) that is said, not failed
    own = [m for m in mismatched if m["method"] in OWN_DECODING]
    report["lossless"] = all(m["near_tie"] or m.get("target_cache_differs_at") is not None for m in own)
    if any(m.get("target_cache_differs_at") is not None for m in own):
        report["notes"].append(
            f"model type '{setup.target.config.get_text_config(decoder=True).model_type}': transformers' "
            "implementation gives other tokens with its KV cache than without (its own greedy decoding leaves "
            "its cacheless forward), so no decoding can equal greedy there; the outputs that differ are the "
            "target's, not counted against the drafter"
        )
    ties = [m for m in own if m["near_tie"]]
    if ties and report["lossless"]:
        report["notes"].append(
            f"{len(ties)} output(s) of this project's decoding leave greedy's at a near tie of the target's "
            f"{report['dtype']} logits (the two tokens within {ULPS} units in the last place): the target's own "
            "rounding of a batched verify against one-token steps, not the drafter; float32 (on the CPU) "
            "checks token for token"
        )
    for name in sorted({m["method"] for m in mismatched if not m["near_tie"]} - set(OWN_DECODING)):
        report["notes"].append(
            f"{METHOD_LABELS[name]} differs from greedy on this target (transformers' own speculative path, a "
            "comparison only: its speed is not that of a lossless method)"
        )
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

    Returns a JSON-ready dict: `drafter` (its family), `tau` and `tau_by_context` (this drafter's: tau per
    bucket of tokens before the block, decoding.CONTEXT_BUCKETS, buckets without a verify step left out),
    `greedy` {tokens, tokens_per_s}; for each of `dflash`
    (this drafter, whatever its family), `dflash_untrained`, `prompt_lookup`, `transformers_dflash` (DFlash
    drafters only; `notes` says so for another): {tau, verify_steps, tokens, tokens_per_s, speedup, mismatches}
    (plus `accept_histogram`, `tau_by_context` and `verify_steps_by_context` for the first two); `mismatched` (method, prompt, first differing token index);
    `lossless` (every output equals greedy); and the settings used. Bad input raises ValueError.
    """
    setup = prepare_evaluation(
        target_dir, drafter, data_path, num_prompts, device, chat_template, template_kwargs
    )
    return run_evaluation(setup, max_new_tokens)


def engine_main(args) -> int:
    """`--engine vllm`: the prompts decoded by vLLM servers (started from --vllm_python, or at --engine_url)
    with and without the drafter; 2 with one line when a server cannot run the drafter or the settings."""
    try:
        if not (args.vllm_python or args.engine_url):
            raise ValueError("--engine vllm needs --vllm_python PATH (vLLM's own Python) or --engine_url URL")
        info = whole_target(args.target_model)
        tokenizer = load_target_tokenizer(info.path, args.chat_template)
        prompts = load_prompts(tokenizer, args.data, args.num_prompts, args.chat_template_kwargs)
        drafter = resolve_checkpoint(Path(args.drafter).resolve())
        config = load_checked_drafter(drafter, info.path).config
        method = (
            "dspark" if config.family == "dspark" else "dflash"
        )  # DFlash2: vLLM's dflash, by architecture
        speculative = {
            "method": method,
            "model": str(drafter),
            "num_speculative_tokens": config.block_size - 1,
        }
        speculative["draft_sample_method"] = args.draft_sampling
        sampling = SamplingRequest(
            args.temperature,
            args.top_p,
            seed=args.seed,
            stop_token_ids=tuple(eos_token_ids(tokenizer, info.path)),
        )
        if args.engine_url:
            clients = [EngineClient(url) for url in args.engine_url]
            reference = None
            if len(clients) == 1 and not args.temperature:  # the project's own greedy decoding of the target
                model = load_causal_lm(info, resolve_device(args.device), torch.float32)
                eos = eos_token_ids(tokenizer, model)
                reference = [
                    greedy_generate(model, ids, args.max_new_tokens, eos).tokens for _, ids in prompts
                ]
            report = engine_evaluation(
                clients[0],
                clients[1] if len(clients) > 1 else None,
                prompts,
                args.max_new_tokens,
                reference,
                sampling,
            )
        else:
            # one server at a time, each stopped before the next starts: a vLLM server takes the share of the
            # GPU its --gpu-memory-utilization asks (0.9 by default), so a second beside it would not start
            target, python = str(info.path), args.vllm_python
            dtype = "float32" if resolve_device(args.device).type == "cpu" else "auto"
            extra = tuple(shlex.split(args.vllm_args))
            decodes = []
            for spec in (speculative, None):
                with EngineServer(python, target, spec, dtype, extra_args=extra) as server:
                    client = EngineClient(server.url)
                    decodes.append(
                        engine_decode(
                            client, prompts, args.max_new_tokens, sampling, drafting=spec is not None
                        )
                    )
            report = engine_report(*decodes, prompts, args.max_new_tokens, None, sampling)
        report["draft_sampling"] = args.draft_sampling if not args.engine_url else "the server's"
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in report.items() if k != "acceptance_by_position"}))
    print("acceptance by position: " + " ".join(f"{a:.3f}" for a in report["acceptance_by_position"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["lossless"] is False else 0


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 when every speculative output equals greedy, 1 on a mismatch, 2 on bad input."""
    args = parse_arguments(sys.argv[1:] if argv is None else argv)
    if error := argument_error(args):
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.engine == "vllm":
        return engine_main(args)
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
    if len(setup.prompts) < args.num_prompts:
        print(
            f"note: {args.data} has {len(setup.prompts)} prompts (--num_prompts {args.num_prompts})",
            file=sys.stderr,
        )
    if args.confidence_threshold and getattr(setup.drafter, "confidence_head", None) is None:
        print(
            f"error: --confidence_threshold {args.confidence_threshold}: the drafter {args.drafter} has no confidence "
            "head (DSpark drafters trained with --confidence_alpha > 0 have one)",
            file=sys.stderr,
        )
        return 2
    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed) if args.temperature else None
        report = run_evaluation(
            setup,
            args.max_new_tokens,
            lambda i, n: print(f"prompt {i}/{n}", file=sys.stderr),
            sampling,
            args.confidence_threshold,
        )
    except ValueError as e:  # a setting the drafter's family cannot decode with
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["lossless"] is False else 0
