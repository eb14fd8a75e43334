"""The tiny-target tool's long-context step: a tiny target that has seen long inputs, and long data for it.

Run from the repository root (after `make_tiny_target`, whose output it reads)::

    python -m dflash_ddp.tools.make_long_target --out_dir runs/long-target [--max_len 12288]

1. conversations -- long multi-turn conversations made from the tiny target's corpus: question/answer turns
                    (the target's own regenerated answers) appended until a drawn length (log-uniform from
                    --min_len to --max_len, so every context length is covered); with --repeat_frac a turn
                    asks an earlier question of the same conversation again and gets the same answer, so
                    the answer depends on context thousands of tokens back. Held-out conversations end with
                    a held-out question (or a repeat) and are the prompts of an evaluation at long context.
2. training      -- the shipped target fine-tuned on them, one conversation a step, so that it has seen
                    positions up to --max_len (it was trained at 512).

Outputs (under --out_dir)::

    tiny_qwen3/               the fine-tuned target (bf16 safetensors) and its tokenizer
    data/long_train.jsonl     training conversations (--train_conversations)
    data/long_heldout.jsonl   held-out conversations, lengths spread log-uniformly (--heldout_conversations)
    build.json                the command, counts, lengths, loss and timings
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

from dflash_ddp.config import ASSETS
from dflash_ddp.tools.make_tiny_target import (
    add_autocast_argument,
    resolve_autocast,
    save_target,
    write_jsonl,
)
from dflash_ddp.tools.tiny_corpus import log

SOURCE = ASSETS  # the package's own: the tool runs from any directory
LAST_TURN_ROOM = 400  # tokens kept free for a held-out conversation's last turn (a turn is about 160)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def question_answer(row: dict) -> list[dict]:
    """A row's last user turn and its answer (a system prompt, if any, belongs to a conversation's start)."""
    messages = [m for m in row["messages"] if m["role"] != "system"]
    return messages[-2:]


def log_uniform_lengths(count: int, low: int, high: int, rng: random.Random) -> list[int]:
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(count)]


def long_conversation(
    turns: list[list[dict]],
    turn_tokens: list[int],
    length: int,
    repeat_frac: float,
    rng: random.Random,
    last: list[dict] | None = None,
) -> dict:
    """One conversation of at most `length` tokens: turns drawn from `turns` (or repeats of its own earlier
    turns, with probability `repeat_frac`), ending with `last` when given (a held-out question, or with
    probability `repeat_frac` a repeat)."""
    closing_tokens = 0 if last is None else LAST_TURN_ROOM
    chosen: list[int] = []
    used = 0
    while True:
        if chosen and rng.random() < repeat_frac:
            pick = chosen[rng.randrange(len(chosen))]
        else:
            pick = rng.randrange(len(turns))
        if used + turn_tokens[pick] + closing_tokens > length and chosen:
            break
        chosen.append(pick)
        used += turn_tokens[pick]
    messages = [m for i in chosen for m in turns[i]]
    if last is not None:
        messages += turns[chosen[rng.randrange(len(chosen))]] if rng.random() < repeat_frac else last
    return {"messages": messages}


def conversation_ids(tok, row: dict) -> list[int]:
    return list(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])


def fine_tune(model, tok, rows: list[dict], args) -> dict:
    """Train `model` in place on `rows`, one conversation a step (AdamW, warm-up then cosine to 10%); every
    token is predicted, as the tiny target was trained."""
    import torch

    order = list(range(len(rows)))
    random.Random(args.seed + 5).shuffle(order)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    model.train()
    losses, start = [], time.time()
    for step in range(args.train_steps):
        ids = torch.tensor([conversation_ids(tok, rows[order[step % len(order)]])[: args.max_len]])
        warm = (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.train_steps - args.warmup_steps)
        scale = warm if step < args.warmup_steps else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for group in opt.param_groups:
            group["lr"] = args.lr * scale
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16_autocast):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        log(f"  step {step + 1}/{args.train_steps}: {ids.shape[1]} tokens, loss {losses[-1]:.3f}")
    model.eval()
    return {
        "steps": args.train_steps,
        "first_loss": losses[0],
        "final_loss": sum(losses[-5:]) / len(losses[-5:]),
        "seconds": round(time.time() - start, 1),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", required=True)
    p.add_argument("--source_dir", default=str(SOURCE), help="make_tiny_target's output (target and data)")
    p.add_argument("--train_data", default="docstring_qa_regenerated.jsonl", help="under SOURCE/data")
    p.add_argument("--min_len", type=int, default=512)
    p.add_argument("--max_len", type=int, default=12288)
    p.add_argument("--train_conversations", type=int, default=64)
    p.add_argument("--heldout_conversations", type=int, default=16)
    p.add_argument("--repeat_frac", type=float, default=0.25)
    p.add_argument("--train_steps", type=int, default=40)
    p.add_argument("--warmup_steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    add_autocast_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the long conversations, fine-tune the target on them, write everything under --out_dir."""
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    command = resolve_autocast(args, " ".join(sys.argv[1:] if argv is None else argv))
    source, out = Path(args.source_dir), Path(args.out_dir)
    started = time.time()
    tok = AutoTokenizer.from_pretrained(source / "tiny_qwen3")
    train_turns = [question_answer(r) for r in read_rows(source / "data" / args.train_data)]
    held_turns = [question_answer(r) for r in read_rows(source / "data" / "heldout_regenerated.jsonl")]
    turn_tokens = [len(conversation_ids(tok, {"messages": t})) for t in train_turns]
    rng = random.Random(args.seed)
    train = [
        long_conversation(train_turns, turn_tokens, n, args.repeat_frac, rng)
        for n in log_uniform_lengths(args.train_conversations, args.min_len, args.max_len, rng)
    ]
    # held-out lengths spread evenly in log space, so that every context bucket has prompts
    span = math.log(args.max_len) - math.log(args.min_len)
    held_lengths = [
        int(args.min_len * math.exp(span * i / max(1, args.heldout_conversations - 1)))
        for i in range(args.heldout_conversations)
    ]
    held = [
        long_conversation(train_turns, turn_tokens, n, args.repeat_frac, rng, held_turns[i % len(held_turns)])
        for i, n in enumerate(held_lengths)
    ]
    write_jsonl(out / "data" / "long_train.jsonl", train)
    write_jsonl(out / "data" / "long_heldout.jsonl", held)
    lengths = {
        name: sorted(len(conversation_ids(tok, r)) for r in rows)
        for name, rows in (("train", train), ("heldout", held))
    }
    log(f"conversations: train {len(train)} ({sum(lengths['train'])} tokens), held-out {len(held)}")

    model = AutoModelForCausalLM.from_pretrained(source / "tiny_qwen3", dtype=torch.float32)
    log(f"fine-tuning the target at up to {args.max_len} tokens")
    stats = fine_tune(model, tok, train, args)
    # room for the longest prompt and its answer; the project checks contexts against this
    model.config.max_position_embeddings = 2 ** math.ceil(math.log2(2 * args.max_len))
    tok.model_max_length = model.config.max_position_embeddings
    save_target(model, tok, out / "tiny_qwen3")
    build = {
        "command": f"python -m dflash_ddp.tools.make_long_target {command}",
        "lengths": lengths,
        "training": stats,
        "seconds": round(time.time() - started, 1),
    }
    (out / "build.json").write_text(json.dumps(build, indent=1) + "\n")
    log(f"done in {build['seconds']:.0f} s: {out}")


if __name__ == "__main__":
    main()
