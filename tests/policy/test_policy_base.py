"""The Policy base contract: views, config schema, checkpoint hooks, import layering."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import conveyor.policy
from conveyor.policy import Policy
from conveyor.schema import ConfigError, Option, merge_schemas


class RunningMean:
    """A stand-in observation normaliser: checkpointed state that is not a module."""

    def __init__(self) -> None:
        self.mean, self.count = 0.0, 0

    def update(self, x: np.ndarray) -> None:
        self.count += x.size
        self.mean += (float(x.sum()) - self.mean * x.size) / self.count

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.count = state["mean"], state["count"]


class EchoPolicy(Policy):
    """A minimal subclass: records what the views pass to its hooks."""

    @classmethod
    def config_schema(cls) -> dict:
        return merge_schemas(super().config_schema(), {"other": {"scale": Option(2.0, "Action scale.")}})

    @classmethod
    def build_model(cls, model_cfg) -> nn.Module:
        return nn.Linear(model_cfg.obs_shape, model_cfg.action_shape)

    def __init__(self, cfg, model=None, **kwargs) -> None:
        super().__init__(cfg, model, **kwargs)
        self.normaliser = RunningMean()
        self.register_state("obs_normaliser", self.normaliser)
        self.resets: list = []
        self.grad_enabled: list[bool] = []

    def _forward_learn(self, batch):
        self.train_iter += 1
        return {"losses/echo": float(batch.reward.sum()), "charts/obs_type": type(batch.obs).__name__}

    def _forward_collect(self, acting, obs, **kwargs):
        self.grad_enabled.append(torch.is_grad_enabled())
        self.normaliser.update(obs.numpy())
        acting.memory["view"] = "collect"
        return {"action": acting.model(obs).argmax(-1).numpy(), "kwargs": kwargs, "obs_type": type(obs)}

    def _forward_eval(self, acting, obs):
        self.grad_enabled.append(torch.is_grad_enabled())
        acting.memory["view"] = "eval"
        return {"action": acting.model(obs).argmax(-1).numpy()}

    def _reset(self, memory, env_ids):
        self.resets.append((memory.get("view"), env_ids))


def echo_policy(**kwargs) -> EchoPolicy:
    return EchoPolicy({"model": {"obs_shape": 3, "action_shape": 2}}, **kwargs)


def test_collect_view_converts_numpy_once_and_passes_kwargs_without_grad():
    policy = echo_policy()
    out = policy.collect_mode.forward(np.ones((4, 3), np.float32), eps=0.2, temperature=1.0)
    assert out["action"].shape == (4,)
    assert out["kwargs"] == {"eps": 0.2, "temperature": 1.0}
    assert out["obs_type"] is torch.Tensor
    assert policy.grad_enabled == [False]


def test_eval_view_runs_without_grad():
    policy = echo_policy()
    policy.eval_mode.forward(np.ones((2, 3), np.float32))
    assert policy.grad_enabled == [False]


def test_reset_views_reach_their_hooks_with_env_ids():
    policy = echo_policy()
    policy.collect_mode.forward(np.ones((4, 3), np.float32))
    policy.eval_mode.forward(np.ones((4, 3), np.float32))
    policy.collect_mode.reset([1, 3])
    policy.eval_mode.reset()
    assert policy.resets == [("collect", [1, 3]), ("eval", None)]


def test_learn_view_accepts_a_dict_of_numpy_and_counts_through_train_iter():
    policy = echo_policy()
    out = policy.learn_mode.forward({"obs": np.zeros((5, 3), np.float32), "reward": np.ones(5, np.float32)})
    assert out["losses/echo"] == 5.0 and out["charts/obs_type"] == "Tensor"
    assert policy.learn_mode.train_iter == 1


def test_views_expose_only_their_modes_methods():
    policy = echo_policy()
    public = {name for name in dir(policy.collect_mode) if not name.startswith("_")}
    assert public == {"forward", "reset", "snapshot", "version", "state_dict", "load_state_dict"}  # its memory, rng
    assert {name for name in dir(policy.eval_mode) if not name.startswith("_")} == \
        {"forward", "reset", "snapshot", "version"}
    assert {name for name in dir(policy.learn_mode) if not name.startswith("_")} == \
        {"forward", "publish", "set_lr_factor", "train_iter", "state_dict", "load_state_dict", "join_data_parallel"}


def test_registered_state_joins_the_checkpoint():
    policy = echo_policy(seed=0)
    policy.collect_mode.forward(np.full((4, 3), 2.0, np.float32))
    policy.learn_mode.forward({"obs": np.zeros((1, 3), np.float32), "reward": np.ones(1, np.float32)})
    state = policy.state_dict()
    assert set(state) == {"model", "rng", "obs_normaliser", "counters"}

    resumed = echo_policy(seed=1)
    resumed.load_state_dict(state)
    assert (resumed.normaliser.mean, resumed.normaliser.count) == (2.0, 12)
    assert resumed.learn_mode.train_iter == 1
    assert resumed.rng.random() == policy.rng.random()


def test_checkpoint_from_another_policy_class_is_rejected():
    state = echo_policy().state_dict()
    del state["obs_normaliser"]
    with pytest.raises(KeyError, match="missing \\['obs_normaliser'\\]"):
        echo_policy().load_state_dict(state)


def test_registering_a_name_twice_or_a_stateless_object_is_an_error():
    policy = echo_policy()
    with pytest.raises(ValueError, match="already registered"):
        policy.register_state("model", nn.Linear(1, 1))
    with pytest.raises(TypeError, match="needs state_dict"):
        policy.register_state("plain", object())


def test_subclass_schema_extends_the_base_schema():
    cfg = EchoPolicy.default_config()
    assert cfg.other.scale == 2.0
    assert {"cuda", "discount_factor", "model", "learn", "collect", "eval", "other"} <= set(cfg)
    assert set(cfg.learn) >= {"batch_size", "learning_rate", "update_per_collect", "grad_clip"}
    assert cfg.learn.grad_clip is None and cfg.collect.n_sample > 0 and cfg.eval.evaluator.eval_freq > 0


def test_grad_clip_accepts_a_float_and_rejects_a_negative():
    assert echo_policy().cfg.learn.grad_clip is None
    cfg = {"model": {"obs_shape": 3, "action_shape": 2}, "learn": {"grad_clip": 10}}
    assert EchoPolicy(cfg).cfg.learn.grad_clip == 10
    with pytest.raises(ConfigError, match=r"policy\.learn\.grad_clip"):
        EchoPolicy({**cfg, "learn": {"grad_clip": -1.0}})


@pytest.mark.parametrize("cls, model", [("PPOPolicy", {"action_space": "gaussian"}), ("SACPolicy", {}),
                                        ("TD3Policy", {}), ("BCPolicy", {"action_space": "continuous"})])
@pytest.mark.parametrize("bound", [[True, 1.0], [], True])
def test_every_continuous_policy_refuses_an_action_bound_of_bools_or_no_values(cls, model, bound):
    with pytest.raises(ConfigError, match=r"policy\.model\.action_low"):
        getattr(conveyor.policy, cls)({"model": {"obs_shape": 3, "action_shape": 2, **model, "action_low": bound,
                                                 "action_high": 2.0}})


@pytest.mark.parametrize("cls, model", [("PPOPolicy", {"action_space": "gaussian"}), ("SACPolicy", {}),
                                        ("TD3Policy", {}), ("BCPolicy", {"action_space": "continuous"})])
def test_every_continuous_policy_takes_an_action_bound_of_ints_and_floats(cls, model):
    cfg = {"model": {"obs_shape": 3, "action_shape": 2, **model, "action_low": [-1, -2.5], "action_high": 2}}
    assert getattr(conveyor.policy, cls)(cfg).cfg.model.action_low == [-1, -2.5]


def test_cuda_config_without_a_cuda_device_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"policy\.cuda=False"):
        EchoPolicy({"cuda": True, "model": {"obs_shape": 3, "action_shape": 2}})
    assert echo_policy().device == torch.device("cpu")


def test_given_model_replaces_the_built_one():
    model = nn.Linear(3, 2)
    assert echo_policy(model=model).model is model


def test_policy_package_imports_no_upper_layer():
    forbidden = ("conveyor.engine", "conveyor.middleware", "conveyor.envs", "conveyor.zoo")
    root = pathlib.Path(conveyor.policy.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.startswith(forbidden)]
            assert not bad, f"{path.name} imports {bad}"


def test_public_names_are_exported():
    for name in conveyor.policy.__all__:
        assert getattr(conveyor.policy, name) is not None


ACT_THEN_CHECKPOINT = """
import sys
import numpy as np
from conveyor.config import compile_config
from conveyor.zoo.{entry} import main_config
from conveyor.policy import {cls}
policy = {cls}(compile_config(main_config, policy={cls}).policy)
policy.eval_mode.forward(np.zeros((2, {obs_dim}), dtype=np.float32))
acted = 'torch._dynamo' in sys.modules
replica = {cls}(compile_config(main_config, policy={cls}).policy)
replica.load_state_dict(policy.state_dict())  # a collector's checkpoint, and a resume from it
replica.state_dict()
print(acted, 'torch._dynamo' in sys.modules)
"""


@pytest.mark.parametrize("entry, cls, obs_dim", [("cartpole.dqn", "DQNPolicy", 4), ("cartpole.ppo", "PPOPolicy", 4),
                                                 ("cartpole.impala", "IMPALAPolicy", 4),
                                                 ("pendulum.sac", "SACPolicy", 3), ("pendulum.iql", "IQLPolicy", 3),
                                                 ("pendulum.td3", "TD3Policy", 3)])
def test_a_policy_that_only_acts_makes_no_optimizer_so_never_imports_torch_dynamo(entry, cls, obs_dim):
    """A torch optimizer imports torch._dynamo when made (1.5 s): a collector or evaluator process never pays it,
    not even to save or load a checkpoint."""
    code = ACT_THEN_CHECKPOINT.format(entry=entry, cls=cls, obs_dim=obs_dim)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]
