"""The :class:`ModelExchanger`: the learner sends its newest weights, collectors and evaluators act on the newest
they received (see :mod:`conveyor.middleware.exchanger` for how the exchangers join a multi-process run).

It imports no torch: it handles weights through the policy's ``acting_state()`` / ``load_acting_state()``, and
the types a version's extras hold are registered with the codec when one is made."""
from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Dict, Iterable, Iterator, Optional, Set

from conveyor.engine import declares, task
from conveyor.engine.parallel import codec
from conveyor.middleware.exchange_base import MODEL_REQUEST_TOPIC, MODEL_TOPIC, Exchanger, anything, seconds
from conveyor.middleware.messages import BadMessage, check_fields, layout

__all__ = ["ModelExchanger"]

log = logging.getLogger("conveyor.middleware.exchanger")  # where the exchangers always logged


def _versioned(model_or_policy: Any) -> Any:
    """A policy as it is; a bare ``torch.nn.Module`` as :class:`~conveyor.policy.ModuleVersions`; else a TypeError.
    Where torch is loaded (a torch policy or module was made), registers the types a version's extras hold with
    the codec (:data:`conveyor.policy.weights.WIRE_TYPES`): imported here, so importing this module loads no torch."""
    if "torch" in sys.modules:
        from conveyor.policy.weights import WIRE_TYPES
        for wire_type in WIRE_TYPES:
            codec.register(*wire_type)
    if all(callable(getattr(model_or_policy, m, None)) for m in ("acting_state", "load_acting_state")):
        return model_or_policy
    if callable(getattr(model_or_policy, "parameters", None)) and callable(getattr(model_or_policy, "buffers", None)):
        from conveyor.policy.weights import ModuleVersions
        return ModuleVersions(model_or_policy)
    raise TypeError(f"ModelExchanger({model_or_policy!r}): needs a policy with acting_state() and "
                    f"load_acting_state(), or a torch.nn.Module")


@declares()  # no context field: it reads and writes the policy's weights
class ModelExchanger(Exchanger):
    """The learner sends its newest weights; collectors and evaluators act on the newest they received.

    ``model_or_policy``: a policy (``version``, ``acting_state()``, ``load_acting_state()``, as
    :class:`conveyor.policy.Policy`) or a bare ``torch.nn.Module`` (then the learner numbers a new version
    after each of its iterations).

    Learner: after each iteration (after the trainer published), sends ``acting_state()`` when its
    version is newer than the last sent; it answers a request (a late joiner's) at once, from the router's
    receive thread, with the last version it sent (the current one before the first). Receiver: before each
    iteration, loads the newest version received (``load_acting_state``, under the learner's number, so
    collected rows record it). The first iteration
    waits for a version (asking for one). ``max_staleness`` (collectors only): one version serves at most
    ``max_staleness + 1`` collect iterations, so no batch is collected on weights more than
    ``max_staleness`` versions older than what the learner has made of the earlier ones; the next waits for
    a newer version (``0``: every batch on fresh weights, on-policy). ``None``: never waits after the
    first. Every wait is bounded by ``timeout_s``. A receiver whose learners are all gone (finished or
    lost) ends its run normally at once, at the start of an iteration or in a wait; with ``rejoin_s`` > 0,
    when the last one was lost (not finished) it first waits that long for a learner to (re)join (one
    restarted by ``auto_recover``) and goes on with that learner's first version, whatever its number.

    Whose versions count: a receiver takes a version only from a learner, as the router authenticates its
    sender (``router.sender``): one of ``learners`` (node ids) where given, else a peer subscribed to
    :data:`MODEL_REQUEST_TOPIC` (learners answer requests; collectors and evaluators do not). An honest
    learner, restarted or not, numbers its versions as it likes and is always heard; a version from any other
    node, whatever its number, is dropped and counted (``stats()["rejected"]``) before it can be heard of, so
    no one else can make a receiver wait for a version that will never come or act on weights of its own.

    Reads / writes ctx: nothing; it reads and writes the policy's weights.
    """

    def __init__(self, model_or_policy: Any, max_staleness: Optional[int] = None, timeout_s: float = 60.0,
                 rejoin_s: float = 0.0, learners: Optional[Iterable[Any]] = None) -> None:
        self.policy = _versioned(model_or_policy)
        self._bare = self.policy is not model_or_policy
        if max_staleness is not None and (not isinstance(max_staleness, int) or isinstance(max_staleness, bool)
                                          or max_staleness < 0):
            raise ValueError(f"ModelExchanger(max_staleness={max_staleness!r}): must be an int >= 0, or None")
        self.max_staleness, self.timeout_s = max_staleness, seconds("ModelExchanger", "timeout_s", timeout_s)
        self.rejoin_s = seconds("ModelExchanger", "rejoin_s", rejoin_s, zero_ok=True)
        self._sources = None if learners is None else {str(node) for node in learners}
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
        sender = getattr(self._router, "sender", None)
        if sender is not None and str(sender) not in (self._router.subscribers(MODEL_REQUEST_TOPIC)
                                                      if self._sources is None else self._sources):
            raise BadMessage(f"node {sender} is not a learner: only a learner's versions are taken")
        check_fields(state, version=int, tensors=lambda v: isinstance(v, list), extras=anything)
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
            if got is None:
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
