"""Sampling at temperature > 0, and speculative sampling that is lossless in distribution.

The drafter proposes a block of tokens drawn from its own distributions q_1..q_k; the target's forward over
`[anchor, drafts]` gives p_1..p_{k+1}. Draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at
the first rejection the token is drawn from the residual max(p_i - q_i, 0) (normalised) and the block ends;
when every draft is accepted the target's next token is drawn from p_{k+1}. Each committed token is then
distributed exactly as the target's own sampling would draw it (Leviathan et al. 2023, Chen et al. 2023),
whatever the drafter: a poor drafter only commits fewer tokens per verify step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: softmax(logits / temperature), restricted to the smallest set of most likely
    tokens whose probability reaches `top_p`, from a generator seeded with `seed`."""

    temperature: float
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(
                f"--temperature {self.temperature}: sampling needs a temperature > 0 (0 is greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p {self.top_p} must be in (0, 1]")

    def generator(self, device: torch.device) -> torch.Generator:
        """A generator on `device` seeded with `seed`: the same draws on every run."""
        return torch.Generator(device=device).manual_seed(self.seed)


def token_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] fp32 probabilities of the next token: temperature, then top-p (the most likely tokens whose
    probabilities sum to at least top_p, the first one always kept), renormalised."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
    kept = torch.zeros_like(probs).scatter(-1, order, (before < sampling.top_p).to(probs.dtype))
    probs = probs * kept
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [..., V] -> [...] ids."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def accept_drafts(
    drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[int, list[int]]:
    """The rejection rule for one block: `drafts` [k], `draft_probs` [k, V] (the q each was drawn from) and
    `target_probs` [k + 1, V] (p after the anchor and after each draft). Returns (drafts accepted, the tokens
    committed: those drafts, then the residual's token or the bonus token)."""
    k = drafts.shape[0]
    rows = torch.arange(k, device=drafts.device)
    p, q = target_probs[rows, drafts], draft_probs[rows, drafts]
    uniform = torch.rand(k, generator=generator, device=drafts.device)
    accepted = int((uniform * q < p).long().cumprod(dim=0).sum())  # u < p / q, without dividing by q = 0
    if accepted < k:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp(min=0)
        if residual.sum() <= 0:  # p == q: any draw from p is the residual's limit
            residual = target_probs[accepted]
        last = draw(residual / residual.sum(), generator)
    else:
        last = draw(target_probs[k], generator)
    return accepted, [*drafts[:accepted].tolist(), int(last)]
