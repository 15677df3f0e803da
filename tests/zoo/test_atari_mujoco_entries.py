"""The MuJoCo and Atari zoo entries: each builds and acts on every env it is meant for, a smoke run of each trains
in one process and in async mode from the same entry file, and one entry of each family's pipeline distributed."""
import copy

import gymnasium as gym
import numpy as np
import pytest

from conveyor.config import compile_config
from conveyor.policy import PPOPolicy, SACPolicy, TD3Policy
from conveyor.zoo import load_entry
from conveyor.zoo.mujoco import MUJOCO_ENV_IDS
from conveyor.run import train_distributed

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MUJOCO = {"mujoco/sac": SACPolicy, "mujoco/td3": TD3Policy, "mujoco/ppo": PPOPolicy}
ATARI = ["atari/ppo", "atari/dqn", "atari/impala"]
ENTRIES_MARKED = [*MUJOCO, *(pytest.param(name, marks=pytest.mark.slow) for name in ATARI)]  # Atari's take > 5 s
DISTRIBUTED = ["mujoco/sac", "mujoco/ppo", "atari/impala"]
"""One entry per family pipeline (off_policy.actor_critic, on_policy, actor_learner; the q_learning one is
tests/zoo/test_distributed.py's cartpole/dqn), Atari's frames and Nature CNN among them: an entry adds a config to
its family's pipeline, which every layout runs unchanged, and each entry's own smoke runs in one process above."""
BUDGET = 128  # env steps of each smoke run


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # also where mujoco writes its MUJOCO_LOG.TXT
    return tmp_path


def tiny(name):
    """The entry's config shrunk for a smoke run: one env, short episodes (an untrained greedy Atari agent may never
    press FIRE), small MLPs (the Nature CNN stays as it is), a small replay and short warm-up, IMPALA's unrolls of
    16 steps two to a batch, one evaluation."""
    cfg = copy.deepcopy(load_entry(name).main_config)
    atari = name.startswith("atari/")
    cfg.env.update(collector_env_num=1, evaluator_env_num=1, n_evaluator_episode=1,
                   max_episode_steps=100 if atari else 50)
    if not atari:
        cfg.policy.model.hidden_sizes = [16, 16]
    if "replay_buffer" in cfg.policy.get("other", {}):
        cfg.policy.learn.update(batch_size=16, learning_starts=32, update_per_collect=2)
        cfg.policy.collect.n_sample = 16
        if "random_collect_size" in cfg.policy.collect:
            cfg.policy.collect.random_collect_size = 32
        cfg.policy.other.replay_buffer.size = 500
        cfg.policy.eval.evaluator.eval_freq = 1000  # one evaluation, before training
        if "eps" in cfg.policy.other:
            cfg.policy.other.eps.decay = 100
    elif "publish_every" in cfg.policy.learn:  # IMPALA: a gradient step per 2 unrolls of 16 steps
        cfg.policy.learn.batch_size = 2
        cfg.policy.collect.n_sample = 16
        cfg.policy.eval.evaluator.eval_freq = 1000
    else:
        cfg.policy.learn.update(epoch_per_collect=1, batch_size=32)
        cfg.policy.collect.n_sample = 64
        cfg.policy.eval.evaluator.eval_freq = 1000
    return cfg


@pytest.mark.parametrize("env_id", MUJOCO_ENV_IDS)
def test_every_mujoco_entry_builds_its_policy_for_the_env_and_acts_in_its_bounds(in_tmp, env_id):
    env = gym.make(env_id)
    try:
        obs, _ = env.reset(seed=0)
        for name, policy_cls in MUJOCO.items():
            cfg = copy.deepcopy(load_entry(name).main_config)
            cfg.env.env_id = env_id
            policy = policy_cls(compile_config(cfg, policy=policy_cls).policy)
            for _ in range(3):
                action = policy.collect_mode.forward(obs[None].astype(np.float32))["action"][0]
                assert env.action_space.contains(action.astype(env.action_space.dtype)), (name, action)
                obs, *_ = env.step(action)
    finally:
        env.close()


@pytest.mark.parametrize("name", ENTRIES_MARKED)
def test_smoke_run_in_one_process(in_tmp, name):
    ctx = load_entry(name).main(tiny(name), exp_name="smoke", max_env_step=BUDGET, progress=False)
    assert ctx.env_step >= BUDGET and ctx.train_iter > 0 and ctx.last_eval_value is not None
    assert (in_tmp / "runs" / "smoke" / "ckpt" / "final.pth.tar").is_file()


@pytest.mark.parametrize("name", ENTRIES_MARKED)
def test_smoke_run_in_async_mode(in_tmp, name):
    ctx = load_entry(name).main(tiny(name), exp_name="async", max_env_step=BUDGET, async_mode=True, progress=False)
    assert ctx.env_step >= BUDGET and ctx.train_iter > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", DISTRIBUTED)
def test_smoke_run_distributed_with_one_collector(in_tmp, name):
    run = train_distributed(load_entry(name), collectors=1, cfg=tiny(name), exp_name="dist", max_env_step=BUDGET, progress=False)
    assert run.env_step >= BUDGET and run.train_iter > 0
    assert [node["collected"] > 0 for node in run.nodes if node["role"] == "collector"] == [True]
    learner, = [node for node in run.nodes if node["role"] == "learner"]
    assert (learner["shared_batches"] > 0) == name.startswith("atari/")  # frames: through shared memory on one host
