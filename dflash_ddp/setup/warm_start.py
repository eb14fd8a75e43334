"""`--init_from`: a run's drafter starts from one that exists instead of from random weights.

Before any target loads, the source is checked against the run, each mismatch one line naming both values
and what to do. The drafter ranks then copy its weights into their freshly built drafter: the backbone
always, a family's own parts where both drafters have them; parts only the run's family has keep their
start, which drafts as the source does (DFlash2's convolutions are the identity and its selector neutral,
DSpark's Markov bias is zero), and parts only the source has are dropped with a line. The optimizer, the
schedule, the step and the data order start fresh.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_ddp.checkpoint.resume import RestoreError
from dflash_ddp.config import TrainConfig
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.families import build_model
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.parallel.downloads import once
from dflash_ddp.serving.source_drafter import SourceDrafter, hub_drafter_name, locate_source_drafter
from dflash_ddp.target_model.info import TargetInfo, target_fingerprint

LAYER = re.compile(r"^layers\.(\d+)\.")
# fields the run's drafter takes from its target; a source made for a target of another width differs here
WIDTH_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


@dataclass(frozen=True)
class WarmStart:
    """What a run takes from its source drafter: run tensor -> source tensor, and what it does not."""

    source: SourceDrafter
    layers_map: list[int]  # run layer i takes the source's layer layers_map[i]
    copied: dict[str, str]
    new: list[str]  # the run's tensors that keep their start
    dropped: list[str]  # the source's tensors the run has no place for

    def lines(self) -> list[str]:
        """What the run takes and leaves, for the leader to print."""
        source, family = self.source, self.source.config.family
        lines = [
            f"starting the drafter from {source.name} ({source.kind}, {family}, "
            f"{source.config.num_hidden_layers} layers): {len(self.copied)} tensors copied; the optimizer, "
            "schedule, step and data order start fresh"
        ]
        if self.layers_map != list(range(source.config.num_hidden_layers)):
            lines.append(f"  drafter layers from the source's layers {self.layers_map} (--init_layers_map)")
        if self.new:
            lines.append(
                "  new, at a start that drafts as the source: " + ", ".join(collapse_layers(self.new))
            )
        if self.dropped:
            lines.append(
                "  dropped (the run's drafter has no place for them): "
                + ", ".join(collapse_layers(self.dropped))
            )
        if source.stamp is None:
            lines.append(
                "  the source has no training stamp: its target is checked by shape only (hidden size, "
                "vocabulary, target layers, RoPE)"
            )
        return lines

    def record(self) -> dict:
        """What the checkpoints, the export's stamp and the model card say about the source."""
        source = self.source
        return {
            "source": source.name,
            "path": None if source.commit else str(source.path.resolve()),  # a hub snapshot: its commit
            "commit": source.commit,
            "kind": source.kind,
            "family": source.config.family,
            "sha256": source.sha256,
            "layers_map": self.layers_map,
            "new": collapse_layers(self.new),
            "dropped": collapse_layers(self.dropped),
        }


def collapse_layers(names: list[str]) -> list[str]:
    """Tensor names with the layer index as '*', each once, in order ('layers.*.attention_conv.base_kernel')."""
    return list(dict.fromkeys(LAYER.sub("layers.*.", name) for name in names))


def find_source(name: str, together: bool) -> SourceDrafter:
    """`--init_from`'s drafter; a hub name downloaded once per node (as targets are), then read by all."""
    if hub_drafter_name(name) is None:
        return locate_source_drafter(name)
    commit = once(f"drafter/{name}", lambda commit: locate_source_drafter(name, commit).commit, together)
    return locate_source_drafter(name, commit)


def source_taps_and_mask(
    cfg: TrainConfig, source: SourceDrafter | None
) -> tuple[list[int] | None, int | None]:
    """--target_layer_ids and --mask_token_id as given, else (with --init_from) the source drafter's."""
    if source is None:
        return cfg.target_layer_ids, cfg.mask_token_id
    taps = cfg.target_layer_ids if cfg.target_layer_ids is not None else list(source.config.target_layer_ids)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else source.config.mask_token_id
    return taps, mask


def plan_warm_start(
    cfg: TrainConfig, info: TargetInfo, run: DFlashDraftConfig, source: SourceDrafter
) -> WarmStart:
    """Check `source` against the run's drafter config `run` (built for target `info`) and map its tensors.
    Every mismatch raises one line naming both values and the flag to change."""
    src, where = source.config, source.where
    for name, target_value in (("hidden_size", info.hidden_size), ("vocab_size", info.vocab_size)):
        if getattr(src, name) != target_value:
            raise ValueError(
                f"{where}: its {name} {getattr(src, name)} is not the target's {target_value} ({info.path}): a "
                "drafter reads its own target's hidden states and vocabulary; start from a drafter made for this target"
            )
    if src.num_target_layers != info.num_layers:
        raise ValueError(
            f"{where}: it reads a target of {src.num_target_layers} layers, this run's target has {info.num_layers} "
            f"({info.path}); start from a drafter made for this target"
        )
    for name, flag in (("target_layer_ids", "target_layer_ids"), ("mask_token_id", "mask_token_id")):
        if list(_as_list(getattr(run, name))) != list(_as_list(getattr(src, name))):
            raise ValueError(
                f"{where}: it was trained with {name} {getattr(src, name)}, this run asks for {getattr(run, name)} "
                f"(--{flag}); leave --{flag} unset to take the source's"
            )
    if run.block_size != src.block_size:
        raise ValueError(
            f"{where}: its block size is {src.block_size}, this run's --block_size is {run.block_size}; pass "
            f"--block_size {src.block_size}"
        )
    layers_map = cfg.init_layers_map or list(range(run.num_hidden_layers))
    if cfg.init_layers_map is None and run.num_hidden_layers != src.num_hidden_layers:
        raise ValueError(
            f"{where}: it has {src.num_hidden_layers} layers, this run's --num_draft_layers is "
            f"{run.num_hidden_layers}; pass --num_draft_layers {src.num_hidden_layers}, or --init_layers_map "
            "(the source layer of each drafter layer) to change the depth on purpose"
        )
    bad = [j for j in layers_map if not 0 <= j < src.num_hidden_layers]
    if bad:
        raise ValueError(
            f"--init_layers_map {layers_map}: {bad} are not layers of the source (0..{src.num_hidden_layers - 1})"
        )
    _check_same(where, run, src, layers_map)
    return _map_tensors(source, run, layers_map)


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _check_same(where: str, run: DFlashDraftConfig, src: DFlashDraftConfig, layers_map: list[int]) -> None:
    """RoPE, width, windows, the target's conventions and a shared family's own settings: equal, or refused."""
    if run.rope_parameters != src.rope_parameters:
        raise ValueError(
            f"{where}: its RoPE {src.rope_parameters} is not the target's {run.rope_parameters}; start from a "
            "drafter made for this target"
        )
    for name in WIDTH_FIELDS + ("input_embedding_scale", "final_logit_softcapping", "logit_scale"):
        if getattr(run, name) != getattr(src, name):
            raise ValueError(
                f"{where}: its {name} {getattr(src, name)} is not this run's {getattr(run, name)} (the drafter "
                "takes it from its target); start from a drafter made for this target"
            )
    wanted = [src.layer_types[j] for j in layers_map]
    windows = {run.sliding_window, src.sliding_window} if run.slides or src.slides else set()
    if run.layer_types != wanted or len(windows) > 1:
        raise ValueError(
            f"{where}: its layers attend as {src.layer_types} (window {src.sliding_window}), this run's as "
            f"{run.layer_types} (window {run.sliding_window}); pass --sliding_window and --sliding_layers as the "
            "source's"
        )
    if run.family == src.family:
        for name in run.settings_to_match(src):
            if getattr(run, name) != getattr(src, name):
                raise ValueError(
                    f"{where}: its {name} is {getattr(src, name)}, this run's --{name} is {getattr(run, name)}; "
                    f"pass --{name} {getattr(src, name)}"
                )


def _map_tensors(source: SourceDrafter, run: DFlashDraftConfig, layers_map: list[int]) -> WarmStart:
    """Run tensor -> source tensor by name (layers through the map); shapes must agree."""
    with torch.device("meta"):
        own = {name: tuple(p.shape) for name, p in build_model(run).named_parameters()}
    theirs = source.shapes
    copied, new, used = {}, [], set()
    for name, shape in own.items():
        layer = LAYER.match(name)
        origin = LAYER.sub(f"layers.{layers_map[int(layer.group(1))]}.", name) if layer else name
        if origin not in theirs:
            new.append(name)
            continue
        if theirs[origin] != shape:
            raise ValueError(
                f"{source.where}: its tensor {origin} has shape {list(theirs[origin])}, this run's drafter "
                f"needs {list(shape)} for {name}; the settings of that part differ from the source's"
            )
        copied[name] = origin
        used.add(origin)
    dropped = [name for name in theirs if name not in used and not _unused_source_layer(name, layers_map)]
    return WarmStart(source, layers_map, copied, new, dropped)


def _unused_source_layer(name: str, layers_map: list[int]) -> bool:
    """A tensor of a source layer the map leaves out (a shallower run): not a part the run lacks."""
    layer = LAYER.match(name)
    return layer is not None and int(layer.group(1)) not in layers_map


def load_warm_start(model: DFlashDraftModel, warm: WarmStart) -> None:
    """Copy the source's tensors into a freshly built drafter (in its dtype and on its device). A source
    damaged or changed since the set-up checked it is a RestoreError: one line, as a refused resume."""
    try:
        state = warm.source.weights()
    except ValueError as e:
        raise RestoreError(str(e)) from None
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, origin in warm.copied.items():
            own[name].copy_(state[origin].to(dtype=own[name].dtype, device=own[name].device))


def check_source_target(
    cfg: TrainConfig, warm: WarmStart, target_path: Path, target_commit: str | None
) -> None:
    """A stamped source must have been trained for this run's target (its fingerprint, or the same hub name
    at the same commit), unless --init_from_other_target says the user means to adapt it."""
    stamp = warm.source.stamp
    if stamp is None or not stamp.get("target_fingerprint") or cfg.init_from_other_target:
        return
    mine = target_fingerprint(target_path)
    same_name = stamp.get("target_model") == cfg.target_model and stamp.get("target_commit") == target_commit
    if stamp["target_fingerprint"] == mine or (same_name and target_commit is not None):
        return
    raise ValueError(
        f"{warm.source.where}: it was trained for the target {stamp.get('target_model')} (fingerprint "
        f"{stamp['target_fingerprint']}), this run's target {cfg.target_model} has fingerprint {mine}; pass "
        "--init_from_other_target true to adapt it to this target on purpose"
    )
