"""A training run before its first step: settings, target and tokenizer, tokenized data, the batch
schedule and the identity stored in checkpoints. `train.py` builds a `Run` from these and hands it to the
rank's role loop; `--plan` prints the set-up without loading weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_ddp.config import TrainConfig, config_to_dict
from dflash_ddp.data.chat_template import ChatTokenizer, load_target_tokenizer, tokenizer_code_note
from dflash_ddp.data.dataset import TokenizedDataset, TokenizeSettings, load_or_tokenize
from dflash_ddp.data.schedule import BatchSchedule
from dflash_ddp.data.sources import DataStats
from dflash_ddp.drafter.config import (
    DFlashDraftConfig,
    drafter_config_for,
    resolve_mask_token_id,
    resolve_target_layer_ids,
)
from dflash_ddp.drafter.families import FAMILIES
from dflash_ddp.drafter.zlab import to_zlab_config
from dflash_ddp.files import fingerprint_files
from dflash_ddp.hub import ModelSource, TextWeights, weights_summary
from dflash_ddp.observe.trackers import Trackers
from dflash_ddp.parallel.devices import compute_dtype
from dflash_ddp.parallel.downloads import fetch_target_weights, resolve_data_files, resolve_target
from dflash_ddp.parallel.machine import GIB
from dflash_ddp.parallel.topology import Topology
from dflash_ddp.setup.plan import (
    CONTEXT_LENGTHS,
    RunMemory,
    context_length_plans,
    longest_fitting,
    one_pass_beside_pieces,
    pieces_that_fit,
    plan_memory,
    planned_device,
    run_device,
)
from dflash_ddp.setup.warm_start import (
    WarmStart,
    check_source_target,
    find_source,
    plan_warm_start,
    source_taps_and_mask,
)
from dflash_ddp.target_model.info import (
    TargetInfo,
    inspect_target,
    layers_run,
    soft_target_compute_share,
    target_fingerprint,
)
from dflash_ddp.target_model.kernels import kernels_note, linear_layers_summary
from dflash_ddp.target_model.quantization import WeightStorage, check_kernels, weight_storage
from dflash_ddp.target_model.tensor_parallel import check_groups_within_nodes, check_tensor_parallel


@dataclass
class RunSetup:
    """Everything derived from the config before any weights load."""

    source: ModelSource  # where the target's files are: a local directory or a hub snapshot
    info: TargetInfo  # its path: the directory the target ranks load (for a hub name, a view of the shards)
    tokenizer: object
    drafter_config: DFlashDraftConfig
    memory: RunMemory  # predicted peaks, whether they fit, and the drafter's execution
    warm_start: WarmStart | None = None  # --init_from: the drafter to start from, checked against this run
    notes: list[str] = dataclasses.field(default_factory=list)  # what the leader says before the run starts


def prepare(cfg: TrainConfig, topology: Topology) -> RunSetup:
    """Read the target's config and tokenizer, size the drafter and predict the memory of this rank's node.

    A hub name's files are downloaded (once per node) into the hub cache: config and tokenizer first, then,
    unless this is a --plan without --calibrate, the weight files of the layers the target ranks run (all
    of them with --eval_data, whose evaluation runs the whole target). No weights are loaded."""
    device = run_device(cfg)
    if topology.tp_size > 1 and cfg.channel_backend == "gloo" and device.type == "cuda":
        raise ValueError(
            f"--target_tp_size {topology.tp_size} with --channel_backend gloo: a tensor-parallel group "
            "all-reduces every layer's output and needs NCCL on GPUs; pass --channel_backend auto"
        )
    check_groups_within_nodes(topology)
    # every process prepares, except under --plan, where the drafter leader does alone (and, to time their
    # sharded forward, a tensor-parallel group with it): hub downloads are coordinated only when all do
    together = not cfg.plan or (cfg.calibrate and topology.tp_size > 1)
    source = resolve_target(cfg.target_model, together)
    check_tensor_parallel(source.path, topology.tp_size)
    info = inspect_target(source.path)
    tokenizer = load_target_tokenizer(info.path, cfg.chat_template)
    tokenizer_note = tokenizer_code_note(info.path)  # here: info.path becomes a view of the weights below
    source_drafter = find_source(cfg.init_from, together) if cfg.init_from else None
    requested_taps, requested_mask = source_taps_and_mask(cfg, source_drafter)
    taps = resolve_target_layer_ids(info, requested_taps)
    mask_id = resolve_mask_token_id(tokenizer, info, requested_mask)
    config_class = FAMILIES[cfg.drafter][0]
    drafter_config = drafter_config_for(
        info,
        cfg.num_draft_layers,
        taps,
        mask_id,
        cfg.block_size,
        config_class,
        config_class.run_values(cfg),
        (cfg.sliding_window, cfg.sliding_layers),
    )
    warm = plan_warm_start(cfg, info, drafter_config, source_drafter) if source_drafter else None
    if cfg.target_prefill_tokens and info.own_cache:
        raise ValueError(
            f"--target_prefill_tokens {cfg.target_prefill_tokens}: {info.model_type} ({info.path}/config.json) "
            f"runs only with its own cache ({info.own_cache}), which a prefill in pieces cannot share; "
            "pass --target_prefill_tokens 0 (one pass)"
        )
    if cfg.target_topk > info.vocab_size:
        raise ValueError(
            f"--target_topk {cfg.target_topk} is more than the target's {info.vocab_size} tokens "
            f"({info.path}/config.json vocab_size); pass at most {info.vocab_size} (all of them: the full distribution)"
        )
    if not cfg.plan or cfg.calibrate:  # the target will run here: refused before its weights download
        check_kernels(info, weight_storage(info, planned_device(cfg)))
        view_root = Path(cfg.cache_dir or Path(cfg.output_dir) / "cache")
        if cfg.eval_data:
            fetch_target_weights(source, None, together=together)
        view = fetch_target_weights(
            source, target_layers_read(cfg, info, taps), view_root, together, target_weights(info)
        )
        info = dataclasses.replace(info, path=view)
    if warm and (not cfg.plan or cfg.calibrate or source.repo_id is None):  # the target's files are here
        check_source_target(cfg, warm, info.path, source.commit)
    planned = planned_device(cfg)
    memory = plan_memory(cfg, info, drafter_config, topology, planned, plan_gpu_bytes(cfg))
    notes = [
        kernels_note(info, target_layers_run(cfg, info, taps), planned.type),
        positions_note(cfg, info),
        tokenizer_note,
    ]
    return RunSetup(source, info, tokenizer, drafter_config, memory, warm, [n for n in notes if n])


def positions_note(cfg: TrainConfig, info: TargetInfo) -> str:
    """A warning when --max_seq_len runs past the positions the target's config declares ("" otherwise)."""
    if cfg.max_seq_len <= info.max_position_embeddings:
        return ""
    return (
        f"note: --max_seq_len {cfg.max_seq_len} is past the target's max_position_embeddings "
        f"{info.max_position_embeddings} ({info.path}/config.json): positions beyond it are ones the target "
        "was not trained at (unless its rope scaling extends them); lower --max_seq_len to stay within"
    )


def plan_gpu_bytes(cfg: TrainConfig) -> int | None:
    """--plan_gpu_memory in bytes, or None: the fit is judged on this machine's devices."""
    return int(cfg.plan_gpu_memory * GIB) if cfg.plan_gpu_memory else None


def target_weights(info: TargetInfo) -> TextWeights:
    """The tensors target ranks read: the text model the checkpoint's own classes name (text_stack.py), so
    that a vision-language wrapper's vision tower is neither downloaded nor opened."""
    stack = info.text_stack()
    return stack.weights_read()


def target_layers_run(cfg: TrainConfig, info: TargetInfo, taps: list[int]) -> int:
    """How many of the target's layers its ranks run: up to the last tap, or all with soft targets."""
    return layers_run(info.num_layers, taps, cfg.target_topk)


def target_layers_read(cfg: TrainConfig, info: TargetInfo, taps: list[int]) -> int | None:
    """How many layers' weights target ranks read: those they run, or all (None) where the text model cannot
    be cut (Gemma 4's per-layer inputs: it is built whole, and its forward stops after the last tap)."""
    return target_layers_run(cfg, info, taps) if info.text_stack().truncatable else None


def load_data(
    cfg: TrainConfig, setup: RunSetup, where: str, together: bool = True
) -> tuple[TokenizedDataset, DataStats]:
    """The tokenized --data, from the cache when files, tokenizer, template and settings are unchanged.
    `together`: every process of the job loads it (hub datasets are then downloaded once per node)."""
    chat = ChatTokenizer(setup.tokenizer, cfg.chat_template_kwargs, cfg.train_last_turn_only)
    settings = TokenizeSettings(
        max_seq_len=cfg.max_seq_len,
        block_size=cfg.block_size,
        overlength=cfg.overlength,
        skip_bad_rows=cfg.skip_bad_rows,
    )
    cache_dir = Path(cfg.cache_dir or Path(cfg.output_dir) / "cache")
    data, stats, _ = load_or_tokenize(
        chat,
        setup.info.path,
        resolve_data_files(cfg.data, together=together),
        settings,
        cache_dir,
        cfg.num_proc,
        log=lambda m: print(m + where),
    )
    check_token_ids(data, setup)
    return data, stats


def check_token_ids(data: TokenizedDataset, setup: RunSetup) -> None:
    """Refuse data whose token ids the target has no embedding for (a tokenizer with more tokens than the
    model's vocab_size): the target's forward would fail on it, on a GPU with a device-side assert."""
    rows, vocab = setup.info.vocab_size, len(setup.tokenizer)
    if not len(data) or int(data.input_ids.max()) < rows:
        return
    position = int((data.input_ids >= rows).nonzero()[0])
    sample = int(torch.searchsorted(data.offsets, position, right=True)) - 1
    raise ValueError(
        f"--data: tokenized sample {sample} holds token id {int(data.input_ids[position])}, and the target has "
        f"embeddings for ids below {rows} ({setup.info.path}/config.json vocab_size) while its tokenizer has "
        f"{vocab} tokens: use the tokenizer saved with these weights (one that adds tokens needs the model's "
        "embeddings resized and saved with it)"
    )


def build_schedule(cfg: TrainConfig, data: TokenizedDataset, topology: Topology) -> BatchSchedule:
    """The global batch sequence for --max_steps (0: none), or for --num_epochs when max_steps is -1."""
    lengths = data.lengths
    per_step = topology.num_drafters * cfg.gradient_accumulation_steps
    if cfg.max_steps >= 0:
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


def run_identity(
    cfg: TrainConfig, setup: RunSetup, data: TokenizedDataset, stats: DataStats, topology: Topology
) -> dict:
    """The parts of trainer_state.json that decide whether a checkpoint belongs to this run (and the data
    files' sizes, which name the files a changed data fingerprint comes from)."""
    return {
        "config": identity_config(cfg, topology),
        "fingerprints": {
            "target": target_fingerprint(setup.info.path),
            "target_commit": setup.source.commit,  # a hub name's snapshot; None for a local directory
            "tokenizer": fingerprint_files(sorted(setup.info.path.glob("tokenizer*"))),
            "data": data.fingerprint(),
        },
        "drafter": to_zlab_config(setup.drafter_config),
        "init_from": setup.warm_start.record() if setup.warm_start else None,
        "data_files": stats.inputs,
        # how the drafter ran (the plan's choice for this device): recorded, free to change on a resume
        "execution": setup.memory.execution.record(),
    }


def text_stack_note(info: TargetInfo) -> str:
    """What of a wrapper checkpoint the target ranks leave out (a vision or audio tower), the layers' kinds
    of a hybrid target, and a hyper-connection target's streams."""
    note = ""
    if info.other_parameters:
        note += (
            f"; the text model of {info.architecture}: {info.other_parameters / 1e6:.2f}M parameters beside it "
            "(vision/audio towers) are never loaded and not counted"
        )
    kinds = sorted(set(info.layer_types))
    if len(kinds) > 1:
        note += "; layers " + ", ".join(f"{info.layer_types.count(k)} {k}" for k in kinds)
    if info.altup:
        note += (
            f"; {info.residual_streams} AltUp streams between layers: each tapped feature is read out of them "
            "as the model reads its final hidden state"
        )
    elif info.residual_streams > 1:
        note += (
            f"; {info.residual_streams} residual streams between layers (hyper-connections): each tapped "
            "feature is their mean after the layer's post-mix, as the engines feed a drafter"
        )
    return note


def quantization_line(storage: WeightStorage, dtype: torch.dtype) -> dict[str, str]:
    """The plan's line on a quantized release's weights (none for a target that is not quantized)."""
    return {"target_quantization": storage.describe(dtype)} if storage.method else {}


def print_plan(cfg: TrainConfig, setup: RunSetup, topology: Topology) -> None:
    """Topology, sizes and predicted memory per rank; loads no weights."""
    c, info, memory = setup.drafter_config, setup.info, setup.memory
    drafter, target, fit = memory.drafter, memory.target, memory.fit
    width_bytes = len(c.target_layer_ids) * info.hidden_size * compute_dtype(planned_device(cfg)).itemsize
    soft_bytes = 6 * cfg.target_topk
    extra_layers = info.num_layers - max(c.target_layer_ids) - 1
    soft_cost = (
        f"{extra_layers} more layer(s) than the taps need and a {info.vocab_size} x {info.hidden_size} LM head, "
        f"about {soft_target_compute_share(info, c.target_layer_ids):.0%} more target compute per token"
    )
    reader = ", which DSpark's loss reads" if cfg.drafter == "dspark" else ""  # on by default with dspark
    for line in topology.describe():
        print(f"{'topology':>26}: {line}")
    plan = {
        "target": f"{info.path} ({info.model_type}, {info.num_layers} layers, hidden {info.hidden_size})"
        + text_stack_note(info),
        "target_layers_run": f"0..{target_layers_run(cfg, info, c.target_layer_ids) - 1} of {info.num_layers} ("
        + (
            f"all layers, the final norm and the LM head: the top {cfg.target_topk} next-token probabilities are "
            f"sent as soft targets (--target_topk{reader}); {soft_cost}"
            if cfg.target_topk
            else "all layers, the last one's output final-normed as transformers' hidden_states[N]; the LM head skipped"
            if max(c.target_layer_ids) == info.num_layers - 1
            else "later layers, the final norm and the LM head skipped"
        )
        + ")",
        "target_kernels": linear_layers_summary(
            info, target_layers_run(cfg, info, c.target_layer_ids), planned_device(cfg).type
        ),
        "target_weights": weights_summary(
            setup.source, target_layers_read(cfg, info, c.target_layer_ids), target_weights(info)
        )
        + (f"; {setup.source.repo_id} at commit {setup.source.commit}" if setup.source.repo_id else ""),
        **quantization_line(memory.target_storage, compute_dtype(planned_device(cfg))),
        "target_layer_ids": c.target_layer_ids,
        "mask_token_id": c.mask_token_id,
        "block_size": c.block_size,
        "drafter": f"{c.family}, {c.num_hidden_layers} layers, {memory.drafter_params / 1e6:.1f}M trainable parameters",
        "message_size": f"up to {cfg.batch_tokens * width_bytes / 2**20:.1f} MiB of features per batch "
        f"(--tokens_per_batch {cfg.tokens_per_batch}, or one sequence of --max_seq_len {cfg.max_seq_len} if longer)"
        + (
            f" + {cfg.batch_tokens * soft_bytes / 2**20:.1f} MiB of soft targets ({soft_bytes} bytes a "
            f"token: {cfg.target_topk} int32 ids and bf16 probabilities, +{100 * soft_bytes / width_bytes:.1f}%)"
            if cfg.target_topk
            else ""
        ),
        "target_rank_memory": f"{target.total / GIB:.2f} GiB predicted peak ({target.describe()})"
        + (
            f"; weights are 1/{topology.tp_size} of the truncated target's"
            + (
                f", but {memory.unsharded_bytes / GIB:.2f} GiB of them whole on each rank (transformers' plans "
                "for the model do not split them)"
                if memory.unsharded_bytes > GIB / 100
                else ""
            )
            if topology.tp_size > 1
            else ""
        )
        + one_pass_beside_pieces(memory),
        "drafter_rank_memory": f"{drafter.total / GIB:.2f} GiB predicted peak ({drafter.describe()}), "
        f"--drafter_chunk_tokens {cfg.drafter_chunk_tokens}",
        "drafter_execution": memory.execution.describe(),
        "fits": f"{'yes' if fit.fits else 'NO'}: {fit.needed / GIB:.2f} GiB needed on {fit.where}"
        + pieces_that_fit(memory),
    }
    contexts = context_length_plans(cfg, info, c, topology, planned_device(cfg), plan_gpu_bytes(cfg))
    for p in contexts:
        plan[f"context_{p.length // 1024}K"] = (
            f"drafter rank {p.memory.drafter.total / GIB:.1f} GiB, target rank {p.memory.target.total / GIB:.1f} GiB"
            + (f" ({one_pass.total / GIB:.1f} in one pass)" if (one_pass := p.memory.one_pass_target) else "")
            + f", message {p.message_bytes / 2**20:.1f} MiB: {'fits' if p.memory.fit.fits else 'does NOT fit'} "
            f"{p.memory.fit.where}"
            + pieces_that_fit(p.memory, short=True)
            + (
                f"; past the target's max_position_embeddings {info.max_position_embeddings}"
                if p.length > info.max_position_embeddings
                else ""
            )
        )
    positions = info.max_position_embeddings
    within = [p for p in contexts if p.length <= positions]
    longest, overall = longest_fitting(within), longest_fitting(contexts)
    if longest:
        text = f"{longest} tokens fit (--max_seq_len {longest}, --tokens_per_batch at least that)"
    elif within:
        text = f"none of {within[0].length}..{within[-1].length} tokens fits"
    else:
        text = f"no length planned ({CONTEXT_LENGTHS[0]}..{CONTEXT_LENGTHS[-1]}) is within the target's positions"
    if overall and overall != longest:
        text += f"; {overall} would fit the memory, past the target's max_position_embeddings {positions}"
    plan["longest_context"] = text
    for key, value in plan.items():
        print(f"{key:>26}: {value}")
