"""The frozen target's shape and identity, read from its directory without loading weights: TargetInfo,
the fingerprint a checkpoint records, the default tapped layers, and parameter counts for the memory plan.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

from dflash_ddp.target_model.forward_code import (
    FULL_ATTENTION,
    altup_streams,
    mask_building,
    own_cache_class,
    residual_streams,
    text_model_class,
)
from dflash_ddp.target_model.text_stack import (
    TextStack,
    attention_layers_per_decoder_layer,
    decoder_layer_count,
    read_text_stack,
    truncated_text_config,
)


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's widths (most such configs point `head_dim` at the RoPE part): a layer
    caches a token's `latent` compressed keys and values plus its `rope` key, and expands them for every
    query head into keys of `nope + rope` and values of `value`."""

    nope: int
    rope: int
    value: int
    latent: int

    @property
    def query_key(self) -> int:
        """A query or key head's width."""
        return self.nope + self.rope


@dataclass(frozen=True)
class LinearMixer:
    """A hybrid target's linear-attention or state-space layers as their chunked algorithms see them: `kind`
    "gated_delta" (Qwen3.5, Qwen3-Next), "kda" (Kimi Linear, GLM-5: a decay per channel) or "mamba2"
    (Nemotron-H, Falcon-H1, Zamba2); `heads` (value heads), `key` and `value` widths per head, Mamba-2's
    `state`, and the positions of a `chunk`."""

    kind: str
    heads: int
    key: int
    value: int
    state: int = 0
    chunk: int = 64  # the gated delta rules' chunks in transformers


@dataclass(frozen=True)
class SparseIndexer:
    """DeepSeek Sparse Attention's indexer (DeepSeek V3.2/V4, GLM-5, Mistral Large 4, ...): before an indexed
    layer's attention it scores every key for every query, with `heads` heads of `width` in fp32, a score per
    `pool` keys (GLM-5's pools, DeepSeek V4's compressed keys), and keeps the top-k."""

    heads: int
    width: int
    pool: int = 1


# the layer types whose attention runs an indexer first (DeepSeek V4's heavily compressed layers run none)
INDEXED_LAYER_TYPES = ("indexed_attention", "compressed_sparse_attention")
# DeepSeek V4's layer types that attend to compressed keys beside their window
COMPRESSED_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
# the layer types whose KV cache keeps only a window of the last keys (transformers' sliding-window cache
# layers: a prefill in pieces attends to that window and the piece, not to every key before it)
WINDOWED_LAYER_TYPES = ("sliding_attention", "chunked_attention", "hybrid_sliding", *COMPRESSED_LAYER_TYPES)


@dataclass(frozen=True)
class TargetInfo:
    """What the drafter needs to know about a target model directory, read from its config only."""

    path: Path
    model_type: str
    num_layers: int  # decoder layers, whose outputs the drafter taps
    hidden_size: int
    intermediate_size: int  # the drafter's MLP width: the target's dense one, else its widest layer's
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict  # of the full-attention layers where layer types have their own
    tie_word_embeddings: bool
    layer_types: tuple[str, ...] = ()  # per decoder layer, where the family names them
    embedding_scale: float = 1.0  # the target's input embedding multiplies its rows by this (Gemma)
    final_logit_softcapping: float | None = None  # the target soft-caps its logits at this (Gemma)
    logit_scale: float = 1.0  # the target multiplies its logits by this (Falcon-H1)
    architecture: str = ""  # the checkpoint's class (a causal LM or a vision-language wrapper)
    other_parameters: int = 0  # parameters of the checkpoint a target rank never loads (a vision tower)
    eager_attention: bool = False  # transformers runs its attention eagerly (no SDPA): scores materialised
    fp32_sinks: bool = False  # its attention sinks are kept in fp32: eager scores joined to them go fp32
    alibi_mask: bool = False  # ALiBi added onto SDPA's mask, one per head (Falcon with `alibi`)
    mlp_widths: tuple[int, ...] = ()  # per decoder layer, the MLP width a token passes through (0: none)
    residual_streams: int = 1  # hidden states passed between layers per token (hyper-connections: 4)
    # the streams are Gemma 3n's AltUp predictions, read out by its projections, not averaged
    altup: bool = False
    attention_per_layer: int = 1  # attention layers in each decoder layer (LongCat-Flash: 2)
    # decoder layers its forward skips on text (Llama 3.2 Vision's cross-attention layers run with an image only)
    image_only_layers: tuple[int, ...] = ()
    latent_attention: LatentAttention | None = None  # DeepSeek V2/V3, Kimi, GLM-5: keys from a cached latent
    linear_mixer: LinearMixer | None = None  # a hybrid's linear-attention or state-space layers
    sparse_indexer: SparseIndexer | None = None  # DeepSeek Sparse Attention's indexer before some layers
    # per layer type, the positions a compressed key stands for (DeepSeek V4: beside a layer's own keys)
    key_compression: dict = field(default_factory=dict)
    shared_key_value: frozenset[str] = frozenset()  # layer types caching one tensor as keys and values
    # Gemma 3n and 4: an input per token for each decoder layer, held through the forward (layers x width)
    per_layer_inputs: int = 0
    kv_shared_layers: int = 0  # Gemma 3n and 4: the last layers reuse earlier layers' keys and values
    key_window: int = 0  # a windowed layer's window (its cache keeps one key fewer), else 0
    masks_built: frozenset[str] = frozenset()  # kinds whose mask the forward builds whatever its layers
    causal_skip: bool = True  # transformers may skip a mask SDPA's causal flag expresses (not Falcon's)
    own_cache: str | None = None  # the cache class its forward insists on (no prefill in pieces)
    stack: TextStack | None = field(default=None, compare=False, repr=False)

    @property
    def mlp_width(self) -> int:
        """The widest MLP a token passes through in any layer (the memory plan's activations)."""
        return max(self.mlp_widths, default=self.intermediate_size)

    def text_stack(self) -> TextStack:
        """Where the checkpoint keeps the text model (read from the directory when not known yet)."""
        return self.stack or read_text_stack(self.path)


FINGERPRINT_SAMPLES = 16  # 64 KiB windows per weight file: cheap, yet any retrained weights differ


def target_fingerprint(path: str | Path) -> str:
    """Identify a target's weights without reading them all: config.json, then for each safetensors file
    its size, its header (names, dtypes, shapes) and evenly spaced 64 KiB windows of its tensor bytes.

    Two checkpoints of one architecture (a base and an instruct model) share config and headers but
    not their bytes, so a drafter trained for one is not silently resumed against the other."""
    path = Path(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}\n".encode())
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
            start = 8 + header_len
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(start + (size - start) * i // FINGERPRINT_SAMPLES)
                h.update(f.read(1 << 16))
    return h.hexdigest()[:16]


def inspect_target(path: str | Path) -> TargetInfo:
    """Validate a Hugging Face model directory and read its shape. Errors say what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"--target_model {path}: not a directory (pass a local Hugging Face model directory or a hub name "
            "such as Qwen/Qwen3-8B)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"--target_model {path}: no config.json in the directory")
    _refuse_a_drafter(path)
    if not list(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file():
        raise ValueError(
            f"--target_model {path}: no *.safetensors weights (pickled .bin weights are not loaded; "
            "convert them with `save_pretrained(..., safe_serialization=True)`)"
        )
    stack = read_text_stack(path)
    return target_info_from_config(stack.config, path, stack)


def _refuse_a_drafter(path: Path) -> None:
    """One line for a drafter (a checkpoint or export of this project, or z-lab's) given as the target."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers' reading says what is wrong with it
    if not isinstance(config, dict):
        return
    name = str((config.get("architectures") or ["a dflash_config"])[0])
    if "dflash_config" in config or name.endswith("DraftModel"):
        raise ValueError(
            f"--target_model {path}: this is a drafter ({name}), not a target: pass the model it drafts for "
            "(a drafter to start from goes to --init_from)"
        )


DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _full_attention_layer(config) -> int:
    """The first decoder layer with full attention (0 where the family names no layer types)."""
    types = list(getattr(config, "layer_types", None) or ())
    return types.index(FULL_ATTENTION) if FULL_ATTENTION in types else 0


# per family, the sub-configs that hold its layers' settings (DBRX: its KV heads in `attn_config`, its experts'
# count, width and top-k in `ffn_config`); not MPT's `attn_config`, whose `kv_n_heads` its model never reads
NESTED_CONFIGS = {"dbrx": ("attn_config", "ffn_config")}


def layer_attribute(config, name: str):
    """`config.name`, or for a setting given per layer (Gemma 4's head sizes) the full-attention layers'
    value, whose shape and rope the drafter takes, or the value of the family's sub-config (NESTED_CONFIGS);
    None where the config gives none."""
    try:
        value = getattr(config, name, None)
    except AmbiguousGlobalPerLayerAttributeError:
        value = getattr(config.per_layer_config[_full_attention_layer(config)], name, None)
    nested = (getattr(config, sub, None) for sub in NESTED_CONFIGS.get(config.model_type, ()))
    return value if value is not None else next((getattr(c, name) for c in nested if hasattr(c, name)), None)


def full_attention_rope(config) -> dict:
    """The rope of the target's full-attention layers: `rope_parameters` itself, or its full-attention
    entry where the family gives one per layer type (Gemma 3/4, OLMo 3), or its attention's `main` entry
    (DeepSeek V4); plain rope for a family with none (Nemotron-H's attention has no positions: the drafter's
    own still need some), the sliding layers' where the full-attention ones have none (Beam, Ergo)."""
    theta = getattr(config, "rope_theta", DEFAULT_ROPE["rope_theta"])
    rope = getattr(config, "rope_parameters", None) or {**DEFAULT_ROPE, "rope_theta": theta}
    if FULL_ATTENTION in rope:  # Beam, Ergo: global layers without positions (None) take the sliding ones'
        rope = rope[FULL_ATTENTION] or next((r for r in rope.values() if r), DEFAULT_ROPE)
    elif "main" in rope and "rope_type" not in rope:  # DeepSeek V4: its attention's, beside the compressor's
        rope = rope["main"]
    return dict(rope)


# a dense MLP's width under the names families give it: Llama's and most, Kolibri's MLP-only layers, Ergo's
# dense first blocks, Falcon, OPT and XGLM, GPT-2's family (GPT-J, CodeGen, StarCoder), CTRL, CPM-Ant; else as
# a multiple of the hidden size
DENSE_WIDTHS = (
    "intermediate_size",
    "mlp_only_intermediate_size",
    "first_dense_intermediate_size",
    "ffn_hidden_size",
    "ffn_dim",
    "n_inner",
    "dff",
    "dim_ff",
)
DENSE_RATIOS = ("expansion_ratio", "intermediate_multiple_size")  # MPT, GPT-NeoX-Japanese
# families whose MLP is 4x the hidden size with no field to say so (in their code)
FOUR_TIMES_HIDDEN = frozenset({"bloom", "openai-gpt"})
# width fields whose classes document an unset value as 4x the hidden size (GPT-2's family, GPT-Neo)
FOUR_TIMES_IF_UNSET = ("intermediate_size", "n_inner")


def _dense_width(config) -> int | list[int] | None:
    """A dense MLP's width (a list of one per decoder layer where the family gives it so: Gemma 3n): the
    first width field the class defines (`intermediate_size` only where it is not an alias of its experts'
    width, as in DeepSeek V4), 4x the hidden size where that field is unset
    (GPT-2's `n_inner`, GPT-Neo's `intermediate_size`: their classes' documented default), a ratio of the
    hidden size (MPT), or 4x for BLOOM; None where the config names no dense width (all-expert models)."""
    aliases = getattr(type(config), "attribute_map", {})
    own = {f.name for f in fields(config)} if is_dataclass(config) else set()
    for name in DENSE_WIDTHS:
        if name in aliases:
            continue
        width = layer_attribute(config, name)
        if width is not None:
            return width
        if name in own and name in FOUR_TIMES_IF_UNSET:
            return 4 * config.hidden_size
    ratio = _first(config, DENSE_RATIOS)
    if ratio is not None:
        return int(ratio * config.hidden_size)
    return 4 * config.hidden_size if config.model_type in FOUR_TIMES_HIDDEN else None


def _widest(width: int | list[int] | None) -> int | None:
    """A dense width, the widest layer's where it is given per layer."""
    return max(width) if isinstance(width, (list, tuple)) else width


def _first(config, names: tuple[str, ...]):
    return next((v for v in (layer_attribute(config, n) for n in names) if v is not None), None)


def _sparse_layers(config, experts: int | None) -> list[bool | None]:
    """Per decoder layer: True for experts, False for a dense MLP, None for a layer without an MLP
    (Nemotron-H's Mamba and attention blocks), each from the fields its family states it in."""
    n = decoder_layer_count(config)
    if not experts:
        return [False] * n
    layer_types = list(getattr(config, "layer_types", None) or ())
    if "moe" in layer_types:  # one kind per block: "moe", "mlp", or a mixer
        return [True if t == "moe" else False if t == "mlp" else None for t in layer_types]
    kinds = getattr(config, "mlp_layer_types", None)
    if kinds:
        return [kind != "dense" for kind in kinds]
    first_dense = _first(config, ("first_k_dense_replace", "num_dense_layers"))  # DeepSeek's, AfMoE's
    if first_dense is not None:
        return [i >= first_dense for i in range(n)]
    start = getattr(config, "moe_layer_start_index", None)
    if isinstance(start, int):  # Ernie 4.5: every `moe_layer_interval`-th layer from start to end
        end = getattr(config, "moe_layer_end_index", None)
        end = n - 1 if end is None or end < 0 else end
        interval = getattr(config, "moe_layer_interval", None) or 1
        return [(i + 1) % interval == 0 and start <= i <= end for i in range(n)]
    moe_layers = getattr(config, "moe_layers", None)
    if moe_layers is not None:
        return [i in moe_layers for i in range(n)]
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    return [i not in dense_only and (i + 1) % step == 0 for i in range(n)]


# a sparse layer's fields under the names families give them
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # DBRX, Aria
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "top_k_experts", "moe_top_k", "moe_topk")
SHARED_EXPERT_WIDTHS = (
    "shared_expert_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "shared_intermediate_size",  # Granite's MoE families, Ergo
)
SHARED_EXPERT_COUNTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")  # x expert width
# the dense layers' width where `intermediate_size` names the experts' (Llama 4; Cohere's MoE's first layers;
# MiniMax-M3)
DENSE_BESIDE_EXPERTS = ("intermediate_size_mlp", "prefix_dense_intermediate_size", "dense_intermediate_size")
# families whose every decoder layer runs its dense MLPs beside its experts, as a shared expert runs (LongCat-
# Flash: two dense sublayers and a shortcut MoE whose output joins the second's)
DENSE_AND_EXPERTS_IN_EVERY_LAYER = frozenset({"longcat_flash"})


def layer_mlp_widths(config) -> tuple[int, ...]:
    """The MLP width a token passes through in each decoder layer, read by meaning: a dense layer's
    `intermediate_size`; a sparse layer's expert width (`moe_intermediate_size`, or `intermediate_size` where
    the family names its experts' width so) times the experts per token, plus its shared experts' (LongCat-
    Flash: its dense sublayer's). A field the config lacks is one line naming the model type and the field."""
    experts = _first(config, EXPERT_COUNTS)
    if getattr(config, "is_moe", None) is False:  # Doge: experts configured, switched off
        experts = None
    expert_width, dense = layer_attribute(config, "moe_intermediate_size"), _dense_width(config)
    if isinstance(expert_width, (list, tuple)):  # per modality (Ernie 4.5 VL: text, vision): text tokens' own
        expert_width = expert_width[0]
    if experts and expert_width is None:  # gpt-oss, MiniMax-M2, Llama 4: intermediate_size is the experts'
        expert_width, dense = dense, _first(config, DENSE_BESIDE_EXPERTS)
    per_token = _first(config, EXPERTS_PER_TOKEN)
    shared = _first(config, SHARED_EXPERT_WIDTHS) or (_first(config, SHARED_EXPERT_COUNTS) or 0) * (
        expert_width or 0
    )
    if config.model_type in DENSE_AND_EXPERTS_IN_EVERY_LAYER:
        shared += dense
    widths = []
    for i, sparse in enumerate(_sparse_layers(config, experts)):
        if sparse is None:
            widths.append(0)
        elif sparse and expert_width and per_token:
            widths.append(expert_width * per_token + shared)
        elif not sparse and dense:
            widths.append(dense[i] if isinstance(dense, (list, tuple)) else dense)
        else:
            needed = "moe_intermediate_size and num_experts_per_tok" if sparse else "intermediate_size"
            raise ValueError(
                f"target model type '{config.model_type}': layer {i} has {'experts' if sparse else 'a dense MLP'} "
                f"but its config gives no {needed}; check the checkpoint's config.json"
            )
    return tuple(widths)


def target_info_from_config(config, path: Path, stack: TextStack | None = None) -> TargetInfo:
    """The shape of a target from its text config; `path` is where its files live, `stack` where the
    checkpoint keeps the text model (None: a causal-LM checkpoint of `config`)."""
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        raise ValueError(
            f"target model type '{config.model_type}' has no attention layers (its config gives no "
            "num_attention_heads), whose shape the drafter takes: pure state-space models (Mamba, Mamba-2) are "
            "not supported as targets; hybrids with attention layers are"
        )
    widths, masks, eager = layer_mlp_widths(config), mask_building(config), eager_attention_only(config)
    return TargetInfo(
        path=path,
        model_type=config.model_type,
        num_layers=decoder_layer_count(config),
        attention_per_layer=attention_layers_per_decoder_layer(config),
        image_only_layers=tuple(getattr(config, "cross_attention_layers", None) or ()),
        hidden_size=config.hidden_size,
        intermediate_size=_widest(_dense_width(config)) or max(widths),
        mlp_widths=widths,
        residual_streams=residual_streams(config),
        altup=bool(altup_streams(config)),
        num_attention_heads=heads,
        num_key_value_heads=_first(config, ("num_key_value_heads", "kv_n_heads")) or heads,
        head_dim=layer_attribute(config, "head_dim") or config.hidden_size // heads,
        vocab_size=config.vocab_size,
        rms_norm_eps=getattr(config, "rms_norm_eps", None) or 1e-6,  # Cohere's MoE: None, a LayerNorm
        max_position_embeddings=getattr(config, "max_position_embeddings", 32768),
        rope_parameters=full_attention_rope(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        layer_types=layer_types(config),
        embedding_scale=stack.embedding_scale if stack else 1.0,
        final_logit_softcapping=(stack.final_logit_softcapping if stack else None),
        logit_scale=stack.logit_scale if stack else 1.0,
        architecture=stack.architecture if stack else "",
        other_parameters=stack.other_parameters if stack else 0,
        eager_attention=eager,
        alibi_mask=bool(getattr(config, "alibi", False)) and not eager,
        fp32_sinks=fp32_attention_sinks(config),
        latent_attention=latent_attention(config),
        linear_mixer=linear_mixer(config),
        sparse_indexer=sparse_indexer(config),
        key_compression=key_compression(config),
        shared_key_value=shared_key_value(config),
        per_layer_inputs=decoder_layer_count(config)
        * (getattr(config, "hidden_size_per_layer_input", 0) or 0),
        kv_shared_layers=getattr(config, "num_kv_shared_layers", 0) or 0,
        key_window=key_window(config),
        masks_built=masks.always,
        causal_skip=masks.causal_skip,
        own_cache=getattr(own_cache_class(config), "__name__", None),
        stack=stack,
    )


def linear_mixer(config) -> LinearMixer | None:
    """The shape of the linear-attention or state-space layers where the family has them, else None."""
    if getattr(config, "linear_num_value_heads", None):
        return LinearMixer(
            "gated_delta",
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
    if getattr(config, "linear_num_heads", None):
        return LinearMixer("kda", config.linear_num_heads, config.linear_head_dim, config.linear_head_dim)
    heads = _first(config, ("mamba_num_heads", "mamba_n_heads", "n_mamba_heads"))  # Zamba2: the last
    width = _first(config, ("mamba_head_dim", "mamba_d_head", "mamba_headdim"))
    if not heads or not width:  # Zamba (Mamba-1) names heads but no head width
        return None
    state = _first(config, ("ssm_state_size", "mamba_d_state"))
    chunk = _first(config, ("mamba_chunk_size", "chunk_size")) or 256  # Mamba-2's own default
    return LinearMixer("mamba2", heads, width, width, state, chunk)


def key_compression(config) -> dict[str, int]:
    """Per layer type of the config's layers that attends to compressed keys beside its own, the positions
    each compressed key stands for (DeepSeek V4's `compress_rates`: 4 and 128), else {}."""
    types = getattr(config, "layer_types", None) or ()
    return {t: r for t, r in (getattr(config, "compress_rates", None) or {}).items() if t in types}


def shared_key_value(config) -> frozenset[str]:
    """The layer types whose cache keeps one tensor as both keys and values (DeepSeek V4's compressed
    layers; its sliding ones keep two), asked of transformers' own cache for `config` (none where it cannot
    be built: keys and values counted apart, which errs high)."""
    if text_model_class(config) is None:  # importing the class registers the family's cache layers
        return frozenset()
    try:
        cache = DynamicCache(config=config)
        shared = set()
        for index, kind in enumerate(layer_types(config)[: len(cache.layers)]):
            states = torch.zeros(1, 1, 1, 8)
            cache.update(states, states.clone(), index)
            if cache.layers[index].keys.data_ptr() == cache.layers[index].values.data_ptr():
                shared.add(kind)
        return frozenset(shared)
    except Exception:  # noqa: BLE001 - a family whose cache needs more than its config: the safe reading
        return frozenset()


def layer_types(config) -> tuple[str, ...]:
    """Per decoder layer, its kind where the family names them; where it does not, sliding-window layers
    throughout if the config sets a `sliding_window` (Mistral v0.1, Phi-3 mini, Starcoder2: transformers
    then builds a windowed mask and cache), else none (full attention). A family that picks one mask for
    every layer by the window (`MaskBuilding.by_window`) gives its full layers the sliding mask (MiniMax)."""
    types = tuple(getattr(config, "layer_types", None) or ())
    if layer_attribute(config, "sliding_window") is None:
        return types
    if not types:
        return ("sliding_attention",) * decoder_layer_count(config)
    if mask_building(config).by_window:
        return tuple("sliding_attention" if t == FULL_ATTENTION else t for t in types)
    return types


def key_window(config) -> int:
    """A windowed layer's window (`sliding_window`, or Llama 4's `attention_chunk_size`; its cache keeps
    one key fewer) where some layer type is windowed or the forward builds a sliding mask whatever the
    layers are, else 0."""
    windowed = set(layer_types(config)) & set(WINDOWED_LAYER_TYPES)
    if not windowed and "sliding_attention" not in mask_building(config).always:
        return 0
    return layer_attribute(config, "sliding_window") or layer_attribute(config, "attention_chunk_size") or 0


def sparse_indexer(config) -> SparseIndexer | None:
    """The indexer's shape where some layer runs one (`index_n_heads` and an indexed layer type), else None."""
    heads = layer_attribute(config, "index_n_heads")
    types = getattr(config, "layer_types", None) or ()
    if not heads or not any(t in INDEXED_LAYER_TYPES for t in types):
        return None
    compressed = key_compression(config).get("compressed_sparse_attention")
    pool = getattr(config, "index_kpool", None) or compressed or 1
    return SparseIndexer(heads, layer_attribute(config, "index_head_dim"), pool)


def latent_attention(config) -> LatentAttention | None:
    """The latent attention's widths where the family has it (`kv_lora_rank`), else None."""
    latent = layer_attribute(config, "kv_lora_rank")
    if not latent:
        return None
    rope = layer_attribute(config, "qk_rope_head_dim") or 0
    nope = layer_attribute(config, "qk_nope_head_dim") or 0
    return LatentAttention(nope, rope, layer_attribute(config, "v_head_dim") or nope + rope, latent)


def fp32_attention_sinks(config) -> bool:
    """Whether the text model keeps its attention sinks in fp32 whatever the checkpoint's dtype (DeepSeek
    V4: `_keep_in_fp32_modules_strict`), so that its eager scores, joined to them, are shifted and
    softmaxed in fp32."""
    return "sinks" in (getattr(text_model_class(config), "_keep_in_fp32_modules_strict", None) or ())


def eager_attention_only(config) -> bool:
    """Whether transformers runs the text model's attention eagerly: its class supports no SDPA (gpt-oss,
    DeepSeek V4), so each layer materialises its [rows, heads, queries, keys] scores."""
    model_class = text_model_class(config)
    return model_class is not None and not getattr(model_class, "_supports_sdpa", False)


def layers_run(num_layers: int, target_layer_ids: list[int], topk: int) -> int:
    """How many of the target's layers its ranks run: up to the last tapped one, or all of them when they
    also compute soft targets (--target_topk), which need the final norm and the LM head."""
    return num_layers if topk else max(target_layer_ids) + 1


def truncated_parameter_count(info: TargetInfo, layers: int) -> int:
    """Parameters of the target cut after `layers` decoder layers (what a target rank loads), counted on the
    meta device from its own text config: exact for any architecture transformers builds (biases, experts),
    and never counting a vision tower (target ranks do not load one)."""
    config = truncated_text_config(info.text_stack(), layers)
    with torch.device("meta"):
        return sum(p.numel() for p in text_model_class(config)._from_config(config).parameters())


def soft_target_compute_share(info: TargetInfo, target_layer_ids: list[int]) -> float:
    """About how much more compute a token costs when the target runs every layer and its LM head (soft
    targets) instead of stopping after the last tap: the ratio of the matrix parameters each token passes
    through, minus 1 (the embedding is a lookup; attention over the context is left out)."""
    embedding = info.vocab_size * info.hidden_size
    tapped = truncated_parameter_count(info, max(target_layer_ids) + 1) - embedding
    whole = truncated_parameter_count(info, info.num_layers) - embedding + embedding  # + the LM head
    return whole / tapped - 1
