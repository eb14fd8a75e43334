"""`python -m dflash_ddp.train --help`: every flag with one line saying what it does, its allowed values and
the value this run will use, grouped by concern.

The values shown are resolved as the run would resolve them: the embedded preset's when no --target_model
is given (the default run), a --config file's and the other flags' when they come with --help.
"""

from __future__ import annotations

import typing

from dflash_ddp.config import (
    EMBEDDED_NAME,
    EMBEDDED_PRESET,
    FLOAT_RANGES,
    INT_MINIMUM,
    RESUME_OVERRIDABLE,
    TrainConfig,
    _field_types,
    _load_yaml,
    _parse_flags,
)
from dflash_ddp.observe.trackers import REPORT_TO_CHOICES

REQUIRED = ("target_model", "data")  # required once the embedded default is not used


# group -> {flag: (what it does, allowed values or "" to derive them from the type and config's ranges)}
FLAGS: dict[str, dict[str, tuple[str, str]]] = {
    "model": {
        "target_model": (
            "the frozen target: a local Hugging Face model directory or a hub name (through the hub cache; "
            "HF_HUB_OFFLINE=1 reads the cache only)",
            "a directory, org/name[@revision], or embedded (the tiny target shipped in the package, with its preset)",
        ),
        "num_draft_layers": ("decoder layers of the drafter", ""),
        "target_layer_ids": (
            "target layers whose outputs the drafter reads; unset: the paper's spread over the target's depth",
            "layer ids, increasing, comma- or space-separated",
        ),
        "mask_token_id": (
            "token id filling the drafted positions of a block; unset: the tokenizer's mask token",
            "a token id >= 0 with an embedding row",
        ),
        "block_size": ("tokens per draft block: the anchor plus the positions drafted in parallel", ""),
    },
    "data": {
        "data": (
            "training conversations (messages or ShareGPT conversations); needs --target_model",
            "jsonl/json/parquet files, globs, a save_to_disk directory, or a hub dataset org/name[:split]",
        ),
        "chat_template": ("a jinja file replacing the tokenizer's chat template", "a file"),
        "chat_template_kwargs": (
            "extra arguments of the chat template",
            "a JSON object, e.g. '{\"enable_thinking\": false}'",
        ),
        "train_last_turn_only": ("the loss covers only the last assistant turn of each conversation", ""),
        "skip_bad_rows": ("skip and count unusable rows instead of stopping at the first one", ""),
        "max_seq_len": ("longest tokenized conversation", ""),
        "overlength": ("what happens to longer conversations", "truncate | drop"),
        "tokens_per_batch": ("token budget of one batch (one target forward); >= --max_seq_len", ""),
        "cache_dir": ("tokenized-data cache; unset: OUTPUT_DIR/cache", "a directory"),
        "num_proc": ("tokenization processes", ""),
    },
    "optimisation": {
        "num_anchors": ("draft blocks sampled per conversation and step", ""),
        "anchor_rule": (
            "where anchors may sit: on response tokens followed by a response token (as at inference), or "
            "also on the last prompt token before each response",
            "response or prompt_end",
        ),
        "loss_gamma": (
            "with --position_weighting decay: the loss's position decay exp(-(k-1)/gamma); unset: 7 for blocks "
            "of 16, 5 for 10, 4 for 8",
            "",
        ),
        "loss_gamma_start": (
            "with --position_weighting decay: the decay's gamma at the first step, moving linearly to "
            "--loss_gamma at the last (a schedule); unset: --loss_gamma throughout",
            "",
        ),
        "position_weighting": (
            "how block positions weigh in the loss: D-PACE (weights from the drafter's own confidence on the "
            "labels), the paper's fixed decay, or Spec-AUF (weight 1 up to the drafter's first wrong position, "
            "0 after); D-PACE and AUF are normalised by the blocks with a label",
            "dpace, decay or auf",
        ),
        "dpace_smoothing": ("D-PACE's a: q~ = (1 - a) q + a for the label probability q", ""),
        "loss": (
            "what a block position is scored against: the data's token (ce), or the target's top-k "
            "next-token distribution by KL divergence or total variation (needs --target_topk)",
            "ce, kl or tv",
        ),
        "target_topk": (
            "soft targets: the target ranks run every layer and the LM head and send the top-k next-token "
            "probabilities with the features (k x 6 bytes more a token); 0: none",
            "0 or an integer >= 1",
        ),
        "ce_weight": ("share of the token's CE mixed into --loss kl or tv (DSpark trains 0.1 with tv)", ""),
        "num_epochs": ("passes over the data (when --max_steps is -1)", ""),
        "max_steps": ("optimizer steps; -1: --num_epochs passes", "-1 or an integer >= 1"),
        "learning_rate": ("peak learning rate (linear warm-up, cosine decay)", ""),
        "optimizer": (
            "Muon for the drafter's weight matrices (its rate scaled to AdamW's update size) with AdamW for "
            "the norms, or AdamW for all; a checkpoint resumes only with the optimizer it was saved with",
            "muon or adamw",
        ),
        "warmup_ratio": ("share of the steps spent warming up", ""),
        "weight_decay": ("decoupled weight decay (Muon and AdamW alike)", ""),
        "max_grad_norm": ("gradient clipping threshold", ""),
        "seed": ("seed of the data order, anchors and drafter initialisation", "an integer in [0, 2^63)"),
        "gradient_accumulation_steps": ("batches per drafter rank and optimizer step", ""),
    },
    "distributed": {
        "drafter_ranks": (
            "the last N ranks train the drafter (data-parallel); the others run the target",
            "",
        ),
        "target_tp_size": (
            "target ranks per tensor-parallel group (one sharded copy of the target per group, inside a node)",
            "",
        ),
        "max_inflight": ("sends a target rank keeps outstanding before it waits (backpressure)", ""),
        "dist_timeout": ("seconds a transfer or collective may take before the job names the lost rank", ""),
        "channel_backend": (
            "how hidden states travel: NCCL between GPUs, gloo through host memory",
            "auto (NCCL on GPUs, gloo on CPU) | nccl | gloo",
        ),
    },
    "memory and compute": {
        "device": ("where each rank computes", "auto | cpu | cuda"),
        "attention": (
            "the drafter's attention kernel",
            "auto (flex on CUDA, sparse elsewhere) | sparse | flex | dense (the slow reference)",
        ),
        "drafter_chunk_tokens": (
            "draft positions per drafter forward/backward: bounds activation memory",
            "",
        ),
        "gradient_checkpointing": (
            "recompute each drafter layer in backward; unset: on exactly when --plan predicts it is needed",
            "true | false | unset",
        ),
        "memory_check": ("refuse at start a run whose predicted peak memory exceeds the machine's", ""),
        "loss_chunk_size": ("rows of the LM-head loss computed at once", ""),
    },
    "checkpoints": {
        "output_dir": ("checkpoints, metrics.jsonl, config and tracker logs", "a directory"),
        "save_steps": ("save a checkpoint every N steps (and at the last one)", ""),
        "save_total_limit": ("checkpoints kept; 0 keeps all", ""),
        "resume": ("where to resume from", "auto (newest valid checkpoint) | never | PATH of a checkpoint"),
        "resume_override": (
            "optimisation settings a resumed run may change",
            "any of " + ", ".join(RESUME_OVERRIDABLE),
        ),
    },
    "evaluation": {
        "eval_data": (
            "held-out conversations for real speculative decoding at the end; empty: no evaluation",
            "a jsonl file, a hub dataset org/name[:split], or empty",
        ),
        "eval_prompts": ("prompts taken from --eval_data", ""),
        "eval_max_new_tokens": ("tokens generated per prompt", ""),
        "eval_steps": (
            "also evaluate the checkpoint of every N-th step during training (a multiple of --save_steps); 0: off",
            "",
        ),
    },
    "logging": {
        "logging_steps": ("log metrics every N steps", ""),
        "report_to": (
            "experiment trackers, as in Hugging Face (all: every installed one)",
            " | ".join(REPORT_TO_CHOICES) + "; several: tensorboard,wandb",
        ),
        "run_name": ("the run's name in the trackers; empty: the output directory's name", "text"),
    },
    "planning": {
        "plan": ("print topology, sizes and the memory estimate, then exit", ""),
        "calibrate": ("with --plan: measure one target and one drafter rank, recommend a split", ""),
    },
}


def allowed(name: str, hint: typing.Any) -> str:
    """A field's allowed values from its type and config.py's ranges (what validate() enforces)."""
    if name in INT_MINIMUM:
        return f"an integer >= {INT_MINIMUM[name]}"
    if name in FLOAT_RANGES:
        return FLOAT_RANGES[name][1].removeprefix("a ").replace("in [", "a number in [")
    if hint is bool:
        return "true | false (a bare --flag means true)"
    return str(hint).replace("typing.", "") if typing.get_args(hint) else hint.__name__


def shown(value: typing.Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, dict):
        return str(value) if value else "{}"
    return "''" if value == "" else str(value)


def resolved_values(argv: list[str]) -> tuple[dict, bool]:
    """The values the run given by `argv` would use (before validation), and whether they are the embedded
    preset's; a flag that does not parse is left out (the run itself reports it)."""
    types_ = _field_types(TrainConfig)
    try:
        config_file, flags = _parse_flags(argv, types_)
        given = {**(_load_yaml(config_file, types_) if config_file else {}), **flags}
    except ValueError:
        given = {}
    defaults = {name: getattr(TrainConfig(), name) for name in types_}
    if given.get("target_model") == EMBEDDED_NAME:
        del given["target_model"]
    embedded = "target_model" not in given
    return {**defaults, **(EMBEDDED_PRESET if embedded else {}), **given}, embedded


def usage(argv: list[str] | None = None) -> str:
    """The --help text; `argv` (the other flags given with --help) decides the values shown."""
    values, embedded = resolved_values([a for a in argv or [] if a not in ("--help", "-h")])
    types_ = _field_types(TrainConfig)
    defaults = TrainConfig()
    lines = [
        "usage: torchrun --nproc-per-node N -m dflash_ddp.train [--config FILE.yaml] [--key value ...]",
        "       python -m dflash_ddp.train [...]   (one process: target and drafter together)",
        "",
        "Train a DFlash drafter for a frozen target LLM as one job: the first ranks run the target, the last",
        "--drafter_ranks train the drafter. Settings: built-in defaults < --config FILE.yaml < flags.",
        "`value`: what this run would use"
        + (
            ". No --target_model is given, so that is the embedded default run (the tiny\n"
            "target and data shipped in the package); where a run with --target_model would use another value,\n"
            "'otherwise' gives it."
            if embedded
            else "."
        ),
        "",
        "  --config FILE.yaml    settings as key: value (the flag names without --); flags override it",
        "  --help, -h            this text; with other flags, the values shown are theirs",
    ]
    documented = set()
    for group, flags in FLAGS.items():
        present = [(n, d) for n, d in flags.items() if n in types_]
        if not present:
            continue
        lines += ["", f"{group}:"]
        for name, (what, values_text) in present:
            documented.add(name)
            value = shown(values[name])
            if embedded and name in EMBEDDED_PRESET and EMBEDDED_PRESET[name] != getattr(defaults, name):
                value += (
                    f" (otherwise {shown(getattr(defaults, name)) if name not in REQUIRED else 'required'})"
                )
            lines.append(f"  --{name:<29} {what}")
            lines.append(f"  {'':<31} {values_text or allowed(name, types_[name])}; value: {value}")
    rest = [n for n in types_ if n not in documented]  # a new setting not described here yet
    if rest:
        lines += ["", "other:"]
        lines += [f"  --{n:<29} {allowed(n, types_[n])}; value: {shown(values[n])}" for n in rest]
    lines += [
        "",
        "Examples:",
        "  torchrun --nproc-per-node 8 -m dflash_ddp.train --config configs/qwen3-8b.yaml",
        "  torchrun --nproc-per-node 8 -m dflash_ddp.train --target_model DIR --data chats.jsonl --plan",
        "Errors name the flag, the value and what is allowed, exit status 2, before anything loads.",
    ]
    return "\n".join(lines)
