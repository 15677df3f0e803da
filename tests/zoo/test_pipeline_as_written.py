"""The off-policy pipeline users already know runs as written (only the imports differ), sync and async."""
import pytest
from easydict import EasyDict

from conveyor import OnlineRLContext, task
from conveyor.config import compile_config
from conveyor.data import DequeBuffer
from conveyor.envs import make_env_manager
from conveyor.middleware import (CkptSaver, OffPolicyLearner, StepCollector, data_pusher, eps_greedy_handler,
                                 interaction_evaluator)
from conveyor.policy import DQNPolicy


@pytest.mark.parametrize("async_mode", [False, True])
def test_dqn_pipeline_runs_as_written(tmp_path, monkeypatch, async_mode):
    monkeypatch.chdir(tmp_path)
    cfg = compile_config(EasyDict(dict(
        exp_name="as_written",
        env=dict(env_id="CartPole-v1", collector_env_num=4, evaluator_env_num=2, n_evaluator_episode=2),
        policy=dict(learn=dict(batch_size=16, update_per_collect=2), collect=dict(n_sample=16),
                    eval=dict(evaluator=dict(eval_freq=20))),
    )), policy=DQNPolicy)
    policy = DQNPolicy(cfg.policy)
    buffer_ = DequeBuffer(cfg.policy.other.replay_buffer.size)
    with make_env_manager(cfg.env, "collector") as collector_env, \
            make_env_manager(cfg.env, "evaluator") as evaluator_env:
        with task.start(async_mode=async_mode, ctx=OnlineRLContext()):
            task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env))
            task.use(eps_greedy_handler(cfg))
            task.use(StepCollector(cfg, policy.collect_mode, collector_env))
            task.use(data_pusher(cfg, buffer_))
            task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer_))
            task.use(CkptSaver(policy, cfg.exp_name, train_freq=10))
            task.run(max_step=30)
            assert task.ctx.env_step == 30 * 16
            assert task.ctx.train_iter == policy.learn_mode.train_iter > 0
            assert task.ctx.last_eval_iter is not None
    assert (tmp_path / "as_written" / "ckpt" / "latest.pth.tar").is_file()
