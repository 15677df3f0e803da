"""The tables the docs site generates from the code (docs/hooks/conveyor_docs.py) have a row for everything."""
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

import conveyor.middleware
from conveyor.engine import OfflineRLContext, OnlineRLContext, declares
from conveyor.envs import ENV_SCHEMA

ROOT = Path(__file__).resolve().parents[1]


def _load_hook():
    spec = importlib.util.spec_from_file_location("conveyor_docs", ROOT / "docs" / "hooks" / "conveyor_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs = _load_hook()


def _first_cells(table: str) -> list:
    """The first cell of each body row of a Markdown table, without its backticks."""
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]  # after the header and rule
    return [row.split(" | ")[0][2:].strip("`") for row in rows]


@pytest.mark.parametrize("cls", [OnlineRLContext, OfflineRLContext])
def test_context_table_has_a_row_per_field(cls):
    names = [f.name for f in dataclasses.fields(cls)]
    assert _first_cells(docs.context_table(cls.__name__)) == names


def test_context_table_marks_the_kept_fields():
    rows = {name: kept for name, _, _, kept, _ in docs.context_fields(OnlineRLContext)}
    assert {name for name, kept in rows.items() if kept} == set(OnlineRLContext().kept_fields)


def test_middleware_table_has_a_row_per_public_name():
    names = [cell.split("(")[0] for cell in _first_cells(docs.middleware_table())]
    assert names == list(conveyor.middleware.__all__)


def test_declarations_are_read_from_middleware_classes_factories_and_the_classes_factories_return():
    @declares(reads=("env_step",), writes=("train_data",))
    class Fetcher:
        def __call__(self, ctx):
            pass

    @declares(reads=("trajectories",), writes=("trajectories",))
    def scaler(scale):
        return lambda ctx: None

    def fetcher(cfg) -> Fetcher:
        return Fetcher()

    def undeclared(ctx):
        pass

    assert docs.declaration(Fetcher) == (("env_step",), ("train_data",))
    assert docs.declaration(scaler) == (("trajectories",), ("trajectories",))
    assert docs.declaration(fetcher) == (("env_step",), ("train_data",))
    assert docs.declaration(undeclared) is None


def test_config_tables_have_a_row_per_option():
    keys = [key for key, *_ in docs.config_rows(ENV_SCHEMA, prefix="env.")]
    assert keys == [f"env.{key}" for key in ENV_SCHEMA]
    for cls in docs.policy_classes():
        table_keys = _first_cells(docs.config_table(cls.config_schema(), prefix="policy."))
        assert table_keys == [key for key, *_ in docs.config_rows(cls.config_schema(), prefix="policy.")]
        assert "policy.learn.learning_rate" in table_keys


def test_every_marker_in_the_pages_renders():
    pages = sorted((ROOT / "docs").rglob("*.md"))
    markers = [m for page in pages for m in docs.MARKER.finditer(page.read_text())]
    assert {m.group(1) for m in markers} >= {"context-fields", "middleware", "config", "benchmarks"}
    for marker in markers:
        assert docs.render(marker.group(1), marker.group(2)).startswith(("|", "#"))


def test_an_unknown_marker_fails_the_build():
    with pytest.raises(ValueError, match="unknown marker"):
        docs.render("no-such-table", None)


def test_docstring_roles_become_code():
    assert docs.rst_to_markdown("see :class:`~conveyor.engine.Task` and ``ctx.keep``") == \
        "see `Task` and `ctx.keep`"


def test_di_engine_page_names_only_config_keys_that_exist():
    keys = {key for key, *_ in docs.config_rows(ENV_SCHEMA, prefix="env.")}
    for cls in docs.policy_classes():
        keys |= {key for key, *_ in docs.config_rows(cls.config_schema(), prefix="policy.")}
    page = (ROOT / "docs" / "di-engine.md").read_text()
    renames = [line.split(" | ")[1] for line in page.splitlines() if line.startswith("| `policy.")]
    named = {path for cell in renames for path in re.findall(r"`((?:policy|env)\.[\w.]+)`", cell)}
    assert named and named <= keys, sorted(named - keys)


def test_api_reference_shows_rst_docstrings_as_markdown():
    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("griffe_rst", ROOT / "docs" / "hooks" / "griffe_rst.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "Use it like this::\n\n    task.run()\n\nThen :meth:`Task.stop`.\n\n>>> 1 + 1\n2"
    assert module.rst_docstring(text) == ("Use it like this:\n\n```python\ntask.run()\n```\n\nThen `Task.stop`.\n\n"
                                          "```pycon\n>>> 1 + 1\n2\n```")


def test_every_test_the_reliability_page_cites_exists():
    """docs/reliability.md backs each promise with a test: ``tests/FILE.py::name``, or ``::name`` in the file last named."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    missing, current = [], None
    for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", text):
        current = path or current
        if not (ROOT / current).is_file():
            missing.append(current)
        elif name and not re.search(rf"^def {name}\(", (ROOT / current).read_text(), re.MULTILINE):
            missing.append(f"{current}::{name}")
    assert current is not None and missing == []
