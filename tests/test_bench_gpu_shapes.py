"""The Qwen3-8B-shaped benchmark (`python -m dflash_ddp.bench --gpu`) at its tiny scale on the CPU, and its
FLOP formulas against torch's own FLOP counter."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dflash_ddp.bench.flops import draft_work, drafter_flops, target_forward_flops
from dflash_ddp.bench.gpu_shapes import SCALES, add_arguments, build_target, qwen3_config
from dflash_ddp.bench.op_count import run_gpu_shapes as run
from dflash_ddp.data.batch import Batch
from dflash_ddp.drafter.attention import dense_block_mask
from dflash_ddp.drafter.blocks import sample_anchors
from dflash_ddp.drafter.objective import block_loss_terms
from dflash_ddp.drafter.trainer import DrafterTrainer, OptimizerSettings, StepSettings, build_drafter
from dflash_ddp.drafter.weighting import LossSettings
from dflash_ddp.target_model.features import tapped_features
from dflash_ddp.target_model.head import SharedTargetHead

from helpers import small_draft_config


def _addmm_(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def count_flops(fn) -> dict[str, int]:
    """FLOPs of fn() by aten op. SDPA runs as its math decomposition, so its matmuls are counted (bmm), and
    the in-place addmm_ of the MLP's backward, which the counter does not know, counts like addmm."""
    mapping = {torch.ops.aten.addmm_: _addmm_}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _two_rows(c, lengths=(40, 33)):
    """Two sequences of different lengths (the second padded), response from position 8 on."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size - 1, (2, max(lengths)), generator=g)
    attention = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        attention[row, :length] = 1
    loss = attention.clone()
    loss[:, :8] = 0
    features = torch.randn(2, max(lengths), len(c.target_layer_ids) * c.hidden_size, generator=g)
    return Batch(ids, attention, loss, torch.tensor([0, 1])), features * attention[..., None]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_drafter_flops_match_torch_flop_counter(checkpointing, one_thread):
    c = small_draft_config()
    L, h, d = c.num_hidden_layers, c.num_attention_heads, c.head_dim
    g = torch.Generator().manual_seed(1)
    head = SharedTargetHead(*(torch.randn(c.vocab_size, c.hidden_size, generator=g) for _ in range(2)))
    drafter = build_drafter(c, 0, torch.device("cpu"))
    drafter.gradient_checkpointing = checkpointing
    settings = StepSettings(6, 0, 1.0, "dense", 8192, LossSettings(chunk_rows=16))
    trainer = DrafterTrainer(drafter, head, settings, OptimizerSettings(1e-3, 0.0, 0.0, 10))
    batch, features = _two_rows(c)
    work = draft_work(batch, settings, c.block_size, epoch=0)
    formula = drafter_flops(c, work, checkpointing)

    # the allowed (query, key) pairs, counted independently: the reference mask's True entries
    anchors = [sample_anchors(batch.loss_mask[b, :n], 6, 0, 0, b) for b, n in enumerate((40, 33))]
    assert [a.numel() for a in anchors] == [6, 6]  # no padding slots: the dense path computes no more
    padded = torch.stack(anchors)
    assert work.allowed == int(dense_block_mask(padded, 40, c.block_size).sum())
    assert work.positions == 2 * 6 * c.block_size and work.context_tokens == 2 * 40
    dense_pairs = 2 * (6 * c.block_size) * (40 + 6 * c.block_size)  # what the dense path computes, per head

    # forward only: every matmul of the formula's forward, nothing else
    chunk = trainer._chunks(batch, features, 0)[0]

    def forward():
        with torch.no_grad():
            embeds = head.embed_tokens(chunk.inputs.block_ids)
            out = drafter(embeds, chunk.features, chunk.inputs.position_ids, chunk.mask).last_hidden_state
            block_loss_terms(out, head.lm_head_weight, chunk.inputs, LossSettings(chunk_rows=16))

    counted = count_flops(forward)
    weights = sum(v for k, v in formula.forward.items() if k != "attention")
    assert counted["mm"] == weights, (counted, formula.forward)
    assert counted["bmm"] == 4 * L * h * d * dense_pairs

    # forward + backward of a whole step: the executed count, its attention part by the dense closed form
    # (the math path keeps its scores: no recomputed scores; 2 products forward, 4 backward)
    counted = count_flops(lambda: trainer.step([(batch, features, 0)]))
    matmuls = counted["mm"] + counted.get("addmm", 0) + counted.get("addmm_", 0)
    no_scores = formula.recomputed["attention_scores"]
    assert matmuls == pytest.approx(formula.executed - formula.executed_attention, rel=0.01), counted
    assert counted["bmm"] == (12 + 4 * checkpointing) * L * h * d * dense_pairs
    assert formula.executed_attention - no_scores == (12 + 4 * checkpointing) * L * h * d * work.allowed
    # model FLOPs: the forward three times where inputs and weights get gradients, twice for fc (no input
    # gradient) and the frozen LM head (no weight gradient)
    f = formula.forward
    assert formula.model == 3 * (f["layers"] + f["context_kv"] + f["attention"]) + 2 * (
        f["fc"] + f["lm_head"]
    )


def test_target_flops_match_torch_flop_counter(one_thread):
    config = qwen3_config(SCALES["tiny"], layers=3)
    model = build_target(config, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 500, (2, 24))
    mask = torch.ones_like(ids)
    counted = count_flops(lambda: tapped_features(model, model.layers, [0, 2], ids, mask))
    heads = config.num_attention_heads * config.head_dim
    full_attention = 3 * 4 * heads * 2 * 24 * 24  # the math path computes every (query, key) pair
    causal = full_attention * 25 // 48  # S (S + 1) / 2 of S^2 pairs
    assert counted["bmm"] == full_attention
    assert target_forward_flops(config, [24, 24]) == counted["mm"] + causal


def test_tiny_benchmark_writes_its_figures(tmp_path, capsys, one_thread):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "--peak_tflops" in parser.format_help()  # its help texts format (a bare % would raise)
    args = parser.parse_args(
        ["--scale", "tiny", "--device", "cpu", "--out", str(tmp_path), "--target_steps", "1"]
        + ["--drafter_steps", "2", "--peak_tflops", "1", "--profile", "always"]
    )
    figures = run(args)
    assert json.loads((tmp_path / "gpu_shapes.json").read_text()) == json.loads(json.dumps(figures))
    target, drafter, split = figures["target"], figures["drafter"], figures["split"]
    assert target["tokens_per_s"] > 0 and target["sequences"] == 2 and target["layers_run"] == 4
    assert target["flops_per_forward"] > 0 and 0 < target["mfu"] < 1
    assert drafter["step_s"] > 0 and drafter["draft_positions_per_step"] == 2 * 64 * 16
    assert drafter["flops_per_step"]["executed"] > drafter["flops_per_step"]["model"] > 0
    assert 0 < drafter["mfu"] < drafter["hfu"] < 1
    for part in (target, drafter):
        # on the CPU the peak is resident growth: 0 when the process already holds freed memory to reuse
        assert part["peak_gib"] >= 0 and part["predicted_peak_gib"] > 0
    t, m = (int(x) for x in split["recommended"].split(" + "))
    assert t >= 1 and m >= 1 and t + m <= 8
    assert any(line.startswith("recommended split:") for line in split["lines"])
    assert (tmp_path / "profile_drafter_step.txt").is_file()
    assert sum(figures["profile"]["time_shares"].values()) == pytest.approx(1.0, abs=0.01)
    parts = drafter["parts"]
    assert parts["seconds"]["optimizer"] > 0 and sum(parts["shares"].values()) >= 0.99
    assert figures["op_count"]["step"]["launching"] > 0  # its ceilings: test_bench_op_count.py
    printed = capsys.readouterr().out
    assert "draft positions/s" in printed and "recommended split:" in printed
    assert "drafter step by part" in printed and "launching ops per step" in printed
