"""A zygote: a preloading process that forks children on request, so that heavy imports (torch) happen once.

:class:`Zygote` starts ``python -c`` running :func:`zygote_main`, which gets multiprocessing's preparation data
(``sys.path``, the working directory, the main module, as its ``spawn`` start method sends them; the main
module is imported there) and imports the modules it is given (no torch op runs and no Python thread starts
there). It then forks a child per :meth:`Zygote.fork`: the child holds one end of its own socket pair with the
parent (passed through the zygote's connection as a descriptor, SCM_RIGHTS), applies the preparation data
sent on it, and calls the zygote's ``entry(conn)`` (``"module:function"``), whose return is its exit code.

The zygote reaps the children (through pidfds) and reports their exit codes, and signals one for the parent
only while it is unreaped (so never a reused pid); it ignores SIGINT and holds SIGTERM blocked (the parent
decides; a child forked from it unblocks SIGTERM once its handler is in, so one sent at its birth is
delivered then, not lost) and leaves once the parent closes its connection and its children are gone.
A script that starts children without an ``if __name__ == "__main__":`` guard would start them again in the
zygote, which imports it: :func:`importing_main` tells the caller so, to refuse it as multiprocessing does.
A child ends as multiprocessing's forked children do: non-daemon threads joined, ``atexit`` handlers run,
streams flushed, then ``os._exit`` (tearing down an interpreter that imported torch took about 1 s of CPU).
No multiprocessing helper process (resource tracker) is started, so stopping the children leaves nothing.
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing import connection as mp_connection
from multiprocessing import reduction as mp_reduction
from multiprocessing import spawn as mp_spawn
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

from conveyor.processes._signals import raise_terminated, signals_held

__all__ = ["Forked", "UnguardedStart", "Zygote", "importing_main", "preparation", "zygote_main"]

log = logging.getLogger(__name__)

_CODE = "from conveyor.processes._zygote import zygote_main; zygote_main()"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_importing_main = False
"""True in the zygote while it imports the parent's main module."""


class UnguardedStart(RuntimeError):
    """Children were asked for while the zygote imports the parent's main module: a script with no main guard.
    Raise it there (its message names the fix): the zygote reports it to the parent as it is."""


def importing_main() -> bool:
    """Whether this is a zygote importing its parent's main module (starting children now would recurse)."""
    return _importing_main


def preparation(name: str) -> Dict[str, Any]:
    """multiprocessing's preparation data for a process called ``name``, without its own key (no process
    needs it, and it must not travel)."""
    data = mp_spawn.get_preparation_data(name)
    data.pop("authkey", None)
    return data


class Forked:
    """The parent's handle on a child the zygote forked, with what ``subprocess.Popen`` offers: ``pid``,
    ``returncode`` (negative: killed by that signal), ``poll``, ``wait``, ``terminate``, ``kill``."""

    def __init__(self, zygote: "Zygote", pid: int, name: str) -> None:
        self.zygote, self.pid, self.name = zygote, pid, name
        self.returncode: Optional[int] = None

    def __repr__(self) -> str:
        return f"{self.name} (pid {self.pid})"

    def poll(self) -> Optional[int]:
        """Its exit code (negative: killed by that signal), None while it runs."""
        self.zygote.pump(0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait until the zygote reports its exit; ``subprocess.TimeoutExpired`` past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"child pid {self.pid}", timeout or 0.0)
            self.zygote.pump(left)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Have the zygote send it ``signum``, if it still runs."""
        if self.poll() is None:  # the zygote signals it only while it has not reaped it: no pid reuse
            with signals_held():
                self.zygote.conn.send(("signal", self.pid, int(signum)))

    def terminate(self) -> None:
        """SIGTERM: in a child, :class:`~conveyor.processes.Terminated` (exit code 143) unless it handles it."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


# Why not multiprocessing's forkserver with set_forkserver_preload: benchmarks/process_start.py measured both
# bringing up 3 ready nodes (2026-11-25, load 6-8): ready 7.92 s here against 7.71 s (ratio 0.97), as fast.
# But a forkserver starts the resource tracker (a helper process left behind), does not hold SIGTERM for a
# child until its handler is in, and on Python 3.11 ignores "__main__" in its preload list (the entry's own
# imports, torch, would have to be found by hand); the runner's tests ask for all three (docs/benchmarks.md).
class Zygote:
    """A preloading process that imports ``modules`` and forks children running ``entry`` (``"module:function"``,
    called with the child's connection to this process; returns its exit code). Its failures (it could not
    import the main module, it died) raise ``error``, with ``owner`` (who starts the children, ``what``) first in
    the message. ``ready_timeout_s`` bounds the fork once the zygote's imports are done; the imports themselves
    (slow on a loaded machine: torch) are bounded by what the zygote does, not by the clock: TimeoutError if it
    uses ``ready_timeout_s`` of CPU on them, or none for ``ready_timeout_s`` (blocked), naming the module."""

    def __init__(self, modules: Sequence[str], ready_timeout_s: float, entry: str, *,
                 error: Type[Exception] = RuntimeError, owner: str = "zygote", what: str = "children") -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _CODE, str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()
        self.conn = mp_connection.Connection(ours.detach())
        self.ready_timeout_s, self.error, self.owner, self.what = ready_timeout_s, error, owner, what
        self._children: Dict[int, Forked] = {}
        self._forked: List[int] = []
        self._importing: Optional[str] = "its first modules"  # what the zygote imports now; None once it waits
        self.preparation = preparation("conveyor-zygote")
        self.conn.send((self.preparation, entry, list(modules)))

    def preload(self, modules: Sequence[str]) -> None:
        """Import ``modules`` too before the next fork."""
        with signals_held():
            self.conn.send(("preload", list(modules)))
        self._importing = self._importing or "the preloaded modules"

    def fork(self, name: str) -> Tuple[Forked, Any]:
        """A new child called ``name``, and the parent's connection to it (preparation data already sent)."""
        ours, theirs = socket.socketpair()
        try:
            with signals_held():
                self.conn.send(("fork",))
                mp_reduction.send_handle(self.conn, theirs.fileno(), self.proc.pid)
        finally:
            theirs.close()
        conn = mp_connection.Connection(ours.detach())
        try:
            self._await_fork()
        except BaseException:
            conn.close()
            raise
        pid = self._forked.pop()
        child = self._children[pid] = Forked(self, pid, name)
        conn.send(preparation(name))
        return child, conn

    def _await_fork(self) -> None:
        """Wait for the zygote's next fork: ``ready_timeout_s`` from the end of its imports (or from now), while
        the imports run as long as the zygote keeps using CPU and has used less than ``ready_timeout_s`` of it."""
        bound, pid = self.ready_timeout_s, self.proc.pid
        deadline = time.monotonic() + bound
        cpu_from = cpu_seen = _cpu_seconds(pid)
        moved_at = time.monotonic()
        while not self._forked:
            now = time.monotonic()
            if self._importing is None:
                if deadline <= now:
                    raise TimeoutError(f"{self.owner}: the zygote (pid {pid}) finished its imports but forked no "
                                       f"{self.what} within ready_timeout_s={bound}s (its stderr may say why)")
                self.pump(deadline - now)
                continue
            cpu = _cpu_seconds(pid)
            if cpu is not None and cpu_seen is not None and cpu > cpu_seen:
                cpu_seen, moved_at = cpu, now
            if cpu is not None and cpu_from is not None and cpu - cpu_from >= bound:
                raise TimeoutError(f"{self.owner}: the zygote (pid {pid}) used {cpu - cpu_from:.0f}s of CPU "
                                   f"importing {self._importing} (ready_timeout_s={bound}s): move the work out of that "
                                   f"module's top level, or raise ready_timeout_s")
            if now - moved_at >= bound:
                raise TimeoutError(f"{self.owner}: the zygote (pid {pid}) has used no CPU for {bound}s while importing "
                                   f"{self._importing}: its top level blocks (input, a lock, the network?); fix that")
            importing = self._importing
            self.pump(min(0.5, bound / 4))
            if self._importing != importing:  # a message is progress too (where /proc cannot be read)
                moved_at = deadline = time.monotonic()
                deadline += bound

    def pump(self, timeout: Optional[float]) -> None:
        """Take one message from the zygote if one comes within ``timeout`` (None: no limit)."""
        try:
            if not self.conn.poll(timeout):
                return
            with signals_held():
                message = self.conn.recv()
        except (EOFError, OSError):
            raise self.error(f"{self.owner}: the zygote (pid {self.proc.pid}) that forks the {self.what} is gone "
                             f"(exit code {self.proc.poll()}; its stderr has the details); its {self.what} stop when "
                             f"their connections close") from None
        if message[0] == "failed":
            raise self.error(message[1] if message[2] else f"{self.owner}: {message[1]}")
        if message[0] == "forked":
            self._forked.append(message[1])
        elif message[0] == "importing":
            self._importing = message[1]
        elif message[0] == "exit":
            self._children.pop(message[1]).returncode = message[2]

    def alive(self) -> bool:
        """Whether the zygote process still runs."""
        return self.proc.poll() is None

    def kill(self) -> None:
        """End a zygote that forked no child at once (SIGKILL; it may still be importing) and reap it."""
        self.conn.close()
        self.proc.kill()
        self.proc.wait()

    def close(self, grace_s: float) -> None:
        """Close the connection (the zygote then exits) and reap it; call once every child is reaped."""
        self.conn.close()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _cpu_seconds(pid: int) -> Optional[float]:
    """The CPU time (user + system) process ``pid`` has used, from /proc; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# --- inside the zygote ---------------------------------------------------------------------------------
def zygote_main() -> None:
    """Entry point of the zygote (``python -c``; argv[1] is the inherited descriptor of its connection)."""
    global _importing_main
    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)
    # Ctrl-C or a TERM to the whole group: the parent decides. SIGTERM is held, not ignored, so that a
    # child forked from here, which inherits this, gets a SIGTERM sent before its handler is in.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    # A child that dies in native code (SIGSEGV, SIGABRT...) prints the Python stack of each thread to the
    # stderr it shares with the parent before it goes: the launcher reports the signal, this says where.
    faulthandler.enable(all_threads=True)
    conn = mp_connection.Connection(fd)
    data, entry, modules = conn.recv()
    conn.send(("importing", data.get("init_main_from_path") or data.get("init_main_from_name") or "__main__"))
    _importing_main = True
    try:
        mp_spawn.prepare(data)
    except BaseException as exc:
        if not isinstance(exc, UnguardedStart):
            traceback.print_exc()
        conn.send(("failed", str(exc), True) if isinstance(exc, UnguardedStart) else
                  ("failed", f"the zygote could not import the main module of its parent ({type(exc).__name__}: "
                             f"{exc}); its traceback is above", False))
        with contextlib.suppress(OSError):
            while os.read(fd, 65536):  # until the parent closes: its requests never meet a closed socket
                pass
        os._exit(1)
    finally:
        _importing_main = False
    _preload(conn, [*modules, entry.partition(":")[0]])
    module, _, function = entry.partition(":")
    _fork_children(conn, getattr(importlib.import_module(module), function))
    os._exit(0)


def _preload(conn: Any, modules: Sequence[str]) -> None:
    """Import ``modules`` in the zygote, telling the parent which one it is at, then that it is done. Not
    ``torch._dynamo`` (1.5 s here), which torch imports when a process makes its first optimizer: children that
    only act never need it (docs/distributed.md)."""
    for name in modules:
        conn.send(("importing", name))
        try:
            importlib.import_module(name)
        except Exception:  # a child imports it again, and reports the error itself
            log.debug("zygote: preloading %s failed", name, exc_info=True)
    conn.send(("importing", None))


def _fork_children(conn: Any, entry: Callable[[Any], int]) -> None:
    """The zygote's loop: fork a child per request (its connection comes as a passed descriptor), signal one on
    request (it is unreaped then, so its pid is still its own), report each exit; when the parent's
    connection closes, reap the children left (they stop themselves when theirs closes) and return."""
    children: Dict[int, int] = {}  # pidfd -> pid
    parent = True
    while parent or children:
        for ready in mp_connection.wait([conn, *children] if parent else list(children)):
            if ready is not conn:
                pid = children.pop(ready)
                os.close(ready)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                try:
                    if parent:
                        conn.send(("exit", pid, code))
                except OSError:
                    parent = False
                continue
            try:
                message = conn.recv()
                if message[0] == "fork":
                    fd = mp_reduction.recv_handle(conn)
                    pid = os.fork()
                    if pid == 0:
                        for pidfd in children:
                            os.close(pidfd)
                        conn.close()
                        _forked_child(fd, entry)
                    os.close(fd)
                    children[os.pidfd_open(pid)] = pid
                    conn.send(("forked", pid))
                elif message[0] == "preload":
                    _preload(conn, message[1])
                elif message[0] == "signal" and message[1] in children.values():
                    os.kill(message[1], message[2])
            except (EOFError, OSError):
                parent = False


def _forked_child(fd: int, entry: Callable[[Any], int]) -> None:
    """A child just forked: SIGINT ignored, SIGTERM raises :class:`Terminated`; apply the preparation data, run
    ``entry(conn)``, then end as multiprocessing's forked children do (see the module docstring)."""
    code = 1
    try:
        os.set_inheritable(fd, False)  # the child's own children must not hold the parent's connection
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, raise_terminated)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # held since the fork (see zygote_main)
        conn = mp_connection.Connection(fd)
        mp_spawn.prepare(conn.recv())
        code = entry(conn)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, _exit_at_once)  # its result or error is sent: a stop interrupts nothing
        try:
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_at_once(signum: int, frame: Any) -> None:
    os._exit(128 + signum)
