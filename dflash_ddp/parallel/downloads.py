"""Hub names resolved once per node: the first process of each node downloads what the run needs into the
hub cache while the node's other processes wait, then every process reads the same snapshot.

`together`: every process of the job makes the same call (a training run); False where one process works
alone (the drafter leader's --plan), which then downloads by itself. Local paths need no coordination."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflash_ddp.hub import (
    ModelSource,
    TextWeights,
    check_complete,
    fetch_weights,
    hub_dataset_name,
    hub_model_name,
    locate_model,
    resolve_data,
    truncated_view,
)
from dflash_ddp.parallel.topology import once_per_node


def once(key: str, work: Callable[[str | None], str | None], together: bool) -> str | None:
    return once_per_node(key, work) if together else work(None)


def resolve_target(name: str, together: bool = True) -> ModelSource:
    """`--target_model`: a local directory, or a hub name's snapshot with its config and tokenizer files."""
    if hub_model_name(name) is None:
        return locate_model(name)
    commit = once(f"target/{name}", lambda commit: locate_model(name, commit).commit, together)
    return locate_model(name, commit)


def fetch_target_weights(
    source: ModelSource,
    num_layers: int | None,
    view_root: Path | None = None,
    together: bool = True,
    text: TextWeights | None = None,
) -> Path:
    """Download and check the weight files of the first `num_layers` layers (None: the whole target), of its
    text model alone with `text` (a vision-language wrapper's vision tower is left in the hub), and return
    the directory transformers should load them from (see hub.truncated_view: with `text`, a hub name needs
    `view_root`, as its snapshot's own index names files that are not downloaded)."""

    def fetch(fetched: str | None) -> str:
        fetch_weights(source, num_layers, local_only=fetched is not None, text=text)
        return "fetched"

    if source.repo_id is None:
        fetch(None)  # a local directory: only its files' integrity is checked
        check_complete(source.path)
        return source.path
    which = f"{source.name}/{num_layers}/{'text' if text else 'all'}"
    once(f"weights/{which}", fetch, together)
    if view_root is None:
        return source.path
    view = once(
        f"view/{which}",
        lambda made: made or str(truncated_view(source, num_layers, view_root, text)),
        together,
    )
    return Path(view)


def resolve_data_files(specs: list[str], flag: str = "--data", together: bool = True) -> list[str]:
    """Files, directories and globs as they are; each hub dataset `org/name[:split]` as its split's files."""
    files = []
    for spec in specs:
        if hub_dataset_name(spec) is None:
            files.append(spec)
            continue

        def resolve(commit: str | None, spec=spec) -> str | None:
            return resolve_data(spec, flag, commit)[1]

        files += resolve_data(spec, flag, once(f"data/{spec}", resolve, together))[0]
    return files
