"""Offline zoo entries end to end: `conveyor train cartpole/bc` on a small dataset recorded in the test, exact
resume of an offline run, and the one-line errors for a missing dataset and an env-step budget."""
from __future__ import annotations

import copy
import json

import gymnasium as gym
import numpy as np
import pytest

from conveyor.cli import main as cli
from conveyor.data import DatasetWriter
from conveyor.middleware import load_checkpoint
from conveyor.zoo import load_entry

from tests.cli_helpers import ROOT, TINY
from tests.test_readme import readme_steps

from .resume_bar import differences


def record_random_episodes(root, dataset_id: str, env_id: str, episodes: int) -> None:
    """``episodes`` episodes of uniformly random actions as a Minari dataset ``dataset_id`` under ``root``."""
    env = gym.make(env_id)
    env.action_space.seed(0)
    with DatasetWriter(dataset_id, env.observation_space, env.action_space, root=root) as writer:
        for episode in range(episodes):
            obs, _ = env.reset(seed=episode)
            steps = {key: [] for key in ("obs", "action", "reward", "next_obs", "terminated", "truncated")}
            done = False
            while not done:
                action = env.action_space.sample()
                next_obs, reward, terminated, truncated, _ = env.step(action)
                for key, value in zip(steps, (obs, action, reward, next_obs, terminated, truncated)):
                    steps[key].append(value)
                obs, done = next_obs, terminated or truncated
            writer.add_episode({key: np.array(values) for key, values in steps.items()})


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """A tmp working folder with its own (empty) Minari dataset folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "datasets"))
    return tmp_path


@pytest.fixture
def small_bc(monkeypatch):
    """cartpole/bc with a small network, 20 gradient steps and an evaluation every 8 (the entry's config patched)."""
    bc = load_entry("cartpole/bc")
    cfg = copy.deepcopy(bc.main_config)
    cfg.policy.model.hidden_sizes = [32]
    cfg.policy.learn.update(batch_size=32, max_train_iter=20)
    cfg.policy.eval.evaluator.eval_freq = 8
    cfg.env.update(evaluator_env_num=2, n_evaluator_episode=2)
    monkeypatch.setattr(bc, "main_config", cfg)
    return bc


def test_conveyor_train_runs_an_offline_entry_on_a_recorded_dataset(in_tmp, small_bc, capsys):
    record_random_episodes(in_tmp / "datasets", "cartpole/expert-v0", "CartPole-v1", 10)
    assert cli(["train", "cartpole/bc", "--exp-name", "bc", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("budget reached: train iter 20 of max_train_iter 20; ")
    run = in_tmp / "runs" / "bc"
    final = load_checkpoint(run / "ckpt" / "final.pth.tar")
    assert final["ctx"]["train_iter"] == 20 and final["ctx"]["train_epoch"] >= 1
    assert final["objects"]["policy"]["counters"]["train_iter"] == 20 and final["meta"]["policy"] == "BCPolicy"
    assert (run / "ckpt" / "eval_best.pth.tar").is_file()
    # offline_logger: evaluations and the policy's losses, indexed by train iteration
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tb")).Reload()
    assert [e.step for e in events.Scalars("eval/return")] == [0, 8, 16]
    assert {"losses/bc", "charts/accuracy", "charts/train_epoch"} <= set(events.Tags()["scalars"])


def test_the_log_of_an_offline_run_names_no_env_step(in_tmp, small_bc):
    record_random_episodes(in_tmp / "datasets", "cartpole/expert-v0", "CartPole-v1", 4)
    assert cli(["train", "cartpole/bc", "--exp-name", "bc", "--no-progress"]) == 0
    log = (in_tmp / "runs" / "bc" / "log.txt").read_text()
    assert "evaluation at train_iter 0: mean return" in log and "env_step" not in log, log


def test_a_resumed_offline_run_ends_exactly_where_a_straight_run_ends(in_tmp, small_bc):
    record_random_episodes(in_tmp / "datasets", "cartpole/expert-v0", "CartPole-v1", 10)
    small_bc.main(exp_name="straight", max_train_iter=20, progress=False)
    small_bc.main(exp_name="split", max_train_iter=10, progress=False)
    ctx = small_bc.main(exp_name="split", max_train_iter=20, resume=True, progress=False)
    assert ctx.train_iter == 20
    a = load_checkpoint(in_tmp / "runs" / "straight" / "ckpt" / "final.pth.tar")
    b = load_checkpoint(in_tmp / "runs" / "split" / "ckpt" / "final.pth.tar")
    assert a["ctx"]["train_epoch"] >= 1  # the split fell inside an epoch or across one: the fetcher's order is saved
    assert differences(a, b) == []


def test_a_missing_dataset_is_one_line_naming_the_commands_that_build_it(in_tmp, capsys):
    assert cli(["train", "cartpole/bc", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cartpole/expert-v0" in err
    assert "conveyor train cartpole/dqn" in err and "conveyor collect cartpole/dqn" in err
    assert not (in_tmp / "runs").exists()  # nothing left behind: the same command works once the data is there


def _first_example_of_offline_md():
    """The commands of docs/offline.md's first example (under "Recording a dataset"), as argv lists."""
    section = (ROOT / "docs" / "offline.md").read_text().split("## Recording a dataset", 1)[1]
    start = section.index("```bash")
    return [argv for kind, argv in readme_steps(section[:section.index("```\n", start + 7) + 4]) if kind == "command"]


def _tiny(argv):
    """A command of the docs with test-sized budgets: a few env steps, episodes and gradient steps."""
    if argv[1] == "collect":
        return [*argv[:argv.index("--episodes") + 1], "2", *argv[argv.index("--episodes") + 2:], "--no-progress"]
    if argv[2] == "cartpole/bc":
        return [*argv, "--max-train-iter", "4", "--set", "policy.model.hidden_sizes=[8]", "--set",
                "policy.learn.batch_size=16", "--set", "env.evaluator_env_num=2", "--set", "env.n_evaluator_episode=2",
                "--no-progress"]
    return [*argv, *TINY]


def test_the_first_example_of_offline_md_trains_bc_on_the_dataset_it_wrote(in_tmp, capsys):
    commands = _first_example_of_offline_md()
    assert [argv[1:3] for argv in commands] == [["train", "cartpole/dqn"], ["collect", "cartpole/dqn"],
                                                ["collect", "cartpole/dqn"], ["train", "cartpole/bc"]]
    for argv in commands:  # MINARI_DATASETS_PATH is an empty folder: only --dataset-dir finds the data
        assert cli(_tiny(argv)[1:]) == 0, (argv, capsys.readouterr().err)
    assert (in_tmp / "datasets" / "cartpole" / "expert-v0").is_dir()
    run = in_tmp / "runs" / "cartpole_bc"
    assert load_checkpoint(run / "ckpt" / "final.pth.tar")["ctx"]["train_iter"] == 4
    assert json.loads((run / "config.json").read_text())["config"]["policy"]["other"]["dataset"]["dir"] == "datasets"


def test_dataset_dir_for_an_online_entry_is_a_one_line_error(in_tmp, capsys):
    assert cli(["train", "cartpole/dqn", "--dataset-dir", "datasets", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dataset-dir: cartpole/dqn trains online" in err, err


def test_an_env_step_budget_for_an_offline_entry_is_a_one_line_error(in_tmp, capsys):
    assert cli(["train", "pendulum/iql", "--max-env-step", "100", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_train_iter" in err


@pytest.mark.parametrize("name, dataset_id, env_id", [("cartpole/cql", "cartpole/expert-v0", "CartPole-v1"),
                                                      ("pendulum/cql", "pendulum/medium-v0", "Pendulum-v1"),
                                                      ("pendulum/iql", "pendulum/medium-v0", "Pendulum-v1")])
def test_each_offline_entry_trains_a_few_steps_on_its_dataset(in_tmp, name, dataset_id, env_id):
    record_random_episodes(in_tmp / "datasets", dataset_id, env_id, 2)
    entry = load_entry(name)
    cfg = copy.deepcopy(entry.main_config)
    cfg.policy.model.hidden_sizes = [16]
    cfg.policy.learn.batch_size = 16
    cfg.env.update(evaluator_env_num=1, n_evaluator_episode=1)
    ctx = entry.main(cfg, max_train_iter=3, progress=False)
    assert ctx.train_iter == 3 and ctx.last_eval_value is not None
    assert (in_tmp / "runs" / cfg.exp_name / "ckpt" / "final.pth.tar").is_file()
