"""The two tensors the drafter shares with the target (input embedding and LM head), read straight from the
target's safetensors files without building the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dflash_ddp.target_model.info import TargetInfo


def _tensor_locations(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    locations = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            locations.update({name: file for name in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return locations


def _find_tensor(locations: dict[str, Path], suffix: str) -> str | None:
    matches = sorted(name for name in locations if name == suffix or name.endswith("." + suffix))
    # Prefer the shortest name: "model.embed_tokens.weight" over a vision tower's embedding.
    return min(matches, key=len) if matches else None


def load_shared_embeddings(info: TargetInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ONLY the input embedding and LM head from the target's safetensors (never the whole model)."""
    locations = _tensor_locations(info.path)
    embed_name = _find_tensor(locations, "embed_tokens.weight")
    if embed_name is None:
        raise ValueError(
            f"--target_model {info.path}: no '*embed_tokens.weight' tensor in the safetensors files"
        )
    head_name = _find_tensor(locations, "lm_head.weight")
    if head_name is None and not info.tie_word_embeddings:
        raise ValueError(
            f"--target_model {info.path}: no 'lm_head.weight' tensor and tie_word_embeddings is false"
        )
    tensors = {}
    for name in filter(None, [embed_name, head_name]):
        with safe_open(locations[name], framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    embed = tensors[embed_name]
    head = tensors[head_name] if head_name else embed
    return embed, head


class SharedTargetHead(nn.Module):
    """The target's frozen embedding and LM head, held beside the drafter (not part of its checkpoint)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.float(), freeze=True)
        self.lm_head_weight = nn.Parameter(lm_head_weight.float(), requires_grad=False)

    @classmethod
    def from_target(cls, info: TargetInfo) -> SharedTargetHead:
        return cls(*load_shared_embeddings(info))

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.num_embeddings
