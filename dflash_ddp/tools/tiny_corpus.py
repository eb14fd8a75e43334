"""The tiny target's corpus: question/answer conversations made from Python standard-library docstrings (the
embedded default's data) or from manual pages (the method benchmark's second target), their split, and the
data's provenance README."""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path


def log(msg: str) -> None:
    """Print a timestamped progress line (flushed, so it shows up in piped logs)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# Stdlib modules to mine for docstrings. Sorted at use; modules that fail to import are skipped.
# fmt: off
STDLIB_MODULES = [
    "abc", "argparse", "array", "ast", "asyncio", "atexit", "base64", "bdb", "binascii",
    "bisect", "builtins", "bz2", "calendar", "cmath", "cmd", "code", "codecs", "codeop",
    "collections", "collections.abc", "colorsys", "compileall", "concurrent.futures",
    "concurrent.futures.process", "concurrent.futures.thread", "configparser", "contextlib",
    "contextvars", "copy", "copyreg", "cProfile", "csv", "ctypes", "dataclasses", "datetime",
    "dbm", "decimal", "difflib", "dis", "doctest", "email", "email.contentmanager",
    "email.generator", "email.header", "email.headerregistry", "email.message",
    "email.mime.text", "email.parser", "email.policy", "email.utils", "enum", "errno",
    "faulthandler", "fcntl", "filecmp", "fnmatch", "fractions", "ftplib", "functools", "gc",
    "getopt", "getpass", "gettext", "glob", "graphlib", "grp", "gzip", "hashlib", "heapq",
    "hmac", "html", "html.parser", "http.client", "http.cookiejar", "http.cookies",
    "http.server", "imaplib", "importlib", "importlib.metadata", "importlib.resources",
    "importlib.util", "inspect", "io", "ipaddress", "itertools", "json", "json.decoder",
    "json.encoder", "keyword", "linecache", "locale", "logging", "logging.handlers", "lzma",
    "mailbox", "marshal", "math", "mimetypes", "mmap", "multiprocessing",
    "multiprocessing.managers", "multiprocessing.pool", "netrc", "numbers", "operator",
    "optparse", "os", "os.path", "pathlib", "pdb", "pickle", "pickletools", "pkgutil",
    "platform", "plistlib", "poplib", "pprint", "profile", "pstats", "pty", "pwd",
    "py_compile", "pyclbr", "queue", "quopri", "random", "re", "reprlib", "resource",
    "rlcompleter", "runpy", "sched", "secrets", "select", "selectors", "shelve", "shlex",
    "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3", "ssl", "stat",
    "statistics", "string", "stringprep", "struct", "subprocess", "symtable", "sys",
    "sysconfig", "tabnanny", "tarfile", "tempfile", "termios", "textwrap", "threading", "time",
    "timeit", "token", "tokenize", "tomllib", "trace", "traceback", "tracemalloc", "tty",
    "types", "typing", "unicodedata", "unittest", "unittest.mock", "urllib.error",
    "urllib.parse", "urllib.request", "urllib.robotparser", "uuid", "venv", "warnings", "wave",
    "weakref", "webbrowser", "wsgiref.headers", "wsgiref.simple_server", "wsgiref.util",
    "xml.dom.minidom", "xml.dom.pulldom", "xml.etree.ElementTree", "xml.sax",
    "xml.sax.handler", "xml.sax.saxutils", "xmlrpc.client", "xmlrpc.server", "zipapp",
    "zipfile", "zipimport", "zlib", "zoneinfo",
]
# fmt: on

SYSTEM_PROMPT = "You are a helpful Python assistant."
QUESTION_TEMPLATES = [
    "What does `{name}` do?",
    "Explain `{name}` in Python.",
    "How do I use `{name}`?",
    "What is `{name}` used for?",
    "Describe the {kind} `{name}`.",
    "Can you tell me about `{name}` in the `{module}` module?",
]
_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->\s*.*)?$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\"'])")


@dataclass(frozen=True)
class DocEntry:
    """One documented public stdlib object."""

    qualname: str  # e.g. "collections.Counter.most_common"
    module: str  # e.g. "collections"
    kind: str  # "module", "function", "class" or "method"
    signature: str | None  # e.g. "most_common(n=None)" or None when unavailable / too long
    summary: str  # cleaned leading sentences of the docstring


def _summarize_docstring(doc: str, max_chars: int) -> str:
    """Return the leading prose of ``doc``: whole sentences, at least ~160 chars when available.

    Paragraphs are taken in order (skipping signature-only lines that C builtins put first)
    until the text is long enough, then cut at a sentence boundary below ``max_chars``.
    """
    paragraphs = [" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n")]
    paragraphs = [p for p in paragraphs if p and not _SIGNATURE_LINE.match(p)]
    text = ""
    for par in paragraphs:
        # Stop at reST/doctest-ish material: it is not prose and reads badly as an answer.
        if par.startswith((">>>", "..", ":", "-", "*", "+")) or par.endswith("::"):
            break
        text = f"{text} {par}".strip()
        if len(text) >= 160:
            break
    if len(text) <= max_chars:
        return text
    out = ""
    for sent in _SENTENCE_END.split(text):
        if out and len(out) + 1 + len(sent) > max_chars:
            break
        out = f"{out} {sent}".strip()
    if len(out) > max_chars:  # a single very long sentence: cut at a word boundary
        out = out[:max_chars].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return out


def _signature(obj: object, short_name: str) -> str | None:
    """Return ``name(params)`` for callables whose signature is introspectable and short."""
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    sig = f"{short_name}{sig}"
    # Long signatures (with reprs of defaults) are noise for a tiny model; also skip addresses.
    if len(sig) > 100 or " at 0x" in sig or "<" in sig:
        return None
    return sig


def _public_attr(obj: object, name: str) -> object | None:
    """``getattr`` that returns None for deprecated attributes (e.g. ``typing.io``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            return getattr(obj, name)
        except Exception:  # noqa: BLE001 -- DeprecationWarning, lazy-import failures, ...
            return None


def _is_defined_in(obj: object, mod: object, name: str) -> bool:
    """True if ``obj`` belongs to module ``mod`` (not just re-imported from elsewhere)."""
    owner = getattr(obj, "__module__", None)
    mod_name = mod.__name__
    if owner == mod_name:
        return True
    # C accelerators (e.g. _functools.reduce, _socket.gethostname) document the public module.
    if isinstance(owner, str) and owner == "_" + mod_name.rsplit(".", 1)[-1]:
        return True
    return name in (getattr(mod, "__all__", None) or ())


def collect_doc_entries(max_chars: int = 400, min_chars: int = 40) -> list[DocEntry]:
    """Walk ``STDLIB_MODULES`` (sorted) and return documented public functions/classes/methods.

    Private names, undocumented objects, data attributes and re-exports are skipped; an object
    reachable from several modules is kept only under the first module (sorted order).
    """
    seen_ids: set[int] = set()
    entries: list[DocEntry] = []

    def add(obj: object, qualname: str, module: str, kind: str, short: str) -> None:
        doc = _public_attr(obj, "__doc__")  # None for deprecated shims such as typing.io
        if not isinstance(doc, str) or not doc.strip():
            return
        summary = _summarize_docstring(doc, max_chars)
        if len(summary) < min_chars:
            return
        sig = _signature(obj, short) if kind != "module" else None
        entries.append(DocEntry(qualname, module, kind, sig, summary))

    for mod_name in sorted(set(STDLIB_MODULES)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(mod_name)
        except Exception as exc:  # noqa: BLE001 -- a missing optional module is fine
            log(f"  skip module {mod_name}: {exc}")
            continue
        if id(mod) not in seen_ids:  # the module's own docstring (os.path is posixpath: once)
            seen_ids.add(id(mod))
            add(mod, mod_name, mod_name, "module", mod_name)
        for name in sorted(dir(mod)):
            if name.startswith("_"):
                continue
            obj = _public_attr(mod, name)
            is_class = inspect.isclass(obj)
            if not (is_class or inspect.isroutine(obj)) or id(obj) in seen_ids:
                continue
            if not _is_defined_in(obj, mod, name):
                continue
            seen_ids.add(id(obj))
            qual = f"{mod_name}.{name}"
            add(obj, qual, mod_name, "class" if is_class else "function", name)
            if not is_class:
                continue
            # Public methods defined (and documented) on the class itself, not inherited ones.
            for attr in sorted(vars(obj)):
                if attr.startswith("_"):
                    continue
                meth = vars(obj)[attr]
                if isinstance(meth, (staticmethod, classmethod)):
                    meth = meth.__func__
                if not inspect.isroutine(meth) or id(meth) in seen_ids:
                    continue
                seen_ids.add(id(meth))
                add(meth, f"{qual}.{attr}", mod_name, "method", attr)
    entries.sort(key=lambda e: e.qualname)
    return entries


def entry_to_answer(e: DocEntry) -> str:
    """Render the assistant answer: a short templated lead-in followed by the docstring prose."""
    if e.kind == "command":
        return f"`{e.qualname}` is a command from {e.module} of the manual. {e.summary}"
    if e.kind == "module":
        return f"`{e.qualname}` is a module in the Python standard library. {e.summary}"
    article = "an" if e.kind[0] in "aeiou" else "a"
    lead = f"`{e.qualname}` is {article} {e.kind} in the `{e.module}` module."
    if e.signature:
        lead += f" Signature: `{e.signature}`."
    return f"{lead} {e.summary}"


_ROFF_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)")
_ROFF_ESCAPE = re.compile(r"\\(\(..|\[[^\]]*\]|[^a-zA-Z])")
# --corpus -> the prefix of the data files it writes
CORPORA = {"docstrings": "docstring_qa", "manpages": "manpage_qa"}
COMMAND_TEMPLATES = [
    "What does the `{name}` command do?",
    "Explain the `{name}` command.",
    "What is `{name}` used for?",
    "Describe the `{name}` command in one paragraph.",
    "Can you tell me about the `{name}` command?",
]


def _roff_text(line: str) -> str:
    """A man page line as plain text: font changes and escapes dropped, `\\-` a hyphen, macro names removed."""
    line = line.replace("\\-", "-").replace("\\(em", "-").replace("\\(en", "-").replace("\\e", "\\")
    line = _ROFF_ESCAPE.sub("", _ROFF_FONT.sub("", line))
    if line.startswith((".", "'")):
        parts = line.split(None, 1)
        if parts[0] not in (".B", ".I", ".BR", ".BI", ".IR", ".RB", ".RI", ".IB", ".SM", ".SB"):
            return ""
        line = parts[1].replace('"', "") if len(parts) > 1 else ""
        if parts[0] in (".BR", ".BI", ".IR", ".RB", ".RI", ".IB"):
            line = "".join(line.split()) if len(line.split()) <= 2 and "(" in line else line
    return " ".join(line.split())


def collect_manpage_entries(
    max_chars: int = 400, min_chars: int = 40, root: str = "/usr/share/man"
) -> list[DocEntry]:
    """Commands of manual sections 1 and 8: the NAME line's summary plus the DESCRIPTION's first sentences.

    A second corpus for benchmarks on a machine without network: other words, other answers' shapes."""
    import gzip

    entries, seen = [], set()
    for section in ("1", "8"):
        for path in sorted(Path(root, f"man{section}").glob(f"*.{section}*")):
            name = path.name.split(f".{section}")[0]
            if name in seen or not re.fullmatch(r"[a-z][a-z0-9+.-]{1,30}", name):
                continue
            try:
                if path.suffix == ".gz":
                    with gzip.open(path, "rt", errors="replace") as f:
                        raw = f.read()
                else:
                    raw = path.read_text(errors="replace")
            except OSError:
                continue
            if raw.startswith(".so "):
                continue  # a link to another page
            whatis, description, current = "", [], None
            for line in raw.splitlines():
                if line.startswith(".SH") or line.startswith(".Sh"):
                    current = line[3:].strip().strip('"').upper()
                    continue
                if current == "NAME" and not whatis:
                    text = _roff_text(line)
                    if " - " in text:
                        whatis = text.split(" - ", 1)[1].strip()
                elif current == "DESCRIPTION" and sum(len(t) for t in description) < 2 * max_chars:
                    text = _roff_text(line)
                    if text:
                        description.append(text)
            prose = " ".join(description)
            summary = " ".join(_SENTENCE_END.split(prose)[:2])[:max_chars].strip()
            if not whatis or len(summary) < min_chars or not summary[0].isalpha():
                continue
            seen.add(name)
            whatis = whatis[0].upper() + whatis[1:].rstrip(".")
            entries.append(DocEntry(name, f"section {section}", "command", None, f"{whatis}. {summary}"))
    return entries


def build_conversations(entries: list[DocEntry], seed: int, system_frac: float) -> list[dict]:
    """Turn entries into deduplicated OpenAI-style ``{"messages": [...]}`` rows (seeded)."""
    rng = random.Random(seed)
    rows, seen = [], set()
    for e in entries:
        templates = COMMAND_TEMPLATES if e.kind == "command" else QUESTION_TEMPLATES
        template = templates[rng.randrange(len(templates))]
        if e.kind == "module" and "{module}" in template:
            template = QUESTION_TEMPLATES[0]  # "about `json` in the `json` module" reads badly
        question = template.format(name=e.qualname, kind=e.kind, module=e.module)
        messages = []
        if rng.random() < system_frac:
            messages.append({"role": "system", "content": SYSTEM_PROMPT})
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": entry_to_answer(e)},
        ]
        key = json.dumps(messages, sort_keys=True)
        if key not in seen:
            seen.add(key)
            rows.append({"messages": messages})
    return rows


def split_rows(rows: list[dict], n_heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Seeded train/held-out split; both parts keep the (sorted) corpus order."""
    idx = list(range(len(rows)))
    random.Random(seed + 1).shuffle(idx)
    held = set(idx[:n_heldout])
    train = [r for i, r in enumerate(rows) if i not in held]
    heldout = [r for i, r in enumerate(rows) if i in held]
    return train, heldout


def dir_size_mb(path: Path) -> float:
    """Total size of files under ``path`` in MB."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def write_readme(path: Path, info: dict, sample: dict) -> None:
    """Write data/README.md describing provenance, counts, loss and timings."""
    t = info["timings"]
    text = f"""# Embedded default data and target

Built offline and deterministically by

```
{info["command"]}
```

(`dflash_ddp/tools/make_tiny_target.py`; seed {info["seed"]}, torch {info["torch"]},
transformers {info["transformers"]}, tokenizers {info["tokenizers"]}, Python {info["python"]}).

## Files

| file | rows | what |
|---|---|---|
| `docstring_qa.jsonl` | {info["n_train"]} | train split: questions about Python stdlib objects, answers from their docstrings (first sentences, <= {info["max_chars"]} chars, plus a templated lead-in with kind/module/signature) |
| `docstring_qa_regenerated.jsonl` | {info["regen_train"]["kept"]} | same train prompts, assistant turn regenerated by the tiny target (greedy, max_new_tokens {info["max_new_tokens"]}); {info["regen_train"]["dropped_short"]} rows dropped for answers < {info["min_answer_tokens"]} tokens |
| `heldout_regenerated.jsonl` | {info["regen_heldout"]["kept"]} | {info["n_heldout"]} held-out prompts (never trained on) with target answers; use to measure acceptance length; {info["regen_heldout"]["dropped_short"]} dropped as too short |
| `../tiny_qwen3/` | - | tiny Qwen3 target (bf16 safetensors, {info["n_params"] / 1e6:.2f}M params) + byte-level BPE tokenizer (vocab {info["vocab_size"]}, ChatML template with `{{% generation %}}` assistant mask) |

Rows use the OpenAI schema `{{"messages": [{{"role": ..., "content": ...}}]}}`; about
{info["system_frac"]:.0%} of conversations start with the system prompt "{SYSTEM_PROMPT}".
The corpus has {info["n_total"]} conversations ({info["n_entries"]} documented public functions,
classes and methods from {info["n_modules"]} stdlib modules), split {info["n_train"]} train / {info["n_heldout"]} held-out.

## Tiny target training

{info["train"]["steps"]} steps of AdamW (lr {info["lr"]}, warmup {info["warmup_steps"]} + cosine), batch {info["batch_size"]} conversations
(<= {info["max_len"]} tokens, length-bucketed; {info["train"]["epochs"]:.1f} epochs over {info["train"]["tokens_per_epoch"]} tokens),
{"bf16 autocast" if info.get("bf16_autocast", True) else "fp32"} with fp32 weights,
loss on all tokens. **Final training loss: {info["train"]["final_loss"]:.3f}** (mean of last 20 steps).
Regenerated answers average {info["regen_train"]["mean_answer_tokens"]:.0f} tokens; {info["regen_train"]["hit_max_new_tokens"] + info["regen_heldout"]["hit_max_new_tokens"]} of all rows hit `max_new_tokens` without `<|im_end|>`.

## Timings (2-core CPU)

| phase | seconds |
|---|---|
| corpus | {t["corpus"]:.0f} |
| tokenizer | {t["tokenizer"]:.0f} |
| training | {t["training"]:.0f} |
| regeneration | {t["regeneration"]:.0f} |
| total | {t["total"]:.0f} |

## Example (held-out)

Prompt: {sample["prompt"]}

Original answer: {sample["original"]}

Target answer: {sample["regenerated"]}
"""
    path.write_text(text, encoding="utf-8")
