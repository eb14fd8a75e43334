"""Checkpoint files: the contract layout, corruption detection, refusals, pickles, a full disk, the CLI."""

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dflash_ddp.checkpoint.__main__ import main as checkpoint_main
from dflash_ddp.checkpoint.layout import read_latest
from dflash_ddp.checkpoint.manifest import verify_checkpoint, write_manifest
from dflash_ddp.checkpoint.parts import model_parts
from dflash_ddp.checkpoint.reader import read_tensor_file
from dflash_ddp.checkpoint.resume import RestoreError, find_checkpoint
from dflash_ddp.checkpoint.trainer_state import load_trainer_state
from dflash_ddp.checkpoint.writer import remove_leftovers, save_checkpoint
from dflash_ddp.config import TrainConfig
from dflash_ddp.files import SaveError
from dflash_ddp.setup.start import check_same_run
from dflash_ddp.train import main

from conftest import build_target
from helpers import train_flags


def args(tiny_target, chat_data, out, *extra):
    settings = {"save_steps": 3, "max_steps": 6, "save_total_limit": 5}
    return train_flags(tiny_target, chat_data, out, **settings) + list(extra)


@pytest.fixture
def finished_run(tiny_target, chat_data, tmp_path):
    out = tmp_path / "run"
    assert main(args(tiny_target, chat_data, out)) == 0
    return out


def _newest(out):
    return out / "checkpoints" / "step-00000006"


def _training_objects(ckpt):
    """A drafter of the checkpoint's shape with a fresh AdamW and a constant schedule, to save."""
    from dflash_ddp.drafter.model import DFlashDraftModel
    from dflash_ddp.drafter.zlab import from_zlab_config

    drafter = DFlashDraftModel(from_zlab_config(json.loads((ckpt / "config.json").read_text())))
    optimizer = torch.optim.AdamW(drafter.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return drafter, optimizer, scheduler


@pytest.mark.parametrize(
    "damage",
    ["truncate_weights", "flip_optimizer_byte", "remove_manifest"],
)
def test_corrupt_newest_checkpoint_is_reported_and_skipped(finished_run, damage):
    ckpt = _newest(finished_run)
    if damage == "truncate_weights":
        data = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "flip_optimizer_byte":
        data = bytearray((ckpt / "optimizer.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (ckpt / "optimizer.pt").write_bytes(bytes(data))
    else:
        (ckpt / "manifest.json").unlink()
    assert verify_checkpoint(ckpt)
    notes = []
    assert find_checkpoint(finished_run, "auto", notes.append).name == "step-00000003"
    assert any("skipping corrupt checkpoint step-00000006" in n for n in notes)


def test_half_written_temporary_directory_is_ignored(finished_run):
    tmp = finished_run / "checkpoints" / ".tmp-step-00000009-1234"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"partial")
    notes = []
    assert find_checkpoint(finished_run, "auto", notes.append).name == "step-00000006"
    assert any(".tmp-step-00000009" in n and "never completed" in n for n in notes)


def test_a_data_file_changed_since_the_checkpoint_is_named(tiny_target, chat_data, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    shutil.copy(chat_data, data)
    out = tmp_path / "run"
    assert main(args(tiny_target, data, out, "--max_steps", "2", "--save_steps", "2")) == 0
    before = data.stat().st_size
    with data.open("a") as f:
        f.write(data.read_text().splitlines()[0] + "\n")
    assert main(args(tiny_target, data, out, "--max_steps", "4", "--save_steps", "2")) == 2
    err = capsys.readouterr().err
    assert f"(data files changed: {data} {before} -> {data.stat().st_size} bytes)" in err


def test_no_valid_checkpoint_is_an_error(finished_run):
    for ckpt in (finished_run / "checkpoints").glob("step-*"):
        (ckpt / "manifest.json").unlink()
    with pytest.raises(ValueError, match="none of its 2 checkpoints verifies"):
        find_checkpoint(finished_run, "auto", print)


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("--mask_token_id", "5", "drafter"),
        ("--block_size", "8", "drafter"),
        ("--target_layer_ids", "0,1,2", "drafter"),
        ("--num_draft_layers", "2", "drafter"),
        ("--max_seq_len", "120", "fingerprints.data"),
    ],
)
def test_identity_changes_are_refused_naming_the_field(
    finished_run, tiny_target, chat_data, capsys, flag, value, field
):
    assert main(args(tiny_target, chat_data, finished_run, flag, value, "--max_steps", "9")) == 2
    err = capsys.readouterr().err
    assert "belongs to a different run" in err and field in err
    assert "pass the settings it was trained with to resume it, or another --output_dir for a new run" in err
    assert "(with --init_from " in err and "to start it from these weights, on other data" in err


def test_other_target_or_tokenizer_is_refused(finished_run):
    saved = load_trainer_state(_newest(finished_run))
    for key in ("target", "tokenizer", "data"):
        current = json.loads(json.dumps(saved))
        current["fingerprints"][key] = "something-else"
        with pytest.raises(ValueError, match=f"fingerprints.{key}: checkpoint"):
            check_same_run(saved, current, [], _newest(finished_run))


def test_a_checkpoint_from_before_an_objective_setting_resumes_with_the_setting_it_trained_with(finished_run):
    """Checkpoints written before --position_weighting, --loss, --target_topk, --ce_weight, --anchor_rule and
    --loss_gamma_start lack them: they trained with the decay (a constant one), the token's CE and response
    anchors, so a run that says so resumes and one that does not is told."""
    saved = load_trainer_state(_newest(finished_run))
    current = json.loads(json.dumps(saved))
    assert current["config"]["loss_gamma_start"] is None
    for key in (
        "position_weighting",
        "dpace_smoothing",
        "loss",
        "target_topk",
        "ce_weight",
        "anchor_rule",
        "loss_gamma_start",
    ):
        del saved["config"][key]
    current["config"].update(
        position_weighting="decay", loss="ce", target_topk=0, ce_weight=0.0, anchor_rule="response"
    )
    assert check_same_run(saved, current, [], _newest(finished_run)) == []
    current["config"].update(position_weighting="dpace", loss="tv", target_topk=8)
    with pytest.raises(
        ValueError, match="position_weighting: checkpoint 'decay', now 'dpace'; loss: checkpoint"
    ) as refused:
        check_same_run(saved, current, [], _newest(finished_run))
    assert "restore them with --position_weighting decay --loss ce --target_topk 0, or" in str(refused.value)
    accepted = check_same_run(
        saved, current, ["position_weighting", "loss", "target_topk"], _newest(finished_run)
    )
    assert "loss: 'ce' -> 'tv'" in accepted
    # a global batch the new drafter ranks cannot keep says what it is made of
    current["config"].update(position_weighting="decay", loss="ce", target_topk=0)
    current["config"]["global_batch"] = saved["config"]["global_batch"] + 1
    with pytest.raises(
        ValueError, match=r"global_batch: checkpoint \d+, now \d+ batches a step \(drafter ranks x"
    ):
        check_same_run(saved, current, [], _newest(finished_run))


def test_a_checkpoint_from_before_anchor_scaling_resumes_under_the_default_where_it_trains_alike(
    finished_run,
):
    """Such a checkpoint trained 0 (no scaling): today's default (3072) trains its sequences of at most
    --max_seq_len 3072 tokens alike, so it resumes; a longer --max_seq_len would scale, and is told."""
    saved = load_trainer_state(_newest(finished_run))
    current = json.loads(json.dumps(saved))
    del saved["config"]["anchor_scale_tokens"]
    current["config"]["anchor_scale_tokens"] = 3072
    assert current["config"]["max_seq_len"] <= 3072
    assert check_same_run(saved, current, [], _newest(finished_run)) == []
    for config in (saved["config"], current["config"]):
        config["max_seq_len"] = 8192
    with pytest.raises(ValueError, match="anchor_scale_tokens: checkpoint 0, now 3072"):
        check_same_run(saved, current, [], _newest(finished_run))


def test_a_checkpoint_from_before_the_optimizer_option_resumes_as_adamw_and_names_it(finished_run):
    """Checkpoints written before --optimizer trained with AdamW: resuming one with --optimizer adamw works,
    resuming it under today's default (Muon) is refused with the flag that continues it."""
    saved = load_trainer_state(_newest(finished_run))
    current = json.loads(json.dumps(saved))
    del saved["config"]["optimizer"]
    current["config"]["optimizer"] = "adamw"
    assert check_same_run(saved, current, [], _newest(finished_run)) == []
    current["config"]["optimizer"] = TrainConfig().optimizer
    with pytest.raises(ValueError, match="optimizer: checkpoint 'adamw', now 'muon'") as refused:
        check_same_run(saved, current, [], _newest(finished_run))
    assert "pass --optimizer adamw" in str(refused.value)


def test_a_checkpoint_from_before_the_orthogonalisation_option_resumes_with_torchs_and_names_it(finished_run):
    """Muon checkpoints written before --muon_orthogonalisation trained with torch's five Newton-Schulz
    iterations, the default: they resume with that, or with Polar Express when the user names the change
    (the state is the same); an AdamW checkpoint resumes whatever the setting, which trains nothing there."""
    saved = load_trainer_state(_newest(finished_run))
    del saved["config"]["muon_orthogonalisation"]
    saved["config"]["optimizer"] = "muon"
    current = json.loads(json.dumps(saved))
    current["config"]["muon_orthogonalisation"] = TrainConfig().muon_orthogonalisation
    assert check_same_run(saved, current, [], _newest(finished_run)) == []
    current["config"]["muon_orthogonalisation"] = "polar_express_3"
    with pytest.raises(
        ValueError, match="muon_orthogonalisation: checkpoint 'newton_schulz_5', now 'polar_express_3'"
    ) as refused:
        check_same_run(saved, current, [], _newest(finished_run))
    assert "--muon_orthogonalisation newton_schulz_5" in str(refused.value)
    accepted = check_same_run(saved, current, ["muon_orthogonalisation"], _newest(finished_run))
    assert accepted == ["muon_orthogonalisation: 'newton_schulz_5' -> 'polar_express_3'"]
    saved["config"]["optimizer"] = current["config"]["optimizer"] = "adamw"
    assert check_same_run(saved, current, [], _newest(finished_run)) == []


def test_a_setting_whose_part_is_off_now_is_no_change_on_resume(finished_run):
    """A value recorded before such settings were refused (or before the part it sets was turned off with
    --resume_override) does not trap the resume: the run refuses the flag that restores it, and without it
    the setting is idle, so neither its old nor its new value trains."""
    saved = load_trainer_state(_newest(finished_run))
    current = json.loads(json.dumps(saved))
    saved["config"] |= {"num_epochs": 3, "dpace_smoothing": 0.3}
    current["config"] |= {"num_epochs": 6, "dpace_smoothing": 0.5, "position_weighting": "decay"}
    assert current["config"]["max_steps"] != -1
    with pytest.raises(ValueError, match="position_weighting: checkpoint 'dpace', now 'decay'") as refused:
        check_same_run(saved, current, [], _newest(finished_run))
    assert "num_epochs" not in str(refused.value) and "dpace_smoothing" not in str(refused.value)
    accepted = check_same_run(saved, current, ["position_weighting"], _newest(finished_run))
    assert accepted == ["position_weighting: 'dpace' -> 'decay'"]
    current["config"]["position_weighting"] = "dpace"  # D-PACE on: its smoothing trains, and changed
    with pytest.raises(ValueError, match="dpace_smoothing: checkpoint 0.3, now 0.5"):
        check_same_run(saved, current, [], _newest(finished_run))


def test_optimisation_change_needs_an_override(finished_run, tiny_target, chat_data, capsys):
    assert (
        main(args(tiny_target, chat_data, finished_run, "--learning_rate", "1e-2", "--max_steps", "6")) == 2
    )
    assert "learning_rate: checkpoint 0.0006, now 0.01" in capsys.readouterr().err
    assert (
        main(
            args(
                tiny_target,
                chat_data,
                finished_run,
                "--learning_rate",
                "1e-2",
                "--resume_override",
                "learning_rate",
            )
        )
        == 0
    )
    assert "resume override accepted: learning_rate: 0.0006 -> 0.01" in capsys.readouterr().out
    # trained on with the change: its checkpoints, and the card of their export, say the first 6 steps
    # trained with the old rate
    more = ("--learning_rate", "1e-2", "--max_steps", "8", "--save_steps", "2", "--resume_override")
    assert main(args(tiny_target, chat_data, finished_run, *more, "learning_rate,max_steps")) == 0
    state = json.loads((finished_run / "checkpoints" / "step-00000008" / "trainer_state.json").read_text())
    changes = ["max_steps: 6 -> 8", "learning_rate: 0.0006 -> 0.01"]
    assert state["overrides"] == [{"step": 6, "changes": changes}]
    from dflash_ddp.serving.export import main as export_main

    assert export_main([str(finished_run), str(finished_run.parent / "export")]) == 0
    card = (finished_run.parent / "export" / "README.md").read_text()
    assert (
        "- the steps before step 6 trained with other settings, changed on resume: " + "; ".join(changes)
        in card
    )


def test_missing_trainer_state_field_is_an_error(finished_run):
    ckpt = _newest(finished_run)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["batches_consumed"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(ckpt, 6)  # a consistent manifest: the missing field itself must be refused
    with pytest.raises(ValueError, match="missing field\\(s\\) \\['batches_consumed'\\]"):
        load_trainer_state(ckpt)


def test_extra_or_missing_weight_keys_are_refused(finished_run, tiny_target, chat_data, capsys):
    from safetensors.torch import load_file, save_file

    ckpt = _newest(finished_run)
    state = load_file(ckpt / "model.safetensors")
    state["lm_head.weight"] = torch.zeros(2, 2)
    del state["norm.weight"]
    save_file(state, ckpt / "model.safetensors")
    write_manifest(ckpt, 6)  # a consistent manifest: the content itself must be refused
    more = ("--max_steps", "9", "--resume_override", "max_steps")
    assert main(args(tiny_target, chat_data, finished_run, *more)) == 2
    err = capsys.readouterr().err
    assert "missing ['norm.weight'], unexpected ['lm_head.weight']" in err and "Traceback" not in err


class _RunsCode:
    def __reduce__(self):
        return (exec, ("open('PWNED_MARKER', 'w').write('x')",))


def test_pickled_code_in_optimizer_state_is_refused_without_running(finished_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = _newest(finished_run)
    with (ckpt / "optimizer.pt").open("wb") as f:
        pickle.dump({"state": _RunsCode()}, f, protocol=2)
    write_manifest(ckpt, 6)
    with pytest.raises(ValueError, match="optimizer.pt: refused to load"):
        read_tensor_file(ckpt, "optimizer.pt")
    assert not (tmp_path / "PWNED_MARKER").exists()


def test_a_refused_pickle_in_a_real_resume_is_one_line_exit_2(
    finished_run, tiny_target, chat_data, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    ckpt = _newest(finished_run)
    with (ckpt / "optimizer.pt").open("wb") as f:
        pickle.dump({"state": _RunsCode()}, f, protocol=2)
    write_manifest(ckpt, 6)  # the manifest verifies: the refusal must come from the weights_only load
    more = ("--max_steps", "9", "--resume_override", "max_steps")
    assert main(args(tiny_target, chat_data, finished_run, *more)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimizer.pt: refused to load" in err[0], err
    assert "which this project never loads" in err[0] and "weights_only" not in err[0]  # not torch's offer
    assert not (tmp_path / "PWNED_MARKER").exists()


def test_a_failed_save_leaves_earlier_checkpoints_and_latest_intact(finished_run, monkeypatch):
    drafter, optimizer, scheduler = _training_objects(_newest(finished_run))

    def disk_full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(SaveError, match="saving checkpoint step-00000009 failed .*No space left.*intact"):
        save_checkpoint(
            finished_run, 9, model_parts(drafter, optimizer, scheduler), drafter.config, {}, {0: {}}, 5
        )
    root = finished_run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000006"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000003", "step-00000006"]
    # the first save of a run that fails says no checkpoint was saved, not that earlier ones are intact
    empty = finished_run.parent / "fresh_run"
    with pytest.raises(
        SaveError, match="saving checkpoint step-00000001 failed .*no checkpoint had been saved yet"
    ):
        save_checkpoint(empty, 1, model_parts(drafter, optimizer, scheduler), drafter.config, {}, {0: {}}, 5)
    monkeypatch.undo()
    # saved, every file is readable by the team (safetensors writes its own 0600)
    modes = {p.name: p.stat().st_mode & 0o777 for p in _newest(finished_run).iterdir() if p.is_file()}
    assert modes["model.safetensors"] == 0o644, modes
    assert all(verify_checkpoint(p) == [] for p in root.glob("step-*"))


def test_rotation_keeps_the_limit_and_the_resumed_checkpoint(tiny_target, chat_data, tmp_path, capsys):
    """Each removal is said on the save's line (a run's log tells where its older checkpoints went)."""
    out = tmp_path / "run"
    assert main(args(tiny_target, chat_data, out, "--save_steps", "1", "--save_total_limit", "2")) == 0
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000005", "step-00000006"]
    saved = [line for line in capsys.readouterr().err.splitlines() if line.startswith("saved ")]
    assert len(saved) == 6 and "removed" not in saved[1]
    assert saved[2].endswith("; removed step-00000001 (--save_total_limit 2)")
    assert saved[5].endswith("; removed step-00000004 (--save_total_limit 2)")
    capsys.readouterr()
    resumed = out / "checkpoints" / "step-00000005"
    assert (
        main(
            args(
                tiny_target,
                chat_data,
                out,
                "--save_steps",
                "1",
                "--save_total_limit",
                "2",
                "--max_steps",
                "9",
                "--resume",
                str(resumed),
                "--resume_override",
                "max_steps",
            )
        )
        == 0
    )
    names = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert names == ["step-00000005", "step-00000008", "step-00000009"]


@pytest.mark.processes
def test_inspect_and_verify_cli(finished_run, capsys):
    run = [sys.executable, "-m", "dflash_ddp.checkpoint"]  # the module's entry point, once
    shown = subprocess.run([*run, "inspect", str(finished_run)], capture_output=True, text=True)
    assert (
        shown.returncode == 0 and "step         6" in shown.stdout and "manifest     verified" in shown.stdout
    )
    assert checkpoint_main(["verify", str(_newest(finished_run))]) == 0
    (_newest(finished_run) / "scheduler.pt").write_bytes(b"garbage")
    capsys.readouterr()
    assert checkpoint_main(["verify", str(_newest(finished_run))]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert checkpoint_main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: ")


def test_resuming_an_earlier_checkpoint_sets_later_ones_aside(finished_run, tiny_target, chat_data, capsys):
    root = finished_run / "checkpoints"
    early = root / "step-00000003"
    assert main(args(tiny_target, chat_data, finished_run, "--max_steps", "5", "--save_steps", "1",
                     "--resume", str(early), "--resume_override", "max_steps")) == 0  # fmt: skip
    assert "moved step-00000006 to" in capsys.readouterr().out
    assert sorted(p.name for p in root.glob("step-*")) == [f"step-0000000{i}" for i in (3, 4, 5)]
    assert [p.name[:13] for p in (root / "abandoned").iterdir()] == ["step-00000006"]  # kept, not deleted
    assert (root / "latest").read_text().strip() == "step-00000005"
    # a later automatic resume continues this run's own newest checkpoint, not the abandoned step 6
    assert find_checkpoint(finished_run, "auto", print) == root / "step-00000005"


def test_the_data_cursor_stays_exact_after_an_accepted_change_of_global_batch(
    tiny_target, chat_data, tmp_path
):
    out = tmp_path / "run"
    assert (
        main(args(tiny_target, chat_data, out, "--max_steps", "4", "--gradient_accumulation_steps", "2")) == 0
    )
    state = load_trainer_state(out / "checkpoints" / "step-00000003")
    assert state["batches_consumed"] == 6
    more = [
        "--max_steps",
        "6",
        "--gradient_accumulation_steps",
        "1",
        "--resume_override",
        "global_batch",
        "max_steps",
    ]
    assert main(args(tiny_target, chat_data, out, *more)) == 0
    # 8 batches by step 4 (2 per step), then 1 per step: 10 at step 6, not 6 x 1
    assert load_trainer_state(out / "checkpoints" / "step-00000006")["batches_consumed"] == 10


def test_a_target_with_the_same_config_but_other_weights_is_refused(
    finished_run, tiny_target, chat_data, tmp_path, capsys
):
    other = tmp_path / "retrained_target"
    shutil.copytree(tiny_target, other)
    config = json.loads((tiny_target / "config.json").read_text())
    build_target(other, vocab_size=config["vocab_size"], seed=1)  # same architecture, other weights
    assert (other / "config.json").read_text() == (tiny_target / "config.json").read_text()
    assert main(args(other, chat_data, finished_run)) == 2
    assert "fingerprints.target: checkpoint" in capsys.readouterr().err


@pytest.mark.processes
def test_latest_is_only_followed_to_a_checkpoint_beside_it(finished_run):
    root = finished_run / "checkpoints"
    for content in ("../../elsewhere\n", "/etc\n", "", "step-00000003/..\n", "step-00000009\n"):
        (root / "latest").write_text(content)
        warnings = []
        assert read_latest(root, warnings.append) is None
        assert len(warnings) == 1 and "ignoring" in warnings[0] and "newest valid checkpoint" in warnings[0]
    shown = subprocess.run(
        [sys.executable, "-m", "dflash_ddp.checkpoint", "inspect", str(finished_run)],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0 and f"checkpoint   {root / 'step-00000006'}" in shown.stdout
    assert "warning: ignoring" in shown.stderr


def test_a_failed_rotation_is_a_save_error_naming_the_complete_checkpoint(finished_run, monkeypatch):
    from dflash_ddp.checkpoint import writer

    ckpt = _newest(finished_run)
    drafter, optimizer, scheduler = _training_objects(ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text()) | {"global_step": 9}

    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(writer.shutil, "rmtree", refuse)
    with pytest.raises(
        SaveError, match="removing old checkpoints after saving step-00000009 failed .*Permission"
    ):
        save_checkpoint(
            finished_run, 9, model_parts(drafter, optimizer, scheduler), drafter.config, state, {0: {}}, 1
        )
    assert (finished_run / "checkpoints" / "latest").read_text().strip() == "step-00000009"
    assert verify_checkpoint(finished_run / "checkpoints" / "step-00000009") == []


def test_leftovers_of_killed_saves_are_cleared_and_a_set_aside_only_copy_moved_back(finished_run):
    root = finished_run / "checkpoints"
    # killed between the two renames of a second save of step 6: its only copy is the set-aside one
    os.replace(root / "step-00000006", root / ".stale-step-00000006-7")
    shutil.copytree(root / "step-00000003", root / ".stale-step-00000003-8")  # its step exists: a leftover
    (root / ".tmp-step-00000009-7").mkdir()
    (root / ".latest-7").write_text("step-000")
    notes = remove_leftovers(finished_run)
    assert any("moved .stale-step-00000006-7 back to step-00000006" in n for n in notes)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000003", "step-00000006"]
    assert verify_checkpoint(root / "step-00000006") == []


def test_snapshots_reuse_host_buffers_and_write_the_same_files(tmp_path):
    """A writer's second save refills the host buffers of its first (no new allocation per save), and the
    files equal those of a save into fresh memory."""
    from dflash_ddp.checkpoint.writer import HostStaging, snapshot, write_checkpoint
    from dflash_ddp.drafter.model import DFlashDraftModel

    from helpers import small_draft_config

    torch.manual_seed(0)
    drafter = DFlashDraftModel(small_draft_config())
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def train_one_step():
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.randn_like(p)
        optimizer.step()

    def tensors(snap):
        found = []
        for part in (
            snap.parts["model.safetensors"][1],
            snap.parts["optimizer.pt"][1]["state"],
            snap.rng_states,
        ):
            stack = [part]
            while stack:
                item = stack.pop()
                if isinstance(item, torch.Tensor):
                    found.append(item)
                elif isinstance(item, dict):
                    stack.extend(item.values())
        return found

    staging, state, rng = HostStaging(), {"tokens_seen": 0}, {0: {"torch": torch.get_rng_state()}}
    train_one_step()
    parts = model_parts(drafter, optimizer, scheduler)
    first = snapshot(1, parts, drafter.config, state, rng, staging)  # kept alive: no address reuse
    train_one_step()
    second = snapshot(2, parts, drafter.config, state, rng, staging)
    assert [t.data_ptr() for t in tensors(second)] == [t.data_ptr() for t in tensors(first)]
    reused = write_checkpoint(tmp_path / "reused", second, 2)
    fresh = save_checkpoint(tmp_path / "fresh", 2, parts, drafter.config, state, rng, 2)
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng-rank0.pt", "manifest.json"):
        assert (reused / name).read_bytes() == (fresh / name).read_bytes(), name


def test_muon_and_soft_targets_resume_exactly_and_the_optimizer_cannot_change(
    tiny_target, chat_data, tmp_path, capsys
):
    """--optimizer muon (Muon with AdamW, two states in one optimizer file) with D-PACE and TV against soft
    targets: resuming step 3 trains the step 6 of the uninterrupted run, bit for bit; resuming it as AdamW is
    refused, naming both optimizers."""
    out = tmp_path / "run"
    method = ["--optimizer", "muon", "--position_weighting", "dpace", "--loss", "tv", "--target_topk", "4"]
    assert main(args(tiny_target, chat_data, out, *method)) == 0
    root = out / "checkpoints"
    uninterrupted = load_file(root / "step-00000006" / "model.safetensors")
    assert set(read_tensor_file(root / "step-00000006", "optimizer.pt")) == {"muon", "adamw"}
    assert main(args(tiny_target, chat_data, out, *method, "--resume", str(root / "step-00000003"))) == 0
    resumed = load_file(root / "step-00000006" / "model.safetensors")
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    capsys.readouterr()
    assert (
        main(args(tiny_target, chat_data, out, *method[2:], "--optimizer", "adamw", "--max_steps", "9")) == 2
    )
    assert "optimizer: checkpoint 'muon', now 'adamw'" in capsys.readouterr().err


class _Counter:
    """A stand-in for a new stateful part (an EMA of the weights, say): tensors and a plain number."""

    def __init__(self):
        self.value, self.updates = torch.zeros(3), 0

    def state_dict(self) -> dict:
        return {"value": self.value.clone(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.updates = state["value"].clone(), state["updates"]


def test_a_new_stateful_part_is_one_registration_and_resumes_exactly(tmp_path):
    from test_trainer import random_batch, small_trainer

    from dflash_ddp.checkpoint.parts import StatefulPart
    from dflash_ddp.checkpoint.trainer_state import restore_training, trainer_parts, trainer_state
    from dflash_ddp.checkpoint.writer import rng_state
    from dflash_ddp.parallel.topology import Topology

    def registered(trainer, counter):  # the one registration a new part takes
        return [
            *trainer_parts(trainer),
            StatefulPart("counter.pt", counter.state_dict, counter.load_state_dict),
        ]

    torch.manual_seed(0)  # the trainers' made-up target head (the frozen target's, not in the checkpoint)
    trained, counter = small_trainer(lazy_checks=False), _Counter()
    trained.step(random_batch(0))
    counter.value, counter.updates = torch.tensor([1.5, -2.0, 3.25]), 7
    cursor = {"global_step": 1, "epoch": 0, "batches_consumed": 1, "tokens_seen": 87}
    identity = {"config": {}, "fingerprints": {"target": "t", "tokenizer": "k", "data": "d"}, "drafter": {}}
    state = trainer_state(identity, Topology(1, 0, 1), cursor, 10)
    parts = registered(trained, counter)
    ckpt = save_checkpoint(tmp_path, 1, parts, trained.drafter.config, state, {0: rng_state()}, 3)
    assert verify_checkpoint(ckpt) == [] and (ckpt / "counter.pt").is_file()  # saved and in the manifest

    torch.manual_seed(0)
    resumed, restored = small_trainer(lazy_checks=False), _Counter()
    assert restore_training(ckpt, resumed, 0, 1, registered(resumed, restored)) == 87
    assert torch.equal(restored.value, counter.value) and restored.updates == 7
    for a, b in zip(trained.drafter.parameters(), resumed.drafter.parameters(), strict=True):
        assert torch.equal(a, b)
    trained.step(random_batch(1))  # the next step is the same step
    resumed.step(random_batch(1))
    for a, b in zip(trained.drafter.parameters(), resumed.drafter.parameters(), strict=True):
        assert torch.equal(a, b)

    (ckpt / "counter.pt").write_bytes(b"not a torch file")  # a damaged part is named, like every other
    with pytest.raises(RestoreError, match="counter.pt: size or sha256 does not match the manifest"):
        restore_training(ckpt, resumed, 0, 1, registered(resumed, _Counter()))


def test_the_checkpoint_records_how_the_drafter_ran(finished_run):
    """The plan's execution (on a CPU with room: nothing recomputed) is in trainer_state.json; a resume may
    run another (it changes no result beyond rounding), so it is recorded, not compared."""
    saved = load_trainer_state(_newest(finished_run))
    assert saved["execution"] == {
        "recompute": "none",
        "gradient_checkpointing": False,
        "loss_chunk_size": 1024,
    }
    current = json.loads(json.dumps(saved))
    current["execution"] = {"recompute": "qkv_mlp", "gradient_checkpointing": True, "loss_chunk_size": 8192}
    assert check_same_run(saved, current, [], _newest(finished_run)) == []


def test_the_rate_logged_after_a_schedule_override_is_the_one_the_step_used(
    finished_run, tiny_target, chat_data
):
    """--max_steps raised on resume (--resume_override max_steps): step 7 trains at the new schedule's rate;
    it was logged as the old schedule's last (0.0 where it had decayed to its end)."""
    assert (
        main(args(tiny_target, chat_data, finished_run, "--max_steps", "9", "--resume_override", "max_steps"))
        == 0
    )
    lines = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["lr"] for r in lines}
    assert rates[7] > rates[8] > 0, rates


def test_resuming_a_drafter_from_elsewhere_names_init_from(tmp_path):
    """A SpecForge checkpoint (config.json and weights, no manifest or trainer_state.json) given to --resume
    is no checkpoint of this project; the refusal says --init_from starts a run from its weights."""
    other = tmp_path / "epoch_0_step_10"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(
        ValueError, match=r"no manifest.json .*a drafter from elsewhere, whose weights --init_from"
    ):
        find_checkpoint(tmp_path / "run", str(other), print)
