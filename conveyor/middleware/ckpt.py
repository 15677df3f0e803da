"""Checkpoints: written atomically, so a killed process never leaves a half-written file behind."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from conveyor.engine import Context, OnlineRLContext, task

__all__ = ["CkptSaver", "save_checkpoint", "load_checkpoint", "restore"]

PathLike = Union[str, "os.PathLike[str]"]


def save_checkpoint(path: PathLike, state: Dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically: temporary file in the same folder, fsync, rename, fsync folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(path: PathLike) -> Dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (or :class:`CkptSaver`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: run training first, or check the experiment name")
    return torch.load(path, map_location="cpu", weights_only=False)


def restore(path: PathLike, policy: Any, ctx: Optional[Context] = None, buffer: Any = None) -> Dict[str, Any]:
    """Load a checkpoint into a policy, a context's kept fields and a replay buffer (where saved)."""
    state = load_checkpoint(path)
    policy.load_state_dict(state["policy"])
    if ctx is not None and "ctx" in state:
        ctx.load_state_dict(state["ctx"])
    if buffer is not None and state.get("buffer") is not None:
        buffer.load_state_dict(state["buffer"])
    return state


class CkptSaver:
    """Saves the policy, the context's kept fields and, on request, the replay buffer.

    Files under ``<save_dir>/ckpt/``: ``latest.pth.tar`` every ``train_freq`` train iterations (what
    ``--resume`` reads), ``eval_best.pth.tar`` whenever the evaluation return improves, and
    ``final.pth.tar`` when the pipeline finishes.

    Reads ctx: ``train_iter``, ``last_save_iter``, ``eval_value``, kept fields. Writes ctx: ``last_save_iter``.
    """

    def __init__(self, policy: Any, save_dir: PathLike, train_freq: Optional[int] = None, *,
                 buffer: Any = None, save_finish: bool = True) -> None:
        if train_freq is not None and (not isinstance(train_freq, int) or train_freq <= 0):
            raise ValueError(f"CkptSaver(train_freq={train_freq!r}): must be an int > 0, or None to save only "
                             f"the best and final checkpoints")
        self._policy = policy
        self._dir = Path(save_dir) / "ckpt"
        self._train_freq = train_freq
        self._buffer = buffer
        self._save_finish = save_finish
        self._best: Optional[float] = None

    def __repr__(self) -> str:
        return f"CkptSaver(dir={str(self._dir)!r}, train_freq={self._train_freq})"

    @property
    def directory(self) -> Path:
        """Where checkpoints are written."""
        return self._dir

    def __call__(self, ctx: OnlineRLContext):
        due = self._train_freq is not None and ctx.train_iter > 0 and \
            ctx.train_iter - (ctx.last_save_iter or 0) >= self._train_freq
        if due:
            ctx.last_save_iter = ctx.train_iter
            self.save(ctx, "latest.pth.tar")
        if ctx.eval_value is not None and (self._best is None or ctx.eval_value > self._best):
            self._best = ctx.eval_value
            self.save(ctx, "eval_best.pth.tar", with_buffer=False)
        yield
        if task.finish and self._save_finish:
            ctx.last_save_iter = ctx.train_iter
            self.save(ctx, "final.pth.tar")
            self.save(ctx, "latest.pth.tar")

    def save(self, ctx: Context, name: str, with_buffer: bool = True) -> Path:
        """Write one checkpoint file now."""
        state = {"policy": self._policy.state_dict(), "ctx": ctx.state_dict(), "saved_at": time.time(),
                 "buffer": self._buffer.state_dict() if (with_buffer and self._buffer is not None) else None}
        return save_checkpoint(self._dir / name, state)
