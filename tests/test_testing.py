"""conveyor.testing: check_env for users' envs, check_pipeline as a smoke test of any pipeline."""
import textwrap

import gymnasium as gym
import numpy as np
import pytest

from conveyor.engine import OnlineRLContext, declares, task
from conveyor.testing import EnvCheckError, PipelineCheckError, check_env, check_pipeline


class Drifting(gym.Env):
    """Observations outside its own observation space."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.full(2, 5.0, np.float32), {}

    def step(self, action):
        return np.full(2, 5.0, np.float32), 1.0, False, False, {}


def test_check_env_passes_a_gymnasium_env_and_lists_the_problems_of_a_bad_one():
    check_env("CartPole-v1", steps=5)
    with pytest.raises(EnvCheckError, match="outside observation_space"):
        check_env(Drifting(), steps=3)


@declares(reads=("env_step",), writes=("env_step", "trajectories"))
def collect(ctx):
    ctx.env_step += 1
    ctx.trajectories = [ctx.env_step]


@declares(reads=("trajectories", "train_iter"), writes=("train_iter",))
def learn(ctx):
    ctx.train_iter += len(ctx.trajectories)


def main(seed=None, exp_name=None, progress=True):
    with task.start(ctx=OnlineRLContext()):
        task.use(collect)
        task.use(learn)
        task.run()
        return task.ctx


def test_check_pipeline_runs_a_few_iterations_of_main_and_returns_its_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    table = check_pipeline(main, iterations=3)
    assert [row.name for row in table] == ["collect", "learn"] and not table.problems
    assert list(tmp_path.iterdir()) == []  # it worked in a temporary folder


def test_check_pipeline_names_the_entry_and_the_cause_of_a_failure(tmp_path):
    entry = tmp_path / "swapped.py"
    entry.write_text(textwrap.dedent("""
        from conveyor.engine import OnlineRLContext, task
        from tests.test_testing import collect, learn

        def main():
            with task.start(ctx=OnlineRLContext()):
                task.use(learn)
                task.use(collect)
                task.run()
    """))
    with pytest.raises(PipelineCheckError, match=r"swapped.py\): PipelineError: .*'learn' \(#1\) reads "
                                                 r"ctx.trajectories, which only the later 'collect' \(#2\)"):
        check_pipeline(str(entry))
    with pytest.raises(PipelineCheckError, match="returned without calling task.run()"):
        check_pipeline(lambda: None)


@pytest.mark.slow
def test_check_pipeline_runs_a_zoo_entry():
    table = check_pipeline("cartpole/dqn", iterations=1)
    assert [row.name for row in table][:3] == ["InteractionEvaluator", "eps_greedy_handler", "StepCollector"]
