"""`python -m dflash_ddp.train --help`: every flag with one line saying what it does, its allowed values and
the value this run will use, grouped by concern.

The values shown are resolved as the run would resolve them: the embedded preset's when no --target_model
is given (the default run), a --config file's and the other flags' when they come with --help.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing

from dflash_ddp.config import EMBEDDED_NAME, EMBEDDED_PRESET, TrainConfig, family_defaults
from dflash_ddp.settings import Setting, allowed_values, field_types, load_yaml, parse_flags

REQUIRED = ("target_model", "data")  # required once the embedded default is not used


def settings_by_group() -> dict[str, list[tuple[str, Setting]]]:
    """{group: [(field name, its Setting)]} in the order TrainConfig declares them."""
    groups: dict[str, list[tuple[str, Setting]]] = {}
    for f in dataclasses.fields(TrainConfig):
        spec = f.metadata["setting"]
        groups.setdefault(spec.group, []).append((f.name, spec))
    return groups


HELP_WIDTH = 110  # --help's descriptions wrap at this width


def shown(value: typing.Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, dict):
        return str(value) if value else "{}"
    return "''" if value == "" else str(value)


def resolved_values(argv: list[str]) -> tuple[dict, bool, str]:
    """The values the run given by `argv` would use (before validation), whether they are the embedded
    preset's, and why `argv` does not parse ("" when it does: then none of it is shown)."""
    types_ = field_types(TrainConfig)
    try:
        config_file, flags = parse_flags(argv, types_)
        given, error = {**(load_yaml(config_file, types_) if config_file else {}), **flags}, ""
    except ValueError as e:
        given, error = {}, str(e)
    defaults = {name: getattr(TrainConfig(), name) for name in types_}
    if given.get("target_model") == EMBEDDED_NAME:
        del given["target_model"]
    embedded = "target_model" not in given
    values = {**(EMBEDDED_PRESET if embedded else {}), **given}
    return {**defaults, **values, **family_defaults(values)}, embedded, error


def usage(argv: list[str] | None = None) -> str:
    """The --help text; `argv` (the other flags given with --help) decides the values shown."""
    values, embedded, error = resolved_values([a for a in argv or [] if a not in ("--help", "-h")])
    types_ = field_types(TrainConfig)
    defaults = TrainConfig()
    lines = [
        "usage: torchrun --nproc-per-node N -m dflash_ddp.train [--config FILE.yaml] [--key value ...]",
        "       python -m dflash_ddp.train [...]   (one process: target and drafter together)",
        "",
        "Train a DFlash drafter for a frozen target LLM as one job: the first ranks run the target, the last",
        "--drafter_ranks train the drafter. Settings: built-in defaults < --config FILE.yaml < flags.",
        "`value`: what this run would use"
        + (
            ". No --target_model is given, so that is the embedded default run (the tiny\n"
            "target and data shipped in the package); where a run with --target_model would use another value,\n"
            "'otherwise' gives it."
            if embedded
            else "."
        ),
        *(
            [f"NOTE: the flags given with --help do not parse ({error}): the values below are the defaults."]
            if error
            else []
        ),
        "",
        "  --config FILE.yaml    settings as key: value (the flag names without --); flags override it",
        "  --help, -h            this text; with other flags, the values shown are theirs",
    ]
    for group, settings in settings_by_group().items():
        lines += ["", f"{group}:"]
        for name, spec in settings:
            value = shown(values[name])
            if embedded and name in EMBEDDED_PRESET and EMBEDDED_PRESET[name] != getattr(defaults, name):
                value += (
                    f" (otherwise {shown(getattr(defaults, name)) if name not in REQUIRED else 'required'})"
                )
            if values["drafter"] not in spec.family_defaults:
                value += "".join(
                    f" (with --drafter {k}: {shown(v)})" for k, v in spec.family_defaults.items()
                )
            # the description wrapped under its flag; the values line whole (a test reads it as one)
            lines += textwrap.wrap(
                spec.help, HELP_WIDTH, initial_indent=f"  --{name:<29} ", subsequent_indent=" " * 34
            )
            lines.append(f"  {'':<31} {allowed_values(spec, types_[name])}; value: {value}")
    lines += [
        "",
        "Examples:",
        "  torchrun --nproc-per-node 8 -m dflash_ddp.train --config configs/qwen3-8b.yaml",
        "  torchrun --nproc-per-node 8 -m dflash_ddp.train --target_model DIR --data chats.jsonl --plan",
        "Errors name the flag, the value and what is allowed, exit status 2, before anything loads.",
    ]
    return "\n".join(lines)


REFERENCE_START = "<!-- settings: generated by `python -m dflash_ddp.cli_help --write docs/cli.md` -->"
REFERENCE_END = "<!-- end of settings -->"


def markdown_reference() -> str:
    """Every setting by group as Markdown tables (flag, what it does, allowed values, default): the
    reference section of docs/cli.md, from the same fields as --help."""
    types_, defaults = field_types(TrainConfig), TrainConfig()
    lines = [REFERENCE_START]
    for group, settings in settings_by_group().items():
        lines += [
            "",
            f"### {group}",
            "",
            "| flag | what it does | allowed | default |",
            "| --- | --- | --- | --- |",
        ]
        for name, spec in settings:
            by_family = "".join(f"; with --drafter {k}: {shown(v)}" for k, v in spec.family_defaults.items())
            cells = [
                f"`--{name}`",
                spec.help,
                allowed_values(spec, types_[name]),
                shown(getattr(defaults, name)) + by_family,
            ]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", REFERENCE_END]
    return "\n".join(lines)


def with_reference(page: str) -> str:
    """`page` (docs/cli.md's text) with its generated section replaced by the current one, or appended."""
    if REFERENCE_START in page:
        before, rest = page.split(REFERENCE_START, 1)
        after = rest.split(REFERENCE_END, 1)[1]
        return before + markdown_reference() + after
    return page.rstrip("\n") + "\n\n## Every setting\n\n" + markdown_reference() + "\n"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:2] == ["--write"] and len(sys.argv) == 3:
        page = Path(sys.argv[2])
        page.write_text(with_reference(page.read_text()))
    elif sys.argv[1:] == ["--markdown"]:
        print(markdown_reference())
    else:
        sys.exit("usage: python -m dflash_ddp.cli_help --markdown | --write docs/cli.md")
