"""Checkpoints: consistent cuts of the whole pipeline, written atomically.

A checkpoint file holds ``task.state_dict()`` (the context's kept fields and ``total_step``, every
stateful middleware, and the objects registered with ``task.register_state``: policy, buffer, RNGs)
plus a ``"meta"`` entry (when it was written, by what), the only part that differs between two runs
that did the same work. :class:`CkptSaver` takes it through ``task.between_iterations``, so no
middleware runs while it is gathered, in sync and async mode alike. Files are written to a temporary
file that is renamed into place; temporary files a killed write left behind are removed by the next
:class:`CkptSaver` on the same folder.

Every file carries ``"format_version"`` (:data:`FORMAT_VERSION`; a file without it is version 0).
:func:`load_checkpoint` converts an older layout to today's through :data:`CONVERTERS`, one step at a time,
and refuses a newer one. See docs/checkpoints.md, "Across versions".
"""
from __future__ import annotations

import errno
import io
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Union

import torch

from conveyor.engine import FINISH_EVENT, Context, OnlineRLContext, declares, task
from conveyor.middleware.evaluator import EVAL_EVENT

__all__ = ["CheckpointError", "CheckpointVersionError", "CkptSaver", "FORMAT_VERSION", "CONVERTERS", "save_checkpoint",
           "load_checkpoint", "restore", "remove_stale_temps"]

PathLike = Union[str, "os.PathLike[str]"]

_TEMP_SUFFIX = ".tmp"
_EVAL_KEYS = ("returns", "lengths", "mean", "std", "env_step", "train_iter", "weight_version", "crashes", "dropped",
              "seed", "agent_returns", "agent_mean")
FD_RETRY_S = 5.0
"""How long :func:`save_checkpoint` retries a write that found no free file descriptor."""


class CheckpointError(OSError):
    """A checkpoint (or another file of a run) could not be written or read; the message names the path
    and the cause."""

    def __init__(self, action: str, path: Path, cause: OSError, what: str = "checkpoint") -> None:
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.message = f"cannot {action} {what} {path}: {cause.strerror or cause}"
        if cause.filename and str(cause.filename) != str(path):
            self.message += f" ({cause.filename})"

    def __str__(self) -> str:
        return self.message


class CheckpointVersionError(CheckpointError):
    """A checkpoint whose format version this code cannot read: newer than :data:`FORMAT_VERSION`, or with no
    converter to today's layout. The message names the version and the fix."""

    def __init__(self, path: Path, message: str) -> None:
        OSError.__init__(self, errno.EINVAL, message, str(path))
        self.message = message


FORMAT_VERSION = 1
"""The layout :func:`save_checkpoint` writes. Raise it when the layout changes, and add a converter from the
previous version to :data:`CONVERTERS` (and a fixture set, docs/checkpoints.md "Across versions")."""


def _v0_to_v1(state: Dict[str, Any]) -> Dict[str, Any]:
    """Version 0 (before ``format_version`` existed, back to e3c69fd) has today's layout: nothing moves."""
    return state


CONVERTERS: Dict[int, Callable[[Dict[str, Any]], Dict[str, Any]]] = {0: _v0_to_v1}
"""``CONVERTERS[n]`` turns a version-``n`` checkpoint into a version-``n + 1`` one; applied in order on load."""


def _upgrade(state: Dict[str, Any], path: Path) -> Dict[str, Any]:
    """``state`` converted to :data:`FORMAT_VERSION` (without its ``format_version``: what was saved comes back),
    or a :class:`CheckpointVersionError` saying why it cannot be."""
    version = state.pop("format_version", 0) if isinstance(state, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise CheckpointVersionError(path, f"{path} is not a Conveyor checkpoint (format version {version!r}): "
                                           f"give a .pth.tar file written by conveyor train")
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(path, f"{path} has checkpoint format version {version}, newer than this "
                                           f"Conveyor reads ({FORMAT_VERSION}): upgrade Conveyor to load it")
    while version < FORMAT_VERSION:
        if version not in CONVERTERS:
            raise CheckpointVersionError(path, f"{path} has checkpoint format version {version}, which this Conveyor "
                                               f"cannot convert to {FORMAT_VERSION}: load it with the release that "
                                               f"wrote it")
        state = CONVERTERS[version](state)
        version += 1
    return state


def save_checkpoint(path: PathLike, state: Dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically: serialise in memory, write a temporary file in the same
    folder, fsync, rename, fsync the folder. A disk error is a :class:`CheckpointError` naming the path.
    Running out of file descriptors (a flood of connections holds them a moment) is retried for up to
    ``FD_RETRY_S`` seconds first."""
    path = Path(path)
    buffer = io.BytesIO()
    # in memory first: a full disk then fails in our write, not inside torch
    torch.save({**state, "format_version": FORMAT_VERSION}, buffer)
    deadline, pause = time.monotonic() + FD_RETRY_S, 0.01
    while True:
        try:
            return _write_atomically(path, buffer)
        except CheckpointError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.5)


def _write_atomically(path: Path, buffer: io.BytesIO) -> Path:
    """One try of :func:`save_checkpoint`'s write."""
    tmp: Optional[str] = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TEMP_SUFFIX, dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise CheckpointError("write", path, exc) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path


def remove_stale_temps(directory: PathLike) -> int:
    """Delete the temporary files that writes killed mid-way left in ``directory``; returns how many."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    removed = 0
    for stale in directory.glob(f".*{_TEMP_SUFFIX}"):
        stale.unlink(missing_ok=True)
        removed += 1
    return removed


def load_checkpoint(path: PathLike) -> Dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (or :class:`CkptSaver`) of this or an earlier
    version, converted to today's layout (the one place where old layouts are converted): the ``state`` saved."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: run training first, or check the experiment name")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except OSError as exc:
        raise CheckpointError("read", path, exc) from exc
    return _upgrade(state, path)


def restore(path: PathLike, policy: Any, ctx: Optional[Context] = None, buffer: Any = None) -> Dict[str, Any]:
    """Load a checkpoint's policy (and, where saved, context kept fields and replay buffer) outside a pipeline.

    Reads ``latest`` / ``final`` files (``task.state_dict()`` layout) and ``eval_best`` files alike. To
    resume a whole pipeline, use ``task.load_state_dict`` instead.
    """
    state = load_checkpoint(path)
    objects = state.get("objects", {})
    policy.load_state_dict(objects["policy"] if "policy" in objects else state["policy"])
    if ctx is not None and state.get("ctx") is not None:
        kept = dict(state["ctx"])
        total_step = kept.pop("total_step", None)
        ctx.load_state_dict(kept)
        if total_step is not None:
            ctx.total_step = total_step
    if buffer is not None and objects.get("buffer") is not None:
        buffer.load_state_dict(objects["buffer"])
    return state


def _register(name: str, obj: Any) -> None:
    """``task.register_state(name, obj)`` where possible: inside ``task.start`` and the name still free."""
    if obj is None or not hasattr(obj, "state_dict"):
        return
    try:
        task.register_state(name, obj)
    except (RuntimeError, ValueError, TypeError):
        pass  # outside task.start, the pipeline registered its own under that name, or it is not saveable


@declares(reads=("eval_output", "train_iter"), optional=("eval_output",), writes=("last_save_iter",))
class CkptSaver:
    """Writes consistent checkpoints of the whole pipeline, and the evaluated weights that scored best.

    Files under ``<save_dir>/ckpt/``:

    - ``latest.pth.tar``: ``task.state_dict()`` every ``train_freq`` train iterations and every
      ``interval_s`` seconds of wall-clock time (what ``--resume`` reads); taken between iterations.
    - ``final.pth.tar`` and ``latest.pth.tar`` when the run ends normally (``max_step``, ``task.finish``:
      a budget, the stop value, a signal), or in an error raised at an iteration's start, before anything of
      it ran (``error.at_iteration_start``: an exchanger's wait for another node that timed out). If the run
      stopped because an evaluation reached the stop value, the policy in them is the evaluated snapshot.
    - ``eval_best.pth.tar``: ``{"policy": snapshot.state_dict(), "eval": {...}, "meta": {...}}`` of each
      evaluation whose mean return (a team's: summed over agents) beats the best so far; the best score is
      part of the saver's state, so it survives a resume.

    Built inside ``task.start``, the saver registers ``policy`` (and ``buffer`` if given) with
    ``task.register_state`` under those names, unless something is registered under them already; register
    other objects (RNGs, ...) yourself.
    ``meta`` is merged into every file's ``"meta"`` entry (e.g. the entry and policy names).

    Evaluations are read from ``ctx.eval_output`` and from the evaluator's ``EVAL_EVENT`` (an evaluation
    that reaches the stop value ends its iteration before the saver is entered).

    Reads ctx: ``train_iter``, ``eval_output``. Writes ctx: ``last_save_iter``.
    """

    def __init__(self, policy: Any, save_dir: PathLike, train_freq: Optional[int] = None, *, buffer: Any = None,
                 interval_s: Optional[float] = None, save_finish: bool = True,
                 meta: Optional[Mapping[str, Any]] = None) -> None:
        if train_freq is not None and (not isinstance(train_freq, int) or train_freq <= 0):
            raise ValueError(f"CkptSaver(train_freq={train_freq!r}): must be an int > 0, or None to save only "
                             f"the best and final checkpoints")
        if interval_s is not None and not interval_s > 0:
            raise ValueError(f"CkptSaver(interval_s={interval_s!r}): must be a number of seconds > 0, or None")
        self._policy = policy
        self._dir = Path(save_dir) / "ckpt"
        self._train_freq = train_freq
        self._interval_s = interval_s
        self._save_finish = save_finish
        self._meta = dict(meta or {})
        self._best: Optional[float] = None
        self._last_save_iter = 0
        self._last_write = time.monotonic()
        self._stop_snapshot: Any = None
        self._seen: Any = None
        for name, obj in (("policy", policy), ("buffer", buffer)):
            _register(name, obj)
        task.on(FINISH_EVENT, self._on_finish)
        task.on(EVAL_EVENT, self._on_evaluation)  # also sees an evaluation that ended its iteration early
        remove_stale_temps(self._dir)

    def __repr__(self) -> str:
        return f"CkptSaver(dir={str(self._dir)!r}, train_freq={self._train_freq}, interval_s={self._interval_s})"

    @property
    def directory(self) -> Path:
        """Where checkpoints are written."""
        return self._dir

    def state_dict(self) -> Dict[str, Any]:
        """The best evaluation score so far and the train iteration of the last periodic save."""
        return {"best": self._best, "last_save_iter": self._last_save_iter}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`: a resumed run only replaces ``eval_best`` with a better score."""
        self._best = state["best"]
        self._last_save_iter = int(state["last_save_iter"])

    def __call__(self, ctx: OnlineRLContext) -> None:
        self._on_evaluation(ctx.eval_output)
        now = time.monotonic()
        due = self._train_freq is not None and ctx.train_iter - self._last_save_iter >= self._train_freq
        if due:
            self._last_save_iter = ctx.last_save_iter = ctx.train_iter
        if due or (self._interval_s is not None and now - self._last_write >= self._interval_s):
            self._last_write = now
            task.between_iterations(lambda: self.save("latest.pth.tar"))

    def save(self, *names: str, state: Optional[Dict[str, Any]] = None) -> Path:
        """Write ``task.state_dict()`` (or ``state``) now to each of ``names``; call it between iterations."""
        if state is None:
            state = task.state_dict()
        state["meta"] = {**self._meta, "saved_at": time.time()}
        path = self._dir
        for name in names:
            path = save_checkpoint(self._dir / name, state)
        return path

    def _on_evaluation(self, out: Any) -> None:
        """Write ``eval_best`` if this evaluation beats the best so far (each result is handled once)."""
        if not isinstance(out, dict) or out.get("mean") is None or out is self._seen:
            return
        self._seen = out
        if self._best is None or out["mean"] > self._best:
            self._best = out["mean"]
            self._save_best(out)
        if out.get("stop_value_reached"):
            self._stop_snapshot = out.get("snapshot")

    def _save_best(self, out: Mapping[str, Any]) -> None:
        snapshot = out.get("snapshot")
        holder = snapshot if hasattr(snapshot, "state_dict") else self._policy
        state = {"policy": holder.state_dict(), "eval": {key: out.get(key) for key in _EVAL_KEYS}}
        self.save("eval_best.pth.tar", state=state)

    def _on_finish(self, error: Optional[BaseException] = None) -> None:
        if (error is not None and not getattr(error, "at_iteration_start", False)) or not self._save_finish:
            return
        state = task.state_dict()
        snapshot = self._stop_snapshot
        if snapshot is not None and hasattr(snapshot, "state_dict") and "policy" in state.get("objects", {}):
            state["objects"]["policy"] = snapshot.state_dict()  # the weights that reached the stop value
        self.save("final.pth.tar", "latest.pth.tar", state=state)
