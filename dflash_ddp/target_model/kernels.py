"""Whether a hybrid target's linear-attention or state-space layers run fused kernels. transformers runs
them with a kernel package's function where it imports (and the inputs are on CUDA), and otherwise, without
a word, with its reference implementation in PyTorch: a Python loop over chunks and fp32 tensors per
position many times the layer's width (Kimi Linear's and GLM-5's decay per channel: chunk x key width per
head), which the memory plan then counts (memory.py) and a GPU run is told about.
"""

from __future__ import annotations

import functools
import importlib

from dflash_ddp.target_model.info import TargetInfo

# per kind of layer: the scan's kernel, then the convolution's, as transformers imports them
# (module, function, the pip package that installs it)
KERNELS = {
    "gated_delta": (
        ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "flash-linear-attention"),
        ("causal_conv1d", "causal_conv1d_fn", "causal-conv1d"),
    ),
    "kda": (
        ("fla.ops.kda", "chunk_kda", "flash-linear-attention"),
        ("causal_conv1d", "causal_conv1d_fn", "causal-conv1d"),
    ),
    "mamba2": (
        ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined", "mamba-ssm"),
        ("causal_conv1d", "causal_conv1d_fn", "causal-conv1d"),
    ),
}
# the layer types that run them ("hybrid": Falcon-H1's layers run attention and Mamba-2 side by side)
MIXER_LAYER_TYPES = ("linear_attention", "hybrid", "hybrid_sliding")


@functools.cache
def kernel_imports(module: str, function: str) -> bool:
    """Whether `module.function` imports here, as transformers tries it: any failure (not installed, an
    older release without it, a build for another torch) sends it to its reference code."""
    try:
        return callable(getattr(importlib.import_module(module), function, None))
    except Exception:
        return False


def runs_linear_mixer(info: TargetInfo, layers: int) -> bool:
    """Whether the first `layers` decoder layers include a linear-attention or state-space one."""
    return info.linear_mixer is not None and any(t in MIXER_LAYER_TYPES for t in info.layer_types[:layers])


def missing_kernels(info: TargetInfo, layers: int, device_type: str) -> list[str]:
    """The pip packages whose kernels the linear layers among the first `layers` would run without on
    `device_type`: on a CPU all of them (they run on CUDA only). On CUDA judged on this machine, so a plan
    for another machine's GPUs (--plan_gpu_memory) assumes its packages are these."""
    if not runs_linear_mixer(info, layers):
        return []
    kernels = KERNELS[info.linear_mixer.kind]
    return [package for module, function, package in kernels if not runs_fused(module, function, device_type)]


def runs_reference_scan(info: TargetInfo, layers: int, device_type: str) -> bool:
    """Whether the layers' scan, the part whose memory counts, runs transformers' reference code."""
    if not runs_linear_mixer(info, layers):
        return False
    module, function, _ = KERNELS[info.linear_mixer.kind][0]
    return not runs_fused(module, function, device_type)


def runs_fused(module: str, function: str, device_type: str) -> bool:
    """Whether transformers runs that kernel on `device_type` (CUDA only, where the function imports)."""
    return device_type == "cuda" and kernel_imports(module, function)


def linear_layers_summary(info: TargetInfo, layers: int, device_type: str) -> str:
    """How the target's linear-attention or state-space layers run, for --plan."""
    if not runs_linear_mixer(info, layers):
        return "no linear-attention or state-space layers among those run"
    kind, missing = info.linear_mixer.kind, missing_kernels(info, layers, device_type)
    if not missing:
        return f"{kind} layers with fused kernels ({', '.join(k[2] for k in KERNELS[kind])})"
    why = "on the CPU" if device_type != "cuda" else f"{', '.join(missing)} not importable here"
    memory = ", its memory counted below" if runs_reference_scan(info, layers, device_type) else ""
    return f"{kind} layers with transformers' reference code ({why}){memory}"


def kernels_note(info: TargetInfo, layers: int, device_type: str) -> str | None:
    """One line for a GPU run whose target's linear layers fall back to transformers' reference code."""
    missing = missing_kernels(info, layers, device_type)
    if device_type != "cuda" or not missing:
        return None
    memory = (
        ", and with more memory, which the plan counts" if runs_reference_scan(info, layers, "cuda") else ""
    )
    return (
        f"note: the target's {info.linear_mixer.kind} layers run transformers' reference code in PyTorch "
        f"({', '.join(missing)} not importable): slower{memory}; `pip install {' '.join(missing)}` for the "
        "fused kernels"
    )
