"""Sampling at temperature > 0: the filtered distribution, the rejection rule, and speculative sampling whose
tokens are distributed exactly as the target's own sampling, on the shipped tiny target."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash_ddp.evaluation.decoding import speculative_generate
from dflash_ddp.evaluation.sampling import Sampling, accept_drafts, token_probs
from dflash_ddp.target_model.info import inspect_target
from dflash_ddp.target_model.loading import load_causal_lm

from helpers import small_draft_config

EMBEDDED_TARGET = Path(__file__).parent.parent / "dflash_ddp" / "assets" / "tiny_qwen3"


def test_top_p_keeps_the_most_likely_tokens_reaching_it():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = token_probs(p.log(), Sampling(1.0, top_p=0.8))
    torch.testing.assert_close(kept, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert token_probs(p.log(), Sampling(1.0, top_p=0.1)).tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(token_probs(p.log(), Sampling(1.0)), p)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(0.0)


def test_the_rejection_rule_commits_the_targets_distribution():
    """One draft from q, accepted or replaced by the residual's token: the committed token follows p."""
    p = torch.tensor([0.1, 0.6, 0.2, 0.1])
    q = torch.tensor([0.4, 0.1, 0.1, 0.4])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20000):
        draft = torch.multinomial(q, 1, generator=g)
        _, committed = accept_drafts(draft, q[None], torch.stack([p, p]), g)
        counts[committed[0]] += 1
    assert (counts / counts.sum() - p).abs().sum() / 2 < 0.01


def exact_second_token(target, prompt: list[int], sampling: Sampling) -> torch.Tensor:
    """P(second generated token) = sum over x1 of p(x1 | prompt) p(x2 | prompt, x1), over every x1."""
    with torch.no_grad():
        first = token_probs(target(torch.tensor([prompt])).logits[0, -1], sampling)
        support = (first > 1e-7).nonzero().flatten()
        batch = torch.cat([torch.tensor([prompt]).expand(len(support), -1), support[:, None]], dim=1)
        second = token_probs(target(batch).logits[:, -1], sampling)
    return (first[support, None] * second).sum(0)


class NearbyDrafter:
    """Drafts from a distribution close to, not equal to, the target's: the target's own next-token logits
    after the anchor, halved and shifted, for every drafted position (the anchor found by its embedding row).
    Its drafts are then often accepted and often rejected, so both paths of the rule are taken."""

    def __init__(self, target, prompt: list[int]):
        self.config = SimpleNamespace(block_size=4, mask_token_id=0, target_layer_ids=[1, 2])
        self.target, self.prompt, self.logits = target, prompt, {}

    def __call__(self, noise_embeds, context_hidden_states, position_ids, cache):
        rows = self.target.get_input_embeddings().weight
        self.anchor = int((rows - noise_embeds[0, 0]).abs().sum(-1).argmin())
        return SimpleNamespace(last_hidden_state=noise_embeds)

    def draft_logits(self, hidden, head):
        if self.anchor not in self.logits:
            logits = self.target(torch.tensor([[*self.prompt, self.anchor]])).logits[0, -1]
            self.logits[self.anchor] = 0.5 * logits + torch.linspace(0, 2, logits.shape[0])
        return self.logits[self.anchor].expand(self.config.block_size - 1, -1)

    def bind_target(self, embedding):
        pass  # reads nothing of the target

    def confidences(self, hidden, previous):
        return None  # no confidence head

    def sample_drafts(self, hidden, head, anchor, draw_from):
        tokens, probs = draw_from(self.draft_logits(hidden, head))
        self.first_draft = int(tokens[0])
        return tokens[None], probs


@pytest.mark.parametrize("top_p", [1.0])
def test_speculative_sampling_draws_as_the_target_samples(top_p):
    """At temperature 1.0 the second generated token (drafted, then accepted or drawn from the residual) of
    600 speculative runs follows the target's exact distribution within sampling noise: the total variation
    over its 8 likeliest tokens and the rest (9 bins) within three times its expected value for 600 exact
    draws, 0.062 (over the whole vocabulary that bound exceeded 1, which no total variation reaches).
    Committing the drafts unchecked is off by 0.10 on the same bins, and fails (drawn from the first draft's
    own distribution: two tokens a run, so the drafter's anchor is always the prefill's). Fixed seeds: the same
    draws every run."""
    target = load_causal_lm(inspect_target(EMBEDDED_TARGET), torch.device("cpu"), torch.float32)
    prompt = [5, 300, 41, 977, 12, 1500, 64, 7]
    exact = exact_second_token(target, prompt, Sampling(1.0, top_p))
    drafter = NearbyDrafter(target, prompt)
    counts, unchecked, accepted, runs = torch.zeros_like(exact), torch.zeros_like(exact), 0, 600
    for seed in range(runs):  # two tokens: the prefill's, then one verify step's first
        result = speculative_generate(target, drafter, prompt, 2, sampling=Sampling(1.0, top_p, seed))
        counts[result.tokens[1]] += 1
        # the first draft was accepted exactly where it was committed: a rejected draft's residual is 0
        accepted += result.tokens[1] == drafter.first_draft
        first = token_probs(drafter.draft_logits(None, None)[0], Sampling(1.0, top_p))
        unchecked[int(torch.multinomial(first, 1, generator=torch.Generator().manual_seed(seed)))] += 1
    assert 0.2 * runs < accepted < 0.9 * runs  # drafts both accepted and rejected
    top = exact.topk(8).indices

    def binned(p: torch.Tensor) -> torch.Tensor:
        return torch.cat([p[top], (p.sum() - p[top].sum()).reshape(1)])

    expected = binned(exact)
    noise = float((2 * expected * (1 - expected) / (torch.pi * runs)).sqrt().sum() / 2)  # E[TV], 600 draws
    assert 3 * noise < 0.1
    assert float((binned(counts / runs) - expected).abs().sum() / 2) < 3 * noise
    assert (
        float((binned(unchecked / runs) - expected).abs().sum() / 2) > 3 * noise
    )  # tells a wrong rule apart


def test_a_dflash2_drafter_is_not_sampled_silently():
    """The selector's walk is not sampled by this decoder: asking for it is an error naming what to do."""
    from dflash_ddp.drafter.dflash2 import DFlash2DraftConfig
    from dflash_ddp.drafter.families import build_model

    config = DFlash2DraftConfig(
        **small_draft_config().to_dict(), conv_group_size=8, selector_rank=8, selector_top_k=4
    )
    with pytest.raises(
        ValueError, match="DFlash2 drafter: its selector's walk is not sampled.*--temperature 0"
    ):
        build_model(config).draft_logits(torch.zeros(1, 4, 32), None)
