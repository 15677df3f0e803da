"""Where a distributed run's collectors act (``--inference``): each on its own replica of the policy (``local``), or
through one inference server node (``server``, :mod:`conveyor.middleware.inference`), and which is the default.

The rule, measured with ``benchmarks/inference_server.py`` (docs/distributed.md has the figures): ``server`` where
the whole run starts on this host with two collectors or more (with one there is nothing to batch, and one
collector's figures were measured acting locally) and either torch sees a CUDA device (one forward pass on the GPU
for every collector) or the policy acts on images (a convolutional encoder: on a 2-core CPU machine atari/impala and atari/ppo
collected 1.27-1.52x the env steps/s through the server, for 1.12-1.18x the CPU per step); else ``local`` (an MLP
policy: the server's messages cost more than its batching saves, cartpole/impala and cartpole/ppo 0.72-0.76x), and for a
policy that keeps a state per env (recurrent, or a team's), which the server cannot hold.
"""
from __future__ import annotations

from typing import Any, Mapping

from conveyor.envs import is_multi_agent_id

__all__ = ["IMAGE_ENCODERS", "INFERENCE", "acts_on_images", "default_inference", "keeps_state"]

INFERENCE = ("local", "server")
"""The values of ``--inference``."""
IMAGE_ENCODERS = ("nature", "impala")
"""``policy.model.encoder`` kinds that are convolutional (conveyor.policy.encoders)."""


def acts_on_images(config: Mapping[str, Any]) -> bool:
    """Whether the policy of an entry's ``config`` has a convolutional encoder: ``policy.model.encoder`` an image
    kind, or ``auto`` over an image ``obs_shape`` where the config gives one (an uncompiled one may not)."""
    model = config.get("policy", {}).get("model", {})
    shape = model.get("obs_shape")
    return model.get("encoder") in IMAGE_ENCODERS or (model.get("encoder", "auto") == "auto" and shape is not None
                                                      and not isinstance(shape, (int, Mapping)) and len(shape) == 3)


def keeps_state(config: Mapping[str, Any]) -> bool:
    """Whether the policy of an entry's ``config`` may keep a state per env, which the server cannot hold: a
    recurrent core (``policy.model.rnn``), or a team's envs (whose policies, QMIX's, are recurrent by default)."""
    return bool(config.get("policy", {}).get("model", {}).get("rnn")) \
        or is_multi_agent_id(config.get("env", {}).get("env_id"))


def default_inference(config: Mapping[str, Any], cuda: bool, one_host: bool = True, collectors: int = 2) -> str:
    """``--inference`` when not given, for an entry's ``config`` and a run of ``collectors``: the rule in the module
    docstring (never the server for a policy that :func:`keeps_state`)."""
    return "server" if one_host and collectors >= 2 and not keeps_state(config) and (cuda or acts_on_images(config)) \
        else "local"
