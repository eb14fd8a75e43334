"""Which split of the job's processes trains fastest, from rates measured on the user's data and hardware.

`--plan --calibrate` times a few batches of the real schedule through one target rank's work (the
truncated target) and through one drafter rank's work (a training step on a fresh drafter), each in
sequences per second, and predicts every split of W processes into T target and M drafter ranks:

    sequences/s          = min(T x target_rate, M x drafter_rate)
    drafter wait         = 1 - sequences/s / (M x drafter_rate)
    target idle          = 1 - sequences/s / (T x target_rate)

With `--target_tp_size N` the target unit is a group of N ranks: its rate is measured on the group itself
(every rank of group 0 runs the sharded forward together), T counts ranks in multiples of N, and T x
target_rate above reads (T / N) x group_rate. The drafter's side is then timed on features drawn at random
in the target's shape (a training step's time does not depend on their values: the drafter leader cannot
hold a target that needs a group).

Drafter ranks are counted as scaling linearly: the per-step gradient all-reduce among them is not
modelled (its size is printed), so with M > 1 the prediction is an upper bound. The hidden-state channel
is not modelled either (it runs at the speed of raw sends, see docs/benchmarks.md). Among the splits within 2% of the
best, the one with the fewest processes wins; the processes it leaves out sit idle.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dflash_ddp.data.batch import Batch, SoftTargets
from dflash_ddp.data.dataset import TokenizedDataset
from dflash_ddp.data.schedule import BatchSchedule
from dflash_ddp.drafter.trainer import DrafterTrainer
from dflash_ddp.target_model.features import TargetFeatureExtractor

TIMED_STEPS = 3


TIE_TOLERANCE = 0.02  # splits this close to the best count as equal; the one with fewer processes wins


def warmup_steps(device: torch.device) -> int:
    """Untimed steps first: the first call pays for allocations and lazy initialisation; on CUDA it also
    compiles the flex attention kernel, and one more step keeps the allocator's growth out of the timing."""
    return 2 if device.type == "cuda" else 1


def calibration_steps(device: torch.device) -> int:
    """All optimizer steps of a calibration: the untimed ones, then TIMED_STEPS."""
    return warmup_steps(device) + TIMED_STEPS


@dataclass(frozen=True)
class Rates:
    """Sequences per second of one target unit (a rank, or a tensor-parallel group) and of one drafter
    rank, each on its own devices."""

    target: float
    drafter: float


@dataclass(frozen=True)
class SplitPrediction:
    """The predicted throughput of T target + M drafter ranks out of W processes (W = 1: colocated)."""

    world_size: int
    target_ranks: int
    drafter_ranks: int
    sequences_per_s: float
    drafter_wait: float  # fraction of the drafter ranks' time spent waiting for features
    target_idle: float  # fraction of the target ranks' time spent with nothing to compute (blocked sends)
    tp_size: int = 1  # target ranks per group

    @property
    def colocated(self) -> bool:
        return self.world_size == 1

    @property
    def processes(self) -> int:
        """Processes the split uses (one when colocated)."""
        return 1 if self.colocated else self.target_ranks + self.drafter_ranks

    @property
    def idle_ranks(self) -> list[int]:
        """Ranks of the W processes the split leaves out (a job of T + M processes uses ranks 0..T+M-1)."""
        return list(range(self.processes, self.world_size))


def predict(
    world_size: int, target_ranks: int, drafter_ranks: int, rates: Rates, tp_size: int = 1
) -> SplitPrediction:
    """The throughput and idle fractions of one split; world size 1 runs target and drafter in turn.
    `target_ranks` come in groups of `tp_size`, each group one unit of `rates.target`."""
    if world_size == 1:
        rate = 1.0 / (1.0 / rates.target + 1.0 / rates.drafter)
        # the drafter waits while the target computes, and the other way round
        return SplitPrediction(1, 1, 1, rate, rate / rates.target, rate / rates.drafter)
    if (
        target_ranks < 1
        or drafter_ranks < 1
        or target_ranks + drafter_ranks > world_size
        or target_ranks % tp_size
    ):
        raise ValueError(
            f"{target_ranks} (groups of {tp_size}) + {drafter_ranks} ranks is not a split of {world_size} processes"
        )
    targets, drafters = target_ranks // tp_size * rates.target, drafter_ranks * rates.drafter
    rate = min(targets, drafters)
    return SplitPrediction(
        world_size, target_ranks, drafter_ranks, rate, 1 - rate / drafters, 1 - rate / targets, tp_size
    )


def candidate_splits(world_size: int, rates: Rates, tp_size: int = 1) -> list[SplitPrediction]:
    """Every split T + M <= W with T a positive multiple of `tp_size` and M >= 1 (the colocated run alone
    for W = 1)."""
    if world_size == 1:
        return [predict(1, 1, 1, rates)]
    return [
        predict(world_size, t, used - t, rates, tp_size)
        for used in range(2, world_size + 1)
        for t in range(tp_size, used, tp_size)
    ]


def recommend(world_size: int, rates: Rates, tp_size: int = 1) -> SplitPrediction:
    """The fastest split of W processes; within TIE_TOLERANCE of it, the one using the fewest processes."""
    splits = candidate_splits(world_size, rates, tp_size)
    best = max(s.sequences_per_s for s in splits)
    close = [s for s in splits if s.sequences_per_s >= (1 - TIE_TOLERANCE) * best]
    return min(close, key=lambda s: (s.processes, -s.sequences_per_s, s.drafter_ranks))


@dataclass(frozen=True)
class Measurement:
    """What the timed steps saw."""

    rates: Rates
    batches: int  # timed batches (each went through both sides)
    sequences: int
    target_s: float  # seconds in the target's forward, over the timed batches
    drafter_s: float  # seconds in the drafter's training steps


def calibration_batches(
    data: TokenizedDataset, tokens_per_batch: int, seed: int, accumulation: int, pad_id: int, steps: int
) -> Iterator[tuple[Batch, int]]:
    """(batch, epoch) pairs for `steps` optimizer steps: the first global batches of the run's own schedule."""
    schedule = BatchSchedule(data.lengths, tokens_per_batch, seed, accumulation, steps)
    return ((data.batch(item.members, pad_id), item.epoch) for item in schedule)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time them, not their launch
        torch.cuda.synchronize(device)


def _forward_steps(
    batches: Iterator[tuple[Batch, int]], extractor, accumulation: int
) -> Iterator[tuple[bool, list[tuple], float]]:
    """Per optimizer step of a calibration: whether it is timed (after the untimed warm-up steps), its
    `accumulation` (batch, features, epoch, soft targets) micro-batches, and the seconds their target
    forwards took."""
    device = extractor.device
    for step in range(calibration_steps(device)):
        micro_batches, target_s = [], 0.0
        for _ in range(accumulation):
            batch, epoch = next(batches)
            start = time.perf_counter()
            features, soft = extractor(batch.input_ids.to(device), batch.attention_mask.to(device))
            _synchronize(device)
            target_s += time.perf_counter() - start
            micro_batches.append((batch, features, epoch, soft))
        yield step >= warmup_steps(device), micro_batches, target_s


def _sequences(micro_batches) -> int:
    return sum(len(batch.sample_ids) for batch, *_ in micro_batches)


def measure_rates(
    batches: Iterator[tuple[Batch, int]],
    extractor: TargetFeatureExtractor | RandomFeatures,
    trainer: DrafterTrainer,
    accumulation: int,
) -> Measurement:
    """Time calibration_steps() optimizer steps of `accumulation` (batch, epoch) pairs each: every
    batch through the target's forward, then each step's batches through the drafter's training step.

    Both sides see the same batches, so the ratio of their rates does not depend on which were drawn."""
    target_s = drafter_s = 0.0
    sequences = timed_batches = 0
    for timed, micro_batches, step_target_s in _forward_steps(batches, extractor, accumulation):
        start = time.perf_counter()
        trainer.step(micro_batches)
        _synchronize(extractor.device)
        if timed:
            drafter_s += time.perf_counter() - start
            target_s += step_target_s
            sequences += _sequences(micro_batches)
            timed_batches += accumulation
    rates = Rates(target=sequences / target_s, drafter=sequences / drafter_s)
    return Measurement(rates, timed_batches, sequences, target_s, drafter_s)


class RandomFeatures:
    """The target's stand-in on a drafter leader timing its steps for a target that needs a group:
    features of the target's width (and `topk` soft targets over `vocab_size` tokens) drawn at random (a
    step's time does not depend on their values)."""

    def __init__(
        self, width: int, device: torch.device, dtype: torch.dtype, topk: int = 0, vocab_size: int = 0
    ):
        self.width, self.device, self.dtype = width, device, dtype
        self.topk, self.vocab_size = topk, vocab_size
        self.generator = torch.Generator(device=device).manual_seed(0)

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, SoftTargets | None]:
        shape = (*input_ids.shape, self.width)
        features = torch.randn(shape, generator=self.generator, device=self.device, dtype=self.dtype)
        soft = None
        if self.topk:
            top = (*input_ids.shape, self.topk)
            ids = torch.randint(self.vocab_size, top, generator=self.generator, device=self.device)
            soft = SoftTargets(
                ids.int(), torch.full(top, 1 / self.topk, dtype=torch.bfloat16, device=self.device)
            )
        return features * attention_mask[..., None].to(self.dtype), soft


def time_target_forward(
    batches: Iterator[tuple[Batch, int]], extractor: TargetFeatureExtractor, accumulation: int
) -> tuple[int, float]:
    """(sequences, seconds) of the target's forward over the timed steps of a calibration: the same batches
    and the same untimed steps as `measure_rates`, run by every rank of a tensor-parallel group."""
    sequences, seconds = 0, 0.0
    for timed, micro_batches, target_s in _forward_steps(batches, extractor, accumulation):
        if timed:
            sequences += _sequences(micro_batches)
            seconds += target_s
    return sequences, seconds


def planning_world(world_size: int, device: torch.device) -> int:
    """The number of processes to plan a split for: this launch's, or for a single process the GPUs of
    this machine (on a CPU, 8: the README's default launch), since one process has no split to choose."""
    if world_size > 1:
        return world_size
    return torch.cuda.device_count() if device.type == "cuda" else 8


def _describe(split: SplitPrediction) -> str:
    return (
        f"{split.sequences_per_s:,.2f} sequences/s, drafter waits {100 * split.drafter_wait:.0f}%, "
        f"targets idle {100 * split.target_idle:.0f}%"
    )


def _groups(split: SplitPrediction) -> str:
    groups = split.target_ranks // split.tp_size
    return f"{groups} group{'s' if groups > 1 else ''} of {split.tp_size}"


def _split(split: SplitPrediction) -> str:
    grouped = f" ({_groups(split)})" if split.tp_size > 1 else ""
    return f"{split.target_ranks}{grouped} + {split.drafter_ranks}"


def global_batch_note(drafter_ranks: int, recommended: int, accumulation: int) -> list[str]:
    """What another number of drafter ranks does to the step (nothing when it is the same): each drafter rank
    trains `accumulation` batches of --tokens_per_batch a step, so the global batch grows with the ranks."""
    now, then = drafter_ranks * accumulation, recommended * accumulation
    if now == then:
        return []
    keep = (
        f"--gradient_accumulation_steps {now // recommended}"
        if now % recommended == 0
        else f"--tokens_per_batch x {now}/{then}"
    )
    return [
        f"  global batch: a step takes drafter ranks x --gradient_accumulation_steps batches: {now} now, {then} "
        f"with {recommended} drafter ranks, another recipe (fewer steps an epoch; the learning rate may want "
        f"tuning); to keep {now} a step with {recommended} drafter ranks pass {keep}"
    ]


def report(
    measurement: Measurement,
    world_size: int,
    device: torch.device,
    drafter_ranks: int,
    allreduce_bytes: int,
    tp_size: int = 1,
    accumulation: int = 1,
) -> list[str]:
    """The lines `--plan --calibrate` prints: the measured rates, the splits of the planning world with
    their predictions, then `recommended split: T target ranks + M drafter ranks`, what it does to the
    global batch (drafter ranks x `accumulation` batches a step) and the idle ranks."""
    m, rates = measurement, measurement.rates
    unit = "one target rank: " if tp_size == 1 else f"one target group ({tp_size} ranks, tensor-parallel):"
    lines = [
        f"calibration on {device}: {warmup_steps(device)} untimed + {TIMED_STEPS} timed optimizer steps "
        f"({m.batches} batches, {m.sequences} sequences of the schedule)",
        f"  {unit} {rates.target:,.2f} sequences/s (truncated target forward, {m.target_s:.2f} s)",
        f"  one drafter rank: {rates.drafter:,.2f} sequences/s (training step, {m.drafter_s:.2f} s); the "
        f"gradient all-reduce between 2+ drafter ranks ({allreduce_bytes / 2**20:,.1f} MiB per step) is not modelled",
    ]
    world = planning_world(world_size, device)
    if world_size == 1:
        colocated = predict(1, 1, 1, rates)
        lines.append(f"  this launch, colocated (target and drafter take turns): {_describe(colocated)}")
    if device.type == "cpu":
        lines.append(
            "  (on a CPU the splits below assume each rank a machine like this one; ranks started on this one "
            "share its cores)"
        )
    best = recommend(world, rates, tp_size)
    if best.colocated:
        lines.append("recommended split: colocated (one device: there is no split to choose)")
        return lines
    lines.append(
        f"  splits of {world} processes"
        + (":" if world_size > 1 else f" (torchrun --nproc-per-node {world}):")
    )
    shown = [s for s in candidate_splits(world, rates, tp_size) if s.processes == world]
    if best.processes < world:
        shown.append(best)
    for s in shown:
        notes = ["recommended"] if s == best else []
        if world_size > 1 and s.processes == world and s.drafter_ranks == drafter_ranks:
            notes.append("this launch")
        mark = f"  <- {', '.join(notes)}" if notes else ""
        lines.append(f"    {_split(s)}: {_describe(s)}{mark}")
    groups = f" ({_groups(best)}, tensor-parallel)" if tp_size > 1 else ""
    flag = f" --target_tp_size {tp_size}" if tp_size > 1 else ""
    lines.append(
        f"recommended split: {best.target_ranks} target ranks + {best.drafter_ranks} drafter ranks{groups} "
        f"(torchrun --nproc-per-node {best.processes} ... --drafter_ranks {best.drafter_ranks}{flag}): "
        f"{_describe(best)}"
    )
    lines += global_batch_note(drafter_ranks, best.drafter_ranks, accumulation)
    idle = best.idle_ranks
    if idle:
        which = f"rank {idle[0]}" if len(idle) == 1 else f"ranks {idle[0]}-{idle[-1]}"
        lines.append(
            f"  idle: {which} of {world} (using {'it' if len(idle) == 1 else 'them'} gains under "
            f"{100 * TIE_TOLERANCE:.0f}%): free {'it' if len(idle) == 1 else 'them'} for other work"
        )
    else:
        lines.append(f"  idle: none of the {world} processes")
    return lines
