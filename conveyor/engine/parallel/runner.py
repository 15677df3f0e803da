"""``Parallel.runner``: the same ``main()`` on N worker processes joined by routers.

``Parallel.runner(n_parallel_workers, topology=..., protocol=...)(main, *args)`` starts one process per
worker, gives each a :class:`~conveyor.engine.parallel.router.Router` (its node id, its listen address,
the peers to dial), attaches it with ``task.attach_router`` (so ``task.emit`` / ``task.on`` cross
processes), waits until every worker has completed the ready handshake with its peers, then calls
``main(*args)`` in all of them at once. It returns the list of ``main``'s return values, by worker.

Topologies: ``"star"``, node 0 is the hub every other worker dials (a worker's events reach the hub, the
hub's reach everyone); ``"mesh"``, every worker dials every other; ``"alone"``, no router at all
(``task.router.is_active`` is False). One worker with ``"alone"`` runs ``main`` in this process.

How a worker starts: ``python -c`` running :func:`_worker_main` with one end of a socket pair passed as
an inherited descriptor. Everything private travels over that pair, never in the environment or on
the command line: multiprocessing's preparation data (``sys.path``, the working directory, the main
module, as its ``spawn`` start method sends them), then ``main`` and its args (pickled by reference,
so ``main`` must be a module-level function and a script that calls the runner needs an
``if __name__ == "__main__":`` guard, as with multiprocessing), then the shared secret. No
multiprocessing helper process (resource tracker) is started, so stopping the workers leaves nothing.

The secret: ``secret=`` (bytes), else ``$CONVEYOR_SECRET``, else one generated for this launch; a
generated secret is known to this launch only, so the workers then stay on this host (ipc, or tcp on
a loopback address), as a :class:`Router` without a secret does.

The launcher then supervises: an uncaught exception in a worker is sent back with its traceback; the
launcher stops the other workers (SIGTERM, then SIGKILL after ``grace_s``) and re-raises it, rebuilt
(or as :class:`WorkerError` when it cannot be unpickled), with the worker's traceback text as its
``__cause__`` (a :class:`RemoteTraceback`) and a note naming the worker. A worker that dies without an
exception (a signal, ``os._exit``) raises :class:`WorkerError`. SIGTERM to the launcher (from its main
thread) or Ctrl-C stops every worker the same way, removes the ipc files, and ends the launcher with
``SystemExit(143)`` or ``KeyboardInterrupt``. A worker whose launcher disappears stops itself.

Inside a worker, SIGINT is ignored (Ctrl-C reaches the whole process group; the launcher decides) and
SIGTERM raises ``SystemExit(143)``, so ``finally`` blocks and ``with task.start()`` exits run.
When its ``main`` returns, a worker tells its peers and waits until each has finished too or is gone,
before closing its router: no message it sent is cut off by closing early.
"""
from __future__ import annotations

import difflib
import logging
import os
import pickle
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
from multiprocessing import spawn as mp_spawn
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import conveyor
from conveyor.engine.compose import note
from conveyor.engine.parallel.frame import SECRET_ENV, generate_secret, load_secret

__all__ = ["Parallel", "RemoteTraceback", "WorkerError", "WorkerRouter"]

log = logging.getLogger(__name__)

TOPOLOGIES = ("star", "mesh", "alone")
PROTOCOLS = ("ipc", "tcp")
FINISHED_TOPIC = "conveyor.runner.finished"
"""Published by a worker whose ``main`` has returned; its peers close only after hearing it (or losing it)."""

_WORKER_CODE = "from conveyor.engine.parallel.runner import _worker_main; _worker_main()"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(conveyor.__file__)))


class WorkerError(RuntimeError):
    """A worker ended without an exception that can be re-raised here: killed by a signal, ``os._exit``,
    or an exception that does not unpickle in the launcher (its type and message are in this one's)."""


class RemoteTraceback(Exception):
    """The traceback text of a worker's exception, set as the ``__cause__`` of the one the runner raises."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.tb.rstrip()}\n\"\"\""


class _Terminated(SystemExit):
    """Raised by the SIGTERM handler of a worker or of the launcher: unwinds ``finally`` blocks, exits 143."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(128 + signum)


class WorkerRouter:
    """``task.router`` inside a worker: every method of the node's :class:`Router`, plus ``node_id`` (the
    worker's int id), ``n_workers``, ``labels`` and ``is_active``. Under topology ``"alone"`` there is no
    router: ``is_active`` is False, :meth:`publish` reaches nobody and :meth:`on` subscribes to nothing."""

    def __init__(self, router: Any, node_id: int, n_workers: int, labels: Iterable[str] = ()) -> None:
        self._router = router
        self.node_id, self.n_workers, self.labels = node_id, n_workers, frozenset(labels)
        self._neighbours: List[str] = []
        self._finished: set = set()
        self._finished_changed = threading.Condition()
        if router is not None:  # before any dial, so the first hello already lists the topic
            router.on(FINISHED_TOPIC, self._peer_finished)
            router.on_peer_lost(self._peer_finished)

    @property
    def is_active(self) -> bool:
        """Whether this worker has a router that is open."""
        return self._router is not None and not self._router.closed

    def publish(self, topic: str, payload: Any) -> int:
        return 0 if self._router is None else self._router.publish(topic, payload)

    def on(self, topic: str, fn: Callable[[Any], Any]) -> None:
        if self._router is not None:
            self._router.on(topic, fn)

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
            self._finished_changed.notify_all()

    def _finish(self) -> None:
        """Tell the peers this worker's main returned; wait until each of them has said so or is gone."""
        if self._router is None:
            return
        self._router.publish(FINISHED_TOPIC, self._router.node_id)
        with self._finished_changed:
            self._finished_changed.wait_for(lambda: set(self._neighbours) <= self._finished)

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
        ``labels``: labels of every worker (``task.router.labels``). ``ready_timeout_s`` bounds the start
        and the handshake; ``grace_s`` the wait between SIGTERM and SIGKILL when stopping workers.
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
        if auto_recover or max_retries is not None:
            raise NotImplementedError(f"{where}(auto_recover={auto_recover!r}, max_retries={max_retries!r}): restarting "
                                      f"failed workers is not implemented yet; leave both unset")
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


# --- the launcher --------------------------------------------------------------------------------------
def _launch(plan: _Plan, main: Callable[..., Any], args: tuple) -> List[Any]:
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
    ipc_dir = tempfile.mkdtemp(prefix="conveyor-run-") if own_dir else plan.address
    listens = [_listen_address(plan, i, node_id, ipc_dir) for i, node_id in enumerate(plan.node_ids)]
    workers: List[_Worker] = []
    try:
        if generated and plan.topology != "alone":
            _check_local(listens + plan.attach_to)
        with _terminate_on_sigterm():
            for i, node_id in enumerate(plan.node_ids):
                spec = {"node_id": node_id, "n_workers": plan.n, "topology": plan.topology, "listen": listens[i],
                        "secret": secret, "labels": plan.labels, "ready_timeout_s": plan.ready_timeout_s,
                        "router_options": plan.router_options}
                workers.append(_Worker.start(spec, program))
            return _supervise(plan, workers)
    finally:
        with _signals_ignored():
            _stop(workers, plan.grace_s)
            if own_dir:
                shutil.rmtree(ipc_dir, ignore_errors=True)
            elif plan.protocol == "ipc":
                for url in listens:
                    _unlink(url[len("ipc://"):])


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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class _Worker:
    """The launcher's handle on one worker process and what it has reported."""

    def __init__(self, spec: Dict[str, Any], proc: subprocess.Popen, conn: Any) -> None:
        self.node_id, self.proc, self.conn = spec["node_id"], proc, conn
        self.address: Any = _Worker  # not reported yet
        self.ready = False
        self.result: Any = None

    @classmethod
    def start(cls, spec: Dict[str, Any], program: bytes) -> "_Worker":
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE, str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()
        worker = cls(spec, proc, mp_connection.Connection(ours.detach()))
        preparation = mp_spawn.get_preparation_data(f"conveyor-worker-{spec['node_id']}")
        preparation.pop("authkey", None)  # multiprocessing's own key: the worker needs none, and it must not travel
        worker.conn.send(preparation)
        worker.conn.send((spec, program))
        return worker

    def __repr__(self) -> str:
        return f"worker {self.node_id} (pid {self.proc.pid})"


def _supervise(plan: _Plan, workers: List[_Worker]) -> List[Any]:
    by_conn = {w.conn: w for w in workers}
    live = set(by_conn)
    deadline = time.monotonic() + plan.ready_timeout_s
    phase = "address"
    while live:
        timeout = None if phase == "running" else max(0.0, deadline - time.monotonic())
        answered = mp_connection.wait(list(live), timeout)
        if not answered and phase != "running":
            waiting = [w.node_id for w in workers if (w.address is _Worker if phase == "address" else not w.ready)]
            raise TimeoutError(f"Parallel.runner: workers {waiting} not {'started' if phase == 'address' else 'ready'} "
                               f"after ready_timeout_s={plan.ready_timeout_s}s; raise it, or check that nothing "
                               f"blocks their start (imports at module level) or their addresses")
        for conn in answered:
            worker = by_conn[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                live.discard(conn)
                _ended(plan, worker, phase)
                continue
            kind = message[0]
            if kind == "error":
                raise _rebuild(worker, *message[1:])
            if kind == "address":
                worker.address = message[1]
            elif kind == "ready":
                worker.ready = True
            elif kind == "result":
                worker.result = message[1]
        if phase == "address" and all(w.address is not _Worker for w in workers):
            for i, worker in enumerate(workers):
                worker.conn.send(_dial_plan(plan, i, [w.address for w in workers]))
            phase = "ready"
        if phase == "ready" and all(w.ready for w in workers):
            for worker in workers:
                worker.conn.send(("go",))
            phase = "running"
    return [_loads_or_none(w.result) for w in workers]


def _dial_plan(plan: _Plan, i: int, addresses: List[Optional[str]]) -> tuple:
    """("peers", addresses worker i dials, how many peers it waits for)."""
    if plan.topology == "alone":
        return "peers", [], 0
    if plan.topology == "star":
        local = addresses[1:] if i == 0 else addresses[:1]  # the hub dials no one: the leaves' hellos make it dial back
        dial = [] if i == 0 else addresses[:1]
    else:
        local = dial = addresses[:i] + addresses[i + 1:]
    return "peers", dial + plan.attach_to, len(local) + len(plan.attach_to)


def _ended(plan: _Plan, worker: _Worker, phase: str) -> None:
    """Its connection closed: it has exited (or is exiting). Raise unless it ended well."""
    try:
        code = worker.proc.wait(timeout=plan.grace_s)
    except subprocess.TimeoutExpired:
        raise WorkerError(f"Parallel.runner: {worker} closed its connection but did not exit within "
                          f"grace_s={plan.grace_s}s") from None
    if code < 0:
        raise WorkerError(f"Parallel.runner: {worker} was killed by {_signal_name(-code)}")
    if code != 0:
        raise WorkerError(f"Parallel.runner: {worker} exited with code {code} without reporting an exception "
                          f"(its stderr has the details)")
    if phase != "running":
        raise WorkerError(f"Parallel.runner: {worker} exited during the start, before main ran")


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
def _worker_main() -> None:
    """Entry point of a worker process (``python -c``; argv[1] is the inherited descriptor)."""
    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)  # the worker's own children must not hold the launcher's connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_terminated)
    conn = mp_connection.Connection(fd)
    try:
        mp_spawn.prepare(conn.recv())
        spec, program = conn.recv()
    except _Terminated:
        sys.exit(128 + signal.SIGTERM)
    sys.exit(_run_worker(spec, program, conn))


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
    node = WorkerRouter(router, spec["node_id"], spec["n_workers"], spec["labels"])
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


def _stop_when_orphaned(conn: Any) -> None:
    """The launcher never writes after 'go': end of file here means it is gone, so stop this worker."""
    try:
        conn.recv()
    except (EOFError, OSError):
        os.kill(os.getpid(), signal.SIGTERM)
