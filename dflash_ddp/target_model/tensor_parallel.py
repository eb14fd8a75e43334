"""Tensor-parallel target groups: refusing targets that N ranks cannot shard, and loading a group's shards
with transformers' own tensor-parallel plans on the group's device mesh (built in parallel/meshes.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from torch import nn
from transformers import __version__ as transformers_version
from transformers.distributed import DistributedConfig
from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

from dflash_ddp.parallel.meshes import group_mesh
from dflash_ddp.parallel.topology import Topology
from dflash_ddp.target_model.info import TargetInfo
from dflash_ddp.target_model.loading import load_target_model
from dflash_ddp.target_model.quantization import WeightStorage, weight_bytes_by_name
from dflash_ddp.target_model.text_stack import expert_parallel, read_config, truncated_text_config


def check_tensor_parallel(path: str | Path, tp_size: int) -> None:
    """Refuse a target that `tp_size` ranks cannot shard: a model family without a tensor-parallel plan in
    transformers, or attention heads, KV heads, MLP widths or a vocabulary that `tp_size` does not divide.

    Reads the config only; runs before the target's shape is read, since families without a plan are also
    those whose configs name their sizes differently."""
    if tp_size == 1 or not (Path(path) / "config.json").is_file():  # inspect_target says what is missing
        return
    from transformers.distributed import mixin

    if not hasattr(mixin, "initialize_distributed_mesh"):  # the one function group_mesh replaces
        raise ValueError(
            f"--target_tp_size {tp_size}: this transformers ({transformers_version}) loads sharded models "
            "differently from the 5.24 this trainer was built against; install transformers 5.24 or pass "
            "--target_tp_size 1"
        )
    config = read_config(path).get_text_config(decoder=True)
    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(
            f"--target_tp_size {tp_size}: transformers has no tensor-parallel plan for the model family "
            f"'{config.model_type}' of {path}; pass --target_tp_size 1 (each target rank holds a whole copy)"
        )
    for what, size in split_sizes(config).items():
        # a width given per layer (Gemma 3n) or per modality (Ernie 4.5 VL's experts): every one is split
        for one in size if isinstance(size, (list, tuple)) else [size]:
            if one is not None and one % tp_size:
                raise ValueError(
                    f"--target_tp_size {tp_size} does not divide the target's {one} {what} in "
                    f"{path}/config.json; pass a --target_tp_size that divides it"
                )
    if any(getattr(config, "activation_sparsity_pattern", None) or ()):
        raise ValueError(
            f"--target_tp_size {tp_size}: model type '{config.model_type}' keeps only the largest of some layers' "
            f"MLP gate activations, cut at statistics of the whole gate (activation_sparsity_pattern in "
            f"{path}/config.json), which transformers' plan splits across the group: each rank would cut its "
            "own share at its own statistics; pass --target_tp_size 1"
        )


# module names whose split by a plan splits a size of the config (a plan's key ends with one of them)
HEAD_PROJECTIONS = ("q_proj", "q_b_proj", "kv_b_proj", "o_proj", "qkv_proj")
KV_PROJECTIONS = ("k_proj", "v_proj")
MLP_PROJECTIONS = ("mlp.gate_proj", "mlp.up_proj", "feed_forward.gate_proj", "feed_forward.up_proj")
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


EXPERT_PARALLEL_STYLES = ("grouped_gemm", "ep_dispatch_experts")  # split the experts by count, not width


def _split_keys(config, by_width: bool = False) -> list[str]:
    """The keys of the plans a group loads `config`'s text model with whose style splits parameters (by
    width: not the expert-parallel styles)."""
    plan = _group_plan(config)
    return [
        k
        for k, style in plan.items()
        if _shards(style) and not (by_width and style in EXPERT_PARALLEL_STYLES)
    ]


def attention_split(config) -> bool:
    """Whether a group splits the attention's heads across its ranks (DeepSeek V4's plan splits its shared
    experts alone: every rank runs the whole attention)."""
    return any(key.endswith(HEAD_PROJECTIONS) for key in _split_keys(config))


def split_sizes(config) -> dict[str, int | list | None]:
    """The config's sizes a group splits across its ranks, by what its plans split: the heads where the
    attention's projections are split, the KV heads where theirs are, the MLP's width, the experts' width
    where a plan splits experts or shared experts by width, the routed experts' count under expert
    parallelism, and the vocabulary (the embedding is split by rows)."""
    keys = _split_keys(config)
    splits = lambda names: any(key.endswith(names) for key in keys)  # noqa: E731
    sizes = {"vocabulary (vocab_size; the embedding is split by rows)": config.vocab_size}
    if splits(HEAD_PROJECTIONS):
        sizes["attention heads (num_attention_heads)"] = config.num_attention_heads
    if splits(KV_PROJECTIONS):
        sizes["KV heads (num_key_value_heads)"] = getattr(config, "num_key_value_heads", None)
    if splits(MLP_PROJECTIONS):
        sizes["MLP width (intermediate_size)"] = getattr(config, "intermediate_size", None)
    if any("expert" in key for key in _split_keys(config, by_width=True)):
        sizes["expert MLP width (moe_intermediate_size)"] = getattr(config, "moe_intermediate_size", None)
    if expert_parallel(config):  # each rank holds an equal share of the routed experts
        counts = [getattr(config, name) for name in EXPERT_COUNTS if getattr(config, name, None)]
        sizes["routed experts (each rank holds its share)"] = counts[0] if counts else None
    return sizes


def splits_evenly(config, tp_size: int) -> bool:
    """Whether a group of `tp_size` ranks divides every size its plans split (`check_tensor_parallel`)."""
    sizes = split_sizes(config).values()
    return all(
        one is None or one % tp_size == 0
        for size in sizes
        for one in (size if isinstance(size, (list, tuple)) else [size])
    )


def check_groups_within_nodes(topology: Topology) -> None:
    """A group's all-reduces run after every layer: its ranks must share a node. torchrun numbers the
    ranks of a node consecutively, LOCAL_WORLD_SIZE per node."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    if topology.tp_size == 1 or not per_node:
        return
    for k in range(topology.num_groups):
        ranks = topology.group_ranks(k)
        if ranks[0] // per_node != ranks[-1] // per_node:
            raise ValueError(
                f"--target_tp_size {topology.tp_size}: target group {k} (ranks {ranks[0]}-{ranks[-1]}) would span "
                f"two nodes of {per_node} processes each; make the target ranks per node a multiple of "
                f"{topology.tp_size} (e.g. --nproc-per-node or --drafter_ranks)"
            )


def load_sharded(
    info: TargetInfo, layers: int, dtype: torch.dtype, device: torch.device, meshes
) -> nn.Module:
    """The target's first `layers` decoder layers, sharded across this rank's group by transformers'
    tensor-parallel plan; each rank reads only its shard of every weight."""
    tp_size = meshes.get_mesh("tp").size()
    # a mixture of experts whose family has an expert-parallel plan: each rank of the group holds its share
    # of the experts, runs them on the batch the group shares, and the group sums their outputs (transformers'
    # tensor-parallel plans leave the experts whole on every rank)
    ep_size = tp_size if expert_parallel(info.text_stack().config) else 1
    distributed = DistributedConfig(tp_size=tp_size, ep_size=ep_size, ep_implementation="all_reduce")
    with group_mesh(meshes, device):
        model = load_target_model(info, layers, dtype, device, distributed_config=distributed)
    _check_plan_runs(model, info, tp_size)
    return model


@torch.no_grad()
def _check_plan_runs(model: nn.Module, info: TargetInfo, tp_size: int) -> None:
    """One forward of 2 tokens on every rank of the group (the same on each, so all fail alike): a plan that
    shards a projection its inputs do not match (transformers 5.25's GLM-5 plan names its linear-attention
    layers' output projection as its MLA layers') is one line before training, not a traceback mid-run."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    try:
        model(input_ids=ids, use_cache=False)
    except RuntimeError as error:
        raise ValueError(
            f"--target_tp_size {tp_size}: transformers' tensor-parallel plan for model type '{info.model_type}' "
            f"does not run on {info.path} ({str(error).splitlines()[0]}); pass --target_tp_size 1 (each target "
            "rank holds a whole copy)"
        ) from None


def unsharded_weight_bytes(info: TargetInfo, layers: int, storage: WeightStorage, dtype: torch.dtype) -> int:
    """Of `truncated_weight_bytes`, those a tensor-parallel group leaves whole on every rank (`load_sharded`):
    weights of modules transformers' plans for the model name no sharding for (the norms; the routed experts
    of a family without an expert-parallel plan; Falcon-H1's layers, whose plan splits the embedding alone)
    and those whose style keeps them whole. The input embedding is split by rows unless the plan names it,
    as transformers does."""
    return unsharded_of(info, layers, *weight_bytes_by_name(info, layers, storage, dtype))


def unsharded_of(info: TargetInfo, layers: int, sizes: dict[str, int], embedding: str) -> int:
    """`unsharded_weight_bytes` of the parameter sizes `weight_bytes_by_name` counted (and the name of the
    input embedding's weight), without building the model again."""
    config = truncated_text_config(info.text_stack(), layers)
    plan = {embedding.removesuffix(".weight"): "embedding_rowwise", **_group_plan(config)}
    return sum(size for name, size in sizes.items() if not _sharded_by(plan, name))


def _group_plan(config) -> dict[str, str]:
    """The tensor-parallel plan of `config`'s family, and its expert-parallel one where a group uses it."""
    return {
        **(config.base_model_tp_plan or {}),
        **(config.base_model_ep_plan if expert_parallel(config) else {}),
    }


def _sharded_by(plan: dict[str, str], name: str) -> bool:
    """Whether a parameter (`layers.3.self_attn.q_proj.weight`) is split by a plan whose keys name modules or
    parameters with layer numbers as `*`, as transformers matches them."""
    wildcard = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
    return _shards(plan.get(wildcard) or plan.get(wildcard.rsplit(".", 1)[0]))


def _shards(style: str | None) -> bool:
    """Whether a plan's style splits parameters: it has a `shard_param` of its own (`replicate`,
    `mla_kv_a_proj` and the like keep them whole)."""
    layer = ALL_PARALLEL_STYLES.get(style) if style else None
    return layer is not None and type(layer).shard_param is not TensorParallelLayer.shard_param
