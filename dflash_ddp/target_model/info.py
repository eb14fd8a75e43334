"""The frozen target's shape and identity, read from its directory without loading weights: TargetInfo,
the fingerprint a checkpoint records, the default tapped layers, and parameter counts for the memory plan.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel


@dataclass(frozen=True)
class TargetInfo:
    """What the drafter needs to know about a target model directory, read from its config only."""

    path: Path
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict
    tie_word_embeddings: bool


FINGERPRINT_SAMPLES = 16  # 64 KiB windows per weight file: cheap, yet any retrained weights differ


def target_fingerprint(path: str | Path) -> str:
    """Identify a target's weights without reading them all: config.json, then for each safetensors file
    its size, its header (names, dtypes, shapes) and evenly spaced 64 KiB windows of its tensor bytes.

    Two checkpoints of one architecture (a base and an instruct model) share config and headers but
    not their bytes, so a drafter trained for one is not silently resumed against the other."""
    path = Path(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(f"{file.name}:{size}\n".encode())
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
            start = 8 + header_len
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(start + (size - start) * i // FINGERPRINT_SAMPLES)
                h.update(f.read(1 << 16))
    return h.hexdigest()[:16]


def inspect_target(path: str | Path) -> TargetInfo:
    """Validate a Hugging Face model directory and read its shape. Errors say what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"--target_model {path}: not a directory (pass a local Hugging Face model directory or a hub name "
            "such as Qwen/Qwen3-8B)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"--target_model {path}: no config.json in the directory")
    if not list(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file():
        raise ValueError(
            f"--target_model {path}: no *.safetensors weights (pickled .bin weights are not loaded; "
            "convert them with `save_pretrained(..., safe_serialization=True)`)"
        )
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return target_info_from_config(config.get_text_config(decoder=True), path)


def target_info_from_config(config, path: Path) -> TargetInfo:
    """The shape of a target from its (text) config; `path` is where its files live."""
    rope = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", 10000.0),
    }
    return TargetInfo(
        path=path,
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(config, "max_position_embeddings", 32768),
        rope_parameters=dict(rope),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def layers_run(num_layers: int, target_layer_ids: list[int], topk: int) -> int:
    """How many of the target's layers its ranks run: up to the last tapped one, or all of them when they
    also compute soft targets (--target_topk), which need the final norm and the LM head."""
    return num_layers if topk else max(target_layer_ids) + 1


def truncated_parameter_count(info: TargetInfo, layers: int) -> int:
    """Parameters of the target cut after `layers` decoder layers (what a target rank loads), counted on the
    meta device from its own config: exact for any architecture transformers builds (biases, experts)."""
    config = AutoConfig.from_pretrained(info.path, num_hidden_layers=layers, local_files_only=True)
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModel.from_config(config).parameters())


def soft_target_compute_share(info: TargetInfo, target_layer_ids: list[int]) -> float:
    """About how much more compute a token costs when the target runs every layer and its LM head (soft
    targets) instead of stopping after the last tap: the ratio of the matrix parameters each token passes
    through, minus 1 (the embedding is a lookup; attention over the context is left out)."""
    embedding = info.vocab_size * info.hidden_size
    tapped = truncated_parameter_count(info, max(target_layer_ids) + 1) - embedding
    whole = truncated_parameter_count(info, info.num_layers) - embedding + embedding  # + the LM head
    return whole / tapped - 1
