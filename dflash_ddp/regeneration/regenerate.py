"""Regenerate the assistant turns of chat data with the frozen target (the DFlash paper trains on these).

    python -m dflash_ddp.regenerate --target_model DIR --data IN.jsonl [IN2 ...] --out OUT.jsonl
    torchrun --nproc-per-node 8 -m dflash_ddp.regenerate --target_model DIR --data IN.jsonl --out OUT.jsonl

Each row keeps its system and user turns. Every assistant turn is replaced by what the target generates
given the conversation before it (earlier turns already regenerated), and a row that ends with a user turn
gets one generated assistant turn appended. Multi-turn rows go in rounds: round j generates the j-th
assistant turn of every row of the batch that has one.

Determinism and resume contract:
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
  input order, each once, as {"messages": [...]}, keeps the settings beside it as OUT.settings.json (the
  drafter export stamps them), then removes OUT.parts. Bad rows, rows with an empty
  generated answer (the trainer refuses those) and rows cut off by --max_new_tokens (training would append an
  end of turn to them; --keep_truncated, read by the merging process, keeps them) are left out and counted.
- OUT.lock (an flock, removed at the end) makes the start-up checks and the merge of the ranks run one at a
  time. Run one job per OUT at a time (each rank holds an flock on its own part file, so a second job of
  the same size stops with an error).
- OUT existing without OUT.parts is a finished run: running again says so and exits 0 without comparing
  settings (there is nothing left to compare against); delete OUT or pick another --out to regenerate.

Sampling settings come from the flags only (greedy unless --temperature > 0): the target's
generation_config contributes its EOS ids, never its recommended temperature or penalties, so that
settings.json describes the output completely.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from jinja2 import TemplateError
from transformers import GenerationConfig
from transformers import logging as hf_logging

from dflash_ddp.data.chat_template import check_template_kwargs, json_object, load_target_tokenizer
from dflash_ddp.data.sources import BadRow, DataStats, data_file_contents, data_files, read_conversations
from dflash_ddp.files import file_sha256
from dflash_ddp.hub import ModelSource, hub_dataset_name
from dflash_ddp.parallel.downloads import fetch_target_weights, resolve_data_files, resolve_target
from dflash_ddp.parallel.topology import env_world, resolve_device
from dflash_ddp.regeneration.parts import PartWriter, Summary, index_parts, locked, merge, start_parts
from dflash_ddp.target_model.info import inspect_target
from dflash_ddp.target_model.loading import eos_token_ids, load_causal_lm

PROGRESS_EVERY_S = 30.0


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
    parser.add_argument("--target_model", required=True, help="local Hugging Face model directory")
    parser.add_argument(
        "--data", required=True, nargs="+", help="jsonl/json/parquet files, globs, save_to_disk dirs"
    )
    parser.add_argument("--out", required=True, help="output jsonl, one {'messages': [...]} per row")
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
    ):
        default = getattr(defaults, name)
        text += f"; default {default}" if default != "" else ""
        parser.add_argument(f"--{name}", type=kind, default=default, help=text)
    for name, text in (
        ("skip_bad_rows", "skip and count unusable rows"),
        ("keep_truncated", "also write rows whose answer --max_new_tokens cut off (merge-time choice)"),
    ):
        parser.add_argument(f"--{name}", action="store_true", help=text)
    config = RegenerateConfig(**vars(parser.parse_args(argv)))
    config.validate()
    return config


@dataclass
class Row:
    """One input conversation and the positions of the assistant turns to generate, in order."""

    index: int
    where: str
    messages: list[dict]
    targets: list[int]  # message positions; len(messages) means "append a turn"


def plan_row(index: int, where: str, messages: list[dict]) -> Row:
    """Every assistant turn is regenerated, except those that call tools (the tool results after them answer
    those very calls, so they are kept as written); a trailing user or tool turn gets a reply. BadRow if
    nothing is left."""
    targets = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    if messages[-1]["role"] in ("user", "tool"):
        targets.append(len(messages))
    if not targets:
        raise BadRow(
            f"{where}: nothing to generate (no assistant turn, and the last turn is not a user turn)"
        )
    if targets[0] == 0:
        raise BadRow(f"{where}: turn 0 is an assistant turn, so there is no prompt to answer")
    return Row(index, where, messages, targets)


def load_rows(cfg: RegenerateConfig) -> tuple[list[Row], DataStats]:
    """The input rows in order, numbered after bad rows are skipped (so the numbers are stable per input)."""
    stats = DataStats()
    conversations = read_conversations(cfg.data, cfg.skip_bad_rows, stats, require_assistant=False)
    rows = []
    for where, messages in conversations:
        try:
            rows.append(plan_row(len(rows), where, messages))
        except BadRow as e:
            if not cfg.skip_bad_rows:
                raise
            stats.skip(e)
    if not rows:
        raise ValueError(f"--data {cfg.data}: no row has anything to generate")
    stats.kept = len(rows)
    return rows, stats


@dataclass
class Answer:
    """One generated turn: decoded text (special tokens and surrounding whitespace removed) and its length."""

    text: str
    new_tokens: int  # generated tokens, EOS included
    hit_max_new_tokens: bool  # stopped by --max_new_tokens before any EOS


class TargetGenerator:
    """The target and its tokenizer: chat-template rendering and batched, left-padded `generate`."""

    def __init__(self, model, tokenizer, cfg: RegenerateConfig):
        self.model, self.tokenizer = model, tokenizer
        self.template_kwargs = cfg.chat_template_kwargs
        self.eos = set(eos_token_ids(tokenizer, model))
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

    def prompt_ids(self, row: Row, messages: list[dict]) -> list[int]:
        """Prompt ids ending in the generation prompt; BadRow naming the row when the template refuses it."""
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True, **self.template_kwargs
            )
        # e.g. a template's raise_exception on a role order it does not accept
        except (TemplateError, ValueError, TypeError) as e:
            raise BadRow(f"{row.where}: the chat template failed on this conversation ({e})") from None
        return list(rendered["input_ids"])

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
        answers = []
        for generated in out[:, longest:].tolist():
            end = next((i for i, t in enumerate(generated) if t in self.eos), None)
            tokens = generated if end is None else generated[:end]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
            # Without an EOS the row never finished, so `generated` has no padding and is max_new_tokens long.
            answers.append(Answer(text, len(generated) if end is None else end + 1, end is None))
        return answers


def batch_seed(seed: int, batch: int) -> int:
    """The RNG seed of global batch `batch`: a hash, so that neighbouring batches get unrelated streams."""
    digest = hashlib.sha256(f"dflash-regenerate:{seed}:{batch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def regenerate_batch(
    generate: TargetGenerator, rows: list[Row], seed: int, skip_bad_rows: bool = False
) -> list[dict]:
    """The finished records of `rows` (one global batch), round by round; seeded first, so recomputing a
    batch gives the same answers whatever ran before.

    A row whose prompt the chat template refuses (in any round) raises BadRow, or with `skip_bad_rows`
    leaves this and later rounds and is finished as {"row", "bad"}: done for good, never retried."""
    torch.manual_seed(seed)
    messages = [[dict(m) for m in row.messages] for row in rows]
    hit, new_tokens = [False] * len(rows), [0] * len(rows)
    bad: dict[int, str] = {}  # batch position -> the reason
    for j in range(max(len(row.targets) for row in rows)):
        prompts = {}  # batch position -> prompt ids, for the rows taking part in round j
        for b, row in enumerate(rows):
            if j >= len(row.targets) or b in bad:
                continue
            try:
                prompts[b] = generate.prompt_ids(row, messages[b][: row.targets[j]])
            except BadRow as e:
                if not skip_bad_rows:
                    raise BadRow(
                        f"{e}. Pass --skip_bad_rows to skip and count such rows; the finished rows are kept, "
                        "so the same command with --skip_bad_rows continues this run"
                    ) from None
                bad[b] = str(e)
        if not prompts:  # every row left is bad
            continue
        for b, answer in zip(prompts, generate(list(prompts.values())), strict=True):
            position, turn = rows[b].targets[j], {"role": "assistant", "content": answer.text}
            if position == len(messages[b]):
                messages[b].append(turn)
            else:
                messages[b][position] = turn
            hit[b] |= answer.hit_max_new_tokens
            new_tokens[b] += answer.new_tokens
    return [
        {"row": row.index, "messages": messages[b], "hit_max_new_tokens": hit[b], "new_tokens": new_tokens[b]}
        if b not in bad
        else {"row": row.index, "bad": bad[b]}
        for b, row in enumerate(rows)
    ]


def run_settings(
    cfg: RegenerateConfig, source: ModelSource, tokenizer, dtype: torch.dtype, num_rows: int
) -> dict:
    """What decides the output: a parts directory started with other values must not be continued."""
    data = [
        {"path": str(f.resolve()), "bytes": f.stat().st_size, "sha256": file_sha256(f)}
        for f in data_file_contents(cfg.data)
    ]
    return {
        "data": data,
        "num_rows": num_rows,
        "target_model": f"{source.repo_id}@{source.commit}" if source.repo_id else str(source.path.resolve()),
        "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
        "chat_template_kwargs": cfg.chat_template_kwargs,
        "dtype": str(dtype).removeprefix("torch."),
        **{
            name: getattr(cfg, name)
            for name in ("batch_size", "max_new_tokens", "temperature", "top_p", "top_k", "seed")
        },
    }


def pick_device(name: str, local_rank: int) -> tuple[torch.device, torch.dtype]:
    """cuda:LOCAL_RANK in bf16 (as the target is served), else the CPU in fp32 (bf16 matmuls are slow there)."""
    device = resolve_device(name)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device, torch.bfloat16
    return device, torch.float32


def say_finished(out: Path, parts: Path, rank: int) -> None:
    """Rank 0 says that OUT is a finished run (the other ranks stay quiet: one line per job)."""
    if rank == 0:
        print(f"{out} already exists and no run is in progress ({parts.name}/ is absent): nothing to do")


def regenerate(cfg: RegenerateConfig) -> Summary | None:
    """Run this rank's share of the batches, then merge if every row is finished. Returns the summary on
    the process that merged; None elsewhere. Bad input raises ValueError."""
    rank, world, local_rank = env_world()
    out = Path(cfg.out)
    parts, lock = out.with_name(out.name + ".parts"), out.with_name(out.name + ".lock")
    if out.exists() and not parts.is_dir():  # a finished run: say so before reading data or weights
        say_finished(out, parts, rank)
        return None
    cfg = dataclasses.replace(cfg, data=resolve_data_files(cfg.data))  # hub datasets: their split's files
    rows, stats = load_rows(cfg)
    source = resolve_target(cfg.target_model)
    info = inspect_target(source.path)
    fetch_target_weights(source, None)
    tokenizer = load_target_tokenizer(info.path, cfg.chat_template)
    device, dtype = pick_device(cfg.device, local_rank)
    settings = run_settings(cfg, source, tokenizer, dtype, len(rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(lock):
        if not start_parts(out, parts, settings):  # another rank merged since the check above
            lock.unlink(missing_ok=True)  # see the merge below
            say_finished(out, parts, rank)
            return None
        writer = PartWriter(parts / f"rank{rank}-of-{world}.jsonl")
        done = set(index_parts(parts, len(rows)))
    if rank != 0:
        hf_logging.disable_progress_bar()  # one "Loading weights" bar per job, not one per rank
    generate = TargetGenerator(load_causal_lm(info, device, dtype), tokenizer, cfg)
    num_batches = -(-len(rows) // cfg.batch_size)
    if rank == 0:
        print(
            f"regenerating {len(rows)} rows ({stats.bad_rows} bad rows skipped, {len(done)} already done) "
            f"in {num_batches} batches of {cfg.batch_size} on {world} process(es), {device} {dtype}"
        )
    generated_rows = generated_tokens = 0
    start = last_report = time.perf_counter()
    try:  # closed on a stop too (a bad row): the same process may run again, as the tests do
        for k in range(rank, num_batches, world):
            batch = rows[k * cfg.batch_size : (k + 1) * cfg.batch_size]
            if all(row.index in done for row in batch):
                continue
            records = regenerate_batch(generate, batch, batch_seed(cfg.seed, k), cfg.skip_bad_rows)
            # A batch cut short by a kill was recomputed whole; its rows already on disk are not written again.
            records = [r for r in records if r["row"] not in done]
            writer.write(records)
            generated_rows += len(records)
            generated_tokens += sum(r.get("new_tokens", 0) for r in records)
            if rank == 0 and time.perf_counter() - last_report > PROGRESS_EVERY_S:
                last_report = time.perf_counter()
                print(
                    f"rank 0: batch {k + 1}/{num_batches}, {generated_tokens / (last_report - start):.0f} tokens/s"
                )
    finally:
        writer.close()
    seconds = time.perf_counter() - start
    rate = (
        f"{generated_rows} rows, {generated_tokens} tokens in {seconds:.1f} s "
        f"({generated_tokens / max(seconds, 1e-9):.0f} tokens/s)"
    )
    with locked(lock):
        merged_before = not parts.is_dir()  # by a rank that finished first and found every row done
        summary = None if merged_before else merge(out, parts, len(rows), cfg.keep_truncated)
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
        f"wrote {out}: {summary.written} of {summary.rows} rows; {summary.bad} bad rows and "
        f"{summary.empty} with an empty answer left out, {summary.hit_max_new_tokens} cut off by "
        f"--max_new_tokens ({cfg.max_new_tokens}) {cut}; {summary.turns} generated turns, "
        f"{summary.new_tokens} tokens in all; this process: {rate}"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 when done (or nothing left to do), 2 on bad input or settings, 1 when the disk fails."""
    rank, world, _ = env_world()
    where = "" if world == 1 else f" (rank {rank})"
    try:
        regenerate(parse_args(argv))
    except ValueError as e:
        print(f"error{where}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error{where}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
