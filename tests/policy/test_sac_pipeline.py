"""SACPolicy in the off-policy pipeline as written: StepCollector (random warm-up), data_pusher,
OffPolicyLearner, interaction_evaluator and CkptSaver on Pendulum, synchronous and asynchronous."""
from __future__ import annotations

import numpy as np
import pytest
from easydict import EasyDict

from conveyor.config import compile_config
from conveyor.data import DequeBuffer
from conveyor.engine import OnlineRLContext, task
from conveyor.envs import make_env_manager
from conveyor.middleware import (CkptSaver, OffPolicyLearner, StepCollector, data_pusher, interaction_evaluator,
                                 load_checkpoint, nstep_reward_enhancer)
from conveyor.policy.sac import SACPolicy


def pendulum_cfg(nstep: int = 1, prioritized: bool = False) -> EasyDict:
    return compile_config(EasyDict(dict(
        exp_name="sac_pipeline", seed=0,
        env=dict(env_id="Pendulum-v1", collector_env_num=2, evaluator_env_num=2, n_evaluator_episode=2),
        policy=dict(nstep=nstep, model=dict(hidden_sizes=[16, 16]),
                    learn=dict(batch_size=16, update_per_collect=2, learning_starts=32),
                    collect=dict(n_sample=8, random_collect_size=32),
                    eval=dict(evaluator=dict(eval_freq=20)),
                    other=dict(replay_buffer=dict(size=1000, prioritized=prioritized))),
    )), policy=SACPolicy)


@pytest.fixture
def envs(request):
    def make(cfg):
        made = [make_env_manager(cfg.env, role, seed=cfg.seed) for role in ("collector", "evaluator")]
        for env in made:
            request.addfinalizer(env.close)
        return made
    return make


class WatchedBuffer(DequeBuffer):
    """A replay buffer that records each length read (during a run only the learner reads it, once a call)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lengths_seen = []

    def __len__(self) -> int:
        length = super().__len__()
        self.lengths_seen.append(length)
        return length


def run_pipeline(cfg, collector_env, evaluator_env, save_dir, *, async_mode: bool, steps: int = 12, calls=None):
    """The off-policy pipeline; ``calls`` (a list) gets, per learner call, the env step it counted up to and
    the gradient steps it took."""
    policy = SACPolicy(cfg.policy, seed=0)
    replay = cfg.policy.other.replay_buffer
    buffer = WatchedBuffer(replay.size, prioritized=replay.prioritized, seed=0)
    learner = OffPolicyLearner(cfg, policy.learn_mode, buffer)

    def learn(ctx):
        before = policy.learn_mode.train_iter
        learner(ctx)
        if calls is not None:
            calls.append((learner.state_dict()["env_step"], policy.learn_mode.train_iter - before))

    with task.start(async_mode=async_mode, ctx=OnlineRLContext()):
        task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env))
        task.use(StepCollector(cfg, policy.collect_mode, collector_env,
                               random_collect_size=cfg.policy.collect.random_collect_size))
        if cfg.policy.nstep > 1:
            task.use(nstep_reward_enhancer(cfg))
        task.use(data_pusher(cfg, buffer))
        task.use(learn if calls is not None else learner, lock=True)
        task.use(CkptSaver(policy, save_dir, train_freq=4, buffer=buffer), lock=True)
        task.run(max_step=steps)
        return task.ctx, policy, buffer


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_sac_runs_in_the_off_policy_pipeline(tmp_path, envs, async_mode):
    cfg = pendulum_cfg()
    calls = []
    ctx, policy, buffer = run_pipeline(cfg, *envs(cfg), tmp_path, async_mode=async_mode, calls=calls)
    lengths = list(buffer.lengths_seen)  # before this test reads len(buffer) itself
    n, updates, starts = 8, 2, 32  # n_sample, update_per_collect, learning_starts
    assert ctx.env_step == 12 * n and len(buffer) == 12 * n
    # Every gradient step is counted once in the kept ctx.train_iter, however iterations overlap.
    assert policy.learn_mode.train_iter == ctx.train_iter == sum(steps for _, steps in calls)
    # The learner runs once per iteration (and reads the buffer's length once), in order. It sees its own iteration's data; in async mode
    # (max_inflight=2) it may also see the one newer iteration's, never more: that is all the schedule decides.
    assert len(calls) == len(lengths) == 12
    for i, ((env_step, _), length) in enumerate(zip(calls, lengths)):
        assert {env_step, length} <= ({n * (i + 1), n * (i + 2)} if async_mode else {n * (i + 1)})
    # Given what each call saw, its gradient steps are fixed: none until the buffer holds learning_starts,
    # then update_per_collect per n_sample env steps counted since the previous call (none when a call before
    # it already counted them, as OffPolicyLearner documents).
    previous = None
    for (env_step, steps), length in zip(calls, lengths):
        counted = n if previous is None or env_step == 0 else env_step - previous
        assert steps == (updates * counted // n if length >= starts else 0)
        previous = env_step
    if not async_mode:  # one schedule: training starts in the 4th round
        assert ctx.train_iter == (12 - 3) * updates
    assert ctx.last_eval_value is not None and np.isfinite(ctx.last_eval_value)
    saved = load_checkpoint(tmp_path / "ckpt" / "latest.pth.tar")
    policy_state = saved["objects"]["policy"]
    assert policy_state["counters"]["train_iter"] >= 4 and "temperature" in policy_state


def test_random_warm_up_and_policy_actions_both_stay_inside_pendulums_bounds(tmp_path, envs):
    cfg = pendulum_cfg()
    _, _, buffer = run_pipeline(cfg, *envs(cfg), tmp_path, async_mode=False)
    action = buffer.sample(len(buffer)).action.numpy()
    assert action.shape[-1] == 1 and (np.abs(action) <= 2.0).all()
    assert (np.abs(action) > 1.0).any()  # scaled to [-2, 2], not left in [-1, 1]


def test_sac_trains_on_nstep_prioritized_batches(tmp_path, envs):
    cfg = pendulum_cfg(nstep=3, prioritized=True)
    ctx, policy, buffer = run_pipeline(cfg, *envs(cfg), tmp_path, async_mode=False)
    assert ctx.train_iter > 0
    batch = buffer.sample(16)
    assert "discount" in batch and "weight" in batch
    out = policy.learn_mode.forward(batch)
    assert np.isfinite(out["losses/q"]) and out.priorities.shape == (16,) and np.isfinite(out.priorities).all()
