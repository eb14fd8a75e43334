"""Qwen3-8B-shaped performance with random weights (no download): the target rank's forward, the drafter
rank's training step, their FLOPs and model FLOP utilisation (MFU), peak memory against drafter/memory.py, and the
split of 8 devices that setup/calibrate.py recommends from the two measured rates.

`python -m dflash_ddp.bench --gpu [--scale qwen3-8b|tiny] [--out DIR] [--peak_tflops X]`

- Target: Qwen3 built from the embedded tiny target's config class with Qwen3-8B's sizes (hidden 4096, 32
  heads / 8 KV heads, head_dim 128, MLP 12288, vocabulary 151936), only the layers up to the last tap
  (34 of 36) instantiated, on the meta device and then on the GPU with random weights; one forward of the
  recipe's batch (`--tokens_per_batch 32768` of `--max_seq_len 3072`: 10 sequences of 3072 tokens) through
  `target.tapped_features`, as a target rank runs it.
- Drafter: 5 layers of the same width, `DrafterTrainer.step` (flex attention on CUDA, the chunked loss,
  the default `--drafter_chunk_tokens`), 512 anchors x block 16 on each sequence of the same batch; two
  batches of features stay resident as on a drafter rank of a split job (the current one and the next).
- FLOPs: `drafter_flops` and `target_forward_flops` (formulas in their docstrings and in docs/benchmarks.md); MFU
  is model FLOPs / time / the device's dense bf16 peak (`flops.PEAK_BF16_TFLOPS`, by device name, or
  `--peak_tflops`). Below `MFU_GOAL` on CUDA one more step runs under torch.profiler (top kernels).
- Parts: two more drafter steps with the trainer's StepTimer on (it waits for the device around each part,
  so never during the timed steps): seconds and share of the step of blocks, forward, loss, backward and
  the optimizer (clipping, then Muon's step with AdamW's for the norms: what Muon costs).
- Operations: how many aten operations one drafter step dispatches, counted on the CPU at the fixed tiny
  shape whatever `--scale` (op_count.py): a proxy for the GPU's kernel launches that compares between
  machines and runs.
- `--scale tiny` runs the same code on the CPU in about a second (hidden 64, 2 drafter layers, 64 anchors).
Figures are printed and written to OUT/gpu_shapes.json after each part (a run cut short keeps the parts
it finished).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel

from dflash_ddp.config import EMBEDDED_TARGET, TrainConfig
from dflash_ddp.data.batch import Batch
from dflash_ddp.drafter.config import (
    DFlashDraftConfig,
    default_target_layer_ids,
    drafter_config_for,
    resolve_attention,
)
from dflash_ddp.drafter.trainer import DrafterTrainer, build_drafter
from dflash_ddp.parallel.devices import compute_dtype, select_device
from dflash_ddp.parallel.machine import GIB, peak_resident_bytes, process_baseline
from dflash_ddp.parallel.topology import Topology
from dflash_ddp.setup.calibrate import Measurement, Rates, recommend, report, warmup_steps
from dflash_ddp.setup.plan import Execution, plan_memory
from dflash_ddp.setup.trainer import configure_execution, optimizer_settings, step_settings
from dflash_ddp.target_model.features import tapped_features
from dflash_ddp.target_model.head import SharedTargetHead
from dflash_ddp.target_model.info import TargetInfo, target_info_from_config
from dflash_ddp.target_model.text_stack import read_text_stack

from .flops import DraftWork, device_peak, draft_work, drafter_flops, target_forward_flops

MFU_GOAL = 0.55  # below it (on CUDA) one more drafter step runs under torch.profiler
PART_STEPS = 2  # drafter steps timed by part after the timed ones
WORLD = 8  # the split is planned for 8 devices of this kind


@dataclass(frozen=True)
class Scale:
    """The target's shape (Qwen3 config fields), the drafter's depth and the recipe's batch."""

    target: dict
    draft_layers: int
    num_anchors: int
    block_size: int
    max_seq_len: int
    tokens_per_batch: int
    mask_token_id: int


def _qwen3(hidden, intermediate, heads, kv_heads, head_dim, vocab, layers, max_positions, rope_theta) -> dict:  # noqa: PLR0913 - a config's fields
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        num_hidden_layers=layers,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )


SCALES = {  # the recipe's batch: --tokens_per_batch 32768 of --max_seq_len 3072, 512 anchors x 16, 5 layers
    "qwen3-8b": Scale(
        _qwen3(4096, 12288, 32, 8, 128, 151936, 36, 40960, 1e6), 5, 512, 16, 3072, 32768, 151669
    ),
    "tiny": Scale(_qwen3(64, 128, 4, 2, 16, 512, 6, 512, 1e4), 2, 64, 16, 256, 512, 511),
}


# ------------------------------------------------------------------------------------------ building


def qwen3_config(scale: Scale, layers: int):
    """A Qwen3 config of `scale`'s sizes with `layers` decoder layers, of the embedded target's class."""
    config_class = type(AutoConfig.from_pretrained(EMBEDDED_TARGET, local_files_only=True))
    fields = {**scale.target, "num_hidden_layers": layers}
    return config_class(**fields, rms_norm_eps=1e-6, tie_word_embeddings=False)


def target_info(config, path: Path) -> TargetInfo:
    """What `inspect_target` would read from a directory holding `config` (written there: --plan's memory
    model reads the config from it; no weights)."""
    config.save_pretrained(path)
    return target_info_from_config(config, path, read_text_stack(path))  # read once, not per plan


def build_target(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The truncated target with random weights: built on the meta device, then given memory on `device`
    (no host copy of the weights), matrices ~ N(0, 0.02), norms 1, rope tables recomputed."""
    with torch.device("meta"):
        model = AutoModel.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=generator) if p.dim() > 1 else p.fill_(1.0)
    model.rotary_emb = type(model.rotary_emb)(config).to(device)  # its buffers were left unset by to_empty
    return model.eval().requires_grad_(False)


def random_batch(scale: Scale, sequences: int, seed: int) -> Batch:
    """`sequences` full-length random sequences whose last 7/8 is response (where anchors may fall)."""
    g = torch.Generator().manual_seed(seed)
    shape = (sequences, scale.max_seq_len)
    ids = torch.randint(0, scale.mask_token_id, shape, generator=g)
    loss = torch.ones(shape, dtype=torch.long)
    loss[:, : scale.max_seq_len // 8] = 0
    return Batch(ids, torch.ones(shape, dtype=torch.long), loss, torch.arange(sequences) + seed * sequences)


# ------------------------------------------------------------------------------------------ measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time them, not their launch
        torch.cuda.synchronize(device)


def _start_peak(device: torch.device) -> int:
    """Reset the peak; returns what the measured peak is taken above (0 on CUDA: allocated tensors count
    from zero; on the CPU the resident size now)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return 0
    with contextlib.suppress(OSError):  # Linux: VmHWM back to the resident size (else it keeps older peaks)
        Path("/proc/self/clear_refs").write_text("5")
    return process_baseline()


def _peaks(device: torch.device, base: int) -> dict:
    """The measured peak (CUDA: allocated tensors; CPU: resident size above `base`), and on CUDA the peak
    the caching allocator reserved (what --plan's 2 GiB CUDA reserve has to cover beside the tensors)."""
    if device.type == "cuda":
        return {
            "peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    return {"peak_gib": (peak_resident_bytes() - base) / GIB}


def measure_target(config, taps: list[int], batch: Batch, device: torch.device, steps: int) -> dict:
    """One warm-up and `steps` timed forwards of the truncated target, as a target rank runs them."""
    base = _start_peak(device)
    model = build_target(config, device, compute_dtype(device))
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)

    def forward(model):
        features = tapped_features(model, model.layers, taps, ids, None)  # no padding mask, as the extractor
        return features * mask[..., None].to(features.dtype)  # as TargetFeatureExtractor zeroes padding

    forward(model)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        forward(model)
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    lengths = batch.attention_mask.sum(dim=1).tolist()
    figures = {
        "layers_run": config.num_hidden_layers,
        "sequences": len(lengths),
        "tokens": sum(lengths),
        "forwards": steps,
        "forward_s": seconds,
        "sequences_per_s": len(lengths) / seconds,
        "tokens_per_s": sum(lengths) / seconds,
        "flops_per_forward": target_forward_flops(config, lengths),
        **_peaks(device, base),
    }
    del model
    return figures


def build_trainer(cfg: TrainConfig, c: DFlashDraftConfig, execution: Execution, device: torch.device):
    """The drafter, a random shared head and the trainer, set up as train.build_trainer sets them up from
    a run's config (which reads the head from the target's files; here there are none), run as `execution`."""
    dtype = compute_dtype(device)
    g = torch.Generator(device=device).manual_seed(1)
    embed, head = (
        torch.randn(c.vocab_size, c.hidden_size, generator=g, device=device, dtype=dtype) * 0.02
        for _ in range(2)
    )
    shared = SharedTargetHead(embed, head).to(dtype=dtype)
    del embed, head
    drafter = build_drafter(c, cfg.seed, device)
    configure_execution(drafter, execution, device)
    settings = step_settings(cfg, resolve_attention(cfg.attention, device), execution.loss_rows)
    return DrafterTrainer(drafter, shared, settings, optimizer_settings(cfg, 1000))


def _held_features_peak(plan, held: int, planned: int) -> float:
    """The drafter rank's predicted peak with `held` batches of received features instead of `planned`."""
    return plan.total - plan.parts["received features"] * (1 - held / planned)


def measure_drafter(trainer: DrafterTrainer, batches: list[Batch], steps: int, base: int):
    """Warm-up steps, then `steps` timed optimizer steps cycling through `batches`, whose random features
    stay resident; returns the figures and the (batch, features, epoch) micro-batches."""
    device, c = trainer.device, trainer.drafter.config
    width = len(c.target_layer_ids) * c.hidden_size
    g = torch.Generator(device=device).manual_seed(2)
    dtype = compute_dtype(device)
    micro = [
        (b, torch.randn(*b.input_ids.shape, width, generator=g, device=device, dtype=dtype), 0)
        for b in batches
    ]
    for i in range(warmup_steps(device)):  # on CUDA the first compiles flex
        trainer.step([micro[i % len(micro)]])
    _sync(device)
    start = time.perf_counter()
    for i in range(steps):
        trainer.step([micro[i % len(micro)]])
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    work = [draft_work(b, trainer.settings, c.block_size, 0) for b in batches]
    total = sum((work[i % len(work)] for i in range(steps)), DraftWork())
    flops = drafter_flops(c, total, trainer.drafter.gradient_checkpointing, trainer.drafter.recomputes)
    parts = time_parts(trainer, micro, PART_STEPS)
    figures = {
        "step_s": seconds,
        "sequences_per_step": sum(len(b.sample_ids) for b in batches) / len(batches),
        "draft_positions_per_step": total.positions / steps,
        "draft_positions_per_s": total.positions / steps / seconds,
        "work_per_step": {k: v / steps for k, v in asdict(total).items()},
        "flops_per_step": {
            "model": flops.model / steps,
            "executed": flops.executed / steps,
            "forward": {k: v / steps for k, v in flops.forward.items()},
            "recomputed": {k: v / steps for k, v in flops.recomputed.items()},
        },
        "parts": parts,
        **_peaks(device, base),
    }
    return figures, micro


def time_parts(trainer: DrafterTrainer, micro, steps: int) -> dict:
    """`steps` more drafter steps with the trainer's StepTimer on: seconds per step of each of its parts
    (blocks, drafter forward, loss, backward, optimizer; "other": the rest of the step) and their shares.
    The timer waits for the device around each part, which the timed steps must not pay."""
    timer = trainer.timer
    timer.enabled = True
    timer.take()
    start = time.perf_counter()
    for i in range(steps):
        trainer.step([micro[i % len(micro)]])
    _sync(trainer.device)
    step_s = (time.perf_counter() - start) / steps
    timer.enabled = False
    seconds = {part: s / steps for part, s in timer.take().items()}
    seconds["other"] = max(0.0, step_s - sum(seconds.values()))
    return {
        "steps": steps,
        "step_s": step_s,
        "seconds": seconds,
        "shares": {part: s / step_s for part, s in seconds.items()},
    }


def profile_step(trainer: DrafterTrainer, micro, path: Path) -> dict:
    """One more step, on the first sequence of `micro` only (one chunk: every chunk of the timed steps holds
    one sequence; fewer events to process), under torch.profiler: the top kernels by self device time
    (CPU: operators by self CPU time) into `path`, and their split into matmul / attention / other by name."""
    from torch.profiler import ProfilerActivity, profile

    batch, features, epoch = micro
    first = Batch(
        *(t[:1] for t in (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.sample_ids))
    )
    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        trainer.step([(first, features[:1], epoch)])
        _sync(trainer.device)
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.write_text(events.table(sort_by=sort, row_limit=30) + "\n")
    if cuda:
        timed = [
            (e.key, e.self_device_time_total)
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events if e.key.startswith("aten::")]
    total = sum(t for _, t in timed) or 1.0
    kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, t in timed:
        kinds[_kernel_kind(name)] += t / total
    top = sorted(timed, key=lambda x: -x[1])[:10]
    return {
        "file": path.name,
        "time_shares": {k: round(v, 3) for k, v in kinds.items()},
        "top": [{"name": n[:100], "ms": round(t / 1000, 3), "share": round(t / total, 3)} for n, t in top],
    }


def _kernel_kind(name: str) -> str:
    lower = name.lower()
    if any(k in lower for k in ("gemm", "cutlass", "xmma", "nvjet", "aten::mm", "aten::addmm", "aten::bmm")):
        return "matmul"
    if any(k in lower for k in ("flex", "flash", "fmha", "attention", "triton_tem")):
        return "attention"
    return "other"


# ------------------------------------------------------------------------------------------ the run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--gpu (Qwen3-8B shapes, random weights)")
    group.add_argument("--scale", choices=sorted(SCALES), default="qwen3-8b", help="tiny: the same on a CPU")
    group.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    group.add_argument("--out", default="gpu_shapes", help="folder for gpu_shapes.json (and a profile)")
    group.add_argument("--target_steps", type=int, default=5, help="timed target forwards")
    group.add_argument("--drafter_steps", type=int, default=5, help="timed drafter steps")
    group.add_argument(
        "--recompute",
        choices=("auto", "none", "qkv_mlp"),
        default="auto",
        help="the drafter's execution (as --recompute of a run; auto: the plan's choice for this device)",
    )
    group.add_argument(
        "--loss_chunk_size",
        type=int,
        default=0,
        help="rows of a loss piece (as a run's; 0: the plan's choice, on CUDA a chunk's rows in one piece)",
    )
    group.add_argument(
        "--peak_tflops", type=float, default=None, help="dense bf16 peak of the device (default: the table)"
    )
    group.add_argument(
        "--profile",
        choices=("auto", "always", "never"),
        default="auto",
        help=f"profile one drafter step: auto = on CUDA when MFU < {100 * MFU_GOAL:.0f}%%",
    )


def run(args: argparse.Namespace) -> dict:
    """Measure, print and write OUT/gpu_shapes.json; returns the figures."""
    device = select_device(args.device, 0)
    scale = SCALES[args.scale]
    if args.loss_chunk_size < 0:
        raise SystemExit(
            f"--loss_chunk_size {args.loss_chunk_size}: rows of a loss piece, or 0 for the plan's"
        )
    for flag in ("target_steps", "drafter_steps"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} {getattr(args, flag)}: at least 1 timed step")
    if args.scale != "tiny" and device.type != "cuda":
        raise SystemExit(f"--scale {args.scale} needs a GPU (about 60 GB); pass --scale tiny on a CPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peak, peak_source = device_peak(device, args.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    figures: dict = {"scale": args.scale, "device": name, "dtype": str(compute_dtype(device)).split(".")[-1]}
    figures.update(torch=torch.__version__, peak_tflops=peak and peak / 1e12, peak_source=peak_source)

    def save() -> None:
        (out / "gpu_shapes.json").write_text(json.dumps(figures, indent=1) + "\n")

    full = qwen3_config(scale, scale.target["num_hidden_layers"])
    info = target_info(full, out / "target_config")
    taps = default_target_layer_ids(info.num_layers)
    c = drafter_config_for(info, scale.draft_layers, taps, scale.mask_token_id, scale.block_size)
    cfg = TrainConfig(
        target_model=str(info.path),
        device=device.type,
        num_draft_layers=scale.draft_layers,
        num_anchors=scale.num_anchors,
        block_size=scale.block_size,
        max_seq_len=scale.max_seq_len,
        tokens_per_batch=scale.tokens_per_batch,
        recompute=args.recompute,
        loss_chunk_size=args.loss_chunk_size,
    )
    # what --plan predicts for a drafter rank and a target rank of the recipe's 7 + 1 launch
    memory = plan_memory(cfg, info, c, Topology(WORLD, WORLD - 1, 1), device)
    sequences = scale.tokens_per_batch // scale.max_seq_len
    print(
        f"gpu_shapes {args.scale} on {name} ({figures['dtype']}; peak "
        + (f"{peak / 1e12:,.4g} TFLOP/s from {peak_source})" if peak else f"unknown: {peak_source})")
    )

    # the target rank's forward
    truncated = qwen3_config(scale, max(taps) + 1)
    target = measure_target(truncated, taps, random_batch(scale, sequences, 0), device, args.target_steps)
    sends = memory.target.parts["sends in flight"]
    target["predicted_peak_gib"] = (memory.target.total - sends) / GIB  # no sends here
    target["mfu"] = peak and target["flops_per_forward"] / target["forward_s"] / peak
    figures["target"] = target
    save()
    print(
        f"  target ({target['layers_run']} of {info.num_layers} layers, {sequences} x {scale.max_seq_len} tokens): "
        f"{target['forward_s']:.3f} s per forward, {target['sequences_per_s']:,.2f} sequences/s, "
        f"{target['tokens_per_s']:,.0f} tokens/s, {_tflops(target['flops_per_forward'], target['forward_s'])}"
        f"{_mfu(target['mfu'])}; peak {target['peak_gib']:.2f} GiB (predicted {target['predicted_peak_gib']:.2f}, "
        "without sends in flight)"
    )
    gc.collect()

    # the drafter rank's training step
    base = _start_peak(device)
    trainer = build_trainer(cfg, c, memory.execution, device)
    if device.type == "cuda":  # count from the drafter and its head (not the head's fp32 staging copy)
        torch.cuda.reset_peak_memory_stats(device)
    batches = [random_batch(scale, sequences, seed) for seed in (1, 2)]
    drafter, micro = measure_drafter(trainer, batches, args.drafter_steps, base)
    flops = drafter["flops_per_step"]
    drafter.update(
        layers=c.num_hidden_layers,
        params=sum(p.numel() for p in trainer.drafter.parameters()),
        anchors=cfg.num_anchors,
        block_size=c.block_size,
        attention=trainer.settings.attention,
        chunk_tokens=cfg.drafter_chunk_tokens,
        gradient_checkpointing=trainer.drafter.gradient_checkpointing,
        execution=memory.execution.describe(),
        steps=args.drafter_steps,
        mfu=peak and flops["model"] / drafter["step_s"] / peak,
        hfu=peak and flops["executed"] / drafter["step_s"] / peak,
        # like for like: the plan's drafter rank of a 7 + 1 launch holds 1 + max_inflight batches of received
        # features, this measurement the features of its `batches` alone
        predicted_peak_gib=_held_features_peak(memory.drafter, len(batches), 1 + cfg.max_inflight) / GIB,
        predicted_launch_peak_gib=memory.drafter.total / GIB,
        predicted_parts_gib={k: round(v / GIB, 3) for k, v in memory.drafter.parts.items()},
    )
    figures["drafter"] = drafter
    save()
    print(
        f"  drafter ({c.num_hidden_layers} layers, {drafter['params'] / 1e6:,.4g}M parameters, "
        f"{drafter['sequences_per_step']:.0f} sequences x {cfg.num_anchors} anchors x {c.block_size}, "
        f"{drafter['attention']}, chunks of {cfg.drafter_chunk_tokens}): {drafter['step_s']:.3f} s per step, "
        f"{drafter['draft_positions_per_s']:,.0f} draft positions/s, model {flops['model']:.3g} FLOP per step, "
        f"{_tflops(flops['model'], drafter['step_s'])}{_mfu(drafter['mfu'])} (executed {flops['executed']:.3g}"
        f"{_mfu(drafter['hfu'], 'HFU')}); peak {drafter['peak_gib']:.2f} GiB (predicted "
        f"{drafter['predicted_peak_gib']:.2f} with the features of {len(batches)} batches held, as here; "
        f"{drafter['predicted_launch_peak_gib']:.2f} in a 7 + 1 launch: {memory.drafter.describe()}); "
        f"{drafter['execution']}"
    )
    parts = drafter["parts"]
    shares = ", ".join(
        f"{part} {parts['seconds'][part]:.3f} s ({100 * share:.0f}%)"
        for part, share in sorted(parts["shares"].items(), key=lambda x: -x[1])
    )
    print(
        f"  drafter step by part ({PART_STEPS} more steps, timer on, {parts['step_s']:.3f} s per step): {shares}"
    )

    # the split of 8 devices, from the two rates (setup/calibrate.py: its model and report)
    rates = Rates(target=target["sequences_per_s"], drafter=sequences / drafter["step_s"])
    measurement = Measurement(
        rates, args.drafter_steps, sequences * args.drafter_steps, sequences / rates.target, drafter["step_s"]
    )
    grads = sum(p.numel() * p.element_size() for p in trainer.drafter.parameters())
    lines = report(measurement, WORLD, device, 0, grads)[1:]  # its first line describes a calibration run
    best = recommend(WORLD, rates)
    figures["split"] = {
        "world": WORLD,
        "target_rate": rates.target,
        "drafter_rate": rates.drafter,
        "targets_x7": 7 * rates.target,
        "recommended": f"{best.target_ranks} + {best.drafter_ranks}",
        "sequences_per_s": best.sequences_per_s,
        "lines": lines,
    }
    save()
    print(
        f"  split of {WORLD} such devices (sequences of {scale.max_seq_len} tokens, {cfg.num_anchors} anchors):"
    )
    for line in lines:
        print("  " + line)

    # where the time goes, when the drafter is below the goal
    mfu = drafter["mfu"]
    wanted = args.profile == "always" or (
        args.profile == "auto" and device.type == "cuda" and (mfu is None or mfu < MFU_GOAL)
    )
    if wanted:
        try:
            figures["profile"] = profile_step(trainer, micro[0], out / "profile_drafter_step.txt")
            print(
                f"  profile of one drafter step: {figures['profile']['time_shares']} -> {out / 'profile_drafter_step.txt'}"
            )
        except Exception as error:  # noqa: BLE001 - the figures above must survive a profiler failure
            figures["profile"] = {"error": f"{type(error).__name__}: {error}"}
            print(f"  profile failed: {figures['profile']['error']}")
        save()

    return figures


def _tflops(flops: float, seconds: float) -> str:
    return f"{flops / seconds / 1e12:,.3g} TFLOP/s"


def _mfu(value: float | None, label: str = "MFU") -> str:
    return f", {label} {100 * value:.1f}%" if value is not None else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
