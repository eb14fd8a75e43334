"""The DFlash2 drafter: its convolutions, its candidate selector (walk and loss), its start as DFlash, its
settings and its serving layout (the z-lab fixtures' names and shapes)."""

import json

import pytest
import torch
import torch.nn.functional as F

from dflash_ddp.config import TrainConfig
from dflash_ddp.drafter.attention import block_layout
from dflash_ddp.drafter.blocks import build_block_inputs
from dflash_ddp.drafter.config import drafter_config_for
from dflash_ddp.drafter.dflash2 import DFlash2DraftConfig, DFlash2DraftModel, DynamicConvolution
from dflash_ddp.drafter.families import build_model
from dflash_ddp.drafter.model import DFlashDraftModel, trainable_state_dict
from dflash_ddp.drafter.optimizer import build_optimizer
from dflash_ddp.drafter.selector import CandidateSelector, selector_terms, walk
from dflash_ddp.drafter.trainer import build_drafter
from dflash_ddp.drafter.weighting import LossSettings
from dflash_ddp.drafter.zlab import from_zlab_config, to_zlab_config, zlab_keys
from dflash_ddp.evaluation.decoding import speculative_generate
from dflash_ddp.serving.export import load_drafter
from dflash_ddp.target_model.info import inspect_target
from dflash_ddp.target_model.loading import load_causal_lm

from helpers import small_draft_config, train_flags

CPU = torch.device("cpu")


def dflash2_config(**overrides) -> DFlash2DraftConfig:
    fields = {"conv_group_size": 8, "conv_kernel_size": 3, "selector_rank": 6, "selector_top_k": 5}
    return DFlash2DraftConfig(**small_draft_config().to_dict(), **{**fields, **overrides})


def randomised(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Every weight random (the identity start would hide what the convolutions and the selector do)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def test_an_untrained_dflash2_drafter_is_the_dflash_drafter_of_the_same_seed():
    dflash = build_drafter(small_draft_config(), 0, CPU)
    dflash2 = build_drafter(dflash2_config(), 0, CPU)
    own = dict(dflash2.named_parameters())
    for name, weight in dflash.named_parameters():  # the backbone, weight for weight
        assert torch.equal(own[name], weight), name
    anchors = torch.tensor([[1, 4, 7], [2, 5, -1]])
    context, positions = 12, torch.arange(12).expand(2, 12)
    blocks = (anchors.clamp(min=0)[:, :, None] + torch.arange(4)).flatten(1)
    inputs = (torch.randn(2, 12, 32), torch.randn(2, 12, 64), torch.cat([positions, blocks], 1))
    layout = block_layout(anchors, context, 4, 4, CPU)
    out, out2 = (m(inputs[0], inputs[1], inputs[2], layout).last_hidden_state for m in (dflash, dflash2))
    assert torch.equal(out, out2)  # identity convolutions: the same outputs, bit for bit


@pytest.fixture(scope="module")
def tiny_causal_lm(tiny_target):
    return load_causal_lm(inspect_target(tiny_target), CPU, torch.float32)


def test_an_untrained_dflash2_drafter_drafts_what_the_dflash_drafter_drafts(tiny_target, tiny_causal_lm):
    info = inspect_target(tiny_target)
    dflash_config = drafter_config_for(info, 2, [1, 3], 3, 4)
    dflash2_config_ = drafter_config_for(
        info, 2, [1, 3], 3, 4, DFlash2DraftConfig, {"selector_top_k": 4, "selector_rank": 8}
    )
    dflash, dflash2 = (build_drafter(c, 5, CPU).eval() for c in (dflash_config, dflash2_config_))
    prompt = [5, 17, 42, 8, 99, 23]
    a = speculative_generate(tiny_causal_lm, dflash, prompt, 40)
    b = speculative_generate(tiny_causal_lm, dflash2, prompt, 40)
    assert a.tokens == b.tokens and a.accepted == b.accepted


def naive_convolution(x, base, delta, taps, group, block):
    """out[i, c] = sum_t (base[t, c] + delta[i, t, c // group]) * x[i - t, c], zero where i - t leaves i's
    block: the engines' formula, one position at a time."""
    out = torch.zeros_like(x)
    for i in range(x.shape[1]):
        for t in range(taps):
            if i % block >= t:
                kernel = base[t] + delta[:, i, t].repeat_interleave(group, dim=-1)
                out[:, i] += kernel * x[:, i - t]
    return out


def test_the_convolution_is_the_engines_formula_and_never_reaches_before_its_block():
    config = dflash2_config(conv_kernel_size=3)
    conv = randomised(DynamicConvolution(config))
    x = torch.randn(2, 3 * config.block_size, 32, requires_grad=True)  # 3 blocks of 4
    side0, deltas = conv.prepare(x)
    assert deltas.shape == (2, 12, 2, 3, 4)  # [B, Q, side, tap, group]: the projection's output order
    expected = naive_convolution(x, conv.base_kernel[0], deltas[:, :, 0], 3, 8, 4)
    torch.testing.assert_close(side0, expected)
    y = torch.randn(2, 12, 32)
    torch.testing.assert_close(
        conv.finish(y, deltas), naive_convolution(y, conv.base_kernel[1], deltas[:, :, 1], 3, 8, 4)
    )
    # the gradient of position 1 of the second block: its own position, the one before, nothing else (its
    # deltas come from its own input; tap 2 would reach into the first block)
    (grad,) = torch.autograd.grad(side0[:, 5].sum(), x)
    touched = grad.abs().sum(dim=(0, 2)) > 0
    assert touched.nonzero().flatten().tolist() == [4, 5]


def engines_walk(selector, hidden, head_weight, anchor, multiplier=1.0, softcap=None):
    """vLLM's score table and walk: score[l, p, c] for every predecessor p of slot l (the anchor for the
    first slot, the previous slot's candidates after), then prev = 0 and the first maximum of row prev."""
    logits = hidden[0, 1:] @ head_weight.T
    values, ids = logits.topk(selector.top_k, dim=-1)
    values = values * multiplier
    if softcap:
        values = torch.tanh(values / softcap) * softcap
    k = selector.top_k
    predecessors = torch.cat([anchor.view(1, 1).expand(1, k), ids[:-1]], dim=0)  # [L, K]
    a = selector.predecessor_codebook[predecessors]  # [L, K, r]
    w = selector.hidden_projection(hidden[0, 1:])  # [L, r]
    b = selector.successor_codebook[ids]  # [L, K, r]
    scores = values[:, None, :] + torch.einsum("lpr,lcr->lpc", a * w[:, None, :], b)
    prev, out = 0, []
    for slot in range(scores.shape[0]):
        row = scores[slot, prev]
        prev = int((row == row.max()).nonzero()[0])
        out.append(int(ids[slot, prev]))
    return out


def test_with_tied_logits_an_untrained_selector_drafts_the_lm_heads_argmax():
    """bf16 logits tie often; topk orders ties as it likes, argmax takes the lowest id: the candidates are
    ordered so that the untrained walk drafts DFlash's token even then."""
    selector = CandidateSelector(32, 50, rank=6, top_k=5)
    selector.reset_parameters(0.02)
    head = torch.nn.Linear(32, 50, bias=False)
    with torch.no_grad():
        head.weight[25:] = head.weight[:25]  # every logit appears twice
    for trial in range(10):
        hidden = torch.randn(1, 6, 32)
        drafted = walk(selector, hidden, head, torch.tensor([[trial]]))
        assert torch.equal(drafted, head(hidden[:, 1:]).argmax(dim=-1))


@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.2, 2.0)])
def test_the_walk_is_the_engines_walk(multiplier, softcap):
    torch.manual_seed(0)
    selector = randomised(CandidateSelector(32, 50, rank=6, top_k=5))
    head = torch.nn.Linear(32, 50, bias=False)
    for trial in range(20):
        hidden, anchor = torch.randn(1, 6, 32), torch.tensor([[trial]])
        ours = walk(selector, hidden, head, anchor, multiplier, softcap)
        assert ours[0].tolist() == engines_walk(selector, hidden, head.weight, anchor, multiplier, softcap)


def loss_inputs(config, labels_in_top_k=True):
    """One sequence's block inputs, the drafter output and a head under which each label's rank is known."""
    torch.manual_seed(1)
    ids = torch.randint(0, 40, (1, 20))
    inputs = build_block_inputs(ids, torch.ones(1, 20), [torch.tensor([2, 9, 14])], 4, 49, LossSettings())
    hidden = torch.randn(1, 12, 32)
    head = torch.randn(50, 32)
    if not labels_in_top_k:
        # every label scores lowest (positive outputs, negative label rows): outside any top 5 of 50 tokens
        hidden = hidden.abs()
        head[inputs.labels.flatten()[inputs.scored]] = -10.0
    return inputs, hidden, head


def reference_selector_loss(drafter, inputs, hidden, head):
    """The selector's K-way CE with teacher-forced predecessors, written out row by row; whether each row's
    pick is the label, and how many picks are not the LM head's best."""
    selector, total, picked, reranked = drafter.candidate_selector, torch.zeros(()), [], 0
    labels = inputs.labels.flatten()
    weights = inputs.weights.flatten()
    rows = hidden.flatten(0, 1)
    for index in inputs.scored.tolist():
        h = rows[index]
        candidates = (h @ head.T).topk(selector.top_k).indices
        scores = selector.scores(
            h[None], (h @ head[candidates].T)[None], candidates[None], labels[index - 1 : index]
        )[0]
        found = labels[index] in candidates.tolist()
        if found:
            rank = candidates.tolist().index(int(labels[index]))
            total = total + weights[index] * F.cross_entropy(scores[None], torch.tensor([rank]))
        picked.append(found and int(candidates[scores.argmax()]) == int(labels[index]))
        reranked += int(scores.argmax()) != 0
    return total, picked, reranked


def test_the_selector_loss_is_the_k_way_ce_with_the_previous_token_teacher_forced():
    drafter = randomised(DFlash2DraftModel(dflash2_config()))
    inputs, hidden, head = loss_inputs(drafter.config)
    settings = LossSettings(weighting="decay", selector_weight=0.5, chunk_rows=4)
    terms = selector_terms(drafter, hidden, head, inputs, settings)
    unary = DFlashDraftModel.loss_terms(drafter, hidden, head, inputs, settings)
    expected, picked, reranked = reference_selector_loss(drafter, inputs, hidden, head)
    torch.testing.assert_close(terms.selector_loss_sum, expected)
    torch.testing.assert_close(terms.loss_sum, unary.loss_sum + 0.5 * expected)
    assert terms.correct_per_pos.sum() == sum(picked)  # the accuracy is the selector's
    assert terms.candidate_hits > 0
    assert terms.reranked == reranked


def test_the_logged_rerank_share_counts_the_selectors_picks_other_than_the_lm_heads_best():
    """0 while the selector drafts as the LM head (an untrained one: its successor codebook is zero); with
    pairwise scores as large as the unary ones, the share of rows whose pick is not the head's best."""
    drafter = DFlash2DraftModel(dflash2_config())
    inputs, hidden, head = loss_inputs(drafter.config)
    assert selector_terms(drafter, hidden, head, inputs, LossSettings()).metrics()["rerank_share"] == 0.0
    randomised(drafter)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.mul_(10.0)
    metrics = selector_terms(drafter, hidden, head, inputs, LossSettings()).metrics()
    _, _, reranked = reference_selector_loss(drafter, inputs, hidden, head)
    assert reranked > 0 and metrics["rerank_share"] == pytest.approx(reranked / inputs.scored.numel())


def test_a_label_outside_the_candidates_adds_no_selector_loss_and_counts_as_wrong():
    drafter = randomised(DFlash2DraftModel(dflash2_config()))
    inputs, hidden, head = loss_inputs(drafter.config, labels_in_top_k=False)
    settings = LossSettings(weighting="decay")
    terms = selector_terms(drafter, hidden, head, inputs, settings)
    unary = DFlashDraftModel.loss_terms(drafter, hidden, head, inputs, settings)
    assert terms.candidate_hits == 0 and terms.selector_loss_sum == 0
    torch.testing.assert_close(terms.loss_sum, unary.loss_sum)
    assert terms.correct_per_pos.sum() == 0 and terms.metrics()["tau_estimate"] == 1.0
    metrics = terms.metrics()
    assert metrics["candidate_recall"] == 0.0 and "selector_loss" in metrics


def test_one_step_trains_the_selector_and_the_convolutions_from_their_start():
    drafter = DFlash2DraftModel(dflash2_config())
    inputs, _, head = loss_inputs(drafter.config)
    features = torch.randn(1, inputs.context_len, 64)
    layout = block_layout(inputs.anchors, inputs.context_len, 4, 4, CPU)
    out = drafter(torch.randn(1, 12, 32), features, inputs.position_ids, layout).last_hidden_state
    drafter.loss_terms(out, head, inputs, LossSettings(weighting="dpace")).loss_sum.backward()
    grads = {name: p.grad for name, p in drafter.named_parameters()}
    for name in (
        "candidate_selector.successor_codebook",
        "layers.0.attention_conv.kernel_projection.weight",
        "layers.1.mlp_conv.base_kernel",
    ):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name


def test_muon_leaves_the_codebooks_and_base_kernels_to_adamw():
    drafter = DFlash2DraftModel(dflash2_config())
    optimizer = build_optimizer(drafter, "muon", lr=1e-3, weight_decay=0.0, fused=False)
    on_muon = {id(p) for group in optimizer.muon.param_groups for p in group["params"]}
    names = {name for name, p in drafter.named_parameters() if id(p) in on_muon}
    assert "candidate_selector.hidden_projection.weight" in names
    assert "layers.0.attention_conv.kernel_projection.weight" in names
    assert not any("codebook" in n or "base_kernel" in n for n in names)


def train_config(**settings) -> TrainConfig:
    return TrainConfig(target_model="t", data=["d.jsonl"], **settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"conv_group_size": 8}, "--conv_group_size 8 sets the dflash2 drafter, .* pass --drafter dflash2"),
        ({"selector_loss_alpha": 0.5}, "--selector_loss_alpha 0.5 sets the dflash2 drafter"),
        ({"drafter": "dflash3"}, "--drafter dflash3: choose dflash, dflash2, dspark or lilicorr"),
        ({"drafter": "dflash2", "selector_top_k": 0}, "--selector_top_k 0: must be a positive integer"),
        (
            {"drafter": "dflash2", "selector_loss_alpha": -1.0},
            "--selector_loss_alpha -1.0: must be a number >= 0",
        ),
    ],
)
def test_dflash2_settings_are_checked_at_start(settings, message):
    with pytest.raises(ValueError, match=message):
        train_config(**settings).validate()


def test_a_shape_the_engines_cannot_serve_is_refused_naming_the_flag(tiny_target):
    info = inspect_target(tiny_target)  # hidden 64
    for fields, message in (
        ({"conv_group_size": 24}, "--conv_group_size 24 must divide the hidden size 64"),
        ({"conv_kernel_size": 5}, r"--conv_kernel_size 5 must be in \[1, block_size 4\]"),
        ({"selector_top_k": 1000}, r"--selector_top_k 1000 must be in \[1, vocab size"),
    ):
        with pytest.raises(ValueError, match=message):
            drafter_config_for(info, 2, [1, 3], 3, 4, DFlash2DraftConfig, fields)


# z-lab/dflash tests/fixtures/dflash2-config.json, as published (the layout the engines load)
ZLAB_FIXTURE = {
    "architectures": ["DFlash2DraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 200000,
    "dflash_config": {
        "block_size": 16,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "final_logit_softcapping": 20.0,
        "mask_token_id": 201818,
        "output_multiplier": 0.19611613513818404,
        "selector_rank": 256,
        "selector_top_k": 16,
        "target_layer_ids": [1, 13, 25, 37, 49],
    },
    "dtype": "bfloat16",
    "eos_token_id": 200001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 6656,
    "initializer_range": 0.02,
    "intermediate_size": 19968,
    "is_causal": False,
    "layer_types": ["sliding_attention"] * 5,
    "max_position_embeddings": 131072,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 52,
    "pad_token_id": 200018,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048,
    "tie_word_embeddings": False,
    "transformers_version": "5.15.0",
    "use_cache": False,
    "use_sliding_window": True,
    "vocab_size": 202048,
}
# z-lab/dflash tests/fixtures/dflash2-safetensors-header.json: every tensor outside the layers, and layer 0's
# (layers 1-4 alike)
ZLAB_SHAPES = {
    "candidate_selector.hidden_projection.weight": [256, 6656],
    "candidate_selector.predecessor_codebook": [202048, 256],
    "candidate_selector.successor_codebook": [202048, 256],
    "fc.weight": [6656, 33280],
    "hidden_norm.weight": [6656],
    "norm.weight": [6656],
    "layers.0.attention_conv.base_kernel": [2, 2, 6656],
    "layers.0.attention_conv.kernel_projection.weight": [1664, 6656],
    "layers.0.mlp_conv.base_kernel": [2, 2, 6656],
    "layers.0.mlp_conv.kernel_projection.weight": [1664, 6656],
    "layers.0.input_layernorm.weight": [6656],
    "layers.0.post_attention_layernorm.weight": [6656],
    "layers.0.self_attn.q_proj.weight": [4096, 6656],
    "layers.0.self_attn.k_proj.weight": [1024, 6656],
    "layers.0.self_attn.v_proj.weight": [1024, 6656],
    "layers.0.self_attn.o_proj.weight": [6656, 4096],
    "layers.0.self_attn.q_norm.weight": [128],
    "layers.0.self_attn.k_norm.weight": [128],
    "layers.0.mlp.gate_proj.weight": [19968, 6656],
    "layers.0.mlp.up_proj.weight": [19968, 6656],
    "layers.0.mlp.down_proj.weight": [6656, 19968],
}


def test_the_zlab_fixture_loads_with_every_dflash2_field_and_the_fixtures_tensor_names_and_shapes():
    config = from_zlab_config(ZLAB_FIXTURE)
    assert isinstance(config, DFlash2DraftConfig)
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == (
        2,
        16,
        256,
        16,
    )
    assert config.output_multiplier == pytest.approx(0.196116135) and config.final_logit_softcapping == 20.0
    assert config.layer_types == ["sliding_attention"] * 5 and config.sliding_window == 2048
    with torch.device("meta"):
        model = build_model(config)
    shapes = {name: list(t.shape) for name, t in trainable_state_dict(model).items()}
    assert set(shapes) == zlab_keys(5, "dflash2")
    assert {name: shapes[name] for name in ZLAB_SHAPES} == ZLAB_SHAPES
    # and back: the same dflash_config and flags the fixture has
    out = to_zlab_config(config)
    assert out["architectures"] == ["DFlash2DraftModel"] and out["is_causal"] is False
    assert out["dflash_config"] == ZLAB_FIXTURE["dflash_config"]
    assert out["layer_types"] == ZLAB_FIXTURE["layer_types"] and out["sliding_window"] == 2048
    assert out["use_sliding_window"] is True


def test_a_dflash_export_config_is_unchanged_by_the_families():
    out = to_zlab_config(small_draft_config())
    assert out["architectures"] == ["DFlashDraftModel"] and "is_causal" not in out
    assert set(out["dflash_config"]) == {"mask_token_id", "target_layer_ids", "block_size"}
    assert type(from_zlab_config(json.loads(json.dumps(out)))).__name__ == "DFlashDraftConfig"


def test_a_config_missing_a_dflash2_field_names_it():
    broken = json.loads(json.dumps(ZLAB_FIXTURE))
    del broken["dflash_config"]["selector_rank"]
    with pytest.raises(ValueError, match="config.json: missing field 'dflash_config.selector_rank'"):
        from_zlab_config(broken)
    with pytest.raises(ValueError, match="architectures \\['DominoDraftModel'\\]: not a drafter"):
        from_zlab_config({**ZLAB_FIXTURE, "architectures": ["DominoDraftModel"]})
    # sliding layers without is_causal are causal to z-lab's reader: refused, not silently run otherwise
    causal = {k: v for k, v in ZLAB_FIXTURE.items() if k != "is_causal"}
    with pytest.raises(ValueError, match="a drafter with causal layers cannot be loaded"):
        from_zlab_config(causal)


@pytest.mark.processes
def test_a_dflash2_run_trains_evaluates_exports_and_decodes_losslessly(
    tiny_target, chat_data, tmp_path, capsys
):
    """`--drafter dflash2` through the real CLI: training with checkpoint evaluations (--eval_steps) and the
    end-of-run table, the export in the engines' layout with its model card, and `evaluate --json`."""
    from dflash_ddp.evaluation.evaluate import main as evaluate_main
    from dflash_ddp.serving.export import main as export_main
    from dflash_ddp.train import main as train_main

    run, export = tmp_path / "run", tmp_path / "export"
    flags = train_flags(
        tiny_target, chat_data, run, drafter="dflash2", selector_rank=16, selector_top_k=8, max_steps=20
    )
    flags += ["--save_steps", "10", "--eval_steps", "10", "--eval_data", str(chat_data)]
    flags += ["--eval_prompts", "3", "--eval_max_new_tokens", "16"]
    assert train_main(flags) == 0
    out = capsys.readouterr().out
    assert "DFlash2, this drafter" in out and "transformers' generate runs DFlash drafters only" in out
    final = json.loads((run / "eval.json").read_text())
    assert final["drafter"] == "dflash2" and final["lossless"] and "transformers_dflash" not in final
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20] and all(r["lossless"] for r in records)
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"selector_loss", "unary_accuracy", "candidate_recall", "rerank_share"} <= set(metrics)

    assert export_main([str(run), str(export)]) == 0
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    fields = {"block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size"}
    assert fields | {"selector_rank", "selector_top_k", "output_multiplier"} <= set(config["dflash_config"])
    card = (export / "README.md").read_text()
    assert "--speculative-num-draft-tokens 4" in card and '"num_speculative_tokens": 3' in card
    assert "unquantized" in card and "transformers' `generate` runs DFlash drafters only" in card

    report_path = tmp_path / "report.json"
    args = ["--target_model", str(tiny_target), "--drafter", str(export), "--data", str(chat_data)]
    assert (
        evaluate_main([*args, "--num_prompts", "3", "--max_new_tokens", "16", "--json", str(report_path)])
        == 0
    )
    report = json.loads(report_path.read_text())
    assert report["drafter"] == "dflash2" and report["lossless"] and report["dflash"]["mismatches"] == 0

    # an fp32 export loaded back is the trained drafter: it drafts the same tokens on the same prompts
    assert export_main([str(run), str(tmp_path / "export32"), "--dtype", "float32"]) == 0
    checkpoint = sorted((run / "checkpoints").glob("step-*"))[-1]
    trained, exported = load_drafter(checkpoint), load_drafter(tmp_path / "export32")
    target = load_causal_lm(inspect_target(tiny_target), CPU, torch.float32)
    for prompt in ([5, 17, 42, 8, 99, 23], [7, 7, 120, 33]):
        a = speculative_generate(target, trained, prompt, 24)
        b = speculative_generate(target, exported, prompt, 24)
        assert a.tokens == b.tokens and a.accepted == b.accepted
    assert report["tau_by_context"] == {"0-2K": pytest.approx(report["tau"])}
    assert all("tau_by_context" in r for r in records)


def test_a_dflash2_run_resumes_exactly_and_refuses_another_family(tiny_target, chat_data, tmp_path, capsys):
    from safetensors.torch import load_file

    from dflash_ddp.train import main as train_main

    settings = {
        "drafter": "dflash2",
        "selector_rank": 16,
        "selector_top_k": 8,
        "max_steps": 12,
        "save_steps": 6,
    }
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert train_main(train_flags(tiny_target, chat_data, whole, **settings)) == 0
    middle = whole / "checkpoints" / "step-00000006"
    assert train_main(train_flags(tiny_target, chat_data, resumed, **settings, resume=middle)) == 0
    a, b = (
        load_file(run / "checkpoints" / "step-00000012" / "model.safetensors") for run in (whole, resumed)
    )
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    other = {k: v for k, v in settings.items() if k not in ("drafter", "selector_rank", "selector_top_k")}
    assert train_main(train_flags(tiny_target, chat_data, tmp_path / "other", **other, resume=middle)) == 2
    err = capsys.readouterr().err
    assert "--drafter: checkpoint 'dflash2', now 'dflash'; a drafter cannot resume as another family" in err
    assert (
        f"pass --drafter dflash2 to resume it, or start a new run in another --output_dir with --init_from {middle}"
        in err
    )
    assert "drafter.architectures" not in err  # said as the flag, not the configs' fields
