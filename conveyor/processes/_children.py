"""Children started with :mod:`multiprocessing` and a duplex pipe: started, watched for death, stopped, and their
exceptions carried back to the parent."""
from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import pickle
import select
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from conveyor.processes._cleanup import track_shared_memory
from conveyor.processes._signals import describe_exit, ignore_stop_signals

__all__ = ["GOODBYE", "Child", "ChildLost", "RemoteTraceback", "child_started", "default_start_method",
           "pack_exception", "send_quietly", "start_frozen", "stop", "unpack_exception"]

log = logging.getLogger(__name__)

_LOST_WAIT_S = 2.0
"""How long a child whose pipe broke is waited for, to tell how it ended."""
GOODBYE = pickle.dumps(("close", None))
"""What :meth:`Child.stop` sends by default: the children of this project answer it by returning."""


class RemoteTraceback(Exception):
    """The traceback text of a child's exception, set as the ``__cause__`` of the one raised in the parent."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.tb.rstrip()}\n\"\"\""


class ChildLost(RuntimeError):
    """A child process died, or did not answer in time and was killed."""


def pack_exception(exc: BaseException) -> tuple:
    """``(pickled exception or None where it does not round-trip, "Type: message", traceback text)``."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob: Optional[bytes] = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    return blob, f"{type(exc).__name__}: {exc}", text


def unpack_exception(packed: tuple, fallback: Callable[[str], BaseException] = RuntimeError) -> BaseException:
    """The exception :func:`pack_exception` packed (else ``fallback("Type: message")``), its traceback text as
    its ``__cause__``."""
    blob, summary, text = packed
    try:
        exc = pickle.loads(blob) if blob is not None else None
    except Exception:
        log.warning("an exception sent by a child process does not unpickle here", exc_info=True)
        exc = None
    if not isinstance(exc, BaseException):
        exc = fallback(summary)
    exc.__cause__ = RemoteTraceback(text)
    return exc


def send_quietly(conn: Any, message: Any) -> None:
    """Send ``message`` pickled if the connection still takes it (an error report on the way out)."""
    try:
        conn.send_bytes(pickle.dumps(message))
    except Exception:
        pass


def default_start_method(requested: Optional[str]) -> Optional[str]:
    """The start method for a child process: ``requested``, else multiprocessing's default, except "spawn"
    once this process has initialised CUDA (a forked child cannot use CUDA, and a policy replica may)."""
    if requested is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return "spawn"
    return requested


def start_frozen(proc: Any) -> None:
    """Start ``proc`` (a ``multiprocessing.Process``) so that, if forked, it never finalizes what it inherited:
    garbage of the parent's (a socket of a library whose threads a fork does not copy, such as nng) would
    abort the child if its collector ran there. The parent's objects are frozen out of the garbage collector
    while it forks; the child calls :func:`child_started` first thing."""
    enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        proc.start()
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def child_started() -> None:
    """In a child started by :func:`start_frozen`: collect garbage again, leaving what was inherited alone."""
    gc.enable()


def _child_main(target: Callable[..., Any], conn: Any, inherited: Any, args: tuple) -> None:
    child_started()
    # Started daemonic (multiprocessing ends it when the parent exits), but multiprocessing refuses children to a
    # daemonic process, and a collector process starts its env manager's worker processes (themselves daemonic).
    mp.current_process().daemon = False
    ignore_stop_signals()  # Ctrl-C and a SIGTERM to the group are for the parent, which stops its children
    if inherited is not None:
        inherited.close()  # the parent's end, copied by the fork: the pipe must break when the parent goes
    target(conn, *args)


class Child:
    """A child process running ``target(conn, *args)`` (a module-level function), and the parent's end of their
    duplex pipe. Started at once, daemonic (multiprocessing ends it if the parent exits normally), with
    SIGINT and SIGTERM ignored: the parent stops it (:meth:`stop`). ``label`` names it in errors
    (``"worker process 3"``; ``{pid}`` in it is replaced by its pid). ``start_method``: see
    :func:`default_start_method`."""

    def __init__(self, target: Callable[..., Any], args: tuple = (), *, name: str, label: str,
                 start_method: Optional[str] = None) -> None:
        track_shared_memory()  # before the fork: a block it attaches later stays the parent's to free
        context = mp.get_context(default_start_method(start_method))
        self.conn, theirs = context.Pipe(duplex=True)
        inherited = self.conn if context.get_start_method() == "fork" else None
        self.proc = context.Process(target=_child_main, args=(target, theirs, inherited, args), name=name, daemon=True)
        try:
            start_frozen(self.proc)
        finally:
            theirs.close()
        self.label = label.format(pid=self.proc.pid)
        self._poller = select.poll()  # made once: a step's wait is one system call
        for fd in (self.conn.fileno(), self.proc.sentinel):
            self._poller.register(fd, select.POLLIN)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    def send_bytes(self, data: bytes) -> bool:
        """Send ``data``; False if the pipe is broken (the child is gone)."""
        try:
            self.conn.send_bytes(data)
            return True
        except OSError:
            return False

    def recv_bytes(self, timeout: Optional[float] = None, limit: str = "timeout") -> bytes:
        """The child's next message. Raises :class:`ChildLost` if the child ends first (watched on its process
        sentinel, so children of its own holding the pipe cannot hide its death), or, with ``timeout``, if it
        does not answer within that many seconds (it is killed then; ``limit`` names the setting)."""
        if not self._poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
            self.kill()
            raise ChildLost(f"{self.label} did not answer within {limit}={timeout}s and was killed")
        try:
            if self.conn.poll():
                return self.conn.recv_bytes()
        except (EOFError, OSError):
            pass
        raise self.lost()

    def lost(self) -> ChildLost:
        """Why the pipe broke: how the child ended (waited for a moment)."""
        self.proc.join(_LOST_WAIT_S)
        return ChildLost(f"{self.label} {describe_exit(self.proc.exitcode)}")

    def poll(self) -> Optional[int]:
        """Its exit code (negative: killed by that signal), None while it runs."""
        return self.proc.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait until it ends; ``subprocess.TimeoutExpired`` if it runs on past ``timeout``."""
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.label, timeout or 0.0)
        return self.proc.exitcode

    def terminate(self) -> None:
        """SIGTERM (a :class:`Child` ignores it: ask with a goodbye instead, see :func:`stop`)."""
        self.proc.terminate()

    def kill(self) -> None:
        """SIGKILL."""
        self.proc.kill()

    def close(self) -> None:
        """Close the parent's end of the pipe."""
        self.conn.close()

    def stop(self, grace_s: float, goodbye: Optional[bytes] = GOODBYE) -> None:
        """:func:`stop` this child alone, then close the pipe."""
        stop([self], grace_s, goodbye)
        self.close()


def stop(children: Sequence[Any], grace_s: float, goodbye: Optional[bytes] = None, warn: bool = False) -> None:
    """Ask every child still running to stop, all at once (send ``goodbye`` on its pipe, or SIGTERM if None), SIGKILL
    those still there after ``grace_s`` (with a warning if ``warn``), and reap them all. ``children``: :class:`Child`
    objects or anything with ``poll`` / ``wait`` / ``terminate`` / ``kill`` as ``subprocess.Popen`` has them."""
    for child in children:
        if child.poll() is None:
            if goodbye is None:
                child.terminate()
            else:
                child.send_bytes(goodbye)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if warn:
                log.warning("%s did not stop within %ss; killing it", child, grace_s)
            child.kill()
            child.wait()
