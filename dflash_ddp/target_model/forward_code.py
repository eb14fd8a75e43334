"""What a target's text model does, read from transformers' code for its config: the class that builds it,
the attention masks its forward builds, and the cache it insists on."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass

from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMultimodalLM,
    PreTrainedModel,
)

FULL_ATTENTION = "full_attention"


def residual_streams(config) -> int:
    """How many hidden states per token a model passes between its layers: its hyper-connection streams
    (`hyper_connection_streams`), Gemma 3n's AltUp streams (`altup_num_inputs`, 4), else 1."""
    return altup_streams(config) or hyper_connection_streams(config)


def altup_streams(config) -> int:
    """Gemma 3n's AltUp streams (`altup_num_inputs`, 4), which its own readout turns into its hidden states;
    else 0."""
    return getattr(config.get_text_config(decoder=True), "altup_num_inputs", None) or 0


def hyper_connection_streams(config) -> int:
    """A hyper-connection model's residual streams (DeepSeek V4's and GLM-5's `hc_mult`, Qwen4-exp's
    `hc_count`, 4), which the engines average into the hidden states a drafter reads; else 1."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "hc_mult", None) or getattr(text, "hc_count", None) or 1


def text_model_class(config) -> type | None:
    """The transformers class that builds the text model of `config`: AutoModel's, or where AutoModel maps
    none (the text configs of Ernie 4.5 VL, Llama 3.2 Vision, Qwen3-Omni's thinker and other wrappers) the
    model without a head that its family's modeling code builds for that config class; None where
    transformers has neither."""
    mapped = _mapped_class(AutoModel, config)
    return mapped if mapped is not None else _family_text_model(type(config))


def causal_lm_class(config) -> type | None:
    """The causal-LM class transformers maps `config` to, None where it maps none."""
    return _mapped_class(AutoModelForCausalLM, config)


def generating_class(config) -> type | None:
    """The class transformers maps `config` to that generates text: its causal LM, else its image-text-to-text
    or multimodal LM (a wrapper whose config names an architecture the package spells otherwise: Kimi K2.5's
    `KimiK25ForConditionalGeneration` is transformers' `Kimi_K25ForConditionalGeneration`)."""
    autos = (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMultimodalLM)
    return next((found for auto in autos if (found := _mapped_class(auto, config)) is not None), None)


def _mapped_class(auto: type, config) -> type | None:
    try:
        return auto._model_mapping.get(type(config), None)
    except ValueError:  # mapped to a class its package does not export (Voxtral Realtime's text model)
        return None


HEADED = re.compile(r"PreTrainedModel$|For[A-Z]\w*$")  # a base class, or a model with a head


@functools.cache
def _family_text_model(config_class: type) -> type | None:
    try:
        module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    built = {
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, PreTrainedModel)
        and getattr(cls, "config_class", None) is config_class
        and not HEADED.search(cls.__name__)
    }
    # a renamed class kept as a subclass of the new one (Ernie 4.5 VL's) is the same model
    roots = [cls for cls in built if not any(cls is not other and issubclass(cls, other) for other in built)]
    return roots[0] if len(roots) == 1 else None


# transformers' attention-mask builders, by the kind of layer whose mask each builds
MASK_BUILDERS = {
    "create_causal_mask": FULL_ATTENTION,
    "create_sliding_window_causal_mask": "sliding_attention",
    "create_chunked_causal_mask": "chunked_attention",
}
LAYER_TYPE_TEST = re.compile(r"sliding|chunk|layer_type")  # a condition on the kinds of layers present


@dataclass(frozen=True)
class MaskBuilding:
    """How a text model's forward builds its attention masks: `always`, the kinds whose mask it builds
    whatever kinds its layers are; `by_window`, one mask for every layer, the sliding one where the config
    sets a window (Mistral's `create_causal_mask if sliding_window is None else ...`); `causal_skip`, whether
    transformers may skip a mask that SDPA's causal flag expresses (Falcon and Doge build theirs always:
    `allow_is_causal_skip=False`)."""

    always: frozenset[str]
    by_window: bool
    causal_skip: bool = True


def mask_building(config) -> MaskBuilding:
    """How the text model's forward builds its masks, read from its code (none always, none by the window
    where transformers has no class for `config` or its source cannot be read). A builder named outside any condition on the kinds of
    layers present (an `if` on sliding layers, a lambda called per present type) builds its mask whatever
    they are: Ministral's full mask beside sliding layers only, Qwen2-MoE's sliding one (a window of 0)
    beside full layers only."""
    return _mask_building_of(text_model_class(config))


@functools.cache
def _forward_source(model_class: type | None) -> str | None:
    """The source of the class's forward, read once per class (None where it cannot be read)."""
    try:
        return textwrap.dedent(inspect.getsource(model_class.forward))
    except (AttributeError, TypeError, OSError):
        return None


@functools.cache
def _mask_building_of(model_class: type | None) -> MaskBuilding:
    """`mask_building` of the class's forward, read once per class."""
    try:
        tree = ast.parse(_forward_source(model_class) or "")
    except SyntaxError:
        return MaskBuilding(frozenset(), False)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    always, by_window = set(), False
    for name in ast.walk(tree):
        if not (isinstance(name, ast.Name) and name.id in MASK_BUILDERS):
            continue
        enclosing, node = [], name
        while node in parents:
            node = parents[node]
            enclosing.append(node)
        if any(isinstance(n, ast.IfExp) and "sliding_window" in ast.unparse(n.test) for n in enclosing):
            by_window = True
        elif not any(
            isinstance(n, ast.Lambda) or isinstance(n, ast.If) and LAYER_TYPE_TEST.search(ast.unparse(n.test))
            for n in enclosing
        ):
            always.add(MASK_BUILDERS[name.id])
    return MaskBuilding(frozenset(always), by_window, not _forbids_causal_skip(tree))


def _forbids_causal_skip(tree: ast.AST) -> bool:
    """The forward passes `allow_is_causal_skip=False` to a mask builder, as a keyword or in the dict of
    keywords it hands them (DeepSeek V3.2's `mask_kwargs`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "allow_is_causal_skip":
            value = node.value
        elif isinstance(node, ast.Dict):
            value = next(
                (
                    v
                    for k, v in zip(node.keys, node.values, strict=True)
                    if isinstance(k, ast.Constant) and k.value == "allow_is_causal_skip"
                ),
                None,
            )
        else:
            continue
        if isinstance(value, ast.Constant) and value.value is False:
            return True
    return False


GENERIC_CACHES = ("Cache", "DynamicCache", "EncoderDecoderCache")
OWN_CACHE_CHECK = re.compile(r"not isinstance\((?:cache|past_key_values), (\w+)\)")


def own_cache_class(config) -> type | None:
    """The cache class the text model's forward insists on instead of transformers' shared one, read from
    its code (MiniMax's `MiniMaxCache`), else None: such a target cannot be prefilled in pieces, whose
    cache this project lays out, and is decoded with that cache."""
    return _own_cache_of(text_model_class(config))


@functools.cache
def _own_cache_of(model_class: type | None) -> type | None:
    found = OWN_CACHE_CHECK.findall(_forward_source(model_class) or "")
    name = next((name for name in found if name not in GENERIC_CACHES), None)
    return None if name is None else getattr(sys.modules[model_class.__module__], name)
