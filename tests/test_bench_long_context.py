"""The long-context benchmark (section (j)) through its CLI, at --quick: the long target built by the tool,
every drafter trained and decoded losslessly, tau by context bucket, and the plan against a measured run."""

import subprocess
import sys

from dflash_ddp.bench.long_context import VARIANTS


def test_the_quick_long_context_benchmark_prints_both_tables(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ddp.bench",
            "--only",
            "long_context",
            "--quick",
            "--long_out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        check=True,
    ).stdout
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| trained at")}
    assert list(rows) == list(VARIANTS)
    assert all("| yes |" in row for row in rows.values())  # every drafter's output equals greedy
    assert "| tau 0-2K |" in out
    [length] = [line for line in out.splitlines() if line.startswith("| 1024 |")]
    predicted, measured = (float(cell) for cell in length.split("|")[2:4])
    assert 1 / 1.5 < predicted / measured < 1.5
    assert (tmp_path / "quick" / "table.md").read_text().strip() in out
    # a second run reads what the first kept
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ddp.bench",
            "--only",
            "long_context",
            "--quick",
            "--long_out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "trained trained" not in again and "| 1024 |" in again
