"""Hub names resolved once per node: the first process of each node downloads what the run needs into the
hub cache while the node's other processes wait, then every process reads the same snapshot."""

from __future__ import annotations

from pathlib import Path

from dflash_ddp.hub import ModelSource, fetch_weights, locate_model, resolve_data, truncated_view
from dflash_ddp.parallel.topology import once_per_node


def resolve_target(name: str) -> ModelSource:
    """`--target_model`: a local directory, or a hub name's snapshot with its config and tokenizer files."""
    commit = once_per_node(f"target/{name}", lambda commit: locate_model(name, commit).commit)
    return locate_model(name, commit)


def fetch_target_weights(source: ModelSource, num_layers: int | None, view_root: Path | None = None) -> Path:
    """Download and check the weight files of the first `num_layers` layers (None: the whole target), and
    return the directory transformers should load them from (see hub.truncated_view)."""

    def fetch(fetched: str | None) -> str:
        fetch_weights(source, num_layers, local_only=fetched is not None)
        return "fetched"

    once_per_node(f"weights/{source.name}/{num_layers}", fetch)
    if view_root is None:
        return source.path
    return Path(
        once_per_node(
            f"view/{source.name}/{num_layers}",
            lambda made: made or str(truncated_view(source, num_layers, view_root)),
        )
    )


def resolve_data_files(specs: list[str], flag: str = "--data") -> list[str]:
    """Files, directories and globs as they are; each hub dataset `org/name[:split]` as its split's files."""
    files = []
    for spec in specs:

        def resolve(commit: str | None, spec=spec) -> str | None:
            return resolve_data(spec, flag, commit)[1]

        files += resolve_data(spec, flag, once_per_node(f"data/{spec}", resolve))[0]
    return files
