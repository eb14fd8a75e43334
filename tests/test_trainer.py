"""The drafter's optimizer step: chunking a batch changes nothing but the order of float sums."""

import torch
from safetensors.torch import load_file

import dflash_ddp.trainer as trainer_module
from dflash_ddp.train import main

from helpers import train_flags


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
