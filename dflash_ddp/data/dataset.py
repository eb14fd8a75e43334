"""The tokenized training set: built once per (files, tokenizer, template, settings), cached on disk.

Samples live in three flat tensors (ids, mask, offsets) rather than Python lists: a 1B-token data set
takes 5 GB per process this way, instead of tens of GB of int objects. The cache is one safetensors
file (no pickle) named by a fingerprint of everything that decides its content; the first process to
take the cache's file lock tokenizes, the others of the job wait and then read the same file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import socket
import time
from array import array
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dflash_ddp.data.batch import Batch
from dflash_ddp.data.chat_template import ChatTokenizer
from dflash_ddp.data.sources import BadRow, Conversation, DataStats, data_file_contents, read_conversations
from dflash_ddp.files import describe_error, file_sha256

CHUNK_ROWS = 256  # rows per task of a tokenization worker
# --num_proc 0: worker processes for data of this many rows or more (below, starting them costs more than
# they save), one per CPU core this process may use, at most MAX_AUTO_PROCESSES
AUTO_PROCESSES_FROM_ROWS = 20_000
MAX_AUTO_PROCESSES = 8
# the cache takes about 5 bytes per token, about 1.6 times the inputs' bytes: free space below twice the
# inputs' size is refused before tokenizing, which a full disk would otherwise throw away at the end
CACHE_BYTES_PER_INPUT_BYTE = 2


PROGRESS_EVERY_S = 30.0


# tokens past --max_seq_len kept in a text cut before tokenizing, so that the cut's edge (the last words'
# merges) stays clear of the tokens a sample keeps
CUT_MARGIN_TOKENS = 256


CACHE_VERSION = 4  # bump when tokenization or masking changes, so that old caches are not reused


TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges*",
    "chat_template*",
)


@dataclass(frozen=True)
class TokenizeSettings:
    """The settings that decide the tokenized data besides the ChatTokenizer (part of the cache key, but
    skip_bad_rows: a cache exists only where no bad row stopped the tokenization, so its tokens are the
    same either way where it was made without it, and a cache holding skipped rows refuses a run without
    it when read)."""

    max_seq_len: int
    block_size: int
    overlength: str = "truncate"  # truncate | drop
    skip_bad_rows: bool = False


class TokenizedDataset:
    """Samples 0..n-1 as token ids and assistant masks; `batch` right-pads a list of them."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        offsets: torch.Tensor,
        fingerprint: str | None = None,
    ):
        self.input_ids, self.loss_mask, self.offsets = input_ids, loss_mask, offsets
        self.lengths = (offsets[1:] - offsets[:-1]).tolist()
        self._fingerprint = fingerprint  # None: hashed when first asked for

    def __len__(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of sample i's token ids and loss mask."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[lo:hi], self.loss_mask[lo:hi]

    def batch(self, indices: list[int], pad_id: int) -> Batch:
        """The samples at `indices`, right-padded with `pad_id`; sample ids = the indices."""
        longest = max(self.lengths[i] for i in indices)
        ids = torch.full((len(indices), longest), pad_id, dtype=torch.long)
        attn = torch.zeros((len(indices), longest), dtype=torch.long)
        loss = torch.zeros((len(indices), longest), dtype=torch.long)
        for b, i in enumerate(indices):
            sample_ids, sample_mask = self.sample(i)
            n = len(sample_ids)
            ids[b, :n], attn[b, :n], loss[b, :n] = sample_ids, 1, sample_mask
        return Batch(ids, attn, loss, torch.tensor(indices))

    def fingerprint(self) -> str:
        """A content hash of ids and masks, stored with checkpoints and in the cache file; computed once."""
        if self._fingerprint is None:
            self._fingerprint = self._hash()
        return self._fingerprint

    def _hash(self) -> str:
        h = hashlib.sha256()
        for t in (self.offsets, self.input_ids, self.loss_mask):
            h.update(memoryview(t.contiguous().numpy()))  # no copy of a multi-GB tensor
        return h.hexdigest()[:16]

    @classmethod
    def from_flat(cls, ids: array, mask: array, lengths: list[int]) -> TokenizedDataset:
        """The samples of concatenated int32 ids and uint8 masks (5 bytes per token, no int objects), and
        their lengths; the tensors share the arrays' memory (an array with a view cannot be resized)."""
        return cls(
            torch.frombuffer(ids, dtype=torch.int32) if ids else torch.zeros(0, dtype=torch.int32),
            torch.frombuffer(mask, dtype=torch.uint8) if mask else torch.zeros(0, dtype=torch.uint8),
            torch.cumsum(torch.tensor([0, *lengths], dtype=torch.int64), 0),
        )


_worker: ChatTokenizer | None = None


def _start_worker(chat: ChatTokenizer) -> None:
    global _worker
    _worker = chat


def _tokenize_rows(rows: list[Conversation]) -> list[tuple[array, array, str] | BadRow]:
    """Runs in a worker process (or inline): (ids, mask, context note) or one BadRow per row, in order."""
    out = []
    for where, messages, row_kwargs in rows:
        try:
            ids, mask, note = _worker(messages, where, row_kwargs)
            out.append((array("i", ids), array("B", mask), note))
        except BadRow as e:
            out.append(e)
    return out


def tokenizing_processes(num_proc: int, rows: int) -> int:
    """--num_proc, or for 0 (auto) one per usable CPU core (at most MAX_AUTO_PROCESSES) where the data is
    large enough to gain from them, else 1."""
    if num_proc:
        return num_proc
    if rows < AUTO_PROCESSES_FROM_ROWS:
        return 1
    return max(1, min(MAX_AUTO_PROCESSES, len(os.sched_getaffinity(0))))


def _taken_chunks(rows: list) -> Iterator[list]:
    """`rows` in chunks of CHUNK_ROWS, each let go from `rows` as it is taken: a row's memory is freed once
    it is tokenized, not after every row is (rows as read take about 3 times the inputs' bytes)."""
    for i in range(0, len(rows), CHUNK_ROWS):
        chunk = rows[i : i + CHUNK_ROWS]
        rows[i : i + CHUNK_ROWS] = [None] * len(chunk)
        yield chunk


def _tokenize_all(chat: ChatTokenizer, rows: list, num_proc: int, log) -> Iterator:
    """Results of every row, in order (`rows` is emptied as they are taken); a progress line every
    PROGRESS_EVERY_S seconds."""
    total = len(rows)
    chunks = _taken_chunks(rows)
    start = last = time.perf_counter()
    done = 0
    for results in _chunk_results(chat, chunks, num_proc if total > CHUNK_ROWS else 1):
        yield from results
        done += len(results)
        if time.perf_counter() - last > PROGRESS_EVERY_S:
            last = time.perf_counter()
            log(f"tokenized {done}/{total} rows ({done / (last - start):.0f} rows/s)")


def _chunk_results(chat: ChatTokenizer, chunks: Iterator[list], num_proc: int) -> Iterator[list]:
    if num_proc <= 1:
        _start_worker(chat)
        yield from map(_tokenize_rows, chunks)
        return
    # spawn, not fork: the parent may hold torch threads and locks that a forked child would inherit
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        num_proc, mp_context=context, initializer=_start_worker, initargs=(chat,)
    ) as pool:
        # a bounded number of chunks in flight: the rows are not all pickled into the pool up front
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.submit(_tokenize_rows, chunk))
            if len(pending) >= 4 * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def tokenize_dataset(
    chat: ChatTokenizer, paths: list[str], settings: TokenizeSettings, num_proc: int = 1, log=print
) -> tuple[TokenizedDataset, DataStats]:
    """Tokenize every row, apply --overlength, and drop samples with < 2*block_size response tokens."""
    stats = DataStats(inputs={str(f): f.stat().st_size for f in data_file_contents(paths)})
    rows = read_conversations(paths, settings.skip_bad_rows, stats)
    bound = (settings.max_seq_len + CUT_MARGIN_TOKENS) * longest_token_chars(chat.tokenizer)
    cut_long_texts(rows, bound, token_texts(chat.tokenizer))
    processes = tokenizing_processes(num_proc, len(rows))
    log(f"tokenizing {len(rows)} rows with {processes} process(es)")
    all_ids, all_mask, lengths = array("i"), array("B"), []  # the kept samples, gathered as they come
    for result in _tokenize_all(chat, rows, processes, log):
        if isinstance(result, BadRow):
            if not settings.skip_bad_rows:
                raise result
            stats.skip(result)
            continue
        ids, mask, note = result
        cut = len(ids) > settings.max_seq_len
        if cut and settings.overlength == "drop":
            stats.overlength_dropped += 1
            continue
        ids, mask = ids[: settings.max_seq_len], mask[: settings.max_seq_len]
        if sum(mask[1:]) < 2 * settings.block_size:  # position 0 is never a label
            stats.too_short += 1  # counted once: a truncated sample dropped here is not also "truncated"
            continue
        stats.truncated += cut
        stats.note_context(note)  # of the rows that train
        all_ids.extend(ids)
        all_mask.extend(mask)
        lengths.append(len(ids))
        stats.tokens += len(ids)
        stats.response_tokens += sum(mask[1:])
    stats.kept = len(lengths)
    if not lengths:
        raise ValueError(
            f"--data {' '.join(paths)}: no sample is left with at least {2 * settings.block_size} response "
            f"tokens within --max_seq_len {settings.max_seq_len} ({stats.summary()})"
        )
    return TokenizedDataset.from_flat(all_ids, all_mask, lengths), stats


def longest_token_chars(tokenizer) -> int:
    """The most characters one token can stand for: its vocabulary's longest entry (a byte-level vocabulary
    spells each byte as one character, and a character is at least one byte)."""
    return max(map(len, tokenizer.get_vocab()))


def cut_long_texts(rows: list[Conversation], max_chars: int, markers: re.Pattern) -> None:
    """Cut, in place, every turn's text longer than `max_chars` characters to that many: a token stands for
    at most `longest_token_chars`, so a sample's first --max_seq_len tokens lie within them, and a 100 MB
    row no longer takes gigabytes to tokenize whole before it is cut to --max_seq_len tokens. A text
    holding one of the tokenizer's own token texts (`markers`) past the cut is kept whole: a template may
    render its start by them (Qwen3 drops the thinking up to an answer's `</think>`)."""

    def cut(value):
        if not isinstance(value, str) or len(value) <= max_chars or markers.search(value, max_chars):
            return value
        return value[:max_chars]

    for i, row in enumerate(rows):
        if any(isinstance(v, str) and len(v) > max_chars for turn in row.messages for v in turn.values()):
            rows[i] = row._replace(messages=[{k: cut(v) for k, v in turn.items()} for turn in row.messages])


def token_texts(tokenizer) -> re.Pattern:
    """A pattern of the tokenizer's added and special tokens' texts (`</think>`, `<|im_end|>`)."""
    texts = set(tokenizer.get_added_vocab()) | set(tokenizer.all_special_tokens)
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True) if t) or "(?!)")


def _hash_file(h, path: Path) -> None:
    h.update(f"{path.name}:{path.stat().st_size}:{file_sha256(path)}\n".encode())


def cache_key(chat: ChatTokenizer, tokenizer_dir: Path, paths: list[str], settings: TokenizeSettings) -> str:
    """sha256 over the data files' bytes, the tokenizer files, the template and the settings."""
    # the libraries' versions too: a tokenizers release may split text differently
    versions = f"v{CACHE_VERSION} transformers {transformers.__version__} tokenizers {tokenizers.__version__}"
    h = hashlib.sha256(f"dflash_ddp tokenized {versions}\n".encode())
    for f in data_file_contents(paths):
        _hash_file(h, f)
    for pattern in TOKENIZER_FILES:
        for f in sorted(tokenizer_dir.glob(pattern)):
            _hash_file(h, f)
    h.update(chat.tokenizer.chat_template.encode())
    chat_settings = {"template_kwargs": chat.template_kwargs, "last_turn_only": chat.last_turn_only}
    keyed = {k: v for k, v in asdict(settings).items() if k != "skip_bad_rows"}
    h.update(json.dumps([keyed, chat_settings], sort_keys=True).encode())
    return h.hexdigest()[:20]


def _write_cache(path: Path, data: TokenizedDataset, stats: DataStats) -> None:
    tmp = path.with_suffix(
        f".tmp-{socket.gethostname()}-{os.getpid()}"
    )  # unique across nodes sharing the dir
    tensors = {"input_ids": data.input_ids, "loss_mask": data.loss_mask, "offsets": data.offsets}
    try:
        save_file(
            tensors, tmp, metadata={"stats": json.dumps(asdict(stats)), "fingerprint": data.fingerprint()}
        )
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written file would fill the disk further on every attempt
        raise


def _read_cache(path: Path) -> tuple[TokenizedDataset, DataStats]:
    """The cached data, its tensors checked against the content hash written with them: the hash is the
    data fingerprint a resume compares, so a cache damaged on disk, or rewritten in a shared --cache_dir,
    must not train (and resume) unnoticed. Hashing costs about a second per GB, once per process."""
    with safe_open(path, framework="pt") as f:
        stats = DataStats(**json.loads(f.metadata()["stats"]))
        tensors = [f.get_tensor(name) for name in ("input_ids", "loss_mask", "offsets")]
        written = f.metadata().get("fingerprint")
    data = TokenizedDataset(*tensors)
    if data.fingerprint() != written:
        raise ValueError(
            f"its tensors do not match the hash written with them ({data.fingerprint()}, not {written})"
        )
    return data, stats


def load_or_tokenize(
    chat: ChatTokenizer,
    tokenizer_dir: Path,
    paths: list[str],
    settings: TokenizeSettings,
    cache_dir: Path,
    num_proc: int = 0,
    log=print,
) -> tuple[TokenizedDataset, DataStats, bool]:
    """The tokenized data from the cache, or tokenized now and cached. Returns (data, stats, from_cache).

    A cache file is complete whenever it exists (written aside, then renamed), so reading needs no lock.
    Without one, a process takes the key's exclusive lock, looks again, and tokenizes: the other
    processes of the job wait for its file instead of tokenizing too. An unreadable cache file is
    reported and replaced."""
    key = cache_key(chat, tokenizer_dir, paths, settings)
    path = cache_dir / f"tokenized-{key}.safetensors"
    cached = _try_read_cache(path, log)
    if cached is not None:
        return *_strict(cached, settings), True
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = (cache_dir / f"tokenized-{key}.lock").open("a")
    except OSError as e:
        raise ValueError(
            f"the tokenized-data cache {cache_dir} cannot be written ({e}): pass a writable --output_dir, or "
            "--cache_dir DIR (it defaults to OUTPUT_DIR/cache)"
        ) from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process tokenizes the same data: this rank's peer, or another job
            log(
                f"waiting for the tokenized-data cache {path}: another process holds {lock.name} while it tokenizes"
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _try_read_cache(path, log)
        if cached is not None:
            return *_strict(cached, settings), True
        check_cache_space(cache_dir, data_file_contents(paths))
        log(f"tokenizing {' '.join(paths)} (cached as {path})")
        start = time.perf_counter()
        data, stats = tokenize_dataset(chat, paths, settings, num_proc, log)
        try:
            _write_cache(path, data, stats)
        # a full disk is an OSError from Python but a SafetensorError from safetensors' writer
        except (OSError, SafetensorError) as e:
            raise ValueError(
                f"--cache_dir {cache_dir}: cannot write the tokenized-data cache ({describe_error(e)}); "
                "free space there or pass another --cache_dir"
            ) from None
        log(f"tokenized {stats.rows} rows in {time.perf_counter() - start:.1f} s")
    return data, stats, False


def _strict(cached: tuple[TokenizedDataset, DataStats], settings: TokenizeSettings):
    """A cache made with --skip_bad_rows that skipped rows refuses a run without it, as its data would."""
    stats = cached[1]
    if stats.bad_rows and not settings.skip_bad_rows:
        raise BadRow(
            f"{stats.bad_row_examples[0]} ({stats.bad_rows} bad rows in all, skipped by an earlier run with "
            "--skip_bad_rows): pass --skip_bad_rows to skip and count them"
        )
    return cached


def check_cache_space(cache_dir: Path, inputs: list[Path]) -> None:
    """Refuse, before tokenizing, a cache directory without room for the cache the inputs make."""
    needed = CACHE_BYTES_PER_INPUT_BYTE * sum(p.stat().st_size for p in inputs)
    free = shutil.disk_usage(cache_dir).free
    if free < needed:
        raise ValueError(
            f"--cache_dir {cache_dir}: {free / 2**30:.2f} GiB free, and the tokenized data of these inputs "
            f"takes up to about {needed / 2**30:.2f} GiB (about 5 bytes a token): free space there or pass "
            "another --cache_dir"
        )


def _try_read_cache(path: Path, log) -> tuple[TokenizedDataset, DataStats] | None:
    if not path.is_file():
        return None
    try:
        return _read_cache(path)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:  # a damaged or foreign file
        log(f"ignoring the unreadable cache file {path} ({describe_error(e)}); tokenizing again")
        return None
