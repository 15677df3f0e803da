"""The evaluation protocol: the score comes with its episode count and seed, and Atari evaluations play whole
unclipped games even when the collector's envs end episodes on a life loss."""
import numpy as np

from conveyor.envs import make_env_manager
from conveyor.middleware import evaluate


class FirstAction:
    def forward(self, obs):
        return {"action": np.ones(len(obs), dtype=np.int64)}


def test_the_evaluation_summary_names_the_episode_count_and_the_seed(cartpole_envs):
    result = evaluate(FirstAction(), cartpole_envs(2), n_episode=3, seed=7)
    assert result["summary"] == f"{result['mean']:.1f} +- {result['std']:.1f} over 3 episodes (seed 7)"


def test_atari_evaluation_episodes_are_whole_games_even_with_life_loss_configured():
    cfg = {"env_id": "ALE/Breakout-v5", "evaluator_env_num": 1, "atari": {"terminal_on_life_loss": True}}
    with make_env_manager(cfg, "evaluator", seed=0) as envs:
        result = evaluate(FirstAction(), envs, n_episode=1, seed=3)
    with make_env_manager({**cfg, "collector_env_num": 1}, "collector", seed=0) as envs:
        envs.reset(seed=3)
        ends = 0
        while True:
            ts = envs.step(np.ones(1, dtype=np.int64))
            ends += int(ts.done[0])
            if "episode" in ts.info[0]:
                break
    assert ends == 5 and result["lengths"] == [ts.info[0]["episode"]["l"]]  # the same game, in 5 training episodes
    assert result["returns"] == [ts.info[0]["episode"]["r"]]
