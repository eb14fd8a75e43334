"""A setting of a config dataclass, and how its values are read: each field's `Setting` (its --help group and
line, its allowed values, whether a resume may change it), the check of a value against it, and the reading of
command-line flags and YAML files into the fields' types, with errors naming the flag or the file and key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Setting:
    """What a setting is besides its type and default: the --help group and line, and its allowed values."""

    group: str
    help: str
    allowed: str | typing.Callable[[], str] = ""  # in words, for --help and errors; "": from the rest
    choices: tuple[str, ...] = ()  # the only values of a text setting
    minimum: int | None = None  # the smallest value of an integer setting
    in_range: tuple[typing.Callable[[float], bool], str] | None = None  # a number's range (besides finite)
    overridable: bool = False  # a resumed run may change it (--resume_override)
    # {--drafter family: its own default}, taken where neither a flag nor the --config file gives a value
    family_defaults: dict[str, typing.Any] = field(default_factory=dict, hash=False)


def setting(default: typing.Any, group: str, help: str, **details) -> typing.Any:
    """A TrainConfig field with its `Setting`; a list or dict default is copied for every config."""
    metadata = {"setting": Setting(group, help, **details)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def choice_words(choices: tuple[str, ...]) -> str:
    """'a, b or c'."""
    return " or ".join([", ".join(choices[:-1]), choices[-1]] if len(choices) > 1 else choices)


def check_setting(name: str, value: typing.Any, spec: Setting) -> None:
    """Refuse a value outside its setting's choices, minimum or range, naming the flag."""
    if spec.choices and value not in spec.choices:
        raise ValueError(f"--{name} {value}: choose {allowed_text(spec) or choice_words(spec.choices)}")
    if spec.minimum is not None and value < spec.minimum:
        wanted = "a positive integer" if spec.minimum == 1 else f"at least {spec.minimum}"
        raise ValueError(f"--{name} {value}: must be {wanted}")
    if spec.in_range is not None and value is not None:
        in_range, what = spec.in_range
        if not (math.isfinite(value) and in_range(value)):
            raise ValueError(f"--{name} {value}: must be {what}")


def allowed_text(spec: Setting) -> str:
    """The setting's own words for its allowed values ('' when it has none)."""
    return spec.allowed() if callable(spec.allowed) else spec.allowed


def allowed_values(spec: Setting, hint: typing.Any) -> str:
    """The allowed values of a setting of type `hint`, in words, as --help and docs/cli.md show them."""
    if allowed_text(spec):
        return allowed_text(spec)
    if spec.choices:
        return choice_words(spec.choices)
    if spec.minimum is not None:
        return f"an integer >= {spec.minimum}"
    if spec.in_range is not None:
        return spec.in_range[1].removeprefix("a ").replace("in [", "a number in [")
    if hint is bool:
        return "true | false (a bare --flag means true)"
    return str(hint).replace("typing.", "") if typing.get_args(hint) else hint.__name__


def field_types(cls) -> dict[str, typing.Any]:
    """{field name: its type} of a config dataclass, as the flags and the YAML loader convert to."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# names other trainers give these settings -> this project's (the spelling alone would suggest another)
OTHER_NAMES = {
    "lr": "learning_rate",
    "batch_size": "tokens_per_batch",
    "micro_batch_size": "tokens_per_batch",
    "per_device_train_batch_size": "tokens_per_batch",
    "train_data": "data",
    "train_file": "data",
    "model": "target_model",
    "target": "target_model",
    "model_name_or_path": "target_model",
    "layers": "num_draft_layers",
    "num_layers": "num_draft_layers",
    "epochs": "num_epochs",
    # SpecForge's train_dflash.py (its flags with dashes)
    "target_model_path": "target_model",
    "train_data_path": "data",
    "eval_data_path": "eval_data",
    "max_length": "max_seq_len",
    "accumulation_steps": "gradient_accumulation_steps",
    "log_interval": "logging_steps",
    "eval_interval": "eval_steps",
    "save_interval": "save_steps",
    "tp_size": "target_tp_size",
    "loss_decay_gamma": "loss_gamma",
    "attention_backend": "attention",
    "build_dataset_num_proc": "num_proc",
}
# other trainers' settings this project has no counterpart for, and why
NO_COUNTERPART = {
    "draft_config_path": "the drafter's shape comes from the target and the flags (--num_draft_layers, "
    "--block_size, ...), or from a drafter given to --init_from",
    "trust_remote_code": "targets load through transformers' own classes; no code from a checkpoint is run",
    "embedding_key": "the target's embedding and LM head are found from its own classes",
    "lm_head_key": "the target's embedding and LM head are found from its own classes",
    "is_preformatted": "rows are conversations, rendered by the target's chat template (--chat_template FILE)",
    "dataloader_num_workers": "batches are built once, before training (--num_proc tokenizes in parallel)",
}


def _unknown_key_error(key: typing.Any, known: list[str], where: str) -> ValueError:
    key = str(key)
    name = key.replace("-", "_")  # other trainers spell their flags with dashes
    if name != key and name in known:
        hint = f" (did you mean '{name}'? this project's names use underscores)"
    elif OTHER_NAMES.get(name) in known:
        hint = f" (did you mean '{OTHER_NAMES[name]}'?)"
    elif name in NO_COUNTERPART:
        hint = f" (none here: {NO_COUNTERPART[name]})"
    elif key.startswith("no_") and key[3:] in known:
        hint = f" (to turn '{key[3:]}' off, give it false)"
    else:
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ValueError(f"{where}: unknown key '{key}'{hint}")


def _convert(value: typing.Any, hint: typing.Any, where: str) -> typing.Any:
    """Turn a YAML value or command-line string into the field's type, or say what was expected."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in UNSET):
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    try:
        if hint is dict:
            parsed = json.loads(value) if isinstance(value, str) else value
            if not isinstance(parsed, dict):
                raise ValueError
            return parsed
        if typing.get_origin(hint) is list:
            # `--key a b`, `--key a,b` and YAML lists all work (numbers also `--key "1 2"`); YAML's null: none
            items = [
                part
                for v in (value if isinstance(value, list) else [] if value is None else [value])
                for part in (_parts(v, args[0]) if isinstance(v, str) else [v])
                if not isinstance(part, str) or part.strip()
            ]
            return [_convert(v.strip() if isinstance(v, str) else v, args[0], where) for v in items]
        if hint is str:
            if value is None:  # YAML's null: the empty text, which means "none" for every text setting
                return ""
            if isinstance(value, (bool, list, dict)):  # YAML turned it into something else than text
                raise ValueError
            return str(value)
        if hint in (int, float) and isinstance(value, bool):  # YAML's yes/no/on/off are not numbers
            raise ValueError
        if hint is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        number = value
        if hint is int and isinstance(value, str) and not value.strip().lstrip("+-").isdigit():
            number = float(value)  # 1e3, 2_000.0: a whole number written as a float
        if hint is int and isinstance(number, float) and not number.is_integer():
            raise ValueError
        return hint(number)
    except (ValueError, TypeError):
        name = "a JSON object" if hint is dict else getattr(hint, "__name__", str(hint))
        raise ValueError(f"{where}: expected {name}, got {value!r}") from None


UNSET = ("none", "null", "unset", "")  # an optional setting's words for no value


def _parts(text: str, item: typing.Any) -> list[str]:
    """The items of one text: comma-separated, and for numbers space-separated too (a path may hold spaces)."""
    return text.split(",") if item is str else text.replace(",", " ").split()


def _is_bool(hint: typing.Any) -> bool:
    """Whether a field of type `hint` is a boolean (`bool` or `bool | None`)."""
    return hint is bool or (
        typing.get_origin(hint) in (typing.Union, types.UnionType) and bool in typing.get_args(hint)
    )


def _is_list(hint: typing.Any) -> bool:
    """Whether a field of type `hint` holds a list (`list[int]` or `list[int] | None`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_list(a) for a in typing.get_args(hint))
    return typing.get_origin(hint) is list


def load_yaml(path: str, types_: dict) -> dict:
    """The settings of a --config YAML file, converted to the fields' types; unknown keys are errors."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"--config {path}: " + ("a directory, not a file" if p.is_dir() else "file not found")
        )
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ValueError(f"--config {path}: not valid YAML ({where}{what})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: the top level must be a mapping of key: value")
    values = {}
    for key, value in raw.items():
        if key not in types_:
            if isinstance(value, dict) and value and all(k in types_ for k in value):
                first = next(iter(value))
                raise ValueError(
                    f"{path}: '{key}' holds settings ({', '.join(map(str, value))}): settings are flat, "
                    f"write '{first}: {value[first]}' at the top level"
                )
            raise _unknown_key_error(key, list(types_), f"{path}")
        values[key] = _convert(value, types_[key], f"{path}: key '{key}'")
    return values


def parse_flags(argv: list[str], types_: dict, allowed: dict | None = None) -> tuple[str | None, dict]:
    """`--key value`, `--key=value`, `--key v1 v2` for lists, bare `--flag` for booleans; `allowed`: the
    words for a setting's values, which a flag given without one is told."""
    config_file, values, i = None, {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument '{arg}': settings are given as --key value")
        key, equals, inline = arg[2:].partition("=")
        if key != "config" and key not in types_:
            raise _unknown_key_error(key, ["config", *types_], "command line")
        # a repeated flag wins over the first (as argparse's do), but a list's or --config's would drop the
        # first silently where extending it is just as likely meant
        if (key in values and _is_list(types_[key])) or (key == "config" and config_file is not None):
            raise ValueError(f"--{key} is given twice: give it once (a list's values all after one --{key})")
        i += 1
        raw: list[str] = [inline] if equals else []  # `--key=` gives the empty value
        while not equals and i < len(argv) and not argv[i].startswith("--"):
            raw.append(argv[i])
            i += 1
        if key == "config":
            if len(raw) != 1:
                raise ValueError("--config takes exactly one YAML file")
            config_file = raw[0]
            continue
        hint = types_[key]
        listed = _is_list(hint)
        if not raw:
            if not _is_bool(hint):
                words = (allowed or {}).get(key)
                raise ValueError(
                    f"--{key}: missing value"
                    + (f" ({words})" if words else f" (--{key} '' for none)" if hint is str else "")
                )
            values[key] = True
            continue
        value = raw if listed or len(raw) > 1 else raw[0]
        if len(raw) > 1 and not listed:
            raise ValueError(f"--{key}: takes one value, got {raw}")
        values[key] = _convert(value, hint, f"--{key}")
    return config_file, values
