"""Loading the target as the device holds it (a target rank's first layers, the whole target for generation in
evaluation and regeneration) and the end-of-sequence ids it stops on."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_ddp.hub import TextWeights, cache_dir, fetch_weights, locate_model, truncated_view
from dflash_ddp.target_model.info import TargetInfo, inspect_target
from dflash_ddp.target_model.quantization import check_kernels, weight_storage
from dflash_ddp.target_model.text_stack import load_text_model


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


def load_causal_lm(info: TargetInfo, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The whole text model with its LM head, for generation and speculative verification (a vision-language
    checkpoint's text model alone, as a causal LM), on `device` (`load_target_model`)."""
    model = load_target_model(info, info.num_layers, dtype, device, with_head=True)
    return model.to(device).eval().requires_grad_(False)


def eos_token_ids(tokenizer, target: nn.Module | Path) -> list[int]:
    """EOS ids of the tokenizer and of the target's generation config (either may be a list or missing); the
    target is the loaded model, or its directory where no weights are loaded (a serving engine decodes)."""
    if isinstance(target, Path):
        from transformers import AutoConfig, GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(target, local_files_only=True)
        except OSError:  # no generation_config.json: the model config's own ids, as a loaded model has
            generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(target))
    else:
        generation = target.generation_config
    ids = set()
    for value in (tokenizer.eos_token_id, generation.eos_token_id):
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
    return sorted(ids)


VIEWS = "dflash_ddp-views"  # beside the hub cache: views of a snapshot that index the text model alone


def views_root() -> Path:
    """Where views of hub snapshots for decoding live (hub.truncated_view), beside the hub cache."""
    return cache_dir().parent / VIEWS


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
    view = truncated_view(source, None, views_root(), text)
    return info if view == source.path else inspect_target(view)
