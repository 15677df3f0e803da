"""cartpole/dqn: a smoke run, resume after a clean stop and after a kill, and a run that learns."""
import copy
import os
import signal
import subprocess
import sys
import time

import pytest

from conveyor.middleware import load_checkpoint
from conveyor.zoo import entries, load_entry

dqn = load_entry("cartpole/dqn")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_zoo_entry_has_a_config_and_main():
    for name in entries():
        entry = load_entry(name)
        assert callable(entry.main) and entry.main_config.exp_name


def test_smoke_run_writes_logs_and_checkpoints(in_tmp):
    ctx = dqn.main(exp_name="smoke", max_env_step=600, progress=False)
    assert ctx.env_step >= 600 and ctx.train_iter > 0 and ctx.last_eval_value is not None
    run = in_tmp / "runs" / "smoke"
    assert (run / "ckpt" / "final.pth.tar").is_file() and (run / "ckpt" / "latest.pth.tar").is_file()
    assert list((run / "tb").glob("events.out.tfevents.*"))


def test_smoke_run_in_async_mode(in_tmp):
    ctx = dqn.main(exp_name="smoke_async", max_env_step=600, async_mode=True, progress=False)
    assert ctx.env_step >= 600 and ctx.train_iter > 0


def test_async_mode_collects_in_a_process_over_env_worker_processes(in_tmp):
    """The collector process starts its env manager's worker processes (a daemonic process could not)."""
    cfg = copy.deepcopy(dqn.main_config)
    cfg.env.update(manager="subprocess", collector_env_num=2, num_workers=2)
    ctx = dqn.main(cfg, exp_name="async_subprocess", max_env_step=200, async_mode=True, progress=False)
    assert ctx.env_step >= 200 and ctx.train_iter > 0


def test_resume_continues_env_steps_and_train_iterations(in_tmp):
    first = dqn.main(exp_name="resumed", max_env_step=600, progress=False)
    second = dqn.main(exp_name="resumed", max_env_step=1200, resume=True, progress=False)
    assert 1200 <= second.env_step < 1200 + 64
    assert second.train_iter > first.train_iter


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_last_checkpoint(in_tmp):
    cmd = [sys.executable, "-m", "conveyor", "train", "cartpole/dqn", "--exp-name", "killed", "--no-progress",
           "--max-env-step", "200000"]
    latest = in_tmp / "runs" / "killed" / "ckpt" / "latest.pth.tar"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not latest.exists():  # the file appears atomically, complete, once train_iter reaches 1000
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    saved = load_checkpoint(latest)["ctx"]
    resumed = dqn.main(exp_name="killed", max_env_step=saved["env_step"] + 500, resume=True, progress=False)
    assert resumed.env_step >= saved["env_step"] + 500
    assert resumed.train_iter > saved["train_iter"]
    # a write the SIGKILL cut short (eval_best's, say) leaves its temporary file: the resumed run removes it
    assert not [p for p in latest.parent.iterdir() if p.name.endswith(".tmp")]
