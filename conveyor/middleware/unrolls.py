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
  stale and the policy's V-trace corrects for it.
"""
from __future__ import annotations

from typing import Any, Dict, List

import treetensor.torch as ttorch
import treevalue

from conveyor.data.batch import to_numpy, to_tensor
from conveyor.engine import OnlineRLContext, declares
from conveyor.middleware.trainer import _positive_int, _Trainer

__all__ = ["unroll_cutter", "UnrollLearner", "unroll_learner"]


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
class UnrollLearner(_Trainer):
    """One gradient step per ``cfg.policy.learn.batch_size`` unrolls received, publishing every ``publish_every``.

    Each call queues ``ctx.train_data`` (unrolls ``[n, T]``, from :func:`unroll_cutter` or, merged from the
    collectors that sent them, from a ``ContextExchanger``) and steps on the oldest ``batch_size`` while that many
    are queued; the rest wait for the next call. ``learn_mode.forward`` gets each batch once. After every
    ``cfg.policy.learn.publish_every`` steps the weights are published (``publish()``: collectors in this process act
    on them, a ``ModelExchanger`` sends them to the others), not after every batch. The learning rate follows
    ``learn.lr_anneal_steps`` as in the other trainers; a view with ``gather`` gets each batch first.
    ``state_dict()`` holds the queued unrolls and the steps since the last publish, so a resume goes on as the run
    would have.

    Reads ctx: ``train_data``, ``train_iter``, ``env_step``.
    Writes ctx: ``train_data = None`` (queued), ``train_iter`` (+1 per step), ``train_output`` (per-step metrics).
    """

    def __init__(self, cfg: Any, policy: Any) -> None:
        super().__init__(cfg, policy, "UnrollLearner")
        learn = cfg.policy.learn
        self._batch_size = _positive_int(learn.get("batch_size"), "batch_size", "UnrollLearner")
        self._publish_every = _positive_int(learn.get("publish_every"), "publish_every", "UnrollLearner")
        self._queued: List[Any] = []
        self._since_publish = 0
        if self._schedule.steps is None or self._schedule.unit != "env_step":
            declares(reads=("train_data", "train_iter"), writes=("train_data", "train_iter", "train_output"))(self)

    def __repr__(self) -> str:
        return f"UnrollLearner(batch_size={self._batch_size}, publish_every={self._publish_every})"

    @property
    def queued(self) -> int:
        """Unrolls received and not learned from yet."""
        return sum(len(batch.reward) for batch in self._queued)

    def state_dict(self) -> Dict[str, Any]:
        """The trainer's state, the queued unrolls (as numpy) and the steps since the weights were last published."""
        return {**super().state_dict(), "queued": [to_numpy(batch) for batch in self._queued],
                "since_publish": self._since_publish}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._queued = [to_tensor(batch) for batch in state["queued"]]
        self._since_publish = int(state["since_publish"])

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
            self._step(ctx, batch, outputs)
            self._since_publish += 1
            if self._since_publish >= self._publish_every:
                self._policy.publish()
                self._since_publish = 0
        self._queued = [queued[start:]] if start < size else []
        ctx.train_output = outputs


def unroll_learner(cfg: Any, policy: Any) -> UnrollLearner:
    """IMPALA's learner: batches of unrolls, weights published on a schedule (see :class:`UnrollLearner`)."""
    return UnrollLearner(cfg, policy)
