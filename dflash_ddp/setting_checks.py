"""The run's settings that depend on each other, checked together once the config is built (each error names
the flags and says what to pass instead): a drafter family's own settings, sliding windows, the loss and its
soft targets.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dflash_ddp.drafter.dspark import TARGET_TOPK as DSPARK_TARGET_TOPK
from dflash_ddp.drafter.families import FAMILIES
from dflash_ddp.drafter.lilicorr import TARGET_TOPK as LILICORR_TARGET_TOPK
from dflash_ddp.hub import hub_dataset_name

# DFlash2's settings that --drafter lilicorr --lilicorr_conv reads too
CONVOLUTION_SETTINGS = ("conv_kernel_size", "conv_group_size")


def check_family(cfg) -> None:
    """A setting of another drafter family (its --help group) would be silently ignored: refuse it."""
    for f in dataclasses.fields(cfg):
        family = f.metadata["setting"].group
        shared = f.name in CONVOLUTION_SETTINGS and cfg.drafter == "lilicorr" and cfg.lilicorr_conv
        if family in FAMILIES and family != cfg.drafter and getattr(cfg, f.name) != f.default and not shared:
            convolved = " (or --lilicorr_conv true, DFlash2's convolutions in LiLiCorr)"
            raise ValueError(
                f"--{f.name} {getattr(cfg, f.name)} sets the {family} drafter, and this run trains "
                f"--drafter {cfg.drafter}: pass --drafter {family} with it"
                f"{convolved if f.name in CONVOLUTION_SETTINGS and cfg.drafter == 'lilicorr' else ''}, or drop it"
            )
    if (
        cfg.drafter == "dspark"
        and not cfg.markov_rank
        and cfg.confidence_head_with_markov
        and cfg.confidence_alpha
    ):
        raise ValueError(
            "--markov_rank 0 (no Markov head) with --confidence_head_with_markov true: the confidence head has no "
            "Markov embedding to read; pass --confidence_head_with_markov false"
        )
    if cfg.conv_kernel_size > cfg.block_size:
        raise ValueError(
            f"--conv_kernel_size {cfg.conv_kernel_size}: a convolution looks back inside a block only, so "
            f"at most --block_size {cfg.block_size} taps"
        )


def check_sliding(cfg) -> None:
    """--sliding_window and --sliding_layers together, the layers among the drafter's."""
    if cfg.sliding_layers is not None and not cfg.sliding_window:
        raise ValueError(
            f"--sliding_layers {cfg.sliding_layers} names the layers that slide, and --sliding_window is 0 "
            "(full attention everywhere): pass --sliding_window N, or drop --sliding_layers"
        )
    if cfg.sliding_window and cfg.sliding_window < cfg.block_size:
        raise ValueError(
            f"--sliding_window {cfg.sliding_window}: a block always sees itself whole, so at least "
            f"--block_size {cfg.block_size}"
        )
    outside = [i for i in cfg.sliding_layers or () if not 0 <= i < cfg.num_draft_layers]
    if outside:
        raise ValueError(
            f"--sliding_layers {cfg.sliding_layers}: {outside} are not layers of the drafter "
            f"(--num_draft_layers {cfg.num_draft_layers}: ids 0..{cfg.num_draft_layers - 1})"
        )


def check_loss(cfg) -> None:
    """--loss, --target_topk and --ce_weight together: each soft-target setting needs the others."""
    if (
        cfg.drafter in ("dspark", "lilicorr") and cfg.ce_weight
    ):  # their losses are their own: it would be ignored
        own = "--dspark_ce_alpha" if cfg.drafter == "dspark" else "--lilicorr_ce_alpha"
        raise ValueError(
            f"--ce_weight {cfg.ce_weight} mixes the token's CE into DFlash's --loss kl or tv, which --drafter "
            f"{cfg.drafter} does not train (its loss is its own: {own} weighs its CE); drop --ce_weight"
        )
    if cfg.drafter == "lilicorr":
        if cfg.loss != "ce" or (cfg.lilicorr_penalty_alpha and not cfg.target_topk):
            raise ValueError(
                f"--drafter lilicorr (--loss {cfg.loss}, --target_topk {cfg.target_topk}): the backbone's loss is "
                "--loss ce, and the correlator's penalty (--lilicorr_penalty_alpha) reads the target's top-k: pass "
                f"--target_topk K >= 1 or leave it out ({LILICORR_TARGET_TOPK}), or --lilicorr_penalty_alpha 0"
            )
        if not cfg.lilicorr_penalty_alpha and cfg.target_topk:
            raise ValueError(
                f"--lilicorr_penalty_alpha 0 with --target_topk {cfg.target_topk} (the family's default unless "
                "given): the target ranks would run every layer and send soft targets that nothing reads without "
                "the penalty; pass --target_topk 0 with it"
            )
        return
    if cfg.drafter == "dspark":
        reads_distribution = bool(cfg.dspark_l1_alpha or cfg.confidence_alpha)
        if not reads_distribution and cfg.target_topk:
            raise ValueError(
                f"--dspark_l1_alpha 0 and --confidence_alpha 0 with --target_topk {cfg.target_topk} (the family's "
                "default unless given): DSpark then trains on its CE alone, and the target ranks would run every "
                "layer and send a distribution that nothing trains on; pass --target_topk 0 with them"
            )
        if cfg.loss != "ce" or (reads_distribution and not cfg.target_topk):
            raise ValueError(
                f"--drafter dspark (--loss {cfg.loss}, --target_topk {cfg.target_topk}): DSpark's loss is its "
                "own (--dspark_ce_alpha, --dspark_l1_alpha, --confidence_alpha) against the target's "
                f"distribution: pass --target_topk K >= 1 or leave it out ({DSPARK_TARGET_TOPK}, the "
                "reference's), and keep --loss ce"
            )
        return
    if cfg.loss != "ce" and not cfg.target_topk:
        raise ValueError(
            f"--loss {cfg.loss} trains against the target's top-k next-token distribution: pass "
            "--target_topk K (e.g. 8), or --loss ce"
        )
    if cfg.loss == "ce" and cfg.target_topk:
        raise ValueError(
            f"--target_topk {cfg.target_topk} makes the target ranks run every layer and send soft targets "
            "that --loss ce does not read: pass --loss kl or --loss tv, or drop --target_topk"
        )
    if cfg.loss == "ce" and cfg.ce_weight:
        raise ValueError(
            f"--ce_weight {cfg.ce_weight} mixes the token's CE into --loss kl or tv; --loss ce is that CE alone"
        )


def check_init_from(cfg) -> None:
    """--init_from's companions need it, and a layers map names one source layer per drafter layer."""
    if not cfg.init_from:
        for name in ("init_from_other_target", "init_layers_map"):
            if getattr(cfg, name):
                raise ValueError(
                    f"--{name} {getattr(cfg, name)} goes with --init_from: pass the drafter to start from"
                )
        return
    if cfg.init_layers_map is not None and len(cfg.init_layers_map) != cfg.num_draft_layers:
        raise ValueError(
            f"--init_layers_map {cfg.init_layers_map} names {len(cfg.init_layers_map)} source layers, and "
            f"--num_draft_layers is {cfg.num_draft_layers}: name one source layer for each drafter layer"
        )


def idle_settings(config: dict) -> dict[str, tuple[str, str, str]]:
    """The settings that do nothing in a run of `config` (the settings as a dict) because another leaves
    what they set off: name -> (what it sets, what turns that on, what the run has instead)."""
    weighting, steps, optimizer = config["position_weighting"], config["max_steps"], config["optimizer"]
    table = (
        (
            "dpace_smoothing",
            weighting == "dpace",
            "D-PACE's smoothing",
            "--position_weighting dpace",
            weighting,
        ),
        (
            "lilicorr_margin",
            config["lilicorr_margin_alpha"] > 0,
            "the hinge's margin",
            "--lilicorr_margin_alpha W > 0",
            0,
        ),
        ("markov_head_type", config["markov_rank"] > 0, "the Markov head", "--markov_rank R > 0", 0),
        (
            "confidence_head_with_markov",
            config["confidence_alpha"] > 0,
            "what the confidence head reads",
            "--confidence_alpha W > 0",
            0,
        ),
        ("muon_orthogonalisation", optimizer == "muon", "Muon's update", "--optimizer muon", optimizer),
        ("num_epochs", steps == -1, "the length of a run of whole passes", "--max_steps -1", steps),
        ("eval_prompts", bool(config["eval_data"]), "the evaluation's prompts", "--eval_data FILE", "empty"),
        (
            "eval_max_new_tokens",
            bool(config["eval_data"]),
            "the evaluation's prompts",
            "--eval_data FILE",
            "empty",
        ),
    )
    return {name: (sets, needs, f"it is {has}") for name, acts, sets, needs, has in table if not acts}


def check_idle(cfg, flags: dict, file_values: dict, config_file: str | None) -> None:
    """A setting given (as a flag or in the config file) and changed from its default that acts only with
    another, which this run leaves off, would be recorded and ignored: refuse it, naming what it needs."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name, (sets, needs, instead) in idle_settings(vars(cfg)).items():
        value = getattr(cfg, name)
        if value == defaults[name] or (name not in flags and name not in file_values):
            continue
        shown = str(value).lower() if isinstance(value, bool) else value
        where = f"--{name} {shown}" if name in flags else f"{config_file}: {name}: {shown}"
        raise ValueError(
            f"{where} sets {sets}, which acts only with {needs} ({instead}): it would be ignored; drop "
            f"{'it' if name in flags else 'the key'}, or pass {needs} with it"
        )


def check_together(cfg) -> None:
    """Settings that only make sense with others: the decay's gamma, --calibrate, --plan_gpu_memory, the
    channel's backend, the taps, and --eval_steps."""
    for name in ("loss_gamma", "loss_gamma_start"):
        if getattr(cfg, name) is not None and cfg.position_weighting != "decay":
            raise ValueError(
                f"--{name} {getattr(cfg, name)} sets the decay of --position_weighting decay, and D-PACE "
                "(the default) has no decay: pass --position_weighting decay with it, or drop it"
            )
    if cfg.calibrate and not cfg.plan:
        raise ValueError("--calibrate measures the split for --plan: pass --plan --calibrate")
    if cfg.plan_gpu_memory and not cfg.plan:
        raise ValueError(
            f"--plan_gpu_memory {cfg.plan_gpu_memory} plans a run on other GPUs and a run judges its fit on its "
            "own devices: pass --plan with it, or drop it"
        )
    if cfg.plan_gpu_memory and cfg.calibrate:
        raise ValueError(
            f"--calibrate times the ranks on this machine's devices and --plan_gpu_memory {cfg.plan_gpu_memory} "
            "plans for other GPUs: calibrate on the machine that will train, or drop --calibrate"
        )
    if cfg.channel_backend == "nccl" and cfg.device == "cpu":
        raise ValueError("--channel_backend nccl needs GPUs: use --device cuda, or --channel_backend gloo")
    if cfg.target_layer_ids is not None and len(cfg.target_layer_ids) == 0:
        raise ValueError("--target_layer_ids: give at least one layer id")
    if cfg.eval_steps and not cfg.eval_data:
        raise ValueError(
            f"--eval_steps {cfg.eval_steps} needs --eval_data (conversations to take prompts from)"
        )
    if cfg.eval_steps % cfg.save_steps:
        raise ValueError(
            f"--eval_steps {cfg.eval_steps} is not a multiple of --save_steps {cfg.save_steps}: checkpoints "
            "are what is evaluated"
        )


def check_paths(cfg) -> None:
    """Paths read only after training (--eval_data) or written later (--output_dir), checked now."""
    if cfg.eval_data and not Path(cfg.eval_data).is_file() and hub_dataset_name(cfg.eval_data) is None:
        raise ValueError(
            f"--eval_data {cfg.eval_data}: no such file (nor a hub dataset name org/name[:split])"
        )
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise ValueError(
            f"--resume {cfg.resume}: no such checkpoint or run directory (auto: the output directory's newest)"
        )
    for flag, path in (("--output_dir", cfg.output_dir), ("--cache_dir", cfg.cache_dir)):
        existing = next((p for p in (Path(path), *Path(path).parents) if p.exists()), None) if path else None
        if existing is not None and not existing.is_dir():
            raise ValueError(f"{flag} {path}: {existing} is a file, not a directory; pass another path")


def check_required(cfg) -> None:
    """A target and data: a run has nothing to train without them."""
    if not cfg.target_model:
        raise ValueError("--target_model is required (a local Hugging Face model directory or a hub name)")
    if not cfg.data:
        raise ValueError("--data is required (one or more jsonl/json/parquet files)")


def check_values(cfg) -> None:
    """Values a setting's own range does not say: the seed's, --max_steps' and the mask token's."""
    if not 0 <= cfg.seed < 2**63:
        raise ValueError(f"--seed {cfg.seed}: must be in [0, 2^63)")
    if cfg.max_steps < -1:
        raise ValueError(
            f"--max_steps {cfg.max_steps}: pass a positive number, 0 to save the starting drafter untrained, or "
            "-1 to run --num_epochs"
        )
    if cfg.mask_token_id is not None and cfg.mask_token_id < 0:
        raise ValueError(f"--mask_token_id {cfg.mask_token_id}: must be a token id >= 0")
