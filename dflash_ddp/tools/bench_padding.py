"""Benchmark: padding efficiency of the token-budget batches (real tokens / padded slots).

    python -m dflash_ddp.tools.bench_padding [--samples 200000] [--max_seq_len 3072]

For several length mixes and budgets it prints, side by side, the epoch batches of `schedule.epoch_batches`
and a baseline of the same number of samples per batch drawn without length bucketing: padding efficiency,
fill of the budget (real tokens / tokens_per_batch), batches per epoch, mean batch size, and how many batch
compositions of epoch 0 recur in epoch 1. The mixes are synthetic (seeded) plus, with --embedded, the
tokenized conversations shipped with the package.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from dflash_ddp.data.schedule import epoch_batches


def length_mixes(n: int, max_len: int, seed: int) -> dict[str, list[int]]:
    """Seeded synthetic sequence lengths, by name."""
    rng = random.Random(seed)

    def clip(x: float) -> int:
        return min(max_len, max(32, int(x)))

    return {
        # chat answers: median ~600 tokens, a long tail cut at max_seq_len (a sixth or so of ShareGPT-like data)
        "chat (lognormal)": [clip(rng.lognormvariate(math.log(600), 0.8)) for _ in range(n)],
        # a mix of short QA and long reasoning/code answers
        "short QA + long reasoning": [
            clip(rng.lognormvariate(math.log(250), 0.5) if rng.random() < 0.6 else rng.gauss(2200, 500))
            for _ in range(n)
        ],
        "uniform 64..max": [rng.randint(64, max_len) for _ in range(n)],
    }


def embedded_lengths(max_seq_len: int) -> list[int]:
    """Lengths of the embedded default's tokenized training conversations."""
    from transformers import AutoTokenizer

    from dflash_ddp.config import EMBEDDED_PRESET
    from dflash_ddp.data.chat_template import ChatTokenizer
    from dflash_ddp.data.dataset import TokenizeSettings, tokenize_dataset

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_PRESET["target_model"], local_files_only=True)
    data, _ = tokenize_dataset(
        ChatTokenizer(tokenizer, {}),
        EMBEDDED_PRESET["data"],
        TokenizeSettings(max_seq_len, EMBEDDED_PRESET["block_size"]),
    )
    return data.lengths


def measure(lengths: list[int], batches: list[list[int]], tokens_per_batch: int) -> dict:
    """Padding efficiency, fill of the budget, number and mean size of the batches."""
    real = sum(lengths)
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return {
        "efficiency": real / padded,
        "fill": real / (len(batches) * tokens_per_batch),
        "batches": len(batches),
        "mean_size": len(lengths) / len(batches),
    }


def unbucketed(lengths: list[int], sizes: list[int], seed: int) -> list[list[int]]:
    """The same batch sizes over a random order: what padding costs without length bucketing."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    out, start = [], 0
    for size in sizes:
        out.append(order[start : start + size])
        start += size
    return out


def main(argv: list[str] | None = None) -> None:
    """Print the table for every length mix and budget."""
    parser = argparse.ArgumentParser(prog="python -m dflash_ddp.tools.bench_padding")
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--max_seq_len", type=int, default=3072)
    parser.add_argument("--tokens_per_batch", type=int, nargs="+", default=[32768, 16384])
    parser.add_argument("--embedded", action="store_true", help="also the package's tokenized conversations")
    args = parser.parse_args(argv)
    mixes = {
        name: (lengths, args.tokens_per_batch)
        for name, lengths in length_mixes(args.samples, args.max_seq_len, 0).items()
    }
    if args.embedded:  # with the embedded preset's own budget
        from dflash_ddp.config import EMBEDDED_PRESET

        lengths = embedded_lengths(EMBEDDED_PRESET["max_seq_len"])
        mixes["embedded default data"] = (lengths, [EMBEDDED_PRESET["tokens_per_batch"]])
    header = f"{'length mix':<32} {'budget':>7} {'efficiency':>10} {'unbucketed':>10} {'fill':>6} {'batches':>8} {'size':>6} {'recur':>6} {'s/epoch':>8}"
    print(header)
    for name, (lengths, budgets) in mixes.items():
        for tokens_per_batch in budgets:
            if tokens_per_batch < max(lengths):
                continue
            start = time.perf_counter()
            epoch0 = epoch_batches(lengths, tokens_per_batch, seed=0, epoch=0)
            seconds = time.perf_counter() - start
            epoch1 = epoch_batches(lengths, tokens_per_batch, seed=0, epoch=1)
            recur = len({tuple(sorted(b)) for b in epoch0} & {tuple(sorted(b)) for b in epoch1})
            ours = measure(lengths, epoch0, tokens_per_batch)
            base = measure(lengths, unbucketed(lengths, [len(b) for b in epoch0], 0), tokens_per_batch)
            print(
                f"{name:<32} {tokens_per_batch:>7} {ours['efficiency']:>10.1%} {base['efficiency']:>10.1%} "
                f"{ours['fill']:>6.1%} {ours['batches']:>8} {ours['mean_size']:>6.1f} {recur:>6} {seconds:>8.2f}"
            )


if __name__ == "__main__":
    main()
