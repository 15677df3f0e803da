"""The actor-learner split of IMPALA (Espeholt et al. 2018): collectors send fixed-length unrolls, a learner
batches them from whichever collectors sent them and publishes its weights on a schedule.

- :func:`unroll_cutter` (collector side, after a :class:`~conveyor.middleware.StepCollector`): the collector's
  time-major ``[T, N]`` trajectories as ``N`` unrolls ``[N, T]``, one per env, each with the behaviour
  log-probabilities and the version that acted as the collect policy recorded them. Batch-major, so that unrolls
  from several collectors join along their first dim (``ContextExchanger`` concatenates there).
- :class:`UnrollLearner` (learner side): queues the unrolls that arrive (in one process from the collector, in
  async mode from the collector process, distributed from every collector whose batch the ``ContextExchanger``
  received: it never waits for a particular one), takes one gradient step per ``batch_size`` unrolls, each unroll
  used once, and publishes the weights every ``publish_every`` steps, so collectors act with a version a few steps
  stale and the policy's V-trace corrects for it. With ``learn.replay_ratio = k > 0`` it learns more per agent step:
  each batch, once learned from, joins a FIFO replay of the last ``learn.replay_size`` unrolls, and ``k`` more steps
  follow on batches drawn uniformly from it (ACER's replay ratio; the IMPALA paper's replay variant mixes replayed
  unrolls into its batches), so each unroll is learned from ``1 + k`` times on average. The behaviour
  log-probabilities travel with the unrolls, so V-trace corrects a replayed unroll for every version the policy has
  moved since it was acted, as it does for the collectors' lag.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import treetensor.torch as ttorch
import treevalue

from conveyor.data import DequeBuffer
from conveyor.data.batch import to_numpy, to_tensor
from conveyor.engine import OnlineRLContext, declares
from conveyor.middleware.trainer_base import TrainerBase, learn_int

__all__ = ["unroll_cutter", "UnrollLearner", "unroll_learner"]

_REPLAY_CHARTS = {f"charts/{name}": f"charts/replay_{name}"
                  for name in ("policy_lag", "policy_lag_max", "rho_mean", "rho_clip_frac")}
"""A replayed step's staleness and importance-weight charts, under their own names: ``charts/policy_lag`` stays the
lag of the batches as they arrived from the collectors."""


@declares(reads=("trajectories",), writes=("train_data", "trajectories", "trajectory_end_idx"), factory=True)
def unroll_cutter():
    """The collector's trajectories ``[T, N]`` as ``N`` unrolls ``[N, T]`` of ``T`` consecutive steps of one env.

    Episodes that end inside an unroll stay in it (``terminated`` / ``truncated`` mark where; the learner cuts its
    bootstrap there); each env's next unroll goes on where this one stopped.

    Reads ctx: ``trajectories``. Writes ctx: ``train_data`` (the unrolls), ``trajectories = None`` and
    ``trajectory_end_idx = None`` (sent once, as unrolls).
    """

    def _cut(ctx: OnlineRLContext) -> None:
        traj = ctx.trajectories
        if traj is None:
            return
        if traj.reward.ndim != 2:
            raise ValueError(f"unroll_cutter: needs a StepCollector's time-major trajectories [T, N], got reward of "
                             f"shape {tuple(traj.reward.shape)}")
        ctx.train_data = treevalue.mapping(traj, lambda x: x.transpose(0, 1).contiguous())
        ctx.trajectories = None
        ctx.trajectory_end_idx = None

    return _cut


@declares(reads=("train_data", "train_iter", "env_step"), writes=("train_data", "train_iter", "train_output"))
class UnrollLearner(TrainerBase):
    """One gradient step per ``cfg.policy.learn.batch_size`` unrolls received (and ``replay_ratio`` more on replayed
    ones), publishing every ``publish_every``.

    Each call queues ``ctx.train_data`` (unrolls ``[n, T]``, from :func:`unroll_cutter` or, merged from the
    collectors that sent them, from a ``ContextExchanger``) and steps on the oldest ``batch_size`` while that many
    are queued; the rest wait for the next call. ``learn_mode.forward`` gets each batch once. After every
    ``cfg.policy.learn.publish_every`` steps the weights are published (``publish()``: collectors in this process act
    on them, a ``ModelExchanger`` sends them to the others), not after every batch. The learning rate follows
    ``learn.lr_anneal_steps`` as in the other trainers; a view with ``gather`` gets each batch first.
    ``state_dict()`` holds the queued unrolls and the steps since the last publish, so a resume goes on as the run
    would have.

    Sample reuse: with ``learn.replay_ratio = k > 0``, each fresh batch, after its step, is added to a FIFO replay
    (a :class:`~conveyor.data.DequeBuffer` of whole unrolls, the newest ``learn.replay_size`` kept, drawn from with a
    generator seeded by ``cfg.seed``) and ``k`` steps follow, each on ``batch_size`` unrolls drawn uniformly (with
    replacement) from it: ``1 + k`` gradient steps per batch received, each unroll learned from ``1 + k`` times on
    average. Only fresh batches go to ``gather``; replayed steps count towards ``publish_every`` as every gradient
    step does, and their ``charts/policy_lag``, ``charts/policy_lag_max``, ``charts/rho_mean`` and
    ``charts/rho_clip_frac`` are renamed ``charts/replay_*``, so ``charts/policy_lag`` stays the collectors' lag.
    The replay, with its generator, is in ``state_dict()``: a resume samples what the uninterrupted run would have.
    ``replay_ratio = 0`` (the default) keeps no replay and steps exactly as before.

    Reads ctx: ``train_data``, ``train_iter``, ``env_step``.
    Writes ctx: ``train_data = None`` (queued), ``train_iter`` (+1 per step), ``train_output`` (per-step metrics).
    """

    def __init__(self, cfg: Any, policy: Any) -> None:
        super().__init__(cfg, policy, "UnrollLearner")
        learn = cfg.policy.learn
        self._batch_size = learn_int(learn.get("batch_size"), "batch_size", "UnrollLearner")
        self._publish_every = learn_int(learn.get("publish_every"), "publish_every", "UnrollLearner")
        self._replay_ratio = learn_int(learn.get("replay_ratio", 0), "replay_ratio", "UnrollLearner", minimum=0)
        self._replay: Optional[DequeBuffer] = None
        if self._replay_ratio:
            size = learn_int(learn.get("replay_size"), "replay_size", "UnrollLearner")
            self._replay = DequeBuffer(size, seed=cfg.get("seed"))
        self._queued: List[Any] = []
        self._since_publish = 0
        if self._schedule.steps is None or self._schedule.unit != "env_step":
            declares(reads=("train_data", "train_iter"), writes=("train_data", "train_iter", "train_output"))(self)

    def __repr__(self) -> str:
        replay = "" if self._replay is None else \
            f", replay_ratio={self._replay_ratio}, replay_size={self._replay.size}"
        return f"UnrollLearner(batch_size={self._batch_size}, publish_every={self._publish_every}{replay})"

    @property
    def queued(self) -> int:
        """Unrolls received and not learned from yet."""
        return sum(len(batch.reward) for batch in self._queued)

    @property
    def replay(self) -> Optional[DequeBuffer]:
        """The FIFO of learned unrolls that replayed steps draw from (``None`` when ``replay_ratio`` is 0)."""
        return self._replay

    def state_dict(self) -> Dict[str, Any]:
        """The trainer's state, the queued unrolls (as numpy), the steps since the weights were last published and
        the replay (its unrolls and its generator), when there is one."""
        state = {**super().state_dict(), "queued": [to_numpy(batch) for batch in self._queued],
                 "since_publish": self._since_publish}
        if self._replay is not None:
            state["replay"] = self._replay.state_dict()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._queued = [to_tensor(batch) for batch in state["queued"]]
        self._since_publish = int(state["since_publish"])
        if self._replay is not None:
            if "replay" not in state:
                raise ValueError("UnrollLearner.load_state_dict: the checkpoint was saved without a replay "
                                 "(learn.replay_ratio was 0); resume with the replay_ratio it was saved with")
            self._replay.load_state_dict(state["replay"])

    def __call__(self, ctx: OnlineRLContext) -> None:
        if ctx.train_data is not None:
            self._queued.append(ctx.train_data)
            ctx.train_data = None
        if self.queued < self._batch_size:
            return
        queued = ttorch.cat(self._queued, dim=0) if len(self._queued) > 1 else self._queued[0]
        size, outputs = len(queued.reward), []
        self._schedule.apply(ctx, self._policy)
        gather = getattr(self._policy, "gather", None)
        start = 0
        while size - start >= self._batch_size:
            batch = queued[start:start + self._batch_size]
            start += self._batch_size
            if gather is not None:
                gather(batch)
            self._learn(ctx, batch, outputs)
            if self._replay is not None:
                self._replay.extend(batch)
                for _ in range(self._replay_ratio):
                    replayed = self._replay.sample(self._batch_size)
                    del replayed["index"]
                    self._learn(ctx, replayed, outputs)
                    outputs[-1] = {_REPLAY_CHARTS.get(key, key): value for key, value in outputs[-1].items()}
        self._queued = [queued[start:]] if start < size else []
        ctx.train_output = outputs

    def _learn(self, ctx: OnlineRLContext, batch: Any, outputs: List[Dict[str, Any]]) -> None:
        """One gradient step, and the weights published when it is the ``publish_every``-th since they last were."""
        self._step(ctx, batch, outputs)
        self._since_publish += 1
        if self._since_publish >= self._publish_every:
            self._policy.publish()
            self._since_publish = 0


def unroll_learner(cfg: Any, policy: Any) -> UnrollLearner:
    """IMPALA's learner: batches of unrolls, weights published on a schedule (see :class:`UnrollLearner`)."""
    return UnrollLearner(cfg, policy)
