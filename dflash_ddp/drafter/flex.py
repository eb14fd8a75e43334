"""Flex attention, the compiled CUDA path: a BlockMask built from the anchors, and the kernel compiled once.

The BlockMask is computed here from the anchors with a few tensor operations (no `create_block_mask`, which
either materialises every (query, key) pair or compiles a new function on every call), so building it never
compiles, never syncs with the host and costs O(queries x key tiles).

The kernel is compiled once with dynamic shapes. Batch size, draft positions and context length vary from
chunk to chunk; they are marked dynamic from the first compile, and chunks are padded to enough anchor slots
that neither queries nor keys fit in one tile. What dynamo still specialises is one sequence against several:
two graphs in all, whatever the shapes (a test counts them under `aot_eager` on the CPU). Should the bound ever be exceeded, dynamo would silently fall back to eager flex,
which materialises [B, H, Q, K] scores and runs out of memory at real sizes: the limit is raised and hitting
it is an error naming the way out instead.
"""

from __future__ import annotations

import torch

try:  # flex attention is optional: CPU training uses the block-sparse path.
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch without flex attention
    BlockMask, flex_attention = None, None


TILE = 128  # flex's default tile in both dimensions; 16-token blocks waste little (see the tiles test)


RECOMPILE_LIMIT = 32  # well above the bounded number of graphs; reaching it means something changed shape


def min_anchor_slots(block_size: int) -> int:
    """The fewest anchor slots a flex chunk is padded to: its queries then span two tiles and so do its keys,
    so no chunk hits dynamo's specialisation of sizes of 1 (one graph more per such size). Padding blocks
    weigh nothing and are skipped tile by tile."""
    return TILE // block_size + 1


def flex_block_mask(anchors: torch.Tensor, context_len: int, block_size: int, window: int | None = None):
    """The DFlash rule (`attention.dense_block_mask`) as a flex-attention BlockMask on `anchors`' device.

    Query q of block b (anchor a_b, -1 for padding) sees context keys [0, a_b) and block keys
    [S + b*bs, S + (b+1)*bs); in a sliding-window layer the query at block position k sees context keys
    (a_b + k - window, a_b) only. A tile is full when each of its rows sees each of its keys, partial when
    some row sees some key; tiles crossing the end of the queries or keys are never full (as
    create_block_mask)."""
    if BlockMask is None:
        raise RuntimeError("this torch has no flex attention; use --attention sparse")
    batch, slots = anchors.shape
    device = anchors.device
    for dim in (0, 1):  # mask_mod reads `anchors`: compiled with its batch and slot count dynamic
        torch._dynamo.maybe_mark_dynamic(anchors, dim)
    num_q, num_kv = slots * block_size, context_len + slots * block_size
    q_tiles, kv_tiles = -(-num_q // TILE), -(-num_kv // TILE)

    # Per query row: its two visible key intervals, as [start, end).
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    valid = row_anchor >= 0
    ctx_end = torch.where(valid, row_anchor, 0)
    ctx_start = torch.zeros_like(ctx_end)
    if window is not None:
        offset = torch.arange(num_q, device=device) % block_size
        ctx_start = torch.minimum((row_anchor + offset - window + 1).clamp(min=0), ctx_end)
    blk_start = context_len + torch.arange(num_q, device=device) // block_size * block_size
    blk_end = torch.where(valid, blk_start + block_size, blk_start)

    # Visible keys of each row in each key tile: the overlap of the tile with each interval.
    tile_start = torch.arange(kv_tiles, device=device) * TILE
    tile_end = (tile_start + TILE).clamp(max=num_kv)

    def overlap(start, end):  # [B, Q, 1] intervals against [kv_tiles] tiles
        return (torch.minimum(end[..., None], tile_end) - torch.maximum(start[..., None], tile_start)).clamp(
            min=0
        )

    seen = overlap(ctx_start, ctx_end) + overlap(blk_start.expand_as(blk_end), blk_end)
    whole_tile = (tile_end - tile_start == TILE) & (seen == TILE)  # [B, Q, kv_tiles]

    # Rows grouped into query tiles; rows past the last query count as seeing nothing.
    pad = q_tiles * TILE - num_q
    seen = torch.nn.functional.pad(seen, (0, 0, 0, pad)).view(batch, q_tiles, TILE, kv_tiles)
    whole_tile = torch.nn.functional.pad(whole_tile, (0, 0, 0, pad)).view(batch, q_tiles, TILE, kv_tiles)
    full = whole_tile.all(dim=2)
    partial = (seen > 0).any(dim=2) & ~full

    def as_indices(tiles: torch.Tensor):  # [B, q_tiles, kv_tiles] bool -> counts and tile indices, heads = 1
        # reduced over a [B, 1, ...] view, so the results are fresh tensors, not views: dynamo guards a
        # view's base strides (one more graph)
        tiles = tiles[:, None].to(torch.int8)
        order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
        return tiles.sum(dim=-1, dtype=torch.int32), order.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        anchor = anchors[b, block]
        ctx = (kv_idx < context_len) & (kv_idx < anchor)
        if window is not None:
            ctx = ctx & (anchor + q_idx % block_size - kv_idx < window)
        same = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        return (anchor >= 0) & (ctx | same)

    kv_num, kv_index = as_indices(partial)
    full_num, full_index = as_indices(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_index,
        full_num,
        full_index,
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod,
        seq_lengths=(num_q, num_kv),
    )


_COMPILED: dict[str, object] = {}


def compiled_flex(backend: str = "inductor"):
    """flex_attention compiled once per backend with dynamic shapes (inductor on CUDA; tests use aot_eager)."""
    if backend not in _COMPILED:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        config.fail_on_recompile_limit_hit = True
        _COMPILED[backend] = torch.compile(flex_attention, dynamic=True, backend=backend)
    return _COMPILED[backend]


def _mark_dynamic(q, k, v, mask) -> None:
    """Batch, lengths and tile counts are dynamic from the first compile: `dynamic=True` alone does not reach the
    BlockMask's tensors, and would recompile once per dimension as each is seen to change."""
    for t in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 2)
    for t in (mask.kv_num_blocks, mask.full_kv_num_blocks, mask.q_num_blocks, mask.full_q_num_blocks):
        torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(t, 2)
    for t in (mask.kv_indices, mask.full_kv_indices, mask.q_indices, mask.full_q_indices):
        for dim in (0, 2, 3):
            torch._dynamo.maybe_mark_dynamic(t, dim)


def kernel_for(device: torch.device):
    """The compiled kernel on CUDA; the eager reference implementation elsewhere (exact, and CPU has no
    compiled flex backward)."""
    return compiled_flex() if device.type == "cuda" else flex_attention


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Flex attention of block queries over [context keys, block keys] under the BlockMask `mask`."""
    _mark_dynamic(q, k, v, mask)
    try:
        return kernel_for(q.device)(q, k, v, block_mask=mask, enable_gqa=True)
    except torch._dynamo.exc.FailOnRecompileLimitHit as e:
        raise RuntimeError(
            f"flex attention recompiled {RECOMPILE_LIMIT} times (queries {tuple(q.shape)}, keys "
            f"{tuple(k.shape)}); eager flex would run out of memory. Resume with --attention sparse."
        ) from e
