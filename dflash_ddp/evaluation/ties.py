"""Whether an output that differs from greedy decoding differs by the target's own rounding.

Speculative decoding verifies a block of tokens in one target forward where greedy decoding runs one token per
forward. In float32 both give the same logits to within a few ulps, so any difference is a bug. In bf16 the
two orders of summation round differently, and where the target's two best tokens are closer than that
rounding, the argmax flips: every method that batches its verification (transformers' prompt lookup too)
then leaves greedy's path at the same token. Such a difference is the target's, not the drafter's; a drafter
cannot change which tokens are accepted, only how many. A difference is counted as a near tie when, at the
first differing position, the target's logits for the two tokens are within `ULPS` units in the last place
of the target's dtype; anything else stays a failure of losslessness.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ULPS = 4  # a few roundings of the logits: a gap this small is below what the dtype resolves


def tie_tolerance(logit: float, dtype: torch.dtype) -> float:
    """`ULPS` units in the last place of `dtype` at the magnitude of `logit`."""
    info = torch.finfo(dtype)
    exponent = math.frexp(max(abs(logit), info.tiny))[1] - 1  # |logit| = m * 2**exponent, 1 <= m < 2
    return ULPS * info.eps * 2.0**exponent


@torch.inference_mode()
def logit_gap(
    target: nn.Module, prompt: list[int], greedy: list[int], other: list[int], first: int
) -> dict | None:
    """At position `first`, where `other` leaves `greedy` (both continuations of `prompt`), the target's
    logit of greedy's token minus that of the other's, recomputed in one forward over the shared prefix, and
    the tolerance of the target's dtype there: {"logit_gap", "tolerance", "near_tie"}. None where one output
    ended there (a shorter or longer output is never a tie)."""
    if first >= min(len(greedy), len(other)):
        return None
    ids = torch.tensor([prompt + greedy[:first]], dtype=torch.long, device=target.device)
    logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    best, chosen = logits[greedy[first]].item(), logits[other[first]].item()
    gap = best - chosen
    tolerance = tie_tolerance(max(abs(best), abs(chosen)), target.dtype)
    return {"logit_gap": gap, "tolerance": tolerance, "near_tie": abs(gap) <= tolerance}


@torch.inference_mode()
def cache_divergence(target: nn.Module, prompt: list[int], greedy: list[int]) -> int | None:
    """The first position of `greedy` (the target's own decoding with its KV cache) that the target's
    forward without a cache, over the same tokens, would not choose; None where they agree. Where they do not,
    the target's implementation computes other logits with its cache than without (transformers' sparse
    attention of `glm_moe_dsa` once a context passes its index top-k): no decoding can match both."""
    if len(greedy) < 2:
        return None
    ids = torch.tensor([prompt + greedy[:-1]], dtype=torch.long, device=target.device)
    chosen = target(input_ids=ids).logits[0, len(prompt) - 1 :].argmax(dim=-1).tolist()
    return next((i for i, (a, b) in enumerate(zip(chosen, greedy, strict=True)) if a != b), None)
