"""Reading a vision-language or omni wrapper's files into its text model loaded alone: transformers' weight
transforms for the wrapper (its renamings, its converters of the text model's weights) registered for the
class loaded while it loads, and taken back after."""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Protocol

from transformers import PretrainedConfig, PreTrainedModel, conversion_mapping
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from transformers.core_model_loading import WeightConverter, WeightRenaming

from dflash_ddp.target_model.forward_code import text_model_class


class WrappedTextModel(Protocol):
    """What these transforms read of where a checkpoint keeps its text model (text_stack.TextStack)."""

    config: PretrainedConfig  # the text config
    wrapped: bool  # the checkpoint is a wrapper, not the causal LM of its text config
    own_prefix: str  # the text model's path in that causal LM
    text_module: str  # the text model's path in the wrapper
    head_module: str  # its LM head's path in the wrapper
    own_head_tensor: str  # the LM head's weight in the causal LM
    wrapper_conversions: tuple  # transformers' weight transforms for the wrapper


def _wrapper_chain(stack: WrappedTextModel, own_prefix: str, with_head: bool) -> list:
    """The weight transforms that read a wrapper's files into its text model loaded alone: transformers' own
    for the wrapper in their order (its renamings of the family's original names, those of each sub-model
    scoped to it), then its text model's path in the wrapper renamed to `own_prefix` (and its LM head's, where
    it sits beside the text model, to the causal LM's), and the converters that act on the text model's
    weights, no longer scoped (they see the renamed names: renamings all run first)."""
    # transformers scopes a transform to a sub-model by its path less the wrapper's base model prefix (most
    # wrappers': `model`)
    paths = {stack.text_module, stack.text_module.removeprefix("model.")}
    renamings = [t for t in stack.wrapper_conversions if not isinstance(t, WeightConverter)]
    converters = []
    for t in stack.wrapper_conversions:
        # a converter of the text model's weights: unscoped, or scoped to the text model or a part holding it
        # (Nemotron 3 Nano Omni's, to the causal LM around its text model)
        scope = t.scope_prefix
        if isinstance(t, WeightConverter) and (
            not scope or any(p == scope or p.startswith(f"{scope}.") for p in paths)
        ):
            unscoped = copy.deepcopy(t)
            unscoped.scope_prefix = None
            converters.append(unscoped)
    into_own = f"{own_prefix}." if own_prefix else ""
    renamings.append(WeightRenaming(f"^{re.escape(stack.text_module)}\\.", into_own))
    own_head = stack.own_head_tensor.removesuffix(".weight")
    beside = stack.head_module and not stack.head_module.startswith(f"{stack.text_module}.")
    if with_head and beside and stack.head_module != own_head:
        renamings.append(WeightRenaming(f"^{re.escape(stack.head_module)}\\.", f"{own_head}."))
    return [*renamings, *converters]


@contextlib.contextmanager
def checkpoint_conversions(model_class: type[PreTrainedModel], stack: WrappedTextModel, with_head: bool):
    """While `model_class` loads from a wrapper's files, the wrapper's weight transforms (`_wrapper_chain`)
    registered for it in place of its own, and taken back after: transformers converts some checkpoints as it
    loads the wrapper and not as it loads the text model alone (Qwen3-VL-MoE's experts, transposed in its
    releases; Ernie 4.5 VL's expert lists, split into text and vision experts; Mistral Large 3's original
    names; GLM-4.5V's per-expert weights). A causal LM's text model gets none of its own meanwhile: they are
    in the chain already, and would rename the renamed names again (Inkling 2's `embed_norm`)."""
    if not stack.wrapped or not stack.wrapper_conversions:
        yield
        return
    own_prefix = stack.own_prefix if with_head else ""  # a causal LM's text model, or the text model itself
    chains = {model_class.__name__: _wrapper_chain(stack, own_prefix, with_head)}
    if with_head:
        chains.setdefault(text_model_class(stack.config).__name__, [])
    before = {name: get_checkpoint_conversion_mapping(name) for name in chains}
    registered_by_user = conversion_mapping.USER_REGISTERED_MAPPINGS & set(chains)
    try:
        for name, chain in chains.items():
            register_checkpoint_conversion_mapping(name, chain, overwrite=True)
        yield
    finally:
        # the registry is transformers' module state: these classes load as before once the target is read
        # (a class transformers registers is not one the user did: that decides how custom code loads)
        for name, mapping in before.items():
            if mapping is None:
                conversion_mapping._checkpoint_conversion_mapping_cache.pop(name, None)
            else:
                register_checkpoint_conversion_mapping(name, mapping, overwrite=True)
            if name not in registered_by_user:
                conversion_mapping.USER_REGISTERED_MAPPINGS.discard(name)
