"""One optimizer step of the drafter on target features: `DrafterTrainer.step` is the only place the drafter
trains; the colocated loop and the distributed drafter ranks both call it with (batch, features) pairs.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from transformers import get_cosine_schedule_with_warmup

from dflash_ddp.data.batch import Batch, SoftTargets
from dflash_ddp.drafter.attention import LayerMasks, block_layout, dense_block_mask
from dflash_ddp.drafter.blocks import BlockInputs, build_block_inputs, plan_draft_chunks, sample_anchors
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.families import build_model
from dflash_ddp.drafter.flex import flex_block_mask, min_anchor_slots
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.drafter.objective import LossTerms
from dflash_ddp.drafter.optimizer import DEFAULT_ORTHOGONALISATION, build_optimizer
from dflash_ddp.drafter.step_timer import StepTimer
from dflash_ddp.drafter.weighting import LossSettings, loss_gamma, scheduled_gamma
from dflash_ddp.parallel.devices import compute_dtype
from dflash_ddp.target_model.head import SharedTargetHead


@dataclass
class StepSettings:
    """What one optimizer step needs besides the data and the model."""

    num_anchors: int
    seed: int
    max_grad_norm: float
    attention: str  # "sparse", "flex" or "dense" (see attention.py)
    chunk_tokens: int  # draft positions per drafter forward/backward (--drafter_chunk_tokens)
    loss: LossSettings = field(default_factory=LossSettings)
    loss_gamma_start: float | None = None  # the decay constant moves from this to loss.gamma over the steps
    anchor_rule: str = "response"  # response | prompt_end (see blocks.sample_anchors)
    anchor_scale_tokens: int = 0  # > 0: num_anchors per that many tokens of a longer sequence


@dataclass
class DraftChunk:
    """One forward/backward of the drafter: a few sequences' blocks, their features and attention mask."""

    inputs: BlockInputs  # on the compute device
    features: torch.Tensor  # [rows, context_len, K*H]
    mask: object  # BlockLayout, BlockMask or boolean tensor (see attention.attend)
    weight_sum: float  # of inputs.weights, computed on the host before the copy


@dataclass
class OptimizerSettings:
    """AdamW (or Muon with AdamW, see optimizer.py) with a cosine schedule and linear warmup."""

    learning_rate: float
    weight_decay: float
    warmup_ratio: float
    total_steps: int
    optimizer: str = "adamw"
    muon_orthogonalisation: str = DEFAULT_ORTHOGONALISATION


class DrafterTrainer:
    """Owns the drafter, the shared target head, the optimizer and the cosine schedule."""

    def __init__(
        self,
        drafter: DFlashDraftModel,
        head: SharedTargetHead,
        settings: StepSettings,
        optim: OptimizerSettings,
        group=None,
        lazy_checks: bool | None = None,
    ):
        self.drafter = drafter
        self.group = group  # the drafter ranks' process group when M > 1
        self.head = head
        drafter.bind_target(head.embed_tokens)
        # the target's logits are the head's, scaled and soft-capped where the target does (Falcon-H1, Gemma)
        conventions = {"logit_scale": head.logit_scale, "logit_softcap": head.logit_softcapping}
        self.device = next(drafter.parameters()).device
        # on CUDA each piece of the LM-head loss runs compiled: its passes over [rows, vocabulary] fuse
        compile_backend = "inductor" if self.device.type == "cuda" else None
        loss = replace(settings.loss, **conventions, compile_backend=compile_backend)
        self.settings = replace(settings, loss=loss)
        # Reading a device value stalls a GPU's queue: on CUDA the finite-loss check and the metrics wait
        # for a logging step (on the CPU a read costs nothing, so the check happens before the update).
        # Only fused AdamW can skip a non-finite update on the device: with Muon the check stays eager.
        if lazy_checks is None:
            lazy_checks = self.device.type == "cuda" and optim.optimizer == "adamw"
        self.lazy_checks = lazy_checks
        self.optimizer = build_optimizer(
            drafter,
            optim.optimizer,
            optim.learning_rate,
            optim.weight_decay,
            fused=self.lazy_checks,
            orthogonalisation=optim.muon_orthogonalisation,
        )
        self.scheduler = get_cosine_schedule_with_warmup(
            self.optimizer, math.ceil(optim.warmup_ratio * optim.total_steps), optim.total_steps
        )
        self.optim = optim
        self.global_step = 0
        self._first_bad_step = torch.zeros((), dtype=torch.long, device=self.device)
        self.timer = StepTimer(self.device, enabled=False)  # the step-cost benchmark turns it on
        # the matrices cast to bf16 once a step (`_step_weights`): on CUDA, where the forward runs in bf16
        self.casts_weights_once = self.device.type == "cuda"

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()  # fp32 on CPU: exact, and what the parity tests compare

    def _mask(self, anchors: torch.Tensor, context_len: int):
        """The chunk's attention rule in the form the chosen path takes (for full and sliding-window layers
        apart when the drafter has both kinds); `anchors` are on the host."""
        cfg = self.drafter.config
        if cfg.slides:
            return LayerMasks(
                self._path_mask(anchors, context_len),
                self._path_mask(anchors, context_len, cfg.sliding_window),
            )
        return self._path_mask(anchors, context_len)

    def _path_mask(self, anchors: torch.Tensor, context_len: int, window: int | None = None):
        cfg = self.drafter.config
        if self.settings.attention == "flex":
            return flex_block_mask(anchors.to(self.device), context_len, cfg.block_size, window)
        if self.settings.attention == "dense":
            return dense_block_mask(anchors.to(self.device), context_len, cfg.block_size, window)
        heads = cfg.num_attention_heads
        return block_layout(anchors, context_len, cfg.block_size, heads, self.device, window)

    def sum_over_drafters(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over all drafter ranks (itself when there is one)."""
        if self.group is not None:
            t = t.clone()
            dist.all_reduce(t, group=self.group)
        return t

    def _sum_terms(self, terms: LossTerms) -> LossTerms:
        """The loss terms summed over the drafter ranks, in one all-reduce."""
        parts = [t.detach().reshape(-1) for t in vars(terms).values()]
        flat = self.sum_over_drafters(torch.cat(parts))
        pieces = flat.split([p.numel() for p in parts])
        return LossTerms(*(p.view_as(t) for p, t in zip(pieces, vars(terms).values(), strict=True)))

    def _sync_gradients(self) -> None:
        """Sum the gradients of all drafter ranks (the loss is already globally normalised)."""
        grads = [p.grad for p in self.drafter.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _chunks(
        self, batch: Batch, features: torch.Tensor, epoch: int, soft: SoftTargets | None = None
    ) -> list[DraftChunk]:
        """The micro-batch's draft blocks as chunks of at most --drafter_chunk_tokens draft positions."""
        cfg, settings = self.drafter.config, self.settings
        lengths = batch.attention_mask.sum(dim=1).tolist()
        anchors = batch_anchors(batch, settings, epoch)
        min_slots = min_anchor_slots(cfg.block_size) if settings.attention == "flex" else 1
        loss = self._loss_settings()
        chunks = []
        for pieces in plan_draft_chunks(anchors, lengths, cfg.block_size, settings.chunk_tokens):
            rows = [row for row, _ in pieces]
            context_len = max(lengths[row] for row in rows)  # keys past every row's end are never visible
            inputs = build_block_inputs(
                batch.input_ids[rows, :context_len],
                batch.loss_mask[rows, :context_len],
                [part for _, part in pieces],
                cfg.block_size,
                cfg.mask_token_id,
                loss,
                min_slots,
                soft_rows(soft, rows, context_len) if loss.soft_targets else None,
            )
            rows_t = torch.tensor(rows, device=features.device)
            chunks.append(
                DraftChunk(
                    inputs.to(self.device),
                    # contiguous whatever the sender's padding: GEMM blocking (and rounding) follows strides
                    features[:, :context_len].index_select(0, rows_t),
                    self._mask(inputs.anchors, context_len),
                    float(inputs.weight_sum),
                )
            )
        return chunks

    def _loss_settings(self) -> LossSettings:
        """The loss settings of this step: the decay's constant on its schedule when it has one."""
        settings = self.settings
        if settings.loss_gamma_start is None:
            return settings.loss
        end = (
            loss_gamma(self.drafter.config.block_size) if settings.loss.gamma is None else settings.loss.gamma
        )
        gamma = scheduled_gamma(settings.loss_gamma_start, end, self.global_step, self.optim.total_steps)
        return replace(settings.loss, gamma=gamma)

    def _step_weights(self) -> dict[str, torch.Tensor] | None:
        """The drafter's matrices in bf16 for every chunk of a step, on CUDA with layers that keep their
        activations: autocast would cast each one again for every chunk. The casts stay in the graph, so each
        chunk's gradients still reach the fp32 weights (and in bf16, as under autocast). None elsewhere: the CPU
        trains in fp32, and recomputing layers cast in their own backward."""
        if not self.casts_weights_once or self.drafter.recomputes:
            return None
        return {name: p.to(torch.bfloat16) for name, p in self.drafter.named_parameters() if p.ndim == 2}

    def _forward_backward(
        self, chunk: DraftChunk, weight_sum: torch.Tensor, weights: dict | None = None
    ) -> LossTerms:
        """One chunk's forward and backward (gradients accumulate); its loss terms, detached. `weights`: the
        step's cast matrices (`_step_weights`)."""
        inputs, timer = chunk.inputs, self.timer
        args = (self.head.embed(inputs.block_ids), chunk.features, inputs.position_ids, chunk.mask)
        with self._autocast():
            with timer.part("drafter forward"):
                if weights is None:
                    out = self.drafter(*args).last_hidden_state
                else:
                    out = torch.func.functional_call(
                        self.drafter, weights, args, strict=False
                    ).last_hidden_state
            with timer.part("loss"):
                terms = self.drafter.loss_terms(out, self.head.lm_head_weight, inputs, self.settings.loss)
        with timer.part("backward"):
            (terms.loss_sum / weight_sum.clamp(min=1e-12)).backward()
        # detached, so the next chunk's activations never meet this one's
        return LossTerms(*(t.detach() for t in vars(terms).values()))

    def warm_up(self) -> None:
        """Forward and backward on made-up batches of two sequences and of one, then drop the gradients.

        On CUDA this compiles the flex kernel (both of its graphs), the layers' regions (with the cast weights
        a step passes them) and the loss's pieces, and grows the allocator before the hidden-state channel
        opens, so no target's send waits on the drafter's first, slowest step. Nothing a training step reads
        changes: no optimizer step, no generator drawn from."""
        config, length = self.drafter.config, 2 * 128
        width = len(config.target_layer_ids) * config.hidden_size
        weights = self._step_weights()  # as a step runs: compiled regions trace the weights it passes
        for rows in (2, 1):
            ids = torch.arange(rows * length).view(rows, length) % config.vocab_size
            batch = Batch(ids, torch.ones_like(ids), torch.ones_like(ids), torch.arange(rows))
            features = torch.zeros(rows, length, width, dtype=compute_dtype(self.device), device=self.device)
            weight_sum = torch.ones((), device=self.device)
            soft = None
            if self.settings.loss.soft_targets:  # made-up soft targets: the top 2 tokens, equally likely
                soft = SoftTargets(
                    torch.stack([ids, ids + 1], -1).remainder(config.vocab_size).int(),
                    torch.full((rows, length, 2), 0.5, dtype=torch.bfloat16),
                )
            for chunk in self._chunks(batch, features, epoch=0, soft=soft):
                self._forward_backward(chunk, weight_sum, weights)
        del weights
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, micro_batches: list[tuple]) -> StepResult:
        """One optimizer step over (batch, target features, epoch[, soft targets]) micro-batches.

        Each micro-batch is processed in chunks bounded by --drafter_chunk_tokens; the loss is normalised by
        the weight sum of ALL chunks of ALL micro-batches of ALL drafter ranks, and the ranks' gradients are
        summed, so the update does not depend on how the global batch is split or chunked.
        """
        with self.timer.part("blocks"):
            chunks = [
                chunk
                for batch, features, epoch, *soft in micro_batches
                for chunk in self._chunks(batch, features.to(self.device), epoch, *soft)
            ]
        weight_sum = self.sum_over_drafters(
            torch.tensor(sum(c.weight_sum for c in chunks), dtype=torch.float32, device=self.device)
        )
        totals = LossTerms.zeros(self.drafter.config.block_size, self.device)
        weights = self._step_weights()
        for chunk in chunks:
            totals = _add_terms(totals, self._forward_backward(chunk, weight_sum, weights))
        del weights
        for p in self.drafter.parameters():  # a rank whose batch had no anchors still joins the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.group is not None:
            self._sync_gradients()
            totals = self._sum_terms(totals)
        # 0/0 (nothing scored) counts as non-finite too
        bad = ~torch.isfinite(totals.loss_sum) | ~(totals.weight_sum > 0)
        if not self.lazy_checks and bool(bad):  # stop before the update
            raise FloatingPointError(self._nonfinite_message(self.global_step + 1))
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update uses
        with self.timer.part("optimizer"):
            grad_norm = self._update(bad)
        self.global_step += 1
        return StepResult(totals, grad_norm.detach(), self.global_step, lr)

    def _update(self, bad: torch.Tensor) -> torch.Tensor:
        """Clip, step the optimizer and the schedule, drop the gradients; the gradients' norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.settings.max_grad_norm)
        if self.lazy_checks:
            # No host sync per step: the fused AdamW skips the update on the device when found_inf is set,
            # and `check_finite` (each logging step, before any save) stops the run.
            bad = bad | ~torch.isfinite(grad_norm)
            self.optimizer.found_inf = bad.float()
            self._first_bad_step = torch.where(
                (self._first_bad_step == 0) & bad, self.global_step + 1, self._first_bad_step
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _nonfinite_message(self, step: int) -> str:
        return (
            f"non-finite loss or gradient at step {step}; the drafter was not updated with it: lower "
            "--learning_rate (or --max_grad_norm) and resume from the last checkpoint"
        )

    def check_finite(self) -> None:
        """Raise FloatingPointError if a step since the start had a non-finite loss (lazy checks only)."""
        if self.lazy_checks and int(self._first_bad_step):
            raise FloatingPointError(self._nonfinite_message(int(self._first_bad_step)))


@dataclass
class StepResult:
    """One optimizer step's sums on the device; read (one host sync) only when a step is logged."""

    totals: LossTerms
    grad_norm: torch.Tensor
    step: int
    lr: float

    def metrics(self) -> dict:
        """Loss, accuracy, estimated tau, grad norm, lr and step as plain numbers."""
        metrics = self.totals.metrics()
        metrics.update({"step": self.step, "lr": self.lr, "grad_norm": float(self.grad_norm)})
        return metrics


def _add_terms(a: LossTerms, b: LossTerms) -> LossTerms:
    return LossTerms(*(x + y for x, y in zip(vars(a).values(), vars(b).values(), strict=True)))


def soft_rows(soft: SoftTargets | None, rows: list[int], context_len: int) -> SoftTargets:
    """The soft targets of a chunk's rows, cut to its context length."""
    if soft is None:  # the settings' checks make a run that reads them ask for them (--target_topk)
        raise ValueError("this run's loss reads the target's soft targets, but this batch came without them")
    return SoftTargets(soft.ids[rows, :context_len], soft.probs[rows, :context_len])


def batch_anchors(batch: Batch, settings: StepSettings, epoch: int) -> list[torch.Tensor]:
    """Each sequence's anchors in `batch`: a pure function of the seed, the epoch and its sample id."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    return [
        sample_anchors(
            batch.loss_mask[b, : lengths[b]],
            settings.num_anchors,
            settings.seed,
            epoch,
            int(batch.sample_ids[b]),
            settings.anchor_rule,
            settings.anchor_scale_tokens,
        )
        for b in range(len(lengths))
    ]


def build_drafter(config: DFlashDraftConfig, seed: int, device: torch.device) -> DFlashDraftModel:
    """A freshly initialised drafter of the config's family; the init depends only on the seed (the same on
    every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(config)
    return model.to(device).train()
