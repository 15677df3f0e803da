"""Moving collected data to the learner: pushing into a replay buffer, and off-policy training."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from conveyor.data.batch import flatten_batch
from conveyor.engine import OnlineRLContext, declares
from conveyor.middleware.protocols import Buffer, LearnPolicy, check_learn_view
from conveyor.policy.learning import LearnResult

__all__ = ["data_pusher", "OffPolicyLearner"]


def _valid_rows(batch: Any) -> Any:
    """Merge leading dims and drop rows marked invalid (crashed env steps)."""
    flat = flatten_batch(batch, batch.reward.ndim)
    if "valid" in flat:
        valid = flat.valid
        del flat["valid"]
        if not bool(valid.all()):
            flat = flat[valid]
    return flat


@declares(reads=("trajectories", "episodes"), optional=("episodes",), writes=("trajectories", "episodes"),
          factory=True)
def data_pusher(cfg: Any, buffer: Buffer):
    """Pushes what the collector gathered into a replay buffer, then clears it from the context.

    A buffer of sequences (``buffer.sequences``, :class:`~conveyor.data.SequenceBuffer`) takes the time-major
    ``[T, N]`` chunk as it is and cuts it itself; any other gets its valid rows, flattened.

    Reads ctx: ``trajectories`` (any leading dims, e.g. ``[T, N]``) or ``episodes``.
    Writes ctx: ``trajectories = None``, ``episodes = None``.
    """

    sequences = bool(getattr(buffer, "sequences", False))

    def _push(ctx: OnlineRLContext) -> None:
        if ctx.trajectories is not None and sequences:
            buffer.extend(ctx.trajectories)
            ctx.trajectories = None
        elif ctx.trajectories is not None:
            rows = _valid_rows(ctx.trajectories)
            if len(rows.reward):  # the n-step enhancer may have no finished transition yet
                buffer.extend(rows)
            ctx.trajectories = None
        elif ctx.episodes is not None:
            for episode in ctx.episodes:
                buffer.extend(episode)
        ctx.episodes = None

    return _push


@declares(reads=("train_iter", "env_step"), writes=("train_iter", "train_output"))
class OffPolicyLearner:
    """Runs ``cfg.policy.learn.update_per_collect`` gradient steps per ``cfg.policy.collect.n_sample`` env steps
    collected, on batches sampled from a buffer.

    In one process each call follows one collection round, so it takes ``update_per_collect`` steps; a
    learner fed by collector processes gets what arrived since its last call (``ctx.env_step`` grew by
    more or less than ``n_sample``) and takes as many steps as one process would on those env steps
    (fractions carry over to the next call), so the replay ratio does not depend on how the data came. In a
    pipeline that counts no env steps (``ctx.env_step`` stays 0) each call is one round; a call that sees no
    new env steps (in async mode the call before it may have counted them already) takes none.
    Training waits until the buffer holds ``max(batch_size, learn.learning_starts)`` transitions.
    The priorities of the policy's :class:`~conveyor.policy.LearnResult` are written back when the buffer is
    prioritized; each step's ``metrics`` go into ``ctx.train_output``.
    After its steps it publishes the weights once (``policy.publish()``), for collectors and evaluators to act on.

    Reads ctx: ``train_iter``, ``env_step``. Writes ctx: ``train_iter``, ``train_output`` (list of per-step
    metric dicts).
    """

    def __init__(self, cfg: Any, policy: LearnPolicy, buffer: Buffer) -> None:
        check_learn_view(policy, "OffPolicyLearner")
        learn = cfg.policy.learn
        self._policy = policy
        self._buffer = buffer
        self._batch_size = learn.batch_size
        self._updates = learn.update_per_collect
        self._n_sample = cfg.policy.collect.n_sample
        self._env_step: Optional[int] = None  # ctx.env_step at the last call
        self._owed = 0.0  # gradient steps earned by env steps and not taken yet (a fraction of one)
        self._starts = max(learn.batch_size, learn.get("learning_starts", 0) or 0)
        self._prioritized = bool(getattr(buffer, "prioritized", False))

    def __repr__(self) -> str:
        return f"OffPolicyLearner(batch_size={self._batch_size}, update_per_collect={self._updates})"

    def state_dict(self) -> Dict[str, Any]:
        """The env step of the last call and the fraction of a gradient step owed, so a resume trains as the
        run would have gone on."""
        return {"env_step": self._env_step, "owed": self._owed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._env_step = None if state["env_step"] is None else int(state["env_step"])
        self._owed = float(state["owed"])

    def __call__(self, ctx: OnlineRLContext) -> None:
        # a whole round on the first call and in a pipeline that counts no env steps; else what is new (in async
        # mode a call may already have counted the next iteration's steps: the one after it then earns none)
        new = self._n_sample if self._env_step is None or ctx.env_step == 0 \
            else max(0, ctx.env_step - self._env_step)
        self._env_step = ctx.env_step
        if len(self._buffer) < self._starts:
            return
        self._owed += self._updates * new / self._n_sample
        steps = math.floor(self._owed + 1e-9)
        self._owed -= steps
        outputs: List[Dict[str, Any]] = []
        for _ in range(steps):
            batch = self._buffer.sample(self._batch_size)
            result = LearnResult.of(self._policy.forward(batch), "OffPolicyLearner")
            if result.priorities is not None and self._prioritized:
                self._buffer.update_priority(batch.index, result.priorities)
            ctx.train_iter += 1
            outputs.append(result.metrics)
        self._policy.publish()
        ctx.train_output = outputs
