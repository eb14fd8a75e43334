"""The drafter side: building the drafter for a target, and one optimizer step on target features.

`DrafterTrainer.step` is the only place the drafter trains; the colocated loop and the distributed
drafter ranks both call it with (batch, features) pairs.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import get_cosine_schedule_with_warmup

from .data import Batch
from .model import DFlashDraftConfig, DFlashDraftModel
from .objective import (
    LossTerms,
    block_loss_terms,
    build_block_inputs,
    dense_block_mask,
    flex_block_mask,
    sample_anchors,
)
from .target import SharedTargetHead, TargetInfo, default_target_layer_ids


def resolve_mask_token_id(tokenizer, info: TargetInfo, requested: int | None) -> int:
    """The mask token: --mask_token_id, else the tokenizer's mask token; it must have an embedding row."""
    mask_id = requested if requested is not None else getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise ValueError(
            f"the tokenizer of {info.path} defines no mask token: pass --mask_token_id with an id whose "
            f"embedding row exists (an unused/reserved token, < vocab size {info.vocab_size})"
        )
    if not 0 <= mask_id < info.vocab_size:
        raise ValueError(
            f"--mask_token_id {mask_id} is outside the target's embedding (vocab size {info.vocab_size})"
        )
    return mask_id


def resolve_target_layer_ids(info: TargetInfo, requested: list[int] | None) -> list[int]:
    """--target_layer_ids, else the paper's default; every id must name a decoder layer of the target."""
    ids = list(requested) if requested is not None else default_target_layer_ids(info.num_layers)
    bad = [i for i in ids if not 0 <= i < info.num_layers]
    if bad:
        raise ValueError(
            f"--target_layer_ids {ids}: {bad} out of range; the target has {info.num_layers} layers (0..{info.num_layers - 1})"
        )
    if sorted(set(ids)) != ids:
        raise ValueError(f"--target_layer_ids {ids}: give distinct ids in increasing order")
    return ids


def drafter_config_for(
    info: TargetInfo, num_layers: int, target_layer_ids: list[int], mask_token_id: int, block_size: int
) -> DFlashDraftConfig:
    """A drafter as wide as the target (hidden, MLP, heads, head_dim) with DFlash's own depth and settings."""
    return DFlashDraftConfig(
        vocab_size=info.vocab_size,
        hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads,
        head_dim=info.head_dim,
        rms_norm_eps=info.rms_norm_eps,
        max_position_embeddings=info.max_position_embeddings,
        rope_parameters=info.rope_parameters,
        num_target_layers=info.num_layers,
        target_layer_ids=target_layer_ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
    )


@dataclass
class StepSettings:
    """What one optimizer step needs besides the data and the model."""

    num_anchors: int
    seed: int
    max_grad_norm: float
    loss_chunk_size: int
    attention: str  # "sdpa" or "flex"
    loss_gamma: float | None = None


@dataclass
class OptimizerSettings:
    """AdamW with a cosine schedule and linear warmup."""

    learning_rate: float
    weight_decay: float
    warmup_ratio: float
    total_steps: int


class DrafterTrainer:
    """Owns the drafter, the shared target head, AdamW and the cosine schedule."""

    def __init__(
        self,
        drafter: DFlashDraftModel,
        head: SharedTargetHead,
        settings: StepSettings,
        optim: OptimizerSettings,
        group=None,
    ):
        self.drafter = drafter
        self.group = group  # the drafter ranks' process group when M > 1
        self.head = head
        self.settings = settings
        self.device = next(drafter.parameters()).device
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=optim.learning_rate, weight_decay=optim.weight_decay, betas=(0.9, 0.95)
        )
        self.scheduler = get_cosine_schedule_with_warmup(
            self.optimizer, math.ceil(optim.warmup_ratio * optim.total_steps), optim.total_steps
        )
        self.global_step = 0

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # fp32 on CPU: exact, and what the parity tests compare

    def _mask(self, anchors: torch.Tensor, context_len: int):
        bs = self.drafter.config.block_size
        if self.settings.attention == "flex":
            return flex_block_mask(anchors, context_len, bs)
        return dense_block_mask(anchors, context_len, bs)

    def sum_over_drafters(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over all drafter ranks (itself when there is one)."""
        if self.group is not None:
            t = t.clone()
            dist.all_reduce(t, group=self.group)
        return t

    def _sync_gradients(self) -> None:
        """Sum the gradients of all drafter ranks (the loss is already globally normalised)."""
        grads = [p.grad for p in self.drafter.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def step(self, micro_batches: list[tuple[Batch, torch.Tensor, int]]) -> dict:
        """One optimizer step over (batch, target features, epoch) micro-batches; returns metrics.

        The loss is normalised by the weight sum of ALL micro-batches of ALL drafter ranks, and the
        ranks' gradients are summed, so the update does not depend on how the global batch is split.
        """
        cfg = self.drafter.config
        prepared = []
        for batch, features, epoch in micro_batches:
            anchors = [
                sample_anchors(
                    batch.loss_mask[b, : int(batch.attention_mask[b].sum())],
                    self.settings.num_anchors,
                    self.settings.seed,
                    epoch,
                    int(batch.sample_ids[b]),
                )
                for b in range(batch.input_ids.shape[0])
            ]
            inputs = build_block_inputs(
                batch.input_ids.to(self.device),
                batch.loss_mask.to(self.device),
                anchors,
                cfg.block_size,
                cfg.mask_token_id,
                self.settings.loss_gamma,
            )
            prepared.append((inputs, features.to(self.device)))
        weight_sum = self.sum_over_drafters(sum(inputs.weight_sum for inputs, _ in prepared))
        totals: LossTerms | None = None
        for inputs, features in prepared:
            with self._autocast():
                out = self.drafter(
                    self.head.embed_tokens(inputs.block_ids),
                    features,
                    inputs.position_ids,
                    self._mask(inputs.anchors, inputs.context_len),
                ).last_hidden_state
                terms = block_loss_terms(out, self.head.lm_head_weight, inputs, self.settings.loss_chunk_size)
            (terms.loss_sum / weight_sum.clamp(min=1e-12)).backward()
            terms = LossTerms(*(t.detach() for t in vars(terms).values()))
            totals = terms if totals is None else _add_terms(totals, terms)
        if self.group is not None:
            self._sync_gradients()
            totals = LossTerms(*(self.sum_over_drafters(t) for t in vars(totals).values()))
        if not math.isfinite(float(totals.loss_sum)):
            raise FloatingPointError(f"non-finite loss at step {self.global_step + 1}; lower --learning_rate")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.settings.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        metrics = totals.metrics()
        metrics.update({"step": self.global_step, "lr": lr, "grad_norm": float(grad_norm)})
        return metrics


def _add_terms(a: LossTerms, b: LossTerms) -> LossTerms:
    return LossTerms(*(x + y for x, y in zip(vars(a).values(), vars(b).values(), strict=True)))


def build_drafter(config: DFlashDraftConfig, seed: int, device: torch.device) -> DFlashDraftModel:
    """A freshly initialised drafter; the init depends only on the seed (the same on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DFlashDraftModel(config)
    return model.to(device).train()
