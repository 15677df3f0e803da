"""Policies: models plus algorithms, each seen through a learn, a collect and an eval view.

A learning step returns a :class:`LearnResult`; acting reads the versions :class:`VersionedWeights` publishes.

Imports only ``conveyor.schema`` and ``conveyor.data`` of Conveyor: a policy works without a pipeline.
"""
from conveyor.policy.base import Policy, Stateful, configured_device
from conveyor.policy.data_parallel import DataParallel, DataParallelError, SignedStore
from conveyor.policy.learning import LazyOptimizer, LearnResult, TargetSync, hard_update, make_target, soft_update
from conveyor.policy.views import (ActorCriticCollectMode, ActorCriticLearnMode, CollectMode, EvalMode, LearnMode,
                                   Snapshot)
from conveyor.policy.weights import Acting, ModuleVersions, VersionedWeights
from conveyor.policy.actor_critic import ActorCritic
from conveyor.policy.bc import BCPolicy
from conveyor.policy.continuous import (
    ActionScaler,
    DeterministicActor,
    EnsembleLinear,
    EnsembleQ,
    TanhGaussianActor,
    tanh_gaussian_log_prob,
    tanh_log_det_jacobian,
)
from conveyor.policy.cql import CQLPolicy, DiscreteCQLPolicy, continuous_cql_penalty, discrete_cql_penalty
from conveyor.policy.dqn import DQNPolicy
from conveyor.policy.export import GreedyModule
from conveyor.policy.impala import IMPALAPolicy
from conveyor.policy.iql import IQLModel, IQLPolicy, expectile_loss
from conveyor.policy.model import (MLP, ConvEncoder, DictEncoder, EncoderHead, FlattenMLP, ImpalaCNN, NatureCNN,
                                   ObsShape, QNetwork, build_encoder)
from conveyor.policy.normaliser import ObsNormaliser, RewardNormaliser, RunningMeanStd
from conveyor.policy.ppo import PPOPolicy
from conveyor.policy.marl_model import AgentNet, TeamActorCritic, bootstrap_agent_mask, team_inputs
from conveyor.policy.mappo import IPPOPolicy, MAPPOPolicy
from conveyor.policy.qmix import QMixer, QMIXPolicy, VDNMixer
from conveyor.policy.q_actor_critic import QActorCriticPolicy
from conveyor.policy.sac import SACModel, SACPolicy, TanhActorCriticPolicy
from conveyor.policy.td3 import TD3Policy
from conveyor.policy.vtrace import VTrace, vtrace

__all__ = [
    "Policy",
    "configured_device",
    "LearnResult",
    "LazyOptimizer",
    "DataParallel",
    "DataParallelError",
    "SignedStore",
    "VersionedWeights",
    "ModuleVersions",
    "LearnMode",
    "CollectMode",
    "EvalMode",
    "Snapshot",
    "Acting",
    "Stateful",
    "make_target",
    "hard_update",
    "soft_update",
    "TargetSync",
    "DQNPolicy",
    "GreedyModule",
    "ObsShape",
    "MLP",
    "FlattenMLP",
    "ConvEncoder",
    "DictEncoder",
    "build_encoder",
    "NatureCNN",
    "ImpalaCNN",
    "QNetwork",
    "PPOPolicy",
    "MAPPOPolicy",
    "IPPOPolicy",
    "QMIXPolicy",
    "QMixer",
    "VDNMixer",
    "AgentNet",
    "TeamActorCritic",
    "bootstrap_agent_mask",
    "team_inputs",
    "IMPALAPolicy",
    "vtrace",
    "VTrace",
    "ActorCritic",
    "ActorCriticCollectMode",
    "ActorCriticLearnMode",
    "ObsNormaliser",
    "RewardNormaliser",
    "RunningMeanStd",
    "SACPolicy",
    "SACModel",
    "ActionScaler",
    "TanhGaussianActor",
    "EnsembleQ",
    "EnsembleLinear",
    "tanh_gaussian_log_prob",
    "tanh_log_det_jacobian",
    "TanhActorCriticPolicy",
    "QActorCriticPolicy",
    "TD3Policy",
    "DeterministicActor",
    "EncoderHead",
    "BCPolicy",
    "CQLPolicy",
    "DiscreteCQLPolicy",
    "discrete_cql_penalty",
    "continuous_cql_penalty",
    "IQLPolicy",
    "IQLModel",
    "expectile_loss",
]
