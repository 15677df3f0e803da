"""conveyor.envs as a package: its public names, its imports, and what importing it pulls in."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import conveyor.envs

UPPER_LAYERS = ("conveyor.engine", "conveyor.middleware", "conveyor.policy", "conveyor.zoo")


def test_every_public_name_is_exported_and_documented():
    for name in conveyor.envs.__all__:
        value = getattr(conveyor.envs, name)
        assert name in ("ENV_SCHEMA", "EnvFn") or value.__doc__, name


def test_envs_modules_import_no_upper_layer():
    for path in Path(conveyor.envs.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith(UPPER_LAYERS)], f"{path.name} imports {names}"


def test_importing_envs_pulls_in_no_torch():
    code = "import sys, conveyor.envs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
