"""Regeneration through serving engines (`--engine vllm`): each row's turns completed by an OpenAI-compatible
server (vLLM, SGLang), many rows in flight across one or more servers, so that the engines' continuous
batching sets the pace. Prompts are rendered here with the target's chat template (a row's own template
arguments included) and sent as token ids, so a server generates from exactly what the transformers path
would; answers come back as token ids where the server returns them (vLLM) and are decoded here.

Seeds: round j of row i draws with a seed from (--seed, i, j), so a row's answer depends neither on the
number of servers or requests in flight nor on what ran before; a row redone after a kill gets the same
seeds."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator

from dflash_ddp.data.sources import BadRow
from dflash_ddp.engines import EngineClient, SamplingRequest
from dflash_ddp.regeneration.turns import Answer, ChatTurns, Row, regenerate_batch, seed_of

MAX_RECORDS_PER_WRITE = 256  # finished rows made durable together (one fsync), at most


@dataclasses.dataclass(frozen=True)
class ServedSettings:
    """What every request of a run shares."""

    max_new_tokens: int
    sampling: SamplingRequest  # its seed is the run's --seed; each request's is derived from it
    skip_bad_rows: bool


class ServedRow:
    """One row's turns, completed one round at a time by one server. The tokenizer is shared by every
    request thread, under `lock` (a fast tokenizer must not be used by two threads at once)."""

    def __init__(self, chat: ChatTurns, lock: threading.Lock, client: EngineClient, settings: ServedSettings):
        self.chat, self.lock, self.client, self.settings = chat, lock, client, settings
        self.row: Row | None = None
        self.round = 0

    def prompt_ids(self, row: Row, messages: list[dict]) -> list[int]:
        """The prompt of this round; BadRow when the template refuses it or it does not fit the server."""
        self.row = row
        with self.lock:
            ids = self.chat.prompt_ids(row, messages)
        limit = self.client.max_model_len
        if limit and len(ids) + self.settings.max_new_tokens > limit:
            raise BadRow(
                f"{row.where}: a prompt of {len(ids)} tokens and --max_new_tokens {self.settings.max_new_tokens} "
                f"do not fit the server's context of {limit} tokens"
            )
        return ids

    def __call__(self, prompts: list[list[int]]) -> list[Answer]:
        (prompt,) = prompts  # a batch of one row
        sampling = self.settings.sampling
        seed = seed_of(sampling.seed, self.row.index, self.round) & (2**31 - 1)  # every server takes 31 bits
        self.round += 1
        done = self.client.complete(
            prompt, self.settings.max_new_tokens, dataclasses.replace(sampling, seed=seed)
        )
        if done.token_ids is None:  # a server without token ids (not vLLM): its own detokenized text
            return [Answer(done.text.strip(), done.completion_tokens, done.hit_max_tokens)]
        with self.lock:
            answer = self.chat.answer(done.token_ids)
        # the server's counts: its token ids may stop short of what it counted (a stop token it left out)
        return [
            dataclasses.replace(
                answer, new_tokens=done.completion_tokens, hit_max_new_tokens=done.hit_max_tokens
            )
        ]


def served_records(
    rows: list[Row], clients: list[EngineClient], in_flight: int, work: Callable[[EngineClient, Row], dict]
) -> Iterator[list[dict]]:
    """`work(client, row)` for every row, `in_flight` rows at a time per client; finished records in groups
    as they come. Daemon threads: a stop (an error, Ctrl-C) never waits for the requests still in flight,
    whose rows are simply not done yet."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for row in rows:
        todo.put(row)
    results: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def worker(client: EngineClient) -> None:
        while not stop.is_set():
            try:
                row = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results.put(work(client, row))
            except BaseException as e:  # handed to the main thread, which stops the run with it
                results.put(e)
                return

    for client in clients:
        for _ in range(min(in_flight, len(rows))):
            threading.Thread(target=worker, args=(client,), daemon=True).start()
    try:
        left = len(rows)
        while left:
            group = [results.get()]
            while len(group) < min(left, MAX_RECORDS_PER_WRITE):
                try:
                    group.append(results.get_nowait())
                except queue.Empty:
                    break
            left -= len(group)
            finished = [r for r in group if not isinstance(r, BaseException)]
            if finished:
                yield finished  # written before the error below stops the run: nothing finished is lost
            errors = [r for r in group if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
    finally:
        stop.set()


def served_row_work(chat: ChatTurns, settings: ServedSettings) -> Callable[[EngineClient, Row], dict]:
    """The work of one row on one server: its rounds, as `regenerate_batch` runs them for a batch of one."""
    lock = threading.Lock()

    def work(client: EngineClient, row: Row) -> dict:
        (record,) = regenerate_batch(
            ServedRow(chat, lock, client, settings), [row], 0, settings.skip_bad_rows
        )
        return record

    return work
