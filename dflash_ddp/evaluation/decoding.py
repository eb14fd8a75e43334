"""Greedy and speculative decoding with a DFlash drafter: the project's own block-draft/verify loop, plain
greedy decoding (the ground truth) and transformers' generate, each counting target verify steps.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.families import build_model
from dflash_ddp.drafter.model import DFlashDraftModel
from dflash_ddp.evaluation.sampling import Sampling, accept_drafts, draw, token_probs
from dflash_ddp.target_model.features import (
    capture_layer_outputs,
    decoder_layers,
    last_layer_norm,
    stream_readout,
)
from dflash_ddp.target_model.forward_code import own_cache_class
from dflash_ddp.target_model.head import embed_as_target


@dataclass
class DecodeResult:
    """One greedy decoding of one prompt."""

    tokens: list[int]  # generated tokens, prompt excluded, ending at the first EOS or at max_new_tokens
    seconds: float  # wall time, prefill included
    target_forwards: int  # calls of the target's forward
    accepted: list[int] = field(default_factory=list)  # tokens committed per verify step (bonus included)
    contexts: list[int] = field(default_factory=list)  # tokens before each verify step's block
    # a drafter with a confidence head (DSpark): each drafted position the decoding reached, as (position in
    # the block from 1, the predicted acceptance, whether it was accepted), and the drafts not verified
    calibration: list[tuple[int, float, bool]] = field(default_factory=list)
    drafts_skipped: int = 0


# Context lengths (tokens before a block) that tau is reported by: (first, end or None, name)
CONTEXT_BUCKETS = ((0, 2048, "0-2K"), (2048, 8192, "2K-8K"), (8192, 32768, "8K-32K"), (32768, None, "32K+"))


def context_bucket(tokens_before: int) -> str:
    """The CONTEXT_BUCKETS name of a block with `tokens_before` tokens of context."""
    return next(name for first, end, name in CONTEXT_BUCKETS if end is None or tokens_before < end)


def tau_by_context(results: Iterable[DecodeResult]) -> tuple[dict[str, float], dict[str, int]]:
    """tau per context bucket ({bucket: tokens committed per verify step}) over every verify step of
    `results`, and the verify steps in each; buckets without a step are left out."""
    committed: dict[str, int] = {}
    steps: dict[str, int] = {}
    for result in results:
        for before, length in zip(result.contexts, result.accepted, strict=True):
            bucket = context_bucket(before)
            committed[bucket] = committed.get(bucket, 0) + length
            steps[bucket] = steps.get(bucket, 0) + 1
    order = [name for _, _, name in CONTEXT_BUCKETS if name in steps]
    return {b: committed[b] / steps[b] for b in order}, {b: steps[b] for b in order}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_input(prompt_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).view(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty")
    return ids


def _commit(new: list[int], room: int, eos: set[int]) -> list[int]:
    """The part of `new` a greedy decoder would emit: at most `room` tokens, ending at the first EOS."""
    new = new[:room]
    for i, token in enumerate(new):
        if token in eos:
            return new[: i + 1]
    return new


class _Chooser:
    """The next token from logits: the argmax, or with `sampling` a draw from the filtered softmax."""

    def __init__(self, sampling: Sampling | None, device: torch.device):
        self.sampling = sampling
        self.generator = sampling.generator(device) if sampling else None

    def __call__(self, logits: torch.Tensor) -> int:
        if self.sampling is None:
            return int(logits.argmax())
        return int(draw(token_probs(logits, self.sampling), self.generator))

    def draw_from(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts from rows of logits [n, V]: (tokens [n], the filtered distributions [n, V] drawn from)."""
        probs = token_probs(logits, self.sampling)
        return draw(probs, self.generator), probs


def new_target_cache(target: nn.Module) -> DynamicCache:
    """An empty cache of the kind the target's forward takes: transformers' shared one, or the family's own
    where its forward insists on it (MiniMax's `MiniMaxCache`, a DynamicCache that cannot be cropped)."""
    own = own_cache_class(target.config)
    return DynamicCache(config=target.config) if own is None else own()


@torch.inference_mode()
def greedy_generate(
    target: nn.Module,
    prompt_ids,
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
    sampling: Sampling | None = None,
) -> DecodeResult:
    """Plain decoding with a KV cache, one target forward per token, timed: greedy, or with `sampling` the
    target's own sampling (the distribution speculative sampling must reproduce)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = target.device
    ids = _as_input(prompt_ids, device)
    eos = set(eos_token_ids)
    cache = new_target_cache(target)
    choose = _Chooser(sampling, device)
    _sync(device)
    start = time.perf_counter()
    logits = target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    tokens = [choose(logits[0, -1])]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        step = torch.tensor([[tokens[-1]]], device=device)
        logits = target(input_ids=step, cache=cache, use_cache=True).logits
        tokens.append(choose(logits[0, -1]))
    _sync(device)
    return DecodeResult(tokens, time.perf_counter() - start, target_forwards=len(tokens))


# per target and verify length: whether a crop of its cache rolls it back (`crop_rolls_back`), checked once
_ROLLS_BACK: weakref.WeakKeyDictionary[nn.Module, dict[int, bool]] = weakref.WeakKeyDictionary()


def crop_rolls_back(target: nn.Module, block_size: int) -> bool:
    """Whether cropping the target's cache after a verify of `block_size` positions puts it back as it was.
    Some caches cannot be cropped (DeepSeek V4's compressed keys), and some families' recurrent layers keep
    fewer states than the cache's crop reads (Zamba v1 records one a forward): transformers' crop then stops,
    or restores another state. Checked once per target and block size, for a verify that keeps one position
    and one that keeps all but one: the crop, then 2 more positions, give the logits of one forward of the
    same positions. A target whose forward keeps its state outside the cache is refused (`_check_cache`)."""
    known = _ROLLS_BACK.setdefault(target, {})
    if block_size not in known:
        _check_cache(target)
        known[block_size] = new_target_cache(target).is_croppable and all(
            _crop_continues_as_one_forward(target, block_size, removed) for removed in {1, block_size - 1}
        )
    return known[block_size]


@torch.inference_mode()
def _check_cache(target: nn.Module) -> None:
    """The decoder rolls back what the target's cache holds: a target whose forward keeps its state elsewhere
    (transformers' RecurrentGemma keeps its recurrent state on its modules, and its cache counts no
    positions) cannot be rolled back after a verify, and is refused in one line."""
    cache = new_target_cache(target)
    target(input_ids=torch.full((1, 3), 4, device=target.device), cache=cache, use_cache=True)
    held = int(cache.get_seq_length())
    if held != 3:
        raise ValueError(
            f"model type '{target.config.get_text_config(decoder=True).model_type}' keeps its state outside the "
            f"cache its forward is given (after 3 positions the cache counts {held}): no decoder can roll it "
            "back after a verify, so it cannot be evaluated by speculative decoding; training reads its forward "
            "without a cache and is not affected"
        )


@torch.inference_mode()
def _crop_continues_as_one_forward(target: nn.Module, block_size: int, removed: int) -> bool:
    cache = new_target_cache(target)
    vocab = target.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(4, 200, (1, 3 + block_size + 2), generator=torch.Generator().manual_seed(0)) % vocab
    ids = ids.to(target.device)
    target(input_ids=ids[:, :3], cache=cache, use_cache=True)
    cache.activate_past_recording(recurrent_states_to_keep=block_size)  # as VerifiedCache's
    target(input_ids=ids[:, 3 : 3 + block_size], cache=cache, use_cache=True)
    try:
        cache.crop(-removed)
    except (IndexError, TypeError):  # a recurrent layer without the states the crop reads
        return False
    kept = 3 + block_size - removed
    continued = target(input_ids=ids[:, kept : kept + 2], cache=cache, use_cache=True).logits.float()
    whole = target(input_ids=ids[:, : kept + 2], use_cache=False).logits[:, kept:].float()
    # on average over the logits: a cached and a cacheless forward round apart (in bf16, and where an MoE
    # routes a position otherwise, at some logits by more), another state moves them all
    return bool((continued - whole).abs().mean() <= 0.02 * whole.abs().mean() + 1e-6)


class VerifiedCache:
    """The target's cache across verify steps, rolled back to the committed prefix after each: cropped, or
    where a crop does not roll it back (`crop_rolls_back`: DeepSeek V4's compressed keys, Zamba's (v1)
    recurrent layers) restored from a copy taken before the verify and advanced over the committed tokens
    again."""

    def __init__(self, cache: DynamicCache, block_size: int, croppable: bool):
        self.cache = cache
        self.block_size = block_size
        self.croppable = croppable
        self.recording = False
        self.before: DynamicCache | None = None

    def before_verify(self) -> None:
        if not self.croppable:
            self.before = copy.deepcopy(self.cache)
        elif not self.recording:
            # lets `crop` roll back sliding-window layers, and linear-attention / Mamba layers to any of the
            # last block_size states (a recurrent state cannot be cut like keys and values), as transformers
            # does: after the prefill, whose every position's states it would keep otherwise
            self.cache.activate_past_recording(recurrent_states_to_keep=self.block_size)
            self.recording = True

    def keep(self, target: nn.Module, block: torch.Tensor, kept: int) -> None:
        """Keep the first `kept` positions of the verified `block` in the cache (the tapped layers' outputs
        at them are captured again where the verify is run anew)."""
        if self.croppable:
            # a crop of 0 too, as transformers does: it drops the states recorded for the verify, and a
            # sliding-window layer's keys beyond its window
            self.cache.crop(kept - block.shape[1])
        elif kept < block.shape[1]:
            self.cache = self.before
            target(input_ids=block[:, :kept], cache=self.cache, use_cache=True)


@torch.inference_mode()
def speculative_generate(  # noqa: PLR0913 - the decoding's inputs, each named
    target: nn.Module,
    drafter: nn.Module,
    prompt_ids,
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
    sampling: Sampling | None = None,
    confidence_threshold: float = 0.0,
) -> DecodeResult:
    """Block-draft/verify decoding (batch size 1): greedy, lossless with respect to `greedy_generate`; with
    `sampling`, speculative sampling (sampling.py), lossless in distribution with respect to
    `greedy_generate(..., sampling=...)`: the drafts are drawn from the drafter's `draft_logits` and accepted
    by the rejection rule. A drafter with a confidence head (DSpark) has its drafts verified only up to the
    first position whose predicted acceptance is below `confidence_threshold` (0: all of them), which saves
    verify tokens and stays lossless (fewer drafts, the same rule).

    The target prefills the prompt; the outputs of its tapped layers at every prompt position are the first
    context. Each cycle the drafter sees the new context features (positions not yet in its cache) and the block
    `[anchor, MASK, ...]` at positions anchor_pos.. anchor_pos+block_size-1, where the anchor is the last committed
    token; the drafter's `draft_tokens` turns outputs 1.. into block_size-1 draft tokens (DFlash: the target
    LM head's argmax at each; DFlash2: its selector's greedy walk from the anchor). One target forward verifies
    `[anchor, drafts]`; the longest prefix of drafts equal to the target's own greedy choices is accepted, plus the
    target's next token (the bonus). Both KV caches are cropped back to the committed prefix, and the tapped
    outputs of the committed verified positions (anchor and accepted drafts) become the next new context.

    `drafter` is called as transformers' DFlash candidate generator calls it and needs `config.block_size`,
    `config.mask_token_id`, `config.target_layer_ids`, `bind_target`, `draft_tokens`, `confidences` and, to
    sample, `sample_drafts` (DFlashDraftModel's). Returns the generated tokens, the number of tokens committed
    by each verify step (bonus included, cut at EOS / max_new_tokens like the tokens), the tokens of context
    before each step's block, and wall time.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    config = drafter.config
    block_size, layer_ids = config.block_size, list(config.target_layer_ids)
    device = target.device
    ids = _as_input(prompt_ids, device)
    eos = set(eos_token_ids)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter.bind_target(embed)
    # the block's embeddings as the drafter trained on them: the rows times the target's scale (the module
    # itself would scale Gemma's rows once more on top, and Falcon-H1 scales in its forward, not there)
    scale = getattr(config, "input_embedding_scale", 1.0)
    masks = torch.full((1, block_size - 1), config.mask_token_id, dtype=torch.long, device=device)
    target_cache, drafter_cache = (
        VerifiedCache(new_target_cache(target), block_size, crop_rolls_back(target, block_size)),
        DynamicCache(),
    )
    accepted: list[int] = []
    contexts: list[int] = []
    calibration: list[tuple[int, float, bool]] = []
    skipped = 0
    _sync(device)
    start = time.perf_counter()
    layers = decoder_layers(target)
    final_norm = last_layer_norm(target, layer_ids, len(layers))
    # the last position's logits only, named by index: an integer would let Gemma 4 run its KV-shared
    # layers on the last position alone, and those layers' outputs at every prompt position are context
    last = torch.tensor([ids.shape[1] - 1], device=device)
    with capture_layer_outputs(
        layers, layer_ids, stop_after_last=False, final_norm=final_norm, readout=stream_readout(target)
    ) as captured:
        logits = target(input_ids=ids, cache=target_cache.cache, use_cache=True, logits_to_keep=last).logits
        context = torch.cat([captured[i] for i in layer_ids], dim=-1)
        context_start = 0  # position of context[:, 0]
        choose = _Chooser(sampling, device)
        tokens = [choose(logits[0, -1])]
        while len(tokens) < max_new_tokens and tokens[-1] not in eos:
            anchor_pos = ids.shape[1] + len(tokens) - 1  # the anchor's own target features do not exist yet
            anchor = torch.tensor([[tokens[-1]]], device=device)
            positions = torch.arange(context_start, anchor_pos + block_size, device=device)[None]
            hidden = drafter(
                noise_embeds=embed_as_target(embed.weight, torch.cat([anchor, masks], dim=1), scale),
                context_hidden_states=context,
                position_ids=positions,
                cache=drafter_cache,
            ).last_hidden_state
            # The cache must hold context only: the next block is written at new positions with a new anchor.
            drafter_cache.crop(-block_size)
            if sampling is None:
                drafts, draft_probs = drafter.draft_tokens(hidden, head, anchor), None
            else:
                drafts, draft_probs = drafter.sample_drafts(hidden, head, anchor, choose.draw_from)
            confidence = drafter.confidences(hidden, torch.cat([anchor[0], drafts[0, :-1]]))
            if confidence is not None and confidence_threshold > 0:
                low = (confidence < confidence_threshold).nonzero().flatten()
                if len(low):  # verify up to the first position predicted below the threshold
                    skipped += drafts.shape[1] - int(low[0])
                    drafts = drafts[:, : int(low[0])]
                    draft_probs = None if draft_probs is None else draft_probs[: int(low[0])]
            block = torch.cat([anchor, drafts], dim=1)
            target_cache.before_verify()
            verified = target(input_ids=block, cache=target_cache.cache, use_cache=True)
            if sampling is None:
                choices = verified.logits[0].argmax(dim=-1)  # choices[k]: the target's token after input k
                num_ok = int((drafts[0] == choices[:-1]).long().cumprod(dim=0).sum())
                committed = choices[: num_ok + 1].tolist()
            else:
                target_probs = token_probs(verified.logits[0], sampling)
                num_ok, committed = accept_drafts(drafts[0], draft_probs, target_probs, choose.generator)
            new = _commit(committed, max_new_tokens - len(tokens), eos)
            accepted.append(len(new))
            contexts.append(anchor_pos)
            tokens += new
            if confidence is not None:  # the positions reached: every one before them was accepted
                reached = range(min(num_ok + 1, drafts.shape[1]))
                calibration += [(j + 1, float(confidence[j]), j < num_ok) for j in reached]
            # The anchor and the accepted drafts stay in the target cache; the bonus token is the next anchor.
            target_cache.keep(target, block, num_ok + 1)
            context = torch.cat([captured[i] for i in layer_ids], dim=-1)[:, : num_ok + 1]
            context_start = anchor_pos
    _sync(device)
    return DecodeResult(
        tokens,
        time.perf_counter() - start,
        1 + len(accepted),
        accepted=accepted,
        contexts=contexts,
        calibration=calibration,
        drafts_skipped=skipped,
    )


@torch.inference_mode()
def transformers_generate(
    target: nn.Module, prompt_ids, max_new_tokens: int, eos_token_ids: Iterable[int] = (), **generate_kwargs
) -> DecodeResult:
    """`target.generate(..., do_sample=False)` with extra arguments (an assistant, prompt lookup), timed, with
    the target's forward calls counted: every call after a plain prefill verifies one set of candidates."""
    device = target.device
    ids = _as_input(prompt_ids, device)
    eos = sorted(set(eos_token_ids))
    calls = 0

    def count(_module, _args):
        nonlocal calls
        calls += 1

    handle = target.register_forward_pre_hook(count)
    try:
        _sync(device)
        start = time.perf_counter()
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,  # never used at batch size 1; set to silence a warning
            use_cache=True,  # assisted decoding needs one, whatever the checkpoint says (MPT ships use_cache false)
            **generate_kwargs,
        )
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        handle.remove()
    tokens = _commit(out[0, ids.shape[1] :].tolist(), max_new_tokens, set(eos))
    return DecodeResult(tokens, seconds, target_forwards=calls)


def as_transformers_assistant(drafter: DFlashDraftModel, target: nn.Module) -> DFlashDraftModel:
    """The drafter on the target's device and in its dtype, as `target.generate(assistant_model=drafter,
    speculation_type="dflash")` needs: its candidate generator applies the target's LM head to the drafter's
    output without casting it (an fp32 drafter with a bf16 target fails with a dtype error).

    Returns `drafter` itself when it already matches, else a converted copy (the input is never modified).
    Only the weights are cast: `Module.to(dtype)` would also round the fp32 rotary frequency buffer to bf16,
    which shifts RoPE angles at long positions.
    """
    device, dtype = target.device, target.dtype
    if all(p.device == device and p.dtype == dtype for p in drafter.parameters()):
        return drafter
    converted = copy.deepcopy(drafter).to(device)
    for p in converted.parameters():
        p.data = p.data.to(dtype)
    return converted.eval()


def untrained_drafter(config: DFlashDraftConfig, seed: int = 0) -> DFlashDraftModel:
    """A freshly initialised drafter of the same family and shape (seeded, without touching the global RNG)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(copy.deepcopy(config)).eval()
