"""What every run gets from conveyor.run: --no-stop, an evaluation hook, a refused --resume that names the keys that
differ, a plain-text log in the run directory, and $CONVEYOR_RUNS."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli import main as cli
from conveyor.zoo import load_entry
from tests.cli_helpers import TINY, assert_usage_error

dqn = load_entry("cartpole/dqn")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def tiny(stop_value=None):
    cfg = copy.deepcopy(dqn.main_config)
    cfg.env.update(collector_env_num=2, evaluator_env_num=2, n_evaluator_episode=2, stop_value=stop_value)
    cfg.policy.model.hidden_sizes = [8]
    cfg.policy.eval.evaluator.eval_freq = 8
    cfg.policy.other.replay_buffer.size = 500
    return cfg


def test_a_run_ends_at_its_stop_value_and_with_no_stop_only_at_its_budget(in_tmp):
    stopped = dqn.main(tiny(stop_value=1.0), exp_name="stops", max_env_step=128, progress=False)
    assert stopped.last_eval_value >= 1.0 and stopped.env_step < 128  # the first evaluation reached it
    ran_on = dqn.main(tiny(stop_value=1.0), exp_name="runs_on", max_env_step=128, progress=False, no_stop=True)
    assert ran_on.env_step >= 128 and ran_on.last_eval_value >= 1.0


def test_the_cli_trains_past_the_stop_value_with_no_stop(in_tmp, capsys):
    assert cli(["train", "cartpole/dqn", *TINY, "--set", "env.stop_value=1", "--no-stop", "--exp-name", "x"]) == 0
    assert capsys.readouterr().out.startswith("budget reached: env step 64 of --max-env-step 64")


class StopAtSecond:
    """An evaluation hook: keeps each result's env step and mean, and stops the run at the second."""

    def __init__(self):
        self.seen = []

    def __call__(self, result):
        self.seen.append((result["env_step"], result["mean"]))
        return len(self.seen) == 2


def test_an_evaluation_hook_sees_each_evaluation_and_its_true_ends_the_run_with_its_final_checkpoint(in_tmp):
    from conveyor.middleware import load_checkpoint

    hook = StopAtSecond()
    ctx = dqn.main(tiny(), exp_name="hooked", max_env_step=100_000, progress=False, evaluation_hook=hook)
    assert len(hook.seen) == 2 and hook.seen[0][0] == 0 and ctx.env_step < 1000
    assert ctx.last_eval_value == hook.seen[-1][1]
    final = load_checkpoint(in_tmp / "runs" / "hooked" / "ckpt" / "final.pth.tar")
    assert final["ctx"]["env_step"] == ctx.env_step


def test_runs_go_under_conveyor_runs_where_it_is_set(in_tmp, monkeypatch, capsys):
    monkeypatch.setenv("CONVEYOR_RUNS", "studies/one")
    assert cli(["train", "cartpole/dqn", *TINY, "--exp-name", "x"]) == 0, capsys.readouterr().err
    assert (in_tmp / "studies" / "one" / "x" / "config.json").is_file() and not (in_tmp / "runs").exists()
    assert capsys.readouterr().out.rstrip().endswith("run directory studies/one/x")


def test_a_refused_resume_names_the_keys_that_differ(in_tmp, capsys):
    assert cli(["train", "cartpole/dqn", *TINY, "--exp-name", "lr"]) == 0
    capsys.readouterr()
    code = cli(["train", "cartpole/dqn", *TINY, "--set", "policy.learn.learning_rate=0.002", "--exp-name", "lr",
                "--resume"])
    assert_usage_error(code, capsys, "policy.learn.learning_rate: saved 0.003, given 0.002")


def test_the_command_line_that_started_a_run_resumes_it(in_tmp, capsys):
    started = ["train", "cartpole/dqn", *TINY, "--seed", "4", "--exp-name", "again"]
    assert cli(started) == 0
    assert cli([*started, "--max-env-step", "96", "--resume"]) == 0
    assert cli([*started, "--max-env-step", "128", "--resume-if-exists"]) == 0
    without_seed = [arg for arg in started if arg not in ("--seed", "4")]
    assert cli([*without_seed, "--max-env-step", "160", "--resume"]) == 0  # the seed is the run's
    lines = (in_tmp / "runs" / "again" / "log.txt").read_text().splitlines()
    assert [line.split("run ended at ")[1].split()[0] for line in lines if "run ended at " in line] == \
        ["env_step=64", "env_step=96", "env_step=128", "env_step=160"]
    capsys.readouterr()
    assert_usage_error(cli([*without_seed, "--set", "seed=5", "--resume"]), capsys,
                       "--seed 5 differs from the seed 4 of run 'again'")
    named = ["train", "cartpole/dqn", "--exp-name", "again", "--no-progress", "--resume"]
    assert cli([*named, "--device", "cpu", "--max-env-step", "192"]) == 0  # the saved config, on its own device
    assert "run ended at env_step=192" in (in_tmp / "runs" / "again" / "log.txt").read_text().splitlines()[-1]


def test_a_run_resumes_with_another_transport_for_its_batches(in_tmp, capsys):
    started = ["train", "cartpole/dqn", *TINY, "--exp-name", "carried"]
    assert cli(started) == 0
    assert cli([*started, "--set", "transport=nng", "--max-env-step", "96", "--resume"]) == 0, capsys.readouterr().err
    assert "run ended at env_step=96" in (in_tmp / "runs" / "carried" / "log.txt").read_text().splitlines()[-1]


def test_a_run_resumes_on_another_device_with_its_saved_config(in_tmp):
    assert cli(["train", "cartpole/dqn", *TINY, "--seed", "3", "--exp-name", "moved"]) == 0
    saved = in_tmp / "runs" / "moved" / "config.json"
    elsewhere = json.loads(saved.read_text())
    elsewhere["config"]["policy"]["device"] = "cuda:0"  # as a run started on a GPU machine saves it
    saved.write_text(json.dumps(elsewhere))
    assert cli(["train", "cartpole/dqn", "--exp-name", "moved", "--device", "cpu", "--max-env-step", "96",
                "--no-progress", "--resume"]) == 0
    log = (in_tmp / "runs" / "moved" / "log.txt").read_text().splitlines()
    assert any("run 'moved' resumed: DQNPolicy, seed 3" in line for line in log) and "env_step=96" in log[-1]


def test_every_run_directory_holds_a_plain_text_log(in_tmp):
    dqn.main(tiny(), exp_name="logged", max_env_step=64, progress=False)
    dqn.main(tiny(), exp_name="logged", max_env_step=96, progress=False, resume=True)
    lines = (in_tmp / "runs" / "logged" / "log.txt").read_text().splitlines()
    assert "run 'logged' started: DQNPolicy, seed 0" in lines[0]
    assert any("evaluation at train_iter 0, env_step 0: mean return" in line for line in lines)
    ends = [line.split("run ended at ")[1] for line in lines if "run ended at " in line]
    assert len(ends) == 2 and ends[1].startswith("env_step=96")
    assert any("run 'logged' resumed" in line for line in lines)


def test_a_run_stopped_at_once_says_why_in_its_log(in_tmp):
    from conveyor.engine import task
    from conveyor.policy import DQNPolicy
    from conveyor.run import Run

    def interrupted(run):
        dqn.pipeline(run)

        def second_ctrl_c(ctx):  # what stop_on_signals raises on a second signal: a bare KeyboardInterrupt
            if ctx.env_step >= 32:
                raise KeyboardInterrupt

        task.use(second_ctrl_c)

    with pytest.raises(KeyboardInterrupt):
        Run(interrupted, dqn.main_config, DQNPolicy, tiny(), exp_name="cut", max_env_step=640, progress=False).train()
    last = (in_tmp / "runs" / "cut" / "log.txt").read_text().splitlines()[-1]
    assert "run ended at env_step=" in last and last.endswith(
        " by KeyboardInterrupt: a second SIGINT or SIGTERM stopped it at once, without a final checkpoint "
        "(latest.pth.tar is kept)"), last


def test_an_offline_entry_given_a_role_is_refused_in_one_line(in_tmp):
    from conveyor.engine import Role, task
    from conveyor.schema import ConfigError
    task.add_role(Role.LEARNER)
    try:
        with pytest.raises(ConfigError, match="an offline entry trains from a dataset"):
            load_entry("cartpole/bc").main(progress=False)
    finally:
        with task.start():  # leaving it clears the role
            pass
    assert not (in_tmp / "runs").exists()


def test_warnings_still_reach_stderr_while_the_run_logs_to_its_file(in_tmp):
    child = ("import logging, pathlib\n"
             "from conveyor.run.control import run_log\n"
             "with run_log(pathlib.Path('log.txt')):\n"
             "    logging.getLogger('conveyor.test').warning('a warning for the terminal')\n"
             "    logging.getLogger('conveyor.test').info('a record for the file only')\n")
    done = subprocess.run([sys.executable, "-c", child], cwd=in_tmp, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stderr == "a warning for the terminal\n", done.stderr
    text = (in_tmp / "log.txt").read_text()
    assert "a warning for the terminal" in text and "a record for the file only" in text



def test_policy_learn_log_freq_sets_how_often_the_training_scalars_are_written(in_tmp, capsys):
    from tests.middleware.test_logger import read_scalars

    iterations = {}
    for freq in (5, 40):  # TINY's runs take 16 gradient steps an iteration: 5 logs each one, 40 every third
        assert cli(["train", "cartpole/dqn", *TINY, "--max-env-step", "400", "--set", f"policy.learn.log_freq={freq}",
                    "--exp-name", f"every{freq}"]) == 0, capsys.readouterr().err
        iterations[freq] = [step for tag, step, _ in read_scalars(in_tmp / "runs" / f"every{freq}" / "tb")
                            if tag == "charts/env_steps_per_s"]
    assert len(iterations[5]) >= 2 * len(iterations[40]) >= 4, iterations
    assert cli(["train", "cartpole/dqn", *TINY, "--set", "policy.learn.log_freq=0", "--exp-name", "never"]) == 2
    assert "log_freq" in capsys.readouterr().err
