"""LiLiCorr (drafter/lilicorr.py, drafter/lattice.py): the correlator's start, its walk greedy and sampled,
the teacher-forced loss, the serving layout vLLM 0.32 loads, and `--drafter lilicorr` (with and without
DFlash2's convolutions) through the real CLI: training, exact resume, export and lossless decoding."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from dflash_ddp.config import EMBEDDED_PRESET, EMBEDDED_TARGET, parse_config
from dflash_ddp.drafter.blocks import build_block_inputs
from dflash_ddp.drafter.families import build_model
from dflash_ddp.drafter.lilicorr import LiLiCorrDraftConfig
from dflash_ddp.drafter.weighting import LossSettings
from dflash_ddp.drafter.zlab import from_zlab_config, to_zlab_config
from dflash_ddp.evaluation.evaluate import main as evaluate_main
from dflash_ddp.serving.export import main as export_main
from dflash_ddp.train import main as train_main

from helpers import small_draft_config, train_flags

HEAD = {
    "lilicorr_hidden_size": 16,
    "lilicorr_factor_dim": 8,
    "lilicorr_num_heads": 2,
    "lilicorr_candidate_topk": 4,
}
CONV = {"conv_kernel_size": 2, "conv_group_size": 8}


def lilicorr_config(**overrides) -> LiLiCorrDraftConfig:
    return LiLiCorrDraftConfig(**{**small_draft_config().to_dict(), **HEAD, **overrides})


def block_output(drafter, seed: int = 0) -> torch.Tensor:
    """The drafter's output for one block after a context of 6 positions (eval mode)."""
    g = torch.Generator().manual_seed(seed)
    context, noise = torch.randn(1, 6, 64, generator=g), torch.randn(1, 4, 32, generator=g)
    return drafter.eval()(noise, context, torch.arange(10)[None]).last_hidden_state


@pytest.mark.parametrize("conv", [{}, CONV], ids=["dflash layers", "dflash2 convolutions"])
def test_an_untrained_lilicorr_drafter_drafts_as_its_backbones_lm_head(conv):
    """The incoming head starts at zero: every candidate of a slot scores alike and the walk keeps the LM
    head's best, so the drafts equal DFlash's with the same seed (the backbone is DFlash's weight for weight)."""
    torch.manual_seed(0)
    drafter = build_model(lilicorr_config(**conv))
    torch.manual_seed(0)
    dflash = build_model(small_draft_config())
    shared = dflash.state_dict()
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in shared.items())
    head, embedding = nn.Linear(32, 50, bias=False), nn.Embedding(50, 32)
    drafter.bind_target(embedding)
    anchor = torch.tensor([[3]])
    for seed in range(4):
        ours = drafter.draft_tokens(block_output(drafter, seed), head, anchor)
        assert torch.equal(ours, dflash.draft_tokens(block_output(dflash, seed), head, anchor))


def test_the_sampled_walk_draws_each_slot_from_its_row_over_the_candidates_alone():
    """At temperature 1 a slot's distribution is softmax of the correlator's row (given the candidate drawn
    before it) over that slot's K candidates, zero elsewhere: what rejection sampling must be given."""
    torch.manual_seed(0)
    drafter = build_model(lilicorr_config())
    nn.init.normal_(drafter.lilicorr.in_head.weight)  # a trained correlator: rows that differ
    head, embedding = nn.Linear(32, 50, bias=False), nn.Embedding(50, 32)
    drafter.bind_target(embedding)
    hidden = block_output(drafter)
    g = torch.Generator().manual_seed(1)

    def draw_from(logits):
        probs = logits.softmax(dim=-1)
        return probs.multinomial(1, generator=g)[:, 0], probs

    tokens, probs = drafter.sample_drafts(hidden, head, torch.tensor([[3]]), draw_from)
    ids, log_probs = drafter.candidates(hidden, head)
    rows = drafter.transitions(hidden, ids, log_probs)[0]
    previous = 0
    for slot in range(3):
        expected = torch.zeros(50)
        expected[ids[0, slot]] = rows[slot, previous].softmax(dim=-1)
        torch.testing.assert_close(probs[slot], expected)
        previous = int((ids[0, slot] == tokens[0, slot]).nonzero()[0])


def lattice_case(**overrides):
    """A drafter of a 20-token vocabulary bound to a target embedding, its output for 5 blocks of 4 over a
    40-token context, and those blocks' inputs (seeded: the same case every call)."""
    torch.manual_seed(0)
    drafter = build_model(lilicorr_config(vocab_size=20, mask_token_id=19, **overrides))
    drafter.bind_target(nn.Embedding(20, 32))
    ids = torch.randint(0, 19, (1, 40), generator=torch.Generator().manual_seed(0))
    inputs = build_block_inputs(ids, torch.ones_like(ids), [torch.tensor([8, 14, 20, 26, 30])], 4, 19)
    out = drafter(torch.randn(1, 20, 32), torch.randn(1, 40, 64), inputs.position_ids).last_hidden_state
    return drafter, out, inputs


def test_the_correlators_loss_is_teacher_forced_and_trains_the_backbone_through_its_features():
    """The lattice terms add to the LM head's loss, their gradient reaches the correlator and, through the
    candidates' log-probabilities and the anchor's state, the backbone's fc; a 20-token vocabulary with 16
    candidates puts the true tokens among them."""
    drafter, out, inputs = lattice_case(lilicorr_candidate_topk=16)
    head_weight = torch.randn(20, 32)
    terms = drafter.loss_terms(out, head_weight, inputs, LossSettings(lilicorr_penalty_weight=0.0))
    without = LossSettings(lilicorr_ce_weight=0.0, lilicorr_penalty_weight=0.0)
    assert (
        terms.selector_rows > 0
        and terms.loss_sum > drafter.loss_terms(out, head_weight, inputs, without).loss_sum
    )
    terms.loss_sum.backward()
    assert drafter.lilicorr.in_head.weight.grad.abs().sum() > 0
    assert drafter.lilicorr.context_proj.weight.grad.abs().sum() > 0  # the anchor's state is read
    assert drafter.fc.weight.grad.abs().sum() > 0


def test_the_logged_recall_and_unary_accuracy_are_shares_of_the_lattices_slots():
    """Candidate recall (the true token among a slot's candidates) and the LM head's own accuracy count the
    same slots, those of every fully scored block: shares at most 1, recall at least the head's accuracy (its
    best token is the first candidate). 4 candidates of 20 tokens leave most true paths broken early."""
    drafter, out, inputs = lattice_case()
    settings = LossSettings(lilicorr_penalty_weight=0.0)
    metrics = drafter.loss_terms(out, torch.randn(20, 32), inputs, settings).metrics()
    recall, unary = metrics["candidate_recall"], metrics["unary_accuracy"]
    assert 0 < unary <= recall < 1, metrics


def test_the_logged_rerank_share_counts_the_walks_choices_other_than_the_lm_heads_best():
    """An untrained correlator walks the LM head's best at every slot (share 0); a trained one (random
    incoming head) overrules it at some slots, at most at all."""
    drafter, out, inputs = lattice_case()
    settings, head_weight = LossSettings(lilicorr_penalty_weight=0.0), torch.randn(20, 32)
    assert drafter.loss_terms(out, head_weight, inputs, settings).metrics()["rerank_share"] == 0.0
    nn.init.normal_(drafter.lilicorr.in_head.weight)
    assert 0 < drafter.loss_terms(out, head_weight, inputs, settings).metrics()["rerank_share"] <= 1


def test_a_shape_the_engines_refuse_is_refused_naming_the_setting():
    errors = lilicorr_config(
        lilicorr_candidate_topk=6, lilicorr_num_heads=3, conv_kernel_size=2
    ).shape_errors()
    assert any("lilicorr_candidate_topk 6 must be a power of two <= 16" in e for e in errors)
    assert any("lilicorr_num_heads 3 must divide the correlator's width 16" in e for e in errors)
    assert any("set both (--lilicorr_conv) or neither" in e for e in errors)


def test_convolution_settings_without_lilicorr_conv_name_it():
    with pytest.raises(
        ValueError, match="--conv_kernel_size 4 sets the dflash2 drafter.* --lilicorr_conv true"
    ):
        parse_config(["--drafter", "lilicorr", "--conv_kernel_size", "4"])
    assert parse_config(["--drafter", "lilicorr", "--lilicorr_conv", "--conv_kernel_size", "4"])[
        0
    ].lilicorr_conv


# vLLM 0.32's LiLiCorrHead (model_executor/models/lilicorr.py), as it loads a checkpoint: every Linear with
# its bias, the two MLPs as up_proj/down_proj, token_proj only where the head is narrower than the model
def vllm_head_shapes(
    width: int, model: int, k: int, slots: int, heads: int, factor: int, layers: int
) -> dict:
    shapes = {
        "pass_hidden_proj.weight": (width, model),
        "pass_hidden_proj.bias": (width,),
        "feature_norm.weight": (5,),
        "feature_norm.bias": (5,),
        "feature_mlp.up_proj.weight": (width, 5),
        "feature_mlp.up_proj.bias": (width,),
        "feature_mlp.down_proj.weight": (width, width),
        "feature_mlp.down_proj.bias": (width,),
        "slot_embedding": (1, 1, slots, 1, width),
        "rank_embedding": (1, 1, 1, k, width),
        "relative_slot_bias": (heads, 2 * slots + 1),
        "same_slot_bias": (heads,),
        "context_proj.weight": (width, model),
        "context_proj.bias": (width,),
        "output_norm.weight": (width,),
        "anchor_norm.weight": (width,),
        "factor_input_proj.weight": (width, 3 * width),
        "factor_input_proj.bias": (width,),
    }
    for name in ("out_head", "in_head", "anchor_out_head"):
        shapes |= {f"{name}.weight": (factor, width), f"{name}.bias": (factor,)}
    if width != model:
        shapes |= {"token_proj.weight": (width, model), "token_proj.bias": (width,)}
    for i in range(layers):
        shapes |= {
            f"layers.{i}.attn_norm.weight": (width,),
            f"layers.{i}.attn.in_proj_weight": (3 * width, width),
            f"layers.{i}.attn.in_proj_bias": (3 * width,),
            f"layers.{i}.attn.out_proj.weight": (width, width),
            f"layers.{i}.attn.out_proj.bias": (width,),
            f"layers.{i}.mlp_norm.weight": (width,),
            f"layers.{i}.mlp.up_proj.weight": (2 * width, width),
            f"layers.{i}.mlp.up_proj.bias": (2 * width,),
            f"layers.{i}.mlp.down_proj.weight": (width, 2 * width),
            f"layers.{i}.mlp.down_proj.bias": (width,),
        }
    return {f"lilicorr.{name}": shape for name, shape in shapes.items()}


@pytest.mark.parametrize("conv", [{}, CONV], ids=["dflash layers", "dflash2 convolutions"])
def test_the_serving_config_and_tensors_are_vllms_lilicorr_layout(conv):
    """`LiLiCorrDraftModel` with every lilicorr_* field (and the convolution's, 0 when off) in dflash_config,
    the correlator's tensors as vLLM 0.32 names and shapes them, the backbone's as DFlash's (DFlash2's with
    the convolutions); the config reads back to the same drafter config."""
    config = lilicorr_config(**conv)
    out = to_zlab_config(config)
    assert out["architectures"] == ["LiLiCorrDraftModel"] and out["model_type"] == "qwen3"
    fields = out["dflash_config"]
    assert fields["lilicorr_enabled"] is True and fields["lilicorr_candidate_topk"] == 4
    assert fields["lilicorr_logit_scale"] == 8.0 and fields["lilicorr_vector_eps"] == 1e-4
    assert fields["conv_kernel_size"] == conv.get("conv_kernel_size", 0)
    assert from_zlab_config(out).to_dict() == config.to_dict()
    shapes = {name: tuple(p.shape) for name, p in build_model(config).named_parameters()}
    head = {name: shape for name, shape in shapes.items() if name.startswith("lilicorr.")}
    assert head == vllm_head_shapes(16, 32, 4, 3, 2, 8, 2)
    convolutions = {name for name in shapes if "_conv." in name}
    assert len(convolutions) == (2 * 2 * 2 if conv else 0)


def test_a_lilicorr_run_trains_resumes_exactly_exports_and_decodes_losslessly(tmp_path, embedded_cache):
    """`--drafter lilicorr` (its penalty reading the target's top 64 by default) through the real CLI on the
    embedded default: the correlator trains away from its start once true tokens are among the candidates, a
    resume from the middle gives the same weights, the export loads back, and the evaluation is lossless
    greedy with a sampled row at temperature 1.0 (with the convolutions: the next test, and DFlash2's resume
    of the same layers)."""
    flags = ["--drafter", "lilicorr", "--max_steps", "4", "--save_steps", "2", "--eval_data", ""]
    flags += [f"--{k}={v}" for k, v in HEAD.items()] + ["--cache_dir", embedded_cache]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert train_main([*flags, "--output_dir", str(whole)]) == 0
    middle = whole / "checkpoints" / "step-00000002"
    assert train_main([*flags, "--output_dir", str(resumed), "--resume", str(middle)]) == 0
    a, b = (
        load_file(run / "checkpoints" / "step-00000004" / "model.safetensors") for run in (whole, resumed)
    )
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert a["lilicorr.in_head.weight"].abs().sum() > 0  # trained away from its zero start
    state = json.loads((whole / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert state["config"]["target_topk"] == 64
    export = tmp_path / "export"
    assert export_main([str(whole), str(export), "--dtype", "float32"]) == 0
    card = (export / "README.md").read_text()  # transformers' generate would draft without the correlator
    assert "speculation_type" not in card and "dflash_ddp's own decoding runs this one" in card
    assert "- objective: cross-entropy, plus the lattice correlator's 0.25 x" in card
    report_path = tmp_path / "report.json"
    args = [
        "--target_model",
        str(EMBEDDED_TARGET),
        "--drafter",
        str(export),
        "--data",
        EMBEDDED_PRESET["eval_data"],
    ]
    assert (
        evaluate_main([*args, "--num_prompts", "2", "--max_new_tokens", "24", "--json", str(report_path)])
        == 0
    )
    report = json.loads(report_path.read_text())
    assert report["drafter"] == "lilicorr" and report["lossless"] and report["dflash"]["mismatches"] == 0
    assert report["dflash_sampled"]["tau"] >= 1.0


def test_a_lilicorr_drafter_of_a_second_target_trains_exports_and_decodes_losslessly(
    tiny_target, chat_data, tmp_path
):
    """Another target (a random 6-layer Qwen3 with its own tokenizer) through the same commands, with the
    convolutions: lossless greedy and a sampled row. At the small job's sizes (one layer, blocks of 4, 8
    anchors), as the other families' runs on this target: the paper's defaults are an 8B target's."""
    run, export = tmp_path / "run", tmp_path / "export"
    flags = train_flags(tiny_target, chat_data, run, drafter="lilicorr", max_steps=2, target_layer_ids="1,3")
    assert train_main([*flags, "--lilicorr_conv", *(f"--{k}={v}" for k, v in HEAD.items())]) == 0
    weights = load_file(run / "checkpoints" / "step-00000002" / "model.safetensors")
    assert "layers.0.attention_conv.base_kernel" in weights  # the convolutions trained with the correlator
    assert export_main([str(run), str(export), "--dtype", "float32"]) == 0
    report_path = tmp_path / "report.json"
    args = ["--target_model", str(tiny_target), "--drafter", str(export), "--data", str(chat_data)]
    assert (
        evaluate_main([*args, "--num_prompts", "2", "--max_new_tokens", "16", "--json", str(report_path)])
        == 0
    )
    report = json.loads(report_path.read_text())
    assert report["drafter"] == "lilicorr" and report["lossless"] and report["dflash_sampled"]["tau"] >= 1.0
