"""Exact resume, the run directory's rules, graceful signals and disk errors, through the CLI and entries."""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conveyor.cli import main as cli
from conveyor.envs import make_env_manager
from conveyor.middleware import ckpt as ckpt_module
from conveyor.middleware import evaluate, load_checkpoint
from conveyor.policy import DQNPolicy
from conveyor.zoo import load_entry
from tests.cli_helpers import start_in_session
from tests.launcher_helpers import group_gone

from .resume_bar import differences, straight_and_split


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- item 11: the resume bar ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("entry, n, options", [  # exactness, not width, length or epochs, is under test
    ("cartpole/dqn", 384, ("--set", "policy.eval.evaluator.eval_freq=250")),  # 160 updates before the split, an
    # evaluation after it
    ("cartpole/ppo", 1024, ()),
    ("pendulum/sac", 200, ("--set", "policy.model.hidden_sizes=[32,32]", "--set", "policy.learn.learning_starts=128",
                           "--set", "policy.collect.random_collect_size=128")),  # 72 updates before the split
    ("cartpole_masked/ppo_gru", 1024, ("--set", "policy.learn.epoch_per_collect=2")),  # every env mid-episode at the
    # split: the GRU's hidden state must carry over
])
def test_stopping_and_resuming_ends_exactly_where_a_straight_run_ends(in_tmp, entry, n, options):
    a, b = straight_and_split(in_tmp, entry, (*options, "--seed", "3"), n)
    assert a["ctx"]["env_step"] >= 2 * n and a["ctx"]["train_iter"] > 0
    assert differences(a, b) == []


# --- item 14: the run directory ------------------------------------------------------------------------
def test_a_new_run_saves_its_resolved_config(in_tmp):
    from conveyor.run.directory import prepare
    dqn = load_entry("cartpole/dqn")
    cfg = prepare(dqn.main_config, DQNPolicy, exp_name="fresh", seed=7)
    saved = json.loads((in_tmp / "runs" / "fresh" / "config.json").read_text())
    assert saved["policy"] == "DQNPolicy" and saved["config"]["seed"] == 7
    assert saved["config"]["policy"]["model"]["obs_shape"] == cfg.policy.model.obs_shape == 4  # inferred


def test_a_new_run_never_reuses_an_existing_run_directory(in_tmp, capsys):
    (in_tmp / "runs" / "taken").mkdir(parents=True)
    (in_tmp / "runs" / "taken" / "config.json").write_text("{}")
    assert cli(["train", "cartpole/dqn", "--exp-name", "taken", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs/taken already holds a run" in err and "--resume" in err
    assert (in_tmp / "runs" / "taken" / "config.json").read_text() == "{}"


def test_a_missing_envpool_stops_before_the_run_directory_is_made(in_tmp, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "envpool", None)  # as if envpool were not installed
    assert cli(["train", "cartpole/dqn", "--set", "env.manager=envpool", "--exp-name", "pooled", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "conveyor[envpool]"' in err, err
    assert not (in_tmp / "runs" / "pooled").exists()


def _fails_while_built(run):
    """A pipeline whose build fails after its envs were made, as a launch that fails does."""
    run.env("collector")
    raise RuntimeError("the pipeline fails while it is built")


TINY_RUN = ["--max-env-step", "64", "--no-progress"]


def test_a_run_that_failed_at_its_start_is_started_over_by_the_same_command(in_tmp, capsys, caplog):
    from conveyor.run import Run
    with pytest.raises(RuntimeError, match="fails while it is built"):
        Run(_fails_while_built, load_entry("cartpole/dqn").main_config, DQNPolicy, exp_name="again").train()
    assert cli(["train", "cartpole/dqn", "--exp-name", "again", *TINY_RUN]) == 0, capsys.readouterr().err
    run_dir = in_tmp / "runs" / "again"
    assert load_checkpoint(run_dir / "ckpt" / "final.pth.tar")["ctx"]["env_step"] >= 64
    assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt", "config.json", "log.txt", "tb"]
    assert (run_dir / "log.txt").read_text().count("run 'again' started") == 2  # the failed start's log is kept
    assert "before its first checkpoint (RuntimeError: the pipeline fails while it is built): it starts over" \
        in caplog.text


def test_resuming_a_run_that_failed_at_its_start_takes_the_config_given(in_tmp, capsys):
    from conveyor.run import Run
    with pytest.raises(RuntimeError, match="fails while it is built"):
        Run(_fails_while_built, load_entry("cartpole/dqn").main_config, DQNPolicy, exp_name="again").train()
    assert cli(["train", "cartpole/dqn", "--exp-name", "again", "--resume", "--set", "env.manager=subprocess",
                *TINY_RUN]) == 0, capsys.readouterr().err
    saved = json.loads((in_tmp / "runs" / "again" / "config.json").read_text())
    assert saved["config"]["env"]["manager"] == "subprocess"
    assert load_checkpoint(in_tmp / "runs" / "again" / "ckpt" / "final.pth.tar")["ctx"]["env_step"] >= 64


@pytest.mark.parametrize("name", ["", "../escape", "a/b", ".."])
def test_exp_names_outside_runs_are_refused(in_tmp, capsys, name):
    assert cli(["train", "cartpole/dqn", "--exp-name", name, "--no-progress"]) == 2
    assert "is not a run name" in capsys.readouterr().err
    assert not (in_tmp / "runs").exists() and not (in_tmp / "escape").exists()


def test_resuming_another_algorithms_run_names_both(in_tmp, capsys):
    run = in_tmp / "runs" / "dqn_run"
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "latest.pth.tar").write_bytes(b"")
    (run / "config.json").write_text(json.dumps({"policy": "DQNPolicy", "config": {}}))
    assert cli(["train", "cartpole/ppo", "--exp-name", "dqn_run", "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PPOPolicy" in err and "DQNPolicy" in err


# --- item 16: disk errors ------------------------------------------------------------------------------
def test_a_file_where_the_runs_folder_should_be_is_one_line_and_exit_2(in_tmp, capsys):
    (in_tmp / "runs").write_text("")
    assert cli(["train", "cartpole/dqn", "--exp-name", "x", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs/x" in err and ("Not a directory" in err or "File exists" in err)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_runs_folder_is_one_line_and_exit_2(in_tmp, capsys):
    (in_tmp / "runs").mkdir()
    (in_tmp / "runs").chmod(0o500)
    try:
        assert cli(["train", "cartpole/dqn", "--exp-name", "x", "--no-progress"]) == 2
    finally:
        (in_tmp / "runs").chmod(0o700)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs/x" in err and "Permission denied" in err


def test_a_full_disk_is_one_line_naming_the_checkpoint_and_exit_2(in_tmp, capsys, monkeypatch):
    def full(fd, mode):
        os.close(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_module.os, "fdopen", full)
    assert cli(["train", "cartpole/dqn", "--exp-name", "full", "--max-env-step", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "cannot write checkpoint runs/full/ckpt/" in err and "No space left on device" in err
    assert not [p for p in (in_tmp / "runs" / "full" / "ckpt").iterdir() if p.name.endswith(".tmp")]


# --- item 12: the checkpoints hold the weights that were evaluated -------------------------------------
@pytest.mark.slow
def test_a_run_stopped_by_its_stop_value_keeps_the_evaluated_weights(in_tmp):
    dqn = load_entry("cartpole/dqn")
    cfg = copy.deepcopy(dqn.main_config)
    cfg.env.update(stop_value=40.0, evaluator_env_num=4, n_evaluator_episode=4)
    cfg.policy.eval.evaluator.eval_freq = 50
    ctx = dqn.main(cfg, exp_name="stops", max_env_step=20000, progress=False)
    assert ctx.last_eval_value >= 40.0 and ctx.env_step < 20000
    ckpt = in_tmp / "runs" / "stops" / "ckpt"
    best, final = load_checkpoint(ckpt / "eval_best.pth.tar"), load_checkpoint(ckpt / "final.pth.tar")
    assert best["eval"]["train_iter"] > 0 and best["eval"]["mean"] == ctx.last_eval_value
    assert differences(best["policy"]["model"], final["objects"]["policy"]["model"]) == []

    compiled = json.loads((in_tmp / "runs" / "stops" / "config.json").read_text())["config"]
    policy = DQNPolicy(compiled["policy"])
    policy.load_state_dict(best["policy"])
    with make_env_manager(compiled["env"], "evaluator") as env:
        again = evaluate(policy.eval_mode, env, compiled["env"]["n_evaluator_episode"], seed=best["eval"]["seed"])
    assert again["returns"] == best["eval"]["returns"]


# --- item 13: signals ----------------------------------------------------------------------------------
CHILD = """
import sys
from conveyor.cli import main
from conveyor.zoo.cartpole import dqn
dqn.main_config.env.manager = sys.argv[1]
sys.exit(main(["train", "cartpole/dqn", "--exp-name", "sig", "--no-progress", "--ckpt-interval", "0.2"]))
"""


@pytest.fixture
def spawn(request):
    """Start a child in its own session; its whole group is killed after the test, whatever happened."""
    def start(*args, cwd):
        return start_in_session([sys.executable, "-c", CHILD, *args], cwd, request)
    return start


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, manager", [(signal.SIGINT, 130, "sync"), (signal.SIGTERM, 143, "subprocess")])
def test_a_signal_finishes_the_iteration_writes_final_and_exits_cleanly(in_tmp, spawn, signum, code, manager):
    proc = spawn(manager, cwd=in_tmp)
    latest = in_tmp / "runs" / "sig" / "ckpt" / "latest.pth.tar"
    deadline = time.monotonic() + 120
    while not latest.exists():  # written on the wall-clock interval once training runs (atomic rename)
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    os.killpg(proc.pid, signum) if signum == signal.SIGTERM else os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"conveyor: interrupted by {signal.Signals(signum).name}"), err
    final = load_checkpoint(latest.parent / "final.pth.tar")
    assert differences(final, load_checkpoint(latest)) == []
    assert final["ctx"]["env_step"] > 0
    assert "leaked" not in err
    deadline = time.monotonic() + 10  # helpers (the resource tracker) exit once they read the parent's EOF
    while not group_gone(proc.pid):
        left = subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(proc.pid)], capture_output=True, text=True)
        assert time.monotonic() < deadline, f"processes left: {left.stdout}"
        time.sleep(0.05)
