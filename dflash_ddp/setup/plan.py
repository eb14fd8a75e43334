"""The run's predicted memory per rank (the drafter's model in drafter/memory.py, the target's in
target_model/memory.py, what the node holds in parallel/machine.py) and the refusal at start of a run that
would not fit.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from dflash_ddp.config import TrainConfig
from dflash_ddp.drafter.config import DFlashDraftConfig, resolve_attention
from dflash_ddp.drafter.families import build_model
from dflash_ddp.drafter.memory import DrafterLoad, drafter_memory
from dflash_ddp.drafter.optimizer import optimizer_state_bytes
from dflash_ddp.drafter.weighting import LOSS_PIECE_ROWS
from dflash_ddp.parallel.devices import compute_dtype, select_device
from dflash_ddp.parallel.machine import GIB, FitCheck, MemoryPlan, check_fit, device_capacity
from dflash_ddp.parallel.topology import Topology, env_world
from dflash_ddp.target_model.info import TargetInfo, layers_run
from dflash_ddp.target_model.memory import TargetLoad, in_pieces, target_memory
from dflash_ddp.target_model.quantization import (
    NOT_QUANTIZED,
    WeightStorage,
    truncated_weight_bytes,
    weight_bytes_by_name,
    weight_storage,
)
from dflash_ddp.target_model.tensor_parallel import attention_split, splits_evenly, unsharded_of


def run_device(cfg: TrainConfig) -> torch.device:
    """The device this rank will train on (before any process group exists); as `init_distributed` picks it,
    so a channel through host memory lets ranks share a GPU here too."""
    return select_device(cfg.device, env_world()[2], share_gpus=cfg.channel_backend == "gloo")


def planned_device(cfg: TrainConfig) -> torch.device:
    """The device the plan sizes the run for: this rank's, or with --plan_gpu_memory another machine's GPU
    (bf16, flex attention under --attention auto, CUDA's loss pieces; nothing runs on it)."""
    return torch.device("cuda") if cfg.plan_gpu_memory else run_device(cfg)


def drafter_sizes(config: DFlashDraftConfig, optimizer: str) -> tuple[int, int]:
    """A drafter of this shape: its trainable parameters and the bytes of `optimizer`'s state for them,
    counted on the meta device (one model built for both)."""
    with torch.device("meta"):  # shapes only, no memory
        model = build_model(config)
    return sum(p.numel() for p in model.parameters()), optimizer_state_bytes(model, optimizer)


def node_roles(topology: Topology) -> list[str]:
    """The roles of the ranks on this rank's node (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE)."""
    if topology.colocated:
        return ["colocated"]
    first = topology.rank - env_world()[2]
    count = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size))
    drafters = set(topology.drafter_ranks)
    return ["drafter" if r in drafters else "target" for r in range(first, first + count)]


@dataclass(frozen=True)
class Execution:
    """How the drafter trades memory for compute: whether its layers recompute q/k/v and the MLP in backward
    (--recompute qkv_mlp), whether each whole layer is recomputed (--gradient_checkpointing) and how many
    rows the LM-head loss scores at once (--loss_chunk_size), and why."""

    recompute: bool
    checkpointing: bool
    loss_rows: int
    reason: str = ""

    def describe(self) -> str:
        """'recompute none, gradient checkpointing off, loss pieces of 1024 rows: <why>'."""
        kind = "qkv_mlp" if self.recompute else "none"
        return (
            f"recompute {kind}, gradient checkpointing {'on' if self.checkpointing else 'off'}, "
            f"loss pieces of {self.loss_rows} rows" + (f": {self.reason}" if self.reason else "")
        )

    def record(self) -> dict:
        """What a checkpoint's trainer_state.json records of it."""
        return {
            "recompute": "qkv_mlp" if self.recompute else "none",
            "gradient_checkpointing": self.checkpointing,
            "loss_chunk_size": self.loss_rows,
        }


def executions(cfg: TrainConfig, device: torch.device, positions: int) -> list[Execution]:
    """The executions the settings allow on `device` for chunks of `positions` draft positions, fastest
    first: keeping every activation runs each matmul once and launches the fewest kernels; recomputing q/k/v
    and the MLP costs about a quarter more of the layers' FLOPs; recomputing whole layers a third more. Within
    each, on CUDA, the loss scores a chunk's rows in one piece (one compiled call and the head's two products,
    no loop over pieces) before pieces of LOSS_PIECE_ROWS; on the CPU pieces of LOSS_PIECE_ROWS (measured
    there, the loss alone took 1-2% longer in one piece)."""
    recomputes = {"none": [False], "qkv_mlp": [True], "auto": [False, True]}[cfg.recompute]
    checkpoints = [False, True] if cfg.gradient_checkpointing is None else [cfg.gradient_checkpointing]
    if cfg.loss_chunk_size:
        loss_pieces = [cfg.loss_chunk_size]
    elif device.type == "cuda" and positions > LOSS_PIECE_ROWS:
        loss_pieces = [positions, LOSS_PIECE_ROWS]
    else:
        loss_pieces = [LOSS_PIECE_ROWS]
    return [Execution(r, c, rows) for c in checkpoints for r in recomputes for rows in loss_pieces]


@dataclass
class RunMemory:
    """The predicted peaks of a drafter rank and a target rank, whether this node holds them, and the drafter's
    execution (the fastest the settings allow that fits; `executions`)."""

    drafter: MemoryPlan
    target: MemoryPlan
    fit: FitCheck
    execution: Execution
    drafter_params: int
    evaluation: int  # with --eval_data: the whole target's weights, which evaluation loads on the leader
    fitting_prefill: int | None = None  # where it does not fit: the largest --target_prefill_tokens that does
    target_storage: WeightStorage = NOT_QUANTIZED  # how a quantized release's weights sit on the device
    one_pass_target: MemoryPlan | None = None  # with the target prefilled in pieces: its plan in one pass
    unsharded_bytes: int = 0  # the target's weights a tensor-parallel plan leaves whole on each rank
    fitting_tp: int | None = (
        None  # where it does not fit even in pieces: the smallest --target_tp_size that does
    )

    @property
    def checkpointing(self) -> bool:
        return self.execution.checkpointing


def plan_memory(
    cfg: TrainConfig,
    info: TargetInfo,
    c: DFlashDraftConfig,
    topology: Topology,
    device: torch.device,
    gpu_bytes: int | None = None,
) -> RunMemory:
    """Predict this run's memory (see memory.py) for the device and node of this rank (`gpu_bytes`: for
    GPUs of that memory instead, as `check_fit`), and choose the drafter's execution."""
    roles = node_roles(topology)
    dtype = compute_dtype(device)
    dtype_bytes = dtype.itemsize
    storage = weight_storage(info, device, elsewhere=gpu_bytes is not None)
    params, optimizer_state = drafter_sizes(c, cfg.optimizer)
    # draft positions of one chunk: bounded by the chunk, by the batch's tokens and by the anchors its
    # sequences (at least 2 x block_size tokens each) can hold
    batch_tokens = cfg.batch_tokens  # a sequence longer than the budget is a batch of its own
    rows = max(1, batch_tokens // (2 * c.block_size))
    positions = min(cfg.drafter_chunk_tokens, c.block_size * min(batch_tokens, cfg.num_anchors * rows))

    def drafter(execution: Execution) -> MemoryPlan:
        load = DrafterLoad(
            num_params=params,
            optimizer_state=optimizer_state,
            chunk_tokens=positions,
            tokens_per_batch=batch_tokens,
            max_seq_len=cfg.max_seq_len,
            loss_chunk_size=execution.loss_rows,
            attention=resolve_attention(cfg.attention, device),
            dtype_bytes=dtype_bytes,
            # split: up to --max_inflight batches arrive while one trains
            received_batches=1 if topology.colocated else 1 + cfg.max_inflight,
            checkpointing=execution.checkpointing,
            recompute=execution.recompute,
        )
        return drafter_memory(c, load)

    layers = layers_run(info.num_layers, c.target_layer_ids, cfg.target_topk)
    sizes, embedding = weight_bytes_by_name(info, layers, storage, dtype)  # the model built once for both
    load = TargetLoad(
        weight_bytes=sum(sizes.values()),
        unsharded_bytes=unsharded_of(info, layers, sizes, embedding),  # whole on each rank of a group
        attention_split=attention_split(info.text_stack().config),
        target_layer_ids=c.target_layer_ids,
        layers=layers,
        tokens_per_batch=batch_tokens,
        dtype_bytes=dtype_bytes,
        inflight=0 if topology.colocated else cfg.max_inflight,  # colocated: no sends
        tp_size=topology.tp_size,
        topk=cfg.target_topk,
        prefill_tokens=cfg.target_prefill_tokens,
        max_seq_len=cfg.max_seq_len,
        device_type=device.type,
    )
    target = target_memory(info, load)
    # speculative decoding verifies with the whole target: every layer and the LM head, on one device
    whole = (
        truncated_weight_bytes(info, info.num_layers, storage, dtype)
        + (0 if info.tie_word_embeddings else info.vocab_size * info.hidden_size * dtype_bytes)
        if cfg.eval_data
        else 0
    )
    candidates = executions(cfg, device, positions)
    drafter_plans = [drafter(execution) for execution in candidates]  # the same beside any target plan

    def run_fit(target: MemoryPlan) -> tuple[Execution, MemoryPlan, FitCheck]:
        return choose_execution(
            candidates, drafter_plans, lambda p: check_fit(p, target, roles, device, gpu_bytes)
        )

    execution, plan, fit = run_fit(target)
    # beside a target in pieces, another of the drafter's executions may be the one that fits
    pieces = None if fit.fits else fitting_prefill(info, load, lambda t: run_fit(t)[2])
    one_pass = target_memory(info, dataclasses.replace(load, prefill_tokens=0)) if in_pieces(load) else None
    group = None
    if not (fit.fits or pieces):  # what a larger tensor-parallel group would hold
        group = fitting_tp_size(info, load, lambda t: run_fit(t)[2])
    return RunMemory(
        plan, target, fit, execution, params, whole, pieces, storage, one_pass, load.unsharded_bytes, group
    )


TP_SIZES = (2, 4, 8)  # a tensor-parallel group stays on one node


def fitting_tp_size(info: TargetInfo, load: TargetLoad, fit_of) -> int | None:
    """The smallest tensor-parallel group (of TP_SIZES, above the run's, dividing every size its plans split)
    with which a run that does not fit would: a target rank's weights shrink by the group's size, but for
    those its plans leave whole."""
    config = info.text_stack().config
    larger = (n for n in TP_SIZES if n > load.tp_size and splits_evenly(config, n))
    return next(
        (n for n in larger if fit_of(target_memory(info, dataclasses.replace(load, tp_size=n))).fits), None
    )


MIN_PREFILL_PIECE = 512  # smaller pieces leave the target's matrix products too thin to be worth it


def fitting_prefill(info: TargetInfo, load: TargetLoad, fit_of) -> int | None:
    """The largest prefill piece (a power of two below the positions run at once now, at least
    MIN_PREFILL_PIECE) with which a run that does not fit would: long contexts whose target materialises
    scores per query and key (eager attention, a sparse-attention indexer) or reference-code intermediates
    per position fit in pieces. None where no piece makes it fit (the weights or the drafter do not)."""
    running = min(load.prefill_tokens or load.tokens_per_batch, load.tokens_per_batch)
    piece = 1 << (running - 1).bit_length() - 1
    while piece >= MIN_PREFILL_PIECE:
        if fit_of(target_memory(info, dataclasses.replace(load, prefill_tokens=piece))).fits:
            return piece
        piece //= 2
    return None


def choose_execution(
    candidates: list[Execution], plans: list[MemoryPlan], fit_of
) -> tuple[Execution, MemoryPlan, FitCheck]:
    """The first of `candidates` (fastest first; `plans` their drafter plans) whose predicted peak fits, with
    the reason. When none fits, the first that needs no more than the leanest: the run is refused then
    (`check_memory`), and the drafter's choice should not be what the refusal names when a target rank is
    what does not fit."""
    fits = [fit_of(plan) for plan in plans]
    fitting = [i for i, fit in enumerate(fits) if fit.fits]
    chosen = fitting[0] if fitting else min(range(len(fits)), key=lambda i: (fits[i].needed, i))
    fit = fits[chosen]
    if len(candidates) == 1:
        reason = "the one the settings allow here (--recompute, --gradient_checkpointing, --loss_chunk_size)"
    elif not fitting:
        reason = f"none fits {fit.where}"
    elif chosen:
        faster = "; ".join(
            f"{candidates[i].describe()} would need {fits[i].needed / GIB:.2f} GiB" for i in range(chosen)
        )
        reason = f"the fastest that fits {fit.where} ({faster})"
    else:
        reason = f"the fastest, and it fits {fit.where}"
    return dataclasses.replace(candidates[chosen], reason=reason), plans[chosen], fit


# the context lengths --plan predicts (tokens of one sequence; a batch holds at least one)
CONTEXT_LENGTHS = (8192, 16384, 32768, 65536, 131072)


@dataclass
class ContextPlan:
    """A run's predicted memory with sequences of `length` tokens, and the size of one message."""

    length: int
    memory: RunMemory
    message_bytes: int  # the features of one batch of at least one such sequence


def context_length_plans(
    cfg: TrainConfig,
    info: TargetInfo,
    c: DFlashDraftConfig,
    topology: Topology,
    device: torch.device,
    gpu_bytes: int | None = None,
) -> list[ContextPlan]:
    """The run at each of CONTEXT_LENGTHS: --max_seq_len that long, --tokens_per_batch at least as long (a
    longer sequence would be a batch of its own anyway)."""
    width_bytes = len(c.target_layer_ids) * info.hidden_size * compute_dtype(device).itemsize
    plans = []
    for length in CONTEXT_LENGTHS:
        at = dataclasses.replace(cfg, max_seq_len=length, tokens_per_batch=max(cfg.tokens_per_batch, length))
        memory = plan_memory(at, info, c, topology, device, gpu_bytes)
        plans.append(ContextPlan(length, memory, at.batch_tokens * width_bytes))
    return plans


def longest_fitting(plans: list[ContextPlan]) -> int | None:
    """The longest context length whose run fits (None when none does)."""
    return max((p.length for p in plans if p.memory.fit.fits), default=None)


def pieces_that_fit(memory: RunMemory, short: bool = False) -> str:
    """Where a run does not fit but would with its target prefilled in pieces or in a larger tensor-parallel
    group, the setting that says so; where no group fits because its plan leaves much whole, how much
    (`short`: that it does not, for the lines of each context length)."""
    if memory.fitting_prefill:
        return f"; fits with --target_prefill_tokens {memory.fitting_prefill}"
    if memory.fitting_tp:
        return f"; fits with --target_tp_size {memory.fitting_tp}"
    if not memory.fit.fits and memory.unsharded_bytes:  # no group of one node fits: why
        if short:
            return f"; no --target_tp_size up to {TP_SIZES[-1]} fits"
        if memory.unsharded_bytes <= memory.target.total / 4:
            return f"; no --target_tp_size up to {TP_SIZES[-1]} that its sizes allow fits"
        return (
            f"; no --target_tp_size up to {TP_SIZES[-1]} fits: {memory.unsharded_bytes / GIB:.1f} GiB of its weights "
            "stay whole on every rank of a group (transformers' plans for the model do not split them)"
        )
    return ""


def one_pass_beside_pieces(memory: RunMemory) -> str:
    """Where the target is prefilled in pieces, its peak in one pass beside it, and which is smaller: pieces
    trade the activations for a KV cache and a mask, which is not always a saving."""
    if memory.one_pass_target is None:
        return ""
    pieces, one_pass = memory.target.total, memory.one_pass_target.total
    saving = (
        f"the pieces save {(one_pass - pieces) / GIB:.2f} GiB" if pieces < one_pass else "one pass is smaller"
    )
    return f"; one pass (--target_prefill_tokens 0) would need {one_pass / GIB:.2f} GiB: {saving}"


def check_memory(cfg: TrainConfig, memory: RunMemory) -> None:
    """Refuse, before anything loads, a run whose predicted peak exceeds what this node has."""
    if cfg.memory_check and not memory.fit.fits:
        parts = (*memory.drafter.parts.items(), *memory.target.parts.items())
        biggest = max(parts, key=lambda kv: kv[1])[0]
        advice = {
            "activations": "--drafter_chunk_tokens",
            "backward or loss": "--drafter_chunk_tokens (or --loss_chunk_size)",
            "attention workspace": "--drafter_chunk_tokens (or use --attention sparse)",
            "received features": "--tokens_per_batch and --max_seq_len (a batch holds one whole sequence at least)",
            "tapped features": "--tokens_per_batch and --max_seq_len (a batch holds one whole sequence at least)",
            "sends in flight": "--max_inflight or --tokens_per_batch",
            # the target's prefill in pieces: a smaller piece, or one pass (0), which keeps neither
            "attention mask": "--target_prefill_tokens (a smaller piece, or 0: one pass needs no mask)",
            "repeated keys and values": "--max_seq_len or --target_prefill_tokens 0 (one pass repeats none)",
            "KV cache": "--tokens_per_batch or --target_prefill_tokens 0 (one pass keeps no cache)",
            "expanded keys and values": "--tokens_per_batch (a piece expands the latent of every key before it)",
            "linear layers' reference code": "--target_prefill_tokens (pieces bound it), or install the kernel "
            "packages --plan names (target_kernels)",
            "attention scores": "--max_seq_len, or prefill in pieces (--target_prefill_tokens: the target's "
            "attention materialises its scores, which pieces bound)",
            "indexer scores": "--max_seq_len, or prefill in pieces (--target_prefill_tokens: the sparse "
            "attention's indexer scores every key for every query in fp32, which pieces bound)",
        }.get(biggest, "--tokens_per_batch or --drafter_chunk_tokens, or use fewer processes per machine")
        raise ValueError(
            f"predicted peak memory {memory.fit.needed / GIB:.1f} GiB exceeds {memory.fit.where}; its largest "
            f"part is the {biggest}: lower {advice}{pieces_that_fit(memory)} (--plan shows every part; "
            "--memory_check false skips this check)"
        )
    if cfg.memory_check and cfg.eval_data:
        check_evaluation_memory(cfg, memory)


def check_evaluation_memory(cfg: TrainConfig, memory: RunMemory) -> None:
    """Refuse at start an --eval_data whose evaluation cannot fit: it loads the whole target on the drafter
    leader's device (beside the training drafter when --eval_steps evaluates during training), which a
    target sharded across a group does not fit."""
    available, where = device_capacity(run_device(cfg))
    beside = memory.drafter.total if cfg.eval_steps else 0
    if memory.evaluation + beside > available:
        during = f" beside the drafter's {beside / GIB:.1f} GiB (--eval_steps)" if beside else ""
        raise ValueError(
            f"--eval_data: real-tau evaluation loads the whole target ({memory.evaluation / GIB:.1f} GiB of "
            f"weights) on the drafter leader's device{during}, and {where} cannot hold it; train without "
            "--eval_data and --eval_steps, then evaluate the export with `python -m dflash_ddp.evaluate` on "
            "a device that holds the target (--memory_check false skips this check)"
        )
