"""`conveyor collect mujoco/sac --d4rl medium|medium-replay`: D4RL-style datasets from one training run of the zoo's
SAC, on a tiny budget (Hopper: a random policy's episodes are short, so a few hundred env steps hold whole ones)."""
import os

import numpy as np
import pytest

from conveyor.cli import main
from conveyor.cli.d4rl import dataset_id, medium_target
from conveyor.data import dataset_metadata, load_dataset

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = ["policy.model.hidden_sizes=[32]", "policy.learn.batch_size=32", "policy.learn.learning_starts=100",
        "policy.collect.random_collect_size=100", "env.evaluator_env_num=1", "env.n_evaluator_episode=1",
        "policy.eval.evaluator.eval_freq=64", "policy.other.replay_buffer.size=2000"]
"""mujoco/sac shrunk: 100 random env steps, then learning; an evaluation of one episode every 64 gradient steps."""


def d4rl(kind, *extra, target="1e9", budget="400", transitions="200", seed="0"):
    sets = [arg for assignment in TINY for arg in ("--set", assignment)]
    return main(["collect", "mujoco/sac", "--d4rl", kind, "--env", "Hopper-v5", "--seed", seed, "--max-env-step",
                 budget, f"--target-return={target}", "--transitions", transitions, "--dataset-dir", "datasets",
                 "--no-progress", *sets, *extra])


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One generation with a target out of reach: the run ends at --max-env-step (400)."""
    work = tmp_path_factory.mktemp("d4rl")
    home = os.getcwd()
    os.chdir(work)
    try:
        assert d4rl("medium-replay") == 0
    finally:
        os.chdir(home)
    return work


def meta(work, kind, seed=0):
    return dataset_metadata(work / "datasets" / dataset_id("Hopper-v5", kind, seed))


def assert_whole_episodes(data):
    for episode in data.episodes():
        ends = episode.terminations | episode.truncations
        assert ends[-1] and not ends[:-1].any()
        assert np.array_equal(episode.observations[1:], episode.next_observations[:-1])


def test_default_target_is_a_third_of_the_way_from_d4rl_random_to_expert():
    assert medium_target("HalfCheetah-v5") == pytest.approx(-280.178953 + (12135.0 + 280.178953) / 3)
    assert medium_target("Hopper-v5") == pytest.approx(-20.272305 + (3234.3 + 20.272305) / 3)


def test_medium_replay_holds_the_whole_episodes_of_the_run_up_to_its_budget(generated):
    data = load_dataset(generated / "datasets" / dataset_id("Hopper-v5", "medium-replay", 0))
    generation = meta(generated, "medium-replay")["conveyor_generation"]
    assert generation["env_steps"] == 400 and not generation["target_reached"]
    assert_whole_episodes(data)
    assert 400 - 100 < len(data) <= 400  # all but the episode running at the end (Hopper's random ones are short)


def test_medium_holds_whole_episodes_of_the_best_policy_past_the_transitions_asked(generated):
    data = load_dataset(generated / "datasets" / dataset_id("Hopper-v5", "medium", 0))
    assert_whole_episodes(data)
    assert len(data) >= 200 and len(data) - len(list(data.episodes())[-1]) < 200


def test_metadata_holds_the_generating_run_entry_config_seed_and_reference_scores(generated):
    for kind in ("medium", "medium-replay"):
        metadata = meta(generated, kind)
        generation = metadata["conveyor_generation"]
        assert generation["kind"] == kind and generation["entry"] == "mujoco/sac" and generation["seed"] == 0
        config = generation["config"]
        assert config["seed"] == 0 and config["env"]["env_id"] == "Hopper-v5" and config["env"]["stop_value"] == 1e9
        assert config["policy"]["model"]["hidden_sizes"] == [32]
        assert generation["request"]["max_env_step"] == 400 and generation["request"]["overrides"] == TINY
        assert generation["medium_policy"].endswith("runs/d4rl_hopper_s0/ckpt/eval_best.pth.tar")
        assert (metadata["ref_min_score"], metadata["ref_max_score"]) == (-20.272305, 3234.3)


def test_a_second_call_with_the_same_request_reuses_the_datasets(generated, monkeypatch, capsys):
    monkeypatch.chdir(generated)
    path = generated / "datasets" / dataset_id("Hopper-v5", "medium", 0) / "data" / "main_data.hdf5"
    before = path.stat().st_mtime_ns
    assert d4rl("medium") == 0
    assert capsys.readouterr().out.startswith(f"reused {path.parent.parent}: medium of 400 env steps")
    assert path.stat().st_mtime_ns == before


def test_another_request_for_existing_datasets_is_exit_2(generated, monkeypatch, capsys):
    monkeypatch.chdir(generated)
    assert d4rl("medium", transitions="300") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another request (transitions)" in err and "--overwrite" in err


def test_a_reached_target_ends_the_run_there(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # Seed 0's greedy returns rise from about 6 at train_iter 0 past 8 by the third evaluation (see the run's log).
    assert d4rl("medium", target="7.7", seed="0") == 0
    assert "target 7.7 reached" in capsys.readouterr().out
    generation = meta(tmp_path, "medium")["conveyor_generation"]
    assert generation["target_reached"] and generation["medium_eval_return"] >= 7.7
    assert generation["env_steps"] < 400
    assert len(load_dataset(tmp_path / "datasets" / dataset_id("Hopper-v5", "medium-replay", 0))) <= \
        generation["env_steps"]


def test_overwrite_generates_again_with_the_new_request(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert d4rl("medium-replay", budget="200") == 0
    assert d4rl("medium-replay", "--overwrite", budget="300") == 0
    assert 300 <= meta(tmp_path, "medium")["conveyor_generation"]["env_steps"] < 310  # rounds of 8 env steps


@pytest.mark.parametrize("args, words", [
    (["collect", "mujoco/sac", "--episodes", "3"], ["give --ckpt, --dataset-id"]),
    (["collect", "mujoco/sac", "--ckpt", "x", "--episodes", "3", "--dataset-id", "a/b-v0", "--env", "Hopper-v5"],
     ["--env go with --d4rl only"]),
    (["collect", "mujoco/sac", "--d4rl", "medium", "--ckpt", "x"], ["--ckpt do not apply"]),
    (["collect", "cartpole/dqn", "--d4rl", "medium"], ["come from a run of mujoco/sac"]),
    (["collect", "mujoco/sac", "--d4rl", "medium", "--noise", "-1"], ["--noise must be a number >= 0"]),
    (["collect", "mujoco/sac", "--d4rl", "medium", "--transitions", "0"], ["--transitions must be an int > 0"]),
    (["collect", "mujoco/sac", "--d4rl", "medium", "--env", "Humanoid-v5"], ["no D4RL reference score",
                                                                             "--target-return"]),
])
def test_bad_collect_arguments_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("conveyor: error: ") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    assert not (tmp_path / "runs").exists()


def test_a_target_the_untrained_policy_reaches_is_exit_2_and_leaves_no_dataset(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert d4rl("medium", target="-1e9") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "finished no whole episode" in err and "--target-return" in err
    assert not list((tmp_path / "datasets").rglob("metadata.json"))
