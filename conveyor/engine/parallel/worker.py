"""Inside a worker of :meth:`Parallel.runner <conveyor.engine.parallel.runner.Parallel.runner>`: its router
(``task.router``), its life from the handshake to the result, and its graceful stop on SIGTERM.

A worker is forked by the launch's zygote (:class:`conveyor.processes.Zygote`), which calls :func:`serve` with
its connection to the launcher. SIGINT is ignored there (Ctrl-C reaches the whole process group; the launcher
decides). The first SIGTERM while ``main`` is inside ``task.run`` stops the run gracefully: ``task.finish`` is
set and :data:`~conveyor.engine.task.STOP_EVENT` emitted (the exchangers stop waiting), the run ends normally
after the current iteration (a ``CkptSaver`` writes its final checkpoint) and ``main`` goes on; inside
``task.ahead_of_run`` (a run on its way, its pipeline still being built) the run ends as soon as it starts. Outside
both, or a second SIGTERM, raises ``SystemExit(143)``, so ``finally`` blocks and ``with task.start()``
exit run. When its ``main`` returns, a worker tells its peers and waits until each has finished too or is
gone, before closing its router: no message it sent is cut off by closing early. Once its result or error is
sent, a SIGTERM ends the worker at once.

A worker whose launcher disappears (killed, its host or its Ray actor lost) stops itself. Without
``auto_recover`` it stops as on SIGTERM, which ends the run on every node. With ``auto_recover`` the job's
nodes outlive the loss of one, so it dies at once as a killed worker would (exit code 143, nothing told to its
peers, its address freed): they go on without it, and a launcher started again in its place (Ray restarts an
actor) starts it again with the same node id and address, and it rejoins.
"""
from __future__ import annotations

import contextlib

import logging
import os
import pickle
import signal
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

from conveyor.engine.ratelimit import RateLimitedLog
from conveyor.processes import Terminated, pack_exception

__all__ = ["FINISHED_TOPIC", "WorkerRouter", "serve"]

log = logging.getLogger(__name__)

FINISHED_TOPIC = "conveyor.runner.finished"
"""Published by a worker whose ``main`` has returned; its peers close only after hearing it (or losing it). Its
payload, the worker's node id, counts only from that node (``Router.sender``): no peer can say another finished."""


class WorkerRouter:
    """``task.router`` inside a worker: every method of the node's :class:`Router`, plus ``node_id`` (the
    worker's int id), ``n_workers``, ``labels``, ``is_active`` and ``restarts`` (how many times the launcher
    restarted this worker, plus the runner's ``restarts_before``: 0 in the first process). Under topology
    ``"alone"`` there is no router: ``is_active`` is False, :meth:`publish` reaches nobody and :meth:`on` /
    :meth:`off` do nothing."""

    def __init__(self, router: Any, node_id: int, n_workers: int, labels: Iterable[str] = (), restarts: int = 0) -> None:
        self._router = router
        self.node_id, self.n_workers, self.labels, self.restarts = node_id, n_workers, frozenset(labels), restarts
        self._neighbours: List[str] = []
        self._finished: set = set()
        self._finished_changed = threading.Condition()
        self._left_callbacks: List[Callable[[str], Any]] = []
        self._refused = 0  # FINISHED messages in another node's name
        self._log = RateLimitedLog(log)
        if router is not None:  # before any dial, so the first hello already lists the topic
            router.on(FINISHED_TOPIC, self._peer_finished)
            router.on_peer_lost(self._peer_left)

    @property
    def is_active(self) -> bool:
        """Whether this worker has a router that is open."""
        return self._router is not None and not self._router.closed

    def publish(self, topic: str, payload: Any, to_lost: bool = False) -> int:
        """Send ``payload`` on ``topic`` to the peers (none under ``"alone"``); how many it reached. ``to_lost``: as
        :meth:`Router.publish`'s."""
        return 0 if self._router is None else self._router.publish(topic, payload, to_lost)

    def on(self, topic: str, fn: Callable[[Any], Any]) -> None:
        """Call ``fn(payload)`` for each message on ``topic`` from a peer."""
        if self._router is not None:
            self._router.on(topic, fn)

    def off(self, topic: str, fn: Callable[[Any], Any]) -> None:
        """Remove a callback given to :meth:`on`."""
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

    def stats(self) -> Dict[str, Any]:
        """The router's counters (:meth:`Router.stats`), with ``rejected_finished``: messages on
        :data:`FINISHED_TOPIC` that said another node than their sender had finished."""
        return {**(self._router.stats() if self._router is not None else {}), "rejected_finished": self._refused}

    def __getattr__(self, name: str) -> Any:
        router = self.__dict__.get("_router")
        if name.startswith("_") or router is None:
            raise AttributeError(f"task.router has no attribute {name!r}"
                                 + (" (topology 'alone': this worker has no router)" if router is None else ""))
        return getattr(router, name)

    def __repr__(self) -> str:
        return f"<WorkerRouter node {self.node_id} of {self.n_workers}: {self._router!r}>"

    def _peer_finished(self, node: Any) -> None:
        sender = getattr(self._router, "sender", None)
        if sender is not None and str(node) != sender:
            self._refused += 1  # the delivery thread alone runs this
            self._log.log("finished", "worker %s: node %s said node %.40r finished; only a node itself can say so "
                          "(%d refused so far)", self.node_id, sender, node, self._refused)
            return
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
        self._router.publish(FINISHED_TOPIC, self._router.node_id, to_lost=True)  # a stopped peer reads it later
        with self._finished_changed:
            self._finished_changed.wait_for(lambda: all(
                node in self._finished or node not in self._router.peers() for node in self._neighbours))

    def close(self) -> None:
        """Close the router (if any)."""
        if self._router is not None:
            self._router.close()


def dumps_or_none(value: Any) -> Optional[bytes]:
    """``value`` pickled, or None (with a warning) where it does not pickle."""
    try:
        return pickle.dumps(value)
    except Exception:
        log.warning("Parallel.runner: %r does not pickle; the launcher gets None for it", type(value).__name__)
        return None


def serve(conn: Any) -> int:
    """A worker's life on its connection to the launcher (the zygote's entry); its exit code."""
    from conveyor.engine.task import task
    spec, program = conn.recv()
    node: Optional[WorkerRouter] = None
    try:
        main, args = pickle.loads(program)
        node = _join(spec, conn)
        task.attach_router(node)
        conn.send(("ready",))
        if conn.recv() != ("go",):
            raise RuntimeError("the launcher sent something other than 'go'")
        orphaned = _Orphaned(conn, spec["node_id"], spec["auto_recover"])
        threading.Thread(target=orphaned.watch, name="conveyor-launcher-watch", daemon=True).start()
        signal.signal(signal.SIGTERM, _GracefulStop(orphaned).handle)
        result = main(*args)
        with contextlib.suppress(OSError):  # a launcher gone (an orphan's) hears nothing; its peers still must
            conn.send(("returned",))  # before the wait for its peers: an owner's return ends the run (ends_with)
        node._finish()
        conn.send(("result", dumps_or_none(result)))
        return 0
    except Terminated:
        return 128 + signal.SIGTERM
    except BaseException as exc:
        try:
            conn.send(("error", pack_exception(exc)))
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
    node = WorkerRouter(router, spec["node_id"], spec["n_workers"], spec["labels"],
                        spec["restarts_before"] + spec["restarts"])
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


SAME_STOP_S = 1.0
"""A worker's second SIGTERM within this many seconds of its first is the same stop, not a demand to stop now."""


class _GracefulStop:
    """A worker's SIGTERM handler while ``main`` runs: inside ``task.run`` the first SIGTERM sets ``task.finish``
    and emits :data:`~conveyor.engine.task.STOP_EVENT` (from a thread: a signal handler must not take the
    event bus's lock), so the run ends normally after this iteration, as does a run on its way
    (``task.ahead_of_run``) as it starts; outside them, or a second time (more than
    :data:`SAME_STOP_S` after the first), it raises ``SystemExit(143)`` at once. A SIGTERM within that second is
    the same stop delivered twice (Slurm signals every process of a task, and the launcher passes its own on).
    With ``auto_recover``, a SIGTERM once the launcher is gone (a Ray
    node's cleanup of a dead actor's processes) makes the worker leave as :class:`_Orphaned` does."""

    def __init__(self, orphaned: "_Orphaned") -> None:
        self._orphaned = orphaned
        self._read, self._write = os.pipe()
        self._asked_at: Optional[float] = None
        threading.Thread(target=self._serve, name="conveyor-stop", daemon=True).start()

    def handle(self, signum: int, frame: Any) -> None:
        from conveyor.engine.task import task
        self._orphaned.leave_if_gone()
        now = time.monotonic()
        if self._asked_at is not None and now - self._asked_at < SAME_STOP_S:
            return
        if self._asked_at is not None or not (task.running or task.run_ahead):
            raise Terminated(128 + signum)
        self._asked_at, task.finish = now, True
        os.write(self._write, b"s")

    def _serve(self) -> None:
        from conveyor.engine.task import STOP_EVENT, task
        if os.read(self._read, 1):
            log.info("worker %s: asked to stop; the run ends %s", getattr(task.router, "node_id", "?"),
                     "after this iteration" if task.running else "as it starts")
            task.emit(STOP_EVENT, only_local=True)


class _Orphaned:
    """What a worker does once its launcher is gone (end of file on ``conn``: the launcher never writes after
    'go'): with ``leave`` (``auto_recover``) it dies at once without ending the run on the others, else it
    stops as on SIGTERM (see the module docstring)."""

    def __init__(self, conn: Any, node_id: Any, leave: bool) -> None:
        self._conn, self._node_id, self._leave = conn, node_id, leave

    def watch(self) -> None:
        """Wait for the launcher to be gone, then stop this worker."""
        try:
            self._conn.recv()
        except (EOFError, OSError):
            self.leave_if_gone()
            os.kill(os.getpid(), signal.SIGTERM)

    def leave_if_gone(self) -> None:
        """With ``leave``, and the launcher gone (its end of ``conn`` closed, so ``poll`` answers at once), exit
        now as a killed worker would: no ``task.finish`` told to the peers, every socket closed."""
        try:
            gone = self._leave and self._conn.poll()
        except (OSError, ValueError):  # closed here: the result is sent, the worker ends anyway
            gone = False
        if gone:
            log.warning("worker %s: its launcher is gone; it leaves the run at once (auto_recover: the others go on "
                        "without it)", self._node_id)
            os._exit(128 + signal.SIGTERM)
