"""Where training starts, agreed by every rank: fresh or resumed (and whether the checkpoint belongs to this
run: target, tokenizer, data, drafter shape and DFlash settings must match, optimisation settings only
change when named in --resume_override), and the run's records pruned back to that step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_ddp.checkpoint.layout import checkpoint_name, resolve_checkpoint
from dflash_ddp.checkpoint.resume import find_checkpoint
from dflash_ddp.checkpoint.trainer_state import load_trainer_state
from dflash_ddp.checkpoint.writer import set_aside_later
from dflash_ddp.config import RESUME_OVERRIDABLE
from dflash_ddp.files import atomic_write_text
from dflash_ddp.parallel.topology import DistributedContext, Topology
from dflash_ddp.setting_checks import idle_settings
from dflash_ddp.setup.run import Run


def decide_start(run: Run, topology: Topology) -> list[str]:
    """On the leader: find the checkpoint to resume from and check it belongs to this run.

    Sets run.start_step / run.resume_from; returns lines to print (skipped checkpoints, overrides).
    """
    notes: list[str] = []
    path = find_checkpoint(run.cfg.output_dir, run.cfg.resume, notes.append)
    if path is None:
        return notes
    saved = load_trainer_state(path)
    saved_batch, drafters = saved["config"].get("global_batch"), topology.num_drafters
    if (
        isinstance(saved_batch, int)
        and saved_batch != run.identity["config"]["global_batch"]
        and "global_batch" not in run.cfg.resume_override
        and saved_batch % drafters == 0
    ):  # another number of drafter ranks: keep the global batch by changing the accumulation
        run.set_accumulation(saved_batch // drafters, topology)
        notes.append(
            f"keeping the checkpoint's global batch of {saved_batch} batches: {drafters} drafter rank(s) x "
            f"--gradient_accumulation_steps {run.cfg.gradient_accumulation_steps}"
        )
    accepted = check_same_run(saved, run.identity, run.cfg.resume_override, path)
    notes += [f"resume override accepted: {change}" for change in accepted]
    # kept in every later checkpoint: the steps before a change trained with the old values (the card says so)
    history = list(saved.get("overrides", []))
    if accepted and saved["global_step"]:
        history.append({"step": int(saved["global_step"]), "changes": accepted})
    run.identity = run.identity | {"overrides": history}
    notes += keep_the_start(saved.get("init_from"), run, path)
    if saved["global_step"] > run.schedule.total_steps:
        raise ValueError(
            f"{path} is at step {saved['global_step']}, past this run's {run.schedule.total_steps} steps"
        )
    run.start_step, run.first_batch, run.resume_from = (
        int(saved["global_step"]),
        int(saved["batches_consumed"]),
        path,
    )
    notes += set_aside_later(run.cfg.output_dir, path, run.start_step)
    was, tp = saved["topology"], saved["topology"].get("target_tp_size", 1)
    notes.append(
        f"resuming from {path} (step {run.start_step}, batch {run.first_batch}; saved as "
        f"{was['target_ranks']}+{was['drafter_ranks']}{_in_groups(tp)}, now "
        f"{topology.num_targets}+{topology.num_drafters}{_in_groups(topology.tp_size)})"
    )
    return notes


def _in_groups(tp_size: int) -> str:
    return f" (tensor-parallel groups of {tp_size})" if tp_size > 1 else ""


def check_same_data(ctx: DistributedContext, run: Run) -> None:
    """Every rank must train on the same tokenized data: compare the data fingerprints of all ranks."""
    if ctx.topology.colocated:
        return
    mine = torch.tensor([int(run.identity["fingerprints"]["data"][:15], 16)], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(ctx.topology.world_size)]
    dist.all_gather(everyone, mine)
    values = [int(t) for t in everyone]
    if len(set(values)) > 1:
        groups = {value: [r for r, v in enumerate(values) if v == value] for value in dict.fromkeys(values)}
        described = "; ".join(f"ranks {ranks} have data {value:015x}" for value, ranks in groups.items())
        raise ValueError(
            f"the ranks tokenized different data ({described}): every rank must see the same --data files, "
            "tokenizer, template and settings"
        )


def share_start(ctx: DistributedContext, run: Run, error: str | None) -> None:
    """Every rank learns the leader's decision (start step and accumulation, or that the run must stop)."""
    topo = ctx.topology
    if topo.colocated:
        if error:
            raise ValueError(error)
        return
    resumed = run.resume_from is not None  # at step 0 too: a --max_steps 0 run's checkpoint
    decision = torch.tensor(
        [run.start_step, 1 if error else 0, run.cfg.gradient_accumulation_steps, run.first_batch, resumed],
        dtype=torch.int64,
    )
    dist.broadcast(decision, src=topo.drafter_ranks[0])
    if int(decision[1]):
        raise ValueError(error or f"rank {topo.drafter_ranks[0]} refused to start (see its message)")
    if int(decision[2]) != run.cfg.gradient_accumulation_steps:
        run.set_accumulation(int(decision[2]), topo)
    run.start_step, run.first_batch = int(decision[0]), int(decision[3])
    if int(decision[4]) and not topo.is_leader:  # other drafter ranks read the same checkpoint
        resume = run.cfg.resume
        run.resume_from = (
            resolve_checkpoint(Path(resume))  # a run directory or its checkpoints/: the one `latest` names
            if resume not in ("auto", "never")
            else Path(run.cfg.output_dir) / "checkpoints" / checkpoint_name(run.start_step)
        )


def prune_metrics(output_dir: str, start_step: int) -> list[str]:
    """Drop metrics.jsonl lines after the resume point (a killed run may have logged past its checkpoint)
    and lines that do not parse (a power loss or full disk during an append leaves a partial last line);
    the kept lines are rewritten atomically (only when that changes the file). Returns lines to print."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    raw = path.read_bytes()
    kept, dropped = [], []
    for number, line in enumerate(raw.decode(errors="replace").splitlines(), 1):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            dropped.append(number)
            continue
        if isinstance(step, int) and step <= start_step:
            kept.append(line)
    text = "".join(line + "\n" for line in kept)
    if text.encode() != raw:
        atomic_write_text(path, text)
    if not dropped:
        return []
    return [
        f"{path}: dropped {len(dropped)} unreadable line(s) (line {', '.join(map(str, dropped[:5]))}), "
        "left by an interrupted append"
    ]


# Settings whose change makes the checkpoint belong to a different run: never overridable.
IDENTITY = (
    "fingerprints.target",
    "fingerprints.target_commit",
    "fingerprints.tokenizer",
    "fingerprints.data",
    "drafter",
)
# How many steps the run trains: free to change from a checkpoint of step 0 (what --max_steps 0 saves).
SCHEDULE_LENGTH = ("max_steps", "num_epochs")
# Identity fields that checkpoints written before them lack, and the value they stand for there: those
# checkpoints were trained from a local directory.
ADDED_LATER = {"fingerprints.target_commit": None}
# Settings that checkpoints written before them lack, and the value those runs trained with.
SETTINGS_ADDED_LATER = {
    "position_weighting": "decay",
    "loss_gamma_start": None,
    "dpace_smoothing": 0.5,
    "loss": "ce",
    "target_topk": 0,
    "ce_weight": 0.0,
    "anchor_rule": "response",
    "anchor_scale_tokens": 0,
    "optimizer": "adamw",
    "selector_loss_alpha": 1.0,
    "muon_orthogonalisation": "newton_schulz_5",
}


def keep_the_start(saved: dict | None, run: Run, where: Path) -> list[str]:
    """A resumed run goes on from its checkpoint's weights, so the drafter it started from stays what its
    checkpoints record. --init_from naming another source (or one for a run that started fresh) would be
    ignored, so it is refused; naming the same one is said to change nothing."""
    current = run.identity.get("init_from")
    run.identity = run.identity | {"init_from": saved}
    if current is None:
        return []
    if saved is None or current.get("sha256") != saved.get("sha256"):
        began = f"from {saved['source']}" if saved else "from a fresh drafter (no --init_from)"
        raise ValueError(
            f"{where}: this run started {began}; --init_from {current['source']} sets the start of a new run: "
            "drop it to resume this one, or pass another --output_dir"
        )
    return [
        f"--init_from {current['source']}: this run's start already; it resumes from its checkpoint's weights"
    ]


def _trains_as(config: dict, key: str):
    """A setting's value as training sees it: anchors scale only in sequences longer than
    --anchor_scale_tokens, so with --max_seq_len no longer than that every value trains like 0 (a run from
    before the setting, or before its default, resumes with today's default)."""
    value = config[key]
    if key == "anchor_scale_tokens" and value >= config.get("max_seq_len", 0):
        return 0
    return value


def _lookup(data: dict, dotted: str):
    if dotted in ADDED_LATER and dotted.split(".")[-1] not in data.get(dotted.split(".")[0], {}):
        return ADDED_LATER[dotted]
    for part in dotted.split("."):
        data = data[part]
    return data


def _differences(key: str, saved, current) -> list[str]:
    """'key: checkpoint X, now Y' for each leaf that differs (a drafter's config: only the fields that do)."""
    if not (isinstance(saved, dict) and isinstance(current, dict)):
        return [f"{key}: checkpoint {saved!r}, now {current!r}"]
    absent = "(absent)"
    return [
        line
        for name in sorted(set(saved) | set(current))
        if saved.get(name, absent) != current.get(name, absent)
        for line in _differences(f"{key}.{name}", saved.get(name, absent), current.get(name, absent))
    ]


# why a resume with another number of drafter ranks can be refused: the accumulation keeps the checkpoint's
# global batch only where the new number of ranks divides it
GLOBAL_BATCH_NOTE = (
    " batches a step (drafter ranks x --gradient_accumulation_steps; these drafter ranks do not divide the "
    "checkpoint's: resume with a number of drafter ranks that does)"
)


def changed_inputs(saved: dict, current: dict) -> str:
    """Which data files a changed data fingerprint comes from, by their sizes ('' where the data is the same,
    or a checkpoint written before the sizes were kept)."""
    was, now = saved.get("data_files"), current.get("data_files")
    if not was or not now or _lookup(saved, "fingerprints.data") == _lookup(current, "fingerprints.data"):
        return ""
    changes = [
        f"{name} {'added' if name not in was else 'gone' if name not in now else f'{was[name]} -> {now[name]} bytes'}"
        for name in sorted(set(was) | set(now))
        if was.get(name) != now.get(name)
    ]
    return f" (data files changed: {'; '.join(changes) or 'the same sizes, other bytes'})"


def check_same_run(saved: dict, current: dict, overrides: list[str], where: Path) -> list[str]:
    """Compare a checkpoint's state with this run's; returns the overridden changes, raises on the rest.

    Both dicts have the trainer_state layout; `current["config"]` also carries `global_batch`.
    """
    family, now = saved["config"].get("drafter", "dflash"), current["config"].get("drafter", "dflash")
    if family != now:  # said as the flag, before the drafter configs' field by field differences
        raise ValueError(
            f"{where}: --drafter: checkpoint {family!r}, now {now!r}; a drafter cannot resume as another family: "
            f"pass --drafter {family} to resume it, or start a new run in another --output_dir with --init_from "
            f"{where} (it grows the drafter into the new family, or drops the parts the family lacks)"
        )
    identity = [
        difference
        for key in IDENTITY
        if _lookup(saved, key) != _lookup(current, key)
        for difference in _differences(key, _lookup(saved, key), _lookup(current, key))
    ]
    if identity:
        moved = _lookup(saved, "fingerprints.target_commit")
        hint = (
            f" (the target's hub revision now resolves to another commit; to go on with the one trained on, "
            f"pass --target_model {current['config']['target_model'].partition('@')[0]}@{moved})"
            if moved and moved != _lookup(current, "fingerprints.target_commit")
            else "; pass the settings it was trained with to resume it, or another --output_dir for a new run "
            f"(with --init_from {where} to start it from these weights, on other data)"
        )
        raise ValueError(
            f"{where} belongs to a different run: "
            + "; ".join(identity)
            + changed_inputs(saved, current)
            + hint
        )
    # optimisation settings: a change is refused unless the user names it in --resume_override
    saved = saved | {"config": SETTINGS_ADDED_LATER | saved["config"]}
    old_optimizer, optimizer = saved["config"]["optimizer"], current["config"]["optimizer"]
    if old_optimizer != optimizer:
        raise ValueError(
            f"{where}: optimizer: checkpoint {old_optimizer!r}, now {optimizer!r}; an optimizer's state cannot "
            f"continue in another: pass --optimizer {old_optimizer}, or start a new run in another --output_dir"
        )
    missing = [k for k in RESUME_OVERRIDABLE if k not in saved["config"]]
    if missing:
        raise ValueError(f"{where}/trainer_state.json: config lacks {missing}")
    idle = idle_settings(current["config"])  # what they set is off now: their value does not train
    changed = {
        k: (saved["config"][k], current["config"][k])
        for k in RESUME_OVERRIDABLE
        if k not in idle and _trains_as(saved["config"], k) != _trains_as(current["config"], k)
    }
    free = SCHEDULE_LENGTH if saved["global_step"] == 0 else ()  # no step has run on the saved schedule
    overrides = [*overrides, *free]
    refused = [
        f"{k}: checkpoint {old!r}, now {new!r}" + (GLOBAL_BATCH_NOTE if k == "global_batch" else "")
        for k, (old, new) in changed.items()
        if k not in overrides
    ]
    if refused:
        flags = [
            f"--{k} {old}"
            for k, (old, _) in changed.items()
            if k not in overrides and k != "global_batch" and isinstance(old, (int, float, str))
        ]
        raise ValueError(
            f"{where}: optimisation settings changed: "
            + "; ".join(refused)
            + f" (restore them{' with ' + ' '.join(flags) if flags else ''}, or accept the change with "
            + "--resume_override "
            + ",".join(k for k in changed if k not in overrides)
            + ")"
        )
    return [
        f"{k}: {old!r} -> {new!r}" + (" (from a checkpoint of step 0)" if k in free else "")
        for k, (old, new) in changed.items()
    ]
