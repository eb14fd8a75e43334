"""Attention of draft blocks over [target context, own block]: the three paths and the rule they share.

A block of `block_size` draft queries anchored at position a sees the context keys j < a and the keys of
its own block, nothing else; padding blocks (anchor -1) see nothing and return zeros. With A anchors per
sequence the dense mask is [A*bs, S + A*bs], of which the block part is (A-1)/A masked out; at the paper's
512 anchors that is more than 99% of the block part. So training without flex uses
`block_sparse_attention`, whose time and memory grow with the allowed entries only:

- context part: queries against context keys, chunked over anchors so that one chunk's scores stay under
  `WORKSPACE_BYTES`, each chunk reading keys only up to its largest anchor;
- block part: [bs x bs] per block (a batched matmul, no mask);
- the two merged exactly through a shared log-sum-exp, and a backward that recomputes the scores chunk by
  chunk (as flash attention does), so nothing of size [queries x keys] is kept for backward.

The dense SDPA path (a boolean mask) stays for inference with padding and as the reference in tests; the
flex path (a BlockMask) is the compiled CUDA kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_ddp.drafter.flex import BlockMask, flex_attend

# Upper bound of one anchor chunk's fp32 scores (all heads) in the block-sparse path; the backward holds
# about three such buffers at once. `--plan` counts this as the attention workspace.
WORKSPACE_BYTES = 4 << 20


@dataclass(frozen=True)
class BlockLayout:
    """Where the draft blocks of a padded batch sit: the block-sparse path's description of the mask.

    anchors: [B, A] anchor positions on the compute device, sorted per row, -1 for padding slots.
    chunks: (first slot, end slot, keys to read) per anchor chunk, planned once on the host so that the
        per-layer attention never waits for the device to tell it sizes.
    """

    anchors: torch.Tensor
    context_len: int
    block_size: int
    chunks: tuple[tuple[int, int, int], ...]


def block_layout(
    anchors: torch.Tensor, context_len: int, block_size: int, num_heads: int, device: torch.device
) -> BlockLayout:
    """Plan the anchor chunks of `anchors` ([B, A], on the host) for `num_heads` query heads."""
    batch, slots = anchors.shape
    ends = (anchors.clamp(min=0).amax(dim=0) if batch else anchors.new_zeros(slots)).tolist()
    rows_per_anchor = batch * num_heads * block_size
    chunks, start = [], 0
    while start < slots:
        end, keys = start + 1, ends[start]
        while end < slots:
            wider = max(keys, ends[end])
            if rows_per_anchor * (end + 1 - start) * max(wider, 1) * 4 > WORKSPACE_BYTES:
                break
            end, keys = end + 1, wider
        # keys j < anchor are visible, so a chunk reads keys 0 .. (its largest anchor) - 1
        chunks.append((start, end, min(keys, context_len)))
        start = end
    return BlockLayout(anchors.to(device, non_blocking=True), context_len, block_size, tuple(chunks))


class _BlockSparseAttention(torch.autograd.Function):
    """Exact attention under the DFlash block rule, computed over the allowed entries only (see module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, layout: BlockLayout):
        out, lse = _sparse_forward(q, k, v, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_sparse_backward(q, k, v, out, lse, grad_out, ctx.layout), None)


def _views(q, k, v, layout: BlockLayout):
    """q as [B, KVH, g, A, bs, D]; context keys/values [B, KVH, S, D]; block keys/values [B, KVH, A, bs, D]."""
    batch, heads, _, dim = q.shape
    kv_heads, s, bs = k.shape[1], layout.context_len, layout.block_size
    slots = layout.anchors.shape[1]
    q6 = q.view(batch, kv_heads, heads // kv_heads, slots, bs, dim)
    blk = (batch, kv_heads, slots, bs, dim)
    return q6, k[:, :, :s], v[:, :, :s], k[:, :, s:].view(blk), v[:, :, s:].view(blk)


def _head_major(t: torch.Tensor, shape) -> torch.Tensor:
    """[B, H, A*bs, D] as [B, KVH, g, A, bs, D], a view when t is stored token-major ([B, A*bs, H, D]) as
    the output is."""
    b, kvh, g, slots, bs, d = shape
    return t.transpose(1, 2).reshape(b, slots, bs, kvh, g, d).permute(0, 3, 4, 1, 2, 5)


def _times(t: torch.Tensor, factor) -> torch.Tensor:
    """t * factor in one fresh contiguous tensor of t's dtype (whatever t's strides)."""
    return torch.mul(t, factor, out=torch.empty(t.shape, dtype=t.dtype, device=t.device))


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """Softmax and gradient sums in fp32 for half-precision inputs, else in the input's own precision."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _chunk_scores(q_c, k_ctx, k_blk, anchors, keys):
    """Scores of one anchor chunk (q_c already scaled): context [B, KVH, g, n, bs, keys], masked, and
    block [.., bs, bs]; in the accumulation dtype, freshly allocated (callers work on them in place)."""
    b, kvh, g, n, bs, d = q_c.shape
    acc = _accumulation(q_c.dtype)
    flat = q_c.reshape(b, kvh, g * n * bs, d)
    s_ctx = (flat @ k_ctx[:, :, :keys].transpose(-1, -2)).to(acc).view(b, kvh, g, n, bs, keys)
    hidden = torch.arange(keys, device=q_c.device) >= anchors[:, None, None, :, None, None]
    s_ctx.masked_fill_(hidden, float("-inf"))
    s_blk = torch.einsum("bkgnqd,bkncd->bkgnqc", q_c, k_blk).to(acc)
    return s_ctx, s_blk


def _sparse_forward(q, k, v, layout: BlockLayout):
    scale = 1.0 / math.sqrt(q.shape[-1])
    q6, k_ctx, v_ctx, k_blk, v_blk = _views(q, k, v, layout)
    b, kvh, g, _, bs, d = q6.shape
    acc = _accumulation(q.dtype)
    # stored token-major, so that o_proj's input [B, A*bs, H*D] is a view of it, not a copy kept beside it
    out = q.new_empty(b, q.shape[2], q.shape[1], d).transpose(1, 2)
    out6 = _head_major(out, q6.shape)
    lse = q6.new_empty(q6.shape[:-1], dtype=acc)
    for a0, a1, keys in layout.chunks:
        n, anchors = a1 - a0, layout.anchors[:, a0:a1]
        q_c = _times(q6[:, :, :, a0:a1], scale)  # scaled per chunk: no scaled copy of all queries
        s_ctx, s_blk = _chunk_scores(q_c, k_ctx, k_blk[:, :, a0:a1], anchors, keys)
        m = s_blk.amax(-1, keepdim=True)  # finite: a block always sees itself
        if keys:
            m = torch.maximum(m, s_ctx.amax(-1, keepdim=True))
        p_ctx, p_blk = s_ctx.sub_(m).exp_(), s_blk.sub_(m).exp_()
        norm = p_ctx.sum(-1, keepdim=True) + p_blk.sum(-1, keepdim=True)
        o = (p_ctx.to(q.dtype).view(b, kvh, g * n * bs, keys) @ v_ctx[:, :, :keys]).view(b, kvh, g, n, bs, d)
        o = o.to(acc) + torch.einsum("bkgnqc,bkncd->bkgnqd", p_blk.to(q.dtype), v_blk[:, :, a0:a1])
        valid = (anchors >= 0)[:, None, None, :, None, None]
        out6[:, :, :, a0:a1] = (o / norm * valid).to(q.dtype)
        lse[:, :, :, a0:a1] = (m + norm.log()).squeeze(-1)
    return out, lse


def _sparse_backward(q, k, v, out, lse, grad_out, layout: BlockLayout):
    """Gradients chunk by chunk; besides dq/dk/dv nothing larger than one chunk is allocated."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    q6, k_ctx, v_ctx, k_blk, v_blk = _views(q, k, v, layout)
    b, kvh, g, slots, bs, d = q6.shape
    s = layout.context_len
    acc = _accumulation(q.dtype)
    do6, o6 = _head_major(grad_out, q6.shape), _head_major(out, q6.shape)
    dq6 = torch.empty(q6.shape, dtype=acc, device=q.device)
    dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (k, v))
    dk_ctx, dv_ctx = dk[:, :, :s], dv[:, :, :s]
    dk_blk, dv_blk = (t[:, :, s:].view(k_blk.shape) for t in (dk, dv))
    for a0, a1, keys in layout.chunks:
        rows = g * (a1 - a0) * bs
        anchors = layout.anchors[:, a0:a1]
        q_c = _times(q6[:, :, :, a0:a1], scale)
        # padding blocks returned constant zeros: their output gradient counts for nothing
        do_c = _times(do6[:, :, :, a0:a1], (anchors >= 0)[:, None, None, :, None, None])
        s_ctx, s_blk = _chunk_scores(q_c, k_ctx, k_blk[:, :, a0:a1], anchors, keys)
        row_lse = lse[:, :, :, a0:a1, :, None]
        p_ctx, p_blk = s_ctx.sub_(row_lse).exp_(), s_blk.sub_(row_lse).exp_()
        delta = (do_c.to(acc) * o6[:, :, :, a0:a1].to(acc)).sum(-1, keepdim=True)
        do_flat = do_c.view(b, kvh, rows, d)
        p_flat = p_ctx.view(b, kvh, rows, keys)
        dv_ctx[:, :, :keys] += p_flat.transpose(-1, -2).to(q.dtype) @ do_flat
        dv_blk[:, :, a0:a1] = torch.einsum("bkgnqc,bkgnqd->bkncd", p_blk.to(q.dtype), do_c)
        # dS = P * (dO V^T - delta), in place on the fresh dO V^T
        ds_ctx = (do_flat @ v_ctx[:, :, :keys].transpose(-1, -2)).to(acc).view_as(p_ctx)
        ds_ctx = ds_ctx.sub_(delta).mul_(p_ctx).to(q.dtype).view(b, kvh, rows, keys)
        ds_blk = torch.einsum("bkgnqd,bkncd->bkgnqc", do_c, v_blk[:, :, a0:a1]).to(acc)
        ds_blk = ds_blk.sub_(delta).mul_(p_blk).to(q.dtype)
        dq_ctx = (ds_ctx @ k_ctx[:, :, :keys]).view(q_c.shape)
        dq6[:, :, :, a0:a1] = (
            dq_ctx.to(acc) + torch.einsum("bkgnqc,bkncd->bkgnqd", ds_blk, k_blk[:, :, a0:a1])
        ) * scale
        dk_ctx[:, :, :keys] += ds_ctx.transpose(-1, -2) @ q_c.view(b, kvh, rows, d)
        dk_blk[:, :, a0:a1] = torch.einsum("bkgnqc,bkgnqd->bkncd", ds_blk, q_c)
    return dq6.view_as(q).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def block_sparse_attention(q, k, v, layout: BlockLayout) -> torch.Tensor:
    """Attention of q [B, H, A*bs, D] over k, v [B, KVH, S + A*bs, D] under the block rule of `layout`."""
    return _BlockSparseAttention.apply(q, k, v, layout)


def dense_attention(q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA with a boolean visibility mask broadcastable to [B, heads, Q, K] (True = visible), or none.

    With a mask, K/V are expanded to the query heads: SDPA's memory-efficient CUDA kernel does not take a
    mask together with `enable_gqa`, and the math kernel it would fall back to materialises the scores.
    A query row with no visible key returns zeros (as flex attention does)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    has_key = mask.any(dim=-1, keepdim=True)
    # A fully masked row would give NaN in SDPA (and NaN gradients); let it see every key, then zero it.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key)
    return out * has_key.to(out.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Attention of block queries over [context keys, block keys], by the kind of `mask`.

    None (every key visible: inference on one sequence), a boolean tensor (dense SDPA), a `BlockLayout`
    (the block-sparse training path) or a flex-attention BlockMask (the compiled CUDA path)."""
    if isinstance(mask, BlockLayout):
        return block_sparse_attention(q, k, v, mask)
    if BlockMask is not None and isinstance(mask, BlockMask):
        return flex_attend(q, k, v, mask)
    return dense_attention(q, k, v, mask)


def dense_block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean visibility [B, 1, A*bs, S + A*bs] for the SDPA path (True = may attend)."""
    device = anchors.device
    num_q = anchors.shape[1] * block_size
    q_block = torch.arange(num_q, device=device) // block_size
    q_anchor = anchors[:, q_block]  # [B, Q]
    valid = (q_anchor >= 0)[:, :, None]
    ctx = torch.arange(context_len, device=device)[None, None, :] < q_anchor[:, :, None]
    same_block = (q_block[:, None] == q_block[None, :])[None]
    mask = torch.cat([ctx, same_block.expand(anchors.shape[0], -1, -1)], dim=-1) & valid
    return mask[:, None]
