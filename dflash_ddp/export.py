"""Serving export in the z-lab layout (what SGLang, vLLM and speculators load), and its inverse.

`python -m dflash_ddp.export CHECKPOINT_DIR OUT_DIR` writes OUT_DIR/config.json and
OUT_DIR/model.safetensors with exactly the drafter's trainable tensors (no embedding, no LM head).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .model import DFlashDraftConfig, DFlashDraftModel, trainable_state_dict

_QWEN3_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "initializer_range",
)


def zlab_keys(num_layers: int) -> set[str]:
    """The exact tensor names of a z-lab DFlash drafter with `num_layers` layers."""
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    keys = {f"layers.{i}.{k}" for i in range(num_layers) for k in per_layer}
    return keys | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def to_zlab_config(config: DFlashDraftConfig) -> dict:
    """The serving config.json: Qwen3 fields plus block_size, num_target_layers and dflash_config."""
    out = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3"}
    out.update({name: getattr(config, name) for name in _QWEN3_FIELDS})
    # Older readers take rope_theta at the top level; newer ones read rope_parameters.
    out["rope_theta"] = config.rope_parameters.get("rope_theta")
    out.update(
        {
            "tie_word_embeddings": False,
            "attention_bias": False,
            "block_size": config.block_size,
            "num_target_layers": config.num_target_layers,
            "dflash_config": {
                "mask_token_id": config.mask_token_id,
                "target_layer_ids": list(config.target_layer_ids),
                "block_size": config.block_size,
            },
            "torch_dtype": "float32",
        }
    )
    return out


def from_zlab_config(data: dict, where: str = "config.json") -> DFlashDraftConfig:
    """Rebuild the drafter config from a z-lab config.json (or from our own saved config)."""
    dflash = data.get("dflash_config", {})
    try:
        kwargs = {name: data[name] for name in _QWEN3_FIELDS if name in data}
        if "rope_parameters" not in data:
            kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": data["rope_theta"]}
        kwargs["mask_token_id"] = dflash.get("mask_token_id", data.get("mask_token_id"))
        kwargs["target_layer_ids"] = dflash.get("target_layer_ids", data.get("target_layer_ids"))
        kwargs["block_size"] = dflash.get("block_size", data["block_size"])
        kwargs["num_target_layers"] = data["num_target_layers"]
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e}") from None
    for name in ("mask_token_id", "target_layer_ids", "hidden_size", "num_hidden_layers"):
        if kwargs.get(name) is None:
            raise ValueError(f"{where}: missing field '{name}'")
    return DFlashDraftConfig(**kwargs)


def save_drafter(model: DFlashDraftModel, out_dir: str | Path) -> None:
    """Write a drafter in the z-lab layout (fp32 weights)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.float().contiguous().cpu() for k, v in trainable_state_dict(model).items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(to_zlab_config(model.config), indent=2) + "\n")


def load_drafter(directory: str | Path, device: str | torch.device = "cpu") -> DFlashDraftModel:
    """Load a drafter from an exported directory or a training checkpoint; keys must match exactly."""
    directory = Path(directory)
    for name in ("config.json", "model.safetensors"):
        if not (directory / name).is_file():
            raise ValueError(
                f"{directory}: no {name} (expected an exported drafter or a checkpoint directory)"
            )
    config = from_zlab_config(
        json.loads((directory / "config.json").read_text()), str(directory / "config.json")
    )
    model = DFlashDraftModel(config)
    state = load_file(directory / "model.safetensors")
    expected = set(trainable_state_dict(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{directory}/model.safetensors: missing keys {missing}, unexpected keys {unexpected}"
        )
    own = trainable_state_dict(model)
    bad = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if state[k].shape != own[k].shape
    ]
    if bad:
        raise ValueError(f"{directory}/model.safetensors: shapes do not match its config.json: {bad}")
    model.load_state_dict(
        state, strict=False
    )  # buffers (rope tables) are not stored; every weight was checked
    return model.to(device).eval()


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Checkpoint directory (or an output directory: the checkpoint `latest` names) -> serving directory."""
    from .checkpoint import resolve_checkpoint  # checkpoint.py imports this module

    ckpt = resolve_checkpoint(Path(checkpoint_dir))
    model = load_drafter(ckpt)
    save_drafter(model, out_dir)
    return ckpt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print("usage: python -m dflash_ddp.export CHECKPOINT_DIR OUT_DIR", file=sys.stderr)
        return 2
    try:
        source = export_checkpoint(argv[0], argv[1])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {source} -> {argv[1]} (config.json, model.safetensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
