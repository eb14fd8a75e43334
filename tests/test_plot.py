"""`python -m dflash_ddp.plot RUN_DIR`: PNGs from metrics.jsonl (and real tau where it was measured)."""

import json

import pytest

from dflash_ddp.observe.plot import PLOTS
from dflash_ddp.plot import main

pytest.importorskip("matplotlib", reason='the plots need the optional extra: pip install -e ".[plot]"')


def metrics_line(step: int, targets: int = 2) -> dict:
    """One metrics.jsonl record with the keys and shapes a split job's drafter leader writes."""
    return {
        "time": 1.5 * step,
        "loss": 6.0 - 0.1 * step,
        "accuracy": 0.05 + 0.01 * step,
        "tau_estimate": 1.0 + 0.05 * step,
        "accuracy_per_position": [0.06 + 0.01 * step, 0.05, 0.04],
        "step": step,
        "lr": 0.002,
        "grad_norm": 0.9,
        "epoch": 0,
        "tokens_seen": 4000 * step,
        "tokens_per_s": 2800.0 + step,
        "wait_fraction": 0.01,
        "hidden_state_bytes_per_s": 2.1e7,
        "outside_compute_fraction": 0.02,
        "target_send_wait_s": {str(r): 0.1 * step for r in range(targets)},
        "target_inflight": {str(r): (step + r) % 3 for r in range(targets)},
    }


def write_run(run_dir, steps=range(1, 11), targets=2):
    run_dir.mkdir(exist_ok=True)
    lines = [json.dumps(metrics_line(s, targets)) for s in steps]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_the_plot_command_writes_non_empty_pngs(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    (run / "eval.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "tau": 1.2 + 0.1 * s, "lossless": True, "tau_by_context": {"0-2K": 1.3}})
            + "\n"
            for s in (5, 10)
        )
    )
    (run / "eval.json").write_text(
        json.dumps({"dflash": {"tau": 2.06}, "tau_by_context": {"0-2K": 2.1, "2K-8K": 1.8}})
    )
    assert main([str(run)]) == 0
    for name in PLOTS:
        data = (run / f"{name}.png").read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, name
    # a colocated run (no target ranks) and a line a running job is still writing
    colocated = write_run(tmp_path / "colocated", targets=0)
    with (colocated / "metrics.jsonl").open("a") as f:
        f.write('{"time": 16.5, "loss": 5.')
    assert main([str(colocated), "--out", str(tmp_path / "plots")]) == 0
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert written == sorted(f"{n}.png" for n in PLOTS if n != "tau_by_context")  # nothing evaluated
    err = capsys.readouterr().err
    assert "metrics.jsonl:11: skipped an unreadable last line" in err
    assert "measured tau by context" in err


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 1
    assert "metrics.jsonl: no such file" in capsys.readouterr().err
    run = write_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    assert main([str(run)]) == 1
    assert "metrics.jsonl:2: not a JSON object" in capsys.readouterr().err
    write_run(run)
    (run / "eval.jsonl").write_text(json.dumps({"step": 5}) + "\n")
    assert main([str(run)]) == 1
    assert "eval.jsonl:1: no 'tau'" in capsys.readouterr().err


def test_the_final_tau_stands_at_the_step_it_measured_and_the_loss_is_named_as_trained(tmp_path):
    """A run resumed past its evaluated end keeps that end's eval.json: its tau belongs at its own step,
    not at the last logged one; the loss plot names the run's own weighting and loss."""
    from dflash_ddp.observe.plot import loss_name, real_tau, real_tau_by_context

    run = write_run(tmp_path / "run")
    (run / "eval.json").write_text(
        json.dumps({"step": 4, "dflash": {"tau": 1.15}, "tau_by_context": {"0-2K": 1.2}})
    )
    assert real_tau(run, last_step=10)[1] == (4, 1.15)
    assert real_tau_by_context(run, last_step=10) == [(4, {"0-2K": 1.2})]
    assert loss_name(run) == "the run's weighted objective"  # no config.json
    (run / "config.json").write_text(json.dumps({"position_weighting": "dpace", "loss": "ce"}))
    assert loss_name(run) == "dpace-weighted ce"
    # each family's own objective, not DFlash's
    (run / "config.json").write_text(json.dumps({"position_weighting": "dpace", "drafter": "dflash2"}))
    assert loss_name(run) == "dpace-weighted ce + the selector's CE"
    (run / "config.json").write_text(json.dumps({"position_weighting": "dpace", "drafter": "dspark"}))
    assert loss_name(run) == "dpace-weighted DSpark: 0.1 CE + 0.9 L1 + 1.0 confidence BCE"


@pytest.mark.parametrize("targets", [2, 0])
def test_the_pipeline_plot_calls_a_colocated_wait_the_targets_forward(tmp_path, targets):
    """Colocated, the drafter's 'wait' is its own process running the target, as the live line says."""
    from matplotlib.figure import Figure

    from dflash_ddp.observe.plot import draw

    records = [metrics_line(step, targets) for step in range(1, 11)]
    if not targets:  # a colocated run's records carry no target figures
        records = [{k: v for k, v in r.items() if not k.startswith("target_")} for r in records]
    figure = Figure()
    assert draw("pipeline", records, tmp_path, figure)
    colocated = "target forward (colocated: the drafter waits its turn)"
    assert figure.axes[0].get_title() == ("drafter waiting for batches" if targets else colocated)


def test_runs_of_two_recipes_are_put_side_by_side(tmp_path, capsys):
    """Two recipes' runs: a table of each one's recipe and last figures (real tau where measured) and the
    comparison PNGs; their losses, different objectives, are not compared."""
    dpace = write_run(tmp_path / "dpace_muon")
    (dpace / "config.json").write_text(
        json.dumps(
            {"drafter": "dflash", "position_weighting": "dpace", "optimizer": "muon", "learning_rate": 0.008}
        )
    )
    (dpace / "eval.jsonl").write_text(json.dumps({"step": 10, "tau": 1.94}) + "\n")
    dspark = write_run(tmp_path / "dspark", steps=range(1, 7))
    (dspark / "config.json").write_text(json.dumps({"drafter": "dspark", "optimizer": "adamw"}))
    with pytest.raises(SystemExit) as refused:  # one directory for the comparison
        main([str(dpace), str(dspark)])
    assert refused.value.code == 2
    assert "pass --out DIR" in capsys.readouterr().err
    assert main([str(dpace), str(dspark), "--out", str(tmp_path / "compared")]) == 0
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert table[0].split() == ["run", "recipe", "step", "accuracy", "tau~", "real", "tau", "(at", "step)"]
    assert table[1].split()[:6] == ["dpace_muon", "dflash,", "dpace,", "ce,", "muon", "0.008"]
    assert table[1].split()[-2:] == ["1.94", "(10)"] and table[2].split()[-2:] == ["not", "measured"]
    assert "losses are not compared" in captured.err
    for name in ("accuracy", "tau", "throughput"):
        assert (tmp_path / "compared" / f"compare_{name}.png").read_bytes().startswith(b"\x89PNG")
