"""Hugging Face hub names for targets (`org/name[@revision]`) and datasets (`org/name[:split]`), resolved
through the user's hub cache with huggingface_hub as transformers does; a local path always wins.

Only what a run needs is downloaded: the config, tokenizer and chat-template files first, then the
safetensors shards holding the layers the run executes (the index file says which), and of a checkpoint
that wraps its text model (a vision-language model) only the text model's shards (`TextWeights`). With
HF_HUB_OFFLINE=1 the cache alone is read. Every failure is one ValueError line saying what to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

EMBEDDED_NAME = "embedded"  # --target_model embedded: the tiny target shipped in the package, by name
EMBEDDED_TARGET = Path(__file__).resolve().parent / "assets" / "tiny_qwen3"

# A repository id: one owner and one name, each of letters, digits, '-', '_' and '.'.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Everything of a model repository a run reads besides its weights.
MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "*.jinja",
    "chat_template*",
    "model.safetensors.index.json",
    "README.md",
]
WEIGHTS_INDEX = "model.safetensors.index.json"
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
# a text model's decoder layers, under the names families give them: Llama's and most; GPT-2's family, Falcon
# and BLOOM; MPT
LAYER_LISTS = ("layers", "h", "blocks")
LAYER_OF_WEIGHT = re.compile(rf"(?:^|\.)(?:{'|'.join(LAYER_LISTS)})\.(\d+)\.")  # Mistral Large 3: `layers.N.`


@dataclass(frozen=True)
class TextWeights:
    """The tensors of a checkpoint that target ranks load: those under `prefixes`, the module names of its
    text model, of its input embedding and of its LM head (the three coincide or nest in a causal LM; Mistral
    3 keeps its head at `language_model.lm_head`, beside its text model `language_model.model`). Everything
    else in the files (a vision or audio tower, a projector, multi-token-prediction heads) is never read.

    Built from the names target_model/text_stack.py finds through the model's own classes
    (`TextStack.weights_read`: its `prefix`, `embed_tensor` and `head_tensor`, or where the files name the text
    model otherwise, the prefixes found by renaming them as transformers loads them), so that no family's
    names are written here. A prefix may be a whole tensor's name."""

    prefixes: tuple[str, ...]

    @classmethod
    def of(cls, prefix: str, embed_tensor: str, head_tensor: str) -> TextWeights:
        modules = [prefix, embed_tensor.rpartition(".")[0], head_tensor.rpartition(".")[0]]
        return cls(tuple(dict.fromkeys(m for m in modules if m)))

    def holds(self, tensor: str) -> bool:
        return any(tensor == prefix or tensor.startswith(f"{prefix}.") for prefix in self.prefixes)

    def part_of(self, tensor: str) -> str:
        """The outermost module of `tensor` outside the text model (`model.visual` for
        `model.visual.blocks.0.attn.qkv.weight` beside `model.language_model`), to name what is skipped."""
        parts = tensor.split(".")
        for end in range(1, len(parts)):
            module = ".".join(parts[:end])
            if not any(f"{prefix}.".startswith(f"{module}.") for prefix in self.prefixes):
                return module
        return tensor


@dataclass(frozen=True)
class ModelSource:
    """Where a target's files are: a local directory, or a snapshot of a hub repository at one commit."""

    name: str  # as the user gave it
    path: Path
    repo_id: str | None = None  # None: a local directory
    revision: str | None = None
    commit: str | None = None


def hub_model_name(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when `name` is a hub name (`org/name[@revision]`) and no local path, else None."""
    if not name or Path(name).exists():
        return None
    repo_id, _, revision = name.partition("@")
    if not REPO_ID.fullmatch(repo_id) or (revision == "" and "@" in name):
        return None
    return repo_id, revision or None


def named_target(name: str) -> str:
    """`--target_model` of the tools beside training (evaluate, regenerate): the name `embedded` is the tiny
    target shipped in the package, as training's preset names it; anything else as given."""
    return str(EMBEDDED_TARGET) if name == EMBEDDED_NAME else name


def hub_dataset_name(spec: str) -> tuple[str, str] | None:
    """(repo id, split) when `spec` is a hub dataset (`org/name[:split]`) and no local path, else None."""
    if not spec or Path(spec).exists() or any(c in spec for c in "*?["):
        return None
    repo_id, _, split = spec.partition(":")
    if not REPO_ID.fullmatch(repo_id) or Path(repo_id).suffix.lower() in DATA_SUFFIXES:
        return None
    return repo_id, split or "train"


def cache_dir() -> Path:
    """The hub cache this process reads (HF_HUB_CACHE, or HF_HOME/hub, or ~/.cache/huggingface/hub)."""
    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE)


def download(
    repo_id: str,
    revision: str | None,
    patterns: list[str],
    repo_type: str = "model",
    flag: str = "--target_model",
    local_only: bool = False,
) -> Path:
    """The snapshot folder of `repo_id` at `revision` holding the files matching `patterns`, downloaded into
    the hub cache unless they are there (or offline: read from the cache only). Errors are one line."""
    what = f"{flag} {repo_id}" + (f"@{revision}" if revision and repo_type == "model" else "")
    kind = "dataset" if repo_type == "dataset" else "model"
    try:
        folder = snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=revision,
            allow_patterns=patterns,
            local_files_only=local_only or offline(),
        )
    except GatedRepoError:
        raise ValueError(
            f"{what}: a gated {kind} repository: accept its terms on huggingface.co, then log in "
            "(`hf auth login`) or set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{what}: {_not_local(repo_id)}no such {kind} repository on the hub, or a private one and no token "
            "was sent (log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(
            f"{what}: the repository has no revision {revision!r} (a branch, tag or commit)"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        reason = "HF_HUB_OFFLINE=1 is set" if offline() else "the hub cannot be reached"
        command = "hf download" + (" --repo-type dataset" if kind == "dataset" else "")
        command += f" {repo_id}" + (f" --revision {revision}" if revision else "")
        raise ValueError(
            f"{what}: {_not_local(repo_id)}not in the hub cache {cache_dir()} and {reason}; download it where the "
            f"hub is reachable (`{command}`) or point HF_HUB_CACHE / HF_HOME at a cache that holds it"
        ) from None
    except HfHubHTTPError as e:
        raise ValueError(f"{what}: the hub answered {' '.join(str(e).split())[:300]}") from None
    except OSError as e:
        raise ValueError(f"{what}: cannot write the hub cache {cache_dir()}: {e}") from None
    return Path(folder)


def _not_local(name: str) -> str:
    """The start of a hub error for a name that may be a mistyped local path: its first folder exists here."""
    first = Path(name).parts[0]
    return (
        f"no local folder {name} ({first}/ exists: a typo?), and as a hub name: "
        if Path(first).is_dir()
        else ""
    )


def download_command(name: str, files: list[str]) -> str:
    """The command that downloads `files` of the hub name `name` (`org/name[@revision]`) into the cache."""
    repo_id, _, revision = name.partition("@")
    return f"hf download {repo_id} {' '.join(files)}" + (f" --revision {revision}" if revision else "")


def locate_model(name: str, commit: str | None = None) -> ModelSource:
    """A local directory as it is, or a hub name's config, tokenizer and chat template (no weights yet).

    `commit`: read exactly this snapshot from the cache (the ranks of a node that did not download)."""
    hub = hub_model_name(name)
    if hub is None:
        return ModelSource(name, Path(name))
    repo_id, revision = hub
    folder = download(repo_id, commit or revision, MODEL_FILES, local_only=commit is not None)
    source = ModelSource(name, folder, repo_id, revision or "main", folder.name)
    if not (folder / WEIGHTS_INDEX).is_file():  # one weights file: every run needs all of it
        fetch_weights(source, None, local_only=commit is not None)
    return source


def _weight_map(path: Path) -> dict[str, str] | None:
    """The index's {tensor: file}, or None for weights in one unindexed file (or several: all are needed)."""
    index = path / WEIGHTS_INDEX
    if not index.is_file():
        return None
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: unreadable index of the weights ({e})") from None


def weight_files(path: Path, num_layers: int | None, text: TextWeights | None = None) -> list[str]:
    """The safetensors files holding every weight outside the decoder layers and those of layers below
    `num_layers` (None: all files), by the index file when the weights are sharded; with `text`, only the
    text model's weights count (a wrapper's vision tower and other parts are left out)."""
    weight_map = _weight_map(path)
    if weight_map is None:
        found = sorted(p.name for p in path.glob("*.safetensors"))
        if found and "model.safetensors" not in found:  # transformers would look for model.safetensors alone
            raise ValueError(
                f"--target_model {path}: {len(found)} safetensors file(s) ({', '.join(found[:3])}"
                f"{' ...' if len(found) > 3 else ''}) and no {WEIGHTS_INDEX}, by which transformers finds "
                "sharded weights; copy the index file saved with them"
            )
        return ["model.safetensors"]
    needed = set()
    for weight, file in weight_map.items():
        if text is not None and not text.holds(weight):
            continue
        layer = LAYER_OF_WEIGHT.search(weight)
        if num_layers is None or layer is None or int(layer.group(1)) < num_layers:
            needed.add(file)
    return sorted(needed)


def other_parts(path: Path, text: TextWeights) -> tuple[list[str], list[str]]:
    """(files, modules): the weight files holding only tensors outside the text model, which a run reading
    `text` never needs whatever its layers, and the modules those tensors belong to (`model.visual`)."""
    weight_map = _weight_map(path)
    if weight_map is None:
        return [], []
    text_files = {file for weight, file in weight_map.items() if text.holds(weight)}
    files = sorted(set(weight_map.values()) - text_files)
    modules = {text.part_of(weight) for weight, file in weight_map.items() if file in files}
    return files, sorted(modules)


def skipped_note(source: ModelSource, text: TextWeights | None) -> str | None:
    """One line on the weight files of a checkpoint's other parts (a vision-language wrapper's vision tower)
    that target ranks never read: how many, how large, and whether they were left out of the download."""
    if text is None:
        return None
    files, modules = other_parts(source.path, text)
    if not files:
        return None
    present = [source.path / f for f in files if (source.path / f).is_file()]
    missing = [f for f in files if not (source.path / f).is_file()]
    remote = remote_sizes(source, missing) if source.repo_id else 0
    size = (
        "size unknown offline"
        if remote is None
        else size_text(sum(p.stat().st_size for p in present) + remote)
    )
    if source.repo_id is None:
        fate = "not read"
    elif missing:
        fate = "not downloaded" if not present else f"{len(missing)} of them not downloaded"
    else:
        fate = "in the hub cache already, not read"
    return (
        f"{len(files)} weight file(s) ({size}) hold only the checkpoint's parts outside its text model "
        f"({', '.join(modules[:4])}{', ...' if len(modules) > 4 else ''}): {fate}"
    )


def fetch_weights(
    source: ModelSource, num_layers: int | None, local_only: bool = False, text: TextWeights | None = None
) -> list[Path]:
    """Make sure the weight files for `num_layers` layers (of the text model alone with `text`) are on disk
    (downloading those of a hub name, after checking that the disk holds them) and intact; returns their
    paths. The process that downloads says which files of the checkpoint's other parts it left out."""
    files = weight_files(source.path, num_layers, text)
    if source.repo_id is not None and not (local_only or offline()):
        missing = [f for f in files if not (source.path / f).is_file()]
        check_disk_space(source, missing)
        download(source.repo_id, source.commit, files)
    check_present(source, files, local_only)
    for name in files:
        check_safetensors(source.path / name, source.name)
    note = skipped_note(source, text) if source.repo_id is not None and not local_only else None
    if note:
        print(f"--target_model {source.name}: {note}")
    return [source.path / f for f in files]


def remote_sizes(source: ModelSource, files: list[str]) -> int | None:
    """Bytes of `files` in the hub repository (None offline or when the hub cannot tell)."""
    if not files:
        return 0
    if offline():
        return None
    try:
        infos = HfApi().get_paths_info(source.repo_id, files, revision=source.commit)
    except (HfHubHTTPError, OSError):
        return None  # the download itself reports what is wrong with the hub
    return sum(getattr(i, "size", 0) or 0 for i in infos)


def weights_summary(source: ModelSource, num_layers: int | None, text: TextWeights | None = None) -> str:
    """What --plan says of the weight files a run reads: how many, how large, how much is still to download,
    and what of the checkpoint's other parts it leaves out."""
    files = weight_files(source.path, num_layers, text)
    present = [source.path / f for f in files if (source.path / f).is_file()]
    missing = [f for f in files if not (source.path / f).is_file()]
    to_download = remote_sizes(source, missing) if source.repo_id else 0
    held = sum(p.stat().st_size for p in present)
    total = "unknown (offline)" if to_download is None else size_text(held + to_download)
    line = f"{len(files)} safetensors file(s), {total}"
    if source.repo_id:
        line += f" ({len(missing)} to download into {cache_dir()})" if missing else f" (in {cache_dir()})"
    note = skipped_note(source, text)
    return line + (f"; {note}" if note else "")


def size_text(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.1f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


def check_disk_space(source: ModelSource, files: list[str]) -> None:
    """Refuse a download the cache's disk cannot hold, before any byte of it is written."""
    needed = remote_sizes(source, files)
    if not needed:
        return
    root = next(p for p in (cache_dir(), *cache_dir().parents) if p.exists())
    free = shutil.disk_usage(root).free
    if needed > free:
        raise ValueError(
            f"--target_model {source.name}: the {len(files)} weight file(s) this run needs take "
            f"{needed / 1e9:.1f} GB and {root} has {free / 1e9:.1f} GB free; free space or point HF_HUB_CACHE "
            "at a larger disk"
        )


def check_present(source: ModelSource, files: list[str], local_only: bool = False) -> None:
    """One line naming every weight file a run needs that is not on disk, and where it would come from."""
    missing = [f for f in files if not (source.path / f).is_file()]
    if not missing:
        return
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    head = f"--target_model {source.name}: {len(missing)} of the {len(files)} weight file(s) this run reads"
    if source.repo_id is None:
        raise ValueError(f"{head} are not in {source.path} ({shown}); copy or download the model again")
    if offline() or local_only:
        raise ValueError(
            f"{head} are not in the hub cache ({shown}) and "
            + ("HF_HUB_OFFLINE=1 is set" if offline() else "the rank that downloads did not fetch them")
            + f"; download them where the hub is reachable (`{download_command(source.name, missing)}`)"
        )
    raise ValueError(  # downloaded without an error, so the repository has no such file
        f"{head} are not in the repository at {source.revision} ({shown}): a repository of pickled .bin weights "
        "only? those are not loaded (they can run code); use a safetensors release of the model"
    )


def check_safetensors(path: Path, name: str) -> None:
    """One line naming a weight file that is missing, cut short or damaged (as an interrupted download
    leaves it) and how to fetch it again, instead of a loader's traceback."""
    again = (
        f"delete it and run again to download it (or `{download_command(name, [path.name])}`)"
        if hub_model_name(name)
        else "copy or download the model again"
    )
    if not path.is_file():
        raise ValueError(f"--target_model {name}: weight file {path} is missing; {again}")
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                raise ValueError("its header is longer than the file")
            header = json.loads(f.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"--target_model {name}: weight file {path} is damaged ({e}); {again}") from None
    if 8 + header_len + end > size:
        raise ValueError(
            f"--target_model {name}: weight file {path} is cut short ({size} bytes, its header describes "
            f"{8 + header_len + end}); {again}"
        )


def split_files(files: list[str], split: str) -> list[str]:
    """The data files of one split by the hub's naming conventions: a folder named after the split, or a
    file name starting with it (`train.jsonl`, `train-00000-of-00002.parquet`, `data/train_x.json`); a
    repository whose files name no split at all is one train split."""
    data = [f for f in files if f.endswith(DATA_SUFFIXES)]
    words = ("train", "test", "validation", "valid", "dev", "eval")

    def names_split(f: str, s: str) -> bool:
        parts = f.split("/")
        return s in parts[:-1] or re.match(rf"{re.escape(s)}([-._ 0-9]|$)", parts[-1]) is not None

    chosen = [f for f in data if names_split(f, split)]
    if not chosen and split == "train" and not any(names_split(f, w) for f in data for w in words):
        chosen = data
    return sorted(chosen)


def resolve_data(spec: str, flag: str = "--data", commit: str | None = None) -> tuple[list[str], str | None]:
    """A hub dataset's split as local files (downloaded into the hub cache), and the snapshot's commit; any
    other spec as it is (a file, directory or glob) with None."""
    hub = hub_dataset_name(spec)
    if hub is None:
        return [spec], None
    repo_id, split = hub
    patterns = [f"*{suffix}" for suffix in DATA_SUFFIXES]
    try:
        folder = download(repo_id, commit, patterns, "dataset", flag, local_only=commit is not None)
    except ValueError as e:  # a mistyped local path reads as a hub name too: say that none exists here
        raise ValueError(
            f"{flag} {spec}: no such local file or directory, and as a hub dataset: {e}"
        ) from None
    listed = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    files = split_files(listed, split)
    if not files:
        found = ", ".join(sorted(f for f in listed if f.endswith(DATA_SUFFIXES))[:8]) or "none"
        raise ValueError(
            f"{flag} {spec}: no jsonl/json/parquet file of split {split!r} in the dataset repository "
            f"(its data files: {found}); name a split with {flag} {repo_id}:SPLIT"
        )
    return [str(folder / f) for f in files], folder.name


def check_complete(path: Path) -> None:
    """Refuse a local directory whose index names weight files it lacks (a snapshot partly copied or
    downloaded): transformers opens every file the index names, and the run's target fingerprint would change
    when the folder is completed. A hub name reads only the shards a run needs."""
    weight_map = _weight_map(path) or {}
    missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
    if not missing:
        return
    hub = re.search(r"models--([^/]+)--([^/]+)/snapshots/([0-9a-f]{40})$", str(path.resolve()))
    advice = (
        f"it is a hub snapshot: pass --target_model {hub.group(1)}/{hub.group(2)}@{hub.group(3)}, whose runs read "
        "only the shards they need"
        if hub
        else "copy the whole model"
    )
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    raise ValueError(
        f"--target_model {path}: its {WEIGHTS_INDEX} names {len(missing)} weight file(s) the folder lacks "
        f"({shown}); {advice}"
    )


def truncated_view(
    source: ModelSource, num_layers: int | None, root: Path, text: TextWeights | None = None
) -> Path:
    """A hub snapshot as transformers should load it for `num_layers` layers (of the text model alone with
    `text`): a directory under `root` of links to its config, tokenizer and the weight files those layers
    need, with an index of only their weights, so that no other shard is opened (or needs to be on disk). A
    local directory is used as is."""
    if source.repo_id is None or not (source.path / WEIGHTS_INDEX).is_file():
        return source.path
    files = weight_files(source.path, num_layers, text)
    layers = ("all" if num_layers is None else f"{num_layers}layers") + ("-text" if text else "")
    view = root / f"{source.repo_id.replace('/', '--')}-{source.commit[:12]}-{layers}"
    if (view / WEIGHTS_INDEX).is_file():
        return view
    index = json.loads((source.path / WEIGHTS_INDEX).read_text())
    index["weight_map"] = {
        w: f for w, f in index["weight_map"].items() if f in files and (text is None or text.holds(w))
    }
    tmp = root / f".{view.name}-{socket.gethostname()}-{os.getpid()}"  # nodes may share the cache
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in source.path.iterdir():
        if item.name != WEIGHTS_INDEX and (not item.name.endswith(".safetensors") or item.name in files):
            (tmp / item.name).symlink_to(item.resolve())
    (tmp / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    try:
        tmp.rename(view)
    except OSError:  # another process of this node made the same view meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return view
