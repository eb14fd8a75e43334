"""The z-lab serving layout of the drafter (what SGLang, vLLM, speculators and transformers load): its config
and exact tensor names, to and from DFlashDraftConfig. A pure adapter, used by checkpoints and the export.
"""

from __future__ import annotations

from dflash_ddp.drafter.config import DFlashDraftConfig

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


def rope_scaling(rope_parameters: dict) -> dict | None:
    """The `rope_scaling` entry of configs written before transformers 5 (which reads `rope_parameters`):
    None for plain RoPE, else the scaling fields. Without it an older reader silently drops, e.g., Llama-3's
    RoPE scaling."""
    if rope_parameters.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope_parameters.items() if k != "rope_theta"}


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
