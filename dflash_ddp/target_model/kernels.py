"""Whether a hybrid target's linear-attention or state-space layers run fused kernels. transformers runs
them with the kernel packages where they are installed and run on the device (CUDA), and otherwise with
its reference implementation in PyTorch: a Python loop over chunks and fp32 tensors per position many
times the layer's width (Kimi Linear's and GLM-5's decay per channel: chunk x key width per head), which
the memory plan then counts (memory.py) and a GPU run is told about.
"""

from __future__ import annotations

import importlib.util

from dflash_ddp.target_model.info import TargetInfo

# per kind of layer: (module transformers imports, the pip package that installs it)
KERNEL_PACKAGES = {
    "gated_delta": (("fla", "flash-linear-attention"), ("causal_conv1d", "causal-conv1d")),
    "kda": (("fla", "flash-linear-attention"), ("causal_conv1d", "causal-conv1d")),
    "mamba2": (("mamba_ssm", "mamba-ssm"), ("causal_conv1d", "causal-conv1d")),
}
MIXER_LAYER_TYPES = ("linear_attention", "hybrid")  # Falcon-H1's layers run attention and Mamba-2 together


def runs_linear_mixer(info: TargetInfo, layers: int) -> bool:
    """Whether the first `layers` decoder layers include a linear-attention or state-space one."""
    return info.linear_mixer is not None and any(t in MIXER_LAYER_TYPES for t in info.layer_types[:layers])


def missing_kernels(info: TargetInfo, layers: int, device_type: str) -> list[str]:
    """The pip packages of fused kernels for the linear layers among the first `layers` that this machine
    lacks (judged by whether their modules are installed); on a CPU all of them, which run on CUDA only."""
    if not runs_linear_mixer(info, layers):
        return []
    return [
        package
        for module, package in KERNEL_PACKAGES[info.linear_mixer.kind]
        if device_type != "cuda" or importlib.util.find_spec(module) is None
    ]


def kernels_note(info: TargetInfo, layers: int, device_type: str) -> str | None:
    """One line for a GPU run whose target's linear layers fall back to transformers' reference code."""
    missing = missing_kernels(info, layers, device_type)
    if device_type != "cuda" or not missing:
        return None
    return (
        f"note: the target's {info.linear_mixer.kind} layers run transformers' reference implementation in "
        f"PyTorch ({', '.join(missing)} not installed): slower, and with more memory, which the plan counts; "
        f"`pip install {' '.join(missing)}` for the fused kernels"
    )
