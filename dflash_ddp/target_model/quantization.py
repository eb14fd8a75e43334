"""How a quantized release's weights sit on a target rank. Releases such as DeepSeek V3/V4, Qwen3.5, GLM and
MiniMax-M2 in FP8, or gpt-oss in MXFP4, ship a `quantization_config`; transformers keeps those weights
quantized where its kernels run them (FP8: a GPU of compute capability 8.9 or more) and dequantizes them to
the compute dtype as it loads them elsewhere (a CPU, an older GPU). The memory plan counts what is held, and
a run whose GPU keeps FP8 weights without the package that runs them stops before it loads them.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.quantizers import AutoHfQuantizer
from transformers.utils import is_kernels_available

from dflash_ddp.target_model.forward_code import text_model_class
from dflash_ddp.target_model.info import TargetInfo
from dflash_ddp.target_model.text_stack import truncated_text_config


@dataclass(frozen=True)
class WeightStorage:
    """How a target's weights are held on the device that runs them."""

    method: str  # the release's quant_method ("": not quantized)
    kept: bool  # they stay quantized there (otherwise they are dequantized to the compute dtype as they load)
    where: str  # the device it was judged for, in words

    def describe(self, dtype: torch.dtype) -> str:
        """One line for --plan about a quantized release."""
        if not self.kept:
            return (
                f"{self.method} as released (quantization_config), dequantized to "
                f"{str(dtype).removeprefix('torch.')} by transformers as it loads them on {self.where}: "
                "counted so below"
            )
        line = f"{self.method} as released (quantization_config), kept so on {self.where}: counted so below"
        problem = missing_kernel(self)
        return line + (f"; {problem}" if problem else "")


NOT_QUANTIZED = WeightStorage("", False, "")


def weight_storage(config: PretrainedConfig, device: torch.device) -> WeightStorage:
    """Whether transformers keeps the weights of `config`'s release quantized on `device`: its own judgement
    of this machine (the quantizer's checks, which turn `dequantize` on where its kernels cannot run), or
    on a CUDA device this machine lacks (--plan_gpu_memory) a GPU that runs them (FP8: compute capability
    8.9 or more, an H100, H200 or B200)."""
    spec = getattr(config, "quantization_config", None)
    if not spec:
        return NOT_QUANTIZED
    quantizer = release_quantizer(spec)
    declared = quantizer.quantization_config.quant_method
    method = str(getattr(declared, "value", declared))
    if device.type == "cuda" and not torch.cuda.is_available():
        kept = not getattr(quantizer.quantization_config, "dequantize", False)
        return WeightStorage(method, kept, "a GPU that runs them (FP8: compute capability 8.9 or more)")
    quieted = logging.getLogger("transformers.quantizers")
    level, quieted.level = quieted.level, logging.ERROR  # the quantizer's warnings say what `describe` says
    try:
        quantizer.validate_environment(device_map={"": device.type}, dtype=None)
    finally:
        quieted.setLevel(level)
    kept = not getattr(quantizer.quantization_config, "dequantize", False)
    return WeightStorage(method, kept, device_words(device))


def release_quantizer(spec):
    """transformers' quantizer of a release's `quantization_config` (a copy: its checks change it)."""
    return AutoHfQuantizer.from_config(copy.deepcopy(spec), pre_quantized=True)


def device_words(device: torch.device) -> str:
    """The device in words for --plan."""
    if device.type != "cuda":
        return "the CPU" if device.type == "cpu" else device.type
    if not torch.cuda.is_available():
        return "a GPU"
    major, minor = torch.cuda.get_device_capability(device)
    return f"this GPU ({torch.cuda.get_device_name(device)}, compute capability {major}.{minor})"


def truncated_weight_bytes(info: TargetInfo, layers: int, storage: WeightStorage, dtype: torch.dtype) -> int:
    """Bytes of the target cut after `layers` decoder layers (what a target rank loads) as they sit on the
    device: every parameter in `dtype`, or where the release stays quantized with the modules transformers'
    quantizer swaps in (FP8: a byte a weight and its blocks' fp32 scales; the embedding, norms, routers and
    the modules the release leaves unconverted in `dtype`), counted on the meta device."""
    config = truncated_text_config(info.text_stack(), layers)
    with torch.device("meta"):
        model = text_model_class(config)._from_config(config, dtype=dtype)
        if storage.kept:
            release_quantizer(config.quantization_config).preprocess_model(model, dtype=dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def missing_kernel(storage: WeightStorage) -> str | None:
    """What stops FP8 weights kept on this GPU from running, or None: transformers runs them with the FP8
    kernels of the `kernels` package (fetched from the hub on first use, `kernels-community/finegrained-fp8`)
    and without it stops at the first forward, after the weights have loaded."""
    if storage.method != "fp8" or not storage.kept or is_kernels_available():
        return None
    return (
        "transformers runs FP8 weights with the kernels package, which is not installed here: `pip install "
        "kernels` (its FP8 kernel, kernels-community/finegrained-fp8, is fetched from the hub once)"
    )
