"""Regenerate the assistant turns of chat data with the frozen target (the DFlash paper trains on these).

    python -m dflash_ddp.regenerate --target_model DIR --data IN.jsonl [IN2 ...] --out OUT.jsonl
    torchrun --nproc-per-node 8 -m dflash_ddp.regenerate --target_model DIR --data IN.jsonl --out OUT.jsonl
    python -m dflash_ddp.regenerate --engine vllm --vllm_python VLLM_VENV/bin/python --target_model DIR ...
    python -m dflash_ddp.regenerate --engine vllm --engine_url http://HOST:PORT [URL2 ...] --target_model DIR ...

Each row keeps its system and user turns and every other field (an id, a source, nested metadata: the row is
written back as it was read, in its own `messages` or ShareGPT `conversations` format). Every assistant turn
is replaced by what the target generates given the conversation before it (earlier turns already
regenerated), and a row that ends with a user turn gets one generated assistant turn appended. Multi-turn
rows go in rounds: round j generates the j-th assistant turn of every row of the batch that has one.

Who generates: the target itself through transformers' `generate`, in batches (the default), or a serving
engine (`--engine vllm`): a vLLM server started from vLLM's own Python (`--vllm_python`, `--vllm_args` for its
own flags such as --tensor-parallel-size), or OpenAI-compatible servers already running (`--engine_url`, vLLM
or SGLang), each with `--requests_in_flight` rows at a time (see served.py). The row format, the parts, the
resume and the merge are the same for both; the engine's rows are keyed by row, not by batch.

A row may carry its own "chat_template_kwargs" (e.g. {"enable_thinking": true} on some rows, false on
others), applied over --chat_template_kwargs; it is kept in the output row, so that training renders the
row as it was generated.

Determinism and resume contract (transformers' path; the engine path: per row, see served.py):
- Global batch k is rows [k*B, (k+1)*B) in input order (rows --skip_bad_rows skips on reading do not count);
  rank r of W (torchrun's RANK/WORLD_SIZE; no process group is created) does batches k = r, r+W, ...
  The RNG is seeded from (seed, k) before each batch, so a row's answer depends on the data, the target,
  the settings and B, not on the number of processes or on what ran before.
- Finished rows are appended as JSON lines {"row", "messages", "hit_max_new_tokens", "new_tokens"} to
  OUT.parts/rank{r}-of-{W}.jsonl, flushed and fsynced after each batch; a row the chat template refuses
  (--skip_bad_rows, else the run stops naming it) is finished as {"row", "bad"}. A restart, with any number of
  processes, reads every part file, ignores a last line cut short by a kill, and skips finished rows; a
  batch finished only in part is recomputed whole (same rows, same seed) and only its missing rows are written.
- OUT.parts/settings.json records the data (size + sha256 of each file), the row count, the target, the chat
  template and every generation setting; a run with other ones is refused, never mixed in. --skip_bad_rows
  is not among them (the row count guards the numbering), so a run stopped at a bad row continues with it.
- The process that finds every row finished writes OUT atomically (temporary file, fsync, rename), rows in
  input order, each once, as the input row with its regenerated turns (parts.merge, turns.output_row: the
  part files hold only the generated conversation, the other fields come from the input, which
  settings.json pins), keeps the settings beside it as OUT.settings.json (the drafter export stamps them),
  then removes OUT.parts. Bad rows, rows with an empty
  generated answer (the trainer refuses those) and rows cut off by --max_new_tokens (training would append an
  end of turn to them; --keep_truncated, read by the merging process, keeps them) are left out and counted.
- OUT.lock (an flock, removed at the end) makes the start-up checks and the merge of the ranks run one at a
  time. Run one job per OUT at a time (each rank holds an flock on its own part file, so a second job of
  the same size stops with an error).
- OUT existing without OUT.parts is a finished run: running again with the settings OUT.settings.json
  records says so and exits 0; with other generation settings, data files or --keep_truncated it is an
  error naming them (delete OUT and OUT.settings.json, or pick another --out, to regenerate).

Sampling settings come from the flags only (greedy unless --temperature > 0): the target's
generation_config contributes its EOS ids, never its recommended temperature or penalties, so that
settings.json describes the output completely.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers import logging as hf_logging

from dflash_ddp.data.chat_template import check_template_kwargs, json_object, load_target_tokenizer
from dflash_ddp.data.sources import (
    BadRow,
    DataStats,
    data_file_contents,
    data_files,
    read_conversations_and_rows,
)
from dflash_ddp.engines import EngineClient, EngineServer, SamplingRequest
from dflash_ddp.files import file_sha256
from dflash_ddp.hub import ModelSource, hub_dataset_name, named_target
from dflash_ddp.parallel.devices import resolve_device
from dflash_ddp.parallel.downloads import fetch_target_weights, resolve_data_files, resolve_target
from dflash_ddp.parallel.topology import env_world
from dflash_ddp.regeneration.parts import (
    PartWriter,
    Summary,
    index_parts,
    locked,
    merge,
    settings_path,
    start_parts,
)
from dflash_ddp.regeneration.served import ServedSettings, served_records, served_row_work
from dflash_ddp.regeneration.turns import Answer, ChatTurns, Row, plan_row, regenerate_batch, seed_of
from dflash_ddp.target_model.info import inspect_target
from dflash_ddp.target_model.loading import decoding_weights, eos_token_ids, load_causal_lm, views_root

PROGRESS_EVERY_S = 30.0
REQUEST_TIMEOUT_S = 3600  # one completion of a long answer, queued behind many on a busy server


@dataclass
class RegenerateConfig:
    """Every setting of a regeneration run; the ones that change the output go into settings.json."""

    target_model: str
    data: list[str]
    out: str
    batch_size: int = 16
    max_new_tokens: int = 1024
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off; sampling only
    top_k: int = 0  # 0 = off; sampling only
    seed: int = 0
    chat_template: str = ""  # a jinja file replacing the tokenizer's template
    chat_template_kwargs: dict = field(default_factory=dict)  # e.g. {"enable_thinking": false}
    skip_bad_rows: bool = False
    keep_truncated: bool = False  # a merge-time choice, not in settings.json
    device: str = "auto"
    engine: str = "transformers"  # or "vllm": a server generates (any OpenAI-compatible one at --engine_url)
    vllm_python: str = ""  # start a vLLM server from this interpreter
    vllm_args: str = ""  # that server's own extra flags, e.g. "--tensor-parallel-size 8"
    engine_url: list[str] = field(default_factory=list)  # servers already running
    requests_in_flight: int = 64  # per server

    def validate(self) -> None:
        """Reject impossible settings with the flag name and what to pass instead."""
        for name in ("batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)}: must be a positive integer")
        if self.temperature < 0:
            raise ValueError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"--top_k {self.top_k}: must be >= 0 (0 = off)")
        if self.temperature == 0 and (self.top_p < 1 or self.top_k > 0):
            raise ValueError("--top_p / --top_k only apply when sampling: also pass --temperature > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device}: choose auto, cpu or cuda")
        if self.requests_in_flight < 1:
            raise ValueError(f"--requests_in_flight {self.requests_in_flight}: must be a positive integer")
        if self.engine == "vllm" and bool(self.vllm_python) == bool(self.engine_url):
            raise ValueError(
                "--engine vllm needs one of --vllm_python PATH (vLLM's own Python: a server is started) or "
                "--engine_url URL [URL ...] (servers already running)"
            )
        if self.engine == "transformers" and (self.vllm_python or self.engine_url or self.vllm_args):
            raise ValueError("--vllm_python, --vllm_args and --engine_url need --engine vllm")
        check_template_kwargs(self.chat_template_kwargs)
        out = Path(self.out).resolve()
        if out in {p.resolve() for p in data_files([d for d in self.data if hub_dataset_name(d) is None])}:
            raise ValueError(f"--out {self.out} is one of the --data files: pick another output path")
        if out.is_dir():
            raise ValueError(f"--out {self.out} is a directory: give a file path such as OUT.jsonl")


def parse_args(argv: list[str] | None) -> RegenerateConfig:
    """The command line as a validated config; bad flags exit 2 with argparse's message."""
    parser = argparse.ArgumentParser(
        prog="python -m dflash_ddp.regenerate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--target_model",
        required=True,
        type=named_target,
        help="a local Hugging Face model directory, a hub name org/name[@revision], or embedded (the tiny "
        "target shipped in the package)",
    )
    parser.add_argument(
        "--data", required=True, nargs="+", help="jsonl/json/parquet files, globs, save_to_disk dirs"
    )
    parser.add_argument(
        "--out", required=True, help="output jsonl: each input row, every field kept, its answers regenerated"
    )
    defaults = RegenerateConfig("", [], "")
    for name, kind, text in (
        ("batch_size", int, "rows per generate call (rows of a batch share a seed)"),
        ("max_new_tokens", int, "per generated turn"),
        ("temperature", float, "0 = greedy, > 0 samples"),
        ("top_p", float, "nucleus sampling, 1 = off (needs --temperature > 0)"),
        ("top_k", int, "top-k sampling, 0 = off (needs --temperature > 0)"),
        ("seed", int, "batch k is seeded from (seed, k)"),
        ("chat_template", str, "jinja file replacing the tokenizer's chat template"),
        ("chat_template_kwargs", json_object, """template variables, e.g. '{"enable_thinking": false}'"""),
        ("device", str, "auto | cpu | cuda (cuda:LOCAL_RANK in bf16; the CPU runs fp32)"),
        ("vllm_python", str, "--engine vllm: start a vLLM server from this Python (vLLM's own environment)"),
        ("vllm_args", str, "--engine vllm: that server's own flags, e.g. '--tensor-parallel-size 8'"),
        ("requests_in_flight", int, "--engine vllm: rows generated at a time, per server"),
    ):
        default = getattr(defaults, name)
        text += f"; default {default}" if default != "" else ""
        parser.add_argument(f"--{name}", type=kind, default=default, help=text)
    parser.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        default="transformers",
        help="who generates: the target through transformers' generate, or a serving engine (vLLM, or any "
        "OpenAI-compatible server at --engine_url)",
    )
    parser.add_argument(
        "--engine_url", nargs="+", default=[], help="--engine vllm: servers already running (vLLM, SGLang)"
    )
    for name, text in (
        ("skip_bad_rows", "skip and count unusable rows"),
        ("keep_truncated", "also write rows whose answer --max_new_tokens cut off (merge-time choice)"),
    ):
        parser.add_argument(f"--{name}", action="store_true", help=text)
    config = RegenerateConfig(**vars(parser.parse_args(argv)))
    config.validate()
    return config


def load_rows(cfg: RegenerateConfig) -> tuple[list[Row], DataStats]:
    """The input rows in order, numbered after bad rows are skipped (so the numbers are stable per input),
    each with every field it was read with (written back around its regenerated answers)."""
    stats = DataStats()
    rows = []
    for (where, messages, row_kwargs), fields in read_conversations_and_rows(
        cfg.data, cfg.skip_bad_rows, stats, require_assistant=False
    ):
        try:
            rows.append(plan_row(len(rows), where, messages, row_kwargs, fields))
        except BadRow as e:
            if not cfg.skip_bad_rows:
                raise
            stats.skip(e)
    if not rows:
        raise ValueError(f"--data {cfg.data}: no row has anything to generate")
    stats.kept = len(rows)
    return rows, stats


class TargetGenerator(ChatTurns):
    """The target itself, through transformers' batched, left-padded `generate`."""

    def __init__(self, model, tokenizer, cfg: RegenerateConfig):
        super().__init__(tokenizer, cfg.chat_template_kwargs, set(eos_token_ids(tokenizer, model)))
        self.model = model
        if not self.eos:
            raise ValueError(
                f"--target_model {cfg.target_model}: neither the tokenizer nor generation_config has an EOS"
            )
        # Pad positions are masked out, so any id works; the tokenizer's pad id keeps the batch readable.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos)
        # A fresh generation config: the model's own (recommended temperature, repetition penalty...) would
        # silently fill every setting not given here and make the output depend on more than settings.json.
        model.generation_config = GenerationConfig()
        self.kwargs = {
            "max_new_tokens": cfg.max_new_tokens,
            "do_sample": cfg.temperature > 0,
            "eos_token_id": sorted(self.eos),
            "pad_token_id": self.pad_id,
        }
        if cfg.temperature > 0:
            self.kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)

    @torch.inference_mode()
    def __call__(self, prompts: list[list[int]]) -> list[Answer]:
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for b, prompt in enumerate(prompts):  # left padding: every row's next token is at the same column
            ids[b, longest - len(prompt) :] = torch.tensor(prompt)
            mask[b, longest - len(prompt) :] = 1
        device = self.model.device
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **self.kwargs)
        return [self.answer(generated) for generated in out[:, longest:].tolist()]


def run_settings(cfg: RegenerateConfig, source: ModelSource, tokenizer, engine: dict, num_rows: int) -> dict:
    """What decides the output: a parts directory started with other values must not be continued. `engine`
    names who generates: the dtype and batch size of transformers' path, or the server's model (and, for a
    server started here, its dtype and flags)."""
    return {
        "data": data_records(cfg.data),
        "num_rows": num_rows,
        "target_model": f"{source.repo_id}@{source.commit}" if source.repo_id else str(source.path.resolve()),
        "chat_template_sha256": template_sha256(tokenizer),
        "chat_template_kwargs": cfg.chat_template_kwargs,
        **engine,
        **{name: getattr(cfg, name) for name in ("max_new_tokens", "temperature", "top_p", "top_k", "seed")},
    }


def data_records(data: list[str]) -> list[dict]:
    """How OUT.settings.json records the data: each local file's path, size and sha256."""
    return [
        {"path": str(f.resolve()), "bytes": f.stat().st_size, "sha256": file_sha256(f)}
        for f in data_file_contents(data)
    ]


def template_sha256(tokenizer) -> str:
    return hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()


def pick_device(name: str, local_rank: int) -> tuple[torch.device, torch.dtype]:
    """cuda:LOCAL_RANK in bf16 (as the target is served), else the CPU in fp32 (bf16 matmuls are slow there)."""
    device = resolve_device(name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device, torch.bfloat16
    return device, torch.float32


# settings a finished run is compared on as given; its data, target and chat template are compared below
FINISHED_SETTINGS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "chat_template_kwargs",
    "keep_truncated",
)


def check_finished(out: Path, cfg: RegenerateConfig) -> None:
    """A finished OUT asked for again: ValueError when OUT.settings.json records other settings, data (local
    files by path and sha256), target or chat template (a local target's) than these, which OUT does not
    follow, or when no OUT.settings.json says this tool wrote OUT. Nothing is downloaded."""
    path = settings_path(out)
    if not path.is_file():
        raise ValueError(
            f"--out {out} exists and no {path.name} beside it says this tool wrote it (another file, or one "
            f"regenerated before the settings were kept): pass another --out, or delete {out} to regenerate"
        )
    old = json.loads(path.read_text())
    was = {name: old[name] for name in FINISHED_SETTINGS if name in old}
    now = {name: getattr(cfg, name) for name in was}
    if "data" in old and all(hub_dataset_name(spec) is None for spec in cfg.data):
        was["data"], now["data"] = (
            sorted(f"{d['path']} (sha256 {d['sha256'][:12]})" for d in records)
            for records in (old["data"], data_records(cfg.data))
        )
    local = Path(cfg.target_model).is_dir()
    if "target_model" in old:  # a hub target by name (its commit is resolved only when it runs)
        was["target_model"] = old["target_model"] if local else old["target_model"].split("@")[0]
        now["target_model"] = (
            str(Path(cfg.target_model).resolve()) if local else cfg.target_model.split("@")[0]
        )
    if "chat_template_sha256" in old and local:
        was["chat_template_sha256"] = old["chat_template_sha256"]
        now["chat_template_sha256"] = template_sha256(
            load_target_tokenizer(cfg.target_model, cfg.chat_template)
        )
    changed = [f"{k}: {was[k]!r} -> {now[k]!r}" for k in was if was[k] != now[k]]
    if changed:
        raise ValueError(
            f"{out} is a finished run with other settings (then -> now): {'; '.join(changed)}. Pass another "
            f"--out, or delete {out} and {path.name} to regenerate"
        )


def say_finished(out: Path, parts: Path, rank: int) -> None:
    """Rank 0 says that OUT is a finished run (the other ranks stay quiet: one line per job)."""
    if rank == 0:
        print(f"{out} already exists and no run is in progress ({parts.name}/ is absent): nothing to do")


class RegenerationRun:
    """The parts of one run on this rank: what is done, the part file it appends to, progress and rate."""

    def __init__(self, writer: PartWriter, done: set[int], rank: int):
        self.writer, self.done, self.rank = writer, done, rank
        self.rows = self.tokens = 0
        self.todo = 0  # rows this process has to generate in this run (`run_batches`, `run_served`)
        self.start = self.last_report = time.perf_counter()

    def write(self, records: list[dict], where: str) -> None:
        """Append finished rows (a batch cut short by a kill was recomputed whole: rows already on disk are
        not written again); a progress line every PROGRESS_EVERY_S on rank 0."""
        records = [r for r in records if r["row"] not in self.done]
        self.writer.write(records)
        self.rows += len(records)
        self.tokens += sum(r.get("new_tokens", 0) for r in records)
        now = time.perf_counter()
        if self.rank == 0 and now - self.last_report > PROGRESS_EVERY_S:
            self.last_report = now
            seconds = now - self.start
            left = max(self.todo - self.rows, 0)
            print(
                f"rank 0: {where}, {self.rows / seconds:.2f} rows/s, {self.tokens / seconds:.0f} tokens/s, "
                f"{left} of its {self.todo} rows left, {time_left(left, self.rows, seconds)}"
            )

    def rate(self) -> str:
        """This process's rows, tokens and speed, for the closing line."""
        seconds = time.perf_counter() - self.start
        return (
            f"{self.rows} rows, {self.tokens} tokens in {seconds:.1f} s "
            f"({self.rows / max(seconds, 1e-9):.2f} rows/s, {self.tokens / max(seconds, 1e-9):.0f} tokens/s)"
        )


def time_left(left: int, done: int, seconds: float) -> str:
    """The time `left` rows take at the rate of the `done` rows of `seconds` (every rank runs at about the
    same rate on its equal share, so rank 0's estimate is the job's)."""
    if not done:
        return "time left unknown"
    minutes = left * seconds / done / 60
    return f"about {minutes:.0f} min left" if minutes >= 1 else "under a minute left"


def run_batches(
    cfg: RegenerateConfig, rows: list[Row], run: RegenerationRun, generate: TargetGenerator, world: int
):
    """Transformers' path: global batches k = rank, rank + world, ..., each seeded from (seed, k)."""
    num_batches = -(-len(rows) // cfg.batch_size)
    run.todo = sum(
        row.index not in run.done
        for k in range(run.rank, num_batches, world)
        for row in rows[k * cfg.batch_size : (k + 1) * cfg.batch_size]
    )
    for k in range(run.rank, num_batches, world):
        batch = rows[k * cfg.batch_size : (k + 1) * cfg.batch_size]
        if all(row.index in run.done for row in batch):
            continue
        run.write(
            regenerate_batch(generate, batch, seed_of(cfg.seed, k), cfg.skip_bad_rows),
            f"batch {k + 1}/{num_batches}",
        )


def run_served(
    cfg: RegenerateConfig, rows: list[Row], run: RegenerationRun, chat: ChatTurns, clients: list[EngineClient]
):
    """The engine's path: every row not done, `requests_in_flight` at a time on each server."""
    sampling = SamplingRequest(cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed, tuple(sorted(chat.eos)))
    work = served_row_work(chat, ServedSettings(cfg.max_new_tokens, sampling, cfg.skip_bad_rows))
    todo = [row for row in rows if row.index not in run.done]
    run.todo = len(todo)
    for records in served_records(todo, clients, cfg.requests_in_flight, work):
        run.write(records, f"{len(run.done) + run.rows + len(records)}/{len(rows)} rows")


def start_engine(
    cfg: RegenerateConfig, target: Path, servers: contextlib.ExitStack
) -> tuple[list[EngineClient], dict]:
    """The servers' clients and the engine's settings: a vLLM server started from --vllm_python (stopped
    with `servers`), or the servers at --engine_url."""
    if cfg.engine_url:
        clients = [EngineClient(url, timeout_s=REQUEST_TIMEOUT_S) for url in cfg.engine_url]
        models = sorted({c.model for c in clients})
        if len(models) > 1:
            raise ValueError(f"--engine_url: the servers serve different models ({', '.join(models)})")
        return clients, {"engine": "server", "served_model": models[0]}
    # fp32 on a machine without a GPU (as transformers' path there); the engine's own choice on GPUs
    dtype = "auto" if torch.cuda.is_available() else "float32"
    extra = tuple(shlex.split(cfg.vllm_args))
    print(f"starting a vLLM server for {target} ({dtype})")
    server = servers.enter_context(EngineServer(cfg.vllm_python, str(target), None, dtype, extra_args=extra))
    client = EngineClient(server.url, timeout_s=REQUEST_TIMEOUT_S)
    return [client], {
        "engine": "vllm",
        "served_model": client.model,
        "dtype": dtype,
        "vllm_args": cfg.vllm_args,
    }


def regenerate(cfg: RegenerateConfig) -> Summary | None:
    """Run this rank's share of the rows, then merge if every row is finished. Returns the summary on
    the process that merged; None elsewhere. Bad input raises ValueError."""
    rank, world, local_rank = env_world()
    if cfg.engine == "vllm" and world > 1:
        raise ValueError(
            "--engine vllm runs as one process (it sends every row to the servers): start it with python, not "
            "torchrun; more GPUs serve through --vllm_args (--data-parallel-size) or more --engine_url servers"
        )
    out = Path(cfg.out)
    parts, lock = out.with_name(out.name + ".parts"), out.with_name(out.name + ".lock")
    if out.exists() and not parts.is_dir():  # a finished run: say so before reading data or weights
        check_finished(out, cfg)
        say_finished(out, parts, rank)
        return None
    cfg = dataclasses.replace(cfg, data=resolve_data_files(cfg.data))  # hub datasets: their split's files
    rows, stats = load_rows(cfg)
    source = resolve_target(cfg.target_model)
    info = inspect_target(source.path)
    if not cfg.engine_url:  # servers already running have their weights; tokenizer and config suffice here
        # transformers decodes the text model alone (a wrapper's vision shards stay in the hub); vLLM loads all
        text = decoding_weights(info) if cfg.engine == "transformers" else None
        path = fetch_target_weights(source, None, views_root() if text else None, text=text)
        info = inspect_target(path) if path != source.path else info
    tokenizer = load_target_tokenizer(info.path, cfg.chat_template)
    with contextlib.ExitStack() as servers:
        if cfg.engine == "vllm":
            clients, engine = start_engine(cfg, info.path, servers)
            chat = ChatTurns(tokenizer, cfg.chat_template_kwargs, set(eos_token_ids(tokenizer, info.path)))
            where = f"{len(clients)} server(s), {cfg.requests_in_flight} rows in flight each"
        else:
            device, dtype = pick_device(cfg.device, local_rank)
            engine = {"dtype": str(dtype).removeprefix("torch."), "batch_size": cfg.batch_size}
            where = f"batches of {cfg.batch_size} on {world} process(es), {device} {dtype}"
        settings = run_settings(cfg, source, tokenizer, engine, len(rows))
        out.parent.mkdir(parents=True, exist_ok=True)
        with locked(lock):
            if not start_parts(out, parts, settings):  # another rank merged since the check above
                lock.unlink(missing_ok=True)  # see the merge below
                say_finished(out, parts, rank)
                return None
            run = RegenerationRun(
                PartWriter(parts / f"rank{rank}-of-{world}.jsonl"), set(index_parts(parts, len(rows))), rank
            )
        try:  # closed on a stop too (a bad row): the same process may run again, as the tests do
            if rank == 0:
                first = f", the first: {stats.bad_row_examples[0]}" if stats.bad_row_examples else ""
                print(
                    f"regenerating {len(rows)} rows ({stats.bad_rows} unreadable rows skipped{first}; "
                    f"{len(run.done)} already done) with {where}"
                )
                for note in stats.notes():
                    print(note)
            if cfg.engine == "vllm":
                run_served(cfg, rows, run, chat, clients)
            else:
                if rank != 0:
                    hf_logging.disable_progress_bar()  # one "Loading weights" bar per job, not one per rank
                model = load_causal_lm(info, device, dtype)
                run.start = run.last_report = (
                    time.perf_counter()
                )  # the rate is the generation's, not the load's
                run_batches(cfg, rows, run, TargetGenerator(model, tokenizer, cfg), world)
        finally:
            run.writer.close()
    rate = run.rate()
    with locked(lock):
        merged_before = not parts.is_dir()  # by a rank that finished first and found every row done
        summary = None if merged_before else merge(out, parts, rows, cfg.keep_truncated)
        if merged_before or summary is not None:
            # Removed while held: a process waiting on it, or creating it anew, finds OUT finished and only reads.
            lock.unlink(missing_ok=True)
    if summary is None:
        rest = (
            "was written by another rank" if merged_before else "will be written by the last rank to finish"
        )
        print(f"rank {rank}: {rate}; {out} {rest}")
        return None
    cut = "kept (--keep_truncated)" if cfg.keep_truncated else "left out (--keep_truncated keeps them)"
    print(
        f"wrote {out}: {summary.written} of {summary.rows} rows; {summary.bad} bad rows found while generating "
        f"(--skip_bad_rows) and {summary.empty} with an empty answer left out, {summary.hit_max_new_tokens} cut off by "
        f"--max_new_tokens ({cfg.max_new_tokens}) {cut}; {summary.turns} generated turns, "
        f"{summary.new_tokens} tokens in all; this process: {rate}"
    )
    if summary.rows and summary.written < summary.rows / 2:
        print(
            f"note: {out} holds {summary.written} of {summary.rows} rows: see above why the others were left out "
            "(answers cut off: a larger --max_new_tokens, or --keep_truncated with a new --out)"
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 when done (or nothing left to do), 2 on bad input or settings, 1 when the disk fails."""
    rank, world, _ = env_world()
    where = "" if world == 1 else f" (rank {rank})"
    stop = []

    def stop_on_sigterm(signum, frame):  # a scheduler's preemption stops as Ctrl-C: what is done is on disk
        stop.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    cfg = None
    try:
        cfg = parse_args(argv)
        regenerate(cfg)
    except ValueError as e:
        print(f"error{where}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error{where}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what is done is on disk
        parts = f"{cfg.out}.parts" if cfg else "OUT.parts"
        how = "stopped (SIGTERM)" if stop else "interrupted"
        print(
            f"{how}{where}: the rows finished so far are kept in {parts}; the same command continues",
            file=sys.stderr,
        )
        return 143 if stop else 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
