"""The run's typed configuration: dataclass defaults < embedded preset < YAML file < command-line flags.

Every key is validated once, here, with an error naming the flag or the file and key. Unknown keys are
errors (with the closest known key suggested), never ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dflash_ddp.data.chat_template import check_template_kwargs
from dflash_ddp.drafter.distillation import LOSSES
from dflash_ddp.drafter.objective import ANCHOR_RULES, POSITION_WEIGHTINGS
from dflash_ddp.drafter.optimizer import OPTIMIZERS
from dflash_ddp.hub import hub_dataset_name
from dflash_ddp.observe.trackers import resolve_report_to

ASSETS = Path(__file__).resolve().parent / "assets"


EMBEDDED_TARGET = ASSETS / "tiny_qwen3"


EMBEDDED_NAME = "embedded"  # --target_model embedded: the embedded default by name (other --data allowed)


# Used when no --target_model is given (or --target_model embedded): the tiny target and its data shipped in the package, with settings
# sized so that the whole job (training, then real speculative decoding) takes a few minutes on 2 CPU cores.
EMBEDDED_PRESET: dict[str, typing.Any] = {
    "target_model": str(EMBEDDED_TARGET),
    "data": [str(ASSETS / "data" / "docstring_qa_regenerated.jsonl")],
    "eval_data": str(ASSETS / "data" / "heldout_regenerated.jsonl"),
    "output_dir": "runs/embedded-default",
    "num_draft_layers": 2,
    "block_size": 8,
    "num_anchors": 16,
    "max_seq_len": 512,
    "tokens_per_batch": 4096,
    # Muon at 150 steps: four times the 2e-3 of AdamW's recipe trains drafters that accept more tokens
    # (docs/benchmarks.md (g): every seed above every seed at 2e-3, on both benchmark targets)
    "learning_rate": 8e-3,
    "max_steps": 150,
    "logging_steps": 10,
    "save_steps": 50,
    "eval_prompts": 20,
    "eval_max_new_tokens": 96,
}


@dataclass
class TrainConfig:
    """All settings of a training run. Defaults follow the paper (appendix A.1) for 8B-class targets."""

    target_model: str = ""
    data: list[str] = field(default_factory=list)
    output_dir: str = "runs/dflash"
    # drafter shape and DFlash settings
    num_draft_layers: int = 5
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    block_size: int = 16
    num_anchors: int = 512
    # where anchors may sit: response (the anchor and its next token are response tokens, as at inference) |
    # prompt_end (also the last prompt token before each response)
    anchor_rule: str = "response"
    loss_gamma: float | None = None
    loss_gamma_start: float | None = None  # the decay constant at the first step, moving to loss_gamma
    # how block positions weigh in the loss: dpace (D-PACE: from the drafter's own confidence, smoothed by
    # dpace_smoothing; see drafter/objective.py) | decay (the paper's exp(-(k-1)/gamma)) | auf (Spec-AUF: only
    # up to the drafter's first wrong position); dpace trains drafters that accept more tokens than decay
    # (docs/benchmarks.md (g))
    position_weighting: str = "dpace"
    dpace_smoothing: float = 0.5
    # what a block position is scored against: ce (the data's token) | kl | tv (the target's own top-k
    # next-token distribution, which target_topk > 0 makes the target ranks compute and send; see
    # drafter/distillation.py), with ce_weight of the token's CE mixed into kl or tv
    loss: str = "ce"
    target_topk: int = 0
    ce_weight: float = 0.0
    # data
    chat_template: str = ""  # a jinja file replacing the tokenizer's chat template
    chat_template_kwargs: dict = field(default_factory=dict)  # e.g. '{"enable_thinking": false}'
    train_last_turn_only: bool = False  # the loss covers only the last assistant turn
    skip_bad_rows: bool = False  # skip and count unusable rows instead of stopping at the first
    max_seq_len: int = 3072
    overlength: str = "truncate"  # truncate | drop: what happens to sequences longer than max_seq_len
    tokens_per_batch: int = 32768
    cache_dir: str = ""  # tokenized data cache; default OUTPUT_DIR/cache
    num_proc: int = 1  # tokenization processes
    # optimisation
    num_epochs: int = 6
    max_steps: int = -1
    learning_rate: float = 6e-4
    # muon (Muon for the drafter's weight matrices, AdamW for its norms) | adamw; Muon trains drafters that
    # accept far more tokens at equal steps (docs/benchmarks.md (g))
    optimizer: str = "muon"
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    # topology: the last drafter_ranks ranks train the drafter, the others run the target
    drafter_ranks: int = 1
    # target ranks per tensor-parallel group: each group of N consecutive target ranks holds one sharded copy
    target_tp_size: int = 1
    gradient_accumulation_steps: int = 1
    max_inflight: int = 2
    dist_timeout: float = 300.0
    # how hidden states travel: auto (NCCL between GPUs, gloo on CPU) | nccl | gloo (through host memory:
    # GPUs without peer-to-peer, or several ranks sharing one GPU, which NCCL refuses)
    channel_backend: str = "auto"
    # compute
    device: str = "auto"
    attention: str = "auto"  # auto (flex on CUDA, sparse elsewhere) | sparse | flex | dense (the reference)
    # draft positions (anchors x block size, summed over sequences) per drafter forward/backward: bounds the
    # drafter's activation memory; 8192 is one sequence of the paper's recipe (512 anchors x 16)
    drafter_chunk_tokens: int = 8192
    # per-layer activation checkpointing of the drafter (recomputes each layer in backward, about a third
    # more compute); unset: on exactly when --plan predicts the run does not fit without it
    gradient_checkpointing: bool | None = None
    memory_check: bool = True  # refuse at start a run whose predicted peak memory exceeds the machine's
    loss_chunk_size: int = 1024
    # bookkeeping
    save_steps: int = 1000
    save_total_limit: int = 3
    logging_steps: int = 10
    # experiment trackers, as in Hugging Face: none | all (every installed one) | tensorboard, wandb, mlflow
    report_to: list[str] = field(default_factory=lambda: ["none"])
    run_name: str = ""  # the run's name in the trackers; empty: the output directory's name
    plan: bool = False
    calibrate: bool = False  # with --plan: measure one target and one drafter rank, recommend a split
    resume: str = "auto"  # auto | never | PATH of a checkpoint directory
    resume_override: list[str] = field(default_factory=list)  # optimisation settings allowed to change
    # evaluation with real speculative decoding at the end of training (skipped when eval_data is empty)
    eval_data: str = ""
    eval_prompts: int = 50
    eval_max_new_tokens: int = 128
    # also at every checkpoint whose step is a multiple of eval_steps (0: off), by a background process on
    # the drafter leader's device: eval.jsonl and checkpoints/best (see evaluation/watch.py)
    eval_steps: int = 0

    def validate(self) -> None:
        """Reject impossible settings with the flag name, the value and what to pass instead."""
        if not self.target_model:
            raise ValueError(
                "--target_model is required (a local Hugging Face model directory or a hub name)"
            )
        if not self.data:
            raise ValueError("--data is required (one or more jsonl/json/parquet files)")
        for name, low in INT_MINIMUM.items():
            if getattr(self, name) < low:
                wanted = "a positive integer" if low == 1 else f"at least {low}"
                raise ValueError(f"--{name} {getattr(self, name)}: must be {wanted}")
        for name, (in_range, what) in FLOAT_RANGES.items():
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and in_range(value)):
                raise ValueError(f"--{name} {value}: must be {what}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed {self.seed}: must be in [0, 2^63)")
        if self.tokens_per_batch < self.max_seq_len:
            raise ValueError(
                f"--tokens_per_batch {self.tokens_per_batch} is smaller than --max_seq_len {self.max_seq_len}: "
                "a batch must hold at least one full sequence"
            )
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(
                f"--max_steps {self.max_steps}: pass a positive number, or -1 to run --num_epochs"
            )
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"--mask_token_id {self.mask_token_id}: must be a token id >= 0")
        check_template_kwargs(self.chat_template_kwargs)
        resolve_report_to(self.report_to)  # unknown names, and packages not installed, refused now
        if self.overlength not in ("truncate", "drop"):
            raise ValueError(f"--overlength {self.overlength}: choose truncate or drop")
        if self.position_weighting not in POSITION_WEIGHTINGS:
            raise ValueError(
                f"--position_weighting {self.position_weighting}: choose "
                f"{', '.join(POSITION_WEIGHTINGS[:-1])} or {POSITION_WEIGHTINGS[-1]}"
            )
        self._check_loss()
        for name in ("loss_gamma", "loss_gamma_start"):
            if getattr(self, name) is not None and self.position_weighting != "decay":
                raise ValueError(
                    f"--{name} {getattr(self, name)} sets the decay of --position_weighting decay, and D-PACE "
                    "(the default) has no decay: pass --position_weighting decay with it, or drop it"
                )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer {self.optimizer}: choose {' or '.join(OPTIMIZERS)}")
        if self.anchor_rule not in ANCHOR_RULES:
            raise ValueError(f"--anchor_rule {self.anchor_rule}: choose {' or '.join(ANCHOR_RULES)}")
        if self.attention not in ("auto", "sparse", "flex", "dense"):
            raise ValueError(
                f"--attention {self.attention}: choose auto, sparse (block-sparse, CPU and GPU), flex (compiled, "
                "CUDA) or dense (boolean-mask SDPA, the slow reference)"
            )
        if self.calibrate and not self.plan:
            raise ValueError("--calibrate measures the split for --plan: pass --plan --calibrate")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device}: choose auto, cpu or cuda")
        if self.channel_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(
                f"--channel_backend {self.channel_backend}: choose auto (NCCL between GPUs, gloo on CPU), nccl "
                "or gloo (through host memory)"
            )
        if self.channel_backend == "nccl" and self.device == "cpu":
            raise ValueError(
                "--channel_backend nccl needs GPUs: use --device cuda, or --channel_backend gloo"
            )
        if self.target_layer_ids is not None and len(self.target_layer_ids) == 0:
            raise ValueError("--target_layer_ids: give at least one layer id")
        unknown = [name for name in self.resume_override if name not in RESUME_OVERRIDABLE]
        if unknown:
            raise ValueError(
                f"--resume_override {','.join(unknown)}: not a setting it can override; choose from "
                + ", ".join(RESUME_OVERRIDABLE)
            )
        if self.eval_steps and not self.eval_data:
            raise ValueError(
                f"--eval_steps {self.eval_steps} needs --eval_data (conversations to take prompts from)"
            )
        if self.eval_steps % self.save_steps:
            raise ValueError(
                f"--eval_steps {self.eval_steps} is not a multiple of --save_steps {self.save_steps}: checkpoints "
                "are what is evaluated"
            )
        self._check_paths()

    def _check_loss(self) -> None:
        """--loss, --target_topk and --ce_weight together: each soft-target setting needs the others."""
        if self.loss not in LOSSES:
            raise ValueError(f"--loss {self.loss}: choose {', '.join(LOSSES)}")
        if self.loss != "ce" and not self.target_topk:
            raise ValueError(
                f"--loss {self.loss} trains against the target's top-k next-token distribution: pass "
                "--target_topk K (e.g. 8), or --loss ce"
            )
        if self.loss == "ce" and self.target_topk:
            raise ValueError(
                f"--target_topk {self.target_topk} makes the target ranks run every layer and send soft targets "
                "that --loss ce does not read: pass --loss kl or --loss tv, or drop --target_topk"
            )
        if self.loss == "ce" and self.ce_weight:
            raise ValueError(
                f"--ce_weight {self.ce_weight} mixes the token's CE into --loss kl or tv; --loss ce is that CE alone"
            )

    def _check_paths(self) -> None:
        """Paths read only after training (--eval_data) or written later (--output_dir), checked now."""
        if self.eval_data and not Path(self.eval_data).is_file() and hub_dataset_name(self.eval_data) is None:
            raise ValueError(
                f"--eval_data {self.eval_data}: no such file (nor a hub dataset name org/name[:split])"
            )
        for flag, path in (("--output_dir", self.output_dir), ("--cache_dir", self.cache_dir)):
            existing = (
                next((p for p in (Path(path), *Path(path).parents) if p.exists()), None) if path else None
            )
            if existing is not None and not existing.is_dir():
                raise ValueError(f"{flag} {path}: {existing} is a file, not a directory; pass another path")


# Integer settings and their smallest valid value (none has an upper bound of its own).
INT_MINIMUM = {
    "num_draft_layers": 1,
    "block_size": 2,  # the anchor + at least one drafted token
    "num_anchors": 1,
    "max_seq_len": 1,
    "tokens_per_batch": 1,
    "num_proc": 1,
    "num_epochs": 1,
    "drafter_ranks": 1,
    "target_tp_size": 1,
    "gradient_accumulation_steps": 1,
    "max_inflight": 1,
    "loss_chunk_size": 1,
    "drafter_chunk_tokens": 1,
    "save_steps": 1,
    "save_total_limit": 0,  # 0 keeps every checkpoint
    "logging_steps": 1,
    "eval_prompts": 1,
    "eval_max_new_tokens": 1,
    "eval_steps": 0,
    "target_topk": 0,  # 0: no soft targets
}


# Float settings: (whether a value is in range, the range in words). Every one must also be finite.
FLOAT_RANGES = {
    "learning_rate": (lambda v: v > 0, "a finite number > 0"),
    "warmup_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "weight_decay": (lambda v: v >= 0, "a finite number >= 0"),
    "max_grad_norm": (lambda v: v > 0, "a finite number > 0 (the clipping threshold)"),
    "loss_gamma": (lambda v: v > 0, "a finite number > 0 (the position-decay scale)"),
    "loss_gamma_start": (lambda v: v > 0, "a finite number > 0 (the position-decay scale at the first step)"),
    "dpace_smoothing": (lambda v: 0 <= v <= 1, "in [0, 1] (D-PACE's smoothing of the label probability)"),
    "ce_weight": (lambda v: 0 <= v <= 1, "in [0, 1] (the share of the token's CE in the loss)"),
    "dist_timeout": (lambda v: 0 < v <= 1e7, "a finite number of seconds in (0, 1e7]"),
}


# Settings a resumed run may change when named in --resume_override (a change of any other setting that
# the checkpoint records either belongs to another run or is followed automatically).
RESUME_OVERRIDABLE = (
    "learning_rate",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "num_anchors",
    "anchor_rule",
    "loss_gamma",
    "loss_gamma_start",
    "position_weighting",
    "dpace_smoothing",
    "loss",
    "target_topk",
    "ce_weight",
    "tokens_per_batch",
    "max_seq_len",
    "seed",
    "max_steps",
    "num_epochs",
    "global_batch",
)


def _field_types(cls) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key_error(key: str, known: list[str], where: str) -> ValueError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ValueError(f"{where}: unknown key '{key}'{hint}")


def _convert(value: typing.Any, hint: typing.Any, where: str) -> typing.Any:
    """Turn a YAML value or command-line string into the field's type, or say what was expected."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    try:
        if hint is dict:
            parsed = json.loads(value) if isinstance(value, str) else value
            if not isinstance(parsed, dict):
                raise ValueError
            return parsed
        if typing.get_origin(hint) is list:
            # `--key a b`, `--key a,b` and YAML lists all work
            items = [
                part
                for v in (value if isinstance(value, list) else [value])
                for part in (v.split(",") if isinstance(v, str) else [v])
                if not isinstance(part, str) or part.strip()
            ]
            return [_convert(v.strip() if isinstance(v, str) else v, args[0], where) for v in items]
        if hint is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if hint is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return hint(value)
    except (ValueError, TypeError):
        name = "a JSON object" if hint is dict else getattr(hint, "__name__", str(hint))
        raise ValueError(f"{where}: expected {name}, got {value!r}") from None


def _load_yaml(path: str, types_: dict) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {path}: file not found")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: the top level must be a mapping of key: value")
    values = {}
    for key, value in raw.items():
        if key not in types_:
            raise _unknown_key_error(key, list(types_), f"{path}")
        values[key] = _convert(value, types_[key], f"{path}: key '{key}'")
    return values


def _parse_flags(argv: list[str], types_: dict) -> tuple[str | None, dict]:
    """`--key value`, `--key=value`, `--key v1 v2` for lists, bare `--flag` for booleans."""
    config_file, values, i = None, {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument '{arg}': settings are given as --key value")
        key, _, inline = arg[2:].partition("=")
        if key != "config" and key not in types_:
            raise _unknown_key_error(key, ["config", *types_], "command line")
        i += 1
        raw: list[str] = [inline] if inline else []
        while not inline and i < len(argv) and not argv[i].startswith("--"):
            raw.append(argv[i])
            i += 1
        if key == "config":
            if len(raw) != 1:
                raise ValueError("--config takes exactly one YAML file")
            config_file = raw[0]
            continue
        hint = types_[key]
        if not raw:
            if hint is not bool:
                raise ValueError(f"--{key}: missing value")
            values[key] = True
            continue
        value = raw if typing.get_origin(hint) is list or len(raw) > 1 else raw[0]
        if len(raw) > 1 and typing.get_origin(hint) is not list:
            raise ValueError(f"--{key}: takes one value, got {raw}")
        values[key] = _convert(value, hint, f"--{key}")
    return config_file, values


def parse_config(argv: list[str]) -> tuple[TrainConfig, bool]:
    """Build and validate the config from argv. Returns it and whether the embedded preset was used."""
    types_ = _field_types(TrainConfig)
    config_file, flags = _parse_flags(argv, types_)
    file_values = _load_yaml(config_file, types_) if config_file else {}
    merged = {**file_values, **flags}
    named = merged.get("target_model") == EMBEDDED_NAME  # the embedded default, asked for by name
    if named:
        del merged["target_model"]
    embedded = "target_model" not in merged
    if embedded and "data" in merged and not named:  # else the tiny target would silently train on it
        raise ValueError(
            "--data needs --target_model: pass the model directory the conversations are for (without "
            f"--target_model the embedded tiny target trains on its own data; --target_model {EMBEDDED_NAME} "
            "trains it on this data on purpose)"
        )
    values = {**EMBEDDED_PRESET, **merged} if embedded else merged
    config = TrainConfig(**values)
    config.validate()
    return config, embedded


def config_to_dict(config: TrainConfig) -> dict:
    """A JSON-ready copy of the config (written to the run directory and into checkpoints)."""
    return dataclasses.asdict(config)
