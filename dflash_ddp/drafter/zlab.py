"""The z-lab serving layout of the drafter (what SGLang, vLLM, speculators and transformers load): its config
and exact tensor names, to and from DFlashDraftConfig (and DFlash2DraftConfig, `DFlash2DraftModel` to the
engines). A pure adapter, used by checkpoints and the export.
"""

from __future__ import annotations

from dflash_ddp.drafter.config import SLIDING, DFlashDraftConfig
from dflash_ddp.drafter.families import architecture, config_class_for

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


def zlab_keys(num_layers: int, family: str = "dflash", markov_head_type: str | None = "vanilla") -> set[str]:
    """The exact tensor names of a z-lab drafter of `family` with `num_layers` layers (DSpark: with a Markov
    head of `markov_head_type`, None for none, and a confidence head)."""
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
    extra = ()
    if family == "dflash2":  # the codebooks are bare parameters: no ".weight"
        per_layer += [f"{conv}.{k}" for conv in ("attention_conv", "mlp_conv") for k in DFLASH2_CONV_KEYS]
        extra = DFLASH2_SELECTOR_KEYS
    if family == "dspark":
        extra = (*DSPARK_KEYS[None], *(DSPARK_KEYS[markov_head_type] if markov_head_type else ()))
    keys = {f"layers.{i}.{k}" for i in range(num_layers) for k in per_layer}
    return keys | {"fc.weight", "hidden_norm.weight", "norm.weight", *extra}


DFLASH2_CONV_KEYS = ("base_kernel", "kernel_projection.weight")
# vLLM's DSpark models load the vanilla head and the confidence head (gated and rnn heads are this project's
# and the reference's; vLLM refuses their extra tensors)
DSPARK_KEYS = {
    None: ("confidence_head.proj.weight", "confidence_head.proj.bias"),
    "vanilla": ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"),
    "gated": (
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "markov_head.gate_proj.weight",
        "markov_head.gate_proj.bias",
    ),
    "rnn": (
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "markov_head.joint_proj.weight",
        "markov_head.joint_proj.bias",
    ),
}
DFLASH2_SELECTOR_KEYS = (
    "candidate_selector.hidden_projection.weight",
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
)


def to_zlab_config(config: DFlashDraftConfig) -> dict:
    """The serving config.json: Qwen3 fields plus block_size, num_target_layers and dflash_config."""
    out = {"architectures": [architecture(config)], "model_type": "qwen3"}
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
    if config.slides:  # z-lab's and the engines' names; a DFlash export without sliding layers has none
        out.update(layer_types=list(config.layer_types), sliding_window=config.sliding_window)
        out["use_sliding_window"] = True
    if config.serving_fields or config.slides:
        # every attention layer sees its whole block (the engines' default for a sliding layer is causal)
        out["is_causal"] = False
        # a field left unset is left out: the engines read its absence as unset
        fields = {name: getattr(config, name) for name in config.serving_fields}
        out["dflash_config"].update({k: v for k, v in fields.items() if v is not None})
        if config.serving_top_level:  # vLLM's DSpark models read their fields at the top level
            out.update({k: v for k, v in fields.items() if v is not None}, **dict(config.top_level_serving))
    # The target's conventions, where it has any (Gemma, Falcon-H1): vLLM's DFlash2 and DSpark models read
    # them from dflash_config, its Gemma 4 DSpark model the soft-capping at the top level.
    if config.input_embedding_scale != 1.0:
        out["dflash_config"]["input_embedding_scale"] = config.input_embedding_scale
    if config.final_logit_softcapping:
        out["dflash_config"]["final_logit_softcapping"] = config.final_logit_softcapping
        out["final_logit_softcapping"] = config.final_logit_softcapping
    if config.logit_scale != 1.0:  # vLLM's DFlash model scales its logits by the top-level logit_scale
        out["logit_scale"] = out["dflash_config"]["logit_scale"] = config.logit_scale
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
    config_class = config_class_for(data.get("architectures"), where)
    layer_types = data.get("layer_types")
    slides = SLIDING in (layer_types or ())
    causal = data.get("is_causal", dflash.get("causal"))
    if causal or (causal is None and slides):  # z-lab reads a sliding layer as causal unless told otherwise
        raise ValueError(
            f"{where}: is_causal {causal}, layer_types {layer_types}: this project's drafters see their whole "
            "block in every layer; a drafter with causal layers cannot be loaded"
        )
    try:
        kwargs = {name: data[name] for name in _QWEN3_FIELDS if name in data}
        if "rope_parameters" not in data:
            kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": data["rope_theta"]}
        kwargs["mask_token_id"] = dflash.get("mask_token_id", data.get("mask_token_id"))
        kwargs["target_layer_ids"] = dflash.get("target_layer_ids", data.get("target_layer_ids"))
        kwargs["block_size"] = dflash["block_size"] if "block_size" in dflash else data["block_size"]
        kwargs["num_target_layers"] = data["num_target_layers"]
        if layer_types:
            kwargs["layer_types"] = layer_types
        if slides:  # vLLM reads dflash_config.swa_window_size first, then sliding_window
            window = dflash["swa_window_size"] if "swa_window_size" in dflash else data["sliding_window"]
            kwargs["sliding_window"] = window
        optional = {**_OPTIONAL_FIELDS, **config_class.optional_serving}
        for name in config_class.serving_fields:  # the engines look in dflash_config first, then the top
            value = dflash.get(name, data.get(name, optional.get(name, KeyError)))
            if value is KeyError:
                raise KeyError(f"dflash_config.{name}")
            kwargs[name] = value
        for name, default in _TARGET_CONVENTIONS.items():
            kwargs[name] = dflash.get(name, data.get(name, default))
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e}") from None
    for name in ("mask_token_id", "target_layer_ids", "hidden_size", "num_hidden_layers"):
        if kwargs.get(name) is None:
            raise ValueError(f"{where}: missing field '{name}'")
    if not kwargs.get("final_logit_softcapping"):  # the engines read none, 0 or less as no soft-capping
        kwargs.pop("final_logit_softcapping", None)
    config = config_class(**kwargs)
    errors = config.shape_errors()
    if errors:
        raise ValueError(f"{where}: " + "; ".join(errors))
    return config


# serving fields the engines default when a config leaves them out
_OPTIONAL_FIELDS = {
    "output_multiplier": 1.0,
    "markov_head_type": "vanilla",
    "enable_confidence_head": False,
    "confidence_head_with_markov": False,
}
# the target's conventions every family carries, and their values for a target without any
_TARGET_CONVENTIONS = {"input_embedding_scale": 1.0, "final_logit_softcapping": None, "logit_scale": 1.0}
