"""Running the target as far as the drafter needs: the tapped layers' outputs (`hidden_states[L + 1]` of
transformers' tuple) with the later layers, the final norm and the LM head skipped; or, with soft targets
(--target_topk), the whole model and the top-k of its next-token distribution at every position.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers import logging as hf_logging

from dflash_ddp.data.batch import SoftTargets
from dflash_ddp.hub import LAYER_LISTS
from dflash_ddp.target_model.forward_code import altup_streams, hyper_connection_streams
from dflash_ddp.target_model.head import load_shared_embeddings
from dflash_ddp.target_model.info import TargetInfo, layers_run
from dflash_ddp.target_model.loading import load_target_model
from dflash_ddp.target_model.memory import SOFT_TARGET_CHUNK
from dflash_ddp.target_model.tensor_parallel import load_sharded
from dflash_ddp.target_model.text_stack import text_model_of


class _StopForward(Exception):
    """Raised after the last tapped layer so that later layers, the final norm and the head never run."""


def layer_output(output, streams: int = 1) -> torch.Tensor:
    """A decoder layer's hidden states as a whole local [B, S, H] tensor (`whole_output`). A hyper-connection
    model (DeepSeek V4, GLM-5) passes [B, S, streams, H] between its layers, after the layer's post-mix: the
    engines feed a drafter their mean over the streams (vLLM's `aux_recon.mean(dim=1)`), and so does
    training; Qwen4-exp passes its `streams` side by side, [B, S, streams x H]."""
    out = whole_output(output)
    if streams > 1 and out.dim() == 3:
        out = out.unflatten(-1, (streams, -1))
    return out.mean(dim=-2) if out.dim() == 4 else out


def whole_output(output) -> torch.Tensor:
    """A decoder layer's output tensor, whole and local. Under tensor parallelism transformers' plans leave
    it replicated (a plain tensor); a plan that leaves it sharded returns a DTensor, gathered here once, on
    the device."""
    out = output[0] if isinstance(output, tuple) else output
    return out.full_tensor() if hasattr(out, "full_tensor") else out


class AltUpReadout:
    """Gemma 3n's hidden states at a layer: its AltUp streams ([streams, B, S, H] between its layers) read out
    as its text model reads its last layer's into its final hidden state (before the norm): the first stream
    as it is, each other one through its `altup_unembed_projections` and rescaled to the first's magnitude,
    then their mean. There is no engine's convention to follow (vLLM serves no drafter of it); this is the
    model's own, and the last layer's tap, normed, is its final hidden state exactly."""

    def __init__(self, text_model: nn.Module):
        self.projections = text_model.altup_unembed_projections

    def __call__(self, output) -> torch.Tensor:
        streams = whole_output(output)
        first = streams[0]
        magnitude = torch.mean(first**2, dim=-1, keepdim=True) ** 0.5
        read = [first]
        for stream, projection in zip(streams[1:], self.projections, strict=True):
            projected = projection(stream).to(first.dtype)
            scale = torch.sqrt(torch.mean(projected**2, dim=-1, keepdim=True).clamp(min=1e-5))
            read.append(projected * magnitude / scale)
        return torch.stack(read).mean(dim=0)


def stream_readout(model: nn.Module) -> Callable[[Any], torch.Tensor]:
    """How a decoder layer's output of `model` becomes the [B, S, H] hidden states a drafter reads: the
    layer's output, or the mean of a hyper-connection model's streams (`layer_output`), or Gemma 3n's AltUp
    streams read out as its final hidden state is (`AltUpReadout`)."""
    if altup_streams(model.config):
        return AltUpReadout(text_model_of(model))
    return functools.partial(layer_output, streams=hyper_connection_streams(model.config))


# a text model's final norm, under the names families give it: Llama's and most; GPT-2's family, Falcon and
# BLOOM; OPT; MPT and Nemotron-H; Phi-2, Falcon-H1, Jamba and Zamba; RecurrentGemma
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "norm_f", "final_layernorm", "final_norm")


def _text_model_part(model: nn.Module, names: tuple[str, ...], kind: type) -> nn.Module | None:
    """The first of `names` that the model's `.model` (or the model itself) holds as a `kind`, else that its
    text model holds (a wrapper loaded whole: searched for only then); None where neither holds one."""

    def owners():
        yield getattr(model, "model", model)
        yield text_model_of(model)

    return next(
        (
            part
            for owner in owners()
            for name in names
            if isinstance(part := getattr(owner, name, None), kind)
        ),
        None,
    )


def last_layer_norm(model: nn.Module, layer_ids: list[int], num_layers: int) -> nn.Module | None:
    """The target's final norm when `layer_ids` include its last decoder layer N-1, else None.

    A tap on layer L reads transformers' `hidden_states[L + 1]`, and for L = N-1 transformers puts the
    final-normed output there, not the layer's raw output. transformers' own DFlash generate and the z-lab
    reference read exactly that entry when serving, so training must see the same features (on the tiny
    target the raw and normed outputs differ by up to 3.4). A hyper-connection model's last tap is the mean
    of its streams as for any other layer: the engines take it before the model's own reduction and norm."""
    if num_layers - 1 not in layer_ids or hyper_connection_streams(model.config) > 1:
        return None
    norm = _text_model_part(model, FINAL_NORMS, nn.Module)
    if norm is None:
        raise ValueError(
            f"--target_layer_ids {list(layer_ids)} include the target's last layer {num_layers - 1}, whose "
            f"features are its final-normed output, but {type(model).__name__} has no final norm at "
            f"{', '.join('`.' + n + '`' for n in FINAL_NORMS)} of its text model; tap layers below {num_layers - 1}"
        )
    return norm


@contextlib.contextmanager
def capture_layer_outputs(
    layers: nn.ModuleList,
    layer_ids: list[int],
    stop_after_last: bool,
    final_norm: nn.Module | None = None,
    readout: Callable[[Any], torch.Tensor] = layer_output,
):
    """Record the outputs of `layers[i]` for i in layer_ids (the OUTPUT of decoder layer L is the
    `hidden_states[L + 1]` of transformers). Yields the dict that fills during the forward.

    `final_norm` (from `last_layer_norm`, given when `layers` is the whole decoder and its last layer is
    tapped) is applied to that layer's output, as transformers does for `hidden_states[N]`; `readout` (from
    `stream_readout`) reads a layer's output as hidden states."""
    captured: dict[int, torch.Tensor] = {}
    last = max(layer_ids)
    normed = len(layers) - 1 if final_norm is not None else None

    def make_hook(idx):
        def hook(_module, _inputs, output):
            out = readout(output)
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


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a text model, a causal LM, or a wrapper loaded whole (GLM-5: those of the
    module that owns the input embedding), under the names families give them."""
    layers = _text_model_part(model, LAYER_LISTS, nn.ModuleList)
    if layers is not None:
        return layers
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__} (expected one of "
        f"{', '.join('`.' + n + '`' for n in LAYER_LISTS)} on its text model)"
    )


class TargetFeatureExtractor:
    """A frozen target that returns the concatenated tapped features and, with `topk` > 0, soft targets.

    Without soft targets the target is truncated after its last tapped layer. With them it runs every
    layer, the final norm and the LM head (read from its files as the drafter's shared head is), and keeps
    the top-`topk` probabilities of each position's next token. With `meshes` (tensor_parallel.group_meshes)
    this rank holds its shard of the group's copy, and every rank of the group must call it on the same
    batches: each layer ends in an all-reduce among them."""

    def __init__(
        self,
        info: TargetInfo,
        target_layer_ids: list[int],
        device: torch.device,
        dtype: torch.dtype,
        meshes=None,
        topk: int = 0,
        prefill_tokens: int = 0,
    ):
        self.target_layer_ids = list(target_layer_ids)
        self.topk = topk
        self.prefill_tokens = prefill_tokens  # positions run at once (0: the whole sequence in one pass)
        keep = layers_run(info.num_layers, self.target_layer_ids, topk)
        # the prefill's cache is laid out for the whole text stack (the layers past the cut stay empty): a cut
        # of a hybrid target that keeps linear-attention layers alone would leave it no attention layer,
        # which transformers' mask builder reads its sizes from
        self.cache_config = info.text_stack().config
        # a text model that attends both ways (an embedding model's setting) would read its padding
        self.causal = getattr(self.cache_config, "is_causal", True) is not False and not getattr(
            self.cache_config, "use_bidirectional_attention", False
        )
        # Load only the layers that run: later layers, the norm's use and the LM head are skipped.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # the dropped layers are reported as unused weights; that is intended
        try:
            if meshes is None:
                self.model = load_target_model(info, keep, dtype, device)
            else:
                self.model = load_sharded(info, keep, dtype, device, meshes)
        finally:
            hf_logging.set_verbosity(verbosity)
        self.model.to(device).eval().requires_grad_(False)
        self.layers = decoder_layers(self.model)
        self.final_norm = last_layer_norm(self.model, self.target_layer_ids, info.num_layers)
        self.readout = stream_readout(self.model)
        self.lm_head = load_shared_embeddings(info)[1].to(device, dtype) if topk else None
        self.device = device

    @torch.no_grad()  # not inference_mode: the drafter's autograd graph reads these features
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, SoftTargets | None]:
        """[B, S] ids and padding mask of a right-padded batch -> ([B, S, K*H] features of the tapped layers
        in tap order, the soft targets or None).

        Padding positions are zeroed so that a batch's features are the same whether they were computed
        here or packed, sent and re-padded by the channel."""
        real = attention_mask[..., None]
        # the model gets the padding mask only where it attends both ways (see `_piece`)
        mask = None if self.causal else attention_mask
        # more rows than a piece's positions: groups of that many rows, a position of each at a time
        rows = input_ids.shape[0]
        group = self.prefill_tokens if 0 < self.prefill_tokens < rows else rows
        runs = [
            self._prefill(
                input_ids[first : first + group], None if mask is None else mask[first : first + group]
            )
            for first in range(0, rows, group)
        ]
        features = torch.cat([f for f, _ in runs]) if len(runs) > 1 else runs[0][0]
        if not self.topk:
            return features * real.to(features.dtype), None
        hidden = torch.cat([h for _, h in runs]) if len(runs) > 1 else runs[0][1]
        soft = top_k_next_tokens(hidden, self.lm_head, self.topk)
        return features * real.to(features.dtype), SoftTargets(
            soft.ids * real.to(soft.ids.dtype), soft.probs * real.to(soft.probs.dtype)
        )

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """The tapped features (and final hidden states, or None) of rows at most --target_prefill_tokens
        many, in one pass or in pieces (`_pieces`)."""
        pieces = [
            self._piece(input_ids, attention_mask, start, end, cache)
            for start, end, cache in self._pieces(input_ids)
        ]
        if len(pieces) == 1:
            return pieces[0]
        hidden = torch.cat([h for _, h in pieces], dim=1) if self.topk else None
        return torch.cat([f for f, _ in pieces], dim=1), hidden

    def _pieces(self, input_ids: torch.Tensor):
        """(first position, end, cache) of each piece of the prefill: one pass without a cache, or pieces of
        `prefill_tokens` positions of the batch (that many over its rows: prefill_tokens // rows of each)
        sharing one KV cache, each piece attending to the cached ones before it."""
        rows, length = input_ids.shape
        piece = max(1, self.prefill_tokens // rows)
        if not self.prefill_tokens or length <= piece:
            return [(0, length, None)]
        cache = DynamicCache(config=self.cache_config)
        return [(start, min(start + piece, length), cache) for start in range(0, length, piece)]

    def _piece(self, input_ids, attention_mask, start: int, end: int, cache):
        """The tapped features (and, with soft targets, the final hidden states) of positions start..end.

        A causal target gets no padding mask (`attention_mask` None): rows are right-padded, so under
        causal attention (and causal recurrences) a real position never reaches its row's padding, and the
        padding's own outputs are zeroed afterwards. Given the mask, transformers would build an explicit
        [rows, queries, keys] one for any padded batch and take SDPA's masked kernel (repeating grouped keys
        and values); without it a one-pass forward of full-attention layers runs torch's causal kernel."""
        run = {"input_ids": input_ids[:, start:end]}
        run["attention_mask"] = None if attention_mask is None else attention_mask[:, :end]
        run |= {"cache": cache, "use_cache": True} if cache is not None else {"use_cache": False}
        if not self.topk:
            return tapped_features(
                self.model, self.layers, self.target_layer_ids, final_norm=self.final_norm, **run
            ), None
        with capture_layer_outputs(
            self.layers, self.target_layer_ids, False, final_norm=self.final_norm, readout=self.readout
        ) as captured:
            last = self.model(**run)
        hidden = last.last_hidden_state
        hidden = hidden.full_tensor() if hasattr(hidden, "full_tensor") else hidden
        return torch.cat([captured[i] for i in self.target_layer_ids], dim=-1), hidden


def top_k_next_tokens(hidden: torch.Tensor, lm_head: torch.Tensor, k: int) -> SoftTargets:
    """The top-k of softmax(hidden @ lm_head.T) for [B, S, H] final-normed states, computed in fp32
    SOFT_TARGET_CHUNK positions at a time (the full logits of a batch never exist at once)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids = torch.empty(flat.shape[0], k, dtype=torch.int32, device=flat.device)
    probs = torch.empty(flat.shape[0], k, dtype=torch.bfloat16, device=flat.device)
    for start in range(0, flat.shape[0], SOFT_TARGET_CHUNK):
        logits = (flat[start : start + SOFT_TARGET_CHUNK] @ lm_head.T).float()
        top = torch.softmax(logits, dim=-1).topk(k, dim=-1)
        ids[start : start + SOFT_TARGET_CHUNK] = top.indices
        probs[start : start + SOFT_TARGET_CHUNK] = top.values
    return SoftTargets(ids.view(*hidden.shape[:-1], k), probs.view(*hidden.shape[:-1], k))


def tapped_features(
    model, layers, layer_ids, input_ids, attention_mask, final_norm=None, **kwargs
) -> torch.Tensor:
    """Run `model` until the last tapped layer and concatenate the tapped layers' outputs (the last
    layer's through `final_norm`, see `capture_layer_outputs`); `kwargs` go to the model (use_cache=False
    unless they say otherwise)."""
    kwargs.setdefault("use_cache", False)
    with (
        capture_layer_outputs(
            layers,
            layer_ids,
            stop_after_last=True,
            final_norm=final_norm,
            readout=stream_readout(model),
        ) as captured,
        contextlib.suppress(_StopForward),
    ):
        model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    return torch.cat([captured[i] for i in layer_ids], dim=-1)
