"""The serving export (z-lab layout) and loading drafters back."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_ddp.export import load_drafter, save_drafter, to_zlab_config, zlab_keys
from dflash_ddp.model import DFlashDraftConfig, DFlashDraftModel


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
    save_drafter(model, tmp_path)
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


def test_export_cli_from_a_checkpoint_directory(tmp_path):
    save_drafter(drafter(), tmp_path / "ckpt")
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
    bad = subprocess.run(
        [sys.executable, "-m", "dflash_ddp.export", str(tmp_path / "nowhere"), str(tmp_path / "o2")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "no config.json" in bad.stderr
