"""The package's shape: imports run down the floors only, so no folder imports one above it and no two
modules import each other. A new module lands in a folder of FLOORS, or this test names it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_ddp"

# From the bottom up: a module may import its own folder's modules and those of lower floors only.
# Entry modules at the top (train.py and the thin `python -m dflash_ddp.X` modules) may import anything.
FLOORS = [
    "files",
    "settings",
    "engines",
    "hub",
    "data",
    "parallel",
    "target_model",
    "drafter",
    "checkpoint",
    "regeneration",
    "serving",
    "evaluation",
    "observe",
    "setting_checks",
    "config",
    "setup",
    "roles",
]
ENTRIES = {"train", "cli_help", "export", "evaluate", "regenerate", "plot", "soak", "bench", "tools"}


def place(module: str) -> str:
    """The folder (or top-level module) a dotted module name under dflash_ddp belongs to."""
    return module.split(".")[1] if module.count(".") else module


def internal_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported dflash_ddp module) of every import in a file, wherever it stands (also in functions)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "relative import"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_ddp."):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("dflash_ddp.")]
    return found


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        yield path, name


def test_every_module_has_a_floor_or_is_an_entry():
    homeless = [name for _, name in modules() if place(name) not in FLOORS + list(ENTRIES) + ["__init__"]]
    assert not homeless, f"modules outside the known folders (add the folder to FLOORS): {homeless}"


def test_imports_run_down_only():
    wrong = []
    for path, name in modules():
        here = place(name)
        if here in ENTRIES:
            continue
        floor = FLOORS.index(here) if here in FLOORS else -1
        for line, target in internal_imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if target == "relative import":
                wrong.append(f"{where}: a relative import (use an absolute dflash_ddp import)")
            elif place(target) not in FLOORS:
                wrong.append(f"{where} imports {target}, an entry module")
            elif FLOORS.index(place(target)) > floor:
                wrong.append(f"{where} imports {target}: {place(target)} stands above {here}")
    assert not wrong, "imports that run back up:\n" + "\n".join(wrong)


def test_no_module_imports_one_that_imports_it_back():
    graph = {name: {t for _, t in internal_imports(path)} for path, name in modules()}
    pairs = [(a, b) for a, targets in graph.items() for b in targets if a in graph.get(b, ())]
    assert not pairs, f"modules importing each other: {pairs}"
