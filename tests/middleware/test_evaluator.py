"""Evaluation: whole episodes, fair shares over envs, finishing at the stop value."""
import numpy as np
import pytest

from conveyor import OnlineRLContext, task
from conveyor.envs import SyncEnvManager
from conveyor.middleware import EvaluationError, evaluate, interaction_evaluator

from .conftest import CrashEveryK


class ConstantPolicy:
    def __init__(self):
        self.resets = 0

    def forward(self, obs):
        return {"action": np.zeros(len(obs), dtype=np.int64)}

    def reset(self, env_ids=None):
        self.resets += 1


def test_evaluate_runs_exactly_the_requested_episodes(cartpole_envs):
    result = evaluate(ConstantPolicy(), cartpole_envs(3), n_episode=7, seed=0)
    assert len(result["returns"]) == len(result["lengths"]) == 7
    assert result["mean"] == pytest.approx(np.mean(result["returns"]))
    assert result["returns"] == [float(n) for n in result["lengths"]]


def test_evaluate_is_deterministic_for_a_seed(cartpole_envs):
    first = evaluate(ConstantPolicy(), cartpole_envs(2), n_episode=4, seed=3)
    second = evaluate(ConstantPolicy(), cartpole_envs(2), n_episode=4, seed=3)
    assert sorted(first["returns"]) == sorted(second["returns"])


def test_evaluator_runs_first_then_every_eval_freq_train_iterations(cfg, cartpole_envs):
    cfg.policy.eval.evaluator.eval_freq = 10
    evaluator = interaction_evaluator(cfg, ConstantPolicy(), cartpole_envs(2))
    ctx = OnlineRLContext()
    evaluated = []
    for train_iter in (0, 5, 10, 15, 20):
        ctx = ctx.renew()
        ctx.train_iter = train_iter
        evaluator(ctx)
        if ctx.eval_value > float("-inf"):
            evaluated.append(train_iter)
    assert evaluated == [0, 10, 20]
    assert ctx.last_eval_iter == 20 and ctx.eval_output["train_iter"] == 20
    assert len(ctx.eval_output["returns"]) == cfg.env.n_evaluator_episode


def test_evaluator_also_runs_every_eval_env_step_freq_env_steps(cfg, cartpole_envs):
    cfg.policy.eval.evaluator.update(eval_freq=10**6, eval_env_step_freq=100)
    evaluator = interaction_evaluator(cfg, ConstantPolicy(), cartpole_envs(2))
    ctx = OnlineRLContext()
    evaluated = []
    for env_step in (0, 50, 100, 150, 200):
        ctx = ctx.renew()
        ctx.env_step = env_step
        evaluator(ctx)
        if ctx.eval_value > float("-inf"):
            evaluated.append(env_step)
    assert evaluated == [0, 100, 200]


def test_evaluator_finishes_the_task_once_the_stop_value_is_reached(cfg, cartpole_envs):
    cfg.env.stop_value = 1.0  # any episode reaches it
    with task.start(ctx=OnlineRLContext()):
        task.use(interaction_evaluator(cfg, ConstantPolicy(), cartpole_envs(2)))
        task.run(max_step=10)
        assert task.finish and task.ctx.total_step == 1
        assert task.ctx.last_eval_value >= 1.0


def crashing_envs(request, k, episode_len, n=2):
    env = SyncEnvManager([lambda: CrashEveryK(k, episode_len)] * n, seed=0, max_retry=1)
    request.addfinalizer(env.close)
    return env


def test_an_env_that_keeps_crashing_mid_episode_ends_the_evaluation_with_a_clear_error(request):
    env = crashing_envs(request, k=7, episode_len=10)  # no episode ever finishes
    with pytest.raises(EvaluationError, match=r"gave up after 5 env crashes .*max_crashes=4.*simulated env failure"):
        evaluate(ConstantPolicy(), env, n_episode=4, seed=0, max_crashes=4)


def test_crashes_and_dropped_episodes_are_counted(request):
    env = crashing_envs(request, k=8, episode_len=5, n=1)  # crashes in the 2nd episode, then every 8 steps
    result = evaluate(ConstantPolicy(), env, n_episode=3, seed=0)
    assert len(result["returns"]) == 3
    assert result["crashes"] >= 1 and result["dropped"] == result["crashes"]


def test_evaluator_records_crashes_and_the_evaluated_version(cfg, request):
    class Versioned(ConstantPolicy):
        version = 7

        def snapshot(self):
            return self

    cfg.env.n_evaluator_episode = 3
    evaluator = interaction_evaluator(cfg, Versioned(), crashing_envs(request, k=8, episode_len=5, n=1))
    ctx = OnlineRLContext()
    evaluator(ctx)
    out = ctx.eval_output
    assert out["crashes"] >= 1 and out["dropped"] >= 1 and out["weight_version"] == 7
    assert isinstance(out["snapshot"], Versioned) and out["stop_value_reached"] is False


def test_a_restored_evaluator_keeps_its_seed_schedule(cfg, cartpole_envs):
    class RandomPolicy(ConstantPolicy):
        def forward(self, obs):
            return {"action": (obs[:, 2] > 0).astype(np.int64)}

    cfg.policy.eval.evaluator.eval_freq = 1
    original = interaction_evaluator(cfg, RandomPolicy(), cartpole_envs(2))
    ctx = OnlineRLContext()
    original(ctx)
    state = original.state_dict()
    ctx.train_iter = 1
    original(ctx)
    expected = ctx.eval_output["returns"]

    resumed = interaction_evaluator(cfg, RandomPolicy(), cartpole_envs(2))
    resumed.load_state_dict(state)
    resumed(ctx)
    assert ctx.eval_output["returns"] == expected
    assert state == {"evaluations": 1, "env_step": 0}
