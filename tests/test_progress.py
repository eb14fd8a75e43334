"""The live display's split warnings: the drafter waiting for features, the targets blocked on sends."""

import io
import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from dflash_ddp.observe import progress
from dflash_ddp.observe.progress import TrainingMonitor, pipeline_warnings, send_wait_fractions


def test_send_wait_fractions_per_target_from_cumulative_seconds():
    before = {"0": 2.0, "1": 5.0}
    now = {"0": 8.0, "1": 6.0, "2": 9.0}  # rank 2 first heard of in this window: no baseline yet
    assert send_wait_fractions(now, before, window_s=10.0) == pytest.approx({"0": 0.6, "1": 0.1})
    assert send_wait_fractions({"0": 30.0}, {"0": 0.0}, window_s=10.0) == {"0": 1.0}  # clock skew: capped


def test_warnings_fire_above_their_limits():
    assert pipeline_warnings(0.10, {"0": 0.5, "1": 0.5}) == {}
    assert set(pipeline_warnings(0.11, {})) == {"drafter_waits"}
    assert "add target ranks" in pipeline_warnings(0.11, {})["drafter_waits"]
    # the targets' mean decides: one target blocked most of the time and one hardly at all is not a surplus
    assert pipeline_warnings(0.0, {"0": 0.9, "1": 0.05}) == {}
    blocked = pipeline_warnings(0.0, {"0": 0.9, "1": 0.3})
    assert set(blocked) == {"targets_blocked"} and "rank: 0: 90%, 1: 30%" in blocked["targets_blocked"]
    assert "could train the drafter instead" in blocked["targets_blocked"]
    # one target rank has no rank to move: it waits for the drafter
    assert "its one target rank waits for it" in pipeline_warnings(0.0, {"0": 0.9})["targets_blocked"]
    # an active warning ends only below half its limit, not when the share hovers at it; but it does end
    # once the drafter is fed (real waits never reach 0)
    assert set(pipeline_warnings(0.06, {}, frozenset({"drafter_waits"}))) == {"drafter_waits"}
    assert pipeline_warnings(0.04, {}, frozenset({"drafter_waits"})) == {}
    assert pipeline_warnings(1e-5, {}, frozenset({"drafter_waits"})) == {}
    assert pipeline_warnings(0.0, {"0": 0.2}, frozenset({"targets_blocked"})) == {}


def record(step: int, wait: float, send_wait_s: dict | None) -> dict:
    r = {"step": step, "loss": 1.0, "accuracy": 0.5, "tau_estimate": 1.5, "wait_fraction": wait}
    if send_wait_s is not None:  # a split job; colocated records carry no target figures
        r |= {"target_send_wait_s": send_wait_s, "target_inflight": dict.fromkeys(send_wait_s, 1)}
        r["hidden_state_bytes_per_s"] = 0.0
    return r


@pytest.fixture
def clock(monkeypatch):
    """The monitor's clock, moved by hand: each logging window below lasts 10 s."""
    now = [0.0]
    monkeypatch.setattr(
        progress, "time", SimpleNamespace(perf_counter=lambda: now[0], time=lambda: 1.8e9 + now[0])
    )
    return now


def test_monitor_warns_once_per_condition_change_and_records_it(tmp_path, capsys, clock):
    monitor = TrainingMonitor(tmp_path, total_steps=60)
    windows = [  # (drafter wait, the two targets' cumulative send-wait seconds)
        (0.5, {"0": 1.0, "1": 1.0}),  # start-up window: not judged
        (0.3, {"0": 2.0, "1": 2.0}),  # drafter waits 30%
        (0.3, {"0": 3.0, "1": 3.0}),  # still: no second message
        (0.0, {"0": 10.0, "1": 9.0}),  # drafter fed; targets blocked 70% and 60%
        (0.0, {"0": 11.0, "1": 10.0}),  # balanced again
    ]
    for i, (wait, send_wait_s) in enumerate(windows, 1):
        clock[0] += 10.0
        monitor.log(record(10 * i, wait, send_wait_s))
    monitor.close()
    err = capsys.readouterr().err
    assert err.count("warning at step 20: the drafter waited 30%") == 1 and "warning at step 30" not in err
    assert err.count("step 40: the drafter waits less than 5% again") == 1
    assert err.count("warning at step 40: the target ranks were blocked on sends 65%") == 1
    assert err.count("step 50: the target ranks are blocked on sends less than 25% again") == 1
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["warnings"] for r in lines] == [
        [],
        ["drafter_waits"],
        ["drafter_waits"],
        ["targets_blocked"],
        [],
    ]
    assert lines[3]["target_send_wait_fraction"] == pytest.approx({"0": 0.7, "1": 0.6})


def test_the_last_window_resolves_nothing(tmp_path, capsys, clock):
    """The job winding down empties the queues: its last window is not news of a balanced split."""
    monitor = TrainingMonitor(tmp_path, total_steps=30)
    for step, wait in ((10, 0.5), (20, 0.3), (30, 0.0)):
        clock[0] += 10.0
        monitor.log(record(step, wait, {"0": step / 10, "1": step / 10}))
    monitor.close()
    err = capsys.readouterr().err
    assert "warning at step 20: the drafter waited 30%" in err and "again" not in err


def test_colocated_runs_get_no_split_warnings(tmp_path, capsys, clock):
    """Colocated, the drafter's 'wait' is the target's own forward: no target rank could be added."""
    monitor = TrainingMonitor(tmp_path, total_steps=20)
    for step in (10, 20):
        clock[0] += 10.0
        monitor.log(record(step, 0.9, None))
    err = capsys.readouterr().err
    assert "warning" not in err
    assert "target forward 90%" in err and "drafter waited" not in err  # not shown as a starved drafter
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("warnings" not in r for r in lines)


@pytest.mark.parametrize("columns", [100, 120])
def test_live_display_keeps_the_bar_and_every_figure_of_a_split_job(tmp_path, monkeypatch, columns):
    """On a terminal narrower than a 7-target job's figures, the bar, the times and every figure stay in view
    (the figures wrap below the bar instead of being cut)."""
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=columns, color_system=None)
    monkeypatch.setattr(progress, "Console", lambda **_: terminal)
    monkeypatch.setattr(progress.sys, "stderr", SimpleNamespace(isatty=lambda: True))
    monitor = TrainingMonitor(tmp_path, total_steps=10_000)
    seven = {str(rank): 1.0 for rank in range(7)}
    monitor.log(record(20, 0.12, seven) | {"tokens_per_s": 12345.0, "hidden_state_bytes_per_s": 2**30})
    monitor._progress.refresh()
    monitor.close()
    assert "step 20/10000" in screen.getvalue()
    shown = screen.getvalue().rsplit("step 20/10000", 1)[1]  # the last frame drawn
    text = " ".join(shown.split())
    assert "…" not in shown and "-:--:--" in shown
    for figure in ("loss 1.000", "tau~1.50", "12,345 tok/s", "drafter waited 12%", "1,024 MiB/s", "6:1"):
        assert figure in text, (figure, shown)


def test_a_quiet_monitor_shows_nothing_and_still_records(tmp_path, capsys, clock):
    """A benchmark printing its own table: no legend (it came once per timed run inside the table), no lines."""
    monitor = TrainingMonitor(tmp_path, total_steps=10, quiet=True)
    monitor.log(record(10, 0.5, None))
    monitor.close()
    assert capsys.readouterr().err == ""
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_one_window_spike_warns_and_ends_in_the_next(tmp_path, capsys, clock):
    """Targets stopped for a while (a paused rank, a long save): the drafter starves, then a target's send wait
    jumps for one window; each warning ends once its share falls, not at the end of the run."""
    monitor = TrainingMonitor(tmp_path, total_steps=60)
    windows = [
        (0.0, {"0": 1.0, "1": 1.0}),  # start-up
        (0.8, {"0": 1.0, "1": 1.0}),  # both targets stopped: the drafter starves
        (0.0, {"0": 21.0, "1": 6.5}),  # they resume: 20 s of one send counted in a 10 s window
        (1e-5, {"0": 21.5, "1": 7.0}),  # balanced again
        (1e-5, {"0": 22.0, "1": 7.5}),
    ]
    for i, (wait, send_wait_s) in enumerate(windows, 1):
        clock[0] += 10.0
        monitor.log(record(10 * i, wait, send_wait_s))
    monitor.close()
    err = capsys.readouterr().err
    assert (
        "warning at step 20: the drafter waited 80%" in err
        and "step 30: the drafter waits less than 5%" in err
    )
    assert "warning at step 30: the target ranks were blocked on sends" in err
    assert "step 40: the target ranks are blocked on sends less than 25% again" in err
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["warnings"] for r in lines] == [[], ["drafter_waits"], ["targets_blocked"], [], []]


def test_plain_log_lines_and_records_say_when(tmp_path, capsys, clock):
    """Under a scheduler (no terminal) each line gives the elapsed and remaining time; each record the wall
    clock beside the seconds since the process started."""
    monitor = TrainingMonitor(tmp_path, total_steps=1000, start_step=400)
    for step in (500, 600):
        clock[0] += 3600.0
        monitor.log(record(step, 0.0, None))
    monitor.close()
    err = capsys.readouterr().err
    assert "step 500/1000" in err and "1:00:00 elapsed, 5:00:00 left" in err
    assert "2:00:00 elapsed, 4:00:00 left" in err
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["time"], r["unix_time"]) for r in lines] == [(3600.0, 1.8e9 + 3600), (7200.0, 1.8e9 + 7200)]
