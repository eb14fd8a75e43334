"""Loading the target as the device holds it (a target rank's first layers, the whole target for generation in
evaluation and regeneration) and the end-of-sequence ids it stops on."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers.utils import logging as hf_logging

from dflash_ddp.hub import TextWeights, cache_dir, check_complete, fetch_weights, locate_model, truncated_view
from dflash_ddp.target_model.forward_code import causal_lm_class
from dflash_ddp.target_model.info import TargetInfo, inspect_target
from dflash_ddp.target_model.quantization import check_kernels, weight_storage
from dflash_ddp.target_model.text_stack import (
    TextStack,
    dequantized_as_it_loads,
    read_config,
    required_text_model_class,
    truncated_text_config,
)
from dflash_ddp.target_model.wrapper_loading import checkpoint_conversions


def load_target_model(
    info: TargetInfo, layers: int, dtype: torch.dtype, device: torch.device, with_head: bool = False, **kwargs
) -> nn.Module:
    """`load_text_model` for `device`: a quantized release stays quantized where the device keeps it and is
    dequantized as it loads elsewhere (transformers judges by the machine's GPU, not by the device asked
    for); where the device would keep it without the kernels that run it, one line before any weight loads.
    `kwargs` go to `load_text_model` (a tensor-parallel `distributed_config`)."""
    storage = weight_storage(info, device)
    check_kernels(info, storage)
    return load_text_model(
        info.path, info.text_stack(), layers, dtype, with_head, dequantize=not storage.kept, **kwargs
    )


def load_text_model(
    path: Path,
    stack: TextStack,
    layers: int,
    dtype: torch.dtype,
    with_head: bool = False,
    dequantize: bool = False,
    **kwargs,
) -> nn.Module:
    """The text model's first `layers` decoder layers (`with_head`: as a causal LM, with its final norm and
    LM head), read from the checkpoint in `path` and nothing else of it; `kwargs` go to `from_pretrained` (a
    tensor-parallel `distributed_config`). A weight the text model expects and the checkpoint lacks is an
    error: transformers would fill it with random numbers. Where transformers has no causal LM of the text
    config alone (GLM-5), the whole model `with_head` is the checkpoint's own class. `dequantize`: a
    quantized release's weights are dequantized as they load (where the device does not keep them)."""
    if with_head and not stack.text_lm:
        return load_checkpoint_class(path, stack, dtype, dequantize, **kwargs)
    model_class = causal_lm_class(stack.config) if with_head else None
    model_class = model_class or required_text_model_class(stack.config)
    with checkpoint_conversions(model_class, stack, with_head):
        return _complete_from_pretrained(
            model_class,
            path,
            f"its text model's first {layers} layers",
            "; read from " + (f"'{stack.prefix}.'" if stack.prefix else "the top of the files") + f" of "
            f"{stack.architecture}. Is the checkpoint complete and saved by transformers?",
            config=truncated_text_config(stack, layers, with_head, dequantize),
            dtype=dtype,
            key_mapping=_key_mapping(stack, with_head),
            **kwargs,
        )


def _complete_from_pretrained(cls, path: Path, whose: str, advice: str, **kwargs) -> nn.Module:
    """`cls.from_pretrained(path, **kwargs)` from local files, refusing a checkpoint whose weights have other
    shapes than its config gives them (`check_shapes`) or lack some of `whose` (transformers would fill them
    with random numbers), naming them and ending with `advice`."""
    model, loading = cls.from_pretrained(
        path,
        local_files_only=True,
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # refused below, with the shapes (transformers' report is silenced)
        **kwargs,
    )
    check_shapes(path, loading)
    missing = sorted(loading.get("missing_keys", ()))
    if missing:
        raise ValueError(
            f"--target_model {path}: the checkpoint lacks {len(missing)} weight(s) of {whose} "
            f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}){advice}"
        )
    return model


def _key_mapping(stack: TextStack, with_head: bool) -> dict[str, str] | None:
    """transformers' `key_mapping` for a load of the text model: none from a wrapper's files where its
    transforms are registered (`wrapper_loading.checkpoint_conversions`), the prefix change where they are not known."""
    if stack.wrapped:
        return None if stack.wrapper_conversions else stack.key_mapping
    return stack.key_mapping if with_head else stack.base_key_mapping


def load_checkpoint_class(
    path: Path, stack: TextStack, dtype: torch.dtype, dequantize: bool, **kwargs
) -> nn.Module:
    """The checkpoint as its own class (a vision-language wrapper whose text model has no causal LM), whole;
    where the class is more than what writes the text, that sub-model's class alone, which transformers reads
    from its part of the files (Omni's thinker, beside a talker that speaks: Qwen2.5-Omni's class would also
    read the talker's voices from a pickle, which this project never loads)."""
    config = read_config(path)
    if dequantize:
        dequantized_as_it_loads(config)
    cls = getattr(transformers, stack.architecture)
    if stack.generator:
        with torch.device("meta"):
            part = cls._from_config(copy.deepcopy(config)).get_submodule(stack.generator)
        cls, config = type(part), part.config
    return _complete_from_pretrained(
        cls,
        path,
        cls.__name__,
        "; is it complete and saved by transformers?",
        config=config,
        dtype=dtype,
        **kwargs,
    )


def check_shapes(path: Path, loading: dict) -> None:
    """Refuse a checkpoint whose weights have other shapes than its config.json gives them (a config edited
    or copied from another size of the model), naming the first few with both shapes."""
    mismatched = sorted(loading.get("mismatched_keys", ()), key=lambda m: m[0])
    if not mismatched:
        return
    shown = "; ".join(
        f"{key}: {tuple(saved)} saved, {tuple(expected)} by the config"
        for key, saved, expected in mismatched[:3]
    )
    raise ValueError(
        f"--target_model {path}: {len(mismatched)} weight(s) do not have the shapes {path}/config.json gives "
        f"them ({shown}{' ...' if len(mismatched) > 3 else ''}): the config does not describe these weights; "
        "use the config.json saved with them"
    )


def load_causal_lm(info: TargetInfo, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The whole text model with its LM head, for generation and speculative verification (a vision-language
    checkpoint's text model alone, as a causal LM), on `device` (`load_target_model`). transformers' load
    report is silenced: the weights it would list as unexpected are a wrapper's vision tower, never read, and
    missing or mismatched weights are refused by `load_text_model` in one line."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = load_target_model(info, info.num_layers, dtype, device, with_head=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval().requires_grad_(False)


def eos_token_ids(tokenizer, target: nn.Module | Path) -> list[int]:
    """EOS ids of the tokenizer and of the target's generation config (either may be a list or missing); the
    target is the loaded model, or its directory where no weights are loaded (a serving engine decodes)."""
    if isinstance(target, Path):
        from transformers import GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(target, local_files_only=True)
        except OSError:  # no generation_config.json: the model config's own ids, as a loaded model has
            generation = GenerationConfig.from_model_config(read_config(target))
    else:
        generation = target.generation_config
    ids = set()
    for value in (tokenizer.eos_token_id, generation.eos_token_id):
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
    return sorted(ids)


VIEWS = "dflash_ddp-views"  # beside the hub cache: views of a snapshot that index the text model alone


def views_root() -> Path:
    """Where views of hub snapshots for decoding live (hub.truncated_view): beside the hub cache, or where
    that cannot be written (a cluster's shared, read-only cache) in this user's cache, else the temporary
    folder. A view is links and an index: small, and made again wherever it is missing."""
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash_ddp"
    for root in (cache_dir().parent / VIEWS, user_cache / "views", Path(tempfile.gettempdir()) / VIEWS):
        existing = next(p for p in (root, *root.parents) if p.exists())
        if os.access(existing, os.W_OK | os.X_OK):
            return root
    raise ValueError(
        f"no writable folder for the target's views: {cache_dir().parent} and {user_cache} are read-only"
    )


def decoding_weights(info: TargetInfo) -> TextWeights | None:
    """The tensors decoding reads: the text model and its head (a wrapper's vision tower never), or None
    where generation runs the checkpoint's own class whole (GLM-5's text config has no causal LM)."""
    stack = info.text_stack()
    return stack.weights_read() if stack.text_lm else None


def whole_target(name: str | Path) -> TargetInfo:
    """A target for decoding, by directory or hub name, with the weight files decoding reads on disk (a hub
    name's are downloaded into the hub cache by this process, a vision-language wrapper's other shards left
    there, and the model read through a view that indexes the text model's alone) and checked intact."""
    source = locate_model(str(name))
    info = inspect_target(source.path)  # a local directory's problems first: not one, no config, no weights
    text = decoding_weights(info)
    fetch_weights(source, None, text=text)
    if source.repo_id is None:
        check_complete(source.path)
    view = truncated_view(source, None, views_root(), text)
    return info if view == source.path else inspect_target(view)
