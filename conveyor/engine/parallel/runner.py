"""``Parallel.runner``: the same ``main()`` on N worker processes joined by routers.

``Parallel.runner(n_parallel_workers, topology=..., protocol=...)(main, *args)`` starts one process per
worker, gives each a :class:`~conveyor.engine.parallel.router.Router` (its node id, its listen address,
the peers to dial), attaches it with ``task.attach_router`` (so ``task.emit`` / ``task.on`` cross
processes), waits until every worker has completed the ready handshake with its peers, then calls
``main(*args)`` in all of them at once. It returns the list of ``main``'s return values, by worker.

Topologies: ``"star"``, node 0 is the hub every other worker dials (a worker's events reach the hub, the
hub's reach everyone); ``"mesh"``, every worker dials every other; ``"alone"``, no router at all
(``task.router.is_active`` is False). One worker with ``"alone"`` runs ``main`` in this process.

How a worker starts: each launch starts a zygote (:class:`conveyor.processes.Zygote`) that imports
the modules ``main`` and its args are pickled from (torch and conveyor with them, once, not once per worker),
then forks every worker of the launch, restarts included (benchmarks/process_start.py measures it against
multiprocessing's forkserver). Everything private travels over each worker's own socket pair with the
launcher, never in the environment or on the command line: the preparation data, then ``main`` and its args
(pickled by reference, so ``main`` must be a module-level function), then the shared secret. A script that
calls the runner without an ``if __name__ == "__main__":`` guard would call it again in the zygote, which
imports it: that is refused at once, with the fix, as :mod:`multiprocessing` does. No multiprocessing helper
process (resource tracker) is started, so stopping the workers leaves nothing.

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

The end of a run: ``ends_with`` names the workers whose return ends the job (the zoo's learner). A worker that
missed their end (stopped, or cut off, when the learner told the others; a collector then waits for a learner
that will not come back) would otherwise hold the launch as long as its own waits last. Once every one of them
has returned, the others get the routers' peer timeout (a node that heard the end ends well within it), then
are stopped as on SIGTERM (their runs end normally after the iteration, with their results), and one still
running ``grace_s`` later is killed; a worker stopped so is logged, not a failure of the job.

SIGTERM to the launcher (from its main thread) or Ctrl-C stops every worker with SIGTERM (each ends its
run gracefully, see below; SIGKILL after ``grace_s``), removes the ipc files, and ends the launcher with
``SystemExit(143)`` or ``KeyboardInterrupt``. A worker whose launcher disappears stops itself: as on SIGTERM,
or with ``auto_recover`` at once, leaving the others to go on (see :mod:`~conveyor.engine.parallel.worker`). The ipc
files of a launch go in ``$TMPDIR/conveyor-run-<launcher pid>-*``; a launch removes such directories
of this user whose launcher is gone (one killed by SIGKILL cannot remove its own).

:func:`zygote_ahead` starts the zygote of the next launch early, so that its imports overlap what the
launching process still does (``conveyor train --collectors`` reads the entry's config, importing torch).

Inside a worker (:mod:`conveyor.engine.parallel.worker`), the first SIGTERM while ``main`` is inside
``task.run`` ends the run gracefully after the current iteration, inside ``task.ahead_of_run`` (a run on its
way) as soon as the run starts; outside them, or a second one, raises ``SystemExit(143)``. The launcher's side,
supervision and restarts included, is :mod:`conveyor.engine.parallel.launch`.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

from conveyor.engine.parallel.frame import check_secret_strength
from conveyor.engine.parallel.launch import WorkerError, launch, zygote_ahead
from conveyor.engine.parallel.worker import WorkerRouter
from conveyor.processes import RemoteTraceback

__all__ = ["Parallel", "RemoteTraceback", "WorkerError", "WorkerRouter", "zygote_ahead"]

TOPOLOGIES = ("star", "mesh", "alone")
PROTOCOLS = ("ipc", "tcp")

DEFAULT_MAX_RETRIES = 3
"""Restarts per worker under ``auto_recover=True`` when ``max_retries`` is None."""


class Parallel:
    """Runs one ``main()`` on several processes: see :meth:`runner` and the module docstring."""

    @staticmethod
    def runner(n_parallel_workers: int, topology: str = "star", protocol: str = "ipc", address: Optional[str] = None,
               ports: Union[int, Sequence[int], None] = None, attach_to: Optional[Sequence[str]] = None,
               node_ids: Union[int, Sequence[int], None] = None, labels: Optional[Iterable[str]] = None,
               auto_recover: bool = False, max_retries: Optional[int] = None, secret: Optional[bytes] = None, *,
               ready_timeout_s: float = 60.0, grace_s: float = 5.0,
               router_options: Optional[Dict[str, Any]] = None, restarts_before: int = 0,
               ends_with: Sequence[int] = ()) -> Callable[..., List[Any]]:
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
        ``restarts_before``: how many times these workers were restarted before this launch, by whatever started
        this launcher again in place of one that died (Ray restarting an actor): ``task.router.restarts`` counts
        on from it, so a worker tells a restart from a first start either way; ``max_retries`` still bounds this
        launch's own restarts. ``ends_with``: the node ids whose return ends the job (a run's owner, its learner;
        those not started here are ignored): once each has returned, the workers still running get the routers'
        peer timeout to end by themselves, are then stopped as on SIGTERM, and killed ``grace_s`` later (see the
        module docstring).
        """
        plan = _Plan(n_parallel_workers, topology, protocol, address, ports, attach_to, node_ids, labels,
                     auto_recover, max_retries, secret, ready_timeout_s, grace_s, router_options, restarts_before,
                     ends_with)
        return lambda main, *args: launch(plan, main, args)


def _closest(value: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(value), choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


class _Plan:
    """The runner's arguments, checked at once."""

    def __init__(self, n: Any, topology: Any, protocol: Any, address: Optional[str], ports: Any, attach_to: Any,
                 node_ids: Any, labels: Any, auto_recover: bool, max_retries: Optional[int], secret: Any,
                 ready_timeout_s: float, grace_s: float, router_options: Optional[Dict[str, Any]],
                 restarts_before: int = 0, ends_with: Sequence[int] = ()) -> None:
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
        if not isinstance(restarts_before, int) or isinstance(restarts_before, bool) or restarts_before < 0:
            raise ValueError(f"{where}(restarts_before={restarts_before!r}): must be an int >= 0")
        if secret is not None and not isinstance(secret, bytes):
            raise TypeError(f"{where}(secret=...): must be bytes, got {type(secret).__name__}")
        if secret is not None:
            check_secret_strength(secret, f"{where}(secret=...)")
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
        ends_with = list(ends_with)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ends_with):
            raise ValueError(f"{where}(ends_with={ends_with!r}): must be node ids (ints), those whose return ends "
                             f"the job")
        if isinstance(attach_to, str):
            attach_to = [a for a in attach_to.split(",") if a]
        self.n, self.topology, self.protocol, self.address, self.ports = n, topology, protocol, address, ports
        self.attach_to, self.node_ids = list(attach_to or ()), node_ids
        self.ends_with = [i for i in ends_with if i in node_ids]
        self.labels = frozenset([labels] if isinstance(labels, str) else labels or ())
        self.secret, self.ready_timeout_s, self.grace_s = secret, ready_timeout_s, grace_s
        self.router_options = dict(router_options or {})
        self.auto_recover, self.restarts_before = auto_recover, restarts_before
        self.max_retries = (DEFAULT_MAX_RETRIES if max_retries is None else max_retries) if auto_recover else 0
