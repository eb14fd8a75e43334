"""How a quantized release's weights sit on a target rank. Releases such as DeepSeek V3/V4, Qwen3.5, GLM and
MiniMax-M2 in FP8, or gpt-oss in MXFP4, ship a `quantization_config`; transformers keeps those weights
quantized where its kernels run them (FP8: a GPU of compute capability 8.9 or more) and dequantizes them to
the compute dtype as it loads them elsewhere (a CPU, an older GPU). The memory plan counts what is held, and
a run whose GPU keeps FP8 weights without the package that runs them stops before it loads them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.quantizers import AutoHfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module
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
        line = f"{self.method} as released (quantization_config), kept so on {self.where}"
        if self.method not in MODELLED:
            return f"{line}; counted below at {str(dtype).removeprefix('torch.')} (more than it holds: the plan models {', '.join(MODELLED)} only)"
        problem = missing_kernel(self)
        return f"{line}: counted so below" + (f"; {problem}" if problem else "")


NOT_QUANTIZED = WeightStorage("", False, "")
# the methods whose storage the plan counts (both of which transformers can also dequantize as it loads)
MODELLED = ("fp8", "mxfp4")
# the GPUs on which transformers keeps a release's weights quantized (a plan for another machine assumes one)
KEPT_ON = {
    "fp8": "a GPU of compute capability 8.9 or more (H100, H200, B200)",
    "mxfp4": "a GPU with triton 3.4 or later and the kernels package",
}


def weight_storage(info: TargetInfo, device: torch.device, elsewhere: bool = False) -> WeightStorage:
    """Whether transformers keeps the weights of the target's release quantized on `device`: its own
    judgement of this machine (the quantizer's checks, which turn `dequantize` on where its kernels cannot
    run), or for another machine's GPUs (`elsewhere`: --plan_gpu_memory) a GPU that keeps them (`KEPT_ON`).
    transformers judges by the machine's GPU, not by the device a run asks for: a CPU run on a GPU machine
    is loaded dequantized explicitly (`load_text_model`'s `dequantize`)."""
    spec = getattr(info.text_stack().config, "quantization_config", None)
    if not spec:
        return NOT_QUANTIZED
    try:
        quantizer = release_quantizer(spec)
        declared = quantizer.quantization_config.quant_method
        method = str(getattr(declared, "value", declared))
        if elsewhere:
            kept = not getattr(quantizer.quantization_config, "dequantize", False)
            return WeightStorage(method, kept, KEPT_ON.get(method, "a GPU that runs them"))
        if device.type == "cpu" and torch.cuda.is_available() and method in MODELLED:
            return WeightStorage(method, False, "the CPU")
        quantizer.validate_environment(device_map={"": device.type}, dtype=None)
    except (ImportError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"--target_model {info.path}: its weights are quantized (config.json quantization_config) and "
            f"transformers cannot load them here: {e}"
        ) from e
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
    return sum(weight_bytes_by_name(info, layers, storage, dtype)[0].values())


def weight_bytes_by_name(
    info: TargetInfo, layers: int, storage: WeightStorage, dtype: torch.dtype
) -> tuple[dict[str, int], str]:
    """{parameter name in the text model: its bytes on the device} (see `truncated_weight_bytes`), and the
    name of the input embedding's weight."""
    config = truncated_text_config(info.text_stack(), layers)
    with torch.device("meta"):
        model = text_model_class(config)._from_config(config, dtype=dtype)
        embedding = next(
            f"{name}.weight" for name, m in model.named_modules() if m is model.get_input_embeddings()
        )
        if storage.kept and storage.method == "mxfp4":
            skipped = release_quantizer(config.quantization_config).quantization_config.modules_to_not_convert
            return mxfp4_bytes(model, skipped, dtype), embedding
        if storage.kept and storage.method in MODELLED:
            release_quantizer(config.quantization_config).preprocess_model(model, dtype=dtype)
    return {name: p.numel() * p.element_size() for name, p in model.named_parameters()}, embedding


MXFP4_BYTES_PER_WEIGHT = 17 / 32  # 32 weights share an 8-bit exponent beside their 16 bytes of 4-bit values


def mxfp4_bytes(model: torch.nn.Module, skipped: list[str] | None, dtype: torch.dtype) -> dict[str, int]:
    """{parameter name: bytes} of `model` as transformers holds gpt-oss's MXFP4 release: the experts of each
    MLP the release converts (all but those `skipped` names) packed (`MXFP4_BYTES_PER_WEIGHT`) with fp32
    biases, the rest in `dtype`. Counted by rule, not with the quantizer's modules, whose construction
    fetches kernels from the hub."""
    packed = {
        f"{name}.experts"
        for name, module in model.named_modules()
        if isinstance(module, GptOssMLP) and should_convert_module(f"{name}.experts", skipped)
    }
    sizes = {}
    for name, parameter in model.named_parameters():
        owner, kind = name.rsplit(".", 1)
        if owner not in packed:
            sizes[name] = parameter.numel() * dtype.itemsize
        elif kind.endswith("_bias"):
            sizes[name] = parameter.numel() * 4
        else:
            sizes[name] = round(parameter.numel() * MXFP4_BYTES_PER_WEIGHT)
    return sizes


def missing_kernel(storage: WeightStorage) -> str | None:
    """What stops FP8 weights kept on this GPU from running, or None: transformers runs them with the FP8
    kernels of the `kernels` package (fetched from the hub on first use, `kernels-community/finegrained-fp8`:
    a machine without the hub needs it in its cache) and without it stops at the first forward, after the
    weights have loaded."""
    if storage.method != "fp8" or not storage.kept or is_kernels_available():
        return None
    return (
        "transformers runs FP8 weights with the kernels package, which is not installed here: `pip install "
        "kernels` (its FP8 kernel, kernels-community/finegrained-fp8, is fetched from the hub once)"
    )


def check_kernels(info: TargetInfo, storage: WeightStorage) -> None:
    """Stop, before any weight loads, where the device would keep the release's weights without the kernels
    that run them (`missing_kernel`)."""
    problem = missing_kernel(storage)
    if problem:
        raise ValueError(f"--target_model {info.path}: {problem}")
