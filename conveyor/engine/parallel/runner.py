"""``Parallel.runner``: the same ``main()`` on N worker processes joined by routers.

``Parallel.runner(n_parallel_workers, topology=..., protocol=...)(main, *args)`` starts one process per
worker, gives each a :class:`~conveyor.engine.parallel.router.Router` (its node id, its listen address,
the peers to dial), attaches it with ``task.attach_router`` (so ``task.emit`` / ``task.on`` cross
processes), waits until every worker has completed the ready handshake with its peers, then calls
``main(*args)`` in all of them at once. It returns the list of ``main``'s return values, by worker.

Topologies: ``"star"``, node 0 is the hub every other worker dials (a worker's events reach the hub, the
hub's reach everyone); ``"mesh"``, every worker dials every other; ``"alone"``, no router at all
(``task.router.is_active`` is False). One worker with ``"alone"`` runs ``main`` in this process.

How a worker starts: each launch first starts a zygote, ``python -c`` running :func:`_zygote_main`,
which gets multiprocessing's preparation data (``sys.path``, the working directory, the main module, as
its ``spawn`` start method sends them; the main module is imported there) and imports the modules that
``main`` and its args are pickled from (torch and conveyor with them, once, not once per worker; no
torch op runs and no Python thread starts there). It then forks every worker of the launch, restarts
included. Each worker has one end of its own socket pair with the launcher (passed through the
zygote's connection as a descriptor, SCM_RIGHTS), and everything private travels over that pair,
never in the environment or on the command line: the preparation data again, then ``main`` and its
args (pickled by reference, so ``main`` must be a module-level function), then the shared secret.
The zygote reaps the workers and reports their exit codes, and signals one for the launcher only while
it is unreaped (so never a reused pid); it ignores SIGINT and holds SIGTERM blocked (the launcher decides;
a worker forked from it unblocks SIGTERM once its handler is in, so one sent at its birth is delivered then,
not lost) and leaves once the launcher closes its connection and its workers are gone. A script that
calls the runner without an ``if __name__ == "__main__":`` guard would call it again in the zygote, which
imports it: that is refused at once, with the fix, as :mod:`multiprocessing` does. A worker ends as
multiprocessing's forked children do: non-daemon threads joined, ``atexit`` handlers run, streams
flushed, then ``os._exit`` (no second teardown of the interpreter).
No multiprocessing helper process (resource tracker) is started, so stopping the workers leaves nothing.

The secret: ``secret=`` (bytes), else ``$CONVEYOR_SECRET``, else one generated for this launch; a
generated secret is known to this launch only, so the workers then stay on this host (ipc, or tcp on
a loopback address), as a :class:`Router` without a secret does.

The launcher then supervises. Faults, two kinds:

- An uncaught exception in a worker (a bug, or a clear error: restarting would repeat it) is sent back
  with its traceback; the launcher stops the other workers (SIGTERM, then SIGKILL after ``grace_s``)
  and re-raises it, rebuilt (or as :class:`WorkerError` when it cannot be unpickled), with the worker's
  traceback text as its ``__cause__`` (a :class:`RemoteTraceback`) and a note naming the worker.
- A worker that dies while running without an exception (killed by a signal, SIGKILL or the OOM
  killer, ``os._exit``, a crash in native code): with ``auto_recover=True`` the launcher starts it
  again, up to ``max_retries`` times per worker (None: :data:`DEFAULT_MAX_RETRIES`), with the same node id,
  address and arguments (``task.router.restarts`` counts them; its router has a new incarnation): it
  dials the workers running now, handshakes and runs ``main`` from the start, joining the run late
  (a ``ModelExchanger`` asks for the newest weights). Otherwise, or once its restarts are spent or
  another worker has already returned, the job goes on without it (a warning; its peers lose it at
  once and the exchangers carry on, see :mod:`conveyor.middleware.exchanger`) and, once the others
  have ended, the runner raises :class:`WorkerError` naming it, with the others' results in ``.results``.
  A death during the start (before ``main``) always stops the job.

SIGTERM to the launcher (from its main thread) or Ctrl-C stops every worker with SIGTERM (each ends its
run gracefully, see below; SIGKILL after ``grace_s``), removes the ipc files, and ends the launcher with
``SystemExit(143)`` or ``KeyboardInterrupt``. A worker whose launcher disappears stops itself. The ipc
files of a launch go in ``$TMPDIR/conveyor-run-<launcher pid>-*``; a launch removes such directories
of this user whose launcher is gone (one killed by SIGKILL cannot remove its own).

:func:`zygote_ahead` starts the zygote of the next launch early, so that its imports overlap what the
launching process still does (``conveyor train --collectors`` reads the entry's config, importing torch).

Inside a worker, SIGINT is ignored (Ctrl-C reaches the whole process group; the launcher decides). The
first SIGTERM while ``main`` is inside ``task.run`` stops the run gracefully: ``task.finish`` is set and
:data:`~conveyor.engine.task.STOP_EVENT` emitted (the exchangers stop waiting), the run ends normally after
the current iteration (a ``CkptSaver`` writes its final checkpoint) and ``main`` goes on. Outside
``task.run``, or a second SIGTERM, raises ``SystemExit(143)``, so ``finally`` blocks and ``with
task.start()`` exits run.
When its ``main`` returns, a worker tells its peers and waits until each has finished too or is gone,
before closing its router: no message it sent is cut off by closing early. Once its result or error is
sent, a SIGTERM ends the worker at once (no traceback from an exit handler it interrupts).
"""
from __future__ import annotations

import difflib
import logging
import atexit
import contextlib
import importlib
import os
import pickle
import pickletools
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import connection as mp_connection
from multiprocessing import reduction as mp_reduction
from multiprocessing import spawn as mp_spawn
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union

import conveyor
from conveyor.engine.compose import note
from conveyor.engine.parallel.frame import SECRET_ENV, generate_secret, load_secret

__all__ = ["Parallel", "RemoteTraceback", "WorkerError", "WorkerRouter", "zygote_ahead"]

log = logging.getLogger(__name__)

TOPOLOGIES = ("star", "mesh", "alone")
PROTOCOLS = ("ipc", "tcp")
FINISHED_TOPIC = "conveyor.runner.finished"
"""Published by a worker whose ``main`` has returned; its peers close only after hearing it (or losing it)."""

DEFAULT_MAX_RETRIES = 3
"""Restarts per worker under ``auto_recover=True`` when ``max_retries`` is None."""

_ZYGOTE_CODE = "from conveyor.engine.parallel.runner import _zygote_main; _zygote_main()"
_RUN_DIR_PREFIX = "conveyor-run-"
"""``$TMPDIR/conveyor-run-<launcher pid>-<random>``: the ipc files of a launch that was given no ``address``."""
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(conveyor.__file__)))


class WorkerError(RuntimeError):
    """A worker ended without an exception that can be re-raised here: killed by a signal, ``os._exit``,
    or an exception that does not unpickle in the launcher (its type and message are in this one's).

    Raised for a worker that died while running (and was not restarted) once the others are done;
    ``results`` then holds their return values by worker (None for the dead ones)."""

    def __init__(self, message: str, results: Optional[List[Any]] = None) -> None:
        super().__init__(message)
        self.results = results


class RemoteTraceback(Exception):
    """The traceback text of a worker's exception, set as the ``__cause__`` of the one the runner raises."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.tb.rstrip()}\n\"\"\""


class _UnguardedLaunch(RuntimeError):
    """The runner was called while the zygote imports the launcher's main module: a script with no main guard."""


_importing_main = False
"""True in the zygote while it imports the launcher's main module (a call of the runner then is refused)."""


class _Terminated(SystemExit):
    """Raised by the SIGTERM handler of a worker or of the launcher: unwinds ``finally`` blocks, exits 143."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(128 + signum)


class WorkerRouter:
    """``task.router`` inside a worker: every method of the node's :class:`Router`, plus ``node_id`` (the
    worker's int id), ``n_workers``, ``labels``, ``is_active`` and ``restarts`` (how many times the launcher
    restarted this worker: 0 in the first process). Under topology ``"alone"`` there is no router:
    ``is_active`` is False, :meth:`publish` reaches nobody and :meth:`on` / :meth:`off` do nothing."""

    def __init__(self, router: Any, node_id: int, n_workers: int, labels: Iterable[str] = (), restarts: int = 0) -> None:
        self._router = router
        self.node_id, self.n_workers, self.labels, self.restarts = node_id, n_workers, frozenset(labels), restarts
        self._neighbours: List[str] = []
        self._finished: set = set()
        self._finished_changed = threading.Condition()
        self._left_callbacks: List[Callable[[str], Any]] = []
        if router is not None:  # before any dial, so the first hello already lists the topic
            router.on(FINISHED_TOPIC, self._peer_finished)
            router.on_peer_lost(self._peer_left)

    @property
    def is_active(self) -> bool:
        """Whether this worker has a router that is open."""
        return self._router is not None and not self._router.closed

    def publish(self, topic: str, payload: Any) -> int:
        return 0 if self._router is None else self._router.publish(topic, payload)

    def on(self, topic: str, fn: Callable[[Any], Any]) -> None:
        if self._router is not None:
            self._router.on(topic, fn)

    def off(self, topic: str, fn: Callable[[Any], Any]) -> None:
        if self._router is not None:
            self._router.off(topic, fn)

    def on_peer_lost(self, fn: Callable[[str], Any]) -> None:
        """Call ``fn(node_id)`` when a peer leaves the run: its ``main`` returned, or its router lost it
        (closed, died, disconnected). A peer that finishes and then closes is reported twice."""
        if not callable(fn):
            raise TypeError(f"task.router.on_peer_lost(fn): fn must be callable, got {fn!r}")
        self._left_callbacks.append(fn)

    def off_peer_lost(self, fn: Callable[[str], Any]) -> None:
        """Remove a callback given to :meth:`on_peer_lost`."""
        if fn in self._left_callbacks:
            self._left_callbacks.remove(fn)

    def __getattr__(self, name: str) -> Any:
        router = self.__dict__.get("_router")
        if name.startswith("_") or router is None:
            raise AttributeError(f"task.router has no attribute {name!r}"
                                 + (" (topology 'alone': this worker has no router)" if router is None else ""))
        return getattr(router, name)

    def __repr__(self) -> str:
        return f"<WorkerRouter node {self.node_id} of {self.n_workers}: {self._router!r}>"

    def _peer_finished(self, node: Any) -> None:
        with self._finished_changed:
            self._finished.add(str(node))
        self._peer_left(node)

    def _peer_left(self, node: Any) -> None:
        with self._finished_changed:
            self._finished_changed.notify_all()
        for fn in list(self._left_callbacks):
            try:
                fn(str(node))
            except Exception:
                log.exception("worker %s: an on_peer_lost callback raised", self.node_id)

    def _finish(self) -> None:
        """Tell the peers this worker's main returned; wait until each of them has said so or is gone (one lost
        and restarted by ``auto_recover`` is live again: it is waited for)."""
        if self._router is None:
            return
        self._router.publish(FINISHED_TOPIC, self._router.node_id)
        with self._finished_changed:
            self._finished_changed.wait_for(lambda: all(
                node in self._finished or node not in self._router.peers() for node in self._neighbours))

    def close(self) -> None:
        if self._router is not None:
            self._router.close()


class Parallel:
    """Runs one ``main()`` on several processes: see :meth:`runner` and the module docstring."""

    @staticmethod
    def runner(n_parallel_workers: int, topology: str = "star", protocol: str = "ipc", address: Optional[str] = None,
               ports: Union[int, Sequence[int], None] = None, attach_to: Optional[Sequence[str]] = None,
               node_ids: Union[int, Sequence[int], None] = None, labels: Optional[Iterable[str]] = None,
               auto_recover: bool = False, max_retries: Optional[int] = None, secret: Optional[bytes] = None, *,
               ready_timeout_s: float = 60.0, grace_s: float = 5.0,
               router_options: Optional[Dict[str, Any]] = None) -> Callable[..., List[Any]]:
        """A launcher: ``Parallel.runner(...)(main, *args)`` runs ``main(*args)`` in every worker and returns
        their return values (by worker; None where one does not pickle).

        ``address``: for tcp the host to listen on (default 127.0.0.1); for ipc the directory of the
        socket files (default: a private temporary one, removed at the end). ``ports``: tcp only, the
        first port (worker i listens on ``ports + i``) or one per worker (default: ports the OS picks,
        told to the peers by the launcher). ``attach_to``: addresses of routers outside this launch that
        every worker dials and waits for. ``node_ids``: the first id or one per worker (default 0..n-1).
        ``labels``: labels of every worker (``task.router.labels``). ``auto_recover``: restart a worker that
        dies (not one that raises) up to ``max_retries`` times (see the module docstring). ``ready_timeout_s``
        bounds the start and the handshake (also a restart's); ``grace_s`` the wait between SIGTERM and
        SIGKILL when stopping workers: time enough for a learner to end its iteration and checkpoint.
        ``router_options``: keyword arguments for every :class:`Router` (timeouts, ``max_message_size``).
        """
        plan = _Plan(n_parallel_workers, topology, protocol, address, ports, attach_to, node_ids, labels,
                     auto_recover, max_retries, secret, ready_timeout_s, grace_s, router_options)
        return lambda main, *args: _launch(plan, main, args)


def _closest(value: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(value), choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


class _Plan:
    """The runner's arguments, checked at once."""

    def __init__(self, n: Any, topology: Any, protocol: Any, address: Optional[str], ports: Any, attach_to: Any,
                 node_ids: Any, labels: Any, auto_recover: bool, max_retries: Optional[int], secret: Any,
                 ready_timeout_s: float, grace_s: float, router_options: Optional[Dict[str, Any]]) -> None:
        where = "Parallel.runner"
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{where}(n_parallel_workers={n!r}): must be an int >= 1")
        if topology not in TOPOLOGIES:
            raise ValueError(f"{where}(topology={topology!r}): must be one of {TOPOLOGIES}{_closest(topology, TOPOLOGIES)}")
        if protocol not in PROTOCOLS:
            raise ValueError(f"{where}(protocol={protocol!r}): must be one of {PROTOCOLS}{_closest(protocol, PROTOCOLS)}")
        if not isinstance(auto_recover, bool):
            raise TypeError(f"{where}(auto_recover={auto_recover!r}): must be True or False")
        if max_retries is not None:
            if not auto_recover:
                raise ValueError(f"{where}(max_retries={max_retries!r}): restarts need auto_recover=True")
            if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
                raise ValueError(f"{where}(max_retries={max_retries!r}): must be an int >= 0, or None for "
                                 f"{DEFAULT_MAX_RETRIES}")
        if secret is not None and not isinstance(secret, bytes):
            raise TypeError(f"{where}(secret=...): must be bytes, got {type(secret).__name__}")
        for name, value in (("ready_timeout_s", ready_timeout_s), ("grace_s", grace_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{where}({name}={value!r}): must be a number of seconds > 0")
        if node_ids is None or isinstance(node_ids, int):
            node_ids = list(range(node_ids or 0, (node_ids or 0) + n))
        node_ids = list(node_ids)
        if len(node_ids) != n or len(set(node_ids)) != n or not all(isinstance(i, int) for i in node_ids):
            raise ValueError(f"{where}(node_ids={node_ids!r}): needs {n} distinct ints (or the first one)")
        if ports is not None:
            if protocol != "tcp":
                raise ValueError(f"{where}(ports={ports!r}): ports are for protocol='tcp'; ipc uses files in `address`")
            ports = list(range(ports, ports + n)) if isinstance(ports, int) else list(ports)
            if len(ports) != n:
                raise ValueError(f"{where}(ports={ports!r}): needs the first port or one port per worker ({n})")
        if isinstance(attach_to, str):
            attach_to = [a for a in attach_to.split(",") if a]
        self.n, self.topology, self.protocol, self.address, self.ports = n, topology, protocol, address, ports
        self.attach_to, self.node_ids = list(attach_to or ()), node_ids
        self.labels = frozenset([labels] if isinstance(labels, str) else labels or ())
        self.secret, self.ready_timeout_s, self.grace_s = secret, ready_timeout_s, grace_s
        self.router_options = dict(router_options or {})
        self.auto_recover = auto_recover
        self.max_retries = (DEFAULT_MAX_RETRIES if max_retries is None else max_retries) if auto_recover else 0


# --- the launcher --------------------------------------------------------------------------------------
def _launch(plan: _Plan, main: Callable[..., Any], args: tuple) -> List[Any]:
    if _importing_main:
        script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main module"
        raise _UnguardedLaunch(f"Parallel.runner: {script} calls the runner again in the zygote that imports it to "
                               f"find main: put the call under `if __name__ == \"__main__\":`, as multiprocessing asks")
    if not callable(main):
        raise TypeError(f"Parallel.runner(...)(main): main must be callable, got {main!r}")
    if plan.n == 1 and plan.topology == "alone":
        return [_run_here(plan, main, args)]
    try:
        program = pickle.dumps((main, args))
    except Exception as e:
        raise TypeError(f"Parallel.runner(...)({getattr(main, '__qualname__', main)!r}, ...): main and its args must "
                        f"pickle to reach the workers (main a module-level function): {e}") from None
    secret, generated = plan.secret, False
    if secret is None:
        secret = load_secret(generate=False) if SECRET_ENV in os.environ else None
        secret, generated = (generate_secret(), True) if secret is None else (secret, False)
    own_dir = plan.protocol == "ipc" and plan.address is None
    if own_dir:
        _remove_stale_run_dirs()
    ipc_dir = tempfile.mkdtemp(prefix=f"{_RUN_DIR_PREFIX}{os.getpid()}-") if own_dir else plan.address
    listens = [_listen_address(plan, i, node_id, ipc_dir) for i, node_id in enumerate(plan.node_ids)]
    workers: List[_Worker] = []
    zygote: Optional[_Zygote] = None
    try:
        if generated and plan.topology != "alone":
            _check_local(listens + plan.attach_to)
        with _terminate_on_sigterm():
            zygote = _take_spare(_modules(program), plan.ready_timeout_s) or _Zygote(_modules(program),
                                                                                    plan.ready_timeout_s)
            for i, node_id in enumerate(plan.node_ids):
                spec = {"node_id": node_id, "n_workers": plan.n, "topology": plan.topology, "listen": listens[i],
                        "secret": secret, "labels": plan.labels, "ready_timeout_s": plan.ready_timeout_s,
                        "router_options": plan.router_options, "restarts": 0}
                workers.append(_Worker.start(spec, program, zygote))
            return _supervise(plan, workers, program, zygote)
    finally:
        with _signals_ignored():
            _stop(workers, plan.grace_s)
            if zygote is not None:
                zygote.close(plan.grace_s)
            if own_dir:
                shutil.rmtree(ipc_dir, ignore_errors=True)
            elif plan.protocol == "ipc":
                for url in listens:
                    _unlink(url[len("ipc://"):])


_spare: Optional["_Zygote"] = None
"""A zygote started ahead of the next launch (:func:`zygote_ahead`)."""


@contextlib.contextmanager
def zygote_ahead(modules: Sequence[str] = ()) -> Iterator[None]:
    """Start the zygote of the next launch inside this block now, importing ``modules``, so that its imports run
    while this process prepares the launch (the CLI imports torch to read an entry's config). The first
    launch inside takes it if this process's preparation data (working directory, ``sys.path``, main
    module) are still those it started with, and starts its own otherwise; one that no launch took is
    closed on the way out."""
    global _spare
    if _spare is not None:
        raise RuntimeError("zygote_ahead: a zygote started ahead is already waiting for a launch")
    _spare = _Zygote(modules, 60.0)
    try:
        yield
    finally:
        spare, _spare = _spare, None
        if spare is not None:
            spare.kill()


def _take_spare(modules: Sequence[str], ready_timeout_s: float) -> Optional["_Zygote"]:
    """The zygote started ahead, told to import ``modules`` too; None if there is none or it no longer fits."""
    global _spare
    spare, _spare = _spare, None
    if spare is None:
        return None
    if spare.proc.poll() is not None or spare.preparation != _preparation("conveyor-zygote"):
        spare.kill()
        return None
    spare.ready_timeout_s = ready_timeout_s
    with _whole_messages():
        spare.conn.send(("preload", list(modules)))
    return spare


def _preparation(name: str) -> Dict[str, Any]:
    """multiprocessing's preparation data for a process called ``name``, without its own key (no process
    needs it, and it must not travel)."""
    preparation = mp_spawn.get_preparation_data(name)
    preparation.pop("authkey", None)
    return preparation


def _modules(program: bytes) -> List[str]:
    """What the zygote preloads: the modules the pickled ``(main, args)`` names (main's own, its args' classes),
    after those every worker imports."""
    strings = (arg.split(" ")[0] if op.name == "GLOBAL" else arg for op, arg, _ in pickletools.genops(program)
               if isinstance(arg, str))
    named = [name for name in strings if name in sys.modules and name != "__main__"]  # prepare() loads __main__
    return list(dict.fromkeys(["conveyor.engine.task", "conveyor.engine.parallel.router", *named]))


def _run_here(plan: _Plan, main: Callable[..., Any], args: tuple) -> Any:
    from conveyor.engine.task import task
    node = WorkerRouter(None, plan.node_ids[0], 1, plan.labels)
    task.attach_router(node)
    try:
        return main(*args)
    finally:
        if task.router is node:
            task.detach_router()


def _listen_address(plan: _Plan, i: int, node_id: int, ipc_dir: Optional[str]) -> Optional[str]:
    if plan.topology == "alone":
        return None
    if plan.protocol == "ipc":
        return f"ipc://{os.path.join(ipc_dir, f'node{node_id}.ipc')}"
    host = plan.address or "127.0.0.1"
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{plan.ports[i] if plan.ports else 0}"


def _check_local(urls: Iterable[str]) -> None:
    from conveyor.engine.parallel.router import is_local_address
    for url in urls:
        if not is_local_address(url):
            raise ValueError(f"Parallel.runner: refusing {url} with a secret generated for this launch: nodes on other "
                             f"hosts cannot know it. Give every node the same secret (secret=, --secret-file FILE or "
                             f"${SECRET_ENV}), or use protocol='ipc' or address='127.0.0.1'")


def _remove_stale_run_dirs() -> None:
    """Remove this user's ``conveyor-run-<pid>-*`` directories whose launcher (``pid``) is gone: one that was
    killed (SIGKILL) could not remove its own."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid, dash, _ = entry.name[len(_RUN_DIR_PREFIX):].partition("-")  # no dash: an older name, no pid in it
            if entry.name.startswith(_RUN_DIR_PREFIX) and dash and pid.isdigit() and not _alive(int(pid)) \
                    and entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@contextlib.contextmanager
def _whole_messages() -> Iterator[None]:
    """Hold SIGINT and SIGTERM (their handlers raise) while a message to or from the zygote is half sent or
    read, so the connection never loses its framing; they are delivered right after."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _Forked:
    """The launcher's handle on a worker the zygote forked, with what ``_Worker`` uses of ``subprocess.Popen``:
    ``pid``, ``returncode`` (negative: killed by that signal), ``poll``, ``wait``, ``terminate``, ``kill``."""

    def __init__(self, zygote: "_Zygote", pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        self.zygote.pump(0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            self.zygote.pump(left)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # the zygote signals it only while it has not reaped it: no pid reuse
            with _whole_messages():
                self.zygote.conn.send(("signal", self.pid, int(signum)))

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """The launch's preloading process: a ``python -c`` running :func:`_zygote_main` that applies the launcher's
    multiprocessing preparation data, imports the modules the workers will import (runs no torch op, starts
    no thread), then forks every worker of the launch, restarts included, and reports their exit codes."""

    def __init__(self, modules: Sequence[str], ready_timeout_s: float) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE_CODE, str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()
        self.conn = mp_connection.Connection(ours.detach())
        self.ready_timeout_s = ready_timeout_s
        self._children: Dict[int, _Forked] = {}
        self._forked: List[int] = []
        self.preparation = _preparation("conveyor-zygote")
        self.conn.send((self.preparation, list(modules)))

    def fork(self, theirs: socket.socket) -> _Forked:
        """A new worker holding ``theirs`` (its end of the launcher's socket pair) as its connection."""
        with _whole_messages():
            self.conn.send(("fork",))
            mp_reduction.send_handle(self.conn, theirs.fileno(), self.proc.pid)
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._forked:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"Parallel.runner: the zygote (pid {self.proc.pid}) forked no worker within "
                                   f"ready_timeout_s={self.ready_timeout_s}s; raise it, or check that nothing blocks "
                                   f"the imports of main's module")
            self.pump(left)
        pid = self._forked.pop()
        child = self._children[pid] = _Forked(self, pid)
        return child

    def pump(self, timeout: Optional[float]) -> None:
        """Take one message from the zygote if one comes within ``timeout`` (None: no limit)."""
        try:
            if not self.conn.poll(timeout):
                return
            with _whole_messages():
                message = self.conn.recv()
        except (EOFError, OSError):
            raise WorkerError(f"Parallel.runner: the zygote (pid {self.proc.pid}) that forks the workers is gone "
                              f"(exit code {self.proc.poll()}; its stderr has the details); its workers stop when "
                              f"the launcher closes their connections") from None
        if message[0] == "failed":
            raise WorkerError(message[1])
        if message[0] == "forked":
            self._forked.append(message[1])
        elif message[0] == "exit":
            self._children.pop(message[1]).returncode = message[2]

    def kill(self) -> None:
        """End a zygote that forked no worker at once (SIGKILL; it may still be importing) and reap it."""
        self.conn.close()
        self.proc.kill()
        self.proc.wait()

    def close(self, grace_s: float) -> None:
        """Close the connection (the zygote then exits) and reap it; call once every worker is reaped."""
        self.conn.close()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Worker:
    """The launcher's handle on one worker process and what it has reported."""

    def __init__(self, spec: Dict[str, Any], proc: _Forked, conn: Any, ready_timeout_s: float) -> None:
        self.spec, self.node_id, self.proc, self.conn = spec, spec["node_id"], proc, conn
        self.restarts: int = spec["restarts"]
        self.address: Any = _Worker  # not reported yet
        self.ready = self.finished = self.ended = False
        self.deadline = time.monotonic() + ready_timeout_s  # to be ready by
        self.result: Any = None

    @classmethod
    def start(cls, spec: Dict[str, Any], program: bytes, zygote: _Zygote) -> "_Worker":
        ours, theirs = socket.socketpair()
        try:
            proc = zygote.fork(theirs)
        finally:
            theirs.close()
        worker = cls(spec, proc, mp_connection.Connection(ours.detach()), zygote.ready_timeout_s)
        worker.conn.send(_preparation(f"conveyor-worker-{spec['node_id']}"))
        worker.conn.send((spec, program))
        return worker

    def __repr__(self) -> str:
        return f"worker {self.node_id} (pid {self.proc.pid})"


def _supervise(plan: _Plan, workers: List[_Worker], program: bytes, zygote: _Zygote) -> List[Any]:
    """Start the workers together (addresses, dial plans, ready, go), then serve them until all have ended:
    re-raise an exception, restart or note a worker that died; restarted ones join on their own."""
    planned = started = False  # every first worker has been told whom to dial / to go
    dead: List[str] = []
    while True:
        by_conn = {w.conn: w for w in workers if not w.ended}
        if not by_conn:
            break
        waiting = [w for w in workers if not w.ended and not w.ready]
        timeout = max(0.0, min(w.deadline for w in waiting) - time.monotonic()) if waiting else None
        answered = mp_connection.wait(list(by_conn), timeout)
        late = [w.node_id for w in waiting if w.deadline <= time.monotonic()]
        if not answered and late:
            raise TimeoutError(f"Parallel.runner: workers {late} not ready after ready_timeout_s="
                               f"{plan.ready_timeout_s}s; raise it, or check that nothing blocks their start "
                               f"(imports at module level) or their addresses")
        for conn in answered:
            worker = by_conn[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                worker.ended = True
                conn.close()
                why = _ended(plan, worker, started)
                if why is not None and not _restart(plan, workers, worker, why, program, zygote):
                    dead.append(why)
                continue
            kind = message[0]
            if kind == "error":
                raise _rebuild(worker, *message[1:])
            if kind == "address":
                worker.address = message[1]
                if started:  # a restarted worker joins those running now
                    worker.conn.send(_dial_plan(plan, workers.index(worker), workers))
            elif kind == "ready":
                worker.ready = True
                if started:
                    worker.conn.send(("go",))
            elif kind == "result":
                worker.result, worker.finished = message[1], True
                for other in workers:  # a restarted worker still joining would wait for peers that are ending
                    if other.restarts and not other.ready and not other.ended:
                        log.warning("Parallel.runner: %s returned while %s was still joining; the job is ending, "
                                    "so it is killed (it has not started main)", worker, other)
                        other.proc.kill()
        if not planned and all(w.address is not _Worker for w in workers):
            for i, worker in enumerate(workers):
                worker.conn.send(_dial_plan(plan, i, workers))
            planned = True
        if not started and all(w.ready for w in workers):
            for worker in workers:
                worker.conn.send(("go",))
            started = True
    results = [_loads_or_none(w.result) for w in workers]
    if dead:
        raise WorkerError(f"Parallel.runner: {'; '.join(dead)}; the other workers went on and ended (their results "
                          f"are in this error's .results)", results)
    return results


def _dial_plan(plan: _Plan, i: int, workers: List[_Worker]) -> tuple:
    """("peers", addresses worker i dials, how many peers it waits for): its neighbours that are running (at
    the first start, all of them), and the routers of ``attach_to``."""
    if plan.topology == "alone":
        return "peers", [], 0
    me, addresses = workers[i], [w.address for w in workers]
    first = not me.restarts
    running = [first or (w.ready and not w.ended) for w in workers]
    if plan.topology == "star":
        local = [j for j in range(1, len(workers))] if i == 0 else [0]
        dial = [] if i == 0 else addresses[:1]  # the hub dials no one: the leaves' hellos make it dial back
    else:
        local = [j for j in range(len(workers)) if j != i]
        dial = [addresses[j] for j in local]
    return "peers", dial + plan.attach_to, sum(running[j] for j in local) + len(plan.attach_to)


def _ended(plan: _Plan, worker: _Worker, started: bool) -> Optional[str]:
    """Its connection closed: it has exited (or is exiting). None if it ended well, else why not; raises
    during the start."""
    try:
        code = worker.proc.wait(timeout=plan.grace_s)
    except subprocess.TimeoutExpired:
        raise WorkerError(f"Parallel.runner: {worker} closed its connection but did not exit within "
                          f"grace_s={plan.grace_s}s") from None
    if code < 0:
        why = f"{worker} was killed by {_signal_name(-code)}"
    elif code != 0:
        why = f"{worker} exited with code {code} without reporting an exception (its stderr has the details)"
    elif not worker.finished:
        why = f"{worker} exited without reporting a result"
    else:
        return None
    if not started:
        raise WorkerError(f"Parallel.runner: {why}, during the start, before main ran")
    return why


def _restart(plan: _Plan, workers: List[_Worker], worker: _Worker, why: str, program: bytes, zygote: _Zygote) -> bool:
    """Start ``worker`` again (same node id and address, a new incarnation) if ``auto_recover`` allows it."""
    if worker.restarts >= plan.max_retries or any(w.finished for w in workers):
        reason = ("auto_recover is off" if not plan.auto_recover else "the job is ending"
                  if worker.restarts < plan.max_retries else f"max_retries={plan.max_retries} spent")
        log.warning("Parallel.runner: %s; the job goes on without it (%s)", why, reason)
        return False
    log.warning("Parallel.runner: %s; restarting it (restart %d of %d)", why, worker.restarts + 1, plan.max_retries)
    new = _Worker.start({**worker.spec, "restarts": worker.restarts + 1}, program, zygote)
    workers[workers.index(worker)] = new
    return True


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _rebuild(worker: _Worker, blob: Optional[bytes], type_name: str, text: str, tb: str) -> BaseException:
    """The worker's exception, with its traceback as the cause and a note naming the worker."""
    exc = _loads_or_none(blob)
    if not isinstance(exc, BaseException):
        exc = WorkerError(f"{type_name}: {text}")
    exc.__cause__ = RemoteTraceback(tb)
    note(exc, f"raised in parallel {worker}; its traceback is the cause above")
    return exc


def _loads_or_none(blob: Optional[bytes]) -> Any:
    try:
        return None if blob is None else pickle.loads(blob)
    except Exception:
        log.warning("Parallel.runner: a value sent by a worker does not unpickle here", exc_info=True)
        return None


def _dumps_or_none(value: Any) -> Optional[bytes]:
    try:
        return pickle.dumps(value)
    except Exception:
        log.warning("Parallel.runner: %r does not pickle; the launcher gets None for it", type(value).__name__)
        return None


def _stop(workers: List[_Worker], grace_s: float) -> None:
    """SIGTERM every worker still running, SIGKILL those still there after ``grace_s``; reap them all."""
    try:
        for worker in workers:
            if worker.proc.poll() is None:
                worker.proc.terminate()
        deadline = time.monotonic() + grace_s
        for worker in workers:
            try:
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("Parallel.runner: %s did not stop within %ss of SIGTERM; killing it", worker, grace_s)
                worker.proc.kill()
                worker.proc.wait()
    except WorkerError as e:  # the zygote is gone: closing their connections below stops the workers
        log.warning("%s", e)
    for worker in workers:
        worker.conn.close()


class _terminate_on_sigterm:
    """SIGTERM raises ``_Terminated`` (``SystemExit(143)``) while the launcher supervises (main thread only)."""

    def __enter__(self) -> None:
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, _raise_terminated)

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


class _signals_ignored:
    """SIGINT and SIGTERM wait while the workers are being stopped, so a second Ctrl-C cannot orphan them."""

    def __enter__(self) -> None:
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


# --- the worker ----------------------------------------------------------------------------------------
def _zygote_main() -> None:
    """Entry point of the zygote (``python -c``; argv[1] is the inherited descriptor of its connection)."""
    global _importing_main
    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)
    # Ctrl-C or a TERM to the whole group: the launcher decides. SIGTERM is held, not ignored, so that a
    # worker forked from here, which inherits this, gets a SIGTERM sent before its handler is in.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    conn = mp_connection.Connection(fd)
    preparation, modules = conn.recv()
    _importing_main = True
    try:
        mp_spawn.prepare(preparation)
    except BaseException as exc:
        if not isinstance(exc, _UnguardedLaunch):
            traceback.print_exc()
        conn.send(("failed", str(exc) if isinstance(exc, _UnguardedLaunch) else
                   f"Parallel.runner: the zygote could not import the main module of the launcher "
                   f"({type(exc).__name__}: {exc}); its traceback is above"))
        with contextlib.suppress(OSError):
            while os.read(fd, 65536):  # until the launcher closes: its requests never meet a closed socket
                pass
        os._exit(1)
    finally:
        _importing_main = False
    _preload(modules)
    _fork_workers(conn)
    os._exit(0)


def _preload(modules: Sequence[str]) -> None:
    """Import ``modules`` in the zygote. Not ``torch._dynamo`` (1.5 s here), which torch imports when a process
    makes its first optimizer: workers that only act never need it, and a learner imports it while they
    start (docs/distributed.md)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # a worker imports it again, and sends the error to the launcher
            log.debug("zygote: preloading %s failed", name, exc_info=True)


def _fork_workers(conn: Any) -> None:
    """The zygote's loop: fork a worker per request (its connection comes as a passed descriptor), signal one
    on request (it is unreaped then, so its pid is still its own), report each exit; when the launcher's
    connection closes, reap the workers left (they stop themselves when theirs closes) and return."""
    children: Dict[int, int] = {}  # pidfd -> pid
    launcher = True
    while launcher or children:
        for ready in mp_connection.wait([conn, *children] if launcher else list(children)):
            if ready is not conn:
                pid = children.pop(ready)
                os.close(ready)
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                try:
                    if launcher:
                        conn.send(("exit", pid, code))
                except OSError:
                    launcher = False
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
                        _forked_worker(fd)
                    os.close(fd)
                    children[os.pidfd_open(pid)] = pid
                    conn.send(("forked", pid))
                elif message[0] == "preload":  # the modules of a launch that took a zygote started ahead
                    _preload(message[1])
                elif message[0] == "signal" and message[1] in children.values():
                    os.kill(message[1], message[2])
            except (EOFError, OSError):
                launcher = False


def _forked_worker(fd: int) -> None:
    """A worker just forked by the zygote: serve the launcher on ``fd``, then end as multiprocessing's forked
    children do: non-daemon threads joined, exit handlers run, streams flushed, ``os._exit`` (tearing down
    an interpreter that imported torch took about 1 s of CPU per worker)."""
    code = 1
    try:
        code = _worker(fd)
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


def _worker(fd: int) -> int:
    """A worker's life on its connection ``fd`` to the launcher; its exit code."""
    os.set_inheritable(fd, False)  # the worker's own children must not hold the launcher's connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # held since the fork (see _zygote_main)
    conn = mp_connection.Connection(fd)
    try:
        mp_spawn.prepare(conn.recv())
        spec, program = conn.recv()
    except _Terminated:
        return 128 + signal.SIGTERM
    return _run_worker(spec, program, conn)


def _run_worker(spec: Dict[str, Any], program: bytes, conn: Any) -> int:
    from conveyor.engine.task import task
    node: Optional[WorkerRouter] = None
    try:
        main, args = pickle.loads(program)
        node = _join(spec, conn)
        task.attach_router(node)
        conn.send(("ready",))
        if conn.recv() != ("go",):
            raise RuntimeError("the launcher sent something other than 'go'")
        threading.Thread(target=_stop_when_orphaned, args=(conn,), name="conveyor-launcher-watch", daemon=True).start()
        signal.signal(signal.SIGTERM, _GracefulStop().handle)
        result = main(*args)
        node._finish()
        conn.send(("result", _dumps_or_none(result)))
        return 0
    except _Terminated:
        return 128 + signal.SIGTERM
    except BaseException as exc:
        try:
            conn.send(("error", _dumps_or_none(exc), type(exc).__qualname__, str(exc), traceback.format_exc()))
        except (OSError, ValueError):
            pass
        return 1
    finally:
        if node is not None:
            if task.router is node:
                task.detach_router()
            node.close()


def _join(spec: Dict[str, Any], conn: Any) -> WorkerRouter:
    """Start this worker's router, tell the launcher its address, dial the peers it names, handshake."""
    router = None
    if spec["topology"] != "alone":
        from conveyor.engine.parallel.router import Router
        router = Router(str(spec["node_id"]), spec["secret"], listen=spec["listen"], **spec["router_options"])
    node = WorkerRouter(router, spec["node_id"], spec["n_workers"], spec["labels"], spec["restarts"])
    try:
        conn.send(("address", None if router is None else router.address))
        _, dial, expected = conn.recv()
        if router is not None:
            for url in dial:
                router.connect(url)
            node._neighbours = router.wait_for_peers(expected, spec["ready_timeout_s"]) if expected else []
    except BaseException:
        node.close()
        raise
    return node


class _GracefulStop:
    """A worker's SIGTERM handler while ``main`` runs: inside ``task.run`` the first SIGTERM sets ``task.finish``
    and emits :data:`~conveyor.engine.task.STOP_EVENT` (from a thread: a signal handler must not take the
    event bus's lock), so the run ends normally after this iteration; outside it, or a second time,
    it raises ``SystemExit(143)`` at once."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self._asked = False
        threading.Thread(target=self._serve, name="conveyor-stop", daemon=True).start()

    def handle(self, signum: int, frame: Any) -> None:
        from conveyor.engine.task import task
        if self._asked or not task.running:
            raise _Terminated(128 + signum)
        self._asked = task.finish = True
        os.write(self._write, b"s")

    def _serve(self) -> None:
        from conveyor.engine.task import STOP_EVENT, task
        if os.read(self._read, 1):
            log.info("worker %s: asked to stop; the run ends after this iteration", getattr(task.router, "node_id", "?"))
            task.emit(STOP_EVENT, only_local=True)


def _stop_when_orphaned(conn: Any) -> None:
    """The launcher never writes after 'go': end of file here means it is gone, so stop this worker."""
    try:
        conn.recv()
    except (EOFError, OSError):
        os.kill(os.getpid(), signal.SIGTERM)
