"""Every built-in middleware that runs cheaply here touches only the context fields it declares.

Each runs for two iterations on a context that records every field read and written, between a setup
middleware that writes what it needs (not recorded) and a marker after it, so what its forward part and
its part after ``yield`` touch are told apart. ProcessCollector (a child process) and wandb_online_logger
(an account) are not run; ProcessCollector forwards what its chain writes, and the wandb logger shares the
TensorBoard logger's reading code.
"""
import dataclasses

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor.config import compile_config
from conveyor.data import DequeBuffer
from conveyor.engine import OnlineRLContext, fields_of, task
from conveyor.middleware import (CkptSaver, ContextExchanger, EpisodeCollector, ModelExchanger, NStepEnhancer,
                                 OffPolicyLearner, StepCollector, data_pusher, eps_greedy_handler, gae_estimator,
                                 interaction_evaluator, multistep_trainer, online_logger, progress_bar,
                                 termination_checker, trainer)
from conveyor.policy import DQNPolicy
from tests.middleware.conftest import cartpole_envs  # noqa: F401  (the fixture)

FIELDS = {f.name for f in dataclasses.fields(OnlineRLContext)} - {"total_step"}  # the engine sets total_step


@dataclasses.dataclass
class Recording(OnlineRLContext):
    """Records (phase, 'get'|'set', field) while ``phase`` is set; a class-level log, since contexts are renewed."""

    phase = None
    log = []

    def __getattribute__(self, name):
        if name in FIELDS and Recording.phase:
            Recording.log.append((Recording.phase, "get", name))
        return super().__getattribute__(name)

    def __setattr__(self, name, value):
        if name in FIELDS and Recording.phase:
            Recording.log.append((Recording.phase, "set", name))
        super().__setattr__(name, value)


def touched(middleware, **given):
    """Run ``middleware`` for two iterations after a setup writing ``given``; {(phase, kind): fields} it touched."""
    Recording.log = []

    def setup(ctx):
        Recording.phase = None
        for name, value in given.items():
            setattr(ctx, name, value)
        Recording.phase = "forward"

    def marker(ctx):
        Recording.phase = "backward"

    try:
        with task.start(ctx=Recording()):
            task.use(setup)
            task.use(middleware)
            task.use(marker)
            task.run(max_step=2)
    finally:
        Recording.phase = None
    found = {}
    for phase, kind, name in Recording.log:
        found.setdefault((phase, kind), set()).add(name)
    return found


def assert_declared(middleware, **given):
    f = fields_of(middleware)
    assert f is not None, f"{middleware!r} declares nothing"
    got = touched(middleware, **given)
    allowed = {("forward", "get"): set(f.reads), ("forward", "set"): set(f.writes),
               ("backward", "get"): set(f.backward_reads), ("backward", "set"): set(f.backward_writes)}
    for key, names in got.items():
        assert names <= allowed[key], f"{middleware!r} {key}: touched {sorted(names - allowed[key])} undeclared"
    return got


@pytest.fixture
def cfg():
    return compile_config(EasyDict(dict(
        exp_name="test", seed=0,
        env=dict(env_id="CartPole-v1", collector_env_num=2, evaluator_env_num=2, n_evaluator_episode=2),
        policy=dict(nstep=2, collect=dict(n_sample=8, n_episode=1), learn=dict(batch_size=4, update_per_collect=1),
                    model=dict(hidden_sizes=[8]), eval=dict(evaluator=dict(eval_freq=1))),
    )), policy=DQNPolicy)


@pytest.fixture
def policy(cfg):
    return DQNPolicy(cfg.policy, seed=0)


def trajectories(n_steps=4, n_env=2):
    return ttorch.Tensor({"obs": torch.zeros(n_steps, n_env, 4), "action": torch.zeros(n_steps, n_env, dtype=torch.long),
                          "reward": torch.ones(n_steps, n_env), "next_obs": torch.zeros(n_steps, n_env, 4),
                          "terminated": torch.zeros(n_steps, n_env, dtype=torch.bool),
                          "truncated": torch.zeros(n_steps, n_env, dtype=torch.bool),
                          "valid": torch.ones(n_steps, n_env, dtype=torch.bool)})


class Learner:
    """A learn view that takes any batch."""

    def forward(self, batch):
        return {"loss": 0.0}

    def publish(self):
        return 0


class Critic:
    def value(self, obs, **state):
        return np.zeros(len(obs), np.float32)


def test_collectors_and_exploration(cfg, policy, cartpole_envs):
    got = assert_declared(StepCollector(cfg, policy.collect_mode, cartpole_envs(2)), collect_kwargs={"eps": 0.5})
    assert {"trajectories", "env_step"} <= got[("forward", "set")]
    assert_declared(EpisodeCollector(cfg, policy.collect_mode, cartpole_envs(2)), collect_kwargs={"eps": 0.5})
    assert_declared(eps_greedy_handler(cfg))


def test_enhancer_advantages_pusher_and_learners(cfg, policy):
    assert_declared(NStepEnhancer(0.99, 2), trajectories=trajectories())
    assert_declared(gae_estimator(EasyDict(policy=dict(discount_factor=0.99, gae_lambda=0.95, learn={})), Critic()),
                    trajectories=trajectories())
    buffer = DequeBuffer(100)
    assert_declared(data_pusher(cfg, buffer), trajectories=trajectories())
    assert_declared(OffPolicyLearner(cfg, Learner(), buffer))
    batch = ttorch.Tensor({"obs": torch.zeros(8, 4), "reward": torch.zeros(8)})
    learn = EasyDict(policy=dict(learn=dict(epoch_per_collect=1, batch_size=4)), seed=0)
    assert_declared(multistep_trainer(learn, Learner()), train_data=batch)
    assert_declared(trainer(learn, Learner()), train_data=batch)


def test_evaluator_checkpoints_budget_loggers_and_exchangers(cfg, policy, cartpole_envs, tmp_path):
    assert_declared(interaction_evaluator(cfg, policy.eval_mode, cartpole_envs(2)))
    assert_declared(termination_checker(max_env_step=10, max_train_iter=10))

    class Bar:
        def __init__(self, **kwargs):
            pass

        update = set_postfix = refresh = close = lambda self, *a, **k: None

    for make in (lambda: CkptSaver(policy, tmp_path, train_freq=1), lambda: online_logger(str(tmp_path / "tb")),
                 lambda: progress_bar(make_bar=Bar), ContextExchanger, lambda: ModelExchanger(policy)):
        with task.start():  # built where task.on works, as in a pipeline
            mw = make()
        got = assert_declared(mw, eval_output={"mean": 1.0, "std": 0.0}, train_output=[{"loss": 1.0}])
        assert got or isinstance(mw, (ContextExchanger, ModelExchanger))  # without a router they touch nothing
