"""The operations one drafter step dispatches (bench/op_count.py), held under a ceiling: on a GPU each is a
kernel launch or more, and the drafter's step is launch-bound, so a change that multiplies them fails here,
before it reaches a GPU."""

from __future__ import annotations

import pytest
import torch

from dflash_ddp.bench.op_count import count_step_ops, launches

# Today's figures plus about 5% (2026-12-04: 1599 launching ops per step at 2 layers x 2 sequences, 299 per
# layer, 431 per sequence, with nothing recomputed, the execution a GPU with room runs; 1939, 382 and 518
# recomputing q/k/v and the MLP; the fused LM-head loss since: 1593, 299 and 428; 2026-12-07, the matrices
# cast once a step as on CUDA: 1587, 299, 424). Outside the regions CUDA compiles (what it launches one by one):
# DFlash 535 per step, 42 per layer (the layer's weight casts and its optimizer step), 155 per sequence;
# DFlash2 781, 54 and 244 since its convolutions and MLP half compile with the rest (2,055, 373 and 562 when
# only its projections did). Lower them when a change launches fewer; raise them only with the reason.
CEILINGS = {"per step": 1665, "per layer": 315, "per sequence": 445}
OUTSIDE_CEILINGS = {
    "dflash": {"per step": 560, "per layer": 45, "per sequence": 165},
    "dflash2": {"per step": 820, "per layer": 57, "per sequence": 256},
}
HOW = (
    "a change that multiplies the kernels a drafter step launches must be justified (on an H200 the step is "
    "bound by launching thousands of small kernels; docs/benchmarks.md). Re-measure with `python -m "
    "dflash_ddp.bench --gpu --scale tiny` (its 'op count' lines) and set the ceiling in this test to the new "
    "figure + 5% only with the reason in docs/LOG.md"
)


@pytest.fixture(scope="module")
def counts():
    """Two counts of the same step (about five seconds each)."""
    return count_step_ops(), count_step_ops()


def outside_figures(count) -> dict[str, int]:
    return {
        "per step": count.step.outside_regions,
        "per layer": count.per_layer_outside,
        "per sequence": count.per_sequence_outside,
    }


def test_ops_per_step_stay_under_their_ceilings(counts):
    count = counts[0]
    figures = {
        "per step": count.step.launching,
        "per layer": count.per_layer,
        "per sequence": count.per_sequence,
    }
    for name, value in figures.items():
        assert value <= CEILINGS[name], (
            f"launching ops {name} grew to {value} (ceiling {CEILINGS[name]}; by part of the step "
            f"{count.step.parts}, top {count.step.top[:5]}): {HOW}"
        )


def test_op_counts_are_positive_and_reproducible(counts):
    first, second = counts
    assert first.per_layer > 0 and first.per_sequence > 0 and first.optimizer > 0
    assert first.step.dispatched > first.step.launching > first.per_layer + first.per_sequence
    assert (first.layers, first.sequences) == (2, 2)
    assert first.step.launching == sum(n for part, n in first.step.parts.items() if part != "blocks")
    same = ("step", "per_layer", "per_sequence", "optimizer")
    assert [getattr(first, f) for f in same] == [getattr(second, f) for f in same]
    # counted as CUDA runs the step: under bf16 autocast, whose casts are kernels (no-ops in fp32)
    top = dict(first.step.top)
    assert top.get("_to_copy", 0) > 0, top


def test_views_allocations_and_host_reads_launch_nothing():
    aten = torch.ops.aten
    for op in (aten.view.default, aten.transpose.int, aten.split.Tensor, aten.detach.default):
        assert not launches(op), op
    for op in (aten.empty.memory_format, aten._unsafe_view.default, aten._local_scalar_dense.default):
        assert not launches(op), op
    for op in (aten.mm.default, aten._to_copy.default, aten.copy_.default, aten.add_.Tensor, aten.mm.out):
        assert launches(op), op


@pytest.mark.parametrize("family", sorted(OUTSIDE_CEILINGS))
def test_what_cuda_launches_one_by_one_stays_under_its_ceilings(family, counts):
    """Outside the regions CUDA compiles (the layers' chains around attention, attention itself, the loss's
    pieces) every operation is a kernel launch of its own: a layer adds only its weight casts and its share of
    the optimizer there, for DFlash and for DFlash2 (whose convolutions and MLP half compile with the rest)."""
    count = counts[0] if family == "dflash" else count_step_ops({"drafter": family})
    assert count.drafter == family
    for name, value in outside_figures(count).items():
        assert value <= OUTSIDE_CEILINGS[family][name], (
            f"{family}: launching ops outside the compiled regions {name} grew to {value} (ceiling "
            f"{OUTSIDE_CEILINGS[family][name]}): an operation moved out of a compiled region or a new one runs "
            f"eagerly beside them. {HOW}"
        )


def test_layers_that_recompute_run_outside_the_compiled_regions(counts):
    """Recomputing q/k/v and the MLP (the execution for a GPU short of memory), the layers run eagerly on CUDA
    too: their operations count outside the regions, and the regions' figure is what keeping them saves."""
    kept = counts[0]
    recomputing = count_step_ops({"recompute": "qkv_mlp"})
    assert recomputing.per_layer_outside > 5 * kept.per_layer_outside
    assert recomputing.per_layer_outside <= recomputing.per_layer
    assert kept.step.outside_regions < kept.step.launching


def test_bench_gpu_counts_the_execution_its_flags_chose(tmp_path, monkeypatch):
    """`bench --gpu --recompute qkv_mlp` counts the recomputing step it timed, not the default one."""
    from types import SimpleNamespace

    from dflash_ddp.bench import op_count

    asked = []

    class Count:
        def as_dict(self):
            return {}

        def lines(self):
            return []

    monkeypatch.setattr(op_count, "run_on_device", lambda args: {})
    monkeypatch.setattr(op_count, "count_step_ops", lambda overrides=None: asked.append(overrides) or Count())
    for recompute, chunk in (("auto", 0), ("qkv_mlp", 0), ("none", 512)):
        op_count.run_gpu_shapes(
            SimpleNamespace(out=str(tmp_path), recompute=recompute, loss_chunk_size=chunk)
        )
    assert asked == [{}, {"recompute": "qkv_mlp"}, {"recompute": "none", "loss_chunk_size": 512}]
