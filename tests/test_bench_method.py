"""The method benchmark: every variant on both targets through the real CLI, its table, its verdicts, and
its resume from the results kept on disk (the quick budget: a few steps, minutes in all)."""

import subprocess
import sys

import pytest

from dflash_ddp.bench.method import STEP_SHARE, TRAINING, VARIANTS, summarise
from dflash_ddp.config import parse_config

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


def test_every_variant_is_settings_the_cli_accepts():
    # a misspelled setting would stop the full benchmark at that variant, an hour in
    for name, variant in VARIANTS.items():
        settings = {**TRAINING, **{k: v for k, v in variant.items() if k != STEP_SHARE}}
        cfg, _ = parse_config([x for k, v in settings.items() for x in (f"--{k}", str(v))])
        assert all(getattr(cfg, k) == v for k, v in settings.items()), name


@pytest.mark.processes(background=True)  # untimed: the table's figures
def test_quick_method_benchmark_runs_variants_on_both_targets_and_resumes(tmp_path):
    cmd = [sys.executable, "-m", "dflash_ddp.bench", "--method", "--quick", "--method_out", str(tmp_path)]
    first = subprocess.run(  # from elsewhere than the checkout: the package finds its own assets
        [*cmd, "--variants", "decay,dpace-tv"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    table = rows(first.stdout)
    assert len(table) == 4 and {row.split(" | ")[0][2:] for row in table} == {"embedded", "manpages"}
    assert all(" 1/1 " in row for row in table)  # every output equal to the target's greedy output
    soft = next(row for row in table if "dpace-tv" in row).split(" | ")
    base = next(row for row in table if "decay" in row).split(" | ")
    assert int(soft[7]) == int(base[7]) + 6 * 8  # the top 8 soft targets add 6 bytes each a token
    # a second run trains only what is new: the kept results stand in for the runs (deleted here), and the
    # table shows every variant measured so far on the targets asked for
    subprocess.run(["rm", "-rf", str(tmp_path / "quick" / "runs")], check=True)
    again = subprocess.run(
        [*cmd, "--variants", "decay,dpace-tv,dpace-anchors32", "--targets", "embedded"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    new_runs = sorted((tmp_path / "quick" / "runs").glob("*/*"))
    assert [(p.parent.name, p.name) for p in new_runs] == [("embedded", "dpace-anchors32")]
    embedded = [row for row in table if row.startswith("| embedded ")]
    assert len(rows(again.stdout)) == 3 and set(embedded) <= set(rows(again.stdout))
    # twice the anchors at equal wall time: 4 budget steps / 1.71 = 2 steps, trained and shown
    assert (new_runs[0] / "seed0" / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert all(row.split(" | ")[5] == "2" for row in rows(again.stdout) if "anchors32" in row)
    assert all(row.split(" | ")[5] == "4" for row in rows(again.stdout) if "anchors32" not in row)
    assert (tmp_path / "quick" / "table.md").read_text().splitlines()[2:] == rows(again.stdout)


def rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
