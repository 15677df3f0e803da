"""Griffe extension for the API reference: Conveyor's docstrings are written in reStructuredText markup
(``literals``, :class:`roles`, ``>>>`` examples, ``::`` literal blocks); this shows them as Markdown."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, List

from griffe import Extension, Object

_spec = importlib.util.spec_from_file_location("conveyor_docs", Path(__file__).with_name("conveyor_docs.py"))
_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tables)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_docstring(text: str) -> str:
    """A docstring as Markdown: inline markup as code spans, ``>>>`` examples and ``::`` blocks as fenced code."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        pad = line[:_indent(line)]
        if line.lstrip().startswith(">>>"):
            block: List[str] = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(pad):])
                i += 1
            out += [pad + "```pycon", *(pad + b for b in block), pad + "```"]
            continue
        if line.rstrip().endswith("::"):
            head = line.rstrip()[:-1]
            out.append(_tables.rst_to_markdown(head) if head.strip() != ":" else "")
            i += 1
            while i < len(lines) and not lines[i].strip():
                i += 1
            block, depth = [], _indent(lines[i]) if i < len(lines) else 0
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) >= depth > len(pad)):
                block.append(lines[i][depth:])
                i += 1
            while block and not block[-1]:
                block.pop()
            out += ["", pad + "```python", *(pad + b if b else "" for b in block), pad + "```", ""]
            continue
        out.append(_tables.rst_to_markdown(line))
        i += 1
    return "\n".join(out)


class RstToMarkdown(Extension):
    """Rewrites every docstring with :func:`rst_docstring` once the object tree is loaded."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_docstring(obj.docstring.value)
