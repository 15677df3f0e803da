"""pendulum/sac and lunarlander_continuous/sac: tiny-budget smoke runs, resume, the CLI, and a run that learns."""
import copy
import sys

import pytest

from conveyor import task
from conveyor.cli import main as cli_main
from conveyor.engine import FINISH_EVENT
from conveyor.middleware import load_checkpoint
from conveyor.zoo import load_entry

pytestmark = pytest.mark.filterwarnings("ignore:builtin type [Ss]wig:DeprecationWarning")  # Box2D's bindings

pendulum = load_entry("pendulum/sac")
lunarlander = load_entry("lunarlander_continuous/sac")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def tiny(entry):
    """The entry's config with small networks and a short warm-up, so a few hundred env steps train."""
    cfg = copy.deepcopy(entry.main_config)
    cfg.policy.model.hidden_sizes = [16, 16]
    cfg.policy.learn.update(batch_size=32, learning_starts=64, update_per_collect=2)
    cfg.policy.collect.random_collect_size = 64
    cfg.policy.eval.evaluator.eval_freq = 100
    cfg.env.update(evaluator_env_num=2, n_evaluator_episode=2)
    return cfg


@pytest.mark.parametrize("entry", [pendulum, lunarlander], ids=["pendulum", "lunarlander_continuous"])
def test_smoke_run_trains_evaluates_and_writes_checkpoints(in_tmp, entry):
    ctx = entry.main(tiny(entry), exp_name="smoke", max_env_step=400, progress=False)
    assert ctx.env_step >= 400 and ctx.train_iter > 0 and ctx.last_eval_value is not None
    run = in_tmp / "runs" / "smoke"
    assert (run / "ckpt" / "final.pth.tar").is_file() and (run / "ckpt" / "latest.pth.tar").is_file()
    assert list((run / "tb").glob("events.out.tfevents.*"))


def test_smoke_run_in_async_mode_collects_in_a_child_process(in_tmp):
    middleware = []
    task.on(FINISH_EVENT, lambda error: middleware.extend(task.stats()))
    ctx = pendulum.main(tiny(pendulum), exp_name="smoke_async", max_env_step=400, async_mode=True, progress=False)
    assert ctx.env_step >= 400 and ctx.train_iter > 0
    assert "ProcessCollector" in middleware and "StepCollector" not in middleware  # 2 lock-steps per call


def test_resume_continues_env_steps_train_iterations_and_the_temperature(in_tmp):
    first = pendulum.main(tiny(pendulum), exp_name="resumed", max_env_step=300, progress=False)
    saved = load_checkpoint(in_tmp / "runs" / "resumed" / "ckpt" / "latest.pth.tar")
    assert saved["objects"]["buffer"] is not None and "temperature" in saved["objects"]["policy"]
    second = pendulum.main(tiny(pendulum), exp_name="resumed", max_env_step=600, resume=True, progress=False)
    assert 600 <= second.env_step < 600 + 16
    assert second.train_iter > first.train_iter


def test_cli_trains_pendulum_sac(in_tmp, capsys):
    assert cli_main(["train", "pendulum/sac", "--exp-name", "cli", "--max-env-step", "40", "--no-progress"]) == 0
    assert "budget reached: env step " in capsys.readouterr().out
    assert (in_tmp / "runs" / "cli" / "ckpt" / "final.pth.tar").is_file()


def test_cli_resume_without_a_checkpoint_is_a_usage_error(in_tmp, capsys):
    assert cli_main(["train", "pendulum/sac", "--exp-name", "nothing", "--resume", "--no-progress"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_lunarlander_without_box2d_is_a_usage_error_naming_the_install(in_tmp, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "Box2D", None)  # makes `import Box2D` fail
    assert cli_main(["train", "lunarlander_continuous/sac", "--max-env-step", "10", "--no-progress"]) == 2
    assert 'pip install "gymnasium[box2d]"' in capsys.readouterr().err


def test_same_seed_gives_the_same_run(in_tmp):
    returns = [pendulum.main(tiny(pendulum), exp_name=f"twin{i}", seed=3, max_env_step=200, progress=False)
               .last_eval_value for i in range(2)]
    assert returns[0] == returns[1]


@pytest.mark.slow
def test_sac_learns_pendulum(in_tmp):
    """The entry's settings on 64x64 networks and batch 128 (the learning, not the width, is under test), evaluated
    every 500 gradient steps and stopped at the first evaluation that reaches the asserted bar (12000 steps: a cap)."""
    cfg = copy.deepcopy(pendulum.main_config)
    cfg.policy.model.hidden_sizes = [64, 64]
    cfg.policy.learn.batch_size = 128
    cfg.policy.eval.evaluator.eval_freq = 500
    cfg.env.stop_value = -250.0
    ctx = pendulum.main(cfg, exp_name="learns", seed=0, max_env_step=12000, progress=False)
    assert ctx.last_eval_value is not None and ctx.last_eval_value >= -250, ctx.last_eval_value
