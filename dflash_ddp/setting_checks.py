"""The run's settings that depend on each other, checked together once the config is built (each error names
the flags and says what to pass instead): a drafter family's own settings, sliding windows, the loss and its
soft targets.
"""

from __future__ import annotations

import dataclasses

from dflash_ddp.drafter.dspark import TARGET_TOPK as DSPARK_TARGET_TOPK
from dflash_ddp.drafter.families import FAMILIES
from dflash_ddp.drafter.lilicorr import TARGET_TOPK as LILICORR_TARGET_TOPK


def check_family(cfg) -> None:
    """A setting of another drafter family (its --help group) would be silently ignored: refuse it."""
    for f in dataclasses.fields(cfg):
        family = f.metadata["setting"].group
        if family in FAMILIES and family != cfg.drafter and getattr(cfg, f.name) != f.default:
            raise ValueError(
                f"--{f.name} {getattr(cfg, f.name)} sets the {family} drafter, and this run trains "
                f"--drafter {cfg.drafter}: pass --drafter {family} with it, or drop it"
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
    if cfg.drafter == "lilicorr":
        if cfg.loss != "ce" or (cfg.lilicorr_penalty_alpha and not cfg.target_topk):
            raise ValueError(
                f"--drafter lilicorr (--loss {cfg.loss}, --target_topk {cfg.target_topk}): the backbone's loss is "
                "--loss ce, and the correlator's penalty (--lilicorr_penalty_alpha) reads the target's top-k: pass "
                f"--target_topk K >= 1 or leave it out ({LILICORR_TARGET_TOPK}), or --lilicorr_penalty_alpha 0"
            )
        return
    if cfg.drafter == "dspark":
        if cfg.loss != "ce" or not cfg.target_topk:
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
