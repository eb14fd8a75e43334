"""Real tau during training: the evaluation watcher, eval.jsonl, `best`, and rotation keeping `best`."""

import shutil

import pytest
import torch

import dflash_ddp.evaluation.watch as watch_module
from dflash_ddp.checkpoint.evaluations import best_record, prune_evaluations, read_evaluations
from dflash_ddp.checkpoint.layout import read_best, resolve_checkpoint, write_best
from dflash_ddp.checkpoint.parts import model_parts
from dflash_ddp.checkpoint.writer import rotate_checkpoints, save_checkpoint
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.evaluation.watch import Evaluator, WatchSettings, watch
from dflash_ddp.train import main

from helpers import small_draft_config, train_flags

EVAL = {"eval_prompts": 2, "eval_max_new_tokens": 8}


@pytest.fixture(scope="module")
def short_run(tiny_target, chat_data, tmp_path_factory):
    """A finished 6-step run with checkpoints at steps 3 and 6 (not evaluated)."""
    out = tmp_path_factory.mktemp("watch") / "run"
    assert main(train_flags(tiny_target, chat_data, out, save_steps=3, max_steps=6)) == 0
    return out


@pytest.fixture(scope="module")
def evaluator(short_run, tiny_target, chat_data):
    """The target, prompts and greedy outputs, loaded once for the tests that call `watch` directly."""
    return Evaluator(settings(short_run, tiny_target, chat_data), print)


def settings(run, tiny_target, chat_data, **overrides) -> WatchSettings:
    values = dict(
        run_dir=run, target_model=str(tiny_target), data=str(chat_data), num_prompts=2, max_new_tokens=8
    )
    return WatchSettings(**{**values, "poll_s": 0.01, **overrides})


@pytest.fixture
def run(short_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(short_run, copy)
    return copy


def test_the_watcher_evaluates_each_checkpoint_writes_best_and_resumes(
    run, evaluator, tiny_target, chat_data
):
    lines = []
    assert watch(settings(run, tiny_target, chat_data), lines.append, evaluator) == 0
    records, bad = read_evaluations(run)
    assert bad == 0 and [r["step"] for r in records] == [3, 6]
    for r in records:
        assert r["lossless"] and r["prompts"] == 2 and r["total_steps"] == 6 and r["wall_s"] > 0
        assert r["tau"] >= 1 and sum(r["accept_histogram"]) == r["verify_steps"] > 0
    root = run / "checkpoints"
    assert read_best(root).name == best_record(records)["checkpoint"]
    assert (root / "latest").read_text().strip() == "step-00000006"  # untouched
    assert lines[-1].startswith("done: 2 checkpoint(s) evaluated")
    # run again: nothing left to evaluate, the run is finished, nothing appended
    assert watch(settings(run, tiny_target, chat_data), lines.append, evaluator) == 0
    assert len(read_evaluations(run)[0]) == 2


def test_eval_steps_and_until_step_choose_checkpoints(run, evaluator, tiny_target, chat_data):
    assert watch(settings(run, tiny_target, chat_data, eval_steps=6), print, evaluator) == 0
    assert [r["step"] for r in read_evaluations(run)[0]] == [6]
    (run / "eval.jsonl").unlink()
    assert watch(settings(run, tiny_target, chat_data, until_step=2), print, evaluator) == 0
    assert [r["step"] for r in read_evaluations(run)[0]] == [3]


def test_invalid_and_vanishing_checkpoints_are_skipped(run, evaluator, tiny_target, chat_data, monkeypatch):
    root = run / "checkpoints"
    weights = root / "step-00000003" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    (root / ".tmp-step-00000009-123").mkdir()  # a save in progress: never a step-NNNNNNNN name
    lines = []
    assert watch(settings(run, tiny_target, chat_data), lines.append, evaluator) == 0
    assert [r["step"] for r in read_evaluations(run)[0]] == [6]
    assert any("skipping invalid checkpoint step-00000003" in line and "sha256" in line for line in lines)
    assert read_best(root).name == "step-00000006"

    # rotation removes a checkpoint between the listing and the read: skipped with a note, never half-read
    (run / "eval.jsonl").unlink()
    real_read = watch_module.read_verified

    def rotated_first(path, names):
        if path.name == "step-00000003":
            shutil.rmtree(path)
        return real_read(path, names)

    monkeypatch.setattr(watch_module, "read_verified", rotated_first)
    lines.clear()
    assert watch(settings(run, tiny_target, chat_data), lines.append, evaluator) == 0
    assert [r["step"] for r in read_evaluations(run)[0]] == [6]
    assert any("step-00000003 was removed (rotation)" in line for line in lines)


def test_a_partial_last_line_is_dropped_and_later_lines_pruned_on_resume(
    run, evaluator, tiny_target, chat_data
):
    assert watch(settings(run, tiny_target, chat_data), print, evaluator) == 0
    with (run / "eval.jsonl").open("a") as f:
        f.write('{"step": 9, "ta')
    assert prune_evaluations(run, 3) == [f"{run / 'eval.jsonl'}: dropped 2 line(s) past step 3"]
    assert [r["step"] for r in read_evaluations(run)[0]] == [3]
    assert read_best(run / "checkpoints").name == "step-00000003"


def test_rotation_keeps_the_best_checkpoint_and_latest_moves_on(tmp_path):
    drafter = DFlashDraftModel(small_draft_config())
    optimizer = torch.optim.AdamW(drafter.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    root = tmp_path / "checkpoints"

    def save(step):
        state = {"global_step": step, "topology": {"drafter_ranks": 1}}
        parts = model_parts(drafter, optimizer, scheduler)
        save_checkpoint(tmp_path, step, parts, drafter.config, state, {0: {}}, save_total_limit=2)

    save(1)
    assert write_best(root, "step-00000001")
    for step in (2, 3, 4):
        save(step)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001", "step-00000003", "step-00000004"]
    assert resolve_checkpoint(tmp_path).name == "step-00000004"  # resume and `latest` as before
    assert write_best(root, "step-00000002") is False  # removed by rotation: `best` is not moved to it
    assert read_best(root).name == "step-00000001"
    assert write_best(root, "step-00000004")
    save(5)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000005"]
    # a run's last save kept 4 as best; its final evaluation then made 6 the best: the job's closing rotation
    # (train.py, after the watcher ends) removes 4, as the next save's would have
    save(6)
    assert write_best(root, "step-00000006")
    rotate_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000005", "step-00000006"]
    rotate_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000006"]


@pytest.mark.processes
def test_training_with_eval_steps_evaluates_in_the_background(tiny_target, chat_data, tmp_path, capsys):
    out = tmp_path / "run"
    flags = train_flags(tiny_target, chat_data, out, save_steps=2, max_steps=6, eval_steps=4, **EVAL)
    assert main([*flags, "--eval_data", str(chat_data)]) == 0
    records, _ = read_evaluations(out)
    assert [r["step"] for r in records] == [4, 6]  # multiples of 4, and the final step
    assert all(r["lossless"] for r in records)
    assert read_best(out / "checkpoints").name == best_record(records)["checkpoint"]
    printed = capsys.readouterr()
    assert "real tau per evaluated step: 4:" in printed.out
    assert "tau~ is estimated on the training batches" in printed.err
    assert "done: 2 checkpoint(s) evaluated" in (out / "eval_watch.log").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--eval_steps", "5"], "--eval_steps 5 is not a multiple of --save_steps 10"),
        (["--eval_steps", "10", "--eval_data", ""], "--eval_steps 10 needs --eval_data"),
    ],
)
def test_eval_steps_settings_are_checked(tiny_target, chat_data, tmp_path, capsys, extra, message):
    flags = train_flags(tiny_target, chat_data, tmp_path / "run", save_steps=10, eval_data=chat_data)
    assert main(flags + extra) == 2
    assert message in capsys.readouterr().err
