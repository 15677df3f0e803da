"""`conveyor collect`: a checkpoint's policy recorded as a Minari dataset; bad input is one line and exit code 2."""
import gymnasium as gym
import numpy as np
import pytest

from conveyor.cli import main
from conveyor.config import compile_config
from conveyor.data import load_dataset
from conveyor.middleware import save_checkpoint
from conveyor.policy import DQNPolicy
from conveyor.zoo import load_entry

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    """An eval_best-style checkpoint of a freshly built cartpole/dqn policy."""
    monkeypatch.chdir(tmp_path)
    cfg = compile_config(load_entry("cartpole/dqn").main_config, policy=DQNPolicy)
    policy = DQNPolicy(cfg.policy, seed=0)
    return str(save_checkpoint(tmp_path / "eval_best.pth.tar", {"policy": policy.state_dict(),
                                                                "meta": {"policy": "DQNPolicy"}}))


def collect(ckpt, *extra, entry="cartpole/dqn", dataset_id="cartpole/noisy-v0", episodes="4"):
    return main(["collect", entry, "--ckpt", ckpt, "--episodes", episodes, "--dataset-id", dataset_id,
                 "--dataset-dir", "datasets", *extra])


def one_line_error(capsys, *words):
    err = capsys.readouterr().err
    assert err.startswith("conveyor: error: ") and err.count("\n") == 1, err
    assert all(word in err for word in words), err


def test_collect_writes_the_episodes_as_a_minari_dataset(ckpt, capsys):
    assert collect(ckpt, "--noise", "0.5", "--seed", "3") == 0
    assert "wrote 4 episodes" in capsys.readouterr().out
    data = load_dataset("cartpole/noisy-v0", root="datasets")
    env = gym.make("CartPole-v1")
    assert (data.observation_space, data.action_space) == (env.observation_space, env.action_space)
    assert data.num_episodes == 4
    for episode in data.episodes():
        ends = episode.terminations | episode.truncations
        assert ends[-1] and not ends[:-1].any()
        assert np.array_equal(episode.observations[1:], episode.next_observations[:-1])


def test_the_same_seed_records_the_same_dataset(ckpt):
    assert collect(ckpt, "--noise", "0.5", "--seed", "1", dataset_id="cartpole/a-v0") == 0
    assert collect(ckpt, "--noise", "0.5", "--seed", "1", dataset_id="cartpole/b-v0") == 0
    a, b = (load_dataset(f"cartpole/{x}-v0", root="datasets") for x in "ab")
    assert np.array_equal(a.observations, b.observations) and np.array_equal(a.actions, b.actions)


def test_missing_checkpoint_is_exit_2(ckpt, capsys):
    assert collect("runs/none/ckpt/eval_best.pth.tar") == 2
    one_line_error(capsys, "no checkpoint at runs/none/ckpt/eval_best.pth.tar")


def test_checkpoint_of_another_algorithm_is_exit_2(ckpt, capsys):
    assert collect(ckpt, entry="cartpole/ppo") == 2
    one_line_error(capsys, "holds a DQNPolicy, which entry cartpole/ppo does not train")


@pytest.mark.parametrize("episodes", ["0", "-3"])
def test_bad_episode_count_is_exit_2(ckpt, capsys, episodes):
    assert collect(ckpt, episodes=episodes) == 2
    one_line_error(capsys, f"--episodes must be an int > 0, got {episodes}")


def test_noise_above_one_for_discrete_actions_is_exit_2_and_leaves_no_dataset(ckpt, capsys, tmp_path):
    assert collect(ckpt, "--noise", "1.5") == 2
    one_line_error(capsys, "--noise is a probability for discrete actions")
    assert not (tmp_path / "datasets" / "cartpole" / "noisy-v0").exists()


def test_existing_dataset_id_is_exit_2_unless_overwritten(ckpt, capsys):
    assert collect(ckpt) == 0
    assert collect(ckpt) == 2
    one_line_error(capsys, "a dataset 'cartpole/noisy-v0' exists already")
    assert collect(ckpt, "--overwrite", episodes="2") == 0
    assert load_dataset("cartpole/noisy-v0", root="datasets").num_episodes == 2


def test_gaussian_noise_moves_continuous_actions_within_the_bounds(tmp_path, monkeypatch):
    from conveyor.cli.collect import collect_dataset
    from conveyor.policy import SACPolicy
    monkeypatch.chdir(tmp_path)
    cfg = compile_config(load_entry("pendulum/sac").main_config, policy=SACPolicy)
    ckpt = save_checkpoint(tmp_path / "sac.pth.tar", {"policy": SACPolicy(cfg.policy, seed=0).state_dict(),
                                                      "meta": {"policy": "SACPolicy"}})
    runs = {noise: collect_dataset("pendulum/sac", ckpt, 1, dataset_id=f"pendulum/noise{int(noise * 10)}-v0", noise=noise,
                                   dataset_dir="datasets") for noise in (0.0, 0.2)}
    greedy, noisy = (load_dataset(path) for path, _, _ in runs.values())
    _, transitions, returns = runs[0.2]
    assert transitions == 200 and np.allclose(returns, noisy.episode_returns())
    assert greedy.truncations[-1] and len(noisy) == len(greedy) == 200
    assert np.abs(noisy.actions).max() <= 2.0 and not np.array_equal(noisy.actions, greedy.actions)
    assert np.std(noisy.actions) > np.std(greedy.actions)
