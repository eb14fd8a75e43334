"""Serving export in the z-lab layout (what SGLang, vLLM and speculators load), and its inverse.

`python -m dflash_ddp.export CHECKPOINT_DIR OUT_DIR [--dtype bfloat16|float32] [--target_model DIR|org/name]`
writes OUT_DIR/config.json and OUT_DIR/model.safetensors with exactly the drafter's trainable tensors (no
embedding, no LM head), in bf16 unless told otherwise, with a `dflash_ddp` stamp saying how it was trained,
and OUT_DIR/README.md, a model card with the hub's metadata header (serving/card.py).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from dflash_ddp.checkpoint.layout import resolve_checkpoint
from dflash_ddp.checkpoint.manifest import read_verified
from dflash_ddp.checkpoint.reader import parse_json, parse_weights, read_json, read_weights
from dflash_ddp.data.chat_template import load_target_tokenizer
from dflash_ddp.data.sources import data_files
from dflash_ddp.drafter.config import DFlashDraftConfig
from dflash_ddp.drafter.families import build_model
from dflash_ddp.drafter.model import DFlashDraftModel, trainable_state_dict
from dflash_ddp.drafter.zlab import from_zlab_config, rope_scaling, to_zlab_config
from dflash_ddp.files import fingerprint_files
from dflash_ddp.hub import ModelSource, hub_model_name, locate_model, named_target
from dflash_ddp.regeneration.parts import settings_path
from dflash_ddp.serving.card import model_card
from dflash_ddp.target_model.text_stack import read_text_stack

# Serving engines run the drafter in the target's dtype (vLLM) or resolve `dtype auto` from the drafter's
# own config (SGLang: an fp32 config becomes float16 there, against a bf16 target); bf16 is what they expect.
SERVING_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def serving_config(
    config: DFlashDraftConfig, dtype: str, stamp: dict | None = None, mask_token: str | None = None
) -> dict:
    """The exported config.json: the z-lab fields plus what the serving engines' loaders read besides."""
    out = to_zlab_config(config)
    out["torch_dtype"] = out["dtype"] = dtype  # older transformers read the first, newer the second
    out["rope_scaling"] = rope_scaling(config.rope_parameters)
    # vLLM (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, get_eagle3_aux_layers_from_config) takes
    # `eagle_aux_hidden_state_layer_ids` as given, and only without it derives them from
    # dflash_config.target_layer_ids + 1; older builds (gpu_model_runner.py's
    # _get_eagle3_aux_layers_from_config) took target_layer_ids without the +1. Its models capture aux id j
    # as the input of decoder layer j (the output of layer j-1; see the layer loop of
    # vllm/model_executor/models/llama.py), so tap L is id L + 1. Written explicitly, every build reads it.
    out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config.target_layer_ids]
    if mask_token is not None:  # older SGLang builds resolve the mask by its token string
        out["dflash_config"]["mask_token"] = mask_token
    if stamp is not None:
        out["dflash_ddp"] = stamp
    return out


def save_drafter(
    model: DFlashDraftModel,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    stamp: dict | None = None,
    mask_token: str | None = None,
) -> None:
    """Write a drafter in the z-lab layout, weights in `dtype` (a key of SERVING_DTYPES), files mode 0644
    (a server often runs as another user than the trainer)."""
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"--dtype {dtype}: choose one of {', '.join(SERVING_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cast = SERVING_DTYPES[dtype]
    tensors = {k: v.to(cast).contiguous().cpu() for k, v in trainable_state_dict(model).items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = serving_config(model.config, dtype, stamp, mask_token)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("model.safetensors", "config.json"):
        os.chmod(out / name, 0o644)


def check_trained_for(directory: Path, target: Path) -> None:
    """A drafter (a checkpoint or an export) against the target it is to run with: ValueError when its record
    (trainer_state.json's fingerprints, or an export's stamp) names another tokenizer, whose token ids mean
    other text. Nothing for a drafter with no record (another project's export). The target's own fingerprint
    is not compared: a run records the one of the shards it read, not the whole model's."""
    if (directory / "trainer_state.json").is_file():
        tokenizer = read_json(directory, "trainer_state.json").get("fingerprints", {}).get("tokenizer")
    else:
        tokenizer = (read_json(directory, "config.json").get("dflash_ddp") or {}).get("tokenizer_fingerprint")
    if tokenizer and tokenizer != fingerprint_files(sorted(target.glob("tokenizer*"))):
        raise ValueError(
            f"{directory} was trained with another tokenizer than {target}'s (fingerprint {tokenizer}): its "
            "token ids would mean other text; evaluate it with the target it was trained for"
        )


def load_drafter(directory: str | Path, device: str | torch.device = "cpu") -> DFlashDraftModel:
    """Load a drafter from an exported directory or a training checkpoint (its files checked against its
    manifest, as every reader of a checkpoint does); keys must match exactly."""
    directory = Path(directory)
    for name in ("config.json", "model.safetensors"):
        if not (directory / name).is_file():
            raise ValueError(
                f"{directory}: no {name} (expected an exported drafter or a checkpoint directory)"
            )
    if (directory / "trainer_state.json").is_file():  # a checkpoint: the bytes its manifest vouches for
        files = read_verified(directory, ("config.json", "model.safetensors"))
        config = parse_json(files["config.json"], directory / "config.json")
        weights = parse_weights(files["model.safetensors"], directory / "model.safetensors")
        return drafter_from_state(config, weights, directory, device)
    config = read_json(directory, "config.json")
    return drafter_from_state(config, read_weights(directory), directory, device)


def drafter_from_state(
    config: dict, state: dict[str, torch.Tensor], directory: str | Path, device: str | torch.device = "cpu"
) -> DFlashDraftModel:
    """A drafter from a parsed config.json and model.safetensors tensors (read from `directory`, named in
    errors); keys and shapes must match exactly."""
    model = build_model(from_zlab_config(config, f"{directory}/config.json"))
    expected = set(trainable_state_dict(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{directory}/model.safetensors: missing keys {missing}, unexpected keys {unexpected}"
        )
    own = trainable_state_dict(model)
    bad = [
        f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if state[k].shape != own[k].shape
    ]
    if bad:
        raise ValueError(f"{directory}/model.safetensors: shapes do not match its config.json: {bad}")
    model.load_state_dict(
        state, strict=False
    )  # buffers (rope tables) are not stored; every weight was checked
    return model.to(device).eval()


def package_version() -> str:
    """This package's installed version (what the stamp records)."""
    try:
        return importlib.metadata.version("dflash_ddp")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without `pip install -e .`
        return "unknown (not installed)"


def regeneration_settings(data: list[str]) -> tuple[dict, list[str]]:
    """{data file: the settings the regenerate tool wrote beside it} for the training data files that came
    from it, and notes for what could not be read."""

    try:
        files = data_files(data)
    except ValueError as e:
        return {}, [f"note: {e}; the stamp has no regeneration settings"]
    found = {}
    for file in files:
        path = settings_path(file)
        if path.is_file():
            try:
                found[str(file)] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: unreadable ({e}); delete it or regenerate {file}") from None
    return found, []


def training_stamp(
    ckpt: Path, target_model: str | None, mask_id: int
) -> tuple[dict, str | None, list[str], ModelSource]:
    """The `dflash_ddp` stamp of a checkpoint, the mask id's token string (None when the id has no token,
    e.g. an unused padded row), notes to print, and where the target's files are (a hub name's config and
    tokenizer are read from the hub cache, or downloaded into it).

    A server compares the stamp with how it serves: the target (fingerprint of config and weights), the chat
    template (sha256 of its text) and its arguments (thinking on or off), and how the data was generated."""

    where = ckpt / "trainer_state.json"
    state = read_json(ckpt, "trainer_state.json")
    try:
        cfg, fingerprints = state["config"], state["fingerprints"]
        recorded_target, template_file = cfg["target_model"], cfg["chat_template"]
        stamp = {
            "version": package_version(),
            "global_step": state["global_step"],
            "target_fingerprint": fingerprints["target"],
            "tokenizer_fingerprint": fingerprints["tokenizer"],
            "data_fingerprint": fingerprints["data"],
            "chat_template_kwargs": cfg["chat_template_kwargs"],
            "target_model": target_model or cfg["target_model"],
            "target_commit": fingerprints.get("target_commit"),  # absent before hub names: a local target
        }
        if state.get("init_from"):  # the drafter it started from (--init_from)
            stamp["init_from"] = state["init_from"]
        data = cfg["data"]
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e}") from None
    name = target_model or recorded_target
    if hub_model_name(name) is None and not Path(name).is_dir():
        raise ValueError(
            f"the target {name} (recorded in {where}) is not there; the stamp needs its tokenizer: "
            "pass --target_model DIR (or its hub name)"
        )
    source = locate_model(name)
    target = source.path
    now = fingerprint_files(sorted(target.glob("tokenizer*")))
    if now != fingerprints["tokenizer"]:
        raise ValueError(
            f"the tokenizer of {target} is not the one the drafter was trained with (fingerprint {now}, "
            f"trained with {fingerprints['tokenizer']}); pass --target_model with the training target"
        )
    stack = read_text_stack(target)
    stamp["target_model_type"], stamp["target_architecture"] = stack.config.model_type, stack.architecture
    tokenizer = load_target_tokenizer(target, template_file)
    stamp["chat_template_sha256"] = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()
    stamp["regeneration"], notes = regeneration_settings(data)
    mask_token = tokenizer.convert_ids_to_tokens(mask_id) if mask_id < len(tokenizer) else None
    return stamp, mask_token, notes, source


# what an export writes: a directory holding these alone (and an export's config) is one to write again
EXPORT_FILES = ("config.json", "model.safetensors", "README.md")


def check_export_dir(out: Path, source: Path) -> str:
    """Refuse an output directory whose files an export would overwrite or mix with: the source itself or a
    directory holding it, a training run or checkpoint, a model or any folder that is not an earlier export.
    An empty or new directory is fine, and so is an earlier export, written again: the note then says what
    it held ("" otherwise)."""
    out, source = out.resolve(), source.resolve()
    if out.is_file():
        raise ValueError(f"{out}: a file; name a new directory to export into")
    if out == source or out in source.parents:
        raise ValueError(f"{out}: holds the checkpoint being exported, {source}; name a new directory")
    if not out.is_dir() or not any(out.iterdir()):
        return ""
    if (
        (out / "manifest.json").exists()
        or (out / "trainer_state.json").exists()
        or (out / "checkpoints").exists()
    ):
        raise ValueError(
            f"{out}: a training checkpoint or run; exporting there would overwrite it: name a new directory"
        )
    others = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES)
    earlier = (out / "config.json").is_file() and "dflash_config" in read_json(out, "config.json")
    if others or not earlier:
        shown = ", ".join(others[:5]) or "a config.json that is not a drafter's"
        raise ValueError(
            f"{out}: not empty and not an earlier export ({shown}); exporting there would overwrite or mix with "
            "its files: name an empty or new directory"
        )
    config = read_json(out, "config.json")
    held = ", ".join(config.get("architectures") or ["a drafter"])
    step = (config.get("dflash_ddp") or {}).get("global_step")
    return f"note: {out} held an earlier export ({held}{f' of step {step}' if step is not None else ''}): replaced"


def export_checkpoint(
    checkpoint_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16", target_model: str | None = None
) -> tuple[Path, list[str]]:
    """Checkpoint directory (or an output directory: the checkpoint `latest` names) -> serving directory.

    A checkpoint gets the stamp from its trainer_state.json; an exported drafter keeps the stamp and mask
    token it has. Returns the source directory and notes to print."""

    if dtype not in SERVING_DTYPES:
        raise ValueError(f"--dtype {dtype}: choose one of {', '.join(SERVING_DTYPES)}")
    ckpt = resolve_checkpoint(Path(checkpoint_dir))
    replaced = check_export_dir(Path(out_dir), ckpt)
    model = load_drafter(ckpt)
    if (ckpt / "trainer_state.json").is_file():
        stamp, mask_token, notes, source = training_stamp(ckpt, target_model, model.config.mask_token_id)
        target_name, target_dir = stamp["target_model"], source.path
    else:
        exported = read_json(ckpt, "config.json")
        stamp, mask_token = exported.get("dflash_ddp"), exported.get("dflash_config", {}).get("mask_token")
        notes = (
            [] if stamp else [f"note: {ckpt} has no trainer_state.json: exported without a dflash_ddp stamp"]
        )
        target_name, target_dir = target_model or (stamp or {}).get("target_model"), None
    notes += [replaced] if replaced else []
    save_drafter(model, out_dir, dtype, stamp, mask_token)
    config = json.loads((Path(out_dir) / "config.json").read_text())
    card = Path(out_dir) / "README.md"
    card.write_text(model_card(config, ckpt, Path(out_dir), target_name, target_dir))
    os.chmod(card, 0o644)
    return ckpt, notes


def main(argv: list[str] | None = None) -> int:
    """CLI: 0 on success, 2 when the source cannot be read or exported (one line naming the file) or on bad
    arguments, as train and evaluate exit on bad input."""
    parser = argparse.ArgumentParser(prog="python -m dflash_ddp.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="a checkpoint, an output directory (its latest) or an export")
    parser.add_argument("out_dir", help="where config.json and model.safetensors are written")
    parser.add_argument(
        "--dtype",
        choices=list(SERVING_DTYPES),
        default="bfloat16",
        help="weight dtype, stated in config.json (default bfloat16, what serving engines run)",
    )
    parser.add_argument(
        "--target_model",
        default=None,
        type=named_target,
        help="the target's directory or hub name when it moved since training (default: the one the run recorded)",
    )
    args = parser.parse_args(argv)
    try:
        source, notes = export_checkpoint(args.checkpoint_dir, args.out_dir, args.dtype, args.target_model)
    except (ValueError, OSError, SafetensorError) as e:  # bad input, or a directory that cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    print(f"exported {source} -> {args.out_dir} (config.json, model.safetensors in {args.dtype}, README.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
