"""The middleware that tie a distributed run's nodes to its learner (conveyor/run/nodes.py starts the nodes).

- :class:`LearnerClock`: the learner's counters for the other nodes, a collector's lead over the learner, and
  the end of the run.
- :class:`RemoteEvaluations`: on the learner, the results of evaluator nodes, with the weights they evaluated
  (:class:`EvaluatedWeights`), so that ``eval_best`` holds them.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional

from conveyor.engine import FINISH_EVENT, PEER_LOST_EVENT, STOP_EVENT, OnlineRLContext, Role, declares, task
from conveyor.engine.parallel import codec
from conveyor.middleware import EVAL_EVENT
from conveyor.middleware.messages import BadMessage, Rejections, check_fields
from conveyor.policy.views import Snapshot

__all__ = ["COLLECTOR_LEAD", "EXCHANGE_TIMEOUT_S", "EvaluatedWeights", "LearnerClock", "PROGRESS_TOPIC",
           "RemoteEvaluations"]

log = logging.getLogger(__name__)

PROGRESS_TOPIC = "conveyor.zoo.progress"
"""Learner -> the other nodes: ``{"node", "train_iter", "env_step", "stop"}`` after each iteration, and at the end."""
COLLECTOR_LEAD = 2
"""Iterations a collector may run per learner iteration before it waits for the learner."""
EXCHANGE_TIMEOUT_S = 120.0
"""The bound on every wait for another node (a batch, weights, the learner's counters): a shared machine is slow."""
LONGEST_ITERATION = 10
"""How many ``timeout_s`` a collector waits for the learner's counters to move while the learner says it is busy."""


class EvaluatedWeights:
    """The weights an evaluator node evaluated (``version`` and the model's state dict), as the learner gets
    them in place of the evaluator's snapshot; :meth:`RemoteEvaluations` binds them to the learner's policy."""

    def __init__(self, version: int, model: Mapping[str, Any], policy: Any = None) -> None:
        self.version, self.model, self.policy = int(version), model, policy

    def state_dict(self) -> Dict[str, Any]:
        """The learner policy's checkpoint with these model weights and version (as ``Snapshot.state_dict``)."""
        if self.policy is None:
            raise RuntimeError("EvaluatedWeights.state_dict(): not bound to the learner's policy")
        state = self.policy.state_dict()
        state["model"] = dict(self.model)
        state["counters"]["version"] = self.version
        return state

    def __repr__(self) -> str:
        return f"<EvaluatedWeights version {self.version}>"


codec.register(Snapshot, "conveyor.zoo.EvaluatedWeights",
               lambda s: {"version": s.version, "model": s.model_state_dict()},
               lambda d: EvaluatedWeights(d["version"], d["model"]))



@declares(reads=("train_iter", "env_step"), writes=("train_iter", "env_step"))
class LearnerClock:
    """The learner's counters for the other nodes, and the end of the run.

    Learner: after each iteration it sends ``train_iter`` and ``env_step`` on :data:`PROGRESS_TOPIC`, with ``stop``
    after the last (``task.finish`` set), so no collector collects its ``lead`` more batches for a learner that takes
    none; when its run ends it sends ``stop`` again once every live peer listens (at most ``timeout_s`` later).
    Others: before each iteration they take the learner's counters (a collector's ``env_step`` becomes the
    larger of its own and the learner's, so exploration schedules follow the whole run). A collector that
    ran ``lead`` iterations since they last moved waits until they move; an evaluator waits so before
    every iteration but its first. ``stop`` sets ``task.finish``. :attr:`collected` counts the env steps
    this node's own iterations added; :attr:`first_step_at` is the ``time.time()`` when they first added
    any (a collector's start-up ends there). A learner whose iteration runs longer than ``timeout_s / 4`` (an
    evaluation of long games, when no evaluator node takes it) sends its unchanged counters every ``timeout_s /
    4`` meanwhile: a node waits until the learner has said nothing for ``timeout_s``, or its counters have not
    moved for :data:`LONGEST_ITERATION` times ``timeout_s``, and ends at once when the
    node is asked to stop (:data:`~conveyor.engine.STOP_EVENT`) or the learner is lost (a warning; the
    node's run then ends, as it does on ``stop``: there is nothing left to collect or evaluate for). With
    ``rejoin_s`` > 0 (the zoo's under ``auto_recover``) a lost learner instead restarts the count of
    iterations, and the exchangers (given the same ``rejoin_s``) wait for it to come back. ``publish=False``: a
    learner that is not rank 0 of data-parallel learners; it sends nothing and only listens (every peer is
    counted as a listener of the final ``stop``). ``learner``: the node id whose counters the others follow
    (None: any node that sends them); counters from another node, or naming a node other than their
    authenticated sender (``router.sender``), are dropped and counted in :meth:`stats`.

    Reads / writes ctx: ``train_iter``, ``env_step``. Place it first, before the exchangers.
    """

    def __init__(self, lead: int = COLLECTOR_LEAD, timeout_s: float = EXCHANGE_TIMEOUT_S,
                 rejoin_s: float = 0.0, publish: bool = True, learner: Optional[Any] = None) -> None:
        if not isinstance(lead, int) or lead < 1:
            raise ValueError(f"LearnerClock(lead={lead!r}): must be an int >= 1")
        self.timeout_s, self.rejoin_s = timeout_s, rejoin_s
        self._source = None if learner is None else str(learner)
        self.collected = 0
        self.first_step_at: Optional[float] = None
        self._router = task.router
        self._learner = task.has_role(Role.LEARNER) and publish
        self._quiet = task.has_role(Role.LEARNER) and not publish
        self._lead = lead if task.has_role(Role.COLLECTOR) else 1
        self._since = 0  # iterations since the learner's counters last moved
        self._changed = threading.Condition()
        self._latest: Optional[Dict[str, Any]] = None
        self._seen: Optional[tuple] = None
        self._ended = False  # asked to stop, or the learner is lost
        self._heard = time.monotonic()  # when the learner last sent its counters
        self._sent: Optional[Dict[str, Any]] = None  # learner: the counters it sent last
        self._busy_since: Optional[float] = None  # learner: when the iteration under way began
        self._finished = threading.Event()  # learner: its run ended
        self._rejections = Rejections(f"LearnerClock on node {self._router.node_id}", self._router)
        if self._quiet:
            self._router.on(PROGRESS_TOPIC, lambda progress: None)  # counted among those told to stop
        elif self._learner:
            task.on(FINISH_EVENT, self._stop_others)
            threading.Thread(target=self._keep_saying, name="conveyor-learner-beat", daemon=True).start()
        else:
            self._router.on(PROGRESS_TOPIC, self._rejections(self._got, PROGRESS_TOPIC))
            task.on(STOP_EVENT, self._end)
            task.on(PEER_LOST_EVENT, self._peer_lost)

    def _end(self) -> None:
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def stats(self) -> Dict[str, int]:
        """``rejected``: progress messages dropped on receipt as not what :data:`PROGRESS_TOPIC` carries."""
        return {"rejected": self._rejections.count}

    def _peer_lost(self, node: Any) -> None:
        latest, peers = self._latest, self._router.peers()
        if (latest is not None and str(node) == latest["node"]) or not peers:
            goodbye = str(node) in peers or (latest is not None and latest["stop"])  # it finished, not a loss
            if not goodbye and self.rejoin_s:  # the exchangers wait for it to come back; collect on meanwhile
                log.warning("node %s: the learner (node %s) is lost; waiting up to %ss for it to rejoin",
                            self._router.node_id, node, self.rejoin_s)
                with self._changed:
                    self._since = 0
                    self._changed.notify_all()
                return
            log.log(logging.INFO if goodbye else logging.WARNING, "node %s: the learner (node %s) %s; this node ends "
                    "its run", self._router.node_id, node, "has finished" if goodbye else "is lost")
            self._end()

    def __repr__(self) -> str:
        return f"LearnerClock({'learner' if self._learner else f'lead={self._lead}'}, timeout_s={self.timeout_s})"

    def _got(self, progress: Any) -> None:
        check_fields(progress, node=lambda v: isinstance(v, str), train_iter=int, env_step=int,
                     stop=lambda v: isinstance(v, bool))
        sender = getattr(self._router, "sender", None)
        if sender is not None and progress["node"] != str(sender):
            raise BadMessage(f"it says it comes from node {progress['node']!r}")
        if self._source is not None and progress["node"] != self._source:
            raise BadMessage(f"node {progress['node']} is not the learner (node {self._source})")
        with self._changed:
            self._heard = time.monotonic()
            if self._latest is None or not self._latest["stop"]:  # a stop heard stays heard
                self._latest = progress
            self._changed.notify_all()
        if progress["stop"]:
            task.finish = True

    def _moved(self) -> bool:
        latest = self._latest
        return self._ended or latest is not None and (latest["stop"] or
                                                      (latest["train_iter"], latest["env_step"]) != self._seen)

    def __call__(self, ctx: OnlineRLContext) -> Iterator[None]:
        if self._quiet:
            yield
            return
        if self._learner:
            self._busy_since = time.monotonic()
            try:
                yield
            finally:
                self._busy_since = None
            self._sent = self._progress(ctx, stop=bool(task.finish))  # the last iteration's hands out no more lead
            self._router.publish(PROGRESS_TOPIC, self._sent)
            return
        with self._changed:
            if self._since >= self._lead:
                self._wait_for_the_learner()
            latest = self._latest
        if self._ended or (latest is not None and latest["stop"]):
            task.finish = True
            task.end_iteration()
            yield
            return
        if self._moved():
            self._seen, self._since = (latest["train_iter"], latest["env_step"]), 0
            ctx.train_iter = max(ctx.train_iter, latest["train_iter"])
            ctx.env_step = max(ctx.env_step, latest["env_step"])
        self._since += 1
        before = ctx.env_step
        yield
        if ctx.env_step > before and self.first_step_at is None:
            self.first_step_at = time.time()
        self.collected += ctx.env_step - before

    def _wait_for_the_learner(self) -> None:
        """Until the learner's counters move (or the count restarts: the learner was lost), the learner has said
        nothing for ``timeout_s``, or they have not moved for ``LONGEST_ITERATION * timeout_s``; with the lock."""
        give_up = time.monotonic() + LONGEST_ITERATION * self.timeout_s
        self._heard = max(self._heard, time.monotonic())  # the silence counts from the start of this wait
        while not (self._moved() or self._since < self._lead):
            deadline = min(self._heard + self.timeout_s, give_up)
            if time.monotonic() >= deadline:
                waited = self.timeout_s if time.monotonic() - self._heard >= self.timeout_s else \
                    LONGEST_ITERATION * self.timeout_s
                raise TimeoutError(f"node {self._router.node_id}: the learner's counters did not move within "
                                   f"{waited}s (live peers: {self._router.peers()}); is the learner running?")
            self._changed.wait(deadline - time.monotonic())

    def _keep_saying(self) -> None:
        """Learner: while an iteration runs longer than ``timeout_s / 4``, send the last counters again that often,
        so the others know it is there."""
        while not self._finished.wait(self.timeout_s / 4):
            since = self._busy_since
            if since is not None and time.monotonic() - since >= self.timeout_s / 4 and self._sent is not None:
                try:
                    self._router.publish(PROGRESS_TOPIC, self._sent)
                except RuntimeError:  # the router closed: the run is over
                    return

    def _stop_others(self, error: Optional[BaseException]) -> None:
        self._finished.set()
        deadline = time.monotonic() + self.timeout_s
        while True:  # the live peers are counted again each second: one may be found lost meanwhile
            try:
                self._router.wait_for_subscribers(PROGRESS_TOPIC, len(self._router.peers()),
                                                  timeout=max(0.01, min(1.0, deadline - time.monotonic())))
                break
            except TimeoutError as e:
                if time.monotonic() >= deadline:
                    log.warning("learner: telling the nodes that listen to stop; not every peer does: %s", e)
                    break
        self._router.publish(PROGRESS_TOPIC, self._progress(task.ctx, stop=True), to_lost=True)  # a stopped one too

    def _progress(self, ctx: OnlineRLContext, stop: bool) -> Dict[str, Any]:
        return {"node": str(self._router.node_id), "train_iter": int(ctx.train_iter), "env_step": int(ctx.env_step),
                "stop": stop}


@declares(writes=("last_eval_value", "last_eval_iter"))
class RemoteEvaluations:
    """Learner: the evaluations of evaluator nodes (``EVAL_EVENT`` from other processes).

    Each result's weights are bound to the learner's policy (so the checkpoint saver's ``eval_best`` and a
    final checkpoint at the stop value hold the evaluated weights with the learner's optimizer); one that
    reached the stop value ends the run. Before each iteration, and when the run ends, the newest result
    goes into the context. Make it before the checkpoint saver and the loggers, so it sees each result first.
    ``stop_value``: the learner's own evaluator runs without one (with data-parallel learners an evaluation must
    not end rank 0's iteration before the others': conveyor/run/learners.py), and a result here that reaches
    it is marked ``stop_value_reached`` (for the saver) and ends the run after the iteration.
    ``evaluators``: the node ids whose results count (None: any node's); a result from another node
    (``router.sender``), with a mean that is not finite, or with a ``train_iter`` the learner has not reached, is
    dropped and counted in :meth:`stats`, so no other node can end the run or set ``eval_best``.

    Writes ctx: ``last_eval_value``, ``last_eval_iter``.
    """

    def __init__(self, policy: Any, stop_value: Optional[float] = None,
                 evaluators: Optional[Iterable[Any]] = None) -> None:
        self._policy, self._stop_value = policy, stop_value
        self._sources = None if evaluators is None else {str(node) for node in evaluators}
        self._lock = threading.Lock()
        self._newest: Optional[Dict[str, Any]] = None
        self._router = task.router
        self._rejections = Rejections("RemoteEvaluations on the learner", self._router)
        task.on(EVAL_EVENT, self._rejections(self._got, EVAL_EVENT))
        task.on(FINISH_EVENT, lambda error: self(task.ctx))

    def stats(self) -> Dict[str, int]:
        """``rejected``: evaluation results dropped on receipt (not from an evaluator, no finite ``mean``, no
        ``train_iter`` count up to the learner's)."""
        return {"rejected": self._rejections.count}

    def __repr__(self) -> str:
        return "RemoteEvaluations()"

    def _got(self, result: Any) -> None:
        sender = getattr(self._router, "sender", None)
        if self._sources is not None and sender is not None and str(sender) not in self._sources:
            raise BadMessage(f"node {sender} is not an evaluator (nodes {sorted(self._sources)})")
        check_fields(result, mean=lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                     and math.isfinite(v), train_iter=int)
        if result["train_iter"] > task.ctx.train_iter:
            raise BadMessage(f"train_iter {result['train_iter']} is past the learner's ({task.ctx.train_iter})")
        if self._stop_value is not None and result["mean"] >= self._stop_value:
            result["stop_value_reached"] = True
        snapshot = result.get("snapshot")
        if isinstance(snapshot, EvaluatedWeights):
            snapshot.policy = self._policy
        with self._lock:
            self._newest = result
        if result.get("stop_value_reached"):
            task.finish = True

    def __call__(self, ctx: OnlineRLContext) -> None:
        with self._lock:
            newest = self._newest
        if newest is not None:
            ctx.last_eval_value, ctx.last_eval_iter = newest["mean"], newest["train_iter"]
