"""Which device a process computes on, and in which precision."""

from __future__ import annotations

import torch


def select_device(device_request: str, local_rank: int, share_gpus: bool = False) -> torch.device:
    """This process's device for --device auto|cpu|cuda: the GPU of its local rank, or the CPU. With
    `share_gpus` (a channel through host memory) more local ranks than GPUs take the GPUs in turn."""
    use_cuda = torch.cuda.is_available() if device_request == "auto" else device_request == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if use_cuda and local_rank >= torch.cuda.device_count() and not share_gpus:
        raise ValueError(
            f"local rank {local_rank}: this node has {torch.cuda.device_count()} GPU(s) and NCCL needs one per "
            "rank; start fewer processes per node, or share GPUs with --channel_backend gloo"
        )
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return device


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: use auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available")
    return device


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA; fp32 on the CPU (exact, and what the parity tests compare)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
