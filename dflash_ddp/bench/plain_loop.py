"""A plain training loop around transformers' own DFlash drafter class: the speed reference of the trainer.

What a user would write in an afternoon: the target (cut after its last tapped layer) computes the
features, transformers' `MuseGlimmerAssistantModel` (the DFlash drafter class `generate(...,
speculation_type="dflash")` drives) trains with a dense [Q, S + Q] mask, full logits, AdamW, one sequence at a
time (a step of several sequences accumulates their gradients, each sequence's loss its mean over them). It
reads the same tokenized sequences as the trainer, so both do the same work; run it as
`python -m dflash_ddp.bench.plain_loop CONFIG_JSON` (the benchmark does), it prints seconds per step.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel


def dense_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[1, 1, Q, S + Q] additive mask: a block sees context before its anchor and its own block."""
    q_block = torch.arange(len(anchors) * block_size) // block_size
    ctx = torch.arange(seq_len)[None] < anchors[q_block][:, None]
    own = q_block[:, None] == q_block[None]
    visible = torch.cat([ctx, own], dim=1)
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]


def train(steps, target_dir, layer_ids, mask_id, num_anchors, block_size, num_layers, warmup) -> float:
    """Train on `steps`, each a list of sequences (ids [S], loss mask [S]); seconds per step after `warmup`
    steps."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.model.layers = target.model.layers[: max(layer_ids) + 1]
    tc = target.config
    config = MuseGlimmerAssistantConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.head_dim,
        rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=tc.rope_parameters,
        layer_types=["full_attention"] * num_layers,
        block_size=block_size,
        mask_token_id=mask_id,
        target_layer_ids=layer_ids,
        attn_implementation="sdpa",
    )
    drafter = MuseGlimmerAssistantModel(config).train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=6e-4, betas=(0.9, 0.95))
    weights = torch.exp(-(torch.arange(block_size) - 1) / 7.0)
    weights[0] = 0
    for step, sequences in enumerate(steps):
        if step == warmup:
            start = time.perf_counter()
        for ids, loss_mask in sequences:
            seq_len = len(ids)
            with torch.no_grad():
                hidden = target.model(ids[None], output_hidden_states=True).hidden_states
                features = torch.cat([hidden[i + 1] for i in layer_ids], dim=-1)
            candidates = torch.nonzero(loss_mask[:-1] & loss_mask[1:]).flatten()  # as the trainer anchors
            anchors = candidates[torch.randperm(len(candidates))[:num_anchors]].sort().values
            pos = (anchors[:, None] + torch.arange(block_size)).clamp(max=seq_len - 1)
            block_ids = torch.full(pos.shape, mask_id)
            block_ids[:, 0] = ids[anchors]
            labels = ids[pos]
            w = weights * loss_mask[pos] * ((anchors[:, None] + torch.arange(block_size)) < seq_len)
            out = drafter(
                noise_embeds=target.model.embed_tokens(block_ids.flatten())[None],
                context_hidden_states=features,
                attention_mask={"full_attention": dense_mask(anchors, seq_len, block_size)},
                position_ids=torch.cat([torch.arange(seq_len), pos.flatten()])[None],
            ).last_hidden_state
            logits = target.lm_head(out[0]).float()
            ce = F.cross_entropy(logits, labels.flatten(), reduction="none")
            ((ce * w.flatten()).sum() / w.sum() / len(sequences)).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / (len(steps) - warmup)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    torch.set_num_threads(spec.pop("threads"))
    torch.manual_seed(0)
    steps = [[(torch.tensor(ids), torch.tensor(mask)) for ids, mask in step] for step in spec.pop("steps")]
    print(json.dumps({"s_per_step": train(steps, **spec)}))


if __name__ == "__main__":
    main()
