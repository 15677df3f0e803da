"""MkDocs hook: tables generated from the code at build time, so the docs cannot drift from it.

A page asks for a table with a marker line, replaced when the site is built:

    <!-- generated: context-fields OnlineRLContext -->   every field of a context dataclass
    <!-- generated: middleware -->                        every name of conveyor.middleware.__all__, reads/writes
    <!-- generated: config top -->                        the top-level config keys (conveyor.config.TOP_SCHEMA)
    <!-- generated: config env -->                        cfg.env (conveyor.envs.ENV_SCHEMA)
    <!-- generated: config policies -->                   cfg.policy of every Policy subclass, one section each
    <!-- generated: zoo -->                               every zoo entry: env id, stop value, docstring
    <!-- generated: benchmarks -->                        each script in benchmarks/ with its docstring

An unknown marker fails the build. The functions below return Markdown and are what tests/test_docs.py calls.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
import typing
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- generated: ([a-z-]+)(?: ([A-Za-z_.]+))? -->$", re.MULTILINE)
NOT_DECLARED = "not declared"


# --- Markdown helpers ------------------------------------------------------------------------------
def _cell(text: str) -> str:
    """Text fit for one table cell: one line, pipes escaped outside code spans (inside them they are literal)."""
    parts = re.split(r"(`[^`]*`)", " ".join(str(text).split()))
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)


def _code(text: str) -> str:
    return f"`{' '.join(str(text).split())}`" if text != "" else ""


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def rst_to_markdown(text: str) -> str:
    """Docstring markup as Markdown: ``x``, :class:`a.X` and :class:`~a.X` become `x`, `a.X` and `X`."""
    text = re.sub(r":[a-z]+:`~[^`]*?([^.`]+)`", r"`\1`", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


def summary(obj: Any) -> str:
    """The first paragraph of ``obj``'s docstring, as Markdown on one line."""
    doc = inspect.getdoc(obj) or ""
    return rst_to_markdown(" ".join(doc.split("\n\n")[0].split()))


# --- context fields --------------------------------------------------------------------------------
def _attribute_docs(cls: type) -> Dict[str, str]:
    """Field descriptions from the ``Attributes:`` sections (``name: text`` entries) of the class's docstring
    and its bases' (a subclass's entry wins)."""
    out: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        section = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)+)", inspect.cleandoc(klass.__doc__ or ""),
                            re.MULTILINE)
        if section is None:
            continue
        current = None
        for line in section.group(1).splitlines():
            entry = re.match(r"^ {4}(\w+): ?(.*)$", line)
            if entry:
                current = entry.group(1)
                out[current] = entry.group(2)
            elif current and line.strip():
                out[current] += " " + line.strip()
    return {name: rst_to_markdown(text) for name, text in out.items()}


def context_fields(cls: type) -> List[Tuple[str, str, str, bool, str]]:
    """``(name, type, default, kept, description)`` of every dataclass field of a context class.

    Raises ``ValueError`` when the docstring describes a name that is not a field (a stale description).
    """
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    docs = _attribute_docs(cls)
    stale = sorted(set(docs) - names)
    if stale:
        raise ValueError(f"{cls.__name__}'s docstring describes {stale}, which are not fields of it")
    kept = set(cls().kept_fields)
    rows = []
    for f in fields:
        if f.default_factory is not dataclasses.MISSING:
            default = f"{f.default_factory.__name__}()"
        else:
            default = repr(f.default)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", repr(f.type))
        rows.append((f.name, kind, default, f.name in kept, docs.get(f.name, "")))
    return rows


def context_table(name: str) -> str:
    """The Markdown table of :func:`context_fields` for ``conveyor.engine.<name>``."""
    cls = getattr(importlib.import_module("conveyor.engine"), name)
    rows = [(_code(field), _code(kind), _code(default), "kept" if kept else "", doc)
            for field, kind, default, kept, doc in context_fields(cls)]
    return _table(["field", "type", "default", "kept", "meaning"], rows)


# --- middleware declarations -----------------------------------------------------------------------
def declaration(obj: Any) -> Optional[Tuple[tuple, tuple]]:
    """``(reads, writes)`` that ``conveyor.engine.declares`` set on a middleware, its class or its factory, or on
    the class a factory is annotated to return (``interaction_evaluator -> InteractionEvaluator``); or ``None``."""
    if hasattr(obj, "reads") or hasattr(obj, "writes"):
        return tuple(getattr(obj, "reads", ())), tuple(getattr(obj, "writes", ()))
    if inspect.isfunction(obj):
        try:
            product = typing.get_type_hints(obj).get("return")
        except Exception:  # an annotation that does not resolve here says nothing about declarations
            return None
        if inspect.isclass(product):
            return declaration(product)
    return None


def _signature(name: str, obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    parts, star = [], False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return f"{name}({', '.join(parts)})"


def middleware_rows() -> List[Tuple[str, str, str, str, str]]:
    """``(name, kind, summary, reads, writes)`` for every name in ``conveyor.middleware.__all__``."""
    module = importlib.import_module("conveyor.middleware")
    rows = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            rows.append((name, "exception", summary(obj), "—", "—"))
            continue
        if isinstance(obj, str):
            rows.append((name, "event name", f"`{obj!r}`", "—", "—"))
            continue
        kind = "class" if inspect.isclass(obj) else "function"
        found = declaration(obj)
        if found is None:
            reads = writes = NOT_DECLARED
        else:
            reads = ", ".join(f"`{f}`" for f in found[0]) or "nothing"
            writes = ", ".join(f"`{f}`" for f in found[1]) or "nothing"
        rows.append((_signature(name, obj), kind, summary(obj), reads, writes))
    return rows


def middleware_table() -> str:
    """The Markdown table of :func:`middleware_rows`."""
    rows = [(_code(name), kind, text, reads, writes) for name, kind, text, reads, writes in middleware_rows()]
    return _table(["name", "kind", "what it does", "reads ctx", "writes ctx"], rows)


# --- config keys -----------------------------------------------------------------------------------
def _type_text(option: Any) -> str:
    if option.choices is not None:
        return " | ".join(repr(c) for c in option.choices)
    types = option.expected_type()
    if types is None:
        text = "any"
    else:  # expected_type widens float to accept int and list to accept tuple; show what was declared
        declared = option.type if option.type is not None else type(option.default)
        declared = declared if isinstance(declared, tuple) else (declared,)
        text = " | ".join("None" if t is type(None) else t.__name__ for t in declared)
    if option.default is None and option.choices is None and not text.endswith("None"):
        text += " | None"
    return text


def config_rows(schema: Mapping[str, Any], prefix: str = "") -> List[Tuple[str, str, str, str]]:
    """``(dotted key, type, default, meaning)`` of every option of a schema (``conveyor.schema``), depth first."""
    from conveyor.schema import Option

    rows = []
    for key, spec in schema.items():
        path = f"{prefix}{key}"
        if isinstance(spec, Option):
            rows.append((path, _type_text(spec), repr(spec.default), rst_to_markdown(spec.doc)))
        else:
            rows.extend(config_rows(spec, prefix=f"{path}."))
    return rows


def config_table(schema: Mapping[str, Any], prefix: str = "") -> str:
    """The Markdown table of :func:`config_rows`."""
    rows = [(_code(key), _code(kind), _code(default), doc) for key, kind, default, doc in config_rows(schema, prefix)]
    return _table(["key", "type", "default", "meaning"], rows)


def policy_classes() -> List[type]:
    """Every concrete ``Policy`` subclass defined in the modules of ``conveyor.policy``, by name."""
    package = importlib.import_module("conveyor.policy")
    for info in pkgutil.iter_modules(package.__path__, prefix="conveyor.policy."):
        importlib.import_module(info.name)
    found, todo = set(), [package.Policy]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("conveyor.policy.") and not inspect.isabstract(sub):
                found.add(sub)
    return sorted(found, key=lambda cls: cls.__name__)


def config_section(what: str) -> str:
    """The Markdown for a ``config`` marker: ``top``, ``env`` or ``policies``."""
    if what == "top":
        from conveyor.config import TOP_SCHEMA
        return config_table(TOP_SCHEMA)
    if what == "env":
        from conveyor.envs import ENV_SCHEMA
        return config_table(ENV_SCHEMA, prefix="env.")
    if what == "policies":
        parts = []
        for cls in policy_classes():
            parts.append(f"### {cls.__name__}\n\n`{cls.__module__}.{cls.__name__}.config_schema()`: "
                         f"{summary(cls)}\n\n{config_table(cls.config_schema(), prefix='policy.')}")
        return "\n".join(parts)
    raise ValueError(f"unknown config section {what!r}: use top, env or policies")


# --- zoo -------------------------------------------------------------------------------------------
def zoo_rows() -> List[Tuple[str, str, str, str]]:
    """``(entry, env id, stop value, summary)`` of every zoo entry (``conveyor.zoo.entries()``)."""
    from conveyor.zoo import entries, load_entry

    rows = []
    for name in entries():
        module = load_entry(name)
        env = module.main_config.get("env", {})
        stop = env.get("stop_value")
        rows.append((name, env.get("env_id", ""), "" if stop is None else repr(stop), summary(module)))
    return rows


def zoo_table() -> str:
    """The Markdown table of :func:`zoo_rows`."""
    rows = [(_code(name), _code(env_id), stop, text) for name, env_id, stop, text in zoo_rows()]
    return _table(["entry", "env", "stop value", "what it trains"], rows)


# --- benchmarks ------------------------------------------------------------------------------------
def benchmark_rows() -> List[Tuple[str, str, List[str]]]:
    """``(module, first paragraph, usage lines)`` of each script in ``benchmarks/`` from its module docstring."""
    rows = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        if path.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        usage = [line.strip() for line in doc.splitlines() if line.strip().startswith("python -m benchmarks.")]
        rows.append((f"benchmarks.{path.stem}", rst_to_markdown(" ".join(doc.split("\n\n")[0].split())), usage))
    return rows


def benchmarks_section() -> str:
    """One subsection per benchmark script: what it measures and how it is run."""
    parts = []
    for script, text, usage in benchmark_rows():
        commands = "\n".join(usage)
        block = f"\n```bash\n{commands}\n```\n" if usage else ""
        parts.append(f"### `{script}`\n\n{text}\n{block}")
    return "\n".join(parts)


# --- the hook --------------------------------------------------------------------------------------
def render(kind: str, arg: Optional[str]) -> str:
    """The Markdown that replaces one marker."""
    if kind == "context-fields" and arg:
        return context_table(arg)
    if kind == "middleware" and not arg:
        return middleware_table()
    if kind == "config" and arg:
        return config_section(arg)
    if kind == "zoo" and not arg:
        return zoo_table()
    if kind == "benchmarks" and not arg:
        return benchmarks_section()
    raise ValueError(f"unknown marker 'generated: {kind}{' ' + arg if arg else ''}'")


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs event: replace every marker of the page with its generated table."""
    def replace(match: "re.Match[str]") -> str:
        try:
            return render(match.group(1), match.group(2))
        except Exception as exc:
            raise RuntimeError(f"{page.file.src_path}: {match.group(0)}: {exc}") from exc

    return MARKER.sub(replace, markdown)

