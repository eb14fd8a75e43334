"""DSpark (drafter/dspark.py): the Markov and confidence heads, their decoding walk and sampling, the loss, and
`--drafter dspark` through the real CLI: training, exact resume, the export in vLLM's DSpark layout, and
lossless decoding in this project's evaluator."""

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from dflash_ddp.drafter.dspark import DSparkDraftConfig
from dflash_ddp.drafter.families import build_model
from dflash_ddp.drafter.zlab import from_zlab_config, to_zlab_config, zlab_keys
from dflash_ddp.evaluation.sampling import Sampling, draw, token_probs

from helpers import small_draft_config, train_flags

KINDS = ("vanilla", "gated", "rnn")


def dspark_config(**overrides) -> DSparkDraftConfig:
    return DSparkDraftConfig(**{**small_draft_config().to_dict(), "markov_rank": 8, **overrides})


def head(vocab: int = 50, width: int = 32, seed: int = 1) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(width, vocab, bias=False)


@pytest.mark.parametrize("kind", KINDS)
def test_an_untrained_dspark_drafter_drafts_as_dflash_with_the_same_backbone(kind):
    """W2 starts at zero: the Markov bias is 0, so the walk drafts each position's argmax, as DFlash does; the
    heads are drawn after the backbone, so the same seed gives DFlash's backbone weight for weight."""
    torch.manual_seed(0)
    dflash = build_model(small_draft_config())
    torch.manual_seed(0)
    dspark = build_model(dspark_config(markov_head_type=kind))
    backbone = dflash.state_dict()
    assert all(torch.equal(backbone[k], v) for k, v in dspark.state_dict().items() if k in backbone)
    lm_head, hidden = head(), torch.randn(1, 4, 32)
    anchor = torch.tensor([[7]])
    assert torch.equal(
        dspark.draft_tokens(hidden, lm_head, anchor), dflash.draft_tokens(hidden, lm_head, anchor)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_each_draft_is_drawn_from_its_distribution_given_the_draft_before_it(kind):
    """sample_drafts walks left to right: q_k is the biased softmax given the token drawn at k - 1 (the anchor
    for the first), which the rejection rule needs to stay lossless in distribution."""
    torch.manual_seed(0)
    drafter = build_model(dspark_config(markov_head_type=kind))
    nn.init.normal_(drafter.markov_head.markov_w2.weight, std=2.0)  # a bias that moves the distribution
    lm_head, hidden, anchor = head(), torch.randn(1, 4, 32), torch.tensor([[7]])
    sampling = Sampling(1.0)
    generator = torch.Generator().manual_seed(3)

    def draw_from(logits):
        probs = token_probs(logits, sampling)
        return draw(probs, generator), probs

    drafts, q = drafter.sample_drafts(hidden, lm_head, anchor, draw_from)
    previous = torch.cat([anchor[0], drafts[0, :-1]])
    features = drafter.markov_head.features(previous[None], hidden[:, 1:])[0]
    expected = token_probs(drafter.biased_logits(hidden[0, 1:], lm_head.weight, features), sampling)
    assert q.shape == (3, 50) and torch.allclose(q, expected, atol=1e-6)
    unbiased = token_probs(drafter.biased_logits(hidden[0, 1:], lm_head.weight, None), sampling)
    assert not torch.allclose(q, unbiased, atol=1e-3)  # the head changes what is drafted


def test_a_shape_without_what_its_heads_need_is_refused():
    errors = dspark_config(markov_rank=0).shape_errors()
    assert any("confidence_head_with_markov needs a Markov head" in e for e in errors)
    assert any(
        "choose one of vanilla, gated, rnn" in e
        for e in dspark_config(markov_head_type="lstm").shape_errors()
    )


@pytest.mark.parametrize("kind", KINDS)
def test_the_serving_config_and_tensors_are_vllms_dspark_layout(kind):
    """vLLM 0.32's Qwen3DSparkModel reads markov_rank, enable_confidence_head and confidence_head_with_markov at
    the top level, takes `DSparkDraftModel` with model_type qwen3 as itself, serves the anchor-given block as
    `sample_from_anchor: false`, and loads markov_w1 [V, r], markov_w2 [V, r], confidence_head.proj [1, H + r]
    with its bias [1]; the config reads back to the same drafter config."""
    config = dspark_config(markov_head_type=kind)
    out = to_zlab_config(config)
    assert out["architectures"] == ["DSparkDraftModel"] and out["model_type"] == "qwen3"
    assert out["markov_rank"] == 8 and out["enable_confidence_head"] is True
    assert out["confidence_head_with_markov"] is True and out["sample_from_anchor"] is False
    assert out["markov_head_type"] == kind and out["is_causal"] is False
    assert from_zlab_config(out).to_dict() == config.to_dict()
    shapes = {name: tuple(p.shape) for name, p in build_model(config).named_parameters()}
    assert set(shapes) == zlab_keys(2, "dspark", kind)
    assert shapes["markov_head.markov_w1.weight"] == (50, 8) == shapes["markov_head.markov_w2.weight"]
    assert shapes["confidence_head.proj.weight"] == (1, 32 + 8) and shapes["confidence_head.proj.bias"] == (
        1,
    )


def test_dspark_settings_are_checked_before_anything_loads(tiny_target, chat_data, tmp_path, capsys):
    from dflash_ddp.train import main as train_main

    flags = train_flags(tiny_target, chat_data, tmp_path / "run", drafter="dspark", target_topk=0)
    assert train_main(flags) == 2  # given on purpose: refused, as DSpark's loss reads the target's top-k
    assert "--drafter dspark (--loss ce, --target_topk 0)" in capsys.readouterr().err
    flags = train_flags(
        tiny_target, chat_data, tmp_path / "run", drafter="dspark", target_topk=8, markov_rank=0
    )
    assert train_main(flags) == 2
    assert "pass --confidence_head_with_markov false" in capsys.readouterr().err
    assert train_main(train_flags(tiny_target, chat_data, tmp_path / "run", markov_rank=16)) == 2
    assert "--markov_rank 16 sets the dspark drafter" in capsys.readouterr().err


def test_dspark_on_its_ce_alone_sends_no_distribution_and_trains(tiny_target, chat_data, tmp_path, capsys):
    """Both distillation weights 0 (an ablation of the Markov head): the top-64 would cost the target ranks
    every layer for nothing, so --target_topk 0 is asked for, and the run trains on the CE alone."""
    from dflash_ddp.train import main as train_main

    ce_only = {
        "drafter": "dspark",
        "dspark_l1_alpha": 0,
        "confidence_alpha": 0,
        "max_steps": 2,
        "save_steps": 2,
    }
    assert train_main(train_flags(tiny_target, chat_data, tmp_path / "run", **ce_only)) == 2
    assert "pass --target_topk 0 with them" in capsys.readouterr().err
    assert train_main(train_flags(tiny_target, chat_data, tmp_path / "run", target_topk=0, **ce_only)) == 0
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["loss"] > 0 and "distill_l1" not in last


def test_dspark_alone_sends_the_targets_top_64_and_plan_says_what_it_costs(
    tiny_target, chat_data, tmp_path, capsys
):
    """`--drafter dspark` and no other drafter flag: --target_topk 64, the reference's, recorded in the run's
    config and its checkpoint; --plan prints the top-64 and the target ranks' extra layers and LM head."""
    from dflash_ddp.train import main as train_main

    flags = train_flags(tiny_target, chat_data, tmp_path / "run", drafter="dspark", max_steps=2, save_steps=2)
    assert train_main([*flags, "--plan"]) == 0
    plan = {line.split(":")[0].strip(): line for line in capsys.readouterr().out.splitlines() if ":" in line}
    assert (
        "the top 64 next-token probabilities are sent as soft targets (--target_topk"
        in plan["target_layers_run"]
    )
    assert "more target compute per token" in plan["target_layers_run"]
    assert "384 bytes a token: 64 int32 ids" in plan["message_size"]
    assert train_main(flags) == 0
    run = tmp_path / "run"
    state = json.loads((run / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert (
        json.loads((run / "config.json").read_text())["target_topk"] == state["config"]["target_topk"] == 64
    )
    assert 0 <= json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["distill_l1"] <= 2


def test_a_dspark_run_trains_resumes_exactly_exports_and_decodes_losslessly(
    tiny_target, chat_data, tmp_path, capsys
):
    """`--drafter dspark --target_topk 8` through the real CLI: every head trains (W2 leaves zero, the
    confidence head moves), the metrics carry the distillation and the confidence's calibration, a resume
    from the middle gives the same weights, the export loads back as the trained drafter, and the evaluation
    is lossless greedy with a sampled row at temperature 1.0."""
    from safetensors.torch import load_file

    from dflash_ddp.evaluation.evaluate import main as evaluate_main
    from dflash_ddp.serving.export import main as export_main
    from dflash_ddp.train import main as train_main

    settings = {"drafter": "dspark", "target_topk": 8, "markov_rank": 16, "max_steps": 8, "save_steps": 4}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert train_main(train_flags(tiny_target, chat_data, whole, **settings)) == 0
    middle = whole / "checkpoints" / "step-00000004"
    assert train_main(train_flags(tiny_target, chat_data, resumed, **settings, resume=middle)) == 0
    a, b = (
        load_file(run / "checkpoints" / "step-00000008" / "model.safetensors") for run in (whole, resumed)
    )
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert a["markov_head.markov_w2.weight"].abs().sum() > 0  # trained away from its zero start
    metrics = json.loads((whole / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 <= metrics["distill_l1"] <= 2 and 0 < metrics["predicted_acceptance"] < 1
    assert 0 <= metrics["observed_acceptance"] <= 1

    export = tmp_path / "export"
    assert export_main([str(whole), str(export), "--dtype", "float32"]) == 0
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["markov_rank"] == 16
    with safe_open(export / "model.safetensors", "pt") as f:
        assert set(f.keys()) == zlab_keys(config["num_hidden_layers"], "dspark", "vanilla")
    card = (export / "README.md").read_text()
    assert "DSpark drafter" in card and '"method": "dspark"' in card and '"num_speculative_tokens": 3' in card
    assert '"enable_adaptive_verification": true' in card  # its confidence head, used
    assert "- objective: DSpark's own loss: 0.1 x the cross-entropy of the Markov-biased logits" in card

    capsys.readouterr()
    report_path = tmp_path / "report.json"
    args = ["--target_model", str(tiny_target), "--drafter", str(export), "--data", str(chat_data)]
    args += ["--num_prompts", "3", "--max_new_tokens", "16", "--json", str(report_path)]
    assert evaluate_main(args) == 0
    report = json.loads(report_path.read_text())
    assert report["drafter"] == "dspark" and report["lossless"] and report["dflash"]["mismatches"] == 0
    assert report["dflash_sampled"]["tau"] >= 1.0
    calibration = report["dflash"]["confidence_calibration"]
    assert calibration[0]["position"] == 1 and all(0 <= r["predicted"] <= 1 for r in calibration)
    assert report["dflash"]["drafts_skipped"] == 0  # no threshold: every draft verified
    assert "DSpark, this drafter" in capsys.readouterr().out
    # a threshold above every prediction verifies no draft: one token per step, still lossless
    argv = [*args[:-2], "--json", str(report_path), "--confidence_threshold", "1.0"]
    assert evaluate_main(argv) == 0
    cut = json.loads(report_path.read_text())
    assert cut["lossless"] and cut["dflash"]["tau"] == 1.0 and cut["dflash"]["drafts_skipped"] > 0
    assert "drafts not verified (below --confidence_threshold)" in capsys.readouterr().out


def test_the_plan_names_dsparks_markov_tables_and_counts_them_as_lasting_state():
    from dflash_ddp.drafter.memory import DrafterLoad, drafter_memory

    load = DrafterLoad(10**6, 8 * 10**6, 1024, 4096, 1024, 1024, "sparse", 4, received_batches=1)
    plan = drafter_memory(dspark_config(), load)
    assert "Markov tables" in plan.parts and "selector codebooks" not in plan.parts
    assert "Markov tables" in plan.lasting and "activations" not in plan.lasting


def test_the_card_of_a_head_vllm_does_not_serve_gives_no_vllm_command():
    from dflash_ddp.serving.card import dspark_serving

    vanilla = "\n".join(dspark_serving("org/target", "/exports/d", 8, "vanilla", False))
    assert '"method": "dspark", "model": "/exports/d", "num_speculative_tokens": 7}\'' in vanilla
    assert "adaptive" not in vanilla
    # a confidence head acts only under vLLM's adaptive verification (off by default)
    confident = "\n".join(dspark_serving("org/target", "/exports/d", 8, "vanilla", True))
    assert '"num_speculative_tokens": 7, "enable_adaptive_verification": true}\'' in confident
    for kind in ("gated", "rnn"):
        card = "\n".join(dspark_serving("org/target", "/exports/d", 8, kind, True))
        assert "vllm serve" not in card and f"Its {kind} Markov head" in card and "not served by vLLM" in card
        assert "python -m dflash_ddp.evaluate --target_model org/target --drafter /exports/d" in card
