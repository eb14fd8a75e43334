"""The frozen target: checking its directory, running it only as far as the drafter needs, and
loading the two tensors the drafter shares with it (input embedding and LM head).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers import logging as hf_logging

from .tensor_parallel import load_sharded


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
            f"--target_model {path}: not a directory (pass a local Hugging Face model directory)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"--target_model {path}: no config.json in the directory")
    if not list(path.glob("*.safetensors")):
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


def default_target_layer_ids(num_layers: int, num_taps: int = 5) -> list[int]:
    """K layers evenly spaced from 1 to N-3 (the paper's choice: [1, 9, 17, 25, 33] for 36 layers)."""
    if num_layers < 4:
        raise ValueError(f"the target has {num_layers} layers; pass --target_layer_ids explicitly")
    last = num_layers - 3
    num_taps = min(num_taps, last)
    if num_taps == 1:
        return [last]
    return [round(1 + i * (last - 1) / (num_taps - 1)) for i in range(num_taps)]


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


class _StopForward(Exception):
    """Raised after the last tapped layer so that later layers, the final norm and the head never run."""


def _layer_output(output) -> torch.Tensor:
    """A decoder layer's hidden states as a whole local tensor. Under tensor parallelism transformers'
    plans leave them replicated (plain tensors); a plan that leaves them sharded returns a DTensor, gathered
    here once, on the device."""
    out = output[0] if isinstance(output, tuple) else output
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def last_layer_norm(model: nn.Module, layer_ids: list[int], num_layers: int) -> nn.Module | None:
    """The target's final norm when `layer_ids` include its last decoder layer N-1, else None.

    A tap on layer L reads transformers' `hidden_states[L + 1]`, and for L = N-1 transformers puts the
    final-normed output there, not the layer's raw output. transformers' own DFlash generate and the z-lab
    reference read exactly that entry when serving, so training must see the same features (on the tiny
    target the raw and normed outputs differ by up to 3.4)."""
    if num_layers - 1 not in layer_ids:
        return None
    norm = getattr(getattr(model, "model", model), "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(
            f"--target_layer_ids {list(layer_ids)} include the target's last layer {num_layers - 1}, whose "
            f"features are its final-normed output, but {type(model).__name__} has no final norm at `.norm` "
            f"or `.model.norm`; tap layers below {num_layers - 1}"
        )
    return norm


@contextlib.contextmanager
def capture_layer_outputs(
    layers: nn.ModuleList, layer_ids: list[int], stop_after_last: bool, final_norm: nn.Module | None = None
):
    """Record the outputs of `layers[i]` for i in layer_ids (the OUTPUT of decoder layer L is the
    `hidden_states[L + 1]` of transformers). Yields the dict that fills during the forward.

    `final_norm` (from `last_layer_norm`, given when `layers` is the whole decoder and its last layer is
    tapped) is applied to that layer's output, as transformers does for `hidden_states[N]`."""
    captured: dict[int, torch.Tensor] = {}
    last = max(layer_ids)
    normed = len(layers) - 1 if final_norm is not None else None

    def make_hook(idx):
        def hook(_module, _inputs, output):
            out = _layer_output(output)
            captured[idx] = final_norm(out) if idx == normed else out
            if stop_after_last and idx == last:
                raise _StopForward

        return hook

    handles = [layers[i].register_forward_hook(make_hook(i)) for i in layer_ids]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} (expected `.model.layers`)"
        )
    return layers


def truncated_parameter_count(info: TargetInfo, layers: int) -> int:
    """Parameters of the target cut after `layers` decoder layers (what a target rank loads), counted on the
    meta device from its own config: exact for any architecture transformers builds (biases, experts)."""
    config = AutoConfig.from_pretrained(info.path, num_hidden_layers=layers, local_files_only=True)
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModel.from_config(config).parameters())


class TargetFeatureExtractor:
    """A frozen target truncated after its last tapped layer; returns the concatenated tapped features.

    With `meshes` (tensor_parallel.group_meshes) this rank holds its shard of the group's copy, and every
    rank of the group must call it on the same batches: each layer ends in an all-reduce among them."""

    def __init__(
        self,
        info: TargetInfo,
        target_layer_ids: list[int],
        device: torch.device,
        dtype: torch.dtype,
        meshes=None,
    ):
        self.target_layer_ids = list(target_layer_ids)
        keep = max(self.target_layer_ids) + 1
        # Load only the layers up to the last tap: later layers, the norm's use and the LM head are skipped.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # the dropped layers are reported as unused weights; that is intended
        try:
            if meshes is None:
                self.model = AutoModel.from_pretrained(
                    info.path, num_hidden_layers=keep, dtype=dtype, local_files_only=True
                )
            else:
                self.model = load_sharded(info, keep, dtype, device, meshes)
        finally:
            hf_logging.set_verbosity(verbosity)
        self.model.to(device).eval().requires_grad_(False)
        self.layers = _decoder_layers(self.model)
        self.final_norm = last_layer_norm(self.model, self.target_layer_ids, info.num_layers)
        self.device = device

    @torch.no_grad()  # not inference_mode: the drafter's autograd graph reads these features
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, S] ids and padding mask -> [B, S, K*H] features of the tapped layers, in tap order.

        Padding positions are zeroed so that a batch's features are the same whether they were computed
        here or packed, sent and re-padded by the channel."""
        features = tapped_features(
            self.model, self.layers, self.target_layer_ids, input_ids, attention_mask, self.final_norm
        )
        return features * attention_mask[..., None].to(features.dtype)


def tapped_features(
    model, layers, layer_ids, input_ids, attention_mask, final_norm=None, **kwargs
) -> torch.Tensor:
    """Run `model` until the last tapped layer and concatenate the tapped layers' outputs (the last
    layer's through `final_norm`, see `capture_layer_outputs`)."""
    with (
        capture_layer_outputs(layers, layer_ids, stop_after_last=True, final_norm=final_norm) as captured,
        contextlib.suppress(_StopForward),
    ):
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    return torch.cat([captured[i] for i in layer_ids], dim=-1)


def load_causal_lm(info: TargetInfo, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The whole target with its LM head, for generation and speculative verification."""
    model = AutoModelForCausalLM.from_pretrained(info.path, dtype=dtype, local_files_only=True)
    return model.to(device).eval().requires_grad_(False)
