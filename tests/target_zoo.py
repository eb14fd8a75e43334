"""Tiny random-weight targets of the architectures a drafter is trained against, built from transformers' own
config classes and saved as `save_pretrained` writes them, in the class each checkpoint ships as.

Each config starts from its class's own defaults and is shrunk (`make_config`): every text stack has hidden
size 64, 4 attention heads of 16 (2 KV heads where the family has them), MLP width 128, MoE layers of 4 experts
of width 32 with 2 per token, 512 positions and untied embeddings unless tying is the family's convention
(Gemma), each where the class defines the field. Plain families have 4 layers; hybrid and heterogeneous ones the
fewest (at least 4) in which every layer kind occurs, with sliding windows and chunk sizes of 8 tokens so that
short sequences cross them. The vision-language wrappers carry a one-layer vision tower of width 32.
Special-token ids are left unset (the caller writes the tokenizer into the same directory) except Gemma's pad id
0, which its code needs. A setting the class does not define is refused, as no released checkpoint has it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.utils import is_timm_available

from dflash_ddp.target_model.text_stack import generating_part

WINDOW = 8
EXPERTS = 4
TOP_K = 2
EXPERT_WIDTH = 32
MLA_WIDTHS = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
GROUPED_EXPERTS = dict(first_k_dense_replace=1, n_group=2, topk_group=1)  # a dense first layer, then groups
# the zoo's shape, each field applied where the class defines it (Qwen3.5-MoE defines no `intermediate_size`,
# DeepSeek V4 has no dense MLP at all)
SHRINK = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    num_experts=EXPERTS,
    num_local_experts=EXPERTS,
    n_routed_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    moe_intermediate_size=EXPERT_WIDTH,
    shared_expert_intermediate_size=EXPERT_WIDTH,
)
TEXT_SHAPE = tuple(SHRINK)
SLIDING_THEN_FULL = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
LINEAR_THEN_FULL = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

Built = tuple[str, Any]
# stands for a released pickle: bytes that no loader reads without an error, so that a read fails the test
UNREADABLE_PICKLE = b"a pickle that dflash_ddp must never load"


def defined_fields(config_class: type) -> set[str]:
    """The fields a transformers config class defines: its dataclass fields, their aliases (`attribute_map`)
    and the legacy names its code reads from the keyword arguments (MiniMax-M2's `rotary_dim`)."""
    source = "".join(
        inspect.getsource(cls)
        for cls in config_class.__mro__
        if cls.__module__.startswith("transformers.models")
    )
    legacy = re.findall(r"kwargs\.(?:pop|get)\(\s*[\"'](\w+)[\"']", source)
    return {f.name for f in dataclasses.fields(config_class)} | set(config_class.attribute_map) | set(legacy)


def make_config(class_name: str, *, shrink: tuple[str, ...] = TEXT_SHAPE, **family) -> Any:
    """`class_name`'s config at its own defaults, shrunk (the SHRINK fields named in `shrink` that the class
    defines and sets: Gemma 4's experts stay off), with the family's settings on top. A setting the class does
    not define is refused: a released checkpoint's config.json has no such field, so a zoo target must not
    have it either."""
    config_class = getattr(transformers, class_name)
    fields = defined_fields(config_class)
    unknown = sorted(set(family) - fields)
    if unknown:
        raise TypeError(f"{class_name} defines no {', '.join(unknown)}: a checkpoint of it has no such field")
    own = {f.name for f in dataclasses.fields(config_class) if f.default is not None}  # not aliases
    shrunk = {k: SHRINK[k] for k in shrink if k in own}
    return config_class(**{**shrunk, **family})


def _mla(class_name: str, **family) -> Any:
    """A multi-head latent attention config: a KV head per query head, and the class's own `head_dim` (it
    derives it from the RoPE part)."""
    shape = tuple(k for k in TEXT_SHAPE if k != "head_dim")
    return make_config(class_name, shrink=shape, num_key_value_heads=4, **family)


def _wrapper(class_name: str, text: Any, vision: Any, **fields) -> Any:
    """A vision-language wrapper's config over `text` and `vision`, nothing of the text shape at its level."""
    return make_config(class_name, shrink=(), text_config=text, vision_config=vision, **fields)


def _unshrunk(class_name: str, **fields) -> Any:
    """A sub-model's config beside the text model (a vision or audio tower, a talker, a vocoder): none of the
    text shape, only what the family gives."""
    return make_config(class_name, shrink=(), **fields)


def _qwen3_5_text(class_name: str, vocab_size: int) -> Any:
    """A Qwen3.5 text config (dense or MoE): 3 gated-delta-net layers then 1 full-attention layer,
    interleaved M-RoPE."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    }
    return make_config(
        class_name,
        vocab_size=vocab_size,
        layer_types=LINEAR_THEN_FULL,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        rope_parameters=rope,
    )


# the vision towers of the wrappers: one layer of width 32, two heads
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def _qwen_vision(class_name: str) -> Any:
    """A one-block Qwen3.5 vision tower of width 32 that projects to the text width."""
    return _unshrunk(
        class_name,
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
    )


def _gemma3_text(vocab_size: int) -> Any:
    """A Gemma 3 text config: 3 sliding layers then 1 global, tied embeddings as Gemma ships."""
    return make_config(
        "Gemma3TextConfig",
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        pad_token_id=0,
        sliding_window=WINDOW,
        layer_types=SLIDING_THEN_FULL,
        query_pre_attn_scalar=16,
    )


def _on_device_gemma(vocab_size: int) -> dict:
    """What Gemma 3n and Gemma 4's small models share: tied embeddings, alternating sliding/global layers,
    per-layer input embeddings, and the last 2 layers reusing earlier layers' KV."""
    return dict(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        pad_token_id=0,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=vocab_size,
        num_kv_shared_layers=2,
    )


def _gemma4_text(vocab_size: int) -> Any:
    """A Gemma 4 (E2B-style) text config: alternating sliding/global layers, global layers with head size 32,
    per-layer input embeddings, the last 2 layers reusing earlier layers' KV, final logit softcapping."""
    return make_config(
        "Gemma4TextConfig",
        **_on_device_gemma(vocab_size),
        global_head_dim=32,
        final_logit_softcapping=30.0,
    )


def _kolibri(vocab_size: int) -> Built:
    """Kolibri 1.1: a dense first layer at its own width (`mlp_only_intermediate_size`, no
    `intermediate_size`), experts after it, 4 sliding layers then one whose sparse attention an indexer picks
    (the default top-k, past every test context)."""
    return "Kolibri1_1ForCausalLM", make_config(
        "Kolibri1_1Config",
        vocab_size=vocab_size,
        num_hidden_layers=5,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 4 + ["indexed_attention"],
        index_layers=[4],
        kv_source_layers=[0, 1, 2, 3, 4],
        index_num_heads=2,
        mlp_only_layers=[0],
        mlp_only_intermediate_size=128,
    )


def _plain(config_class: str, model_class: str, **family) -> Callable[[int], Built]:
    """A family whose tiny target is its shrunk defaults plus `family`."""

    def build(vocab_size: int) -> Built:
        return model_class, make_config(config_class, vocab_size=vocab_size, **family)

    build.__doc__ = f"{model_class} from {config_class}'s defaults, shrunk."
    return build


def _qwen3_5_text_only(vocab_size: int) -> Built:
    """Qwen3.5 text stack alone, as Qwen3_5ForCausalLM."""
    return "Qwen3_5ForCausalLM", _qwen3_5_text("Qwen3_5TextConfig", vocab_size)


def _qwen3_5(vocab_size: int) -> Built:
    """Qwen3.5 as shipped: the vision-language wrapper."""
    text = _qwen3_5_text("Qwen3_5TextConfig", vocab_size)
    config = _wrapper("Qwen3_5Config", text, _qwen_vision("Qwen3_5VisionConfig"), tie_word_embeddings=False)
    return "Qwen3_5ForConditionalGeneration", config


def _qwen3_5_moe_text_only(vocab_size: int) -> Built:
    """Qwen3.5-MoE / Qwen3.6-MoE text stack alone (experts and a shared expert, no dense MLP width)."""
    return "Qwen3_5MoeForCausalLM", _qwen3_5_text("Qwen3_5MoeTextConfig", vocab_size)


def _qwen3_5_moe(vocab_size: int) -> Built:
    """Qwen3.5-MoE / Qwen3.6-MoE as shipped: the vision-language wrapper over a sparse hybrid text stack."""
    config = _wrapper(
        "Qwen3_5MoeConfig",
        _qwen3_5_text("Qwen3_5MoeTextConfig", vocab_size),
        _qwen_vision("Qwen3_5MoeVisionConfig"),
        tie_word_embeddings=False,
    )
    return "Qwen3_5MoeForConditionalGeneration", config


def _qwen3_vl_moe(vocab_size: int) -> Built:
    """Qwen3-VL-MoE as shipped: the vision-language wrapper over a sparse text stack with interleaved
    multimodal rope, which transformers has no causal LM of (decoded as the wrapper, whose generation gives
    rows of multimodal positions)."""
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    text = make_config("Qwen3VLMoeTextConfig", vocab_size=vocab_size, rope_parameters=rope)
    config = _wrapper(
        "Qwen3VLMoeConfig", text, _qwen_vision("Qwen3VLMoeVisionConfig"), tie_word_embeddings=False
    )
    return "Qwen3VLMoeForConditionalGeneration", config


def _mllama(vocab_size: int) -> Built:
    """Llama 3.2 Vision as shipped: the wrapper over a text model that transformers builds only through its
    family's own class (no AutoModel of its config), 4 self-attention layers then a cross-attention layer
    (skipped on text; its released layouts put one after every 4), a config that requires token ids; a
    two-layer vision tower."""
    text = make_config(
        "MllamaTextConfig",
        vocab_size=vocab_size,
        num_hidden_layers=5,
        cross_attention_layers=[4],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    vision = _unshrunk(
        "MllamaVisionConfig",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=2,
        image_size=28,
        patch_size=14,
        vision_output_dim=64,
        intermediate_layers_indices=[0],
    )
    return "MllamaForConditionalGeneration", _wrapper("MllamaConfig", text, vision)


def _ernie4_5_vl_moe(vocab_size: int) -> Built:
    """Ernie 4.5 VL MoE as shipped: the wrapper over a text model with text and vision experts (widths per
    modality) that transformers builds only through its family's own class, saved in Baidu's layout (one
    expert list per layer, transposed gates), which only the wrapper's conversions read; a one-block vision
    tower."""
    rope = {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]}
    text = make_config(
        "Ernie4_5_VLMoeTextConfig",
        vocab_size=vocab_size,
        moe_intermediate_size=[EXPERT_WIDTH, 16],
        moe_num_experts=EXPERTS,
        moe_k=TOP_K,
        moe_num_shared_experts=1,
        rope_parameters=rope,
    )
    vision = _unshrunk(
        "Ernie4_5_VLMoeVisionConfig", depth=1, hidden_size=32, num_heads=2, intermediate_size=64
    )
    return "Ernie4_5_VLMoeForConditionalGeneration", _wrapper("Ernie4_5_VLMoeConfig", text, vision)


def _kimi_k25(vocab_size: int) -> Built:
    """Kimi K2.5 as shipped: the wrapper over a DeepSeek V3 text model (latent attention, a dense first layer,
    grouped-routing experts) and a one-block MoonViT tower; its conversions rename the original `blocks`."""
    text = _deepseek_v3(vocab_size)[1]
    vision = _unshrunk(
        "Kimi_K25VisionConfig",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        pos_emb_height=8,
        pos_emb_width=8,
    )
    config = _wrapper("Kimi_K25Config", text, vision, tie_word_embeddings=False)
    return "Kimi_K25ForConditionalGeneration", config


def _mistral_large4(vocab_size: int) -> Built:
    """Mistral Large 3 as shipped: the wrapper over latent attention with a sparse-attention indexer in every
    layer and experts after a dense first layer, its checkpoints in Mistral's original names (`tok_embeddings`,
    `layers.N.attention.wq`), which only the wrapper's conversions read; a one-block Pixtral tower."""
    text = _mla(
        "MistralLarge4TextConfig",
        vocab_size=vocab_size,
        layer_types=["indexed_attention"] * 4,
        index_head_dim=16,
        index_n_heads=2,
        index_topk=512,
        **MLA_WIDTHS,
        **GROUPED_EXPERTS,
    )
    vision = _unshrunk(
        "PixtralVisionConfig",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    return "MistralLarge4ForConditionalGeneration", _wrapper("MistralLarge4Config", text, vision)


# a one-block audio tower of Qwen's omni models, its output at the text width
OMNI_AUDIO = {
    "d_model": 32,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "output_dim": 64,
}


def _qwen3_omni_moe(vocab_size: int) -> Built:
    """Qwen3-Omni-MoE as its thinking releases ship: the omni class over a thinker (a sparse text model with
    interleaved multimodal rope, one-block vision and audio towers) without the talker that speaks; the class
    names no input embedding of its own (its thinker writes the text), and transformers' generation cannot
    prepare the thinker's position ids for a text prompt."""
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3], "interleaved": True}
    text = make_config("Qwen3OmniMoeTextConfig", vocab_size=vocab_size, rope_parameters=rope)
    vision = _unshrunk(
        "Qwen3OmniMoeVisionEncoderConfig",
        hidden_size=32,
        intermediate_size=64,
        depth=2,
        num_heads=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0],
        patch_size=4,
    )
    audio = _unshrunk("Qwen3OmniMoeAudioEncoderConfig", **OMNI_AUDIO, downsample_hidden_size=16)
    thinker = make_config(
        "Qwen3OmniMoeThinkerConfig", shrink=(), text_config=text, vision_config=vision, audio_config=audio
    )
    config = make_config("Qwen3OmniMoeConfig", shrink=(), thinker_config=thinker, enable_audio_output=False)
    return "Qwen3OmniMoeForConditionalGeneration", config


def _qwen2_5_omni(vocab_size: int) -> Built:
    """Qwen2.5-Omni as it ships: a thinker (dense text model, multimodal rope, one-block vision and audio
    towers) beside a talker that speaks and its token-to-wave vocoder; releases add the talker's voices as a
    pickle (`spk_dict.pt`, written by `build_zoo_target`), which the omni class's `from_pretrained` reads."""
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    text = make_config("Qwen2_5OmniTextConfig", vocab_size=vocab_size, rope_parameters=rope)
    vision = _unshrunk(
        "Qwen2_5OmniVisionEncoderConfig",
        hidden_size=32,
        intermediate_size=64,
        depth=1,
        num_heads=2,
        out_hidden_size=64,
        fullatt_block_indexes=[0],
        window_size=28,
    )
    audio = _unshrunk("Qwen2_5OmniAudioEncoderConfig", **OMNI_AUDIO)
    thinker = make_config(
        "Qwen2_5OmniThinkerConfig", shrink=(), text_config=text, vision_config=vision, audio_config=audio
    )
    talker = _unshrunk(
        "Qwen2_5OmniTalkerConfig",
        vocab_size=64,
        embedding_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=rope,
    )
    dit = _unshrunk(
        "Qwen2_5OmniDiTConfig",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=16,
        emb_dim=32,
        look_ahead_layers=[0],
        look_backward_layers=[1],
        enc_emb_dim=32,
        enc_dim=32,
        enc_channels=[32, 32, 32, 32, 96],
        enc_attention_channels=16,
        enc_se_channels=16,
    )
    vocoder = _unshrunk("Qwen2_5OmniBigVGANConfig", upsample_initial_channel=32)
    token2wav = make_config("Qwen2_5OmniToken2WavConfig", shrink=(), dit_config=dit, bigvgan_config=vocoder)
    config = make_config(
        "Qwen2_5OmniConfig",
        shrink=(),
        thinker_config=thinker,
        talker_config=talker,
        token2wav_config=token2wav,
    )
    return "Qwen2_5OmniForConditionalGeneration", config


def _blip_2(vocab_size: int) -> Built:
    """BLIP-2 over OPT as it ships: its text model's embedding is owned by the `OPTDecoder` one level below the
    `OPTModel` that loads (`language_model.model.decoder`); a one-block vision tower and Q-Former."""
    text = make_config("OPTConfig", vocab_size=vocab_size, ffn_dim=128, word_embed_proj_dim=64)
    layers = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision = _unshrunk("Blip2VisionConfig", image_size=28, patch_size=14, **layers)
    qformer = _unshrunk("Blip2QFormerConfig", encoder_hidden_size=32, **layers)
    config = make_config(
        "Blip2Config",
        shrink=(),
        text_config=text,
        vision_config=vision,
        qformer_config=qformer,
        num_query_tokens=4,
    )
    return "Blip2ForConditionalGeneration", config


def _inkling2(vocab_size: int) -> Built:
    """Inkling 2 as it ships: its checkpoints in the family's original names (`model.llm.embed`,
    `model.llm.unembed`, `embed_norm`), which transformers renames for the wrapper, for its causal LM and for
    its text model alike (a rename must not run twice); its vocabulary padded past the tokenizer's."""
    text = make_config(
        "Inkling2TextConfig",
        vocab_size=vocab_size + 20,
        unpadded_vocab_size=vocab_size,
        layer_types=["hybrid_sliding"] * 4,
    )
    vision = _unshrunk(
        "Inkling2VisionConfig",
        hidden_size=32,
        intermediate_size=64,
        mlp_ratio=2.0,
        num_attention_heads=2,
        num_hidden_layers=1,
        projection_hidden_dim=64,
        text_hidden_size=64,
    )
    return "Inkling2ForConditionalGeneration", _wrapper("Inkling2Config", text, vision)


def _qwen4_exp(vocab_size: int) -> Built:
    """Qwen4-exp: 4 hyper-connection streams passed side by side between its layers ([B, S, 4 x hidden]), 3
    gated-delta-net layers then one indexed sparse-attention layer, experts; a one-block vision tower."""
    text = make_config(
        "Qwen4ExpTextConfig",
        vocab_size=vocab_size,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        hc_lowrank=16,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=16,
        indexer_compress_ratio=4,
        split_ngram_parts=8,
    )
    vision = _unshrunk(
        "Qwen4ExpVisionConfig",
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_position_embeddings=16,
        out_hidden_size=64,
    )
    return "Qwen4ExpForConditionalGeneration", _wrapper("Qwen4ExpConfig", text, vision)


def _qwen3_next(vocab_size: int) -> Built:
    """Qwen3-Next: 3 gated-delta-net layers then 1 gated full-attention layer, every layer sparse."""
    config = make_config(
        "Qwen3NextConfig",
        vocab_size=vocab_size,
        layer_types=LINEAR_THEN_FULL,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    return "Qwen3NextForCausalLM", config


def _gemma2(vocab_size: int) -> Built:
    """Gemma 2: alternating sliding/global layers, attention and final logit soft-capping, tied embeddings."""
    config = make_config(
        "Gemma2Config",
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        pad_token_id=0,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=16,
    )
    return "Gemma2ForCausalLM", config


def _gemma3_text_only(vocab_size: int) -> Built:
    """Gemma 3 text-only (the 1B shape), as Gemma3ForCausalLM."""
    return "Gemma3ForCausalLM", _gemma3_text(vocab_size)


def _gemma3(vocab_size: int) -> Built:
    """Gemma 3 as shipped (4B and up): the wrapper with a one-layer SigLIP tower, 4 tokens per image."""
    vision = _unshrunk(
        "SiglipVisionConfig", **TINY_VISION, image_size=16, patch_size=4, vision_use_head=False
    )
    config = _wrapper("Gemma3Config", _gemma3_text(vocab_size), vision, mm_tokens_per_image=4)
    return "Gemma3ForConditionalGeneration", config


def _gemma4_text_only(vocab_size: int) -> Built:
    """Gemma 4 text stack alone, as Gemma4ForCausalLM."""
    return "Gemma4ForCausalLM", _gemma4_text(vocab_size)


def _gemma4(vocab_size: int) -> Built:
    """Gemma 4 as shipped: the wrapper with a one-layer vision tower (no audio tower)."""
    vision = _unshrunk(
        "Gemma4VisionConfig",
        **TINY_VISION,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=4,
        position_embedding_size=64,
    )
    config = _wrapper("Gemma4Config", _gemma4_text(vocab_size), vision)
    return "Gemma4ForConditionalGeneration", config


def _gemma3n(vocab_size: int) -> Built:
    """Gemma 3n as shipped (E2B, E4B): the wrapper over an on-device Gemma text stack that passes 4 AltUp
    streams between its layers, its MLP width and activation sparsity given per layer (the first layers'
    95%); a one-layer audio tower, and in place of its timm vision tower a stand-in (`build_model`)."""
    text = make_config(
        "Gemma3nTextConfig",
        **_on_device_gemma(vocab_size),
        laurel_rank=8,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
    )
    audio = _unshrunk(
        "Gemma3nAudioConfig", hidden_size=32, conf_num_attention_heads=2, conf_num_hidden_layers=1
    )
    vision = _unshrunk("Gemma3nVisionConfig", hidden_size=32)
    config = _wrapper("Gemma3nConfig", text, vision, audio_config=audio)
    return "Gemma3nForConditionalGeneration", config


class TimmStandIn(torch.nn.Module):
    """In place of Gemma 3n's vision tower, a MobileNet that transformers builds through timm (which this
    project does not install): one convolution under its stem's name, so that the saved release holds
    vision weights beside its text model, as a real one does."""

    def __init__(self, config: Any):
        super().__init__()
        self.timm_model = torch.nn.Module()
        self.timm_model.conv_stem = torch.nn.Conv2d(3, config.hidden_size, 3)


def build_model(model_class: type, config: Any) -> Any:
    """`model_class(config)`, with `TimmStandIn` for a timm vision tower where timm is not installed."""
    own = transformers.AutoModel.__dict__["from_config"]
    build = transformers.AutoModel.from_config

    def from_config(sub_config, **kwargs):
        if type(sub_config).__name__ == "Gemma3nVisionConfig" and not is_timm_available():
            return TimmStandIn(sub_config)
        return build(sub_config, **kwargs)

    transformers.AutoModel.from_config = from_config
    try:
        return model_class(config)
    finally:
        transformers.AutoModel.from_config = own


def _mistral3(vocab_size: int) -> Built:
    """Mistral Small 3.x as shipped: the wrapper with a Mistral text stack and a one-layer Pixtral tower."""
    text = make_config("MistralConfig", vocab_size=vocab_size, sliding_window=None)
    vision = _unshrunk("PixtralVisionConfig", **TINY_VISION, image_size=16, patch_size=4)
    config = _wrapper("Mistral3Config", text, vision, tie_word_embeddings=False)
    return "Mistral3ForConditionalGeneration", config


def _gpt_oss(vocab_size: int) -> Built:
    """gpt-oss: alternating sliding/full layers with attention sinks, every layer sparse, YaRN RoPE scaled by
    32 as shipped (from an original context of 512 / 32 positions, so that the factor is consistent)."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 150_000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    }
    config = make_config(
        "GptOssConfig",
        vocab_size=vocab_size,
        rope_parameters=rope,
        intermediate_size=EXPERT_WIDTH,  # gpt-oss's experts' width
        sliding_window=WINDOW,
    )
    return "GptOssForCausalLM", config


def _llama4_text_config(vocab_size: int) -> Any:
    """A Llama 4 text config: 3 chunked-attention RoPE layers then 1 global NoPE layer, dense and MoE layers
    alternating, and a NoPE attention temperature that grows every 8 positions (shipped: 8192) so that short
    sequences reach it."""
    return make_config(
        "Llama4TextConfig",
        vocab_size=vocab_size,
        intermediate_size=EXPERT_WIDTH,  # Llama 4's experts' width; its dense layers' is intermediate_size_mlp
        intermediate_size_mlp=128,
        interleave_moe_layer_step=2,
        attention_chunk_size=WINDOW,
        floor_scale=WINDOW,
    )


def _llama4_text(vocab_size: int) -> Built:
    """Llama 4 text stack as Llama4ForCausalLM."""
    return "Llama4ForCausalLM", _llama4_text_config(vocab_size)


def _llama4(vocab_size: int) -> Built:
    """Llama 4 as shipped (Scout, Maverick): the wrapper with a one-layer vision tower."""
    vision = _unshrunk(
        "Llama4VisionConfig",
        **TINY_VISION,
        image_size=16,
        patch_size=4,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    config = _wrapper("Llama4Config", _llama4_text_config(vocab_size), vision)
    return "Llama4ForConditionalGeneration", config


def _deepseek_v3(vocab_size: int) -> Built:
    """DeepSeek-V3: multi-head latent attention, 1 dense layer then grouped-routing MoE layers."""
    config = _mla(
        "DeepseekV3Config",
        vocab_size=vocab_size,
        q_lora_rank=32,
        n_shared_experts=1,
        **MLA_WIDTHS,
        **GROUPED_EXPERTS,
    )
    return "DeepseekV3ForCausalLM", config


def _deepseek_v4(vocab_size: int) -> Built:
    """DeepSeek V4: 4 hyper-connection residual streams, a sliding-window layer then layers attending to
    compressed and sparsely indexed keys (compression every 2 and 4 tokens, windows of 8), hash-routed then
    learned-routed experts with a shared one, no dense MLP. The indexer keeps its 512 blocks: transformers'
    implementation gives other logits with its cache than without once a context has more blocks than that."""
    config = make_config(
        "DeepseekV4Config",
        vocab_size=vocab_size,
        head_dim=32,
        partial_rotary_factor=0.25,
        q_lora_rank=32,
        o_lora_rank=32,
        o_groups=2,
        n_shared_experts=1,
        sliding_window=WINDOW,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        index_n_heads=2,
        index_head_dim=16,
        num_nextn_predict_layers=0,
    )
    return "DeepseekV4ForCausalLM", config


def _glm4_moe(vocab_size: int) -> Built:
    """GLM-4.5: QK-norm and biased QKV, half-rotary, 1 dense layer then MoE layers with a shared expert."""
    config = make_config(
        "Glm4MoeConfig",
        vocab_size=vocab_size,
        attention_bias=True,
        use_qk_norm=True,
        first_k_dense_replace=1,
        n_shared_experts=1,
    )
    return "Glm4MoeForCausalLM", config


def _glm_moe_dsa(vocab_size: int) -> Built:
    """GLM-5 as zai-org releases it (`GlmMoeDsaForCausalLM`): multi-head latent attention with DeepSeek Sparse
    Attention's indexer, a dense first layer then MoE layers with a shared expert."""
    config = _mla(
        "GlmMoeDsaConfig",
        vocab_size=vocab_size,
        q_lora_rank=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        index_n_heads=2,
        index_head_dim=16,
        **MLA_WIDTHS,
    )
    return "GlmMoeDsaForCausalLM", config


def _glm5_next_text(vocab_size: int) -> Any:
    """A GLM-5 text config: 4 hyper-connection residual streams, linear-attention layers then an indexed
    sparse MLA layer, dense then sparse MLPs."""
    return _mla(
        "Glm5NextTextConfig",
        vocab_size=vocab_size,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_shared_experts=1,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        indexer_types=["full"] * 4,
        index_head_dim=16,
        index_n_heads=2,
        index_kpool=2,
        linear_head_dim=16,
        linear_num_heads=4,
    )


def _glm5_next(vocab_size: int) -> Built:
    """GLM-5 as shipped: the vision-language wrapper over the hyper-connection text stack."""
    vision = _unshrunk(
        "Glm5NextVisionConfig",
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        out_hidden_size=64,
        projection_intermediate_size=64,
    )
    config = _wrapper("Glm5NextConfig", _glm5_next_text(vocab_size), vision)
    return "Glm5NextForConditionalGeneration", config


def _nemotron_h(vocab_size: int) -> Built:
    """Nemotron-H: one block each of Mamba-2, MoE, attention and ReLU² MLP (the default pattern, saved under
    `backbone.`); Mamba chunks of 8 tokens."""
    config = make_config(
        "NemotronHConfig",
        vocab_size=vocab_size,
        layer_types=["linear_attention", "moe", "full_attention", "mlp"],
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=WINDOW,
        moe_shared_expert_intermediate_size=EXPERT_WIDTH,
        n_shared_experts=1,
    )
    return "NemotronHForCausalLM", config


def _nemotron_h_omni(vocab_size: int) -> Built:
    """Nemotron 3 Nano Omni: a Nemotron-H causal LM (its experts saved one by one, merged as it loads) beside a
    one-block RADIO vision tower; the wrapper names no LM head of its own (its causal LM's writes the text)."""
    text = _nemotron_h(vocab_size)[1]
    vision = _unshrunk(
        "RadioConfig",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        mlp_ratio=2.0,
        video_temporal_patch_size=2,
        max_img_size=64,
        image_size=32,
    )
    config = make_config(
        "NemotronH_Omni_Reasoning_V3_Config",
        shrink=(),
        text_config=text,
        vision_config=vision,
        projector_hidden_size=64,
        vision_hidden_size=32,
    )
    return "NemotronH_Omni_Reasoning_V3", config


def _falcon_h1(vocab_size: int) -> Built:
    """Falcon-H1: every layer runs attention and Mamba-2 in parallel; Mamba chunks of 8 tokens and, as the
    released checkpoints do, non-unit embedding and LM-head multipliers."""
    config = make_config(
        "FalconH1Config",
        vocab_size=vocab_size,
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_chunk_size=WINDOW,
        embedding_multiplier=4.0,
        lm_head_multiplier=0.25,
    )
    return "FalconH1ForCausalLM", config


def _kimi_linear(vocab_size: int) -> Built:
    """Kimi Linear: 3 KDA (linear) layers then 1 NoPE MLA layer, 1 dense layer then MoE layers."""
    config = _mla(
        "KimiLinearConfig",
        vocab_size=vocab_size,
        layer_types=LINEAR_THEN_FULL,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        q_lora_rank=None,
        linear_head_dim=16,
        linear_num_heads=4,
        n_shared_experts=1,
        **MLA_WIDTHS,
    )
    return "KimiLinearForCausalLM", config


def _minimax_m2(vocab_size: int) -> Built:
    """MiniMax-M2: full attention with QK-norm and half-rotary heads, every layer sparse."""
    config = make_config(
        "MiniMaxM2Config", vocab_size=vocab_size, intermediate_size=EXPERT_WIDTH, rotary_dim=8
    )
    return "MiniMaxM2ForCausalLM", config


def _exaone4(vocab_size: int) -> Built:
    """EXAONE 4.0: 3 sliding layers then 1 global NoPE layer, post-norm blocks with QK-norm."""
    config = make_config(
        "Exaone4Config",
        vocab_size=vocab_size,
        sliding_window=WINDOW,
        sliding_window_pattern=4,
        layer_types=SLIDING_THEN_FULL,
    )
    return "Exaone4ForCausalLM", config


def _smollm3(vocab_size: int) -> Built:
    """SmolLM3: every 4th layer without RoPE (NoPE), tied embeddings as shipped."""
    config = make_config("SmolLM3Config", vocab_size=vocab_size, tie_word_embeddings=True)
    return "SmolLM3ForCausalLM", config


def _granite(vocab_size: int) -> Built:
    """Granite 3: the embedding, residual, attention and logit multipliers of the released checkpoints."""
    config = make_config(
        "GraniteConfig",
        vocab_size=vocab_size,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0,
    )
    return "GraniteForCausalLM", config


def _longcat_flash(vocab_size: int) -> Built:
    """LongCat-Flash: two latent-attention and two dense MLP sublayers in each decoder layer beside a shortcut
    MoE with zero (identity) experts; `num_hidden_layers` counts the attention layers, `num_layers` the
    decoder layers (4, as every zoo target)."""
    return "LongcatFlashForCausalLM", _mla(
        "LongcatFlashConfig",
        vocab_size=vocab_size,
        num_layers=4,
        ffn_hidden_size=128,
        expert_ffn_hidden_size=EXPERT_WIDTH,
        moe_topk=TOP_K,
        zero_expert_num=2,
        q_lora_rank=32,
        head_dim=8,
        **MLA_WIDTHS,
    )


# DBRX's rope base as its checkpoints give it: in `attn_config`, where transformers 5 no longer reads it
DBRX_ROPE_THETA = 500000.0


def _dbrx(vocab_size: int) -> Built:
    """DBRX: its KV heads in `attn_config`, its experts' count, width and top-k in `ffn_config`, every layer
    sparse, decoder layers at `transformer.blocks`; the sub-configs as DBRX's config.json writes them."""
    attention = {"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": DBRX_ROPE_THETA}
    experts = {"ffn_hidden_size": EXPERT_WIDTH, "moe_num_experts": EXPERTS, "moe_top_k": TOP_K}
    return "DbrxForCausalLM", make_config(
        "DbrxConfig",
        vocab_size=vocab_size,
        d_model=64,
        n_heads=4,
        n_layers=4,
        max_seq_len=512,
        attn_config=attention,
        ffn_config=experts,
    )


ZOO: dict[str, Callable[[int], Built]] = {
    "llama": _plain("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": _plain("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _plain("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": _plain("Qwen3MoeConfig", "Qwen3MoeForCausalLM", norm_topk_prob=True),
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "qwen3_5_text": _qwen3_5_text_only,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_5_moe_text": _qwen3_5_moe_text_only,
    "qwen3_vl_moe": _qwen3_vl_moe,
    "mllama": _mllama,
    "ernie4_5_vl_moe": _ernie4_5_vl_moe,
    "kimi_k25": _kimi_k25,
    "mistral_large4": _mistral_large4,
    "qwen3_omni_moe": _qwen3_omni_moe,
    "qwen2_5_omni": _qwen2_5_omni,
    "blip_2": _blip_2,
    "inkling2": _inkling2,
    "qwen4_exp": _qwen4_exp,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3_text_only,
    "gemma4": _gemma4,
    "gemma4_text": _gemma4_text_only,
    "gemma3n": _gemma3n,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "llama4_text": _llama4_text,
    "mistral": _plain("MistralConfig", "MistralForCausalLM", sliding_window=None),
    "mistral3": _mistral3,
    "phi3": _plain("Phi3Config", "Phi3ForCausalLM"),
    "granite": _granite,
    "olmo2": _plain("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": _plain("Olmo3Config", "Olmo3ForCausalLM", sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
    "deepseek_v3": _deepseek_v3,
    "deepseek_v4": _deepseek_v4,
    "glm4_moe": _glm4_moe,
    "glm_moe_dsa": _glm_moe_dsa,
    "glm5_next": _glm5_next,
    "minimax_m2": _minimax_m2,
    "minimax": _plain("MiniMaxConfig", "MiniMaxForCausalLM"),  # lightning attention; a cache of its own
    "nemotron_h": _nemotron_h,
    "nemotron_h_omni": _nemotron_h_omni,
    "kimi_linear": _kimi_linear,
    "falcon_h1": _falcon_h1,
    "exaone4": _exaone4,
    "smollm3": _smollm3,
    "seed_oss": _plain("SeedOssConfig", "SeedOssForCausalLM"),
    "kolibri1_1": _kolibri,
    # older layouts, in their own field names: decoder layers at `transformer.h` or `.blocks`, the MLP's width
    # under other names or none, ALiBi instead of position ids
    "falcon": _plain("FalconConfig", "FalconForCausalLM", ffn_hidden_size=128),  # 7B's: one KV head, parallel
    "gpt_bigcode": _plain(  # StarCoder: one KV head
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        n_embd=64,
        n_layer=4,
        n_head=4,
        n_inner=128,
        n_positions=512,
    ),
    "bloom": _plain("BloomConfig", "BloomForCausalLM", n_layer=4, n_head=4),  # ALiBi, an MLP of 4x hidden
    "mpt": _plain(  # ALiBi, `use_cache` false as MPT ships
        "MptConfig", "MptForCausalLM", d_model=64, n_layers=4, n_heads=4, expansion_ratio=2, max_seq_len=512
    ),
    "opt": _plain("OPTConfig", "OPTForCausalLM", ffn_dim=128, word_embed_proj_dim=64),
    "dbrx": _dbrx,
    "longcat_flash": _longcat_flash,
}
ZOO_NAMES = tuple(ZOO)


def zoo_config(name: str, vocab_size: int) -> tuple[type, Any]:
    """The model class that `name` ships as and its tiny config."""
    model_class, config = ZOO[name](vocab_size)
    return getattr(transformers, model_class), config


def build_zoo_target(
    name: str, out: Path, vocab_size: int, seed: int = 0, unwritten: tuple[int, ...] = ()
) -> None:
    """Build the tiny `name` target with random weights from `seed` and save it to `out` (safetensors). Tokens
    in `unwritten` get LM-head rows of zeros, whose logit of 0 a random model never ranks first: its decoding
    writes the tokens a test asks for instead of stopping where it happens to draw the end of a turn."""
    model_class, config = zoo_config(name, vocab_size)
    torch.manual_seed(seed)
    model = build_model(model_class, config)
    writer = generating_part(model, config.get_text_config(decoder=True))[1]  # Omni: its thinker's head
    with torch.no_grad():
        writer.get_output_embeddings().weight[list(unwritten)] = 0
    model.save_pretrained(out)
    if getattr(model, "has_talker", False):  # Qwen2.5-Omni's voices: a pickle, which no part may read
        (out / "spk_dict.pt").write_bytes(UNREADABLE_PICKLE)
