"""The launcher side of :meth:`Parallel.runner <conveyor.engine.parallel.runner.Parallel.runner>`: start the
workers from one zygote, supervise them (ready handshake, results, errors, deaths, ``auto_recover`` restarts),
stop them and clean up. Processes themselves are :mod:`conveyor.processes`'s; this module knows what a
worker says and what the job does about it."""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import pickletools
import shutil
import subprocess
import sys
import time
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set

from conveyor.engine.compose import note
from conveyor.engine.parallel.frame import SECRET_ENV, generate_secret, load_secret
from conveyor.engine.parallel.peers import PEER_TIMEOUT_S
from conveyor.engine.parallel.worker import WorkerRouter
from conveyor.processes import (Forked, RemoteTraceback, UnguardedStart, Zygote, describe_exit, importing_main,
                                preparation, private_dir, sigterm_raises, signals_ignored, stop, unlink_quietly,
                                unpack_exception)

__all__ = ["RemoteTraceback", "WorkerError", "launch", "zygote_ahead"]

log = logging.getLogger(__name__)

RUN_DIR_PREFIX = "conveyor-run-"
"""``$TMPDIR/conveyor-run-<launcher pid>-<random>``: the ipc files of a launch that was given no ``address``."""
_ENTRY = "conveyor.engine.parallel.worker:serve"


class WorkerError(RuntimeError):
    """A worker ended without an exception that can be re-raised here: killed by a signal, ``os._exit``,
    or an exception that does not unpickle in the launcher (its type and message are in this one's).

    Raised for a worker that died while running (and was not restarted) once the others are done;
    ``results`` then holds their return values by worker (None for the dead ones)."""

    def __init__(self, message: str, results: Optional[List[Any]] = None) -> None:
        super().__init__(message)
        self.results = results


def _zygote(modules: Sequence[str], ready_timeout_s: float) -> Zygote:
    return Zygote(modules, ready_timeout_s, _ENTRY, error=WorkerError, owner="Parallel.runner", what="workers")


def launch(plan: Any, main: Callable[..., Any], args: tuple) -> List[Any]:
    """Run ``main(*args)`` on the workers ``plan`` (the runner's checked arguments) describes; their results."""
    if importing_main():
        script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main module"
        raise UnguardedStart(f"Parallel.runner: {script} calls the runner again in the zygote that imports it to "
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
    ipc_dir = private_dir(RUN_DIR_PREFIX) if own_dir else plan.address
    listens = [_listen_address(plan, i, node_id, ipc_dir) for i, node_id in enumerate(plan.node_ids)]
    workers: List[_Worker] = []
    zygote: Optional[Zygote] = None
    try:
        from conveyor.engine.parallel.inbox import check_ipc_address  # imports pynng: only once workers start
        for url in listens:
            check_ipc_address(url or "", "Parallel.runner")
        if generated and plan.topology != "alone":
            _check_local(listens + plan.attach_to)
        with sigterm_raises():
            modules = _modules(program)
            zygote = _take_spare(modules, plan.ready_timeout_s) or _zygote(modules, plan.ready_timeout_s)
            for i, node_id in enumerate(plan.node_ids):
                spec = {"node_id": node_id, "n_workers": plan.n, "topology": plan.topology, "listen": listens[i],
                        "secret": secret, "labels": plan.labels, "ready_timeout_s": plan.ready_timeout_s,
                        "router_options": plan.router_options, "restarts": 0,
                        "restarts_before": plan.restarts_before,
                        "auto_recover": plan.auto_recover}
                workers.append(_Worker.start(spec, program, zygote))
            return _supervise(plan, workers, program, zygote)
    finally:
        with signals_ignored():
            _stop(workers, plan.grace_s)
            if zygote is not None:
                zygote.close(plan.grace_s)
            if own_dir:
                shutil.rmtree(ipc_dir, ignore_errors=True)
            elif plan.protocol == "ipc":
                for url in listens:
                    unlink_quietly(url[len("ipc://"):])


_spare: Optional[Zygote] = None
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
    _spare = _zygote(modules, 60.0)
    try:
        yield
    finally:
        spare, _spare = _spare, None
        if spare is not None:
            spare.kill()


def _take_spare(modules: Sequence[str], ready_timeout_s: float) -> Optional[Zygote]:
    """The zygote started ahead, told to import ``modules`` too; None if there is none or it no longer fits."""
    global _spare
    spare, _spare = _spare, None
    if spare is None:
        return None
    if not spare.alive() or spare.preparation != preparation("conveyor-zygote"):
        spare.kill()
        return None
    spare.ready_timeout_s = ready_timeout_s
    spare.preload(modules)
    return spare


def _modules(program: bytes) -> List[str]:
    """What the zygote preloads: the modules the pickled ``(main, args)`` names (main's own, its args' classes),
    after those every worker imports."""
    strings = (arg.split(" ")[0] if op.name == "GLOBAL" else arg for op, arg, _ in pickletools.genops(program)
               if isinstance(arg, str))
    named = [name for name in strings if name in sys.modules and name != "__main__"]  # prepare() loads __main__
    return list(dict.fromkeys(["conveyor.engine.task", "conveyor.engine.parallel.router", *named]))


def _run_here(plan: Any, main: Callable[..., Any], args: tuple) -> Any:
    from conveyor.engine.task import task
    node = WorkerRouter(None, plan.node_ids[0], 1, plan.labels, plan.restarts_before)
    task.attach_router(node)
    try:
        return main(*args)
    finally:
        if task.router is node:
            task.detach_router()


def _listen_address(plan: Any, i: int, node_id: int, ipc_dir: Optional[str]) -> Optional[str]:
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


class _Worker:
    """The launcher's handle on one worker process and what it has reported."""

    def __init__(self, spec: Dict[str, Any], proc: Forked, conn: Any, ready_timeout_s: float) -> None:
        self.spec, self.node_id, self.proc, self.conn = spec, spec["node_id"], proc, conn
        self.restarts: int = spec["restarts"]
        self.address: Any = _Worker  # not reported yet
        self.ready = self.returned = self.finished = self.ended = False
        self.stopped_at: Optional[float] = None  # when the launcher stopped it, the run having ended
        self.deadline = time.monotonic() + ready_timeout_s  # to be ready by
        self.result: Any = None

    @classmethod
    def start(cls, spec: Dict[str, Any], program: bytes, zygote: Zygote) -> "_Worker":
        proc, conn = zygote.fork(f"conveyor-worker-{spec['node_id']}")
        worker = cls(spec, proc, conn, zygote.ready_timeout_s)
        worker.conn.send((spec, program))
        return worker

    def __repr__(self) -> str:
        return f"worker {self.node_id} (pid {self.proc.pid})"


# --- supervision ---------------------------------------------------------------------------------------
def _supervise(plan: Any, workers: List[_Worker], program: bytes, zygote: Zygote) -> List[Any]:
    """Start the workers together (addresses, dial plans, ready, go), then serve them until all have ended:
    re-raise an exception, restart or note a worker that died; restarted ones join on their own."""
    planned = started = False  # every first worker has been told whom to dial / to go
    dead: List[str] = []
    end = _RunEnd(plan)
    while True:
        by_conn = {w.conn: w for w in workers if not w.ended}
        if not by_conn:
            break
        waiting = [w for w in workers if not w.ended and not w.ready]
        timeouts = [t for t in [w.deadline - time.monotonic() for w in waiting] + [end.due(workers)] if t is not None]
        timeout = max(0.0, min(timeouts)) if timeouts else None
        answered = mp_connection.wait(list(by_conn), timeout)
        end.act(workers)
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
                if why is not None and worker.stopped_at is not None:
                    log.warning("Parallel.runner: %s, stopped once the run had ended", why)
                elif why is not None and not _restart(plan, workers, worker, why, program, zygote):
                    dead.append(why)
                continue
            kind = message[0]
            if kind == "error":
                raise _rebuild(worker, message[1])
            if kind == "address":
                worker.address = message[1]
                if started:  # a restarted worker joins those running now
                    worker.conn.send(_dial_plan(plan, workers.index(worker), workers))
            elif kind == "ready":
                worker.ready = True
                if started:
                    worker.conn.send(("go",))
            elif kind == "returned":
                worker.returned = True
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


def _dial_plan(plan: Any, i: int, workers: List[_Worker]) -> tuple:
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


class _RunEnd:
    """The end of a run whose owners (``plan.ends_with``) have returned: the workers still running get the routers'
    peer timeout to end by themselves, then SIGTERM, then SIGKILL ``plan.grace_s`` later (the module docstring of
    :mod:`~conveyor.engine.parallel.runner`)."""

    def __init__(self, plan: Any) -> None:
        self.owners, self.grace_s = set(plan.ends_with), plan.grace_s
        self.wait_s = float(plan.router_options.get("peer_timeout_s", PEER_TIMEOUT_S))
        self.ended_at: Optional[float] = None
        self.killed: Set[int] = set()  # ids of the workers killed

    def due(self, workers: List[_Worker]) -> Optional[float]:
        """Seconds until :meth:`act` has something to do (None: nothing until a worker says something)."""
        if self.ended_at is None:
            owners = [w for w in workers if w.node_id in self.owners]
            if not owners or not all(w.returned for w in owners):
                return None
            self.ended_at = time.monotonic()
        running = [w for w in workers if not w.ended and id(w) not in self.killed and w.node_id not in self.owners]
        if not running:
            return None
        stops = [self.ended_at + self.wait_s if w.stopped_at is None else w.stopped_at + self.grace_s for w in running]
        return min(stops) - time.monotonic()

    def act(self, workers: List[_Worker]) -> None:
        """Stop the workers whose time after the end ran out, as on SIGTERM; kill those stopped ``grace_s`` ago."""
        if self.ended_at is None:
            return
        now = time.monotonic()
        for w in workers:
            if w.ended or id(w) in self.killed or w.node_id in self.owners:
                continue
            if w.stopped_at is None and now >= self.ended_at + self.wait_s:
                log.warning("Parallel.runner: node %s returned %.1fs ago and %s still runs (it missed the end of the "
                            "run: stopped, or cut off); it is stopped as on SIGTERM", ", ".join(map(str, sorted(
                                self.owners))), now - self.ended_at, w)
                w.stopped_at = now
                w.proc.terminate()
            elif w.stopped_at is not None and now >= w.stopped_at + self.grace_s:
                log.warning("Parallel.runner: %s did not stop within %ss of its SIGTERM; killing it", w, self.grace_s)
                self.killed.add(id(w))
                w.proc.kill()


def _ended(plan: Any, worker: _Worker, started: bool) -> Optional[str]:
    """Its connection closed: it has exited (or is exiting). None if it ended well, else why not; raises
    during the start."""
    try:
        code = worker.proc.wait(timeout=plan.grace_s)
    except subprocess.TimeoutExpired:
        raise WorkerError(f"Parallel.runner: {worker} closed its connection but did not exit within "
                          f"grace_s={plan.grace_s}s") from None
    if code > 0:
        why = f"{worker} exited with code {code} without reporting an exception (its stderr has the details)"
    elif code < 0:
        why = f"{worker} {describe_exit(code)}"
    elif not worker.finished:
        why = f"{worker} exited without reporting a result"
    else:
        return None
    if not started:
        raise WorkerError(f"Parallel.runner: {why}, during the start, before main ran")
    return why


def _restart(plan: Any, workers: List[_Worker], worker: _Worker, why: str, program: bytes, zygote: Zygote) -> bool:
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


def _rebuild(worker: _Worker, packed: tuple) -> BaseException:
    """The worker's exception, with its traceback as the cause and a note naming the worker."""
    exc = unpack_exception(packed, WorkerError)
    note(exc, f"raised in parallel {worker}; its traceback is the cause above")
    return exc


def _loads_or_none(blob: Optional[bytes]) -> Any:
    try:
        return None if blob is None else pickle.loads(blob)
    except Exception:
        log.warning("Parallel.runner: a value sent by a worker does not unpickle here", exc_info=True)
        return None


def _stop(workers: List[_Worker], grace_s: float) -> None:
    """SIGTERM every worker still running, SIGKILL those still there after ``grace_s``; reap them all; close
    their connections (a worker whose zygote is gone stops when its connection closes)."""
    try:
        stop([w.proc for w in workers], grace_s, warn=True)
    except WorkerError as e:
        log.warning("%s", e)
    for worker in workers:
        worker.conn.close()
