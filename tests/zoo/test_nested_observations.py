"""Dict and Tuple observations flow end to end: env manager, collector, n-step, buffer, DQN learner, evaluator."""
import gymnasium as gym
import numpy as np
import pytest
from easydict import EasyDict

from conveyor import OnlineRLContext, task
from conveyor.config import compile_config
from conveyor.data import DequeBuffer
from conveyor.envs import make_env_manager
from conveyor.middleware import (OffPolicyLearner, StepCollector, data_pusher, eps_greedy_handler,
                                 interaction_evaluator, nstep_reward_enhancer)
from conveyor.policy import DQNPolicy


class SplitCartPole(gym.ObservationWrapper):
    """CartPole whose observation is split into positions and velocities, as a Dict or a Tuple."""

    def __init__(self, as_tuple: bool = False):
        super().__init__(gym.make("CartPole-v1"))
        part = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.as_tuple = as_tuple
        self.observation_space = gym.spaces.Tuple((part, part)) if as_tuple else \
            gym.spaces.Dict({"position": part, "velocity": gym.spaces.Dict({"linear": gym.spaces.Box(
                -np.inf, np.inf, (1,), np.float32), "angular": gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)})})

    def observation(self, obs):
        if self.as_tuple:
            return obs[[0, 2]], obs[[1, 3]]
        return {"position": obs[[0, 2]], "velocity": {"linear": obs[[1]], "angular": obs[[3]]}}


gym.register("SplitDictCartPole-v0", entry_point=lambda: SplitCartPole(False))
gym.register("SplitTupleCartPole-v0", entry_point=lambda: SplitCartPole(True))


@pytest.mark.parametrize("env_id,manager", [("SplitDictCartPole-v0", "sync"), ("SplitDictCartPole-v0", "subprocess"),
                                            ("SplitTupleCartPole-v0", "sync")])
def test_nested_observations_train_end_to_end(env_id, manager):
    cfg = compile_config(EasyDict(dict(
        env=dict(env_id=env_id, collector_env_num=4, evaluator_env_num=2, n_evaluator_episode=2, manager=manager,
                 num_workers=2),
        policy=dict(nstep=3, learn=dict(batch_size=16, update_per_collect=2), collect=dict(n_sample=16),
                    eval=dict(evaluator=dict(eval_freq=10))),
    )), policy=DQNPolicy)
    assert isinstance(cfg.policy.model.obs_shape, dict)
    policy = DQNPolicy(cfg.policy)
    buffer_ = DequeBuffer(1000)
    with make_env_manager(cfg.env, "collector", seed=0) as collector_env, \
            make_env_manager(cfg.env, "evaluator", seed=0) as evaluator_env:
        with task.start(ctx=OnlineRLContext()):
            task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env))
            task.use(eps_greedy_handler(cfg))
            task.use(StepCollector(cfg, policy.collect_mode, collector_env))
            task.use(nstep_reward_enhancer(cfg))
            task.use(data_pusher(cfg, buffer_))
            task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer_))
            task.run(max_step=12)
            assert task.ctx.train_iter > 0 and task.ctx.last_eval_value is not None
    sample = buffer_.sample(8)
    if env_id.startswith("SplitDict"):
        assert tuple(sample.obs.velocity.angular.shape) == (8, 1)
        assert tuple(sample.next_obs.position.shape) == (8, 2)
    else:
        assert tuple(sample.obs["0"].shape) == (8, 2)
