"""The drafter's optimizer step: chunking a batch changes nothing but the order of float sums."""

import pytest
import torch
from safetensors.torch import load_file

import dflash_ddp.drafter.trainer as trainer_module
from dflash_ddp.train import main

from helpers import small_draft_config, train_flags


def final_weights(out):
    latest = (out / "checkpoints" / "latest").read_text().strip()
    return load_file(out / "checkpoints" / latest / "model.safetensors")


def test_chunked_steps_train_the_weights_of_unchunked_steps(tiny_target, chat_data, tmp_path, monkeypatch):
    chunk_counts = []
    real_plan = trainer_module.plan_draft_chunks

    def counting_plan(*args):
        chunks = real_plan(*args)
        chunk_counts.append(len(chunks))
        return chunks

    monkeypatch.setattr(trainer_module, "plan_draft_chunks", counting_plan)
    runs = {}
    for name, chunk_tokens in (("whole", 1 << 20), ("chunked", 20)):
        chunk_counts.clear()
        out = tmp_path / name
        flags = train_flags(tiny_target, chat_data, out, max_steps=5, save_steps=100, learning_rate=3e-3)
        assert main([*flags, "--drafter_chunk_tokens", str(chunk_tokens)]) == 0
        runs[name] = (final_weights(out), list(chunk_counts))
    whole, chunked = runs["whole"][0], runs["chunked"][0]
    assert set(runs["whole"][1]) == {1} and min(runs["chunked"][1]) > 3  # each batch: one chunk vs many
    assert any(not torch.equal(whole[k], chunked[k]) for k in whole)  # the sums did run in another order
    for k in whole:
        torch.testing.assert_close(chunked[k], whole[k], rtol=1e-4, atol=1e-6)


def small_trainer(
    lazy_checks: bool, learning_rate: float = 1e-3, loss_gamma: float | None = None, loss_gamma_start=None
):
    from dflash_ddp.drafter.trainer import DrafterTrainer, OptimizerSettings, StepSettings, build_drafter
    from dflash_ddp.target_model.head import SharedTargetHead

    config = small_draft_config(vocab_size=64, mask_token_id=63)
    drafter = build_drafter(config, 0, torch.device("cpu"))
    head = SharedTargetHead(torch.randn(64, 32), torch.randn(64, 32))
    from dflash_ddp.drafter.weighting import LossSettings

    loss = LossSettings(gamma=loss_gamma, chunk_rows=16)
    settings = StepSettings(8, 0, 1.0, "sparse", 24, loss, loss_gamma_start=loss_gamma_start)
    return DrafterTrainer(
        drafter, head, settings, OptimizerSettings(learning_rate, 0.0, 0.0, 10), None, lazy_checks
    )


def random_batch(seed: int):
    from dflash_ddp.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 60, (3, 30), generator=g)
    attention = torch.ones(3, 30, dtype=torch.long)
    attention[2, 20:] = 0
    loss = attention.clone()
    loss[:, :6] = 0
    return [(Batch(ids, attention, loss, torch.arange(3) + 3 * seed), torch.randn(3, 30, 64, generator=g), 0)]


def test_a_decay_schedule_weighs_the_first_step_by_its_start_and_the_last_by_its_end():
    """--loss_gamma_start 1 --loss_gamma 3 over 10 steps: the blocks of step 1 carry the weights of a constant
    gamma 1, those of step 10 the weights of gamma 3; a resumed trainer (its step restored) is on schedule."""
    batch, features, epoch = random_batch(0)[0]

    def weights(trainer):
        return torch.cat([c.inputs.weights.flatten() for c in trainer._chunks(batch, features, epoch)])

    scheduled = small_trainer(False, loss_gamma=3.0, loss_gamma_start=1.0)
    first = weights(small_trainer(False, loss_gamma=1.0))
    last = weights(small_trainer(False, loss_gamma=3.0))
    assert not torch.equal(first, last)
    assert torch.equal(weights(scheduled), first)
    scheduled.global_step = 9  # what restore() sets when resuming before the last step
    assert torch.equal(weights(scheduled), last)


def test_a_lazy_step_reads_nothing_back_from_the_device(monkeypatch):
    """On CUDA a value read back (.item(), float(), nonzero) stalls the GPU's queue: outside the host-side
    preparation of its inputs, a step with lazy checks makes no such read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class CountReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    trainer = small_trainer(lazy_checks=True)
    batch = random_batch(0)
    chunks = [c for b, f, e in batch for c in trainer._chunks(b, f, e)]
    assert len(chunks) > 1
    monkeypatch.setattr(trainer, "_chunks", lambda *a: chunks if a[0] is batch[0][0] else [])
    with CountReads():
        result = trainer.step(batch)
    assert reads == []
    assert result.metrics()["loss"] > 0  # the metrics are read once, when logged


def test_lazy_checks_skip_a_non_finite_update_and_stop_at_the_next_check():
    trainer = small_trainer(lazy_checks=True)
    trainer.step(random_batch(0))
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    poisoned = random_batch(1)
    poisoned[0][1][0, 3] = float("nan")
    trainer.step(poisoned)  # no exception here: nothing is read back
    for k, v in trainer.drafter.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was updated by a non-finite step"
    with pytest.raises(FloatingPointError, match="at step 2"):
        trainer.check_finite()


def test_eager_checks_stop_before_the_update():
    trainer = small_trainer(lazy_checks=False)
    poisoned = random_batch(1)
    poisoned[0][1][0, 3] = float("nan")
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    with pytest.raises(FloatingPointError, match="at step 1"):
        trainer.step(poisoned)
    assert all(torch.equal(v, before[k]) for k, v in trainer.drafter.state_dict().items())


def test_the_warm_up_compiles_every_graph_the_steps_run(monkeypatch):
    """On CUDA a drafter that keeps its activations runs its layers' regions and its loss's pieces compiled,
    the layers reading the step's matrices cast once (`_step_weights`). The warm-up, which runs before the
    channel opens, compiles what the steps then run, with those cast matrices: the first step compiles
    nothing more (here on the CPU under aot_eager, the cast stood in by an fp32 copy)."""
    from dataclasses import replace

    from torch._dynamo.testing import CompileCounterWithBackend

    trainer = small_trainer(lazy_checks=False)
    trainer.drafter.set_recompute(False)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    trainer.drafter.compile_regions(counter)
    trainer.settings = replace(trainer.settings, loss=replace(trainer.settings.loss, compile_backend=counter))
    matrices = [(n, p) for n, p in trainer.drafter.named_parameters() if p.ndim == 2]
    monkeypatch.setattr(trainer, "_step_weights", lambda: {n: p.clone() for n, p in matrices})
    trainer.warm_up()
    warmed = counter.frame_count
    assert warmed == 5  # two regions (each twice: the first layer's input needs no gradient) and the loss
    trainer.step(random_batch(0))
    assert counter.frame_count == warmed
