"""Exchangers: what learner, collector and evaluator processes send each other in a multi-process run.

Both run where ``task.router`` is an active router (a :class:`~conveyor.engine.Parallel` worker) and do
nothing otherwise, so a single-process ``main()`` may keep them in its chain. Which side a process plays
comes from its roles (:meth:`conveyor.engine.Task.add_role`): a process with ``task.role.LEARNER`` is a
learner; any other is a collector or an evaluator. In a multi-process run the roles must have been added
before an exchanger is made.

Messages go by topic to the processes that subscribed to them only (collected data to learners, never to
evaluators or other collectors) through the router's codec: numpy arrays, torch tensors and treetensor
trees travel as raw bytes, nothing is unpickled. Every wait is bounded by ``timeout_s`` and ends in a
``TimeoutError`` that names what was awaited and the live peers.

Place them first in the chain, ``ModelExchanger`` before ``ContextExchanger``: on a collector the weights
are loaded, then the learner's ``train_iter`` read, before collecting; on the learner ``train_iter`` is
sent, then the new weights, after training (so a collector that has a version also knows its iteration).

Faults (membership comes from the router: a peer that dies, disconnects or closes is lost at once, see
:data:`conveyor.engine.PEER_LOST_EVENT`; no wait runs into its timeout for a peer known to be gone):

- A learner trains on whatever its live collectors send. It knows a collector by its subscription to
  :data:`COLLECTOR_TOPIC` (before its first batch) or its batches. When the last one it knows is lost,
  it logs a warning and waits ``grace_s`` for one to (re)join (``Parallel.runner(auto_recover=True)``
  restarts a killed one); if none sends, it ends the run normally (``task.finish``), so a ``CkptSaver``
  writes its final checkpoint.
- A collector or an evaluator whose learners are all gone (finished or dead) ends its run normally at once;
  with ``rejoin_s`` > 0, whose learner was lost (not finished) waits that long for one to come back first.
- :data:`conveyor.engine.STOP_EVENT` (SIGTERM to a worker) ends every wait at once; the run then ends
  normally with ``task.finish``.
- Both unsubscribe from their topics when the ``with task.start():`` block that made them closes.
- A message that is not what its topic carries (a peer with the secret sent a wrong type, a missing key,
  a negative count, arrays of another layout than the first accepted batch or than this node's weights) is
  dropped on receipt, counted in ``stats()["rejected"]`` and logged at most once a minute per topic: it
  never reaches the pipeline, and never ends the run.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Set

from conveyor.engine import CLOSE_EVENT, PEER_LOST_EVENT, STOP_EVENT, OnlineRLContext, declares, task
from conveyor.engine.parallel import codec
from conveyor.middleware.messages import BadMessage, Rejections, check_fields, layout
from conveyor.policy.normaliser import FrozenNormaliser

__all__ = ["BadMessage", "ContextExchanger", "ModelExchanger", "Rejections", "COLLECTOR_TOPIC", "DATA_TOPIC",
           "TRAIN_ITER_TOPIC", "MODEL_TOPIC", "MODEL_REQUEST_TOPIC", "check_fields", "layout"]

log = logging.getLogger(__name__)

DATA_TOPIC = "conveyor.exchange.data"
"""Collectors -> learners: ``{"node", "trajectories", "episodes", "train_data", "env_step", "env_episode"}``
(increments)."""
TRAIN_ITER_TOPIC = "conveyor.exchange.train_iter"
"""Learners -> collectors and evaluators: ``{"train_iter": int}``."""
MODEL_TOPIC = "conveyor.exchange.model"
"""Learner -> the others: ``policy.acting_state()`` (``version``, ``tensors``, ``extras``)."""
MODEL_REQUEST_TOPIC = "conveyor.exchange.model_request"
"""A receiver -> learners: ``{"node": id}``, asking for the newest version (a late joiner's first one)."""
COLLECTOR_TOPIC = "conveyor.exchange.collector"
"""Subscribed to by collectors, so that learners know them before their first batch; nothing is sent on it."""

# A version's extras travel with its weights: PPO's are its frozen observation statistics (tensors or trees
# of them; they arrive on the CPU).
codec.register(FrozenNormaliser, "conveyor.FrozenNormaliser",
               lambda n: {"mean": n.mean, "inv_std": n.inv_std, "clip": n.clip}, lambda d: FrozenNormaliser(**d))

_RETRY_S = 0.25  # a receiver waiting for weights repeats its request this often (a request can pass its subscription)


def _seconds(where: str, name: str, value: Any, zero_ok: bool = False) -> float:
    """``value`` as a float number of seconds (> 0, or >= 0 with ``zero_ok``); else a ValueError naming it."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value >= 0 if zero_ok else value > 0):
        raise ValueError(f"{where}({name}={value!r}): must be a number of seconds {'>= 0' if zero_ok else '> 0'}")
    return float(value)


def _active_router() -> Any:
    router = task.router
    if router is None or not getattr(router, "is_active", True):
        return None
    return router


class _Exchanger:
    """What both exchangers share: the side this process plays, its router subscription, the stop and
    lost-peer wake-ups, and unsubscribing when the ``task.start`` block closes."""

    def __init__(self, name: str, learner_topic: str, learner_fn: Callable[[Any], Any], other_topic: str,
                 other_fn: Callable[[Any], Any]) -> None:
        self._router = _active_router()
        self._cond = threading.Condition()
        self._stopping = False
        self._learner = self._collector = False
        self._subscribed: List[tuple] = []  # (topic, handler)
        self._rejections = Rejections(f"{name} on node {getattr(self._router, 'node_id', '-')}")
        if self._router is None:
            return
        if not task.roles:
            raise RuntimeError(f"{name} in a multi-process run needs this process's role: call "
                               f"task.add_role(task.role.LEARNER) (or COLLECTOR / EVALUATOR) before making it")
        self._learner = task.has_role(task.role.LEARNER)
        if self._learner and task.has_role(task.role.COLLECTOR):
            raise RuntimeError(f"{name}: this process has both the LEARNER and the COLLECTOR role; in a multi-process "
                               f"run a learner takes its data from collector processes (its own collector would "
                               f"overwrite what they sent): give collecting to other workers, or run one process")
        self._collector = not self._learner and task.has_role(task.role.COLLECTOR)
        topic, fn = (learner_topic, learner_fn) if self._learner else (other_topic, other_fn)
        self._subscribe(topic, self._rejections(fn, topic))
        task.on(STOP_EVENT, self._stop)
        task.on(PEER_LOST_EVENT, self._peer_lost)
        task.on(CLOSE_EVENT, self.close)

    def stats(self) -> Dict[str, int]:
        """``rejected``: messages dropped on receipt as not what their topic carries (see the module docstring)."""
        return {"rejected": self._rejections.count}

    def close(self) -> None:
        """Unsubscribe from the router (called when the ``with task.start():`` block closes)."""
        for topic, fn in self._subscribed:
            self._router.off(topic, fn)
        self._subscribed = []

    def _subscribe(self, topic: str, fn: Callable[[Any], Any]) -> None:
        self._router.on(topic, fn)
        self._subscribed.append((topic, fn))

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _peer_lost(self, node: Any) -> None:
        finished = str(node) in self._router.peers()  # its main returned (a goodbye), else the router lost it
        with self._cond:
            self._forget(str(node), finished)
            self._cond.notify_all()

    def _forget(self, node: str, finished: bool) -> None:
        """A peer has left: ``finished`` (said goodbye), or lost (called holding ``_cond``)."""

    def _wait(self, ready: Callable[[], bool], timeout_s: float, poke: Optional[Callable[[], None]] = None) -> Optional[bool]:
        """Wait (holding ``_cond``) until ``ready()``: True; until asked to stop: False; ``timeout_s`` over:
        None. ``poke()`` runs every ``_RETRY_S`` while waiting."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self._stopping:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if poke is not None:
                self._cond.release()
                try:
                    poke()
                finally:
                    self._cond.acquire()
            self._cond.wait(min(left, _RETRY_S) if poke is not None else left)
        return True

    def _timeout(self, what: str, sender: str, timeout_s: float) -> TimeoutError:
        return TimeoutError(f"node {self._router.node_id}: no {what} within {timeout_s}s (live peers: "
                            f"{self._router.peers()}); is a {sender} running, with this exchanger in its chain? "
                            f"Raise timeout_s if it is just slow")

    def _end_run(self, level: int, why: str) -> None:
        """End the run normally after this iteration, entering no further middleware in it."""
        log.log(level, "node %s: %s", self._router.node_id, why)
        task.finish = True
        task.end_iteration()


def _any(value: Any) -> bool:
    return True


def _ignore(payload: Any) -> None:
    pass


def _merge_trajectories(batches: List[Any]) -> Any:
    if len(batches) <= 1:
        return batches[0] if batches else None
    import treetensor.torch as ttorch
    try:
        return ttorch.cat(batches, dim=0)
    except Exception as e:
        raise ValueError(f"ContextExchanger: trajectories from several collectors do not concatenate along their "
                         f"first dim ({type(e).__name__}: {e}); give every collector the same env count") from None


@declares(reads=("train_iter", "env_step", "env_episode"),
          writes=("train_iter", "trajectories", "episodes", "train_data", "env_step", "env_episode"),
          backward_reads=("trajectories", "episodes", "train_data", "env_step", "env_episode", "train_iter"),
          optional=("trajectories", "episodes", "train_data"))  # both sides: see the docstring
class ContextExchanger(_Exchanger):
    """Collectors send what they collected to learners; learners send ``train_iter`` back.

    Reads ctx (collector, after the collector ran): ``trajectories``, ``episodes``, ``train_data`` (what an
    advantage estimator made of them), ``env_step``, ``env_episode``. Writes ctx (collector, before):
    ``train_iter`` (the newest a learner sent). Writes ctx (learner, before): ``trajectories`` and
    ``train_data`` (received ones concatenated on their first dim), ``episodes`` (lists joined), ``env_step`` / ``env_episode`` (+ the collectors' increments).
    Reads ctx (learner, after): ``train_iter``.

    A learner waits at most ``timeout_s`` for the first batch of an iteration; once every collector it
    knows (subscribed to :data:`COLLECTOR_TOPIC`, or sent a batch) is lost it waits ``grace_s`` for one to
    (re)join, then ends the run normally. A collector
    waits at most ``timeout_s`` for a learner to subscribe before its first send, and ends its run when
    the learners it sent to are gone, after waiting ``rejoin_s`` (default 0) for one to (re)subscribe
    unless its run was told to stop (a learner restarted by ``auto_recover`` then gets the batch).
    """

    def __init__(self, timeout_s: float = 60.0, grace_s: float = 10.0, rejoin_s: float = 0.0) -> None:
        self.timeout_s = _seconds("ContextExchanger", "timeout_s", timeout_s)
        self.grace_s = _seconds("ContextExchanger", "grace_s", grace_s)
        self.rejoin_s = _seconds("ContextExchanger", "rejoin_s", rejoin_s, zero_ok=True)
        self._inbox: List[Dict[str, Any]] = []
        self._train_iter: Optional[int] = None
        self._collectors: Set[str] = set()  # learner: the live collectors that have sent data
        self._left: Dict[str, bool] = {}  # learner: collectors gone since it last had none, by id: finished?
        self._gone: Set[str] = set()  # learner: nodes gone (one speaks again only as a restarted, live peer)
        self._finished: Set[str] = set()  # learner: nodes that finished (gone for good)
        self._layouts: Dict[str, Any] = {}  # learner: the layout of the first batch accepted, by field
        self._had_learner = False  # collector: a send reached a learner
        super().__init__("ContextExchanger", DATA_TOPIC, self._got_data, TRAIN_ITER_TOPIC, self._got_train_iter)
        if self._collector:
            self._subscribe(COLLECTOR_TOPIC, _ignore)

    def __repr__(self) -> str:
        side = "learner" if self._learner else "collector" if self._collector else "inactive" if not self._router \
            else "evaluator"
        return f"ContextExchanger({side}, timeout_s={self.timeout_s}, grace_s={self.grace_s})"

    def _got_data(self, payload: Any) -> None:
        check_fields(payload, node=lambda v: isinstance(v, str), env_step=int, env_episode=int,
                     episodes=lambda v: v is None or isinstance(v, list), trajectories=_any, train_data=_any)
        layouts = [(name, self._batch_layout(name, value)) for name, value in (
            ("trajectories", payload["trajectories"]), ("train_data", payload["train_data"]),
            *(("episodes", ep) for ep in payload["episodes"] or ())) if value is not None]
        node = payload["node"]
        live = node not in self._gone or node in self._router.peers()  # not a late message of a lost one
        with self._cond:
            first = {**dict(reversed(layouts)), **self._layouts}  # the accepted ones, else this message's first
            for name, found in layouts:
                if first[name] != found:
                    raise BadMessage(f"its {name} are laid out otherwise than the first batch's (keys, dtypes, "
                                     f"shapes after the first dim)")
            self._layouts = first
            self._inbox.append(payload)
            if live:
                self._collectors.add(node)
                self._gone.discard(node)
            self._cond.notify_all()

    @staticmethod
    def _batch_layout(name: str, value: Any) -> Any:
        rows: Set[int] = set()
        found = layout(value, rows)
        if len(rows) > 1:
            raise BadMessage(f"its {name} hold arrays of different lengths ({sorted(rows)})")
        return found

    def _got_train_iter(self, payload: Any) -> None:
        check_fields(payload, train_iter=int)
        with self._cond:
            self._train_iter = max(self._train_iter or 0, int(payload["train_iter"]))

    def _note_collectors(self) -> None:
        """Learner: count the collectors subscribed to :data:`COLLECTOR_TOPIC` as live (a lost one is listed
        again only once restarted; one that finished, never)."""
        found = self._router.subscribers(COLLECTOR_TOPIC)
        with self._cond:
            self._collectors.update(node for node in found if node not in self._finished)

    def _forget(self, node: str, finished: bool) -> None:
        self._gone.add(node)
        if finished:
            self._finished.add(node)
        if node in self._collectors:
            self._collectors.discard(node)
            self._left[node] = finished

    def __call__(self, ctx: OnlineRLContext) -> Iterator[None]:
        if self._router is None:
            yield
        elif self._learner:
            self._receive(ctx)
            yield
            self._router.publish(TRAIN_ITER_TOPIC, {"train_iter": int(ctx.train_iter)})
        else:
            with self._cond:
                if self._train_iter is not None and self._train_iter > ctx.train_iter:
                    ctx.train_iter = self._train_iter
            env_step, env_episode = ctx.env_step, ctx.env_episode
            yield
            if self._collector and (ctx.trajectories is not None or ctx.episodes is not None
                                    or ctx.train_data is not None):
                self._send({"node": str(self._router.node_id), "trajectories": ctx.trajectories,
                            "episodes": ctx.episodes, "train_data": ctx.train_data,
                            "env_step": int(ctx.env_step - env_step),
                            "env_episode": int(ctx.env_episode - env_episode)})

    def _receive(self, ctx: OnlineRLContext) -> None:
        with self._cond:
            lost: List[str] = []
            got = self._wait(lambda: bool(self._inbox) or bool(self._left and not self._collectors), self.timeout_s,
                             self._note_collectors)
            if got is None:
                raise self._timeout(f"collected data on {DATA_TOPIC!r}", "collector", self.timeout_s)
            if got and not self._inbox:
                lost = [node for node, finished in self._left.items() if not finished]
                done = [node for node, finished in self._left.items() if finished]
                log.log(logging.WARNING if lost else logging.INFO,
                        "node %s: no collector left (%s); the learner stops in %ss unless one joins",
                        self._router.node_id, "; ".join(f"{what}: {', '.join(nodes)}" for what, nodes in
                                                        (("lost", lost), ("finished", done)) if nodes), self.grace_s)
                self._left = {}
                got = self._wait(lambda: bool(self._inbox), self.grace_s)
            if not got:
                return self._end_run(logging.INFO if self._stopping or not lost else logging.WARNING,
                                     "asked to stop" if self._stopping else
                                     f"no collector joined within grace_s={self.grace_s}s; the learner stops")
            got, self._inbox = self._inbox, []  # a loss stays noted until the wait above has seen it
        ctx.env_step += sum(p["env_step"] for p in got)
        ctx.env_episode += sum(p["env_episode"] for p in got)
        ctx.trajectories = _merge_trajectories([p["trajectories"] for p in got if p["trajectories"] is not None])
        ctx.train_data = _merge_trajectories([p["train_data"] for p in got if p.get("train_data") is not None])
        episodes = [ep for p in got if p["episodes"] is not None for ep in p["episodes"]]
        ctx.episodes = episodes or None

    def _send(self, payload: Dict[str, Any]) -> None:
        if self._router.publish(DATA_TOPIC, payload) > 0:
            self._had_learner = True
            return
        if self._had_learner:  # every learner it sent to has left: unsubscribed (finished), or lost
            if self._rejoined() and self._router.publish(DATA_TOPIC, payload) > 0:
                return
            log.info("node %s: no learner left to send collected data to; the collector stops",
                     self._router.node_id)
            task.finish = True
            return
        self._router.wait_for_subscribers(DATA_TOPIC, 1, timeout=self.timeout_s)  # no learner has subscribed yet
        if self._router.publish(DATA_TOPIC, payload) == 0:
            raise RuntimeError(f"ContextExchanger: node {self._router.node_id} found no learner to send its data "
                               f"to (live peers: {self._router.peers()})")
        self._had_learner = True


    def _rejoined(self) -> bool:
        """Whether a learner (re)subscribed within ``rejoin_s``; none is awaited once the run is told to stop."""
        if not self.rejoin_s or task.finish or self._stopping:
            return False
        try:
            self._router.wait_for_subscribers(DATA_TOPIC, 1, timeout=self.rejoin_s)
        except TimeoutError:
            return False
        return True


@declares()  # no context field: it reads and writes the policy's weights
class ModelExchanger(_Exchanger):
    """The learner sends its newest weights; collectors and evaluators act on the newest they received.

    ``model_or_policy``: a policy (``version``, ``acting_state()``, ``load_acting_state()``, as
    :class:`conveyor.policy.Policy`) or a bare ``torch.nn.Module`` (then the learner numbers a new version
    after each of its iterations).

    Learner: after each iteration (after the trainer published), sends ``acting_state()`` when its
    version is newer than the last sent; it answers a request (a late joiner's) at once, from the router's
    receive thread, with the last version it sent (the current one before the first). Receiver: before each iteration, loads the newest version received
    (``load_acting_state``, under the learner's number, so collected rows record it). The first iteration
    waits for a version (asking for one). ``max_staleness`` (collectors only): one version serves at most
    ``max_staleness + 1`` collect iterations, so no batch is collected on weights more than
    ``max_staleness`` versions older than what the learner has made of the earlier ones; the next waits for
    a newer version (``0``: every batch on fresh weights, on-policy). ``None``: never waits after the
    first. Every wait is bounded by ``timeout_s``. A receiver whose learners are all gone (finished or
    lost) ends its run normally at once, at the start of an iteration or in a wait; with ``rejoin_s`` > 0,
    when the last one was lost (not finished) it first waits that long for a learner to (re)join (one
    restarted by ``auto_recover``) and goes on with that learner's first version, whatever its number.

    Reads / writes ctx: nothing; it reads and writes the policy's weights.
    """

    def __init__(self, model_or_policy: Any, max_staleness: Optional[int] = None, timeout_s: float = 60.0,
                 rejoin_s: float = 0.0) -> None:
        if all(callable(getattr(model_or_policy, m, None)) for m in ("acting_state", "load_acting_state")):
            self.policy = model_or_policy
            self._bare = False
        elif callable(getattr(model_or_policy, "parameters", None)) and callable(getattr(model_or_policy, "buffers", None)):
            from conveyor.policy.weights import ModuleVersions  # given a module, torch is loaded already
            self.policy, self._bare = ModuleVersions(model_or_policy), True
        else:
            raise TypeError(f"ModelExchanger({model_or_policy!r}): needs a policy with acting_state() and "
                            f"load_acting_state(), or a torch.nn.Module")
        if max_staleness is not None and (not isinstance(max_staleness, int) or isinstance(max_staleness, bool)
                                          or max_staleness < 0):
            raise ValueError(f"ModelExchanger(max_staleness={max_staleness!r}): must be an int >= 0, or None")
        self.max_staleness, self.timeout_s = max_staleness, _seconds("ModelExchanger", "timeout_s", timeout_s)
        self.rejoin_s = _seconds("ModelExchanger", "rejoin_s", rejoin_s, zero_ok=True)
        self._learners: Set[str] = set()  # receiver: the live learners seen subscribed to requests
        self._left: Set[str] = set()  # receiver: peers that finished (never counted as learners again)
        self._learners_gone = False  # receiver: every learner seen has left
        self._rejoin_due = False  # receiver: every learner left, the last one lost: wait for one to rejoin
        self._newest: Optional[Dict[str, Any]] = None  # receiver: the newest version received, not yet loaded
        self._heard = -1  # receiver: the newest version number heard of
        self._loaded: Optional[int] = None
        self._uses = 0
        self._sent = -1
        self._last: Optional[Dict[str, Any]] = None  # learner: the last version sent
        self._layout: Any = None  # receiver: the layout of its policy's acting state
        self._send_lock = threading.Lock()
        super().__init__("ModelExchanger", MODEL_REQUEST_TOPIC, self._answer, MODEL_TOPIC, self._got_model)

    def __repr__(self) -> str:
        side = "inactive" if self._router is None else "learner" if self._learner else "receiver"
        return f"ModelExchanger({side}, max_staleness={self.max_staleness}, timeout_s={self.timeout_s})"

    @property
    def loaded_version(self) -> Optional[int]:
        """Receiver: the version number acted on now (None before the first)."""
        return self._loaded

    # --- learner -------------------------------------------------------------------------------------
    def _send(self) -> None:
        """After an iteration: send the newest version if it is new (train_iter went out just before)."""
        with self._send_lock:
            state = self.policy.acting_state()
            if state["version"] > self._sent:
                self._router.publish(MODEL_TOPIC, state)
                self._sent, self._last = state["version"], state

    def _answer(self, payload: Any) -> None:
        """A request (on the receive thread): re-send the last version the loop sent, not one a trainer may have
        published mid-iteration, so a version never arrives before the ``train_iter`` that goes with it."""
        with self._send_lock:
            if self._last is None:
                self._last = self.policy.acting_state()
                self._sent = self._last["version"]
            self._router.publish(MODEL_TOPIC, self._last)

    # --- receiver ------------------------------------------------------------------------------------
    def _got_model(self, state: Any) -> None:
        check_fields(state, version=int, tensors=lambda v: isinstance(v, list), extras=_any)
        if self._layout is None:  # this node's own weights: what every version must look like
            own = self.policy.acting_state()
            self._layout = layout(own["tensors"]), type(own["extras"])
        if (layout(state["tensors"]), type(state["extras"])) != self._layout:
            raise BadMessage("its tensors are not laid out as this node's policy's (count, dtypes, shapes), or its "
                             "extras are of another type")
        version = state["version"]
        with self._cond:
            if version > self._heard:
                self._heard, self._newest = version, state
                self._cond.notify_all()

    def _request(self) -> None:
        self._router.publish(MODEL_REQUEST_TOPIC, {"node": str(self._router.node_id)})
        self._note_learners()

    def _note_learners(self) -> None:
        found = self._router.subscribers(MODEL_REQUEST_TOPIC)  # a learner that finished may still be listed
        with self._cond:
            new = {node for node in found if node not in self._left and node not in self._learners}
            if new:  # a lost learner is not listed: one found again has been restarted
                self._learners.update(new)
                self._learners_gone = False

    def _forget(self, node: str, finished: bool) -> None:
        if finished:
            self._left.add(node)
        if node in self._learners:
            self._learners.discard(node)
            self._learners_gone = not self._learners
            self._rejoin_due = self._learners_gone and not finished and self.rejoin_s > 0

    def _await_version(self, newer_than: int, what: str) -> bool:
        """Wait for a version newer than ``newer_than`` (or the first of a learner that rejoins); False if asked
        to stop or every learner is gone."""
        with self._cond:
            got = self._wait(lambda: self._heard > newer_than or self._learners_gone or self._rejoin_due or task.finish,
                             self.timeout_s, self._request)  # a run told to finish stops waiting for weights
            if got is None:
                raise self._timeout(what, "learner", self.timeout_s)
            if got and self._heard > newer_than and not self._rejoin_due:
                return True
        return bool(got) and self._rejoin_due and self._rejoin()

    def _rejoin(self) -> bool:
        """Every learner is gone, the last one lost (not finished): wait ``rejoin_s`` for one to (re)join and load
        its first version (a restarted learner goes on from its checkpoint: its numbers start afresh); whether
        one did."""
        self._rejoin_due = False
        if self._stopping or task.finish:
            return False
        log.warning("node %s: every learner is lost; waiting up to %ss for one to rejoin", self._router.node_id,
                    self.rejoin_s)
        with self._cond:
            self._heard, self._newest, self._loaded = -1, None, None
            got = self._wait(lambda: self._heard >= 0 or task.finish, self.rejoin_s, self._request)
        if not (got and self._heard >= 0):
            log.warning("node %s: no learner rejoined within rejoin_s=%ss", self._router.node_id, self.rejoin_s)
            return False
        log.info("node %s: a learner rejoined with version %s", self._router.node_id, self._heard)
        self._learners_gone = False  # it answered; the next _note_learners lists it
        self._note_learners()
        self._load_newest()
        return True

    def _receive(self) -> bool:
        """Load the newest version, waiting as the first version and ``max_staleness`` require; False: stop."""
        if self._stopping or (self._rejoin_due and not self._rejoin()) or self._learners_gone:
            return False
        if self._loaded is None and not self._await_version(-1, f"weights on {MODEL_TOPIC!r} (the first version)"):
            return False
        self._load_newest()
        if self._collector and self.max_staleness is not None and self._uses > self.max_staleness:
            if not self._await_version(self._loaded, f"weights newer than version {self._loaded} (max_staleness="
                                                     f"{self.max_staleness} and it served {self._uses} batches)"):
                return False
            self._load_newest()
        return True

    def _load_newest(self) -> None:
        with self._cond:
            state, self._newest = self._newest, None
        if state is not None and (self._loaded is None or int(state["version"]) > self._loaded):
            self.policy.load_acting_state(state)
            self._loaded, self._uses = int(state["version"]), 0

    def __call__(self, ctx: Any) -> Iterator[None]:
        if self._router is None:
            yield
        elif self._learner:
            yield
            if self._bare:
                self.policy.publish()
            self._send()
        else:
            self._note_learners()
            if not self._receive():
                self._end_run(logging.INFO, "asked to stop" if self._stopping else
                              "every learner is gone (finished or lost); this node stops")
            else:
                self._uses += 1
            yield
