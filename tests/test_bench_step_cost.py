"""The step-cost benchmark through its real command line: one row per recipe and the plain loop, each part
timed, the parts adding up to the step, and the ratios against the paper's recipe and the plain loop."""

import subprocess
import sys

import pytest

from dflash_ddp.bench.step_cost import PARTS, RECIPES

pytestmark = pytest.mark.processes(background=True)  # untimed processes: the tables' figures

TIMEOUT_S = 1800  # only catches a hang


def test_the_step_cost_section_prints_every_recipes_parts_and_the_plain_loop():
    cmd = [
        sys.executable,
        "-m",
        "dflash_ddp.bench",
        "--only",
        "steps",
        "--cost_steps",
        "1",
        "--cost_tokens",
        "512",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        line.strip("| ").split(" | ") for line in result.stdout.splitlines() if line.startswith("| 512 |")
    ]
    assert [row[1] for row in rows] == [*RECIPES, "plain loop"]
    for row in rows[:-1]:
        total, parts = float(row[2]), [float(x) for x in row[3 : 3 + len(PARTS)]]
        assert all(p >= 0 for p in parts) and parts[PARTS.index("backward")] > 0
        assert abs(sum(parts) - total) <= 0.1 + 1e-3 * total  # the parts are the step, printed to 0.1 ms
        assert float(row[3 + len(PARTS) + 1]) > 0  # vs the plain loop
    assert rows[list(RECIPES).index("paper")][3 + len(PARTS)] == "1.00"  # the paper's recipe against itself
    assert float(rows[-1][2]) > 0
