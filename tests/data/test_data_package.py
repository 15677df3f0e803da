"""conveyor.data's public face and its place in the layers."""
import ast
from pathlib import Path

import conveyor.data

FORBIDDEN = ("conveyor.engine", "conveyor.middleware", "conveyor.policy", "conveyor.envs", "conveyor.zoo")


def test_every_public_name_is_exported():
    assert {"DequeBuffer", "to_tensor", "to_numpy", "stack_nested", "as_tree", "flatten_batch", "map_nested",
            "tree_of_tensors"} <= set(conveyor.data.__all__)
    assert all(hasattr(conveyor.data, name) for name in conveyor.data.__all__)


def test_data_imports_no_upper_layer():
    imported = set()
    for source in Path(conveyor.data.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
    assert not {name for name in imported if name.startswith(FORBIDDEN)}
