"""conveyor tune: an Optuna study in an SQLite file that a second command resumes, trials pruned on their evaluation
returns, the best config for conveyor train --config, distributed trials, and one-line errors for bad input."""
import json
import os
import signal
import sys
import time

import optuna
import pytest
import yaml

from conveyor.cli import main
from conveyor.cli._tune_space import PRUNED_AT
from tests.cli_helpers import TINY, assert_usage_error, run_conveyor, start_in_session

LR = "policy.learn.learning_rate=loguniform(1e-4,1e-2)"
STORAGE = "sqlite:///study.db"


def tune(*args):
    return main(["tune", "cartpole/dqn", *TINY, *args])


def trials_of(folder, study="s", storage=STORAGE):
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return optuna.load_study(study_name=study, storage=storage).get_trials()
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """3 trials with episodes of 100 to 200 steps, then a second command adding 2 trials whose episodes end after 2 to 4
    steps: their first evaluation (at env step 0, on the same untrained weights) returns at most 4 against the
    first trials' 41, below the median, so the median pruner stops them there."""
    folder = tmp_path_factory.mktemp("tune")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        first = tune("--trials", "3", "--param", LR, "--param", "env.max_episode_steps=int(100,200)",
                     "--storage", STORAGE, "--study", "s")
        second = tune("--trials", "2", "--param", LR, "--param", "env.max_episode_steps=int(2,4)",
                      "--storage", STORAGE, "--study", "s")
    finally:
        os.chdir(cwd)
    return folder, first, second


def test_a_second_command_adds_its_trials_to_the_same_sqlite_study(study):
    folder, first, second = study
    assert (first, second) == (0, 0)
    trials = trials_of(folder)
    assert [trial.number for trial in trials] == [0, 1, 2, 3, 4]
    for trial in trials:
        saved = json.loads((folder / "runs" / "s" / f"trial_{trial.number}" / "config.json").read_text())["config"]
        assert saved["policy"]["learn"]["learning_rate"] == pytest.approx(trial.params["policy.learn.learning_rate"])
        assert saved["env"]["max_episode_steps"] == trial.params["env.max_episode_steps"]


def test_trials_whose_returns_fall_below_the_median_are_pruned_and_end_with_their_checkpoint(study):
    folder, _, _ = study
    states = [trial.state for trial in trials_of(folder)]
    assert states == [optuna.trial.TrialState.COMPLETE] * 3 + [optuna.trial.TrialState.PRUNED] * 2
    for trial in trials_of(folder)[3:]:
        assert trial.user_attrs[PRUNED_AT] == 0 and trial.intermediate_values[0] <= 4
        ckpt = folder / "runs" / "s" / f"trial_{trial.number}" / "ckpt"
        assert (ckpt / "final.pth.tar").is_file()
    for trial in trials_of(folder)[:3]:
        assert trial.value == trial.intermediate_values[0] == 41.0


def test_the_best_trial_s_config_trains_with_conveyor_train_config(study, tmp_path, monkeypatch, capsys):
    folder, _, _ = study
    best = yaml.safe_load((folder / "runs" / "s" / "best.yaml").read_text())
    chosen = trials_of(folder)[0]  # the first of equal values is Optuna's best
    assert best["policy"]["learn"]["learning_rate"] == pytest.approx(chosen.params["policy.learn.learning_rate"])
    assert best["env"]["max_episode_steps"] == chosen.params["env.max_episode_steps"]
    assert best["policy"]["model"]["hidden_sizes"] == [8]  # the --set of the tune command too
    monkeypatch.chdir(tmp_path)
    assert main(["train", "cartpole/dqn", "--config", str(folder / "runs" / "s" / "best.yaml"), "--max-env-step",
                 "64", "--no-progress", "--exp-name", "best"]) == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "runs" / "best" / "config.json").read_text())["config"]
    assert saved["policy"]["learn"]["learning_rate"] == pytest.approx(chosen.params["policy.learn.learning_rate"])
    assert saved["env"]["max_episode_steps"] == chosen.params["env.max_episode_steps"]


def test_a_distributed_trial_reports_its_learner_s_evaluations_to_the_study(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert tune("--trials", "1", "--param", LR, "--collectors", "1", "--study", "d") == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    (trial,) = trials_of(tmp_path, "d", "sqlite:///runs/d/study.db")
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.intermediate_values
    assert trial.value == list(trial.intermediate_values.values())[-1]
    assert (tmp_path / "runs" / "d" / "trial_0" / "nodes.json").is_file()
    assert "best: trial 0, value" in out and "runs/d/best.yaml" in out


@pytest.mark.parametrize("argv, fragment", [
    (["--param", "policy.learn.learning_rate=loguniform(1e-2,1e-4)"], "the lower bound must be below the upper one"),
    (["--param", "env.max_episode_steps=int(5,5)"], "the lower bound must be below the upper one"),
    (["--param", "policy.learn.learning_rate=loguniform(0,1e-2)"], "loguniform needs 0 < a"),
    (["--param", "policy.learn.learning_rate=loguniform(1e-2)"], "loguniform takes two bounds"),
    (["--param", "env.max_episode_steps=int(1.5,4)"], "int(a,b) takes whole numbers"),
    (["--param", "policy.learn.learning_rate=normal(0,1)"], "expected KEY=DIST"),
    (["--param", "policy.learn.learning_rate"], "expected KEY=DIST"),
    (["--param", "policy.learn.batch_size=choice()"], "choice needs one or more values"),
    (["--param", LR, "--param", LR], "given 2 times"),
    (["--param", "policy.learn.learnin_rate=loguniform(1e-4,1e-2)"],
     "did you mean 'policy.learn.learning_rate'"),
    (["--param", "policy.lern.batch_size=choice(32,64)"], "did you mean 'policy.learn'"),
    (["--param", LR, "--trials", "0"], "--trials must be >= 1, got 0"),
    (["--param", LR, "--seeds", "0"], "--seeds must be >= 1"),
    (["--trials", "2"], "nothing to search"),
    (["--param", LR, "--evaluators", "1"], "--evaluators 1 needs --collectors N"),
    (["--param", LR, "--study", "a/b"], "--study 'a/b': use one folder name"),
    (["--param", LR, "--storage", "notaurl"], "--storage notaurl: cannot open the study's database"),
    (["--param", LR, "--storage", "sqlite:///no/such/folder/study.db"], "unable to open database file"),
])
def test_bad_input_is_one_line_before_any_trial(argv, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = argv if "--trials" in argv else [*argv, "--trials", "1"]
    assert_usage_error(tune(*argv), capsys, fragment)
    assert not (tmp_path / "runs").exists()


def test_without_optuna_the_error_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    assert_usage_error(tune("--trials", "1", "--param", LR), capsys, 'pip install "conveyor[tune]"')


@pytest.mark.slow
def test_jobs_run_trials_in_worker_processes_and_seeds_in_their_own_folders(tmp_path):
    done = run_conveyor(["conveyor", "tune", "cartpole/dqn", *TINY, "--trials", "2", "--jobs", "2", "--seeds", "2",
                         "--param", LR, "--study", "j"], tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr
    trials = trials_of(tmp_path, "j", "sqlite:///runs/j/study.db")
    assert sorted(trial.number for trial in trials) == [0, 1]
    for trial in trials:
        assert trial.state == optuna.trial.TrialState.COMPLETE and len(trial.user_attrs["returns"]) == 2
        assert trial.value == pytest.approx(sum(trial.user_attrs["returns"]) / 2)
        for seed in (0, 1):
            run = tmp_path / "runs" / "j" / f"trial_{trial.number}" / f"seed_{seed}"
            assert (run / "ckpt" / "final.pth.tar").is_file()
    assert done.stdout.splitlines()[-1].endswith("--config runs/j/best.yaml)")


@pytest.mark.slow
def test_ctrl_c_ends_the_trial_with_its_final_checkpoint_and_the_same_command_goes_on(tmp_path, monkeypatch, capsys,
                                                                                      request):
    proc = start_in_session([sys.executable, "-m", "conveyor", "tune", "cartpole/dqn", "--trials", "3", "--param", LR,
                             "--study", "c", "--max-env-step", "10000000", "--no-progress"], tmp_path, request)
    log = tmp_path / "runs" / "c" / "trial_0" / "log.txt"
    deadline = time.monotonic() + 120
    while "evaluation at" not in (log.read_text() if log.is_file() else ""):  # its first, once training runs
        assert proc.poll() is None and time.monotonic() < deadline, "the trial did not start training"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "conveyor: tune stopped by SIGINT" in err and (log.parent / "ckpt" / "final.pth.tar").is_file()
    storage = "sqlite:///runs/c/study.db"
    assert [trial.state for trial in trials_of(tmp_path, "c", storage)] == [optuna.trial.TrialState.FAIL]
    monkeypatch.chdir(tmp_path)
    assert tune("--trials", "1", "--param", LR, "--study", "c") == 0, capsys.readouterr().err
    assert [trial.state for trial in trials_of(tmp_path, "c", storage)] == [optuna.trial.TrialState.FAIL,
                                                                          optuna.trial.TrialState.COMPLETE]
