"""Evaluation: whole episodes, fair shares over envs, finishing at the stop value."""
import numpy as np
import pytest

from conveyor import OnlineRLContext, task
from conveyor.middleware import evaluate, interaction_evaluator


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
        if ctx.eval_value is not None:
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
        if ctx.eval_value is not None:
            evaluated.append(env_step)
    assert evaluated == [0, 100, 200]


def test_evaluator_finishes_the_task_once_the_stop_value_is_reached(cfg, cartpole_envs):
    cfg.env.stop_value = 1.0  # any episode reaches it
    with task.start(ctx=OnlineRLContext()):
        task.use(interaction_evaluator(cfg, ConstantPolicy(), cartpole_envs(2)))
        task.run(max_step=10)
        assert task.finish and task.ctx.total_step == 1
        assert task.ctx.last_eval_value >= 1.0
