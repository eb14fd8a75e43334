"""Tiny random-weight targets of the architectures a drafter is trained against, built from transformers' own
config classes and saved as `save_pretrained` writes them, in the class each checkpoint ships as.

Every text stack has hidden size 64, 4 attention heads of 16 (2 KV heads where the family has them), MLP width
128, MoE layers of 4 experts of width 32 with 2 per token, 512 positions and untied embeddings unless tying is
the family's convention (Gemma). Plain families have 4 layers; hybrid and heterogeneous ones the fewest (at least
4) in which every layer kind occurs, with sliding windows and chunk sizes of 8 tokens so that short sequences
cross them. The vision-language wrappers carry a one-layer vision tower of width 32. Special-token ids are left
unset (the caller writes the tokenizer into the same directory) except Gemma's pad id 0, which its code needs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

WINDOW = 8
DENSE = dict(
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
)
EXPERTS = 4
TOP_K = 2
EXPERT_WIDTH = 32
SLIDING_THEN_FULL = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
LINEAR_THEN_FULL = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

Built = tuple[str, Any]


def _dense(**overrides) -> dict:
    """The shared dense shape, with family-specific settings on top."""
    return {**DENSE, **overrides}


def _mla(**overrides) -> dict:
    """The shared shape for multi-head latent attention: a KV head per query head, and no `head_dim` (the
    config derives it from the RoPE part)."""
    settings = _dense(num_key_value_heads=4, **overrides)
    del settings["head_dim"]
    return settings


def _qwen3_5_text(config_class: str, vocab_size: int, **moe) -> Any:
    """A Qwen3.5 text config: 3 gated-delta-net layers then 1 full-attention layer, interleaved M-RoPE."""
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    }
    return getattr(transformers, config_class)(
        **_dense(
            vocab_size=vocab_size,
            layer_types=LINEAR_THEN_FULL,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            rope_parameters=rope,
            **moe,
        )
    )


# the vision towers of the wrappers: one layer of width 32, two heads
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def _qwen_vision(config_class: str) -> Any:
    """A one-block Qwen3.5 vision tower of width 32 that projects to the text width."""
    return getattr(transformers, config_class)(
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
    return transformers.Gemma3TextConfig(
        **_dense(
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            pad_token_id=0,
            sliding_window=WINDOW,
            layer_types=SLIDING_THEN_FULL,
            query_pre_attn_scalar=16,
        )
    )


def _gemma4_text(vocab_size: int) -> Any:
    """A Gemma 4 (E2B-style) text config: alternating sliding/global layers, global layers with head size 32,
    per-layer input embeddings, the last 2 layers reusing earlier layers' KV, final logit softcapping."""
    return transformers.Gemma4TextConfig(
        **_dense(
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            pad_token_id=0,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            global_head_dim=32,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=vocab_size,
            num_kv_shared_layers=2,
            final_logit_softcapping=30.0,
        )
    )


def _llama(vocab_size: int) -> Built:
    """Llama 3."""
    return "LlamaForCausalLM", transformers.LlamaConfig(**_dense(vocab_size=vocab_size))


def _qwen3(vocab_size: int) -> Built:
    """Qwen3 (dense, QK-norm)."""
    return "Qwen3ForCausalLM", transformers.Qwen3Config(**_dense(vocab_size=vocab_size))


def _qwen3_moe(vocab_size: int) -> Built:
    """Qwen3-MoE: every layer sparse."""
    config = transformers.Qwen3MoeConfig(
        **_dense(
            vocab_size=vocab_size,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH,
            norm_topk_prob=True,
        )
    )
    return "Qwen3MoeForCausalLM", config


def _qwen3_5_text_only(vocab_size: int) -> Built:
    """Qwen3.5 text stack alone, as Qwen3_5ForCausalLM."""
    return "Qwen3_5ForCausalLM", _qwen3_5_text("Qwen3_5TextConfig", vocab_size)


def _qwen3_5(vocab_size: int) -> Built:
    """Qwen3.5 as shipped: the vision-language wrapper."""
    text = _qwen3_5_text("Qwen3_5TextConfig", vocab_size)
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config=_qwen_vision("Qwen3_5VisionConfig"), tie_word_embeddings=False
    )
    return "Qwen3_5ForConditionalGeneration", config


def _qwen3_5_moe(vocab_size: int) -> Built:
    """Qwen3.5-MoE as shipped: the vision-language wrapper over a sparse hybrid text stack."""
    text = _qwen3_5_text(
        "Qwen3_5MoeTextConfig",
        vocab_size,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=EXPERT_WIDTH,
        shared_expert_intermediate_size=EXPERT_WIDTH,
    )
    config = transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=_qwen_vision("Qwen3_5MoeVisionConfig"), tie_word_embeddings=False
    )
    return "Qwen3_5MoeForConditionalGeneration", config


def _qwen3_next(vocab_size: int) -> Built:
    """Qwen3-Next: 3 gated-delta-net layers then 1 gated full-attention layer, every layer sparse."""
    config = transformers.Qwen3NextConfig(
        **_dense(
            vocab_size=vocab_size,
            layer_types=LINEAR_THEN_FULL,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH,
            shared_expert_intermediate_size=EXPERT_WIDTH,
        )
    )
    return "Qwen3NextForCausalLM", config


def _gemma3_text_only(vocab_size: int) -> Built:
    """Gemma 3 text-only (the 1B shape), as Gemma3ForCausalLM."""
    return "Gemma3ForCausalLM", _gemma3_text(vocab_size)


def _gemma3(vocab_size: int) -> Built:
    """Gemma 3 as shipped (4B and up): the wrapper with a one-layer SigLIP tower, 4 tokens per image."""
    vision = transformers.SiglipVisionConfig(
        **TINY_VISION,
        image_size=16,
        patch_size=4,
        vision_use_head=False,
    )
    config = transformers.Gemma3Config(
        text_config=_gemma3_text(vocab_size), vision_config=vision, mm_tokens_per_image=4
    )
    return "Gemma3ForConditionalGeneration", config


def _gemma4_text_only(vocab_size: int) -> Built:
    """Gemma 4 text stack alone, as Gemma4ForCausalLM."""
    return "Gemma4ForCausalLM", _gemma4_text(vocab_size)


def _gemma4(vocab_size: int) -> Built:
    """Gemma 4 as shipped: the wrapper with a one-layer vision tower (no audio tower)."""
    vision = transformers.Gemma4VisionConfig(
        **TINY_VISION,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=4,
        position_embedding_size=64,
    )
    config = transformers.Gemma4Config(text_config=_gemma4_text(vocab_size), vision_config=vision)
    return "Gemma4ForConditionalGeneration", config


def _mistral3(vocab_size: int) -> Built:
    """Mistral Small 3.x as shipped: the wrapper with a Mistral text stack and a one-layer Pixtral tower."""
    text = transformers.MistralConfig(**_dense(vocab_size=vocab_size, sliding_window=None))
    vision = transformers.PixtralVisionConfig(
        **TINY_VISION,
        image_size=16,
        patch_size=4,
    )
    config = transformers.Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
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
    config = transformers.GptOssConfig(
        **_dense(
            vocab_size=vocab_size,
            rope_parameters=rope,
            intermediate_size=EXPERT_WIDTH,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            sliding_window=WINDOW,
        )
    )
    return "GptOssForCausalLM", config


def _llama4_text(vocab_size: int) -> Built:
    """Llama 4 text stack as Llama4ForCausalLM: 3 chunked-attention RoPE layers then 1 global NoPE layer,
    dense and MoE layers alternating, and a NoPE attention temperature that grows every 8 positions (shipped:
    8192) so that short sequences reach it."""
    config = transformers.Llama4TextConfig(
        **_dense(
            vocab_size=vocab_size,
            intermediate_size=EXPERT_WIDTH,
            intermediate_size_mlp=128,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            interleave_moe_layer_step=2,
            attention_chunk_size=WINDOW,
            floor_scale=WINDOW,
        )
    )
    return "Llama4ForCausalLM", config


def _deepseek_v3(vocab_size: int) -> Built:
    """DeepSeek-V3: multi-head latent attention, 1 dense layer then grouped-routing MoE layers."""
    config = transformers.DeepseekV3Config(
        **_mla(
            vocab_size=vocab_size,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            first_k_dense_replace=1,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
        )
    )
    return "DeepseekV3ForCausalLM", config


def _glm4_moe(vocab_size: int) -> Built:
    """GLM-4.5: QK-norm and biased QKV, half-rotary, 1 dense layer then MoE layers with a shared expert."""
    config = transformers.Glm4MoeConfig(
        **_dense(
            vocab_size=vocab_size,
            attention_bias=True,
            use_qk_norm=True,
            first_k_dense_replace=1,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH,
            n_shared_experts=1,
        )
    )
    return "Glm4MoeForCausalLM", config


def _olmo3(vocab_size: int) -> Built:
    """OLMo 3: 3 sliding layers then 1 full, post-norm blocks with QK-norm."""
    config = transformers.Olmo3Config(
        **_dense(vocab_size=vocab_size, sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL)
    )
    return "Olmo3ForCausalLM", config


def _nemotron_h(vocab_size: int) -> Built:
    """Nemotron-H: one block each of Mamba-2, MoE, attention and ReLU² MLP (the default pattern, saved under
    `backbone.`); Mamba chunks of 8 tokens."""
    config = transformers.NemotronHConfig(
        **_dense(
            vocab_size=vocab_size,
            num_hidden_layers=None,
            layer_types=["linear_attention", "moe", "full_attention", "mlp"],
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            chunk_size=WINDOW,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH,
            moe_shared_expert_intermediate_size=EXPERT_WIDTH,
            n_shared_experts=1,
        )
    )
    return "NemotronHForCausalLM", config


def _falcon_h1(vocab_size: int) -> Built:
    """Falcon-H1: every layer runs attention and Mamba-2 in parallel; Mamba chunks of 8 tokens and, as the
    released checkpoints do, non-unit embedding and LM-head multipliers."""
    config = transformers.FalconH1Config(
        **_dense(
            vocab_size=vocab_size,
            mamba_d_ssm=128,
            mamba_n_heads=8,
            mamba_d_state=16,
            mamba_chunk_size=WINDOW,
            embedding_multiplier=4.0,
            lm_head_multiplier=0.25,
        )
    )
    return "FalconH1ForCausalLM", config


def _kimi_linear(vocab_size: int) -> Built:
    """Kimi Linear: 3 KDA (linear) layers then 1 NoPE MLA layer, 1 dense layer then MoE layers."""
    config = transformers.KimiLinearConfig(
        **_mla(
            vocab_size=vocab_size,
            layer_types=LINEAR_THEN_FULL,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            linear_head_dim=16,
            linear_num_heads=4,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH,
            n_shared_experts=1,
        )
    )
    return "KimiLinearForCausalLM", config


def _minimax_m2(vocab_size: int) -> Built:
    """MiniMax-M2: full attention with QK-norm and half-rotary heads, every layer sparse."""
    config = transformers.MiniMaxM2Config(
        **_dense(
            vocab_size=vocab_size,
            intermediate_size=EXPERT_WIDTH,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            rotary_dim=8,
        )
    )
    return "MiniMaxM2ForCausalLM", config


ZOO: dict[str, Callable[[int], Built]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "qwen3_5_text": _qwen3_5_text_only,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_next": _qwen3_next,
    "gemma3_text": _gemma3_text_only,
    "gemma3": _gemma3,
    "gemma4_text": _gemma4_text_only,
    "gemma4": _gemma4,
    "mistral3": _mistral3,
    "gpt_oss": _gpt_oss,
    "llama4_text": _llama4_text,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "olmo3": _olmo3,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "kimi_linear": _kimi_linear,
    "minimax_m2": _minimax_m2,
}
ZOO_NAMES = tuple(ZOO)


def zoo_config(name: str, vocab_size: int) -> tuple[type, Any]:
    """The model class that `name` ships as and its tiny config."""
    model_class, config = ZOO[name](vocab_size)
    return getattr(transformers, model_class), config


def build_zoo_target(name: str, out: Path, vocab_size: int, seed: int = 0) -> None:
    """Build the tiny `name` target with random weights from `seed` and save it to `out` (safetensors)."""
    model_class, config = zoo_config(name, vocab_size)
    torch.manual_seed(seed)
    model_class(config).save_pretrained(out)
