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
- one sequence per drafter chunk, as the recipe's 512 anchors x 16 fill its 8192-position chunks.

What differs from CUDA: the attention is the path the trainer resolves on the CPU ("sparse": a loop of
matmuls and softmax pieces per anchor chunk) where CUDA runs flex (a few compiled kernels); `--optimizer
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
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_ddp.config import TrainConfig
from dflash_ddp.drafter.config import DFlashDraftConfig, default_target_layer_ids, drafter_config_for
from dflash_ddp.drafter.trainer import DrafterTrainer
from dflash_ddp.setup.plan import executions
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

# (cfg, drafter config, device) -> trainer; the default is gpu_shapes.build_trainer without checkpointing
# unless the config asks for it (the plan leaves it off at both scales)
Builder = Callable[[TrainConfig, DFlashDraftConfig, torch.device], DrafterTrainer]


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
        self._part = OTHER

    @contextlib.contextmanager
    def part(self, name: str):
        """Count the enclosed operations under `name`."""
        outer, self._part = self._part, name
        try:
            yield
        finally:
            self._part = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[self._part][name] += 1
        if launches(func):
            self.launching[self._part][name] += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class StepOps:
    """The operations of one step at one shape."""

    dispatched: int  # every aten operation, views and the blocks' host work included
    launching: int  # those that would launch device work, outside the blocks
    parts: dict[str, int]  # launching operations per part of the step (blocks: host work on a GPU)
    top: list[tuple[str, int]]  # the most frequent launching operations outside the blocks


@dataclass(frozen=True)
class OpCount:
    """`count_step_ops`' figures: the step at the scale's own depth and batch, and what a layer, a sequence
    and the optimizer add to it."""

    layers: int
    sequences: int
    step: StepOps
    per_layer: int  # launching operations one more drafter layer adds (at one sequence)
    per_sequence: int  # ... one more sequence adds (at one layer)
    optimizer: int  # launching operations of the optimizer part of the step
    seconds: float  # to count all of it

    def lines(self) -> list[str]:
        """One line of figures, one of the top operations."""
        step = self.step
        top = ", ".join(f"{name} {n:,}" for name, n in step.top[:5])
        return [
            f"op count (CPU, fixed {SCALE} shape as CUDA would dispatch it, {self.layers} layers x "
            f"{self.sequences} sequences): {step.launching:,} launching ops per step ({step.dispatched:,} "
            f"dispatched), per layer {self.per_layer:,}, per sequence {self.per_sequence:,}, optimizer "
            f"{self.optimizer:,} ({self.seconds:.1f} s to count)",
            f"op count, top: {top}",
        ]

    def as_dict(self) -> dict:
        """The figures as JSON-ready values."""
        return asdict(self)


def count_step_ops(overrides: dict | None = None, build: Builder | None = None, top: int = 10) -> OpCount:
    """Count the operations one `DrafterTrainer.step` dispatches at the fixed tiny shape (module docstring).

    Four trainers run one warm-up step (the first creates the optimizer's state), then one counted step:
    (1 layer, 1 sequence), (2 layers, 1 sequence), (1 layer, 2 sequences) and the scale's own (2, 2).
    per_layer = c(2, 1) - c(1, 1) and per_sequence = c(1, 2) - c(1, 1), in launching operations. The
    optimizer's operations are those inside the trainer's "optimizer" part (clipping, the optimizer's and the
    schedule's steps, dropping the gradients), found by standing an OpCounter in for the trainer's timer.

    `overrides`: TrainConfig fields over the shape's and the defaults (Muon; e.g. {"optimizer": "adamw"}, or a
    future execution setting); `build(cfg, drafter_config, device)`: the trainer, by default as gpu_shapes
    builds it. `top`: how many of the most frequent operations to keep."""
    start = time.perf_counter()
    scale = SCALES[SCALE]
    own = (scale.draft_layers, scale.tokens_per_batch // scale.max_seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # counts do not depend on threads; one keeps a shared machine's cores free
    try:
        counts = {
            shape: _count(*shape, overrides or {}, build or _default_build, top)
            for shape in dict.fromkeys([(1, 1), (2, 1), (1, 2), own])
        }
    finally:
        torch.set_num_threads(threads)
    base = counts[(1, 1)].launching
    step = counts[own]
    return OpCount(
        layers=own[0],
        sequences=own[1],
        step=step,
        per_layer=counts[(2, 1)].launching - base,
        per_sequence=counts[(1, 2)].launching - base,
        optimizer=step.parts.get("optimizer", 0),
        seconds=time.perf_counter() - start,
    )


def _default_build(cfg: TrainConfig, c: DFlashDraftConfig, device: torch.device) -> DrafterTrainer:
    # the execution a GPU's plan picks where it has room: the fastest the settings allow there
    execution = executions(cfg, torch.device("cuda"), cfg.drafter_chunk_tokens)[0]
    return build_trainer(cfg, c, execution, device)


def _count(layers: int, sequences: int, overrides: dict, build: Builder, top: int) -> StepOps:
    """One warm-up step, then the operations of one step, of a trainer of `layers` at `sequences`."""
    scale, device = SCALES[SCALE], torch.device("cpu")
    config = qwen3_config(scale, scale.target["num_hidden_layers"])
    info = target_info_from_config(config, Path(f"qwen3-{SCALE}"))  # a label: nothing is read from it
    taps = default_target_layer_ids(info.num_layers)
    c = drafter_config_for(info, layers, taps, scale.mask_token_id, scale.block_size)
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
    trainer = build(TrainConfig(**{**fields, **overrides}), c, device)
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
    return StepOps(
        dispatched=sum(sum(ops.values()) for ops in counter.counts.values()),
        launching=sum(n for part, n in parts.items() if part != BLOCKS),
        parts=parts,
        top=device_ops.most_common(top),
    )


def _as_on_cuda(trainer: DrafterTrainer) -> None:
    """Set a CPU trainer to dispatch what it would on CUDA, where that is a setting (module docstring)."""
    if not callable(getattr(trainer, "_autocast", None)):  # a renamed hook would silently count fp32
        raise AttributeError("DrafterTrainer has no _autocast to set to bf16: update op_count._as_on_cuda")
    trainer._autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    trainer.head.to(dtype=torch.bfloat16)
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
    count = count_step_ops()
    figures["op_count"] = count.as_dict()
    (Path(args.out) / "gpu_shapes.json").write_text(json.dumps(figures, indent=1) + "\n")
    for line in count.lines():
        print("  " + line)
    return figures
