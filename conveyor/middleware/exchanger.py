"""Exchangers: what learner, collector and evaluator processes send each other in a multi-process run.

Both run where ``task.router`` is an active router (a :class:`~conveyor.engine.Parallel` worker) and do nothing
otherwise, so a single-process ``main()`` may keep them in its chain. Which side a process plays comes from its roles
(:meth:`conveyor.engine.Task.add_role`): a process with ``task.role.LEARNER`` is a learner; any other is a collector
or an evaluator. In a multi-process run the roles must have been added before an exchanger is made.

Messages go by topic to the processes that subscribed to them only (collected data to learners, never to evaluators
or other collectors) through the router's codec: numpy arrays, torch tensors and treetensor trees travel as raw
bytes, nothing is unpickled; between a collector and a learner on one host, a batch's large arrays go through shared
memory (:mod:`conveyor.middleware.shared_batches`). Every wait is bounded by ``timeout_s`` and ends in a
``TimeoutError`` that names what was awaited and the live peers (an :class:`ExchangeTimeout`: raised at an
iteration's start, so a learner's ``CkptSaver`` still writes the final checkpoint before the run ends in it).

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
  dropped on receipt, counted in ``stats()["rejected"]`` and logged at most once a minute per topic with its
  sender: it never reaches the pipeline, and never ends the run. So is a batch whose ``node`` is not its
  authenticated sender (``router.sender``), from a node not among the learner's ``collectors``, or (given the
  env's ``spaces``) with values no env could have produced (:class:`~conveyor.middleware.batch_check.SpaceCheck`:
  an action outside the action space, NaN or infinite numbers...), and a version of the weights from a node
  that is not a learner (:class:`ModelExchanger`).
- A collector's ``env_step`` is credited up to the transitions it sent: over its batches, the learner credits
  it with the smaller of the env steps it claimed and the transitions it sent (an n-step enhancer's carried
  rows are credited once they arrive); claims ahead of the transitions by more than :data:`CREDIT_SLACK` of
  its largest batches (an honest collector's lag: rows an n-step enhancer holds back, episodes still running)
  are counted in ``stats()["credit_capped"]`` and logged at most once a minute.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set

from conveyor.engine import OnlineRLContext, declares, task
from conveyor.middleware.exchange_base import (COLLECTOR_TOPIC, DATA_TOPIC, MODEL_REQUEST_TOPIC, MODEL_TOPIC,
                                               TRAIN_ITER_TOPIC, ExchangeTimeout, Exchanger, anything, seconds)
from conveyor.middleware.batch_check import (SpaceCheck, count_transitions, end_indices, held_transitions,
                                             merge_batches, merge_end_idx)
from conveyor.middleware.ledger import TakeLedger
from conveyor.middleware.messages import BadMessage, Rejections, check_fields, layout
from conveyor.middleware.model_exchanger import ModelExchanger
from conveyor.middleware.shared_batches import SharedBatches

__all__ = ["BadMessage", "ContextExchanger", "ExchangeTimeout", "ModelExchanger", "Rejections", "COLLECTOR_TOPIC",
           "DATA_TOPIC", "TRAIN_ITER_TOPIC", "MODEL_TOPIC", "MODEL_REQUEST_TOPIC", "check_fields", "layout", "shard_topics"]

log = logging.getLogger(__name__)

CREDIT_SLACK = 16
"""How many of its largest batches a collector's claimed env steps may run ahead of the transitions it sent before the
learner counts and logs the claim (it is credited with the transitions either way)."""


def shard_topics(shard: int) -> tuple:
    """The data and collector topics of learner rank ``shard``: :data:`DATA_TOPIC` and :data:`COLLECTOR_TOPIC` for
    rank 0 (every single-learner run), suffixed with the rank for the others."""
    return (DATA_TOPIC, COLLECTOR_TOPIC) if shard == 0 else (f"{DATA_TOPIC}.{shard}", f"{COLLECTOR_TOPIC}.{shard}")


def _ignore(payload: Any) -> None:
    """Nothing is sent on :data:`COLLECTOR_TOPIC`."""


def _empty_list(value: Any) -> bool:
    return isinstance(value, list) and not value


@declares(reads=("train_iter", "env_step", "env_episode", "total_step"),
          writes=("train_iter", "trajectories", "trajectory_end_idx", "episodes", "train_data", "env_step",
                  "env_episode"),
          backward_reads=("trajectories", "trajectory_end_idx", "episodes", "train_data", "env_step", "env_episode",
                          "train_iter"),
          optional=("trajectories", "trajectory_end_idx", "episodes", "train_data", "total_step"))  # see the docstring
class ContextExchanger(Exchanger):
    """Collectors send what they collected to learners; learners send ``train_iter`` back.

    Reads ctx (collector, after the collector ran): ``trajectories``, ``trajectory_end_idx`` (sent with them when
    the collector set it), ``episodes``, ``train_data`` (what an advantage estimator made of them), ``env_step``,
    ``env_episode``. Reads ctx (collector or evaluator, before): ``total_step`` (with ``skip_n_iter``). Writes
    ctx (collector or evaluator, before): ``train_iter`` (the newest a learner sent). Writes ctx (learner,
    before): ``trajectories`` and ``train_data`` (received ones concatenated on their first dim; a recurrent
    policy's sequences ``[L, B]`` side by side, on their second: :func:`conveyor.data.batch.sample_dim`),
    ``trajectory_end_idx`` (each collector's indices shifted past the transitions before its own, so they index
    the merged trajectories; None unless every batch came with indices that fit it: a later middleware, such as
    an n-step enhancer, may have reshaped the trajectories after the collector), ``episodes`` (lists joined),
    ``env_step`` / ``env_episode`` (+ the collectors' increments). Reads ctx (learner, after): ``train_iter``.

    ``skip_n_iter`` (DI-engine's argument): after its first ``skip_n_iter`` iterations (once ``ctx.total_step >=
    skip_n_iter``), a collector or evaluator waits at the start of each iteration, at most ``timeout_s``, for
    a ``train_iter`` the learner sent since its last iteration, so it runs in step with the learner (DI-engine's
    default, 1: a collector waits from its second iteration on, and a learner gets one batch per iteration).
    ``None`` (the default here): it never waits and acts on the newest ``train_iter`` it has. Unlike DI-engine,
    where the wait ends in a warning after 60 s, it ends in a ``TimeoutError``, as every wait here does; it ends
    the run normally once every learner is gone.

    DI-engine's collectors' forms are taken as they are: ``trajectories`` and each episode as a list whose items
    are the transitions (the items share one layout; a learner joins the lists), ``trajectory_end_idx`` as a
    list of ints (a learner gets a list of ints again when the trajectories are lists, else an int array).

    A learner waits at most ``timeout_s`` for the first batch of an iteration; once every collector it
    knows (subscribed to :data:`COLLECTOR_TOPIC`, or sent a batch) is lost it waits ``grace_s`` for one to
    (re)join, then ends the run normally. A collector
    waits at most ``timeout_s`` for a learner to subscribe before its first send (less when its run is told to end
    meanwhile, as a learner that finished first does: the batch is then dropped), and ends its run when
    the learners it sent to are gone, after waiting ``rejoin_s`` (default 0) for one to (re)subscribe
    unless its run was told to stop (a learner restarted by ``auto_recover`` then gets the batch). A learner still
    live but out of reach for a moment (its link reconnecting, as after this collector stood still past the peer
    timeout) is not gone: the collector waits up to ``timeout_s`` for it and sends the batch then.

    ``shard``: with data-parallel learners (conveyor/run/learners.py), the rank of the learner this
    collector sends to, or of this learner: each rank has its own data and collector topics
    (:func:`shard_topics`), so a batch reaches one learner only. A learner's :attr:`received` counts the env
    steps it took from each collector, by node id (see the module docstring for what it credits).

    Learner: ``spaces``, the env's ``(observation_space, action_space)``: every received batch is checked against
    them (:class:`~conveyor.middleware.batch_check.SpaceCheck`) and dropped whole where it fails. ``collectors``:
    the node ids whose batches it takes (None: any peer's).

    ``ledger`` (:mod:`conveyor.middleware.ledger`): a collector's :class:`~conveyor.middleware.ledger.SendLedger`
    (None: it counts nothing), a learner's :class:`TakeLedger` (default: one of its own, :attr:`ledger`): transitions
    offered, taken, dropped. ``shared_memory``: a collector's batch to a learner on its host goes through shared
    memory (:attr:`shared`, :mod:`~conveyor.middleware.shared_batches`); False (``transport: nng``): in its message.
    """

    def __init__(self, timeout_s: float = 60.0, grace_s: float = 10.0, rejoin_s: float = 0.0,
                 skip_n_iter: Optional[int] = None, shard: int = 0, spaces: Optional[tuple] = None,
                 collectors: Optional[Iterable[Any]] = None, ledger: Any = None, shared_memory: bool = True) -> None:
        if not isinstance(shard, int) or isinstance(shard, bool) or shard < 0:
            raise ValueError(f"ContextExchanger(shard={shard!r}): must be an int >= 0 (the learner's rank)")
        if skip_n_iter is not None and (not isinstance(skip_n_iter, int) or isinstance(skip_n_iter, bool)
                                        or skip_n_iter < 0):
            raise ValueError(f"ContextExchanger(skip_n_iter={skip_n_iter!r}): must be an int >= 0 (iterations that "
                             f"do not wait for the learner), or None never to wait")
        self.skip_n_iter = skip_n_iter
        self.timeout_s = seconds("ContextExchanger", "timeout_s", timeout_s)
        self.grace_s = seconds("ContextExchanger", "grace_s", grace_s)
        self.rejoin_s = seconds("ContextExchanger", "rejoin_s", rejoin_s, zero_ok=True)
        self._inbox: List[Dict[str, Any]] = []
        self._train_iter: Optional[int] = None
        self._fresh = False  # collector or evaluator: a train_iter arrived since its last iteration began
        self._learners_seen = False  # collector or evaluator: a learner was subscribed to the data topic
        self._collectors: Set[str] = set()  # learner: the live collectors that have sent data
        self._left: Dict[str, bool] = {}  # learner: collectors gone since it last had none, by id: finished?
        self._gone: Set[str] = set()  # learner: nodes gone (one speaks again only as a restarted, live peer)
        self._finished: Set[str] = set()  # learner: nodes that finished (gone for good)
        self._layouts: Dict[str, Any] = {}  # learner: the layout of the first batch accepted, by field
        self._had_learner = False  # collector: a send reached a learner
        self._sent_to: Set[str] = set()  # collector: the learners its last send reached
        self.shard = shard
        self._data_topic, self._collector_topic = shard_topics(shard)
        self.received: Dict[str, int] = {}  # learner: env steps taken from each collector's batches, by node id
        self._check = None if spaces is None else SpaceCheck(*spaces)
        self._producers = None if collectors is None else {str(node) for node in collectors}
        self._credit: Dict[str, List[int]] = {}  # learner, by collector: env steps claimed, transitions, largest batch
        self._capped = 0
        super().__init__("ContextExchanger", self._data_topic, self._got_data, TRAIN_ITER_TOPIC,
                         self._got_train_iter)
        self.shared = SharedBatches(getattr(self._router, "node_id", "-"), learner=self._learner,
                                     collector=self._collector, enabled=shared_memory)
        if self._collector:
            self._subscribe(self._collector_topic, _ignore)
        self.ledger = ledger if ledger is not None or not self._learner else TakeLedger()
        if self._learner:  # collectors record the incarnation of the learner each batch is queued for
            self.ledger.learner = self._router.incarnation

    def __repr__(self) -> str:
        side = "learner" if self._learner else "collector" if self._collector else "inactive" if not self._router \
            else "evaluator"
        return f"ContextExchanger({side}, timeout_s={self.timeout_s}, grace_s={self.grace_s}, " \
               f"skip_n_iter={self.skip_n_iter})"

    def stats(self) -> Dict[str, int]:
        """``rejected``: messages dropped on receipt (module docstring); ``credit_capped``: batches whose claimed
        env steps went beyond the transitions their collector sent."""
        return {**super().stats(), "credit_capped": self._capped}

    def _got_data(self, payload: Any) -> None:
        payload = self.shared.take(getattr(self._router, "sender", None), payload)
        check_fields(payload, node=lambda v: isinstance(v, str), env_step=int, env_episode=int,
                     episodes=lambda v: v is None or isinstance(v, list), trajectories=anything, train_data=anything)
        check_fields({"offered_before": 0, "incarnation": 0, **payload}, offered_before=int, incarnation=int)
        node, sender = payload["node"], getattr(self._router, "sender", None)
        if sender is not None and node != str(sender):
            raise BadMessage(f"it says it comes from node {node!r}")
        if self._producers is not None and node not in self._producers:
            raise BadMessage(f"node {node!r} is not one of this learner's collectors "
                             f"({', '.join(sorted(self._producers))})")
        end_idx = payload.get("trajectory_end_idx")
        if end_idx is not None:
            end_idx = None if payload["trajectories"] is None else end_indices(end_idx)
            if end_idx is None:
                raise BadMessage("its trajectory_end_idx is not a 1-D array (or list) of indices >= 0 sent with "
                                 "trajectories")
            if end_idx.size and int(end_idx.max()) >= count_transitions(payload["trajectories"]):
                end_idx = None  # set before a later middleware (n-step) reshaped them: unknown
            payload["trajectory_end_idx"] = end_idx
        for name in ("trajectories", "train_data"):  # an empty list of transitions is no batch: nothing to join
            if _empty_list(payload[name]):
                payload[name] = None
        if payload["episodes"] is not None:
            payload["episodes"] = [ep for ep in payload["episodes"] if not _empty_list(ep)]
        batches = [(name, value) for name, value in (
            ("trajectories", payload["trajectories"]), ("train_data", payload["train_data"]),
            *(("episodes", ep) for ep in payload["episodes"] or ())) if value is not None]
        rows: Dict[str, int] = {}
        layouts = [(name, self._batch_layout(name, value, rows)) for name, value in batches]
        if self._check is not None:
            for name, value in batches:
                self._check(name, value)
        live = node not in self._gone or node in self._router.peers()  # not a late message of a lost one
        with self._cond:
            first = {**dict(reversed(layouts)), **self._layouts}  # the accepted ones, else this message's first
            for name, found in layouts:
                if first[name] != found:
                    raise BadMessage(f"its {name} are laid out otherwise than the first batch's (keys, dtypes, "
                                     f"shapes after the first dim)")
            self._layouts = first
            payload["transitions"] = held_transitions(payload, rows)
            self._credit_steps(node, payload, payload["transitions"])
            self._inbox.append(payload)
            if live:
                self._collectors.add(node)
                self._gone.discard(node)
            self._cond.notify_all()

    @staticmethod
    def _batch_layout(name: str, value: Any, rows: Dict[str, int]) -> Any:
        """What every batch of ``name`` must share: its arrays' layout after their first dim, or, for DI-engine's form
        (a list whose items are the rows: transitions, or arrays), the one layout of its items. Sets ``rows[name]``
        to its rows (the list's length, or its arrays' first dim)."""
        if isinstance(value, list):
            found = {layout(item) for item in value}
            if len(found) > 1:
                raise BadMessage(f"its {name} are a list of items laid out differently")
            rows[name] = len(value)
            return "list", found.pop()
        lengths: Set[int] = set()
        found = layout(value, lengths)
        if len(lengths) > 1:
            raise BadMessage(f"its {name} hold arrays of different lengths ({sorted(lengths)})")
        rows[name] = next(iter(lengths), 0)
        return found

    def _credit_steps(self, node: str, payload: Dict[str, Any], held: int) -> None:
        """Set ``payload["env_step"]`` to what ``node`` is credited: its claims so far, up to the transitions it
        sent so far, less what it was credited before (module docstring). Called holding ``_cond``."""
        claimed, sent, largest = self._credit.get(node, (0, 0, 0))
        credited = min(claimed, sent)
        claimed, sent, largest = claimed + payload["env_step"], sent + held, max(largest, held)
        self._credit[node] = [claimed, sent, largest]
        if claimed > sent + CREDIT_SLACK * max(largest, 1):
            self._capped += 1
            self._rejections.log(
                "credit", "%s: node %s claims %d env steps in all but sent %d transitions; it is credited with the "
                "transitions (%d batches capped so far)", self._rejections.owner, node, claimed, sent, self._capped)
        payload["env_step"] = min(claimed, sent) - credited

    def _got_train_iter(self, payload: Any) -> None:
        check_fields(payload, train_iter=int)
        self.shared.offered(getattr(self._router, "sender", None), payload.get("shm"))
        with self._cond:
            self._train_iter = max(self._train_iter or 0, int(payload["train_iter"]))
            self._fresh = True
            self._cond.notify_all()

    def _note_collectors(self) -> None:
        """Learner: count the collectors subscribed to :data:`COLLECTOR_TOPIC` as live (a lost one is listed
        again only once restarted; one that finished, never)."""
        found = self._router.subscribers(self._collector_topic)
        with self._cond:
            self._collectors.update(node for node in found if node not in self._finished)

    def _forget(self, node: str, finished: bool) -> None:
        self.shared.forget(node)
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
            self._router.publish(TRAIN_ITER_TOPIC, {"train_iter": int(ctx.train_iter), **self.shared.offer()})
        else:
            if self.skip_n_iter is not None:
                self._note_learners()
                if ctx.total_step >= self.skip_n_iter and not self._await_train_iter():
                    yield
                    return
            with self._cond:
                self._fresh = False
                if self._train_iter is not None and self._train_iter > ctx.train_iter:
                    ctx.train_iter = self._train_iter
            env_step, env_episode = ctx.env_step, ctx.env_episode
            yield
            if self._collector and (ctx.trajectories is not None or ctx.episodes is not None
                                    or ctx.train_data is not None):
                self._send({"node": str(self._router.node_id), "trajectories": ctx.trajectories,
                            "trajectory_end_idx": getattr(ctx, "trajectory_end_idx", None),
                            "episodes": ctx.episodes, "train_data": ctx.train_data,
                            "env_step": int(ctx.env_step - env_step),
                            "env_episode": int(ctx.env_episode - env_episode)})

    def _receive(self, ctx: OnlineRLContext) -> None:
        with self._cond:
            lost: List[str] = []
            got = self._wait(lambda: bool(self._inbox) or bool(self._left and not self._collectors), self.timeout_s,
                             self._note_collectors)
            if got is None:
                raise self._timeout(f"collected data on {self._data_topic!r}", "collector", self.timeout_s)
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
        for p in got:
            self.received[p["node"]] = self.received.get(p["node"], 0) + p["env_step"]
            self.ledger.take_batch(p)
        ctx.env_step += sum(p["env_step"] for p in got)
        ctx.env_episode += sum(p["env_episode"] for p in got)
        ctx.trajectories = merge_batches([p["trajectories"] for p in got if p["trajectories"] is not None])
        if hasattr(ctx, "trajectory_end_idx"):
            ctx.trajectory_end_idx = merge_end_idx(got)
        ctx.train_data = merge_batches([p["train_data"] for p in got if p.get("train_data") is not None],
                                             by_sample_dim=True)
        episodes = [ep for p in got if p["episodes"] is not None for ep in p["episodes"]]
        ctx.episodes = episodes or None

    def _await_train_iter(self) -> bool:
        """Collector or evaluator, ``skip_n_iter`` passed: wait for a ``train_iter`` sent since the last iteration;
        False (the run was ended) when asked to stop or every learner is gone."""
        with self._cond:
            got = self._wait(lambda: self._fresh or self._learners_gone(), self.timeout_s, self._note_learners)
            if got is None:
                raise self._timeout(f"train_iter on {TRAIN_ITER_TOPIC!r} (skip_n_iter={self.skip_n_iter})",
                                    "learner", self.timeout_s)
            if got and self._fresh:
                return True
        self._end_run(logging.INFO, "asked to stop" if self._stopping else "every learner is gone; this node stops")
        return False

    def _note_learners(self) -> None:
        if self._router.subscribers(self._data_topic):
            self._learners_seen = True

    def _learners_gone(self) -> bool:
        return self._learners_seen and not self._router.subscribers(self._data_topic)

    def close(self) -> None:
        """Unsubscribe; the ledger closes (a learner's counts what arrived after its last iteration)."""
        super().close()
        self.shared.close(wait=self._collector and bool(self._router.subscribers(self._data_topic)))
        if self._learner:
            with self._cond:
                left, self._inbox = self._inbox, []
            self.ledger.close(left)
        elif self.ledger is not None:
            self.ledger.close()

    def _send(self, payload: Dict[str, Any]) -> None:
        if self.ledger is not None:
            rows = {name: len(v) for name in ("trajectories", "train_data") if isinstance(v := payload[name], list)}
            n = held_transitions(payload, rows)
            payload.update(offered_before=self.ledger.offer(n), incarnation=self.ledger.incarnation)
        if self._publish(payload):
            self._had_learner = True
            self._sent_to = set(self._router.subscribers(self._data_topic))
            return
        if self._had_learner:  # every learner it sent to is out of reach: finished, lost, or its link reconnecting
            if self._reached() and self._publish(payload):
                return
            log.info("node %s: no learner left to send collected data to; the collector stops",
                     self._router.node_id)
            return self._dropped()
        with self._cond:  # no learner has subscribed yet: wait for one, unless the run ends meanwhile
            waited = self._wait(lambda: bool(self._router.subscribers(self._data_topic)) or task.finish,
                                self.timeout_s)
        if self._publish(payload):
            self._had_learner = True
        elif waited is None:
            raise TimeoutError(f"ContextExchanger: node {self._router.node_id} found no learner subscribed to "
                               f"{self._data_topic!r} within {self.timeout_s}s (live peers: {self._router.peers()}); "
                               f"is a learner running, with this exchanger in its chain?")
        else:  # the learner's run ended (its stop heard, or it left) or this node was asked to stop first
            log.info("node %s: the run ended before a learner took its first batch; it stops", self._router.node_id)
            self._dropped()

    def _publish(self, payload: Dict[str, Any]) -> bool:
        """Queue the batch for the learners subscribed; the ledger records their incarnations. Whether any was."""
        learners = self._router.subscriber_incarnations(self._data_topic)
        message, block = self.shared.pack(payload, list(learners))  # its arrays in shared memory where it can
        if self._router.publish(self._data_topic, message) == 0:
            self.shared.cancel(block)
            return False
        if self.ledger is not None:
            self.ledger.sent_to(learners.values())
        return True

    def _dropped(self) -> None:
        """No learner is left to take the batch being sent: the ledger counts it as dropped, and the run ends."""
        if self.ledger is not None:
            self.ledger.drop()
        task.finish = True

    def _reached(self) -> bool:
        """Whether a learner it can send to came within its wait: a learner it sent to that is still a live peer (its
        link reconnecting: this node stood still past the peer timeout, and the learner closed its connection) is
        waited for ``timeout_s``; with ``rejoin_s``, one that (re)subscribes is waited for that long. None is awaited
        once the run is told to stop."""
        if task.finish or self._stopping:
            return False
        live = bool(self._sent_to & set(self._router.peers()))
        if not live and not self.rejoin_s:
            return False
        with self._cond:  # the learner's stop heard meanwhile (its last words to a collector it lost) ends it
            self._wait(lambda: bool(self._router.subscribers(self._data_topic)) or task.finish or (
                not self.rejoin_s and not self._sent_to & set(self._router.peers())),
                max(self.rejoin_s, self.timeout_s if live else 0.0))
        return not task.finish and bool(self._router.subscribers(self._data_topic))
