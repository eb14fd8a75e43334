"""Attention of draft blocks over [target context, own block]: the three paths and the rule they share.

A block of `block_size` draft queries anchored at position a sees the context keys j < a and the keys of
its own block, nothing else; padding blocks (anchor -1) see nothing and return zeros. In a sliding-window
layer (window W, at least the block size) the query at block position k (position a + k) sees only the
context keys j with a + k - j < W, as the engines' sliding-window kernels do (key j visible to query p when
p - j < W); its own block stays whole. With A anchors per
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
    chunks: (first slot, end slot, first key, end key) per anchor chunk, planned once on the host so that
        the per-layer attention never waits for the device to tell it sizes.
    window: the sliding window in tokens, or None for full attention to the context.
    """

    anchors: torch.Tensor
    context_len: int
    block_size: int
    chunks: tuple[tuple[int, int, int, int], ...]
    window: int | None = None


def block_layout(
    anchors: torch.Tensor,
    context_len: int,
    block_size: int,
    num_heads: int,
    device: torch.device,
    window: int | None = None,
) -> BlockLayout:
    """Plan the anchor chunks of `anchors` ([B, A], on the host) for `num_heads` query heads; with a
    sliding `window` a chunk reads only the keys its blocks' windows reach."""
    batch, slots = anchors.shape
    valid = anchors >= 0
    ends = (anchors.clamp(min=0).amax(dim=0) if batch else anchors.new_zeros(slots)).tolist()
    lowest = anchors.masked_fill(~valid, 1 << 62).amin(dim=0) if batch else anchors.new_zeros(slots)
    firsts = [0 if window is None or low >= 1 << 62 else max(0, low - window + 1) for low in lowest.tolist()]
    rows_per_anchor = batch * num_heads * block_size
    chunks, start = [], 0
    while start < slots:
        end, first, keys = start + 1, firsts[start], ends[start]
        while end < slots:
            wider_first, wider = min(first, firsts[end]), max(keys, ends[end])
            if rows_per_anchor * (end + 1 - start) * max(wider - wider_first, 1) * 4 > WORKSPACE_BYTES:
                break
            end, first, keys = end + 1, wider_first, wider
        # keys j < anchor are visible, so a chunk reads keys up to (its largest anchor) - 1
        keys = min(keys, context_len)
        chunks.append((start, end, min(first, keys), keys))
        start = end
    return BlockLayout(anchors.to(device, non_blocking=True), context_len, block_size, tuple(chunks), window)


@dataclass(frozen=True)
class LayerMasks:
    """A training chunk's attention rule for a drafter with sliding-window layers: one mask (a BlockLayout,
    BlockMask or boolean tensor) for its full-attention layers, one for its sliding ones."""

    full: object
    sliding: object


@dataclass(frozen=True)
class DecodeWindow:
    """A sliding layer's rule in decoding, resolved once the cache has added its keys: the cached context
    holds positions 0 .. cached - 1, then come the new context and the block at `positions`; the query at
    position p sees key j when p - j < window (training builds the same rule into its block masks)."""

    positions: torch.Tensor  # [B, new context + Q]
    queries: int
    window: int
    mask: torch.Tensor | None  # a padding mask to keep, or None

    def resolve(self, num_keys: int) -> torch.Tensor:
        """Boolean visibility [B, 1, Q, num_keys]."""
        batch, new = self.positions.shape
        past = torch.arange(num_keys - new, device=self.positions.device).expand(batch, -1)
        keys = torch.cat([past, self.positions], dim=1)
        queries = self.positions[:, -self.queries :]
        visible = (queries[:, None, :, None] - keys[:, None, None, :]) < self.window
        return visible if self.mask is None else visible & self.mask


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


def _chunk_scores(q_c, k_ctx, k_blk, anchors, first, keys, window):
    """Scores of one anchor chunk (q_c already scaled): context keys first..keys-1 [B, KVH, g, n, bs, keys -
    first], masked, and block [.., bs, bs]; in the accumulation dtype, freshly allocated (callers work on
    them in place)."""
    b, kvh, g, n, bs, d = q_c.shape
    acc = _accumulation(q_c.dtype)
    flat = q_c.reshape(b, kvh, g * n * bs, d)
    width = keys - first
    s_ctx = (flat @ k_ctx[:, :, first:keys].transpose(-1, -2)).to(acc).view(b, kvh, g, n, bs, width)
    key = torch.arange(first, keys, device=q_c.device)
    row_anchor = anchors[:, None, None, :, None, None]
    hidden = key >= row_anchor
    if window is not None:  # the query at block position k sees keys j > anchor + k - window
        offset = torch.arange(bs, device=q_c.device)[:, None]
        hidden = hidden | (key <= row_anchor + offset - window)
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
    for a0, a1, first, keys in layout.chunks:
        n, anchors = a1 - a0, layout.anchors[:, a0:a1]
        q_c = _times(q6[:, :, :, a0:a1], scale)  # scaled per chunk: no scaled copy of all queries
        s_ctx, s_blk = _chunk_scores(q_c, k_ctx, k_blk[:, :, a0:a1], anchors, first, keys, layout.window)
        m = s_blk.amax(-1, keepdim=True)  # finite: a block always sees itself
        if keys > first:
            m = torch.maximum(m, s_ctx.amax(-1, keepdim=True))
        p_ctx, p_blk = s_ctx.sub_(m).exp_(), s_blk.sub_(m).exp_()
        norm = p_ctx.sum(-1, keepdim=True) + p_blk.sum(-1, keepdim=True)
        width = keys - first
        o = p_ctx.to(q.dtype).view(b, kvh, g * n * bs, width) @ v_ctx[:, :, first:keys]
        o = o.view(b, kvh, g, n, bs, d)
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
    for a0, a1, first, keys in layout.chunks:
        rows, width = g * (a1 - a0) * bs, keys - first
        anchors = layout.anchors[:, a0:a1]
        q_c = _times(q6[:, :, :, a0:a1], scale)
        # padding blocks returned constant zeros: their output gradient counts for nothing
        do_c = _times(do6[:, :, :, a0:a1], (anchors >= 0)[:, None, None, :, None, None])
        s_ctx, s_blk = _chunk_scores(q_c, k_ctx, k_blk[:, :, a0:a1], anchors, first, keys, layout.window)
        row_lse = lse[:, :, :, a0:a1, :, None]
        p_ctx, p_blk = s_ctx.sub_(row_lse).exp_(), s_blk.sub_(row_lse).exp_()
        delta = (do_c.to(acc) * o6[:, :, :, a0:a1].to(acc)).sum(-1, keepdim=True)
        do_flat = do_c.view(b, kvh, rows, d)
        p_flat = p_ctx.view(b, kvh, rows, width)
        dv_ctx[:, :, first:keys] += p_flat.transpose(-1, -2).to(q.dtype) @ do_flat
        dv_blk[:, :, a0:a1] = torch.einsum("bkgnqc,bkgnqd->bkncd", p_blk.to(q.dtype), do_c)
        # dS = P * (dO V^T - delta), in place on the fresh dO V^T
        ds_ctx = (do_flat @ v_ctx[:, :, first:keys].transpose(-1, -2)).to(acc).view_as(p_ctx)
        ds_ctx = ds_ctx.sub_(delta).mul_(p_ctx).to(q.dtype).view(b, kvh, rows, width)
        ds_blk = torch.einsum("bkgnqd,bkncd->bkgnqc", do_c, v_blk[:, :, a0:a1]).to(acc)
        ds_blk = ds_blk.sub_(delta).mul_(p_blk).to(q.dtype)
        dq_ctx = (ds_ctx @ k_ctx[:, :, first:keys]).view(q_c.shape)
        dq6[:, :, :, a0:a1] = (
            dq_ctx.to(acc) + torch.einsum("bkgnqc,bkncd->bkgnqd", ds_blk, k_blk[:, :, a0:a1])
        ) * scale
        dk_ctx[:, :, first:keys] += ds_ctx.transpose(-1, -2) @ q_c.view(b, kvh, rows, d)
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

    None (every key visible: inference on one sequence), a boolean tensor (dense SDPA), a `DecodeWindow`
    (a sliding layer in decoding), a `BlockLayout` (the block-sparse training path) or a flex-attention
    BlockMask (the compiled CUDA path)."""
    if isinstance(mask, BlockLayout):
        return block_sparse_attention(q, k, v, mask)
    if isinstance(mask, DecodeWindow):
        mask = mask.resolve(k.shape[2])
    if BlockMask is not None and isinstance(mask, BlockMask):
        return flex_attend(q, k, v, mask)
    return dense_attention(q, k, v, mask)


def dense_block_mask(
    anchors: torch.Tensor, context_len: int, block_size: int, window: int | None = None
) -> torch.Tensor:
    """Boolean visibility [B, 1, A*bs, S + A*bs] for the SDPA path (True = may attend); `window`: a
    sliding-window layer's (module docstring)."""
    device = anchors.device
    num_q = anchors.shape[1] * block_size
    q_block = torch.arange(num_q, device=device) // block_size
    q_anchor = anchors[:, q_block]  # [B, Q]
    valid = (q_anchor >= 0)[:, :, None]
    key = torch.arange(context_len, device=device)[None, None, :]
    ctx = key < q_anchor[:, :, None]
    if window is not None:
        q_position = q_anchor + torch.arange(num_q, device=device) % block_size
        ctx = ctx & (q_position[:, :, None] - key < window)
    same_block = (q_block[:, None] == q_block[None, :])[None]
    mask = torch.cat([ctx, same_block.expand(anchors.shape[0], -1, -1)], dim=-1) & valid
    return mask[:, None]
