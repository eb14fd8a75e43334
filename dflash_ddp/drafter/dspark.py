"""The DSpark drafter (DeepSeek, 2026): DFlash's backbone, a Markov head that restores the dependence between a
block's positions, and a confidence head that predicts how likely each drafted position is to be accepted.

- Markov head: a low-rank bias on a drafted position's logits from the token before it. With e = W1[prev]
  (W1 [V, r]) and W2 [V, r]: vanilla adds W2 e; gated W2 (sigmoid(G [h; e]) * e); rnn carries a state s
  along the block (s' = g s + (1 - g) tanh(c), [g, c, o] = J [s; e; h], the bias W2 tanh(o)), starting at
  zero at each block. h is the backbone's final-normed output at that position. The bias goes through the
  target's logit conventions as the logits do (scale, soft-capping), as vLLM's DSpark models add it.
- Confidence head: one logit per position, proj([h; e]) (proj(h) without `confidence_head_with_markov`); its
  sigmoid predicts the position's acceptance, so a serving engine can verify only as far as it pays.
- The block: this project's (DFlash's): the anchor at position 0, positions 1..bs-1 drafted, the token
  before position 1 the anchor. vLLM serves this as its fill-in mode (`sample_from_anchor: false`).
- Training (`dspark_terms`): the token before each position teacher-forced to the data's; per position
  w_k (a CE(biased logits, label) + b ||q - p||_1 + c BCE(confidence, 1 - ||q - p||_1 / 2)), q the biased
  softmax, p the target's next-token distribution at that position (its top-k from --target_topk, 0
  outside it), the acceptance label detached; the weights w_k are the run's position weights.
- Decoding (`draft_tokens`, `sample_drafts`): left to right through the head, each position's bias from the
  token drafted before it, as vLLM's DSpark proposer walks.

The Markov head's W2 starts at zero (the reference draws it at random): an untrained DSpark drafter drafts
exactly what the DFlash drafter with the same backbone drafts, and a DFlash drafter grown into DSpark starts
as itself. Every added weight is drawn after the backbone's, so with the same seed the backbone is DFlash's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_ddp.drafter.blocks import BlockInputs
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.distillation import renormalised
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.drafter.objective import LossTerms, ScoredRows, as_target_logits, head_logits, loss_terms
from dflash_ddp.drafter.weighting import LossSettings, reweighting

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# DSpark's loss always reads the target's distribution: the reference trains on its top 64 tokens, which
# --drafter dspark takes as its --target_topk unless the run gives one
TARGET_TOPK = 64


class DSparkDraftConfig(DFlashDraftConfig):
    """Shape of a DSpark drafter: a DFlash drafter's, plus its Markov and confidence heads."""

    model_type = "dspark_draft"
    family = "dspark"
    run_settings = ("markov_rank", "markov_head_type", "confidence_head_with_markov")
    serving_fields = (*run_settings, "enable_confidence_head")
    # vLLM reads the DSpark fields at the top level of config.json, and serves this block as its fill-in
    # mode (the anchor given, the masks drafted)
    serving_top_level = True
    top_level_serving = (("sample_from_anchor", False),)

    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    confidence_head_with_markov: bool = True
    enable_confidence_head: bool = True

    @classmethod
    def run_values(cls, run) -> dict:
        """The run's settings, and the confidence head where its loss has a weight (--confidence_alpha)."""
        return super().run_values(run) | {"enable_confidence_head": run.confidence_alpha > 0}

    def shape_errors(self) -> list[str]:
        """What makes this shape unservable, each naming the setting to change (empty when it is sound)."""
        errors = super().shape_errors()
        if self.markov_rank < 0:
            errors.append(f"markov_rank {self.markov_rank} must be >= 0 (0: no Markov head)")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            errors.append(
                f"markov_head_type {self.markov_head_type!r}: choose one of {', '.join(MARKOV_HEAD_TYPES)}"
            )
        if self.confidence_head_with_markov and not self.markov_rank and self.enable_confidence_head:
            errors.append("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        return errors

    def extra_saved_per_position(self) -> int:
        """The Markov features and the confidence head's input, per position (small beside a layer's)."""
        return 2 * self.markov_rank + self.hidden_size

    lookup_table_label = "Markov tables"  # the plan's name for them

    def lookup_table_params(self) -> int:
        """The Markov head's two [V, rank] tables."""
        return 2 * self.vocab_size * self.markov_rank

    def extra_loss_bytes(self, rows: int, positions: int, dtype_bytes: int) -> int:
        """The biased logits and their softmax per chunk of rows (fp32), beside the LM head's own."""
        return 2 * rows * self.vocab_size * 4

    def extra_backward_per_position(self) -> int:
        """Nothing beyond the chunk's recomputation, counted in `extra_loss_bytes`."""
        return 0


class ZeroLinear(nn.Linear):
    """W2: zero from the start, drawing no random numbers (module docstring)."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class MarkovHead(nn.Module):
    """The bias of a drafted position's logits from the token before it (module docstring). `features`
    gives the r-dimensional vector that W2 maps into the vocabulary, for whole blocks at once."""

    def __init__(self, config: DSparkDraftConfig):
        super().__init__()
        h, r, self.kind = config.hidden_size, config.markov_rank, config.markov_head_type
        self.markov_w1 = nn.Embedding(config.vocab_size, r)
        self.markov_w2 = ZeroLinear(r, config.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(h + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r)

    def features(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[..., bs, r] for blocks of previous tokens [..., bs] and outputs [..., bs, H] (the rnn's state runs
        along the last position dimension, from zero)."""
        embedded = self.markov_w1(previous).to(hidden.dtype)
        if self.kind == "vanilla":
            return embedded
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1))) * embedded
        state, out = torch.zeros_like(embedded[..., 0, :]), []
        for k in range(embedded.shape[-2]):
            state, step = self.step(state, embedded[..., k, :], hidden[..., k, :])
            out.append(step)
        return torch.stack(out, dim=-2)

    def step(self, state: torch.Tensor, embedded: torch.Tensor, hidden: torch.Tensor):
        """One rnn position: (the next state, the features)."""
        gate, candidate, output = self.joint_proj(torch.cat([state, embedded, hidden], dim=-1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return gate * state + (1 - gate) * torch.tanh(candidate), torch.tanh(output)


class ConfidenceHead(nn.Module):
    """One logit per position: the predicted acceptance of its draft (`proj`, as vLLM loads it)."""

    def __init__(self, config: DSparkDraftConfig):
        super().__init__()
        width = config.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
        self.proj = nn.Linear(width, 1)


class DSparkDraftModel(DFlashDraftModel):
    """The DSpark drafter: DFlash's backbone, the Markov head and the confidence head."""

    config_class = DSparkDraftConfig
    embedding_tables = ("markov_head.markov_w1.weight",)

    def __init__(self, config: DSparkDraftConfig):
        super().__init__(config)  # the backbone, initialised as DFlash's
        self.markov_head = MarkovHead(config) if config.markov_rank else None
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        for module in (self.markov_head, self.confidence_head):
            if module is not None:
                module.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, ZeroLinear):
            module.reset_parameters()
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        else:
            super()._init_weights(module)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def biased_logits(self, hidden: torch.Tensor, head_weight: torch.Tensor, features) -> torch.Tensor:
        """fp32 logits of outputs `hidden` [N, H] with the Markov bias of `features` [N, r] (None: no head),
        both through the target's conventions."""
        c = self.config
        logits = head_logits(hidden, head_weight, c.logit_scale, c.final_logit_softcapping)
        if features is None:
            return logits
        bias = self.markov_head.markov_w2(features.to(self.markov_head.markov_w2.weight.dtype))
        return logits + as_target_logits(bias, c.logit_scale, c.final_logit_softcapping)

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """[N] confidence logits of outputs `hidden` [N, H] whose previous tokens are `previous` [N]."""
        if self.config.confidence_head_with_markov:
            hidden = torch.cat([hidden, self.markov_head.markov_w1(previous).to(hidden.dtype)], dim=-1)
        return (
            self.confidence_head.proj(hidden.to(self.confidence_head.proj.weight.dtype)).squeeze(-1).float()
        )

    def loss_terms(self, last_hidden, head_weight, inputs, settings):
        """DSpark's loss (module docstring)."""
        return dspark_terms(self, last_hidden, head_weight, inputs, settings)

    @torch.no_grad()
    def _walk(self, hidden: torch.Tensor, head: nn.Module, anchor: torch.Tensor, pick) -> torch.Tensor:
        drafted, previous = hidden[0, 1:], anchor[0]
        if self.markov_head is None:
            return pick(self.biased_logits(drafted, head.weight, None))
        state = torch.zeros(1, self.config.markov_rank, device=hidden.device, dtype=hidden.dtype)
        tokens = []
        for slot in range(drafted.shape[0]):
            h = drafted[slot : slot + 1]
            if self.markov_head.kind == "rnn":
                state, features = self.markov_head.step(
                    state, self.markov_head.markov_w1(previous).to(h.dtype), h
                )
            else:
                features = self.markov_head.features(previous[:, None], h[:, None])[:, 0]
            previous = pick(self.biased_logits(h, head.weight, features))
            tokens.append(previous)
        return torch.cat(tokens)

    def draft_tokens(self, hidden: torch.Tensor, head: nn.Module, anchor: torch.Tensor) -> torch.Tensor:
        """The block's drafts [1, bs-1], left to right, each position biased by the one drafted before it."""
        return self._walk(hidden, head, anchor, lambda logits: logits.argmax(dim=-1))[None]

    def sample_drafts(self, hidden, head, anchor, draw_from) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [1, bs-1] drawn left to right (`draw_from(logits [n, V])` -> (tokens [n], probs [n, V])),
        and the distribution q [bs-1, V] each was drawn from, given the drafts before it."""
        probs = []

        def pick(logits):
            token, q = draw_from(logits)
            probs.append(q)
            return token

        tokens = self._walk(hidden, head, anchor, pick)
        return tokens[None], torch.cat(probs)

    @torch.no_grad()
    def confidences(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """[bs-1] predicted acceptance (sigmoid) of the drafted positions of `hidden` [1, bs, H] whose
        previous tokens are `previous` [bs-1] (the anchor, then the drafts); None without the head."""
        if self.confidence_head is None:
            return None
        return torch.sigmoid(self.confidence(hidden[0, 1:], previous))


def _dspark_chunk(drafter, hidden, head_weight, features, previous, targets, alphas):
    """One chunk of scored rows: the weighted sum of a CE + b L1 + c BCE, the argmax-correct flags, and the
    detached sums of L1, the predicted and the observed acceptance (1 - L1 / 2). `targets`: the rows'
    labels, the target's top-k (ids, probabilities) and the rows' weights."""
    ce_alpha, l1_alpha, confidence_alpha = alphas
    labels, soft, weights = targets
    logits = drafter.biased_logits(hidden, head_weight, features)
    log_q = torch.log_softmax(logits, dim=-1)
    ce = -log_q.gather(1, labels[:, None]).squeeze(1)
    loss = ce_alpha * ce
    if soft is None:  # --dspark_l1_alpha 0 and --confidence_alpha 0: the CE alone, nothing to distil
        return (loss * weights).sum(), logits.argmax(dim=-1) == labels, torch.zeros(3, device=hidden.device)
    soft_ids, soft_probs = soft
    q = log_q.exp().gather(1, soft_ids)
    l1 = (q - renormalised(soft_probs)).abs().sum(-1) + (1.0 - q.sum(-1)).clamp(min=0)  # p is 0 outside top-k
    loss = loss + l1_alpha * l1
    acceptance = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    predicted = torch.zeros_like(acceptance)
    if drafter.confidence_head is not None:
        confidence = drafter.confidence(hidden, previous)
        loss = loss + confidence_alpha * F.binary_cross_entropy_with_logits(
            confidence, acceptance, reduction="none"
        )
        predicted = torch.sigmoid(confidence).detach()
    sums = torch.stack([l1.sum().detach(), predicted.sum(), acceptance.sum()])
    return (loss * weights).sum(), logits.argmax(dim=-1) == labels, sums


def dspark_terms(
    drafter: DSparkDraftModel,
    last_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    inputs: BlockInputs,
    settings: LossSettings,
) -> LossTerms:
    """DSpark's loss sums for one chunk's output `last_hidden` [B, A*bs, H] (module docstring), the token
    before each position teacher-forced to the data's; D-PACE and AUF weigh the rows from the biased
    logits' own CE and argmax, as DFlash's from its logits."""
    distils = bool(settings.dspark_l1_alpha or settings.confidence_alpha)
    if inputs.soft_ids is None and distils:
        raise ValueError("DSpark's distillation term needs the target's distribution: pass --target_topk K")
    bs = inputs.block_size
    blocks = last_hidden.view(*inputs.labels.shape, -1)  # [B, A, bs, H]
    previous = torch.cat([inputs.labels[..., :1], inputs.labels[..., :-1]], dim=-1)  # position k: label k-1
    features = None if drafter.markov_head is None else drafter.markov_head.features(previous, blocks)
    flat = inputs.scored
    hidden = blocks.flatten(0, 2).index_select(0, flat)
    rows_features = None if features is None else features.flatten(0, 2).index_select(0, flat)
    rows_previous, labels = previous.flatten()[flat], inputs.labels.flatten()[flat]
    soft = tuple(t.flatten(0, 2)[flat] for t in (inputs.soft_ids, inputs.soft_probs)) if distils else None
    weights = inputs.weights.flatten()[flat]
    step = settings.chunk_rows
    parts = [slice(start, start + step) for start in range(0, hidden.shape[0], step)]
    reweight = reweighting(settings, flat, inputs.weights.shape[0] * inputs.weights.shape[1], bs)
    if reweight is not None:  # the weights from the rows' own CE and argmax: constants for the loss
        with torch.no_grad():
            nll, hits = [], []
            for part in parts:
                logits = drafter.biased_logits(hidden[part], head_weight, _part(rows_features, part))
                nll.append(torch.logsumexp(logits, -1) - logits.gather(1, labels[part, None]).squeeze(1))
                hits.append(logits.argmax(-1) == labels[part])
            weights = reweight(torch.cat(nll), torch.cat(hits))
    alphas = (settings.dspark_ce_alpha, settings.dspark_l1_alpha, settings.confidence_alpha)
    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    sums = torch.zeros(3, device=hidden.device)
    for part in parts:
        # recomputed in backward: a chunk's [rows, V] logits are never kept
        chunk_sum, chunk_correct, chunk_sums = checkpoint(
            _dspark_chunk,
            drafter,
            hidden[part],
            head_weight,
            _part(rows_features, part),
            rows_previous[part],
            (labels[part], None if soft is None else tuple(t[part] for t in soft), weights[part]),
            alphas,
            use_reentrant=False,
            preserve_rng_state=False,
        )
        loss_sum = loss_sum + chunk_sum
        correct[part] = chunk_correct
        sums = sums + chunk_sums
    empty = torch.empty(hidden.shape[0], 0, dtype=torch.long, device=hidden.device)
    rows = ScoredRows(hidden, flat, labels, weights, correct, empty, loss_sum)
    # rows the distribution scored: none without it (no distillation metrics to report)
    count = torch.tensor(float(flat.numel() if distils else 0), device=hidden.device)
    return loss_terms(
        inputs,
        rows,
        correct,
        dspark_rows=count,
        distill_sum=sums[0],
        predicted_acceptance_sum=sums[1],
        observed_acceptance_sum=sums[2],
    )


def _part(t: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    return None if t is None else t[part]
