"""The method benchmark: every variant on both targets through the real CLI, its table, its verdicts, and
its resume from the results kept on disk (the quick budget: a few steps, minutes in all)."""

import subprocess
import sys

from dflash_ddp.bench.method import VARIANTS, summarise

TIMEOUT_S = 1800  # only catches a hang


def result(variant: str, seed: int, tau: float) -> dict:
    return {"target": "t", "variant": variant, "seed": seed, "tau": tau, "lossless": True, "s_per_step": 1.0}


def test_a_variant_wins_only_when_its_worst_seed_beats_the_baselines_best():
    runs = [result("decay", s, t) for s, t in enumerate((1.50, 1.55, 1.60))]
    runs += [result("dpace", s, t) for s, t in enumerate((1.61, 1.70, 1.66))]
    runs += [result("decay-gamma2", s, t) for s, t in enumerate((1.40, 1.70, 1.65))]
    rows = {line.split(" | ")[1]: line for line in summarise(runs, ["t"])[2:]}
    assert "wins" in rows["dpace"] and "+" in rows["dpace"]
    assert "within the spread" in rows["decay-gamma2"]
    assert "1.550 (1.500-1.600)" in rows["decay"] and "3/3" in rows["decay"]


def test_quick_method_benchmark_runs_every_variant_on_both_targets_and_resumes(tmp_path):
    cmd = [sys.executable, "-m", "dflash_ddp.bench", "--method", "--quick", "--method_out", str(tmp_path)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert first.returncode == 0, first.stderr[-3000:]
    table = [line for line in first.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == 2 * len(VARIANTS)
    assert {row.split(" | ")[0][2:] for row in table} == {"embedded", "manpages"}
    assert all(" 1/1 " in row for row in table)  # every output equal to the target's greedy output
    results = sorted((tmp_path / "quick" / "results").rglob("seed0.json"))
    assert len(results) == 2 * len(VARIANTS)
    # a second run trains nothing: it reads the kept results (the runs are gone) and prints the same table
    subprocess.run(["rm", "-rf", str(tmp_path / "quick" / "runs")], check=True)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not (tmp_path / "quick" / "runs").exists()
    assert (tmp_path / "quick" / "table.md").read_text().splitlines()[2:] == table
