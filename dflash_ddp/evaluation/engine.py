"""The evaluation in a serving engine: the held-out prompts decoded by vLLM with and without the drafter,
tau and acceptance by position from vLLM's own counters, and the lossless check against the engine's own
output (or this project's greedy decoding where only the drafter's server is given)."""

from __future__ import annotations

import dataclasses
import time

from dflash_ddp.engines import EngineClient, SamplingRequest


def _decode(client: EngineClient, prompts, max_new_tokens: int, sampling: SamplingRequest):
    start = time.perf_counter()
    outputs = [
        client.complete(ids, max_new_tokens, dataclasses.replace(sampling, seed=sampling.seed + i)).token_ids
        for i, (_, ids) in enumerate(prompts)
    ]
    if any(o is None for o in outputs):
        raise ValueError(f"the server at {client.url} returns no token ids (`return_token_ids`): use vLLM")
    return outputs, time.perf_counter() - start


def engine_evaluation(
    drafter_client: EngineClient,
    plain_client: EngineClient | None,
    prompts: list[tuple[str, list[int]]],
    max_new_tokens: int,
    reference: list[list[int]] | None = None,
    sampling: SamplingRequest | None = None,
) -> dict:
    """Decode `prompts` on the server with the drafter and on the one without it (or compare with
    `reference`, the project's own greedy outputs, when there is none); prompt i draws with seed + i. Tau and
    acceptance by position come from the drafter server's counters (tau = 1 + accepted / drafts: each verify
    step commits the accepted drafts and one token of the target's). Greedy when `sampling` is None."""
    sampling = sampling or SamplingRequest()
    before = drafter_client.counters()
    drafted, seconds = _decode(drafter_client, prompts, max_new_tokens, sampling)
    counted = drafter_client.counters() - before
    if plain_client is not None:
        reference, plain_seconds = _decode(plain_client, prompts, max_new_tokens, sampling)
    else:
        plain_seconds = None
    tokens = sum(len(o) for o in drafted)
    mismatched = [
        where for (where, _), a, b in zip(prompts, drafted, reference or [], strict=False) if a != b
    ]
    report = {
        "engine": "vllm",
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "drafts": counted.drafts,
        "tau": 1 + counted.accepted / counted.drafts if counted.drafts else None,
        "acceptance_by_position": [a / counted.drafts for a in counted.accepted_per_position]
        if counted.drafts
        else [],
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_without_drafter": (
            sum(len(o) for o in reference) / plain_seconds if plain_seconds else None
        ),
        "mismatched": mismatched,
    }
    # at a temperature the two servers draw differently: a sample, not a token-for-token check
    report["lossless"] = None if sampling.temperature > 0 or reference is None else not mismatched
    return report
