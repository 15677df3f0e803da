"""A collector in a child process, so that in async mode collection really overlaps training.

Two Python threads share one GIL, and torch hands it over around every operator: a collector thread and a
learner thread running small networks at the same time slow each other down instead of overlapping
(docs/engine.md, "When async pays"). :class:`ProcessCollector` runs the same collector middleware (e.g.
:class:`~conveyor.middleware.StepCollector` over its own env manager) in a child process, with a replica
of the policy that acts on the learner's published versions: the parent only sends a request, waits on a
pipe with the GIL released, and puts the answer into the context.
"""
from __future__ import annotations

import multiprocessing as mp
import pickle
import signal
import weakref
from multiprocessing.connection import Connection
from typing import Any, Callable, List, Optional, Tuple

import cloudpickle
import treetensor.torch as ttorch

from conveyor.data.batch import to_numpy, to_tensor
from conveyor.engine import OnlineRLContext, task
from conveyor.envs._subprocess import _describe_exit, _pack_exception, _send_quietly, _unpack_exception
from conveyor.middleware.collector import EPISODE_EVENT

__all__ = ["ProcessCollector", "step_collector_builder"]

Builder = Callable[[], Tuple[Callable[[OnlineRLContext], Any], Any]]

_OUTPUTS = ("trajectories", "trajectory_end_idx", "episodes")
_POLL_S = 0.5  # how often a waiting parent checks that the child is still alive
_CLOSE_TIMEOUT_S = 5.0


def step_collector_builder(cfg: Any, policy_cls: type, random_collect_size: int = 0) -> Builder:
    """A builder for :class:`ProcessCollector`: in the child, a ``policy_cls`` replica and a
    :class:`~conveyor.middleware.StepCollector` over the collector env manager of ``cfg.env``."""
    def build() -> Tuple[Callable[[OnlineRLContext], Any], Any]:
        from conveyor.envs import make_env_manager
        from conveyor.middleware.collector import StepCollector
        policy = policy_cls(cfg.policy)
        env = make_env_manager(cfg.env, "collector", seed=cfg.seed)
        return StepCollector(cfg, policy.collect_mode, env, random_collect_size=random_collect_size), policy
    return build


def _serve(conn: Connection, parent_end: Optional[Connection], blob: bytes) -> None:
    """The child: build the collector, then answer the parent's requests until it says close or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM go to the parent, which closes us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if parent_end is not None:
        parent_end.close()
    events: List[tuple] = []
    task.off(EPISODE_EVENT)  # a forked child holds copies of the parent's handlers: collect events for the parent
    task.on(EPISODE_EVENT, lambda *args: events.append(args))
    collector = None
    try:
        collector, policy = cloudpickle.loads(blob)()
        conn.send_bytes(pickle.dumps(("ok", None)))
        while True:
            command, arg = pickle.loads(conn.recv_bytes())
            if command == "close":
                return
            try:
                if command == "collect":
                    env_step, collect_kwargs, acting = arg
                    if acting is not None:
                        policy.load_acting_state(acting)
                    ctx = OnlineRLContext()
                    ctx.env_step, ctx.collect_kwargs = env_step, collect_kwargs
                    events.clear()
                    collector(ctx)
                    counters = {"env_step": ctx.env_step - env_step, "env_episode": ctx.env_episode}
                    outputs = {name: _portable(getattr(ctx, name)) for name in _OUTPUTS}
                    reply: Any = (counters, outputs, list(events))
                elif command == "state_dict":
                    reply = collector.state_dict()
                elif command == "load_state_dict":
                    reply = collector.load_state_dict(arg)
                else:
                    raise ValueError(f"unknown request {command!r}")
            except Exception as exc:
                conn.send_bytes(pickle.dumps(("error", _pack_exception(exc))))
                continue
            conn.send_bytes(pickle.dumps(("ok", reply)))
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the parent went away: nothing is left to collect for
    except BaseException as exc:
        _send_quietly(conn, ("error", _pack_exception(exc)))
    finally:
        env = getattr(collector, "_env", None)
        if env is not None:
            env.close()
        conn.close()


def _portable(value: Any) -> Any:
    """A collector's output with its trees as nested dicts of numpy arrays, which pickle by value."""
    if isinstance(value, list):
        return [_portable(v) for v in value]
    return to_numpy(value) if isinstance(value, ttorch.Tensor) else value


def _restore(value: Any) -> Any:
    if isinstance(value, list):
        return [_restore(v) for v in value]
    return to_tensor(value) if isinstance(value, dict) else value


class _Child:
    """The process and the parent's end of its pipe (kept apart from the collector for ``weakref.finalize``)."""

    def __init__(self, proc: Any, conn: Connection) -> None:
        self.proc, self.conn = proc, conn

    def close(self) -> None:
        """Ask the child to stop; kill it if it does not within a few seconds."""
        _send_quietly(self.conn, ("close", None))
        self.proc.join(_CLOSE_TIMEOUT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


class ProcessCollector:
    """Runs a collector middleware in a child process; acts like the collector it runs.

    ``build`` (sent with cloudpickle, so a closure works) makes ``(collector, policy)`` in the child;
    :func:`step_collector_builder` makes one for a :class:`~conveyor.middleware.StepCollector`. Before a
    call, the newest version of ``policy`` (the learner's) is sent when it changed since the last call
    (``policy.acting_state()``), and the child's replica acts on it under the same number, so collected
    rows record the version that produced them. Episode events of the child are emitted here. A child
    that dies ends the run with an error saying how it ended; ``close()`` (or leaving a ``with`` block)
    stops it. ``state_dict()`` / ``load_state_dict()`` are the child collector's (env states, current
    observations), so checkpoints and resume work as with the collector in-process.

    Reads ctx: ``env_step``, ``collect_kwargs``.
    Writes ctx: what the collector writes: ``trajectories``, ``trajectory_end_idx``, ``episodes``,
    ``env_step``, ``env_episode``.
    """

    def __init__(self, build: Builder, policy: Any, *, start_method: Optional[str] = None) -> None:
        if not callable(getattr(policy, "acting_state", None)):
            raise TypeError(f"ProcessCollector needs the learner's policy (with acting_state()), got {policy!r}: "
                            f"pass the Policy object, not one of its views")
        self._policy = policy
        self._sent: Optional[int] = None
        context = mp.get_context(start_method)
        parent_end, child_end = context.Pipe(duplex=True)
        inherited = parent_end if context.get_start_method() == "fork" else None
        proc = context.Process(target=_serve, args=(child_end, inherited, cloudpickle.dumps(build)), daemon=True,
                               name="conveyor-collector")
        proc.start()
        child_end.close()
        self._child = _Child(proc, parent_end)
        self._finalizer = weakref.finalize(self, self._child.close)
        try:
            self._request(None)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"ProcessCollector(pid={self.pid})"

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._child.proc.pid

    def __call__(self, ctx: OnlineRLContext) -> None:
        acting = None
        if self._policy.version != self._sent:
            acting = self._policy.acting_state()
            self._sent = acting["version"]
        counters, outputs, events = self._request(("collect", (ctx.env_step, dict(ctx.collect_kwargs), acting)))
        for name, value in outputs.items():
            setattr(ctx, name, _restore(value))
        for name, delta in counters.items():
            setattr(ctx, name, getattr(ctx, name) + delta)
        for args in events:
            task.emit(EPISODE_EVENT, *args)

    def state_dict(self) -> Any:
        """The child collector's state (see the collector's own ``state_dict``)."""
        return self._request(("state_dict", None))

    def load_state_dict(self, state: Any) -> None:
        """Restore the child collector's state."""
        self._request(("load_state_dict", state))

    def close(self) -> None:
        """Stop the child process (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "ProcessCollector":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _request(self, message: Optional[tuple]) -> Any:
        """Send ``message`` (None: only wait for the child's first answer) and return the child's reply."""
        if not self._finalizer.alive:
            raise RuntimeError("ProcessCollector is closed: build a new one")
        conn, proc = self._child.conn, self._child.proc
        try:
            if message is not None:
                conn.send_bytes(pickle.dumps(message))
            while not conn.poll(_POLL_S):
                if not proc.is_alive():
                    raise EOFError
            status, reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            proc.join(_CLOSE_TIMEOUT_S)
            raise RuntimeError(f"the collector process (pid {proc.pid}) {_describe_exit(proc.exitcode)}: "
                               f"its envs and episodes in progress are lost; see its output above") from None
        if status == "error":
            raise _unpack_exception(reply)
        return reply
