"""Progress where output is not a terminal (CI, Slurm): a line every few seconds instead of nothing."""
import io
from types import SimpleNamespace

import gymnasium as gym
import numpy as np

from conveyor.engine import OnlineRLContext, task
from conveyor.envs import SyncEnvManager
from conveyor.middleware import EVAL_EVENT, interaction_evaluator, logger, progress_bar
from conveyor.middleware.logger import ProgressLines


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_line_at_most_every_interval_with_count_total_postfix_rate_and_elapsed_time():
    clock, out = Clock(), io.StringIO()
    lines = ProgressLines(total=1000, desc="train", unit="step", interval=5.0, clock=clock, file=out)
    lines.update(100)
    clock.now += 4.9
    lines.update(100)
    assert out.getvalue() == ""  # nothing before the interval has passed
    clock.now += 0.1
    lines.set_postfix(refresh=False, eval_return="312.5/475")
    lines.update(50)
    clock.now += 2
    lines.update(50)  # within the interval of the last line: nothing
    clock.now += 3
    lines.update(200)
    assert out.getvalue().splitlines() == [
        "train: 250/1000 step (25%), eval_return=312.5/475, 50 step/s, 0:00:05 elapsed",
        "train: 500/1000 step (50%), eval_return=312.5/475, 50 step/s, 0:00:10 elapsed"]


def test_the_end_is_written_only_when_lines_were_and_without_a_budget_there_is_no_percentage():
    clock, out = Clock(), io.StringIO()
    quiet = ProgressLines(total=None, desc="train", unit="iter", interval=5.0, clock=clock, file=out)
    quiet.update(3)
    quiet.refresh()
    assert out.getvalue() == ""  # a short run stays quiet
    clock.now += 3725
    quiet.update(7)
    quiet.update(0)
    quiet.refresh()  # nothing new since the last line
    clock.now += 1
    quiet.update(1)
    quiet.refresh()
    assert out.getvalue().splitlines() == ["train: 10 iter, 0 iter/s, 1:02:05 elapsed",
                                           "train: 11 iter, 1 iter/s, 1:02:06 elapsed"]


def test_progress_bar_writes_lines_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    clock = Clock()
    monkeypatch.setattr("conveyor.middleware.logger.time.monotonic", clock)

    def step(ctx):
        ctx.env_step += 10
        clock.now += 3
        task.emit(EVAL_EVENT, {"mean": 7.0, "std": 0.0, "env_step": ctx.env_step})

    with task.start(ctx=OnlineRLContext()):
        task.use(step).use(progress_bar(40, stop_value=475.0))
        task.run(max_step=4)
    assert capsys.readouterr().err.splitlines() == [
        "train: 20/40 step (50%), eval_return=7.0/475, 3 step/s, 0:00:06 elapsed",
        "train: 40/40 step (100%), eval_return=7.0/475, 3 step/s, 0:00:12 elapsed"]


class SlowEpisodes(gym.Env):
    """Episodes of 5 steps, each step taking a second of the test's clock: a slow env without sleeping."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, clock):
        self.clock, self.t = clock, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.clock.now += 1
        self.t += 1
        return np.zeros(4, np.float32), 1.0, False, self.t >= 5, {}


class Zeros:
    def forward(self, obs):
        return {"action": np.zeros(len(obs), dtype=np.int64)}


def test_a_long_evaluation_writes_lines_with_its_episodes_when_stderr_is_not_a_terminal(monkeypatch, capsys, cfg,
                                                                                       request):
    clock = Clock()
    monkeypatch.setattr(logger, "time", SimpleNamespace(monotonic=clock))
    env = SyncEnvManager([lambda: SlowEpisodes(clock)] * 2, seed=0)  # 4 episodes: 10 steps of 2 s
    request.addfinalizer(env.close)
    with task.start(ctx=OnlineRLContext()):
        task.use(interaction_evaluator(cfg, Zeros(), env)).use(progress_bar(100))
        task.run(max_step=1)
    assert capsys.readouterr().err.splitlines() == [
        "train: 0/100 step (0%), evaluating=0/4 episodes, 0 step/s, 0:00:06 elapsed",
        "train: 0/100 step (0%), evaluating=2/4 episodes, 0 step/s, 0:00:12 elapsed",
        "train: 0/100 step (0%), evaluating=2/4 episodes, 0 step/s, 0:00:18 elapsed"]
