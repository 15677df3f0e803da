"""QMIX on MPE's simple_spread_v3 (3 agents cover 3 landmarks, 5 discrete actions, episodes of 25 steps).

    conveyor train mpe/qmix [--set policy.model.mixer=vdn] [--seed N] [--max-env-step N] [--resume] [--async]
    conveyor train mpe/qmix --collectors 2

Trains the off-policy family's team pipeline, :func:`conveyor.zoo.off_policy.q_mixing`: eps-greedy GRU agents
(parameters shared, one-hot agent ids) collect one whole episode per env per round (``n_sample = 8 envs * 25
steps``), each episode is a sequence in the replay buffer, and QMIX (or VDN) learns on batches of sequences with
double Q and a target network. The evaluation is the team return (sum over agents) of greedy episodes.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import QMIXPolicy
from conveyor.run import Run
from conveyor.zoo import off_policy

main_config = EasyDict(dict(
    exp_name="mpe_qmix",
    seed=0,
    env=dict(env_id="mpe/simple_spread_v3", env_kwargs=dict(max_cycles=25, continuous_actions=False),
             collector_env_num=8, evaluator_env_num=10, n_evaluator_episode=10, stop_value=None),
    policy=dict(
        discount_factor=0.95,  # 25-step episodes
        model=dict(mixer="qmix", hidden_sizes=[64], rnn_hidden_size=64),
        # One round = one episode per env (200 env steps), then 4 gradient steps on batches of 32 episodes. Tuned on
        # seeds 0-2 (docs/multi-agent.md has the figures): against pymarl's lr 5e-4, hard target copies every 200
        # steps, gamma 0.99 and eps over 50k steps, a faster lr, a soft target (0.01 per step), gamma 0.95 and eps
        # over 10k steps learn within tens of thousands of env steps; hard copies every 100 or 200 steps dropped
        # below random for the first 10-15k.
        learn=dict(batch_size=32, learning_rate=1e-3, update_per_collect=4, target_theta=0.01, grad_clip=10.0),
        collect=dict(n_sample=8 * 25),
        eval=dict(evaluator=dict(eval_freq=100)),
        other=dict(eps=dict(kind="linear", start=1.0, end=0.05, decay=10_000),
                   replay_buffer=dict(size=5000)),  # sequences (episodes), as pymarl's 5000
    ),
))
"""The default config; every key is documented in QMIXPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = off_policy.q_mixing
"""What this entry trains: the off-policy family's team pipeline, ``conveyor/zoo/off_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, **options: Any) -> OnlineRLContext:
    """Train QMIX (or VDN: ``policy.model.mixer='vdn'``) on simple_spread; returns the final context. ``options``:
    :class:`~conveyor.run.Run`'s (``seed``, ``exp_name``, ``max_env_step``, ``resume``...)."""
    return Run(pipeline, main_config, QMIXPolicy, cfg, **options).train()
