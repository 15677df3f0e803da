"""cartpole/impala: one process, async and distributed from the same entry, policy lag logged, exact resume, and
a run that solves CartPole."""
import copy

import pytest

from conveyor.cli import main as cli_main
from conveyor.zoo import load_entry
from conveyor.run import train_distributed
from tests.middleware.test_logger import read_scalars

from .resume_bar import differences, straight_and_split

ENTRY = "cartpole/impala"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def small(**learn):
    """The entry's config with fewer envs and episodes, evaluating often, logging every step."""
    cfg = copy.deepcopy(load_entry(ENTRY).main_config)
    cfg.env.collector_env_num = 4
    cfg.env.evaluator_env_num = 2
    cfg.env.n_evaluator_episode = 2
    cfg.policy.collect.n_sample = 64  # 4 unrolls of 16 steps per call
    cfg.policy.learn.batch_size = 4
    cfg.policy.eval.evaluator.eval_freq = 4
    cfg.policy.learn.update(learn)
    return cfg


def policy_lags(run_dir, tag="charts/policy_lag"):
    return [value for name, _, value in read_scalars(run_dir / "tb") if name == tag]


def test_one_process_run_acts_on_the_newest_weights_and_logs_a_policy_lag_of_zero(in_tmp):
    ctx = load_entry(ENTRY).main(small(), exp_name="sync", max_env_step=640, progress=False, no_stop=True)
    assert ctx.env_step >= 640 and ctx.train_iter == ctx.env_step // 64 and ctx.last_eval_value is not None
    run = in_tmp / "runs" / "sync"
    assert (run / "ckpt" / "final.pth.tar").is_file()
    lags = policy_lags(run)
    assert lags and all(lag == 0.0 for lag in lags)  # collection waits for each batch's learning: never stale


def test_async_run_collects_while_the_learner_steps_and_logs_the_policy_lag(in_tmp):
    ctx = load_entry(ENTRY).main(small(batch_size=1, publish_every=1), exp_name="async", max_env_step=2560,
                                 async_mode=True, progress=False, no_stop=True)
    assert ctx.env_step >= 2560 and ctx.train_iter > 100
    lags = policy_lags(in_tmp / "runs" / "async")
    assert lags and all(lag >= 0.0 for lag in lags)


def test_distributed_learner_batches_unrolls_of_both_collectors_and_logs_the_policy_lag(in_tmp):
    cfg = small(batch_size=1)  # a step per unroll: past the logger's 100 steps between training scalars
    run = train_distributed(load_entry(ENTRY), collectors=2, evaluators=1, cfg=cfg, exp_name="dist", max_env_step=2560,
                            progress=False, no_stop=True)
    learner = [n for n in run.nodes if n["role"] == "learner"][0]
    collectors = [n for n in run.nodes if n["role"] == "collector"]
    assert learner["env_step"] >= 2560 and learner["train_iter"] > 0 and run.last_eval_value is not None
    assert len(collectors) == 2 and all(c["collected"] > 0 for c in collectors)
    lags = policy_lags(in_tmp / "runs" / "dist")
    assert lags and all(lag >= 0.0 for lag in lags)


def test_replay_takes_more_steps_per_batch_and_logs_the_replayed_lag_apart(in_tmp):
    ctx = load_entry(ENTRY).main(small(replay_ratio=2, replay_size=8), exp_name="replay", max_env_step=640,
                                 progress=False, no_stop=True)
    assert ctx.train_iter == 3 * (ctx.env_step // 64)  # a fresh batch and 2 replayed ones per call
    run = in_tmp / "runs" / "replay"
    assert all(lag == 0.0 for lag in policy_lags(run))  # in one process the collectors' data is never stale
    replayed = policy_lags(run, "charts/replay_policy_lag")
    assert replayed and all(lag >= 0.0 for lag in replayed)
    assert all(rho <= 1.0 for rho in policy_lags(run, "charts/replay_rho_mean"))


def test_async_run_replays_while_the_collector_process_acts(in_tmp):
    ctx = load_entry(ENTRY).main(small(batch_size=2, replay_ratio=1, replay_size=8), exp_name="async_replay",
                                 max_env_step=1280, async_mode=True, progress=False, no_stop=True)
    assert ctx.env_step >= 1280 and ctx.train_iter % 2 == 0 and ctx.train_iter > 0
    assert policy_lags(in_tmp / "runs" / "async_replay", "charts/replay_policy_lag")


def test_distributed_learner_replays_unrolls_of_both_collectors(in_tmp):
    cfg = small(batch_size=1, replay_ratio=1, replay_size=16)
    run = train_distributed(load_entry(ENTRY), collectors=2, cfg=cfg, exp_name="dist_replay", max_env_step=1280,
                            progress=False, no_stop=True)
    learner = [n for n in run.nodes if n["role"] == "learner"][0]
    fresh, odd = divmod(learner["train_iter"], 2)  # each step on a fresh unroll is followed by a replayed one
    assert learner["env_step"] >= 1280 and odd == 0 and 0 < fresh <= learner["env_step"] // 16
    assert policy_lags(in_tmp / "runs" / "dist_replay", "charts/replay_policy_lag")


def test_cli_trains_the_entry_distributed(in_tmp, capsys):
    assert cli_main(["train", ENTRY, "--collectors", "2", "--exp-name", "cli", "--max-env-step", "1024",
                     "--no-progress"]) == 0
    assert (in_tmp / "runs" / "cli" / "ckpt" / "final.pth.tar").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("replay", [(), ("--set", "policy.learn.replay_ratio=2", "--set",
                                     "policy.learn.replay_size=20")], ids=["each-unroll-once", "replay"])
def test_stopping_and_resuming_ends_exactly_where_a_straight_run_ends(in_tmp, replay):
    options = ("--seed", "3", "--set", "policy.learn.batch_size=6", *replay)  # unrolls left queued across calls
    a, b = straight_and_split(in_tmp, ENTRY, options, 512)  # 2 calls of 8 unrolls, batches of 6: some queued
    assert a["ctx"]["env_step"] >= 1024 and a["ctx"]["train_iter"] > 0
    assert differences(a, b) == []


@pytest.mark.slow
def test_impala_solves_cartpole(in_tmp):
    cfg = copy.deepcopy(load_entry(ENTRY).main_config)
    cfg.policy.eval.evaluator.eval_env_step_freq = 2000
    ctx = load_entry(ENTRY).main(cfg, exp_name="learns", seed=0, max_env_step=100_000, progress=False)
    assert ctx.last_eval_value >= 475, ctx.last_eval_value
