"""How many operations one drafter training step dispatches: a proxy for the GPU's kernel launches that any
machine can check, counted on the CPU at a fixed tiny shape (`count_step_ops`).

On an H200 the drafter's step launches thousands of small kernels (copies, multiplies, casts around small
matmuls), and at that size launching them costs as much as running them. A kernel count needs a GPU; the
aten operations a step dispatches do not, and each of them, bar views, allocations and host bookkeeping
(`NON_LAUNCHING`), is one launch or more on a GPU. So `DrafterTrainer.step` runs under a TorchDispatchMode
that counts them, on the CPU, at gpu_shapes.py's "tiny" scale, as CUDA would run the step where the code
allows:

- bf16 autocast around the forward and the loss, as the trainer sets it on CUDA, bf16 features and shared
  head (`compute_dtype` on CUDA), so that the casts around the matmuls are counted (in fp32 on the CPU they
  are no-ops and dispatch nothing);
- Muon's orthogonalisation in bf16 (torch's own iterations, what CUDA runs), of same-shaped matrices
  together where the optimizer has that option (its CUDA default), and AdamW's multi-tensor (foreach)
  implementation, torch's default for CUDA parameters (its default on the CPU loops per tensor);
- one sequence per drafter chunk, as the recipe's 512 anchors x 16 fill its 8192-position chunks;
- the drafter's matrices cast to bf16 once a step, as the trainer does on CUDA where the layers keep their
  activations (`DrafterTrainer.casts_weights_once`);
- the regions CUDA runs compiled (the layers' chains around attention and the loss's pieces, where the
  execution keeps every activation): they run eagerly here, their operations, forward and backward (the
  backward of each autograd node a region made), counted apart as `fused`. What is left, `outside_regions`,
  is what CUDA launches one kernel at a time; a compiled region launches its matrix products and a few fused
  kernels per call.

What differs from CUDA: the attention is the path the trainer resolves on the CPU ("sparse": a loop of
matmuls and softmax pieces per anchor chunk) where CUDA runs flex (a compiled kernel each way: counted as a
region here too); `--optimizer
adamw` counts foreach AdamW where CUDA runs the fused kernel; CUDA's autocast casts more functions to fp32
than the CPU's (exp, log, sum, softmax: none sees a bf16 input in the step today); and the blocks (anchors,
block ids, masks), which a GPU builds on the host and copies over, are counted apart and left out of the
launching figure. The loops over row pieces (the recomputing execution's MLP_ROWS and norms' backward
pieces; the loss's --loss_chunk_size where the plan chooses pieces) run once at this size and many times at
the recipe's: the figure counts the kernels per piece, not the pieces. With nothing recomputed and the loss in
one piece a chunk, as CUDA's plan chooses where they fit, no such loop runs at the recipe's size either.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from dflash_ddp.config import TrainConfig
from dflash_ddp.drafter import attention
from dflash_ddp.drafter.config import default_target_layer_ids, drafter_config_for
from dflash_ddp.drafter.families import FAMILIES
from dflash_ddp.drafter.trainer import DrafterTrainer
from dflash_ddp.setup.plan import executions
from dflash_ddp.setup.trainer import configure_execution
from dflash_ddp.target_model.info import target_info_from_config

from .gpu_shapes import SCALES, build_trainer, qwen3_config, random_batch
from .gpu_shapes import run as run_on_device

# Operations that launch no device work, by name (overloads alike): views and other metadata changes (a new
# header over the same memory), allocations without a fill (the caching allocator hands out memory without a
# kernel) and host work (dtype promotion, wrapping a host scalar, the profiler's ranges, reading a value:
# AdamW's step counts live on the host on CUDA too; a device value read is a copy and a wait, not a kernel).
# Any other op whose schema returns an alias of an input it does not write is a view too (`launches`).
NON_LAUNCHING = frozenset(
    {
        # views
        "view", "_unsafe_view", "_reshape_alias", "as_strided", "alias", "detach", "t", "transpose",
        "permute", "expand", "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes",
        "unbind", "narrow", "diagonal", "unfold",
        # allocations
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
        # host work
        "lift_fresh", "promote_types", "_record_function_enter_new", "_record_function_exit",
        "_local_scalar_dense",
    }
)  # fmt: skip
SCALE = "tiny"  # the fixed shape: counts compare between machines and runs only at one shape
BLOCKS = "blocks"  # the trainer's part that a GPU runs on the host
OTHER = "other"  # operations outside the trainer's named parts (the loss sums' adds, the finite check)

REGIONS = "op-count"  # the loss's compile backend while counting: its pieces run as `_as_region` wraps them


def launches(func) -> bool:
    """Whether the aten operation `func` would launch device work on a GPU (see NON_LAUNCHING)."""
    if func.overloadpacket.__name__ in NON_LAUNCHING:
        return False
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class OpCounter(TorchDispatchMode):
    """Counts the operations dispatched while active, by part of the trainer's step: it takes the place of
    the trainer's StepTimer, whose `part(name)` encloses blocks, drafter forward, loss, backward and
    optimizer (clipping, the optimizer's and the schedule's steps); the rest counts as OTHER."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, Counter] = defaultdict(Counter)  # part -> op name -> times dispatched
        self.launching: dict[str, Counter] = defaultdict(Counter)  # the same, launching ops alone
        self.fused: dict[str, Counter] = defaultdict(Counter)  # launching ops inside compiled regions
        self._part = OTHER
        self._regions_running = 0
        self._region_nodes: list[range] = []  # the sequence numbers of the autograd nodes each region made

    @contextlib.contextmanager
    def part(self, name: str):
        """Count the enclosed operations under `name`."""
        outer, self._part = self._part, name
        try:
            yield
        finally:
            self._part = outer

    @contextlib.contextmanager
    def region(self):
        """Count the enclosed operations, and later the backward of the autograd nodes they make, as a
        compiled region's (`_as_region`)."""
        first = torch._C._autograd._get_sequence_nr()
        self._regions_running += 1
        try:
            yield
        finally:
            self._regions_running -= 1
            self._region_nodes.append(range(first, torch._C._autograd._get_sequence_nr()))

    def _in_region(self) -> bool:
        if self._regions_running:
            return True
        node = torch._C._current_autograd_node()  # the node whose backward runs now, if any
        return node is not None and any(node._sequence_nr() in made for made in self._region_nodes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[self._part][name] += 1
        if launches(func):
            self.launching[self._part][name] += 1
            if self._in_region():
                self.fused[self._part][name] += 1
        return func(*args, **(kwargs or {}))


def _as_region(fn, **_compile_options):
    """Stands in for torch.compile while counting: `fn` runs eagerly, its operations counted as a compiled
    region's by the active OpCounter (dynamo compiles nothing under a dispatch mode)."""

    @functools.wraps(fn)
    def region(*args, **kwargs):
        counter = _get_current_dispatch_mode()
        if not isinstance(counter, OpCounter):
            return fn(*args, **kwargs)
        with counter.region():
            return fn(*args, **kwargs)

    return region


@dataclass(frozen=True)
class StepOps:
    """The operations of one step at one shape."""

    dispatched: int  # every aten operation, views and the blocks' host work included
    launching: int  # those that would launch device work, outside the blocks
    outside_regions: int  # ... and outside the regions CUDA compiles: launched one at a time there
    parts: dict[str, int]  # launching operations per part of the step (blocks: host work on a GPU)
    top: list[tuple[str, int]]  # the most frequent launching operations outside the blocks


@dataclass(frozen=True)
class OpCount:
    """`count_step_ops`' figures: the step at the scale's own depth and batch, and what a layer, a sequence
    and the optimizer add to it."""

    drafter: str  # the family
    layers: int
    sequences: int
    step: StepOps
    per_layer: int  # launching operations one more drafter layer adds (at one sequence)
    per_sequence: int  # ... one more sequence adds (at one layer)
    per_layer_outside: int  # the same, outside the compiled regions
    per_sequence_outside: int
    optimizer: int  # launching operations of the optimizer part of the step
    seconds: float  # to count all of it

    def lines(self) -> list[str]:
        """One line of figures, one of those outside the compiled regions, one of the top operations."""
        step = self.step
        top = ", ".join(f"{name} {n:,}" for name, n in step.top[:5])
        return [
            f"op count (CPU, fixed {SCALE} shape as CUDA would dispatch it, {self.drafter}, {self.layers} "
            f"layers x {self.sequences} sequences): {step.launching:,} launching ops per step "
            f"({step.dispatched:,} dispatched), per layer {self.per_layer:,}, per sequence "
            f"{self.per_sequence:,}, optimizer {self.optimizer:,} ({self.seconds:.1f} s to count)",
            f"op count outside the regions CUDA compiles (launched one by one): {step.outside_regions:,} "
            f"per step, per layer {self.per_layer_outside:,}, per sequence {self.per_sequence_outside:,}",
            f"op count, top: {top}",
        ]

    def as_dict(self) -> dict:
        """The figures as JSON-ready values."""
        return asdict(self)


def count_step_ops(overrides: dict | None = None, top: int = 10) -> OpCount:
    """Count the operations one `DrafterTrainer.step` dispatches at the fixed tiny shape (module docstring).

    Four trainers run one warm-up step (the first creates the optimizer's state), then one counted step:
    (1 layer, 1 sequence), (2 layers, 1 sequence), (1 layer, 2 sequences) and the scale's own (2, 2).
    per_layer = c(2, 1) - c(1, 1) and per_sequence = c(1, 2) - c(1, 1), in launching operations (all of them,
    and those outside the compiled regions). The optimizer's operations are those inside the trainer's
    "optimizer" part (clipping, the optimizer's and the schedule's steps, dropping the gradients), found by
    standing an OpCounter in for the trainer's timer.

    `overrides`: TrainConfig fields over the shape's and the defaults (DFlash, Muon; e.g. {"drafter":
    "dflash2"}, {"optimizer": "adamw"}, {"recompute": "qkv_mlp"}); families that train on the target's soft
    targets are refused. `top`: how many of the most frequent operations to keep."""
    start = time.perf_counter()
    scale = SCALES[SCALE]
    own = (scale.draft_layers, scale.tokens_per_batch // scale.max_seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # counts do not depend on threads; one keeps a shared machine's cores free
    try:
        # regions run as _as_region wraps them (their compile happens at set-up, the loss's at its first
        # call); the CPU's block-sparse attention stands in for flex's compiled kernel and counts as one too
        sparse = _as_region(attention.block_sparse_attention)
        with (
            mock.patch.object(torch, "compile", _as_region),
            mock.patch.object(attention, "block_sparse_attention", sparse),
        ):
            counts = {
                shape: _count(*shape, overrides or {}, top)
                for shape in dict.fromkeys([(1, 1), (2, 1), (1, 2), own])
            }
    finally:
        torch.set_num_threads(threads)
    base, step = counts[(1, 1)], counts[own]
    return OpCount(
        drafter=(overrides or {}).get("drafter", "dflash"),
        layers=own[0],
        sequences=own[1],
        step=step,
        per_layer=counts[(2, 1)].launching - base.launching,
        per_sequence=counts[(1, 2)].launching - base.launching,
        per_layer_outside=counts[(2, 1)].outside_regions - base.outside_regions,
        per_sequence_outside=counts[(1, 2)].outside_regions - base.outside_regions,
        optimizer=step.parts.get("optimizer", 0),
        seconds=time.perf_counter() - start,
    )


def _count(layers: int, sequences: int, overrides: dict, top: int) -> StepOps:
    """One warm-up step, then the operations of one step, of a trainer of `layers` at `sequences`."""
    scale, device = SCALES[SCALE], torch.device("cpu")
    config = qwen3_config(scale, scale.target["num_hidden_layers"])
    info = target_info_from_config(config, Path(f"qwen3-{SCALE}"))  # a label: nothing is read from it
    fields = dict(
        target_model=str(info.path),
        device=device.type,
        num_draft_layers=layers,
        num_anchors=scale.num_anchors,
        block_size=scale.block_size,
        max_seq_len=scale.max_seq_len,
        tokens_per_batch=sequences * scale.max_seq_len,
        drafter_chunk_tokens=scale.num_anchors * scale.block_size,  # one sequence per chunk
    )
    cfg = TrainConfig(**{**fields, **overrides})
    if cfg.target_topk:
        raise ValueError(f"op count: --drafter {cfg.drafter} trains on soft targets, which the count has not")
    config_class = FAMILIES[cfg.drafter][0]
    taps = default_target_layer_ids(info.num_layers)
    c = drafter_config_for(
        info, layers, taps, scale.mask_token_id, scale.block_size, config_class, config_class.run_values(cfg)
    )
    # the execution a GPU's plan picks where it has room: the fastest the settings allow there, set up as
    # on CUDA (its compiled regions)
    execution = executions(cfg, torch.device("cuda"), cfg.drafter_chunk_tokens)[0]
    trainer = build_trainer(cfg, c, execution, device)
    configure_execution(trainer.drafter, execution, torch.device("cuda"))
    _as_on_cuda(trainer)
    batch = random_batch(scale, sequences, seed=1)
    g = torch.Generator().manual_seed(2)
    width = len(c.target_layer_ids) * c.hidden_size
    features = torch.randn(*batch.input_ids.shape, width, generator=g).to(torch.bfloat16)
    trainer.step([(batch, features, 0)])
    counter = OpCounter()
    trainer.timer = counter
    with counter:
        trainer.step([(batch, features, 0)])
    parts = {part: sum(ops.values()) for part, ops in counter.launching.items()}
    device_ops = sum((ops for part, ops in counter.launching.items() if part != BLOCKS), Counter())
    fused = sum(sum(ops.values()) for part, ops in counter.fused.items() if part != BLOCKS)
    launching = sum(n for part, n in parts.items() if part != BLOCKS)
    return StepOps(
        dispatched=sum(sum(ops.values()) for ops in counter.counts.values()),
        launching=launching,
        outside_regions=launching - fused,
        parts=parts,
        top=device_ops.most_common(top),
    )


def _as_on_cuda(trainer: DrafterTrainer) -> None:
    """Set a CPU trainer to dispatch what it would on CUDA, where that is a setting (module docstring)."""
    if not callable(getattr(trainer, "_autocast", None)):  # a renamed hook would silently count fp32
        raise AttributeError("DrafterTrainer has no _autocast to set to bf16: update op_count._as_on_cuda")
    trainer._autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    trainer.head.to(dtype=torch.bfloat16)
    trainer.casts_weights_once = True
    # the loss's pieces compiled, as the trainer sets them on CUDA (`LossSettings.compile_backend`)
    loss = replace(trainer.settings.loss, compile_backend=REGIONS)
    trainer.settings = replace(trainer.settings, loss=loss)
    if hasattr(trainer.optimizer, "ortho_dtype"):  # Muon: torch's own iterations, in bf16
        trainer.optimizer.ortho_dtype = torch.bfloat16
    if hasattr(trainer.optimizer, "grouped"):  # Muon: same-shaped matrices orthogonalised together
        trainer.optimizer.grouped = True
    for group in trainer.optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True  # what None means for CUDA tensors


def run_gpu_shapes(args) -> dict:
    """`bench --gpu`: the device's figures (gpu_shapes.run), then the operations one drafter step dispatches,
    counted on the CPU at the fixed tiny shape; last, so that nothing measured on the device is lost if the
    count fails. Both are printed and written to OUT/gpu_shapes.json."""
    figures = run_on_device(args)
    # the execution the device's figures were measured with, where the flags chose one
    chosen = {"recompute": args.recompute, "loss_chunk_size": args.loss_chunk_size}
    count = count_step_ops({k: v for k, v in chosen.items() if v not in ("auto", 0)})
    figures["op_count"] = count.as_dict()
    (Path(args.out) / "gpu_shapes.json").write_text(json.dumps(figures, indent=1) + "\n")
    for line in count.lines():
        print("  " + line)
    return figures
