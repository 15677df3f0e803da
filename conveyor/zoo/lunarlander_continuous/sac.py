"""SAC on LunarLanderContinuous-v3 (Box2D; needs ``pip install "gymnasium[box2d]"``).

    conveyor train lunarlander_continuous/sac [--seed N] [--exp-name NAME] [--max-env-step N] [--resume] [--async]

docs/continuous.md shows its learning curve over a fixed budget (``benchmarks/learning_curve.py``).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from easydict import EasyDict

from conveyor.engine import OnlineRLContext
from conveyor.policy import SACPolicy
from conveyor.run import Run
from conveyor.schema import ConfigError
from conveyor.zoo import off_policy

main_config = EasyDict(dict(
    exp_name="lunarlander_continuous_sac",
    seed=0,
    env=dict(env_id="LunarLanderContinuous-v3", collector_env_num=4, evaluator_env_num=5, n_evaluator_episode=10,
             stop_value=200.0),
    policy=dict(
        discount_factor=0.99,
        nstep=3,
        model=dict(hidden_sizes=[128, 128]),
        learn=dict(batch_size=256, learning_rate=1e-3, update_per_collect=4, learning_starts=5000,
                   target_theta=0.01, auto_alpha=True, alpha=0.2),
        collect=dict(n_sample=8, random_collect_size=5000),
        eval=dict(evaluator=dict(eval_freq=5000)),
        other=dict(replay_buffer=dict(size=300_000)),
    ),
))
"""The default config; every key is documented in SACPolicy.config_schema() and conveyor.envs.ENV_SCHEMA."""


pipeline = off_policy.actor_critic
"""What this entry trains: the off-policy family's pipeline, ``conveyor/zoo/off_policy.py``."""


def main(cfg: Optional[Mapping[str, Any]] = None, *, record: Optional[Any] = None, **options: Any) -> OnlineRLContext:
    """Train SAC on LunarLanderContinuous; ``record``: a :class:`~conveyor.data.DatasetWriter` that receives every whole
    episode the run collects (``conveyor collect --d4rl``; one process only); returns the final context. ``options``:
    :class:`~conveyor.run.Run`'s (``seed``, ``exp_name``, ``max_env_step``, ``resume``...)."""
    _require_box2d()
    return Run(off_policy.recording(pipeline, record, options.get("async_mode", False)), main_config, SACPolicy, cfg,
               ckpt_freq=5000, **options).train()


def _require_box2d() -> None:
    try:
        import Box2D  # noqa: F401
        import pygame  # noqa: F401  (gymnasium's box2d package imports it, even without rendering)
    except ImportError as exc:
        raise ConfigError(f"lunarlander_continuous/sac needs Box2D, but {exc.name} is not installed: run "
                          f"pip install \"gymnasium[box2d]\" and start again") from None
