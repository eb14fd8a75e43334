"""Benchmark: peak memory of the LM-head loss, chunked vs. unchunked, for a Qwen3-8B-sized vocabulary.

    python -m dflash_ddp.tools.bench_loss_memory [--rows 7680] [--vocab 151936] [--hidden 1024] [--chunk 1024]

Each variant runs forward + backward in its own process; the figure is the growth of the process's peak
resident memory over its baseline after the inputs exist, so only what the loss itself allocates counts.
The logits' size does not depend on the hidden width, so a narrower hidden keeps the run short on a CPU.
Default rows: 512 anchors x 15 scored positions (block size 16).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(rows: int, vocab: int, hidden: int, chunk: int, mode: str) -> None:
    import torch
    import torch.nn.functional as F

    from dflash_ddp.drafter.objective import chunked_weighted_ce
    from dflash_ddp.drafter.weighting import LossSettings

    torch.manual_seed(0)
    h = torch.randn(rows, hidden, requires_grad=True)
    head = torch.randn(vocab, hidden) * 0.02
    labels = torch.randint(0, vocab, (rows,))
    weights = torch.rand(rows)
    baseline = _peak_rss_bytes()
    start = time.perf_counter()
    if mode == "chunked":
        loss, _ = chunked_weighted_ce(h, head, labels, weights, LossSettings(chunk_rows=chunk))
    else:
        loss = (F.cross_entropy(h @ head.T, labels, reduction="none") * weights).sum()
    loss.backward()
    print(json.dumps({"peak_growth": _peak_rss_bytes() - baseline, "seconds": time.perf_counter() - start}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512 * 15)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--child", choices=["chunked", "unchunked"])
    args = parser.parse_args()
    if args.child:
        _child(args.rows, args.vocab, args.hidden, args.chunk, args.child)
        return
    gib = 1 << 30
    logits = args.rows * args.vocab * 4
    print(f"rows {args.rows}, vocab {args.vocab}: one fp32 logits tensor is {logits / gib:.2f} GiB")
    results = {}
    for mode in ("unchunked", "chunked"):
        cmd = [sys.executable, "-m", "dflash_ddp.tools.bench_loss_memory", "--child", mode]
        cmd += ["--rows", str(args.rows), "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
        cmd += ["--chunk", str(args.chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
        r = results[mode]
        print(f"{mode:>10}: peak memory growth {r['peak_growth'] / gib:6.2f} GiB   ({r['seconds']:.1f} s)")
    ratio = results["unchunked"]["peak_growth"] / max(1, results["chunked"]["peak_growth"])
    print(f"chunked loss needs {ratio:.1f}x less memory (chunk {args.chunk})")


if __name__ == "__main__":
    main()
