"""The serving export (z-lab layout) and loading drafters back."""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

from dflash_ddp.checkpoint.layout import resolve_checkpoint
from dflash_ddp.checkpoint.manifest import write_manifest
from dflash_ddp.config import TrainConfig
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.drafter.zlab import to_zlab_config, zlab_keys
from dflash_ddp.evaluation.decoding import as_transformers_assistant
from dflash_ddp.export import main
from dflash_ddp.files import fingerprint_files
from dflash_ddp.regeneration.parts import settings_path
from dflash_ddp.serving.card import FAMILY_TERM_DEFAULTS, scored_against, weighted_by
from dflash_ddp.serving.export import load_drafter, package_version, save_drafter
from dflash_ddp.target_model.info import target_fingerprint

from helpers import small_draft_config


def drafter():
    torch.manual_seed(0)
    return DFlashDraftModel(
        DFlashDraftConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_target_layers=6,
            target_layer_ids=[1, 2, 3],
            mask_token_id=63,
            block_size=8,
        )
    )


def test_export_round_trip_is_bit_identical_with_exact_zlab_keys(tmp_path):
    model = drafter()
    save_drafter(model, tmp_path, dtype="float32")
    stored = load_file(tmp_path / "model.safetensors")
    assert set(stored) == zlab_keys(3)
    assert not any("embed" in k or "lm_head" in k for k in stored)
    assert stored["fc.weight"].shape == (32, 3 * 32)
    reloaded = load_drafter(tmp_path)
    for name, p in model.named_parameters():
        assert torch.equal(p, dict(reloaded.named_parameters())[name])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [1, 2, 3], "block_size": 8}
    assert config["block_size"] == 8 and config["num_target_layers"] == 6
    assert config["tie_word_embeddings"] is False


def test_config_has_the_qwen3_fields_serving_engines_read():
    config = to_zlab_config(drafter().config)
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "vocab_size",
    ):
        assert field in config


def test_extra_or_missing_keys_are_refused(tmp_path):
    save_drafter(drafter(), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = torch.zeros(64, 32)
    del state["norm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError, match="missing keys \\['norm.weight'\\], unexpected keys \\['lm_head.weight'\\]"
    ):
        load_drafter(tmp_path)


@pytest.mark.processes
def test_export_cli_from_a_checkpoint_directory(tmp_path, capsys):
    save_drafter(drafter(), tmp_path / "ckpt", dtype="float32")
    result = subprocess.run(
        [sys.executable, "-m", "dflash_ddp.export", str(tmp_path / "ckpt"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (
        load_file(tmp_path / "out" / "model.safetensors").keys()
        == load_file(tmp_path / "ckpt" / "model.safetensors").keys()
    )
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "o2")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_the_export_is_bf16_by_default_with_what_older_readers_and_vllm_read(tmp_path):
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    torch.manual_seed(0)
    model = DFlashDraftModel(small_draft_config(rope_parameters=llama3_rope))
    umask = os.umask(0o077)  # a umask that would make the files private to the trainer's user
    try:
        save_drafter(model, tmp_path)
    finally:
        os.umask(umask)
    stored = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    for name, p in model.named_parameters():
        assert torch.equal(stored[name], p.detach().to(torch.bfloat16)), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["rope_parameters"] == llama3_rope
    assert config["rope_scaling"] == {k: v for k, v in llama3_rope.items() if k != "rope_theta"}
    assert config["rope_theta"] == 500000.0
    # vLLM reads these as given: the inputs of target layers 1 and 3 are the outputs of taps 0 and 2
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644
    # our own loader takes bf16 files back (into fp32 training weights)
    assert load_drafter(tmp_path).fc.weight.dtype == torch.float32
    save_drafter(DFlashDraftModel(small_draft_config()), tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["rope_scaling"] is None


def tiny_target_drafter(tiny_target, **overrides) -> DFlashDraftModel:
    """A random one-layer drafter that fits the tiny_target fixture (6 layers, hidden 64, mask id 3)."""
    torch.manual_seed(0)
    vocab = len(AutoTokenizer.from_pretrained(tiny_target))
    shape = dict(hidden_size=64, intermediate_size=128, head_dim=16, num_hidden_layers=1, vocab_size=vocab)
    shape |= dict(num_target_layers=6, target_layer_ids=[1, 3], mask_token_id=3)
    return DFlashDraftModel(small_draft_config(**shape | overrides))


def fake_checkpoint(tmp_path, tiny_target, chat_data) -> tuple:
    """A checkpoint directory as training writes it (fp32 weights, trainer_state.json), for data that came
    from the regenerate tool (its settings file beside it)."""
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000007"
    save_drafter(tiny_target_drafter(tiny_target), ckpt, dtype="float32")
    data = tmp_path / "regenerated.jsonl"
    shutil.copy(chat_data, data)
    regeneration = {
        "max_new_tokens": 64,
        "temperature": 0.0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    settings_path(data).write_text(json.dumps(regeneration))
    state = {
        "global_step": 7,
        "config": {
            "target_model": str(tiny_target),
            "chat_template": "",
            "chat_template_kwargs": {"enable_thinking": False},
            "data": [str(data)],
        },
        "fingerprints": {
            "target": target_fingerprint(tiny_target),
            "tokenizer": fingerprint_files(sorted(tiny_target.glob("tokenizer*"))),
            "data": "0123456789abcdef",
        },
    }
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    for part in ("optimizer.pt", "scheduler.pt", "rng-rank0.pt"):  # a checkpoint's other files
        torch.save({}, ckpt / part)
    write_manifest(ckpt, 7)  # written last, as a save does
    return tmp_path / "run", data, regeneration


def test_the_export_is_stamped_with_how_the_drafter_was_trained(tmp_path, tiny_target, chat_data, capsys):
    run, data, regeneration = fake_checkpoint(tmp_path, tiny_target, chat_data)
    assert main([str(run), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    template = AutoTokenizer.from_pretrained(tiny_target).chat_template
    assert config["dflash_ddp"] == {
        "version": package_version(),
        "global_step": 7,
        "target_fingerprint": target_fingerprint(tiny_target),
        "tokenizer_fingerprint": fingerprint_files(sorted(tiny_target.glob("tokenizer*"))),
        "data_fingerprint": "0123456789abcdef",
        "chat_template_kwargs": {"enable_thinking": False},
        "target_model": str(tiny_target),
        "target_commit": None,  # a local directory (and a trainer_state.json from before hub names)
        "target_model_type": "qwen3",
        "target_architecture": "Qwen3ForCausalLM",
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
        "regeneration": {str(data): regeneration},
    }
    assert config["dflash_config"]["mask_token"] == "<|mask|>"  # id 3 of the fixture's tokenizer
    # the card's command measures it with prompts rendered as the training data was
    card = (tmp_path / "out" / "README.md").read_text()
    assert "--data HELDOUT.jsonl --chat_template_kwargs '{\"enable_thinking\": false}'`" in card
    # a re-export (here to fp32) keeps the stamp and the mask token
    assert main([str(tmp_path / "out"), str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    again = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert again["dflash_ddp"] == config["dflash_ddp"] and again["dflash_config"] == config["dflash_config"]
    assert again["dtype"] == "float32"
    assert {t.dtype for t in load_file(tmp_path / "fp32" / "model.safetensors").values()} == {torch.float32}
    # ... and its card: the training and acceptance as the first card had them, the fp32 said to be bf16's
    again_card = (tmp_path / "fp32" / "README.md").read_text()
    section = card[card.index("## Training") :].split("\n## ")[0].rstrip()
    assert section in again_card and "- 7 optimizer steps" in again_card
    # no measured tau to carry: the line that says how to measure it names the new export
    assert f"--drafter {(tmp_path / 'fp32').resolve()} --data HELDOUT.jsonl" in again_card
    assert f"--drafter {(tmp_path / 'out').resolve()} " not in again_card
    # a measured table is carried as it was
    from dflash_ddp.serving.card import ACCEPTANCE, MEASURED

    table = f"{ACCEPTANCE}\n\n{MEASURED}, from eval.json:\n\n| tau | 2.50 |"
    (tmp_path / "out" / "README.md").write_text(card.split(ACCEPTANCE)[0] + table + "\n\n## Serving\n")
    assert main([str(tmp_path / "out"), str(tmp_path / "measured"), "--dtype", "float32"]) == 0
    assert table in (tmp_path / "measured" / "README.md").read_text()
    assert "weights in float32 (the bfloat16 values of the export it was made from, widened)" in again_card
    assert "weights in bfloat16" in card

    # the target moved: a clear error, and --target_model points at it
    moved = tmp_path / "moved_target"
    shutil.move(tiny_target, moved)
    try:
        assert main([str(run), str(tmp_path / "o2")]) == 2
        assert f"the target {tiny_target} (recorded in" in capsys.readouterr().err
        assert main([str(run), str(tmp_path / "o2"), "--target_model", str(moved)]) == 0
        other = tmp_path / "other_tokenizer"
        shutil.copytree(moved, other)
        (other / "tokenizer_config.json").write_text((other / "tokenizer_config.json").read_text() + " ")
        assert main([str(run), str(tmp_path / "o3"), "--target_model", str(other)]) == 2
        assert "is not the one the drafter was trained with" in capsys.readouterr().err
    finally:
        shutil.move(moved, tiny_target)


def test_transformers_dflash_drafter_loads_the_export_and_generates_with_a_bf16_target(tmp_path, tiny_target):
    """What an engine does: build transformers' own DFlash drafter class from config.json, load the bf16
    weights strictly (only fc and hidden_norm are named differently there), and run
    `generate(speculation_type="dflash")` against a bf16 target: greedy output equals the target's own."""
    ours = tiny_target_drafter(tiny_target)
    save_drafter(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    dflash = config["dflash_config"]
    glimmer_config = MuseGlimmerAssistantConfig(
        **{k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "rms_norm_eps")},
        **{k: config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")},
        **{k: config[k] for k in ("rope_parameters", "max_position_embeddings")},
        layer_types=["full_attention"] * config["num_hidden_layers"],
        block_size=dflash["block_size"],
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=dflash["target_layer_ids"],
    )
    renamed = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    state = {renamed.get(k, k): v for k, v in load_file(tmp_path / "model.safetensors").items()}
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    glimmer = MuseGlimmerAssistantModel(glimmer_config).eval()
    glimmer.load_state_dict(state, strict=True)
    for p in glimmer.parameters():  # weights only: Module.to would round the fp32 rotary frequencies too
        p.data = p.data.to(torch.bfloat16)
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.bfloat16).eval()

    # the same drafter forward as our class on the same inputs
    mine = as_transformers_assistant(load_drafter(tmp_path), target)
    noise = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    context = torch.randn(1, 9, 128, dtype=torch.bfloat16)
    positions = torch.arange(13)[None]
    with torch.no_grad():
        a = glimmer(
            noise_embeds=noise, context_hidden_states=context, position_ids=positions
        ).last_hidden_state
        b = mine(noise_embeds=noise, context_hidden_states=context, position_ids=positions).last_hidden_state
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)

    ids = torch.tensor([[5, 17, 33, 80, 12, 9, 40]])
    plain = target.generate(ids, do_sample=False, max_new_tokens=16)
    speculative = target.generate(
        ids, do_sample=False, max_new_tokens=16, assistant_model=glimmer, speculation_type="dflash"
    )
    assert speculative.tolist() == plain.tolist()


def test_the_model_card_names_the_position_weighting_it_was_trained_with():
    assert weighted_by({"position_weighting": "dpace", "dpace_smoothing": 0.5}, 8).startswith("D-PACE")
    assert weighted_by({"position_weighting": "decay", "loss_gamma": None}, 8) == (
        "exp(-(k-1)/gamma), gamma 4 (the paper's for block 8)"
    )
    assert weighted_by({"position_weighting": "decay", "loss_gamma": 3.0, "loss_gamma_start": 1.0}, 8) == (
        "exp(-(k-1)/gamma), gamma moving linearly from 1 at the first step to 3 at the last"
    )


def test_the_model_card_names_the_loss_it_was_trained_with():
    assert scored_against({"loss": "ce"}) == "cross-entropy"
    assert scored_against({"loss": "tv", "target_topk": 8, "ce_weight": 0.1}) == (
        "total variation from the target's top-8 next-token distribution plus 0.1 x the token's cross-entropy"
    )
    assert scored_against({"loss": "kl", "target_topk": 4, "ce_weight": 0.0}).startswith("KL divergence")


def test_the_model_card_names_a_familys_own_loss_terms_and_their_weights():
    """DSpark trains its own loss, not the --loss the run records (ce); DFlash2 and LiLiCorr add their parts'."""
    dspark = {"drafter": "dspark", "loss": "ce", "target_topk": 64, "dspark_ce_alpha": 0.1}
    dspark |= {"dspark_l1_alpha": 0.9, "confidence_alpha": 0.0}
    assert scored_against(dspark) == (
        "DSpark's own loss: 0.1 x the cross-entropy of the Markov-biased logits + 0.9 x their L1 distance to the "
        "target's top-64 next-token distribution"
    )
    assert "+ 2 x the confidence head's BCE" in scored_against(dspark | {"confidence_alpha": 2.0})
    lilicorr = {"drafter": "lilicorr", "loss": "ce", "target_topk": 64, "lilicorr_ce_alpha": 0.25}
    lilicorr |= {"lilicorr_margin_alpha": 0.0, "lilicorr_penalty_alpha": 0.5}
    assert scored_against(lilicorr) == (
        "cross-entropy, plus the lattice correlator's 0.25 x its K-way cross-entropy given the true predecessor "
        "+ 0.5 x a penalty on candidates the target's top-64 ranks below the true one"
    )
    hinge = scored_against(lilicorr | {"lilicorr_margin_alpha": 0.1, "lilicorr_margin": 1.5})
    assert "+ 0.1 x a hinge of margin 1.5 +" in hinge
    dflash2 = {"drafter": "dflash2", "loss": "ce", "selector_loss_alpha": 1.0, "selector_top_k": 16}
    assert scored_against(dflash2) == (
        "cross-entropy plus 1 x the candidate selector's cross-entropy over the LM head's top 16, the previous "
        "token teacher-forced"
    )
    assert "selector left at its start" in scored_against(dflash2 | {"selector_loss_alpha": 0.0})


def test_a_checkpoint_from_before_a_family_setting_is_described_with_the_settings_default():
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert {k: defaults[k] for k in FAMILY_TERM_DEFAULTS} == FAMILY_TERM_DEFAULTS
    assert scored_against({"drafter": "dspark", "target_topk": 64}) == (
        "DSpark's own loss: 0.1 x the cross-entropy of the Markov-biased logits + 0.9 x their L1 distance to the "
        "target's top-64 next-token distribution + 1 x the confidence head's BCE against the acceptance that "
        "distance implies"
    )


def one_line_error(cmd: list[str]) -> str:
    """The command's stderr, which must be a single `error:` line with exit 2 and no traceback."""
    result = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, timeout=600)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def one_line_error_of(cli_main, argv: list[str], capsys) -> str:
    """As `one_line_error`, from the CLI's `main` called in this process (a process start saved)."""
    capsys.readouterr()
    code = cli_main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.processes
def test_a_damaged_weights_file_is_one_line_naming_it_wherever_it_is_read(
    tiny_target, chat_data, tmp_path, capsys
):
    """Cut short, or its header altered, a checkpoint's weights are named in one line by export (the real CLI
    once, then its `main`), an export's by export and evaluate."""
    from dflash_ddp.checkpoint.manifest import write_manifest
    from dflash_ddp.evaluate import main as evaluate
    from dflash_ddp.train import main as train

    from helpers import train_flags

    out = tmp_path / "run"
    assert train(train_flags(tiny_target, chat_data, out, max_steps=2, save_steps=2, eval_data="")) == 0
    ckpt = out / "checkpoints" / "step-00000002"
    weights = ckpt / "model.safetensors"
    intact = weights.read_bytes()
    export = [str(ckpt), str(tmp_path / "out")]

    weights.write_bytes(intact[:3000])  # cut short after the save: the manifest no longer matches
    assert f"{weights}: size or sha256 does not match the manifest" in one_line_error(
        ["dflash_ddp.export", *export]
    )
    write_manifest(ckpt, 2)  # written damaged (the manifest vouches for it): the read itself names it
    assert f"{weights}: not a readable safetensors file" in one_line_error_of(main, export, capsys)
    altered = bytearray(intact)
    altered[8:40] = b"x" * 32  # the header's JSON
    weights.write_bytes(bytes(altered))
    write_manifest(ckpt, 2)
    assert f"{weights}: not a readable safetensors file" in one_line_error_of(main, export, capsys)

    weights.write_bytes(intact)
    write_manifest(ckpt, 2)
    assert main(export) == 0
    exported = tmp_path / "out" / "model.safetensors"
    exported.write_bytes(exported.read_bytes()[:3000])  # an export has no manifest: the parse names it
    again = [str(tmp_path / "out"), str(tmp_path / "again")]
    assert f"{exported}: not a readable safetensors file" in one_line_error_of(main, again, capsys)
    evaluate_argv = ["--target_model", str(tiny_target), "--drafter", str(tmp_path / "out")]
    assert f"{exported}: not a readable safetensors file" in one_line_error_of(
        evaluate, [*evaluate_argv, "--data", str(chat_data)], capsys
    )


def test_a_sliding_window_run_exports_its_layer_types_and_decodes_losslessly(
    tiny_target, chat_data, tmp_path
):
    """--sliding_window 8 --sliding_layers 0 through the CLI: the run's own end-of-run decoding is lossless,
    and the export carries z-lab's layer_types / sliding_window (non-causal), which load back the same."""
    from dflash_ddp.serving.export import main as export_main
    from dflash_ddp.train import main as train_main

    from helpers import train_flags

    run, export = tmp_path / "run", tmp_path / "export"
    flags = train_flags(tiny_target, chat_data, run, num_draft_layers=2, sliding_window=8, sliding_layers=0)
    flags += ["--max_steps", "6", "--save_steps", "6", "--eval_data", str(chat_data), "--eval_prompts", "2"]
    assert train_main([*flags, "--eval_max_new_tokens", "24"]) == 0
    assert json.loads((run / "eval.json").read_text())["lossless"]
    assert export_main([str(run), str(export)]) == 0
    config = json.loads((export / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 8
    assert config["is_causal"] is False and config["use_sliding_window"] is True
    drafter = load_drafter(export)
    assert drafter.config.layer_types == config["layer_types"] and drafter.config.window_of(0) == 8


def test_the_card_shows_the_final_evaluation_of_its_own_step_only(tmp_path):
    """eval.json names the step it measured: a run that resumed past it (from a --max_steps 0 run's step 0, say)
    and ended without evaluating does not show it as its last checkpoint's; a file without a step still counts."""
    from dflash_ddp.serving.card import run_evaluation

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    state = {"global_step": 2, "total_steps": 2}
    for recorded, shown in (({"step": 0}, None), ({"step": 2}, 2.5), ({}, 2.5)):
        (run / "eval.json").write_text(json.dumps({**recorded, "tau": 2.5}))
        report, _ = run_evaluation(checkpoint, state)
        assert (report and report["tau"]) == shown


def test_an_export_never_overwrites_a_checkpoint_a_run_or_a_model(tmp_path, tiny_target, chat_data, capsys):
    """Arguments swapped, or the run's own folder named: the export is refused before it writes anything,
    the directory's files untouched; an empty folder or an earlier export is written (again)."""
    run, _, _ = fake_checkpoint(tmp_path, tiny_target, chat_data)
    ckpt = resolve_checkpoint(run)
    model = tmp_path / "target_copy"
    shutil.copytree(tiny_target, model)
    for out, message in [
        (ckpt, "holds the checkpoint being exported"),
        (run, "holds the checkpoint being exported"),
        (ckpt.parent, "holds the checkpoint being exported"),
        (model, "not empty and not an earlier export"),
    ]:
        before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        assert main([str(run), str(out)]) == 2
        assert message in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    other_run = tmp_path / "other_run"
    shutil.copytree(run, other_run)
    assert main([str(run), str(other_run)]) == 2
    assert "a training checkpoint or run" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(run), str(tmp_path / "empty")]) == 0
    assert "held an earlier export" not in capsys.readouterr().err
    assert main([str(run), str(tmp_path / "empty"), "--dtype", "float32"]) == 0  # an earlier export: again
    assert "held an earlier export (DFlashDraftModel of step 7): replaced" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("x")
    assert main([str(run), str(tmp_path / "a_file")]) == 2
    assert "a file; name a new directory" in capsys.readouterr().err


def test_an_export_of_an_export_carries_only_the_sections_it_can(tmp_path):
    """The training section is taken by its exact heading, whole even where a code block holds a `## ` line;
    an unmeasured source's acceptance line (naming the source) is written anew for the new export."""
    from dflash_ddp.serving.card import ACCEPTANCE, source_card_section

    source = tmp_path / "export"
    source.mkdir()
    (source / "README.md").write_text(
        "# d\n\n## Training Details\n\nby hand\n\n## Training\n\n- 7 optimizer steps\n```bash\n## not a heading\n"
        f"```\n\n{ACCEPTANCE}\n\nMeasure it with `... --drafter {source} ...`.\n\n## Serving\n"
    )
    assert source_card_section(source, "## Training") == [
        "## Training\n\n- 7 optimizer steps\n```bash\n## not a heading\n```",
        "",
    ]
    assert source_card_section(source, "## Acceptance") == []  # not its heading
    assert source_card_section(tmp_path / "none", "## Training") == []


def test_a_checkpoint_is_exported_only_as_its_manifest_vouches_for_it(tmp_path, capsys):
    """Export (and evaluate, through the same loader) read a checkpoint's weights against its manifest, as
    resume does: a checkpoint without one, or with weights changed since, is refused in one line."""
    from dflash_ddp.train import main as train_main

    run = tmp_path / "run"
    assert train_main(["--output_dir", str(run), "--max_steps", "1", "--eval_data", ""]) == 0
    checkpoint = resolve_checkpoint(run)
    assert main([str(run), str(tmp_path / "ok")]) == 0
    changed = tmp_path / "changed"
    shutil.copytree(checkpoint, changed)
    weights = bytearray((changed / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (changed / "model.safetensors").write_bytes(bytes(weights))
    capsys.readouterr()
    assert main([str(changed), str(tmp_path / "out1")]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    (changed / "manifest.json").unlink()
    assert main([str(changed), str(tmp_path / "out2")]) == 2
    assert "no manifest.json (the save did not complete)" in capsys.readouterr().err
