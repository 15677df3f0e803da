"""Distributed ``atari/impala`` runs measured as benchmarks/impala_throughput.py describes them (its module docstring
has the figures), for it and benchmarks/trajectory_transport.py."""
from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path
from typing import Any, Dict

from benchmarks._harness import scratch_dir, tensorboard_scalars

ENTRY = "atari/impala"
QUICK_ENV_STEPS = 100
"""The smoke run's agent steps a run: the quick learner logs at its first gradient step and every 10 after, and the
figure needs 3 points. With the quick config the learner took 0.4 gradient steps an agent step in every run
measured (1 and 2 collectors, 100 to 1,200 steps, load 2-15: 8 per 20-step unroll); 100 agent steps ran 6 unrolls,
48 gradient steps, 5 points (gradient steps 1, 11, 21, 31, 41), two to spare. 150 took 111 s a run at load 15, and
the 2-collector run did not end within the test's 240 s."""
QUICK_LOG_FREQ = 10


def config(quick: bool, transport: str = "auto") -> Any:
    """The entry's config with evaluation reduced to the learner's opening game on one env; ``quick``: 2 envs,
    unrolls of 10 steps and a gradient step per unroll, logged every 10 gradient steps, so that the learner logs
    its points within a hundred agent steps. ``transport``: the config key (batches through shared memory or nng)."""
    from conveyor.zoo import load_entry

    cfg = copy.deepcopy(load_entry(ENTRY).main_config)
    cfg.exp_name = "impala_throughput"
    cfg.transport = transport
    cfg.env.update(evaluator_env_num=1, n_evaluator_episode=1)
    cfg.policy.eval.evaluator.eval_freq = 10**9  # the learner evaluates (no evaluator nodes): once, at the start
    cfg.policy.eval.evaluator.pop("eval_env_step_freq", None)
    if quick:
        cfg.env.collector_env_num = 2
        cfg.policy.collect.n_sample = 2 * 10
        cfg.policy.learn.batch_size = 1
        cfg.policy.learn.log_freq = QUICK_LOG_FREQ
    return cfg


def measure(collectors: int, env_steps: int, quick: bool, seed: int, transport: str = "auto") -> Dict[str, Any]:
    """Train the entry with ``collectors`` collector processes for ``env_steps`` agent steps; the figures above, and
    ``shared_batches``, those the learner took through shared memory."""
    from conveyor.run import train_distributed
    from conveyor.zoo import load_entry

    cfg = config(quick, transport)
    with scratch_dir():
        start = time.time()
        run = train_distributed(load_entry(ENTRY), collectors=collectors, cfg=cfg, seed=seed, max_env_step=env_steps,
                                progress=False, no_stop=True)
        end = time.time()
        scalars = tensorboard_scalars(Path("runs") / cfg.exp_name / "tb")
    points = scalars.get("charts/env_steps_per_s", [])
    if len(points) < 3:
        raise RuntimeError(f"the learner logged {len(points)} env_steps_per_s points in {env_steps} agent steps, "
                           f"3 are needed: give more --env-steps (it logs every {cfg.policy.learn.log_freq} gradient "
                           f"steps)")
    (s0, _, t0), (s1, _, t1) = points[1], points[-1]
    nodes = [n for n in run.nodes if n["role"] == "collector"]
    first = min(n["first_step_at"] for n in nodes if n["first_step_at"] is not None)
    lags = [value for _, value, _ in scalars.get("charts/policy_lag", [])]
    lag_max = [value for _, value, _ in scalars.get("charts/policy_lag_max", [])]
    return {"collectors": collectors, "steps_per_s": (s1 - s0) / (t1 - t0), "window": [s0, s1],
            "collected_steps_per_s": sum(n["collected"] for n in nodes) / (end - first),
            "policy_lag": statistics.fmean(lags) if lags else None, "policy_lag_max": max(lag_max, default=None),
            "env_step": run.env_step, "train_iter": run.train_iter, "wall_s": end - start,
            "shared_batches": sum(n.get("shared_batches", 0) for n in run.nodes if n["role"] == "learner")}
