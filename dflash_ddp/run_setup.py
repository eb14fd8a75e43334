"""A training run before its first step: settings, target and tokenizer, tokenized data, the batch
schedule, the identity stored in checkpoints, and where training starts (fresh or resumed), agreed by
every rank. `train.py` builds a `Run` from these and hands it to the rank's role loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .chat_template import ChatTokenizer, load_target_tokenizer
from .checkpoint import atomic_write_text, checkpoint_name, set_aside_later
from .config import TrainConfig, config_to_dict
from .data import DataStats
from .dataset import TokenizedDataset, TokenizeSettings, load_or_tokenize
from .export import to_zlab_config
from .memory import (
    GIB,
    FitCheck,
    MemoryPlan,
    check_fit,
    device_capacity,
    drafter_memory,
    target_memory,
)
from .model import DFlashDraftConfig, DFlashDraftModel
from .resume import check_same_run, find_checkpoint, load_trainer_state
from .schedule import BatchSchedule
from .target import TargetInfo, inspect_target, target_fingerprint, truncated_parameter_count
from .tensor_parallel import check_groups_within_nodes, check_tensor_parallel
from .topology import DistributedContext, Topology, env_world, select_device
from .trackers import Trackers
from .trainer import (
    compute_dtype,
    drafter_config_for,
    resolve_attention,
    resolve_mask_token_id,
    resolve_target_layer_ids,
)


@dataclass
class RunSetup:
    """Everything derived from the config before any weights load."""

    info: TargetInfo
    tokenizer: object
    drafter_config: DFlashDraftConfig
    memory: RunMemory  # predicted peaks, whether they fit, and whether the drafter checkpoints its layers


def prepare(cfg: TrainConfig, topology: Topology) -> RunSetup:
    """Read the target's config and tokenizer, size the drafter and predict the memory of this rank's node;
    no weights are loaded."""
    check_tensor_parallel(cfg.target_model, topology.tp_size)
    check_groups_within_nodes(topology)
    info = inspect_target(cfg.target_model)
    if topology.tp_size > 1 and cfg.channel_backend == "gloo" and run_device(cfg).type == "cuda":
        raise ValueError(
            f"--target_tp_size {topology.tp_size} with --channel_backend gloo: a tensor-parallel group "
            "all-reduces every layer's output and needs NCCL on GPUs; pass --channel_backend auto"
        )
    tokenizer = load_target_tokenizer(info.path, cfg.chat_template)
    taps = resolve_target_layer_ids(info, cfg.target_layer_ids)
    mask_id = resolve_mask_token_id(tokenizer, info, cfg.mask_token_id)
    drafter_config = drafter_config_for(info, cfg.num_draft_layers, taps, mask_id, cfg.block_size)
    return RunSetup(info, tokenizer, drafter_config, plan_memory(cfg, info, drafter_config, topology))


def load_data(cfg: TrainConfig, setup: RunSetup, where: str) -> tuple[TokenizedDataset, DataStats]:
    """The tokenized --data, from the cache when files, tokenizer, template and settings are unchanged."""
    chat = ChatTokenizer(setup.tokenizer, cfg.chat_template_kwargs, cfg.train_last_turn_only)
    settings = TokenizeSettings(
        max_seq_len=cfg.max_seq_len,
        block_size=cfg.block_size,
        overlength=cfg.overlength,
        skip_bad_rows=cfg.skip_bad_rows,
    )
    cache_dir = Path(cfg.cache_dir or Path(cfg.output_dir) / "cache")
    data, stats, _ = load_or_tokenize(
        chat, setup.info.path, cfg.data, settings, cache_dir, cfg.num_proc, log=lambda m: print(m + where)
    )
    return data, stats


def fingerprint_files(paths: list[Path]) -> str:
    """sha256 over the names and bytes of small identity files (config, tokenizer)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def drafter_parameter_count(config: DFlashDraftConfig) -> int:
    """Trainable parameters of a drafter of this shape, counted on the meta device."""
    with torch.device("meta"):  # shapes only, no memory
        return sum(p.numel() for p in DFlashDraftModel(config).parameters())


def run_device(cfg: TrainConfig) -> torch.device:
    """The device this rank will train on (before any process group exists)."""
    return select_device(cfg.device, env_world()[2])


def node_roles(topology: Topology) -> list[str]:
    """The roles of the ranks on this rank's node (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE)."""
    if topology.colocated:
        return ["colocated"]
    first = topology.rank - env_world()[2]
    count = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size))
    drafters = set(topology.drafter_ranks)
    return ["drafter" if r in drafters else "target" for r in range(first, first + count)]


@dataclass
class RunMemory:
    """The predicted peaks of a drafter rank and a target rank, whether this node holds them, and whether
    the drafter checkpoints its layers (--gradient_checkpointing; unset: only if that alone makes it fit)."""

    drafter: MemoryPlan
    target: MemoryPlan
    fit: FitCheck
    checkpointing: bool
    drafter_params: int
    evaluation: int  # with --eval_data: the whole target's weights, which evaluation loads on the leader


def plan_memory(cfg: TrainConfig, info: TargetInfo, c: DFlashDraftConfig, topology: Topology) -> RunMemory:
    """Predict this run's memory (see memory.py) for the device and node of this rank."""
    device, roles = run_device(cfg), node_roles(topology)
    dtype_bytes = compute_dtype(device).itemsize
    params = drafter_parameter_count(c)
    # draft positions of one chunk: bounded by the chunk, by the batch's tokens and by the anchors its
    # sequences (at least 2 x block_size tokens each) can hold
    rows = max(1, cfg.tokens_per_batch // (2 * c.block_size))
    positions = min(
        cfg.drafter_chunk_tokens, c.block_size * min(cfg.tokens_per_batch, cfg.num_anchors * rows)
    )

    def drafter(checkpointing: bool) -> MemoryPlan:
        return drafter_memory(
            c,
            params,
            positions,
            cfg.tokens_per_batch,
            cfg.max_seq_len,
            cfg.loss_chunk_size,
            resolve_attention(cfg.attention, device),
            dtype_bytes,
            received_batches=1 if topology.colocated else 2,  # split: the next batch arrives meanwhile
            checkpointing=checkpointing,
        )

    target = target_memory(
        info,
        truncated_parameter_count(info, max(c.target_layer_ids) + 1),
        c.target_layer_ids,
        cfg.tokens_per_batch,
        dtype_bytes,
        0 if topology.colocated else cfg.max_inflight,  # colocated: no sends
        topology.tp_size,
    )
    checkpointing = bool(cfg.gradient_checkpointing)
    plan = drafter(checkpointing)
    fit = check_fit(plan, target, roles, device)
    if cfg.gradient_checkpointing is None and not fit.fits:
        checkpointing, plan = True, drafter(True)
        fit = check_fit(plan, target, roles, device)
    # speculative decoding verifies with the whole target: every layer and the LM head, on one device
    whole = (
        truncated_parameter_count(info, info.num_layers)
        + (0 if info.tie_word_embeddings else info.vocab_size * info.hidden_size)
        if cfg.eval_data
        else 0
    )
    return RunMemory(plan, target, fit, checkpointing, params, whole * dtype_bytes)


def check_memory(cfg: TrainConfig, setup: RunSetup) -> None:
    """Refuse, before anything loads, a run whose predicted peak exceeds what this node has."""
    memory = setup.memory
    if cfg.memory_check and not memory.fit.fits:
        parts = (*memory.drafter.parts.items(), *memory.target.parts.items())
        biggest = max(parts, key=lambda kv: kv[1])[0]
        advice = {
            "activations": "--drafter_chunk_tokens",
            "backward or loss": "--drafter_chunk_tokens (or --loss_chunk_size)",
            "attention workspace": "--drafter_chunk_tokens (or use --attention sparse)",
            "received features": "--tokens_per_batch",
            "tapped features": "--tokens_per_batch",
            "sends in flight": "--max_inflight or --tokens_per_batch",
        }.get(biggest, "--tokens_per_batch or --drafter_chunk_tokens, or use fewer processes per machine")
        raise ValueError(
            f"predicted peak memory {memory.fit.needed / GIB:.1f} GiB exceeds {memory.fit.where}; its largest "
            f"part is the {biggest}: lower {advice} (--plan shows every part; --memory_check false skips "
            "this check)"
        )
    if cfg.memory_check and cfg.eval_data:
        check_evaluation_memory(cfg, memory)


def check_evaluation_memory(cfg: TrainConfig, memory: RunMemory) -> None:
    """Refuse at start an --eval_data whose evaluation cannot fit: it loads the whole target on the drafter
    leader's device (beside the training drafter when --eval_steps evaluates during training), which a
    target sharded across a group does not fit."""
    available, where = device_capacity(run_device(cfg))
    beside = memory.drafter.total if cfg.eval_steps else 0
    if memory.evaluation + beside > available:
        during = f" beside the drafter's {beside / GIB:.1f} GiB (--eval_steps)" if beside else ""
        raise ValueError(
            f"--eval_data: real-tau evaluation loads the whole target ({memory.evaluation / GIB:.1f} GiB of "
            f"weights) on the drafter leader's device{during}, and {where} cannot hold it; train without "
            "--eval_data and --eval_steps, then evaluate the export with `python -m dflash_ddp.evaluate` on "
            "a device that holds the target (--memory_check false skips this check)"
        )


def print_plan(cfg: TrainConfig, setup: RunSetup, topology: Topology) -> None:
    """Topology, sizes and predicted memory per rank; loads no weights."""
    c, info, memory = setup.drafter_config, setup.info, setup.memory
    drafter, target, fit = memory.drafter, memory.target, memory.fit
    width_bytes = len(c.target_layer_ids) * info.hidden_size * compute_dtype(run_device(cfg)).itemsize
    for line in topology.describe():
        print(f"{'topology':>26}: {line}")
    plan = {
        "target": f"{info.path} ({info.model_type}, {info.num_layers} layers, hidden {info.hidden_size})",
        "target_layers_run": f"0..{max(c.target_layer_ids)} of {info.num_layers} ("
        + (
            "all layers, the last one's output final-normed as transformers' hidden_states[N]; the LM head skipped"
            if max(c.target_layer_ids) == info.num_layers - 1
            else "later layers, the final norm and the LM head skipped"
        )
        + ")",
        "target_layer_ids": c.target_layer_ids,
        "mask_token_id": c.mask_token_id,
        "block_size": c.block_size,
        "drafter": f"{c.num_hidden_layers} layers, {memory.drafter_params / 1e6:.1f}M trainable parameters",
        "message_size": f"up to {cfg.tokens_per_batch * width_bytes / 2**20:.1f} MiB of features per batch "
        f"(--tokens_per_batch {cfg.tokens_per_batch})",
        "target_rank_memory": f"{target.total / GIB:.2f} GiB predicted peak ({target.describe()})"
        + (f"; weights are 1/{topology.tp_size} of the truncated target's" if topology.tp_size > 1 else ""),
        "drafter_rank_memory": f"{drafter.total / GIB:.2f} GiB predicted peak ({drafter.describe()}), "
        f"--drafter_chunk_tokens {cfg.drafter_chunk_tokens}, gradient checkpointing {'on' if memory.checkpointing else 'off'}",
        "fits": f"{'yes' if fit.fits else 'NO'}: {fit.needed / GIB:.2f} GiB needed on {fit.where}",
    }
    for key, value in plan.items():
        print(f"{key:>26}: {value}")


def build_schedule(cfg: TrainConfig, data: TokenizedDataset, topology: Topology) -> BatchSchedule:
    """The global batch sequence for --max_steps, or for --num_epochs when max_steps is -1."""
    lengths = data.lengths
    per_step = topology.num_drafters * cfg.gradient_accumulation_steps
    if cfg.max_steps > 0:
        return BatchSchedule(lengths, cfg.tokens_per_batch, cfg.seed, per_step, cfg.max_steps)
    return BatchSchedule.for_epochs(lengths, cfg.tokens_per_batch, cfg.seed, per_step, cfg.num_epochs)


@dataclass
class Run:
    """What every role loop reads: settings, data, the batch sequence and where training starts."""

    cfg: TrainConfig
    setup: RunSetup
    data: TokenizedDataset
    schedule: BatchSchedule
    identity: dict  # fingerprints, drafter config and settings: stored in, and checked against, checkpoints
    start_step: int = 0
    first_batch: int = 0  # the checkpoint's data cursor: global batches already consumed
    resume_from: Path | None = None
    trackers: Trackers | None = None  # on the drafter leader when --report_to names any

    @property
    def end_batch(self) -> int:
        """One past the last global batch this run consumes: the remaining steps' worth after the cursor."""
        return (
            self.first_batch + (self.schedule.total_steps - self.start_step) * self.schedule.batches_per_step
        )

    def set_accumulation(self, steps: int, topology: Topology) -> None:
        """Change gradient accumulation (to keep a resumed run's global batch); schedule and identity follow."""
        self.cfg = dataclasses.replace(self.cfg, gradient_accumulation_steps=steps)
        self.schedule = build_schedule(self.cfg, self.data, topology)
        self.identity = self.identity | {"config": identity_config(self.cfg, topology)}  # fingerprints stay


def identity_config(cfg: TrainConfig, topology: Topology) -> dict:
    """The settings part of the identity, with the global batch (drafter ranks x accumulation)."""
    return config_to_dict(cfg) | {"global_batch": topology.num_drafters * cfg.gradient_accumulation_steps}


def run_identity(cfg: TrainConfig, setup: RunSetup, data: TokenizedDataset, topology: Topology) -> dict:
    """The parts of trainer_state.json that decide whether a checkpoint belongs to this run."""
    return {
        "config": identity_config(cfg, topology),
        "fingerprints": {
            "target": target_fingerprint(setup.info.path),
            "tokenizer": fingerprint_files(sorted(setup.info.path.glob("tokenizer*"))),
            "data": data.fingerprint(),
        },
        "drafter": to_zlab_config(setup.drafter_config),
    }


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
    notes.append(
        f"resuming from {path} (step {run.start_step}, batch {run.first_batch}; saved as "
        f"{saved['topology']['target_ranks']}+{saved['topology']['drafter_ranks']}, now "
        f"{topology.num_targets}+{topology.num_drafters})"
    )
    return notes


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
    decision = torch.tensor(
        [run.start_step, 1 if error else 0, run.cfg.gradient_accumulation_steps, run.first_batch],
        dtype=torch.int64,
    )
    dist.broadcast(decision, src=topo.drafter_ranks[0])
    if int(decision[1]):
        raise ValueError(error or f"rank {topo.drafter_ranks[0]} refused to start (see its message)")
    if int(decision[2]) != run.cfg.gradient_accumulation_steps:
        run.set_accumulation(int(decision[2]), topo)
    run.start_step, run.first_batch = int(decision[0]), int(decision[3])
    if run.start_step and not topo.is_leader:  # other drafter ranks read the same checkpoint
        resume = run.cfg.resume
        root = Path(resume) if resume not in ("auto", "never") else Path(run.cfg.output_dir) / "checkpoints"
        run.resume_from = root if resume not in ("auto", "never") else root / checkpoint_name(run.start_step)


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
