"""Why a comparison row of the evaluation is left out for a target or a drafter, in one line each: the rows
that transformers' own decoding runs (prompt lookup, transformers' DFlash generate) where it cannot run on the
target as it is, and the sampled row where the drafter's family has none."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from dflash_ddp.evaluation.decoding import crop_rolls_back, new_target_cache
from dflash_ddp.evaluation.report import family_label
from dflash_ddp.evaluation.sampling import Sampling
from dflash_ddp.target_model.forward_code import hyper_connection_streams, residual_streams

# the greedy evaluation's row at temperature 1.0: this drafter with speculative sampling, prompt i seeded with
# SAMPLED_ROW.seed + i (lossless in distribution, so not compared token for token)
SAMPLED_ROW = Sampling(temperature=1.0, top_p=1.0, seed=0)
# transformers' generate drafts with a DFlash drafter with full attention only (speculation_type="dflash"):
# another drafter has no transformers row, and the report says why
NO_TRANSFORMERS_ROW = "transformers' generate runs DFlash drafters only: no transformers row for a {} drafter"
NO_TRANSFORMERS_WINDOW = (
    "transformers' generate runs DFlash drafters with full attention only: no transformers row for a drafter "
    "with sliding-window layers"
)


def assisted_decoding_note(target, block_size: int) -> str | None:
    """Why transformers' assisted decoding (the prompt-lookup and transformers rows, verifying up to
    `block_size` positions) cannot run on this target, or None when it can: it crops the target's cache after
    each verify, and some caches cannot be cropped, or a crop does not roll them back (`crop_rolls_back`)."""
    if crop_rolls_back(target, block_size):
        return None
    cache = new_target_cache(target)
    if not cache.is_croppable:
        why = "compressed attention" if type(cache) is DynamicCache else f"its own {type(cache).__name__}"
    else:
        why = "its recurrent layers keep fewer states than a crop reads"
    return (
        f"transformers' assisted decoding crops the target's cache, which model type "
        f"'{target.config.get_text_config(decoder=True).model_type}' cannot ({why}): no prompt_lookup or "
        "transformers rows; this project's decoder restores a copy of the cache instead"
    )


def hyper_connection_note(target) -> str | None:
    """Why transformers' DFlash generate cannot run a drafter of this target, or None when it can: it hands the
    drafter a hyper-connection model's residual streams as they are ([.., streams, hidden]), not their mean,
    and cuts Gemma 3n's AltUp streams ([streams, batch, positions, hidden]) as if they were a batch: never the
    hidden states read out of them that the drafter is trained on."""
    streams = residual_streams(target.config)
    if streams == 1:
        return None
    trained = (
        "their mean, as vLLM feeds it" if hyper_connection_streams(target.config) > 1 else "their readout"
    )
    return (
        f"transformers' DFlash generate passes the drafter all {streams} residual streams of model type "
        f"'{target.config.get_text_config(decoder=True).model_type}', not {trained}: no transformers row"
    )


def _generation_positions(target) -> torch.Tensor:
    """The position ids transformers' generation prepares for a 2-token prompt of `target`."""
    prompt = torch.zeros(1, 2, dtype=torch.long, device=target.device)
    return target._prepare_position_ids_for_generation(prompt, {"attention_mask": torch.ones_like(prompt)})


def generation_note(target) -> str | None:
    """Why transformers' `generate` (the prompt-lookup and transformers rows) cannot run on this target, or
    None when it can: it cannot even prepare a text prompt's position ids (Qwen3-Omni's thinker reads a
    `vision_start_token_id` its config does not define)."""
    if "position_ids" not in inspect.signature(target.forward).parameters:
        return None
    try:
        _generation_positions(target)
    except (AttributeError, TypeError, ValueError) as e:
        model_type = target.config.get_text_config(decoder=True).model_type
        return (
            f"transformers' generate cannot prepare a text prompt's position ids for model type '{model_type}' "
            f"({type(e).__name__}: {e}): no prompt_lookup or transformers rows"
        )
    return None


def position_ids_note(target) -> str | None:
    """Why transformers' DFlash generate cannot run on this target, or None when it can: it hands the drafter
    the target's position ids, which a target with ALiBi takes none of (BLOOM, MPT), and slices them as
    [batch, positions], which a vision-language target decoded as its wrapper gives as rows of multimodal
    rotary positions ([rows, batch, positions]: Qwen2-VL to Qwen3-VL, GLM-4.5V), asked of its generation."""
    model_type = target.config.get_text_config(decoder=True).model_type
    if "position_ids" not in inspect.signature(target.forward).parameters:
        return (
            f"transformers' DFlash generate reads the target's position ids, which model type '{model_type}' "
            "takes none of (ALiBi): no transformers row"
        )
    if generation_note(target) or _generation_positions(target).dim() <= 2:
        return None
    rows = _generation_positions(target).shape[0]
    return (
        f"transformers' DFlash generate slices the target's position ids as [batch, positions], which model type "
        f"'{model_type}' gives as {rows} rows of multimodal rotary positions: no transformers row"
    )


def sampled_row_note(config) -> str | None:
    """Why the greedy evaluation has no row at temperature 1.0 for this drafter, or None when it has one."""
    if config.family == "dflash2":
        return "no row at temperature 1.0: DFlash2's selector walk is not sampled here yet"
    return None


def transformers_note(config) -> str | None:
    """Why transformers' generate cannot run this drafter, or None when it can."""
    if config.family != "dflash":
        return NO_TRANSFORMERS_ROW.format(family_label(config.family))
    return NO_TRANSFORMERS_WINDOW if config.slides else None


def past_positions_note(target, prompts: list[tuple[str, list[int]]], max_new_tokens: int) -> str | None:
    """How many prompts run past the positions the target's config declares, with their new tokens (the
    target answers them out of its range: one may end after prefill, with no verify step, and leave no trace
    in the tau tables), or None when none does."""
    limit = getattr(target.config.get_text_config(decoder=True), "max_position_embeddings", None)
    past = sum(len(ids) + max_new_tokens > limit for _, ids in prompts) if limit else 0
    if not past:
        return None
    return (
        f"{past} of {len(prompts)} prompts run past the target's {limit} positions (its max_position_embeddings) "
        "with --max_new_tokens: it answers them out of its range, and one that ends after prefill has no "
        "verify step to count"
    )
