"""The long-context benchmark (section (j)) through its CLI, at --quick: the long target built by the tool,
every drafter trained and decoded losslessly, tau by context bucket, and the plan against a measured run."""

import subprocess
import sys

import pytest

from dflash_ddp.bench.long_context import VARIANTS

pytestmark = pytest.mark.processes(background=True)  # untimed processes: the tables' figures


def bench(out_dir, timeout: int, *flags: str) -> str:
    command = [
        "-m",
        "dflash_ddp.bench",
        "--only",
        "long_context",
        "--quick",
        "--long_out",
        str(out_dir),
        *flags,
    ]
    # run from elsewhere than the checkout: the package finds its own assets
    return subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=timeout, check=True, cwd=out_dir
    ).stdout


def test_the_quick_long_context_benchmark_prints_both_tables(tmp_path):
    out = bench(tmp_path, 1200)
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| trained at")}
    assert list(rows) == list(VARIANTS)
    assert all("| yes |" in row for row in rows.values())  # every drafter's output equals greedy
    assert "| tau 0-2K |" in out
    [length] = [line for line in out.splitlines() if line.startswith("| 1024 |")]
    predicted, measured = (float(cell) for cell in length.split("|")[2:4])
    # the plan is generous at this tiny size (each process's measured resident baseline dominates): 1.44x
    # before the fused LM-head loss lowered the real peak, 1.53x after (2026-12-04); above 1.6 it has drifted
    assert 1 / 1.5 < predicted / measured < 1.6
    assert (tmp_path / "quick" / "table.md").read_text().strip() in out
    # a second run reads what the first kept (the target, seed 0's drafters) and trains only what is new:
    # another seed of one chosen drafter, beside the first seed's
    name = list(VARIANTS)[-1]
    other = bench(tmp_path, 1200, "--long_seed", "1", "--long_variants", name)
    assert other.count("trained trained") == 1 and f"trained {name}" in other and "| 1024 |" not in other
    assert (tmp_path / "quick" / "seed1" / "table.md").is_file() and "building the long target" not in other
