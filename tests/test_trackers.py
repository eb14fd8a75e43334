"""Experiment trackers (--report_to): what a short real run leaves in TensorBoard's event files and in wandb's
offline run, and refusals at start."""

import importlib.util
import json

import pytest

from dflash_ddp.config import parse_config
from dflash_ddp.observe.trackers import Trackers, resolve_report_to, scalars
from dflash_ddp.train import main

from helpers import train_flags

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason='tensorboard not installed: pip install -e ".[tensorboard]"',
)


def event_scalars(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def event_hparams(log_dir) -> dict:
    """The hyperparameters stored by add_hparams (in a sub-directory of the run's log directory)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    for sub in log_dir.iterdir():
        if sub.is_dir() and list(sub.glob("events.out.tfevents.*")):
            events = EventAccumulator(str(sub))
            events.Reload()
            content = events.PluginTagToContent("hparams").get("_hparams_/session_start_info")
            if content:
                info = HParamsPluginData.FromString(content).session_start_info
                return {
                    k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
                    for k, v in info.hparams.items()
                }
    return {}


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.mark.processes
@needs_tensorboard
def test_every_installed_tracker_gets_every_logged_metric_and_the_config(
    tiny_target, chat_data, tmp_path, monkeypatch
):
    """One short run with --report_to all (every installed tracker, as in Hugging Face): TensorBoard's event
    files hold each step's metrics and the config; wandb's offline run and MLflow's file store are checked
    when those packages are installed (they are not in the dev extra's CI install)."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # wandb: offline is the default, no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # a file store: no server
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    assert main(train_flags(tiny_target, chat_data, out, max_steps=3, report_to="all", run_name="r1")) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    logged = event_scalars(out / "tensorboard" / "r1")
    assert logged["loss"] == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
    positions = len(records[0]["accuracy_per_position"])  # block_size - 1 drafted positions
    group = {f"accuracy_per_position/pos_{i}" for i in range(1, positions + 1)}
    assert group <= logged.keys()
    last = logged["accuracy_per_position/pos_1"][3]
    assert last == pytest.approx(records[-1]["accuracy_per_position"][0], rel=1e-6)
    for key in ("tau_estimate", "lr", "grad_norm", "tokens_per_s", "wait_fraction", "tokens_seen"):
        assert set(logged[key]) == {1, 2, 3}, key
    assert "unix_time" in records[0] and "unix_time" not in logged  # the trackers stamp their own clock
    hparams = event_hparams(out / "tensorboard" / "r1")
    assert hparams["max_steps"] == 3 and hparams["report_to"] == '["all"]'
    assert hparams["target_model"] == str(tiny_target)

    if installed("wandb"):
        (run,) = (out / "wandb").glob("offline-run-*")
        data = next(run.glob("run-*.wandb")).read_bytes()  # wandb's record log of the run
        assert b"loss" in data and b"accuracy_per_position/pos_1" in data and b"learning_rate" in data
    if installed("mlflow"):
        (run,) = [p for p in (tmp_path / "mlruns").glob("*/*") if (p / "metrics").is_dir()]
        assert len((run / "metrics" / "loss").read_text().splitlines()) == 3
        assert (run / "params" / "max_steps").read_text() == "3"


def test_a_missing_tracker_package_is_refused_at_start_naming_the_extra(
    tiny_target, chat_data, tmp_path, monkeypatch, capsys
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    out = tmp_path / "run"
    assert main(train_flags(tiny_target, chat_data, out, report_to="wandb")) == 2
    err = capsys.readouterr().err
    assert 'error: --report_to wandb: the wandb package is not installed: pip install -e ".[wandb]"' in err
    assert not out.exists()  # refused before anything was loaded or written
    with pytest.raises(ValueError, match="--report_to all: no tracker package is installed"):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
        resolve_report_to(["all"])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tensorbord", "--report_to tensorbord: choose none, all, or any of"),
        ("none,wandb", "none cannot be combined"),
    ],
)
def test_report_to_values(value, message):
    with pytest.raises(ValueError, match=message):
        parse_config(["--target_model", "t", "--data", "d", "--report_to", value])


@needs_tensorboard
def test_a_tracker_that_cannot_start_stops_the_run_before_any_step(tiny_target, chat_data, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("not a directory")
    assert main(train_flags(tiny_target, chat_data, out, max_steps=2, report_to="tensorboard")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --report_to tensorboard: the tracker did not start (")
    assert 'pip install -e ".[tensorboard]"' in err[-1]
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


@needs_tensorboard
def test_evaluation_results_go_to_the_trackers(tmp_path):
    trackers = Trackers.start(["tensorboard"], "ev", tmp_path)
    result = {
        "step": 40,
        "tau": 2.5,
        "acceptance": [0.5, 0.3, 0.2],
        "lossless": True,
        "checkpoint": "step-40",
    }
    trackers.log_eval(43, result)  # an evaluation of step 40's checkpoint, arrived at step 43
    trackers.finish()
    logged = event_scalars(tmp_path / "tensorboard" / "ev")
    assert logged["eval/tau"] == {43: 2.5} and logged["eval/lossless"] == {43: 1.0}
    assert logged["eval/checkpoint_step"] == {43: 40}
    assert logged["eval/acceptance/3"] == {43: pytest.approx(0.2)}


@needs_tensorboard
def test_evaluations_that_arrive_after_training_are_sent_before_the_trackers_close(tmp_path):
    from dflash_ddp.observe.trackers import close_trackers

    trackers = Trackers.start(["tensorboard"], "late", tmp_path)
    trackers.log({"step": 20, "loss": 1.0})
    trackers.log_eval(20, {"step": 10, "tau": 1.5})  # seen during training
    evaluations = [{"step": 10, "tau": 1.5}, {"step": 20, "tau": 1.8, "accept_histogram": [3, 1]}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evaluations))
    close_trackers(trackers, tmp_path, {"dflash": {"tau": 1.9}, "lossless": True})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard" / "late"))
    events.Reload()
    sent = [e.value for e in events.Scalars("eval/checkpoint_step")]
    assert sent == [10, 20]  # step 10's evaluation was not sent twice
    logged = event_scalars(tmp_path / "tensorboard" / "late")
    assert logged["eval/tau"] == {20: pytest.approx(1.8)}
    assert logged["final_eval/dflash/tau"] == {20: pytest.approx(1.9)}
    assert logged["final_eval/lossless"] == {20: 1.0}


def test_records_become_flat_numbers():
    record = {
        "loss": 1.5,
        "accuracy_per_position": [0.5, 0.25],
        "target_inflight": {"0": 2, "1": 1},
        "warnings": ["drafter_waits"],
        "lossless": False,
    }
    assert scalars(record) == {
        "loss": 1.5,
        "accuracy_per_position/pos_1": 0.5,
        "accuracy_per_position/pos_2": 0.25,
        "target_inflight/0": 2,
        "target_inflight/1": 1,
        "lossless": 0.0,
    }
