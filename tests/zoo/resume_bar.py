"""Helpers for the exact-resume tests: run the CLI, compare checkpoints recursively."""
from __future__ import annotations

import concurrent.futures
import contextlib
from pathlib import Path
from typing import Any, List, Sequence, Tuple

import numpy as np
import torch

from conveyor.cli import main as cli
from conveyor.middleware import load_checkpoint
from tests.cli_helpers import run_conveyor


def straight_and_split(cwd: Path, entry: str, options: Sequence[str], n: int) -> Tuple[Any, Any]:
    """The final checkpoints of a run of ``entry`` straight to ``2 * n`` env steps (``runs/straight``) and of one
    stopped at ``n`` and resumed to ``2 * n`` (``runs/split``; the resume adds no option). The split's first part
    runs in a ``conveyor`` process of its own, which ends at its stop; the straight run (beside it) and the resume
    run in this process, which never held the first part's memory and has torch loaded already."""
    argv = ["train", entry, *options, "--no-progress"]
    with contextlib.chdir(cwd), concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(run_conveyor, ["conveyor", *argv, "--exp-name", "split", "--max-env-step", str(n)], cwd,
                            timeout=300)
        assert cli(argv + ["--exp-name", "straight", "--max-env-step", str(2 * n)]) == 0
        first = first.result()
        assert first.returncode == 0, first.stderr[-2000:]
        assert cli(["train", entry, "--exp-name", "split", "--resume", "--max-env-step", str(2 * n),
                    "--no-progress"]) == 0
    return (load_checkpoint(cwd / "runs" / "straight" / "ckpt" / "final.pth.tar"),
            load_checkpoint(cwd / "runs" / "split" / "ckpt" / "final.pth.tar"))


def differences(a: Any, b: Any, path: str = "") -> List[str]:
    """Where two checkpoints differ (tensors compared with torch.equal), ignoring every ``meta`` entry."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only in one" for k in set(a) ^ set(b) if k != "meta"]
        for k in a.keys() & b.keys():
            if k != "meta":
                out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [f"{path}: tensors differ"]
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return [] if a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True) else [f"{path}: arrays differ"]
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, float) and np.isnan(a) and np.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} != {b!r}"[:200]]
