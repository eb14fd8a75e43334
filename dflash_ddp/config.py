"""The run's typed configuration: dataclass defaults < embedded preset < YAML file < command-line flags.

Every key is validated once, here, with an error naming the flag or the file and key. Unknown keys are
errors (with the closest known key suggested), never ignored.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from dflash_ddp.data.chat_template import check_template_kwargs
from dflash_ddp.drafter.blocks import ANCHOR_RULES
from dflash_ddp.drafter.distillation import LOSSES
from dflash_ddp.drafter.dspark import MARKOV_HEAD_TYPES
from dflash_ddp.drafter.dspark import TARGET_TOPK as DSPARK_TARGET_TOPK
from dflash_ddp.drafter.families import FAMILIES
from dflash_ddp.drafter.lilicorr import TARGET_TOPK as LILICORR_TARGET_TOPK
from dflash_ddp.drafter.optimizer import DEFAULT_ORTHOGONALISATION, OPTIMIZERS, ORTHOGONALISATIONS
from dflash_ddp.drafter.weighting import POSITION_WEIGHTINGS
from dflash_ddp.hub import EMBEDDED_NAME, EMBEDDED_TARGET
from dflash_ddp.observe.trackers import REPORT_TO_CHOICES, resolve_report_to
from dflash_ddp.setting_checks import (
    check_family,
    check_idle,
    check_init_from,
    check_loss,
    check_paths,
    check_required,
    check_sliding,
    check_together,
    check_values,
)
from dflash_ddp.settings import allowed_text, check_setting, field_types, load_yaml, parse_flags, setting

ASSETS = EMBEDDED_TARGET.parent


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


_WEIGHT = {"in_range": (lambda x: x >= 0, "a number >= 0"), "overridable": True}
_POSITIVE = (lambda x: x > 0, "a number > 0")


@dataclass
class TrainConfig:
    """All settings of a training run. Defaults follow the paper (appendix A.1) for 8B-class targets.

    Each field is one setting, written once: its type, default, group, help and allowed values
    (`setting`), from which --help (cli_help.py), docs/cli.md, the YAML loader, the flags and `validate`
    all read."""

    # model
    target_model: str = setting(
        "",
        "model",
        "the frozen target: a local Hugging Face model directory or a hub name (through the hub cache; HF_HUB_OFFLINE=1 reads the cache only)",
        allowed="a directory, org/name[@revision], or embedded (the tiny target shipped in the package, with its preset)",
    )
    num_draft_layers: int = setting(5, "model", "decoder layers of the drafter", minimum=1)
    target_layer_ids: list[int] | None = setting(
        None,
        "model",
        "target layers whose outputs the drafter reads; unset: the paper's spread over the target's depth "
        "(with --init_from: the source drafter's)",
        allowed="layer ids, increasing, comma- or space-separated",
    )
    mask_token_id: int | None = setting(
        None,
        "model",
        "token id filling the drafted positions of a block; unset: the tokenizer's mask token (with "
        "--init_from: the source drafter's)",
        allowed="a token id >= 0 with an embedding row",
    )
    block_size: int = setting(
        16, "model", "tokens per draft block: the anchor plus the positions drafted in parallel", minimum=2
    )
    sliding_window: int = setting(
        0,
        "model",
        "sliding-window attention of the drafter's layers, in tokens (a query sees the context keys less "
        "than this many positions before it; at least --block_size); 0: full attention in every layer",
        minimum=0,
    )
    sliding_layers: list[int] | None = setting(
        None,
        "model",
        "the drafter layers that slide with --sliding_window; unset: every layer (as z-lab's DFlash2 drafter)",
        allowed="layer ids, comma- or space-separated",
    )
    drafter: str = setting(
        "dflash",
        "model",
        "the drafter family: dflash drafts a block's positions independently; dflash2 adds convolutions "
        "inside the block and a candidate selector that drafts each position given the one before it; "
        "dspark adds a Markov head (a bias from the previous token) and a confidence head (trained against the "
        f"target's distribution: --target_topk {DSPARK_TARGET_TOPK} unless given); lilicorr reranks each "
        "slot's candidates with a lattice correlator walked left to right (its penalty reads the target's "
        f"top-k: --target_topk {LILICORR_TARGET_TOPK} unless given; --lilicorr_conv adds DFlash2's convolutions)",
        choices=tuple(FAMILIES),
    )
    init_from: str = setting(
        "",
        "model",
        "start the drafter from an existing one: an export, a checkpoint or run directory of this project "
        "(weights only), or a DFlash/DFlash2/DSpark/LiLiCorr drafter in the serving layout; optimizer, schedule, step "
        "and data order start fresh. Another --drafter grows the source (new parts start as a no-op) or drops "
        "its extra parts",
        allowed="a directory, org/name[@revision] (through the hub cache), or empty: random weights",
    )
    init_from_other_target: bool = setting(
        False,
        "model",
        "with --init_from: accept a source drafter trained for another target (its stamp names it)",
    )
    init_layers_map: list[int] | None = setting(
        None,
        "model",
        "with --init_from: for each drafter layer, the source layer it starts from (e.g. 0 1 2 3 4 4 grows 5 "
        "layers into 6); unset: the same layers, and --num_draft_layers must be the source's",
        allowed="source layer ids, one per drafter layer",
    )
    conv_kernel_size: int = setting(
        2,
        "dflash2",
        "taps of each dynamic convolution (the token and the ones before it in the block)",
        minimum=1,
    )
    conv_group_size: int = setting(
        16, "dflash2", "channels sharing one dynamic kernel delta; must divide the hidden size", minimum=1
    )
    selector_rank: int = setting(256, "dflash2", "rank of the selector's codebooks", minimum=1)
    selector_top_k: int = setting(
        16, "dflash2", "candidates per drafted position: the LM head's best tokens", minimum=1
    )
    selector_loss_alpha: float = setting(
        1.0,
        "dflash2",
        "weight of the selector's loss beside the LM head's (0: the selector stays as initialised, a "
        "no-op, to measure the convolutions alone)",
        in_range=(lambda x: x >= 0, "a number >= 0"),
        overridable=True,
    )
    markov_rank: int = setting(
        256, "dspark", "rank of the Markov head's tables (0: no Markov head)", minimum=0
    )
    markov_head_type: str = setting(
        "vanilla", "dspark", "the Markov head's bias from the previous token", choices=MARKOV_HEAD_TYPES
    )
    confidence_head_with_markov: bool = setting(
        True, "dspark", "the confidence head also reads the previous token's Markov embedding"
    )
    dspark_ce_alpha: float = setting(0.1, "dspark", "weight of the CE of the Markov-biased logits", **_WEIGHT)
    dspark_l1_alpha: float = setting(
        0.9, "dspark", "weight of their L1 distance to the target's distribution (--target_topk)", **_WEIGHT
    )
    confidence_alpha: float = setting(
        1.0, "dspark", "weight of the confidence head's BCE (0: no confidence head)", **_WEIGHT
    )
    lilicorr_conv: bool = setting(
        False, "lilicorr", "DFlash2's convolutions in every layer (--conv_kernel_size ...)"
    )
    lilicorr_candidate_topk: int = setting(
        8, "lilicorr", "candidates per slot (a power of two <= 16)", minimum=1
    )
    lilicorr_hidden_size: int = setting(
        1024, "lilicorr", "the correlator's width (0: the drafter's)", minimum=0
    )
    lilicorr_num_heads: int = setting(8, "lilicorr", "attention heads of the correlator's layers", minimum=1)
    lilicorr_mlp_ratio: float = setting(
        2.0, "lilicorr", "its layers' MLP width / its width", in_range=_POSITIVE
    )
    lilicorr_num_layers: int = setting(2, "lilicorr", "layers of the correlator over the lattice", minimum=0)
    lilicorr_factor_dim: int = setting(
        1024, "lilicorr", "width of the vectors scoring a transition", minimum=1
    )
    lilicorr_vector_eps: float = setting(1e-4, "lilicorr", "epsilon of their L2 norm", in_range=_POSITIVE)
    lilicorr_logit_scale: float = setting(
        8.0, "lilicorr", "a transition's cosine to logit", in_range=_POSITIVE
    )
    lilicorr_ce_alpha: float = setting(0.25, "lilicorr", "weight of the correlator's K-way CE", **_WEIGHT)
    lilicorr_margin_alpha: float = setting(
        0.0, "lilicorr", "weight of the hinge (--lilicorr_margin)", **_WEIGHT
    )
    lilicorr_margin: float = setting(
        2.0, "lilicorr", "the true candidate's margin over the best other", **_WEIGHT
    )
    lilicorr_penalty_alpha: float = setting(
        0.25, "lilicorr", "weight of the penalty on candidates the target ranks below the true one", **_WEIGHT
    )
    # data
    data: list[str] = setting(
        [],
        "data",
        "training conversations (messages or ShareGPT conversations); needs --target_model",
        allowed="jsonl/json/parquet files, globs, a save_to_disk directory, or a hub dataset org/name[:split]",
    )
    chat_template: str = setting(
        "", "data", "a jinja file replacing the tokenizer's chat template", allowed="a file"
    )
    chat_template_kwargs: dict = setting(
        {},
        "data",
        "extra arguments of the chat template",
        allowed="a JSON object, e.g. '{\"enable_thinking\": false}'",
    )
    train_last_turn_only: bool = setting(
        False, "data", "the loss covers only the last assistant turn of each conversation"
    )
    skip_bad_rows: bool = setting(
        False, "data", "skip and count unusable rows instead of stopping at the first one"
    )
    max_seq_len: int = setting(3072, "data", "longest tokenized conversation", minimum=1, overridable=True)
    overlength: str = setting(
        "truncate", "data", "what happens to longer conversations", choices=("truncate", "drop")
    )
    tokens_per_batch: int = setting(
        32768,
        "data",
        "token budget of one batch (one target forward, padding included); a sequence longer than it is a "
        "batch of its own",
        minimum=1,
        overridable=True,
    )
    cache_dir: str = setting(
        "", "data", "tokenized-data cache; unset: OUTPUT_DIR/cache", allowed="a directory"
    )
    num_proc: int = setting(
        0,
        "data",
        "tokenization processes; 0: one per CPU core this process may use (at most 8) for data of 20,000 rows "
        "or more, else 1",
        minimum=0,
    )
    # optimisation
    num_anchors: int = setting(
        512, "optimisation", "draft blocks sampled per conversation and step", minimum=1, overridable=True
    )
    anchor_scale_tokens: int = setting(
        3072,
        "optimisation",
        "a conversation longer than N tokens gets --num_anchors blocks per N tokens, so long conversations train as many blocks per token as short ones (the default: the paper's 512 per 3072-token sequence); 0: --num_anchors per conversation whatever its length",
        minimum=0,
        overridable=True,
    )
    anchor_rule: str = setting(
        "response",
        "optimisation",
        "where anchors may sit: on response tokens followed by a response token (as at inference), or also on the last prompt token before each response",
        choices=ANCHOR_RULES,
        overridable=True,
    )
    loss_gamma: float | None = setting(
        None,
        "optimisation",
        "with --position_weighting decay: the loss's position decay exp(-(k-1)/gamma); unset: 7 for blocks of 16, 5 for 10, 4 for 8",
        in_range=(lambda v: v > 0, "a finite number > 0 (the position-decay scale)"),
        overridable=True,
    )
    loss_gamma_start: float | None = setting(
        None,
        "optimisation",
        "with --position_weighting decay: the decay's gamma at the first step, moving linearly to --loss_gamma at the last (a schedule); unset: --loss_gamma throughout",
        in_range=(lambda v: v > 0, "a finite number > 0 (the position-decay scale at the first step)"),
        overridable=True,
    )
    position_weighting: str = setting(
        "dpace",
        "optimisation",
        "how block positions weigh in the loss: D-PACE (weights from the drafter's own confidence on the labels), the paper's fixed decay, or Spec-AUF (weight 1 up to the drafter's first wrong position, 0 after); D-PACE and AUF are normalised by the blocks with a label",
        choices=POSITION_WEIGHTINGS,
        overridable=True,
    )
    dpace_smoothing: float = setting(
        0.5,
        "optimisation",
        "D-PACE's a: q~ = (1 - a) q + a for the label probability q",
        in_range=(lambda v: 0 <= v <= 1, "in [0, 1] (D-PACE's smoothing of the label probability)"),
        overridable=True,
    )
    loss: str = setting(
        "ce",
        "optimisation",
        "what a block position is scored against: the data's token (ce), or the target's top-k next-token distribution by KL divergence or total variation (needs --target_topk)",
        choices=LOSSES,
        overridable=True,
    )
    target_topk: int = setting(
        0,
        "optimisation",
        "soft targets: the target ranks run every layer and the LM head and send the top-k next-token probabilities with the features (k x 6 bytes more a token; --plan prints the target's extra compute); 0: none",
        allowed="0 or an integer >= 1",
        minimum=0,
        overridable=True,
        family_defaults={"dspark": DSPARK_TARGET_TOPK, "lilicorr": LILICORR_TARGET_TOPK},
    )
    ce_weight: float = setting(
        0.0,
        "optimisation",
        "share of the token's CE mixed into --loss kl or tv (DSpark trains 0.1 with tv)",
        in_range=(lambda v: 0 <= v <= 1, "in [0, 1] (the share of the token's CE in the loss)"),
        overridable=True,
    )
    num_epochs: int = setting(
        6, "optimisation", "passes over the data (when --max_steps is -1)", minimum=1, overridable=True
    )
    max_steps: int = setting(
        -1,
        "optimisation",
        "optimizer steps; -1: --num_epochs passes; 0: no training: the starting drafter (--init_from's, or a "
        "fresh one) is saved as the step-0 checkpoint and evaluated like any run's last (the target ranks stream "
        "nothing); a resume with more steps trains on from it",
        allowed="-1, 0 or an integer >= 1",
        overridable=True,
    )
    learning_rate: float = setting(
        6e-4,
        "optimisation",
        "peak learning rate (linear warm-up, cosine decay)",
        in_range=(lambda v: v > 0, "a finite number > 0"),
        overridable=True,
    )
    optimizer: str = setting(
        "muon",
        "optimisation",
        "Muon for the drafter's weight matrices (its rate scaled to AdamW's update size) with AdamW for the norms, or AdamW for all; a checkpoint resumes only with the optimizer it was saved with",
        choices=OPTIMIZERS,
    )
    muon_orthogonalisation: str = setting(
        DEFAULT_ORTHOGONALISATION,
        "optimisation",
        "how Muon orthogonalises its update: torch's five Newton-Schulz iterations, or three Polar Express steps (three fifths of the cost and drafters as good on the embedded target, but two CPUs' last-bit differences grow into different drafters: docs/benchmarks.md (h)); the state is the same, so a resume may change it",
        choices=ORTHOGONALISATIONS,
        overridable=True,
    )
    warmup_ratio: float = setting(
        0.04,
        "optimisation",
        "share of the steps spent warming up",
        in_range=(lambda v: 0 <= v < 1, "in [0, 1)"),
        overridable=True,
    )
    weight_decay: float = setting(
        0.0,
        "optimisation",
        "decoupled weight decay (Muon and AdamW alike)",
        in_range=(lambda v: v >= 0, "a finite number >= 0"),
        overridable=True,
    )
    max_grad_norm: float = setting(
        1.0,
        "optimisation",
        "gradient clipping threshold",
        in_range=(lambda v: v > 0, "a finite number > 0 (the clipping threshold)"),
        overridable=True,
    )
    seed: int = setting(
        0,
        "optimisation",
        "seed of the data order, anchors and drafter initialisation",
        allowed="an integer in [0, 2^63)",
        overridable=True,
    )
    gradient_accumulation_steps: int = setting(
        1, "optimisation", "batches per drafter rank and optimizer step", minimum=1
    )
    # distributed
    drafter_ranks: int = setting(
        1,
        "distributed",
        "the last N ranks train the drafter (data-parallel); the others run the target",
        minimum=1,
    )
    target_tp_size: int = setting(
        1,
        "distributed",
        "target ranks per tensor-parallel group (one sharded copy of the target per group, inside a node)",
        minimum=1,
    )
    max_inflight: int = setting(
        2, "distributed", "sends a target rank keeps outstanding before it waits (backpressure)", minimum=1
    )
    dist_timeout: float = setting(
        300.0,
        "distributed",
        "seconds a transfer or collective may take before the job names the lost rank",
        in_range=(lambda v: 0 < v <= 1e7, "a finite number of seconds in (0, 1e7]"),
    )
    channel_backend: str = setting(
        "auto",
        "distributed",
        "how hidden states travel: NCCL between GPUs, gloo through host memory",
        allowed="auto (NCCL on GPUs, gloo on CPU) | nccl | gloo",
        choices=("auto", "nccl", "gloo"),
    )
    # memory and compute
    device: str = setting(
        "auto", "memory and compute", "where each rank computes", choices=("auto", "cpu", "cuda")
    )
    attention: str = setting(
        "auto",
        "memory and compute",
        "the drafter's attention kernel",
        allowed="auto (flex on CUDA, sparse elsewhere) | sparse | flex | dense (the slow reference)",
        choices=("auto", "sparse", "flex", "dense"),
    )
    target_prefill_tokens: int = setting(
        0,
        "memory and compute",
        "positions of a batch the target runs at once, over all its rows: a larger batch is prefilled in pieces "
        "sharing a KV cache (the same features as one pass, to float tolerance), bounding the target's "
        "activations at long context at the cost of the batch's KV cache; 0: one pass",
        minimum=0,
    )
    drafter_chunk_tokens: int = setting(
        8192,
        "memory and compute",
        "draft positions per drafter forward/backward: bounds activation memory",
        minimum=1,
    )
    gradient_checkpointing: bool | None = setting(
        None,
        "memory and compute",
        "recompute each drafter layer in backward; unset: on exactly when --plan predicts it is needed",
        allowed="true | false | unset",
    )
    recompute: str = setting(
        "auto",
        "memory and compute",
        "what the drafter's layers recompute in backward: none keeps every activation (the fastest; on CUDA each "
        "layer's elementwise chains run compiled into fused kernels); qkv_mlp recomputes q/k/v and the MLP, in "
        "pieces of rows (about a quarter of the activations); auto: none where --plan predicts it fits, else "
        "qkv_mlp (and then --gradient_checkpointing where unset)",
        choices=("auto", "none", "qkv_mlp"),
    )
    memory_check: bool = setting(
        True, "memory and compute", "refuse at start a run whose predicted peak memory exceeds the machine's"
    )
    loss_chunk_size: int = setting(
        0,
        "memory and compute",
        "rows of the LM-head loss computed at once; 0: the plan's choice (on CUDA a drafter chunk's rows in one "
        "piece where that fits, else 1024; on the CPU 1024)",
        minimum=0,
    )
    # checkpoints
    output_dir: str = setting(
        "runs/dflash",
        "checkpoints",
        "checkpoints, metrics.jsonl, config and tracker logs",
        allowed="a directory",
    )
    save_steps: int = setting(
        1000, "checkpoints", "save a checkpoint every N steps (and at the last one)", minimum=1
    )
    save_total_limit: int = setting(3, "checkpoints", "checkpoints kept; 0 keeps all", minimum=0)
    resume: str = setting(
        "auto",
        "checkpoints",
        "where to resume from",
        allowed="auto (newest valid checkpoint) | never | PATH of a checkpoint",
    )
    resume_override: list[str] = setting(
        [],
        "checkpoints",
        "optimisation settings a resumed run may change",
        allowed=lambda: "any of " + ", ".join(RESUME_OVERRIDABLE),
    )
    # evaluation
    eval_data: str = setting(
        "",
        "evaluation",
        "held-out conversations for real speculative decoding at the end; empty: no evaluation",
        allowed="a jsonl file, a hub dataset org/name[:split], or empty",
    )
    eval_prompts: int = setting(50, "evaluation", "prompts taken from --eval_data", minimum=1)
    eval_max_new_tokens: int = setting(128, "evaluation", "tokens generated per prompt", minimum=1)
    eval_steps: int = setting(
        0,
        "evaluation",
        "also evaluate the checkpoint of every N-th step during training (a multiple of --save_steps); 0: off",
        minimum=0,
    )
    # logging
    logging_steps: int = setting(10, "logging", "log metrics every N steps", minimum=1)
    report_to: list[str] = setting(
        ["none"],
        "logging",
        "experiment trackers, as in Hugging Face (all: every installed one)",
        allowed=" | ".join(REPORT_TO_CHOICES) + "; several: tensorboard,wandb",
    )
    run_name: str = setting(
        "", "logging", "the run's name in the trackers; empty: the output directory's name", allowed="text"
    )
    # planning
    plan: bool = setting(False, "planning", "print topology, sizes and the memory estimate, then exit")
    plan_gpu_memory: float = setting(
        0.0,
        "planning",
        "with --plan: judge the fit against GPUs of this many GiB each (plan a GPU machine's run from another "
        "machine); 0: this machine's own devices",
        in_range=(lambda x: x >= 0, "a number of GiB >= 0"),
    )
    calibrate: bool = setting(
        False, "planning", "with --plan: measure one target and one drafter rank, recommend a split"
    )

    def validate(self) -> None:
        """Reject impossible settings with the flag name, the value and what to pass instead."""
        check_required(self)
        for f in dataclasses.fields(self):
            check_setting(f.name, getattr(self, f.name), f.metadata["setting"])
        check_values(self)
        check_template_kwargs(self.chat_template_kwargs)
        resolve_report_to(self.report_to)  # unknown names, and packages not installed, refused now
        check_loss(self)
        check_family(self)
        check_sliding(self)
        check_init_from(self)
        check_together(self)
        unknown = [name for name in self.resume_override if name not in RESUME_OVERRIDABLE]
        if unknown:
            raise ValueError(
                f"--resume_override {','.join(unknown)}: not a setting it can override; choose from "
                + ", ".join(RESUME_OVERRIDABLE)
            )
        check_paths(self)

    @property
    def batch_tokens(self) -> int:
        """The most tokens one batch holds: the budget, or one sequence longer than it."""
        return max(self.tokens_per_batch, self.max_seq_len)


# Settings a resumed run may change when named in --resume_override (a change of any other setting that
# the checkpoint records either belongs to another run or is followed automatically); global_batch is not a
# setting but what tokens_per_batch, the drafter ranks and accumulation make together.
RESUME_OVERRIDABLE = (
    *(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["setting"].overridable),
    "global_batch",
)


def parse_config(argv: list[str]) -> tuple[TrainConfig, bool]:
    """Build and validate the config from argv. Returns it and whether the embedded preset was used."""
    types_ = field_types(TrainConfig)
    words = {  # what a flag given without its value is told
        f.name: allowed_text(f.metadata["setting"]) + (f"; --{f.name} '' for none" if f.default == "" else "")
        for f in dataclasses.fields(TrainConfig)
    }
    config_file, flags = parse_flags(argv, types_, words)
    file_values = load_yaml(config_file, types_) if config_file else {}
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
    config = TrainConfig(**values, **family_defaults(values))
    config.validate()
    check_idle(config, flags, file_values, config_file)
    return config, embedded


def family_defaults(given: dict) -> dict:
    """The --drafter family's own defaults (a setting's `family_defaults`) of the settings `given` leaves out:
    --drafter dspark without --target_topk trains against the target's top 64."""
    drafter = given.get("drafter", TrainConfig.drafter)
    return {
        f.name: f.metadata["setting"].family_defaults[drafter]
        for f in dataclasses.fields(TrainConfig)
        if f.name not in given and drafter in f.metadata["setting"].family_defaults
    }


def config_to_dict(config: TrainConfig) -> dict:
    """A JSON-ready copy of the config (written to the run directory and into checkpoints)."""
    return dataclasses.asdict(config)
