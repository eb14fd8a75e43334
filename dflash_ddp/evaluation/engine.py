"""The evaluation in a serving engine: the held-out prompts decoded by vLLM with and without the drafter,
tau and acceptance by position from vLLM's own counters, and the lossless check against the engine's own
output (or this project's greedy decoding where only the drafter's server is given)."""

from __future__ import annotations

import dataclasses
import time

from dflash_ddp.engines import EngineClient, SamplingRequest, SpecCounters


@dataclasses.dataclass
class EngineDecode:
    """The prompts' outputs on one server, the seconds they took and, on the drafter's server, its
    speculative-decoding counters over them."""

    outputs: list[list[int]]
    seconds: float
    counted: SpecCounters | None


def engine_decode(
    client: EngineClient,
    prompts: list[tuple[str, list[int]]],
    max_new_tokens: int,
    sampling: SamplingRequest | None = None,
    drafting: bool = True,
) -> EngineDecode:
    """Decode `prompts` on `client`'s server, prompt i drawing with seed + i (greedy when `sampling` is None);
    the counters are read where the server is `drafting` (a plain server need not serve /metrics)."""
    sampling = sampling or SamplingRequest()
    before = client.counters() if drafting else None
    start = time.perf_counter()
    outputs = [
        client.complete(ids, max_new_tokens, dataclasses.replace(sampling, seed=sampling.seed + i)).token_ids
        for i, (_, ids) in enumerate(prompts)
    ]
    seconds = time.perf_counter() - start
    if any(o is None for o in outputs):
        raise ValueError(f"the server at {client.url} returns no token ids (`return_token_ids`): use vLLM")
    return EngineDecode(outputs, seconds, client.counters() - before if drafting else None)


def engine_evaluation(
    drafter_client: EngineClient,
    plain_client: EngineClient | None,
    prompts: list[tuple[str, list[int]]],
    max_new_tokens: int,
    reference: list[list[int]] | None = None,
    sampling: SamplingRequest | None = None,
) -> dict:
    """Decode `prompts` on the server with the drafter and on the one without it (or compare with
    `reference`, the project's own greedy outputs, when there is none): `engine_report` of both decodes."""
    drafted = engine_decode(drafter_client, prompts, max_new_tokens, sampling)
    plain = (
        engine_decode(plain_client, prompts, max_new_tokens, sampling, drafting=False)
        if plain_client
        else None
    )
    return engine_report(drafted, plain, prompts, max_new_tokens, reference, sampling)


def engine_report(
    drafted: EngineDecode,
    plain: EngineDecode | None,
    prompts: list[tuple[str, list[int]]],
    max_new_tokens: int,
    reference: list[list[int]] | None = None,
    sampling: SamplingRequest | None = None,
) -> dict:
    """Tau (the tokens each prompt got after its first, which prefill gives, per verify step: the drafter
    server's draft count) and acceptance by position from its counters, the rates, and the lossless check of
    the drafted outputs against the plain server's (else `reference`). vLLM's own 1 + accepted / drafts
    (`tau_counted`) also counts drafts accepted past --max_new_tokens and cut off: higher on short outputs."""
    sampling = sampling or SamplingRequest()
    counted = drafted.counted
    if plain is not None:
        reference = plain.outputs
    tokens = sum(len(o) for o in drafted.outputs)
    mismatched = [
        where for (where, _), a, b in zip(prompts, drafted.outputs, reference or [], strict=False) if a != b
    ]
    report = {
        "engine": "vllm",
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "drafts": counted.drafts,
        "tau": (tokens - len(prompts)) / counted.drafts if counted.drafts else None,
        "tau_counted": 1 + counted.accepted / counted.drafts if counted.drafts else None,
        "acceptance_by_position": [a / counted.drafts for a in counted.accepted_per_position]
        if counted.drafts
        else [],
        "tokens": tokens,
        "tokens_per_s": tokens / drafted.seconds,
        "tokens_per_s_without_drafter": (
            sum(len(o) for o in plain.outputs) / plain.seconds if plain and plain.seconds else None
        ),
        "mismatched": mismatched,
    }
    # at a temperature the two servers draw differently: a sample, not a token-for-token check
    report["lossless"] = None if sampling.temperature > 0 or reference is None else not mismatched
    return report
