"""`python -m dflash_ddp.checkpoint inspect|verify DIR`: a checkpoint's step, data position, topology, config
and sizes, or whether its manifest verifies.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_ddp.checkpoint.layout import resolve_checkpoint
from dflash_ddp.checkpoint.manifest import verify_checkpoint
from dflash_ddp.checkpoint.reader import CheckpointReadError, read_json


def inspect(path: Path) -> str:
    """A human summary: step, data position, topology at save, config, file sizes, manifest status."""
    path = resolve_checkpoint(path)
    state = read_json(path, "trainer_state.json")
    problems = verify_checkpoint(path)
    topo = state.get("topology", {})
    lines = [
        f"checkpoint   {path}",
        f"manifest     {'verified' if not problems else 'INVALID: ' + '; '.join(problems)}",
        f"step         {state.get('global_step')}  (epoch {state.get('epoch')}, "
        f"{state.get('batches_consumed')} global batches consumed, {state.get('tokens_seen')} tokens)",
        f"topology     {topo.get('target_ranks')} target + {topo.get('drafter_ranks')} drafter rank(s) "
        f"(world size {topo.get('world_size')}, tensor-parallel groups of {topo.get('target_tp_size', 1)})",
        f"fingerprints {state.get('fingerprints')}",
        "files",
    ]
    lines += [f"  {p.name:<22} {p.stat().st_size:>14,d} bytes" for p in sorted(path.iterdir()) if p.is_file()]
    lines.append("config")
    lines += [f"  {k:<28} {v!r}" for k, v in sorted(state.get("config", {}).items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_ddp.checkpoint inspect|verify DIR`: verify exits 1 when the manifest fails."""
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m dflash_ddp.checkpoint inspect|verify CHECKPOINT_OR_OUTPUT_DIR"
    if argv in (["--help"], ["-h"]):
        print(f"{usage}\n\n{__doc__.strip()}\nverify exits 1 when a file does not match the manifest.")
        return 0
    if len(argv) != 2 or argv[0] not in ("inspect", "verify"):
        print(usage, file=sys.stderr)
        return 2
    path = resolve_checkpoint(Path(argv[1]))
    if not path.is_dir():
        print(f"error: {path}: no such checkpoint directory", file=sys.stderr)
        return 2
    if argv[0] == "inspect":
        try:
            print(inspect(path))
        except CheckpointReadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    problems = verify_checkpoint(path)
    for problem in problems:
        print(problem)
    print(f"{path}: {'OK' if not problems else 'FAILED'}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
