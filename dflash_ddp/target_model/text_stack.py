"""Where a checkpoint keeps the text model a drafter reads, found through the model's own accessors.

A target ships as a causal LM (`Qwen3ForCausalLM`: text model at `model.`), as a vision-language or omni
wrapper (`Qwen3_5ForConditionalGeneration`: text model at `model.language_model.`, a vision tower beside it),
or with its own names (Nemotron-H: `backbone.embeddings`). The checkpoint's class is built once on the meta
device (no memory, no weights read); its `get_input_embeddings()` and `get_output_embeddings()` name the two
tensors the drafter shares, and the module that owns the input embedding is the text model that target
ranks load, alone and truncated, from the same files. Nothing else of the checkpoint is ever loaded or read.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.conversion_mapping import (
    get_model_conversion_mapping,
)
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from dflash_ddp.hub import LAYER_OF_WEIGHT, TextWeights, check_safetensors
from dflash_ddp.target_model.forward_code import causal_lm_class, generating_class, text_model_class


@dataclass(frozen=True)
class TextStack:
    """The text model inside a target checkpoint and the conventions its logits are computed with."""

    config: PretrainedConfig  # the text (decoder) config
    architecture: str  # the checkpoint's class, e.g. Qwen3_5ForConditionalGeneration
    prefix: str  # the text model's tensor-name prefix in the checkpoint's files, e.g. "model.language_model"
    own_prefix: str  # its prefix in a causal LM of the text config ("model"), where transformers reads it
    wrapped: bool  # the checkpoint is not that causal LM (a vision-language or omni wrapper)
    embed_tensor: str  # the input embedding's tensor in the checkpoint's files
    head_tensor: str  # the LM head's tensor (the embedding's when the two are tied)
    own_head_tensor: str  # the LM head's name in a causal LM of the text config
    embedding_scale: float  # what the input embedding multiplies its rows by (Gemma: sqrt(hidden))
    logit_scale: float  # what the final logits are multiplied by (Falcon-H1's lm_head_multiplier)
    final_logit_softcapping: float | None  # tanh soft-capping of the final logits (Gemma 2-4)
    other_parameters: int  # parameters of the checkpoint outside the text model and its head (vision ...)
    truncatable: bool  # the text model can be built with fewer layers (not Gemma 4: per-layer input tables)
    text_lm: bool = True  # transformers has a causal LM of the text config alone (not GLM-5's)
    base_key_mapping: dict[str, str] | None = None  # reads the text model alone from a causal-LM checkpoint
    # a wrapper's: its text model's module path, its LM head's (the embedding's where the two are tied;
    # Nemotron 3 Nano Omni's `language_model.lm_head` sits beside the text model), the sub-model that writes
    # the text where the class is more (Omni's thinker), and transformers' weight conversions as it loads it
    text_module: str = ""
    head_module: str = ""
    generator: str = ""
    wrapper_conversions: tuple = field(default=(), compare=False, repr=False)
    # a wrapper's, or a causal LM's whose files name its text model at their top (DeepSeek V4's release): the
    # name prefixes of the saved tensors its text model and head load from and of nothing else (its files
    # may hold a vision tower under the text model's prefix, as Ernie 4.5 VL's `model.`, or name the text
    # model otherwise than the model does: `prefix` is then a guess, for messages only)
    text_prefixes: tuple[str, ...] = ()

    def weights_read(self) -> TextWeights:
        """The saved tensors target ranks read: the text model's and its head's, no vision tower's."""
        if self.text_prefixes:
            return TextWeights(self.text_prefixes)
        return TextWeights.of(self.prefix, self.embed_tensor, self.head_tensor)

    @property
    def key_mapping(self) -> dict[str, str] | None:
        """transformers' `key_mapping` that reads the text model out of a wrapper checkpoint (None for a
        causal-LM checkpoint, which transformers reads with its own renamings)."""
        if not self.wrapped:
            return None
        mapping = {f"^{re.escape(self.prefix)}\\.": f"{self.own_prefix}."}
        if not self.head_tensor.startswith(f"{self.prefix}."):  # Mistral 3's `language_model.lm_head`
            mapping[f"^{re.escape(self.head_tensor)}$"] = self.own_head_tensor
        return mapping


def tensor_locations(path: Path) -> dict[str, Path]:
    """Every tensor name of the safetensors checkpoint in `path` and the file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    locations = {}
    for file in sorted(path.glob("*.safetensors")):
        check_safetensors(file, str(path))  # a damaged file is one line naming it, not safetensors' traceback
        with safe_open(file, framework="pt") as f:
            locations.update({name: file for name in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return locations


def _loaded_names(transforms: list, saved: list[str], model: nn.Module) -> dict[str, str]:
    """{saved name: the name it loads as into `model`} for the tensor names `saved`, renamed by `transforms`
    (transformers' for the model the checkpoint loads into: gemma3 and mistral3 save their text model as
    `language_model.model.*`, Nemotron-H as `backbone.*`), and given or stripped of the model's base prefix
    as transformers does (DeepSeek V4's release saves its base model's names, `embed.weight`, `layers.*`)."""
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix, meta = model.base_model_prefix or None, model.state_dict()
    return {name: rename_source_key(name, renamings, converters, prefix, meta)[0] for name in saved}


def _saved_names(transforms: list, wanted: set[str], saved: list[str], model: nn.Module) -> dict[str, str]:
    """{module name: saved name} for the parameter names `wanted` (`_loaded_names`)."""
    loads = _loaded_names(transforms, [name for name in saved if name not in wanted], model)
    found = {}
    for name in saved:
        loaded = name if name in wanted else loads[name]
        if loaded in wanted:
            found.setdefault(loaded, name)
    return found


def _read_prefixes(
    transforms: list, text_module: str, head: str, saved: list[str], model: nn.Module
) -> tuple[str, ...]:
    """The shortest name prefixes that hold every saved tensor loading into the text model at `text_module` or
    into the LM head `head`, and no other: a wrapper's files may hold its vision tower under the text model's
    prefix (Ernie 4.5 VL's `model.vision_model.` beside `model.layers.`) or name the text model otherwise
    than the model does (Mistral Large 3's original names: `layers.`, `norm.`, `output.` and `tok_embeddings.`
    at the top level, beside `vision_encoder.`). Read from the names outside layers 1.. (they repeat layer 0)."""
    names = [name for name in saved if _outside_later_layers(name)]
    loads = _loaded_names(transforms, names, model)
    held = {name for name in names if loads[name] == head or loads[name].startswith(f"{text_module}.")}
    taken = {prefix for name in names if name not in held for prefix in _name_prefixes(name)}
    return tuple(sorted({next(p for p in _name_prefixes(name) if p not in taken) for name in held}))


def _name_prefixes(name: str) -> list[str]:
    """`a`, `a.b`, `a.b.c` for the tensor name `a.b.c`, shortest first."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


def required_text_model_class(text: PretrainedConfig) -> type[PreTrainedModel]:
    """The class that builds the text model of `text` alone (see forward_code.text_model_class)."""
    found = text_model_class(text)
    if found is None:
        raise ValueError(
            f"model type '{text.model_type}': transformers {transformers.__version__} has no class that builds "
            f"its text model ({type(text).__name__}) alone, which target ranks load"
        )
    return found


def checkpoint_class(config: PretrainedConfig, path: Path) -> type[PreTrainedModel]:
    """The class a checkpoint was saved from (config.json `architectures`), else the class that generates
    text transformers maps its config to (`generating_class`)."""
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls
    found = generating_class(config)
    if found is None:
        raise ValueError(
            f"--target_model {path}: model type '{config.model_type}' has no causal-LM class in transformers "
            f"{transformers.__version__} (config.json architectures {getattr(config, 'architectures', None)}): "
            "a drafter needs a target that generates text"
        )
    return found


def _input_embeddings(module: PreTrainedModel) -> nn.Module | None:
    try:
        return module.get_input_embeddings()
    except NotImplementedError:  # a vision tower's model has no text embedding
        return None


def generating_part(model: PreTrainedModel, text: PretrainedConfig) -> tuple[str, PreTrainedModel]:
    """(path, module) of the part of a checkpoint's model that writes its text: the model itself, or where its
    class names no input embedding or no LM head (Qwen2.5-Omni and Qwen3-Omni: a thinker that writes text
    beside a talker that speaks; Nemotron 3 Nano Omni: a causal LM beside its vision and audio towers) the
    first sub-model whose embedding and LM head are the text config's."""
    if _input_embeddings(model) is not None and model.get_output_embeddings() is not None:
        return "", model
    for name, module in model.named_modules():
        if name and isinstance(module, PreTrainedModel) and _input_embeddings(module) is not None:
            head = getattr(module.get_output_embeddings(), "weight", None)
            if isinstance(head, torch.Tensor) and tuple(head.shape) == (text.vocab_size, text.hidden_size):
                return name, module
    return "", model


def _owner_of(model: nn.Module, embed: nn.Module, loaded: type | None = None) -> tuple[str, nn.Module]:
    """(name, module) of the pretrained model whose input embedding is `embed` that target ranks load: the one
    of class `loaded` where one is (BLIP-2's OPT: the `OPTModel` around the `OPTDecoder` that owns the
    embedding too), else the innermost: the text model."""
    owners = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, PreTrainedModel) and _input_embeddings(module) is embed
    ]
    return max(owners, key=lambda item: (type(item[1]) is loaded, len(item[0])))


def text_model_of(model: PreTrainedModel) -> nn.Module:
    """The text model inside `model`: the innermost pretrained model that owns its input embedding."""
    return _owner_of(model, model.get_input_embeddings())[1]


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


def attention_layers_per_decoder_layer(text: PretrainedConfig) -> int:
    """Attention layers in each decoder layer: 1, or where `num_hidden_layers` is a property counting the
    attention layers of `num_layers` decoder layers, their ratio (LongCat-Flash: 2, each decoder layer
    running two attention and two MLP sublayers beside a shortcut MoE, its layers' outputs one stream)."""
    modules = getattr(text, "num_layers", None)
    derived = isinstance(getattr(type(text), "num_hidden_layers", None), property)  # as Nemotron-H's too
    if derived and isinstance(modules, int) and 0 < modules != text.num_hidden_layers:
        return text.num_hidden_layers // modules
    return 1


def decoder_layer_count(text: PretrainedConfig) -> int:
    """The text model's decoder layers, whose outputs the drafter taps (LongCat-Flash: its `num_layers`)."""
    return text.num_hidden_layers // attention_layers_per_decoder_layer(text)


def _refuse_unsupported_layers(config: PretrainedConfig, path: Path) -> None:
    """One line, before anything is built, for decoder layers that read more than the text before them (an
    encoder-decoder's cross-attention): the drafter is given a layer's output and nothing else; and for
    masked-LM encoders, which do not generate."""
    if getattr(config, "is_encoder_decoder", False):  # Florence-2, Pix2Struct, T5Gemma 2, Nougat ...
        raise ValueError(
            f"--target_model {path}: {(config.architectures or [config.model_type])[0]} is an encoder-decoder "
            "model: its decoder's layers also attend to an encoder's output, which a drafter reading the "
            "decoder's hidden states is never given; DFlash drafts for decoder-only targets"
        )
    masked = [a for a in config.architectures or () if a.endswith("ForMaskedLM")]
    if masked:  # BERT, RoBERTa, ModernBERT ...: their heads fill in masked tokens, reading both ways
        raise ValueError(
            f"--target_model {path}: {masked[0]} is a masked-language-model encoder: it fills in masked tokens "
            "reading both ways and does not generate text left to right; DFlash drafts for decoder-only targets"
        )


# inputs a wrapper computes for its text model's decoder layers beside the text, which no drafter is given
LAYER_CONDITIONS = {"t_cond": "a time embedding of its transcription delay, and its audio at every position"}


def _refuse_conditioned_layers(text_model: nn.Module, config: PretrainedConfig, path: Path) -> None:
    """One line for a text model whose decoder layers read an input that only the wrapper computes
    (Voxtral Realtime's streaming transcription: its norms are conditioned on the delay, its positions are
    audio frames), where a forward of the text model alone would stop in a traceback."""
    for module in text_model.modules():
        read = set(inspect.signature(type(module).forward).parameters) & set(LAYER_CONDITIONS)
        if read:
            condition = LAYER_CONDITIONS[read.pop()]
            raise ValueError(
                f"--target_model {path}: {(config.architectures or [config.model_type])[0]}'s decoder layers "
                f"({type(module).__name__}) are conditioned on {condition}, which only its wrapper computes; "
                "DFlash drafts for targets whose layers read the text alone"
            )


DROPPED_ROPE_THETA = 10000.0  # what transformers 5's DbrxConfig sets in place of the checkpoint's


def _restore_nested_rope_theta(text: PretrainedConfig) -> None:
    """DBRX's checkpoints give their rope_theta in `attn_config` (500000), which transformers 5 no longer
    reads: its `rope_parameters` keep the 10000 default, and the model runs with those. Set from the
    checkpoint where they still hold that default (a base set in `rope_parameters` stands), so that the target
    runs with its own positions and the drafter is built with them."""
    theta = getattr(getattr(text, "attn_config", None), "rope_theta", None)
    rope = getattr(text, "rope_parameters", None) or {}
    if text.model_type == "dbrx" and theta is not None and rope.get("rope_theta") == DROPPED_ROPE_THETA:
        text.rope_parameters = {**rope, "rope_theta": float(theta)}


class _LeftOut(nn.Module):
    """In place of a wrapper's tower whose class needs a package this machine lacks (`_towers_left_out`)."""


@contextlib.contextmanager
def _towers_left_out(text: PretrainedConfig):
    """While a wrapper is built on the meta device, a sub-model that transformers builds only with a package
    this project does not install is left out, a `_LeftOut` in its place (Gemma 3n's vision tower is timm's:
    building it needs timm and torchvision even on the meta device). Target ranks read the text model beside
    it, never the tower; the text model itself is built or the error stands."""
    own = AutoModel.__dict__["from_config"]
    build = AutoModel.from_config

    def from_config(config, **kwargs):
        try:
            return build(config, **kwargs)
        except ImportError:
            if _holds(config, type(text)):
                raise
            return _LeftOut()

    AutoModel.from_config = from_config
    try:
        yield
    finally:
        AutoModel.from_config = own


def _holds(config: PretrainedConfig, kind: type) -> bool:
    """Whether `config` is of class `kind` or holds one among its sub-configs (an Omni thinker's text)."""
    subs = (getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {})
    return type(config) is kind or any(isinstance(c, PretrainedConfig) and _holds(c, kind) for c in subs)


def _saved_numbers(locations: dict[str, Path], modules: set[str]) -> int:
    """How many numbers the checkpoint's files hold under the module names `modules` (from their headers)."""
    files: dict[Path, list[str]] = {}
    for name, file in locations.items():
        if any(name.startswith(f"{module}.") for module in modules):
            files.setdefault(file, []).append(name)
    total = 0
    for file, names in files.items():
        with safe_open(file, framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in names)
    return total


def expert_parallel(config: PretrainedConfig) -> bool:
    """Whether a tensor-parallel group shards the experts of the text model of `config` across its ranks too:
    where its family has transformers' expert-parallel plan (tensor_parallel.load_sharded)."""
    return bool(getattr(config, "base_model_ep_plan", None))


def read_config(path: str | Path) -> PretrainedConfig:
    """The checkpoint's config (local files only). A config naming code of its own (`auto_map`) for a class
    transformers does not have is refused in one line: no checkpoint's code is run, and nothing asks on a
    terminal whether to run it."""
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(
            f"--target_model {path}: its config.json names code of its own (auto_map) for a class transformers "
            f"{transformers.__version__} does not have; targets are loaded by transformers' own classes and no "
            "code from a checkpoint is run: use a release of the model in a format transformers supports (or a "
            "newer transformers that has the class)"
        ) from None


def read_text_stack(path: str | Path) -> TextStack:
    """The text model of the checkpoint in `path` (config only; the model is built on the meta device)."""
    path = Path(path)
    config = read_config(path)
    text = config.get_text_config(decoder=True)
    quantized = getattr(config, "quantization_config", None)
    if text is not config and quantized and not getattr(text, "quantization_config", None):
        # a quantized wrapper's (Qwen3.5's FP8 releases) is its text model's too: loaded alone without it, its
        # FP8 weights were read as numbers, their block scales left unread
        text.quantization_config = quantized
    _refuse_unsupported_layers(config, path)
    _restore_nested_rope_theta(text)
    cls = checkpoint_class(config, path)
    with torch.device("meta"), _towers_left_out(text):
        model = cls._from_config(copy.deepcopy(config))
    generator, writer = generating_part(model, text)
    embed, head = _input_embeddings(writer), writer.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(
            f"--target_model {path}: {cls.__name__} ({config.model_type}) has no causal-LM text head "
            "(get_output_embeddings() is None): a drafter needs a target that generates text"
        )
    widths = sorted({embed.weight.shape[-1], head.weight.shape[-1]})
    if widths != [text.hidden_size]:  # OPT-350m's word_embed_proj_dim
        raise ValueError(
            f"--target_model {path}: {cls.__name__} ({config.model_type}) projects between its hidden states "
            f"({text.hidden_size} wide) and its input embedding and LM head ({' and '.join(map(str, widths))} "
            "wide); a DFlash drafter shares those at the hidden width, so it cannot draft for this target"
        )
    names = _module_names(model)
    prefix, text_model = _owner_of(model, embed, text_model_class(text))
    _refuse_conditioned_layers(text_model, config, path)
    embed_name = f"{names[id(embed)]}.weight"
    head_name = f"{names[id(embed) if head.weight is embed.weight else id(head)]}.weight"
    wanted = {embed_name, head_name}
    # a directory holding a config alone (the benchmarks plan real targets from their configs) names none
    locations = tensor_locations(path)
    files = list(locations)
    transforms = get_model_conversion_mapping(model)  # as transformers loads the checkpoint into `model`
    saved = _saved_names(transforms, wanted, files, model) if files else {name: name for name in wanted}
    if embed_name not in saved:
        raise ValueError(
            f"--target_model {path}: no tensor in its safetensors files loads as {cls.__name__}'s input "
            f"embedding `{embed_name}`; is the checkpoint complete?"
        )
    inner = embed_name.removeprefix(f"{prefix}.")
    saved_prefix = _saved_prefix(saved[embed_name], inner)
    own_class = causal_lm_class(text)
    with torch.device("meta"):
        # GLM-5's text config has no causal LM of its own: generation runs the checkpoint's class
        own = (own_class or required_text_model_class(text))._from_config(copy.deepcopy(text))
    own_head = own.get_output_embeddings() if own_class else None
    counted = {id(p) for p in text_model.parameters()} | {id(head.weight)}
    return TextStack(
        config=text,
        architecture=cls.__name__,
        prefix=saved_prefix,
        own_prefix=_owner_of(own, own.get_input_embeddings(), text_model_class(text))[0]
        if own_class
        else own.base_model_prefix,
        wrapped=cls is not type(own),
        text_lm=own_class is not None,
        own_head_tensor=f"{_module_names(own)[id(own_head)]}.weight" if own_head is not None else head_name,
        embed_tensor=saved[embed_name],
        head_tensor=saved.get(head_name, head_name),
        embedding_scale=float(
            getattr(embed, "scalar_embed_scale", None) or getattr(text, "embedding_multiplier", 1.0)
        ),
        logit_scale=float(getattr(text, "lm_head_multiplier", 1.0)),
        final_logit_softcapping=getattr(text, "final_logit_softcapping", None) or None,
        other_parameters=sum(p.numel() for p in model.parameters() if id(p) not in counted)
        + _saved_numbers(locations, {name for name, m in model.named_modules() if isinstance(m, _LeftOut)}),
        truncatable=_truncatable(text),
        base_key_mapping=None if cls is not type(own) else _base_key_mapping(text, files),
        text_module=prefix if cls is not type(own) else "",
        head_module=head_name.removesuffix(".weight") if cls is not type(own) else "",
        generator=generator,
        wrapper_conversions=tuple(transforms) if cls is not type(own) else (),
        # a wrapper's files, or files naming the text model's tensors at their top (DeepSeek V4's release)
        text_prefixes=_read_prefixes(transforms, prefix, head_name, files, model)
        if files and (cls is not type(own) or not saved_prefix)
        else (),
    )


def _saved_prefix(saved_embedding: str, inner: str) -> str:
    """The text model's prefix in the files: the saved embedding's name less its name inside the text model
    (`inner`), or where the files name the embedding otherwise too (Inkling 2's `model.llm.embed.weight` for
    `embed_tokens.weight`), less as many of its last names."""
    if saved_embedding == inner or saved_embedding.endswith(f".{inner}"):
        return saved_embedding.removesuffix(inner).removesuffix(".")
    names = saved_embedding.split(".")
    return ".".join(names[: len(names) - len(inner.split("."))])


def _outside_later_layers(name: str) -> bool:
    layer = LAYER_OF_WEIGHT.search(name)
    return layer is None or layer.group(1) == "0"


def _base_key_mapping(text: PretrainedConfig, saved: list[str]) -> dict[str, str] | None:
    """transformers' `key_mapping` that loads the text model alone (AutoModel) from a causal-LM checkpoint
    where transformers' own renamings would misread a name before stripping the causal LM's prefix (DeepSeek
    V4: its attention's `.norm.` -> `.kv_norm.` also hits `model.norm.weight`): the prefix stripped first. None
    where every weight loads as it is. Checked on the weights outside layers 1.. (the layers repeat layer 0)."""
    with torch.device("meta"):
        base = required_text_model_class(text)._from_config(copy.deepcopy(text))
    transforms = get_model_conversion_mapping(base)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    wanted = {n for n in base.state_dict() if _outside_later_layers(n)}
    prefix = base.base_model_prefix

    def loaded(names) -> set[str]:
        meta = base.state_dict()
        return {rename_source_key(n, renamings, converters, prefix, meta)[0] for n in names}

    names = [n for n in saved if _outside_later_layers(n)]
    if not names or wanted <= loaded(names):
        return None
    stripped = [n.removeprefix(f"{prefix}.") for n in names]
    return {f"^{re.escape(prefix)}\\.": ""} if wanted <= loaded(stripped) else None


def _truncatable(text: PretrainedConfig) -> bool:
    """Whether the text model's weights outside its decoder layers keep their shapes with fewer layers
    (Gemma 4's per-layer input embedding is as wide as all its layers together: it is loaded whole)."""

    def shapes(layers: int) -> dict[str, tuple]:
        with torch.device("meta"):
            model = required_text_model_class(text)._from_config(_cut(text, layers))
        return {n: tuple(p.shape) for n, p in model.named_parameters() if not LAYER_OF_WEIGHT.search(n)}

    return decoder_layer_count(text) < 2 or shapes(1) == shapes(decoder_layer_count(text))


def truncated_text_config(
    stack: TextStack, layers: int, with_head: bool = False, dequantize: bool = False
) -> PretrainedConfig:
    """The text config cut after `layers` decoder layers (all of them where the model cannot be cut: the
    forward then stops after the last tapped layer instead); Gemma 4's last `num_kv_shared_layers` layers
    reuse earlier layers' keys and values, and only those of them that remain stay shared. A quantized
    release's modules left unconverted are also named as the text model alone (`with_head`: its causal LM)
    names them (`_unconverted_modules`), and with `dequantize` its weights are dequantized as they load."""
    config = _cut(stack.config, layers) if stack.truncatable else copy.deepcopy(stack.config)
    spec = getattr(config, "quantization_config", None)
    if isinstance(spec, dict) and (names := spec.get("modules_to_not_convert")):
        spec["modules_to_not_convert"] = _unconverted_modules(stack, names, with_head)
    if dequantize:
        dequantized_as_it_loads(config)
    return config


def dequantized_as_it_loads(config: PretrainedConfig) -> None:
    """Ask transformers to dequantize a quantized release's weights as it loads them (where this device does
    not keep them: it judges by the machine's GPU, not by the device a run asks for)."""
    spec = getattr(config, "quantization_config", None)
    if isinstance(spec, dict):
        spec["dequantize"] = True


def _unconverted_modules(stack: TextStack, names: list[str], with_head: bool) -> list[str]:
    """A release's `modules_to_not_convert` (module names or patterns of the checkpoint's class, plain or
    escaped) beside their names in the class loaded: the text model's path in the checkpoint (a wrapper's
    `model.language_model`, a causal LM's `model`, or as saved) replaced by its path in the class loaded
    (none in the text model alone), and a wrapper's LM head outside its text model by its causal LM's.
    Unrenamed, transformers converted them too (on a GPU that keeps FP8 they then lacked their scales)."""
    into = stack.own_prefix if with_head else ""
    head, own_head = stack.head_module, stack.own_head_tensor.removesuffix(".weight")
    sources = {p for p in (stack.text_module or stack.own_prefix, stack.prefix) if p}
    renamed = []
    for name in names:
        if with_head and head and name == head and not any(head.startswith(f"{p}.") for p in sources):
            renamed.append(own_head)
        for source in sources:
            for written, joined in ((f"{source}.", "."), (rf"{re.escape(source)}\.", r"\.")):
                rest = name.removeprefix("^").removeprefix(written)
                if rest != name.removeprefix("^"):
                    renamed.append(f"{into}{joined if into else ''}{rest}")
    return [*names, *renamed]


# settings a family gives as a list of one per decoder layer, beside `layer_types` (Gemma 3n's MLP widths and
# activation sparsity)
PER_LAYER_SETTINGS = ("intermediate_size", "activation_sparsity_pattern")


def _cut(text: PretrainedConfig, layers: int) -> PretrainedConfig:
    config = copy.deepcopy(text)
    whole = decoder_layer_count(config)
    config.num_hidden_layers = layers * attention_layers_per_decoder_layer(config)
    if getattr(config, "layer_types", None):
        with contextlib.suppress(AttributeError):  # Falcon-H1 derives them from its layer count
            config.layer_types = list(config.layer_types[:layers])
    for name in PER_LAYER_SETTINGS:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and len(value) == whole:
            setattr(config, name, list(value[:layers]))
    shared = getattr(config, "num_kv_shared_layers", None)
    if shared:
        config.num_kv_shared_layers = max(0, layers - (whole - shared))
    return config
