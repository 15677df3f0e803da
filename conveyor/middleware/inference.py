"""Batched inference on a host: the collectors send their observations to one inference server node, which acts
for all of them in one forward pass (``conveyor train ... --collectors N --inference server``, docs/distributed.md).

- :class:`InferenceServer`, the server node's middleware: gathers the requests there are (one from every live
  collector, or what arrived within ``gather_s`` of the first), runs one ``forward`` of its collect view over the
  stacked observations (per distinct ``kwargs``, such as DQN's ``eps``) and sends each collector its rows.
- :class:`RemoteActing`, a collector's collect view: ``forward(obs)`` asks the server and waits for its rows
  (``request`` and ``result`` apart, for a collector that steps one env group while another's actions are made);
  the rest (``reset``, ``value``, ``scale_reward``, ``state_dict``) is the collector's own replica's, which follows
  the learner's versions as before, so a request names the version the collector acts on and the server answers
  on that version or a newer one (the rows' ``weight_version`` says which).

Messages: :data:`REQUEST_TOPIC` (collector -> server) ``{"seq", "version", "obs", "kwargs"}``; ``reply_topic(c)``
(server -> collector ``c``) ``{"seq", "out"}``. As every router message, a request is checked before use (its sender
a collector of the run, its observations laid out as the env's observation space says, at most ``max_rows`` rows,
at most :data:`PENDING_PER_COLLECTOR` waiting per collector); a bad one is dropped, counted and logged, and the
server goes on serving. Only feed-forward policies: the server keeps no per-env state.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from conveyor.data.batch import concat_nested, map_nested
from conveyor.engine import CLOSE_EVENT, FINISH_EVENT, declares, task
from conveyor.middleware.messages import BadMessage, Rejections, check_fields, layout
from conveyor.schema import ConfigError

__all__ = ["InferenceServer", "InferenceServerLost", "PENDING_PER_COLLECTOR", "REQUEST_TOPIC", "RemoteActing",
           "reply_topic"]

log = logging.getLogger("conveyor.middleware.inference")

REQUEST_TOPIC = "conveyor.inference.request"
"""A collector -> the inference server: ``{"seq": int, "version": int, "obs": [B, ...], "kwargs": {str: number}}``."""
PENDING_PER_COLLECTOR = 2
"""Requests of one collector the server holds at once (one per env group); more are dropped."""
_MAX_KWARGS = 8


def reply_topic(node: Any) -> str:
    """The topic collector ``node`` takes its replies on: ``{"seq": int, "out": {key: [B, ...]}}``."""
    return f"conveyor.inference.reply.{node}"


class InferenceServerLost(RuntimeError):
    """A collector's inference server left the run (or never joined) while the collector needed actions."""


def _batch_of(sample: Any) -> Any:
    """One observation of a space (``space.sample()``) as a batch of one, as an env manager stacks them."""
    if isinstance(sample, dict):
        return {key: _batch_of(value) for key, value in sample.items()}
    return np.asarray(sample)[None]


def _number(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) and not isinstance(value, np.ndarray)


class _Request:
    __slots__ = ("sender", "seq", "version", "obs", "kwargs", "rows")

    def __init__(self, sender: str, seq: int, version: int, obs: Any, kwargs: Dict[str, Any], rows: int) -> None:
        self.sender, self.seq, self.version, self.obs, self.kwargs, self.rows = sender, seq, version, obs, kwargs, rows


@declares()  # no context field: it answers other nodes' requests
class InferenceServer:
    """The inference server node's middleware: each call serves one gathered batch (or returns after ``wait_s``
    with none); when the run has ended it goes on serving until every collector has left (at most ``drain_s``).

    ``acting``: the server's collect view (``policy.collect_mode`` of a replica a ``ModelExchanger`` keeps on the
    learner's versions); ``loaded``: the version it acts on (``ModelExchanger.loaded_version``; None before the
    first), a request waits until it is at least the request's; ``obs_space``: the env's observation space, which
    every request's observations must match; ``collectors``: the node ids allowed to ask; ``max_rows``: the most
    observations one request may hold (a collector's envs); ``router``: default ``task.router``.

    Reads / writes ctx: nothing. ``stats()``: ``forwards``, ``served`` (requests answered), ``rejected``.
    """

    def __init__(self, acting: Any, loaded: Callable[[], Optional[int]], obs_space: Any, collectors: Iterable[Any],
                 max_rows: int, gather_s: float = 0.002, wait_s: float = 0.05, drain_s: float = 60.0,
                 router: Any = None) -> None:
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"InferenceServer(max_rows={max_rows!r}): must be an int >= 1")
        self._acting, self._loaded = acting, loaded
        self._reference = layout(_batch_of(obs_space.sample()), set())
        self._collectors = {str(node) for node in collectors}
        self._max_rows, self._gather_s, self._wait_s, self._drain_s = max_rows, gather_s, wait_s, drain_s
        self._router = task.router if router is None else router
        self._cond = threading.Condition()
        self._pending: List[_Request] = []
        self._left: set = set()
        self._checked = False
        self.forwards = self.served = 0
        self._rejections = Rejections(f"InferenceServer on node {self._router.node_id}", self._router)
        self._handler = self._rejections(self._take, REQUEST_TOPIC)
        self._router.on(REQUEST_TOPIC, self._handler)
        self._router.on_peer_lost(self._peer_lost)
        task.on(FINISH_EVENT, self._drain)
        task.on(CLOSE_EVENT, self.close)

    def __repr__(self) -> str:
        return f"InferenceServer(collectors={sorted(self._collectors)}, max_rows={self._max_rows})"

    def stats(self) -> Dict[str, int]:
        """``forwards`` run, requests ``served``, requests ``rejected`` as malformed."""
        return {"forwards": self.forwards, "served": self.served, "rejected": self._rejections.count}

    def close(self) -> None:
        """Stop taking requests (when the ``with task.start():`` block closes)."""
        self._router.off(REQUEST_TOPIC, self._handler)
        self._router.off_peer_lost(self._peer_lost)

    def _take(self, payload: Any) -> None:
        """A request (on the router's delivery thread): checked, then queued for the next gather."""
        sender = str(self._router.sender)
        if sender not in self._collectors:
            raise BadMessage(f"node {sender} is not a collector of this run")
        check_fields(payload, seq=int, version=int, obs=lambda v: True, kwargs=lambda v: isinstance(v, dict))
        kwargs = payload["kwargs"]
        if len(kwargs) > _MAX_KWARGS or not all(isinstance(k, str) and _number(v) for k, v in kwargs.items()):
            raise BadMessage(f"'kwargs' must map at most {_MAX_KWARGS} names to numbers")
        rows: set = set()
        if layout(payload["obs"], rows) != self._reference or len(rows) != 1:
            raise BadMessage("its observations are not a batch of the env's observation space (structure, dtypes, "
                             "shapes)")
        n, = rows
        if not 1 <= n <= self._max_rows:
            raise BadMessage(f"{n} observations; a collector of this run sends 1 to {self._max_rows}")
        with self._cond:
            if sum(r.sender == sender for r in self._pending) >= PENDING_PER_COLLECTOR:
                raise BadMessage(f"more than {PENDING_PER_COLLECTOR} requests waiting from one collector")
            self._pending.append(_Request(sender, payload["seq"], payload["version"], payload["obs"], kwargs, n))
            self._cond.notify_all()

    def _peer_lost(self, node: Any) -> None:
        with self._cond:
            self._left.add(str(node))
            self._pending = [r for r in self._pending if r.sender != str(node)]
            self._cond.notify_all()

    def _servable(self, draining: bool) -> List[_Request]:
        loaded = self._loaded()
        if draining:  # no newer version will come: the learners are gone
            return list(self._pending)
        return [] if loaded is None else [r for r in self._pending if r.version <= loaded]

    def serve(self, wait_s: float, draining: bool = False) -> int:
        """Wait up to ``wait_s`` for a request to serve, gather the others (one from every live collector, or
        ``gather_s``), act on them and reply; how many were served."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._servable(draining), wait_s):
                return 0
            live = len(self._collectors - self._left)
            first = time.monotonic()
            self._cond.wait_for(lambda: len({r.sender for r in self._servable(draining)}) >= live
                                or time.monotonic() - first >= self._gather_s, self._gather_s)
            batch = self._servable(draining)
            self._pending = [r for r in self._pending if r not in batch]
        groups: Dict[Tuple, List[_Request]] = {}
        for request in batch:
            groups.setdefault(tuple(sorted(request.kwargs.items())), []).append(request)
        for requests in groups.values():
            self._act(requests)
        return len(batch)

    def _act(self, requests: List[_Request]) -> None:
        out = self._acting.forward(concat_nested([r.obs for r in requests]), **requests[0].kwargs)
        self.forwards += 1
        if not self._checked:
            self._checked = True
            if self._acting.state_dict()["memory"]:
                raise ConfigError("--inference server: this policy keeps a state per env (a recurrent policy), which "
                                  "one server for every collector cannot hold; use --inference local")
        start = 0
        for request in requests:
            stop = start + request.rows
            self._reply(request, map_nested(lambda leaf: leaf[start:stop], out))
            start = stop
        self.served += len(requests)

    def _reply(self, request: _Request, rows: Any) -> None:
        """Send ``rows`` to the collector that asked. A collector announces its reply topic apart from its requests
        (membership messages skip the send queue), so its first request can come before the announcement: then
        wait for it, at most the router's peer timeout (within which a live peer's state arrives)."""
        topic, reply = reply_topic(request.sender), {"seq": request.seq, "out": rows}
        if self._router.publish(topic, reply) or request.sender in self._left:
            return
        try:
            self._router.wait_for_subscribers(topic, 1, self._router.peer_timeout_s)
        except TimeoutError:
            log.warning("InferenceServer: collector %s asked but never subscribed to its replies within the peer "
                        "timeout; its request %d is dropped", request.sender, request.seq)
            return
        self._router.publish(topic, reply)

    def __call__(self, ctx: Any) -> None:
        self.serve(self._wait_s)

    def _drain(self, error: Optional[BaseException]) -> None:
        """The run has ended (:data:`~conveyor.engine.FINISH_EVENT`, whenever the finish came): answer the collectors
        still collecting until they have left, at most ``drain_s``."""
        if error is not None:
            return
        deadline = time.monotonic() + self._drain_s
        while self._collectors - self._left and time.monotonic() < deadline:
            self.serve(min(self._wait_s, max(deadline - time.monotonic(), 0.0)), draining=True)


class RemoteActing:
    """A collector's collect view that acts through the inference server node ``server``: ``forward(obs,
    **kwargs)`` sends the observations and returns the server's rows (``action`` and what the policy's collect
    output holds, ``weight_version`` among them); anything else is ``local``'s (the collector's own collect view,
    which also names the version to act on). A reply waits at most ``timeout_s``; a lost server raises
    :class:`InferenceServerLost` naming it. ``router``: default ``task.router``."""

    def __init__(self, local: Any, server: Any, timeout_s: float = 60.0, router: Any = None) -> None:
        self._local, self._server, self._timeout_s = local, str(server), timeout_s
        self._router = task.router if router is None else router
        self._node = str(self._router.node_id)
        self._cond = threading.Condition()
        self._seq = 0
        self._asked: Dict[int, int] = {}  # seq -> rows, the requests not answered yet
        self._replies: Dict[int, Dict[str, Any]] = {}
        self._lost = False
        self._joined = False
        self._rejections = Rejections(f"RemoteActing on node {self._node}", self._router)
        self._topic = reply_topic(self._node)
        self._handler = self._rejections(self._reply, self._topic)
        self._router.on(self._topic, self._handler)
        self._router.on_peer_lost(self._peer_lost)
        task.on(CLOSE_EVENT, self.close)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)

    def __repr__(self) -> str:
        return f"<collect view acting through the inference server, node {self._server}>"

    def stats(self) -> Dict[str, int]:
        """``rejected``: replies dropped as not the server's answer to a request waiting here."""
        return {"rejected": self._rejections.count}

    def close(self) -> None:
        """Stop taking replies (when the ``with task.start():`` block closes)."""
        self._router.off(self._topic, self._handler)
        self._router.off_peer_lost(self._peer_lost)

    def reset(self, env_ids: Optional[List[int]] = None) -> None:
        """The local view's reset (a feed-forward policy keeps no per-env state)."""
        self._local.reset(env_ids)

    def forward(self, obs: Any, **kwargs: Any) -> Dict[str, Any]:
        """The server's output for ``obs`` (as ``collect_mode.forward``)."""
        return self.result(self.request(obs, **kwargs))

    def request(self, obs: Any, **kwargs: Any) -> int:
        """Send ``obs`` to the server; the ticket :meth:`result` takes."""
        if not self._joined:
            try:
                self._router.wait_for_subscribers(REQUEST_TOPIC, 1, self._timeout_s)
            except TimeoutError:
                raise self._gone(f"no inference server (node {self._server}) took requests within "
                                 f"{self._timeout_s}s") from None
            self._joined = True
        rows: set = set()
        layout(obs, rows)
        with self._cond:
            self._seq += 1
            seq = self._seq
            self._asked[seq] = rows.pop()
        message = {"seq": seq, "version": int(self._local.version), "obs": obs,
                   "kwargs": {k: (float(v) if isinstance(v, np.floating) else v) for k, v in kwargs.items()}}
        if self._lost or not self._router.publish(REQUEST_TOPIC, message):
            raise self._gone(f"the inference server (node {self._server}) has left the run")
        return seq

    def result(self, seq: int) -> Dict[str, Any]:
        """Wait for the server's rows for the request ``seq``."""
        with self._cond:
            if not self._cond.wait_for(lambda: seq in self._replies or self._lost, self._timeout_s):
                raise self._gone(f"the inference server (node {self._server}) sent no actions within "
                                 f"{self._timeout_s}s")
            if seq not in self._replies:
                raise self._gone(f"the inference server (node {self._server}) was lost")
            self._asked.pop(seq)
            return self._replies.pop(seq)

    def _reply(self, payload: Any) -> None:
        sender = str(self._router.sender)
        if sender != self._server:
            raise BadMessage(f"node {sender} is not this run's inference server (node {self._server})")
        check_fields(payload, seq=int, out=lambda v: isinstance(v, dict) and "action" in v)
        rows: set = set()
        layout(payload["out"], rows)
        with self._cond:
            if self._asked.get(payload["seq"]) is None or payload["seq"] in self._replies:
                raise BadMessage(f"a reply to request {payload['seq']}, which is not waiting")
            if rows != {self._asked[payload["seq"]]}:
                raise BadMessage(f"rows {sorted(rows)} for a request of {self._asked[payload['seq']]}")
            self._replies[payload["seq"]] = payload["out"]
            self._cond.notify_all()

    def _peer_lost(self, node: Any) -> None:
        if str(node) == self._server:
            with self._cond:
                self._lost = True
                self._cond.notify_all()

    def _gone(self, what: str) -> InferenceServerLost:
        return InferenceServerLost(f"node {self._node}: {what}; a collector with --inference server cannot act "
                                   f"without it (is it running? else train with --inference local)")
