"""Policies: models plus algorithms, each seen through a learn, a collect and an eval view.

Imports only ``conveyor.schema`` and ``conveyor.data`` of Conveyor: a policy works without a pipeline.
"""
from conveyor.policy.base import (
    CollectMode,
    EvalMode,
    LearnMode,
    Policy,
    Stateful,
    hard_update,
    make_target,
    soft_update,
)
from conveyor.policy.dqn import DQNPolicy
from conveyor.policy.model import MLP, ConvEncoder, DictEncoder, FlattenMLP, ObsShape, QNetwork, build_encoder

__all__ = [
    "Policy",
    "LearnMode",
    "CollectMode",
    "EvalMode",
    "Stateful",
    "make_target",
    "hard_update",
    "soft_update",
    "DQNPolicy",
    "ObsShape",
    "MLP",
    "FlattenMLP",
    "ConvEncoder",
    "DictEncoder",
    "build_encoder",
    "QNetwork",
]
