"""MAPPO and QMIX on MPE's simple_spread against BenchMARL's, over the same env-step budget: team return and speed.

Per seed (100-102 by default; mpe/mappo and mpe/qmix were tuned on seeds 0-2, never on these), four runs, each
from scratch in a fresh interpreter on one torch thread (``--quick``: ours in this process), the order of the two
sides reversed every other seed:

- ours: the ``mpe/mappo`` and ``mpe/qmix`` zoo entries as they ship (trained as ``conveyor train ENTRY --seed N
  --max-env-step B`` trains them, through ``benchmarks._training.run_seed``: no early stop), evaluated at the
  start and once more at the end of the budget;
- BenchMARL's ``MappoConfig`` and ``QmixConfig`` on its ``PettingZooTask.SIMPLE_SPREAD``, run by
  ``Experiment.run()`` with ``max_n_frames = B`` (a BenchMARL frame is one step of the team's env, as our env
  step) and evaluated at its first iteration and at the end. BenchMARL (with TorchRL and PettingZoo) is
  pip-installed by this script into a virtualenv of its own (``benchmarks._harness.peer_python``): TorchRL 0.11
  reads MPE from ``pettingzoo.mpe``, which PettingZoo 1.25 moved out into ``mpe2`` (what we use), so it needs
  PettingZoo 1.24.3, its own CI's pin.

What matches. The scenario: simple_spread_v3, N=3 agents, episodes of ``max_cycles=25`` steps, ``local_ratio=0.5``,
discrete actions (5 per agent; BenchMARL's ``prefer_continuous_actions=False``), set explicitly on both sides.
``mpe2`` 1.1.1 and ``pettingzoo.mpe`` 1.24.3 are the same simulator: the same seeds and actions give the same
observations, states and rewards (checked when this benchmark was written). Both sides take their hyperparameters
from our entry's config (:func:`benchmarl_settings` maps each): MAPPO: 8 envs, 800 env steps a rollout, 20
minibatches of 400 env steps a rollout (10 epochs x 2; BenchMARL's ``on_policy_n_minibatch_iters`` counts epochs,
passes over the rollout, not minibatches), Adam lr 5e-4 (eps 1e-5), gamma 0.99, GAE lambda 0.95,
clip 0.2, entropy 0.01, value coefficient 1, gradient norm 10, a shared actor and a shared critic on the global
state, MLPs [64, 64] with ReLU. QMIX: 8 envs, 200 env steps a round then 4 updates, batches of 32 x 25
transitions, Adam lr 1e-3, gamma 0.95, soft target updates 0.01, gradient norm 10, mixing embedding 32, epsilon
1.0 -> 0.05 over 10,000 env steps, replay of 5000 x 25 transitions, team reward = the mean over agents. Both
evaluate greedily, on :data:`EVAL_EPISODES` episodes at the end.

What cannot match (each side keeps what its library has, no option on the other): our MAPPO appends one-hot agent
ids to the shared networks' inputs, normalises advantages per minibatch and learns normalised values (MAPPO's
value normalisation); BenchMARL's shares an MLP on the observation alone (the critic: the state alone), with
neither normalisation. Our QMIX's agents are recurrent (an MLP [64] then a GRU of 64) and learn on whole episodes
(32 sequences of 25 steps) with double Q; BenchMARL's are MLPs [64, 64] (a dense layer where we have the GRU)
learning on 800 transitions sampled alone, with a plain target network (no double Q). Evaluation episodes are
each side's own (ours: the evaluator's envs, seeded from 100000 + the run's seed; theirs: its test env).

Figures. The team return of an evaluation episode is the sum over agents and steps of the rewards (BenchMARL logs
the mean over agents, a third of it: we sum its evaluation rollouts ourselves, in the ``on_evaluation_end``
callback of ``benchmarks._benchmarl``). ``mappo_return`` / ``benchmarl_mappo_return`` (and the QMIX pair) are the
means over seeds of the final evaluation's mean team return. simple_spread's rewards are negative distances and
collision penalties, so every team return is negative and the ratio is taken so that above 1 means ours is
better: per seed theirs / ours when both are negative (ours / theirs when both are positive, none for mixed
signs), ``return_ratio`` and ``qmix_return_ratio`` the medians over seeds. ``random_return`` (uniformly random actions, 100 episodes) is given
beside them for scale. ``steps_per_s`` and ``benchmarl_steps_per_s`` are MAPPO's, the median over seeds of the
run's env steps / its wall seconds (setting up its envs, training and both evaluations; not the interpreter's
start nor imports); ``speed_ratio`` the median over seeds of ours / theirs, the two runs of a seed being adjacent
in time (the load of a shared machine drifts over the whole benchmark far more than between them), or, with
``--jobs 2``, running at the same time on a core each; ``qmix_steps_per_s``, ``benchmarl_qmix_steps_per_s`` and
``qmix_speed_ratio`` the same for QMIX. Targets: both return ratios >= 1.0, ``speed_ratio`` >= 1.5 on CPU.

    python -m benchmarks.marl_learning --max-env-step 12000    # 3 seeds x 4 runs: 22 min on 2 shared, loaded cores
    python -m benchmarks.marl_learning --max-env-step 80000 --jobs 2   # each seed's two sides at once
    python -m benchmarks.marl_learning --quick       # ours only, in this process, 1 seed, 1 rollout of each entry
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

from benchmarks._harness import (PeerInstallError, add_worker_option, peer_python, print_json_line, run_worker,
                                 scratch_dir, worker_done)

ENTRIES = {"mappo": "mpe/mappo", "qmix": "mpe/qmix"}
"""Our side of each comparison: the zoo entry trained as it ships."""
SCENARIO = {"N": 3, "max_cycles": 25, "local_ratio": 0.5, "continuous_actions": False}
"""simple_spread_v3's keywords, set explicitly on both sides (``env.env_kwargs`` on ours, the task's config on
BenchMARL's)."""
BENCHMARL = ("torch==2.13.0", "benchmarl==1.5.2", "torchrl==0.11.1", "pettingzoo[mpe]==1.24.3")
"""BenchMARL's virtualenv: its newest release, the TorchRL it allows, the PettingZoo whose MPE TorchRL reads, and
our torch (the CPU build where pip is given one)."""
EVAL_EPISODES = 40
"""Greedy episodes of the final evaluation, both sides (a multiple of both entries' evaluator envs, 8 and 10)."""
QUICK = {"mappo": 800, "qmix": 200}
"""The smoke run's budgets: a rollout of mpe/mappo (8 envs x 100 steps), a round of mpe/qmix (8 x 25); each run
evaluates at the budget and goes on to the end of the next rollout or round."""
QUICK_EVAL_EPISODES = 10
RANDOM_EPISODES = 100
"""Episodes of random actions behind ``random_return`` (:data:`QUICK_EVAL_EPISODES` with ``--quick``: a smoke run)."""
SIDES = ("mappo", "benchmarl_mappo", "qmix", "benchmarl_qmix")


def ours(algo: str, seed: int, budget: int, eval_episodes: int, settings: Dict[str, Any]) -> Dict[str, Any]:
    """Our zoo entry for ``algo`` on :data:`SCENARIO` for ``budget`` env steps; its final evaluation and speed.
    ``settings`` is BenchMARL's (the workers share one signature): the entry runs its own config."""
    import torch

    from benchmarks._training import run_seed
    from conveyor.zoo import load_entry

    torch.set_num_threads(1)
    overrides = [f"env.env_kwargs.{key}={value}" for key, value in SCENARIO.items()]
    with scratch_dir():
        run = run_seed(load_entry(ENTRIES[algo]), seed, budget, eval_every=budget, n_episode=eval_episodes,
                       overrides=overrides)
    return {"side": algo, "seed": seed, "final_return": run["final_return"], "env_steps": run["env_step"],
            "wall_s": run["wall_s"], "steps_per_s": run["env_step"] / run["wall_s"]}


def benchmarl(algo: str, seed: int, budget: int, eval_episodes: int, settings: Dict[str, Any]) -> Dict[str, Any]:
    """BenchMARL's MAPPO or QMIX (``algo``) on simple_spread with ``settings`` (:func:`benchmarl_settings`) for
    ``budget`` frames; the mean team return of its final evaluation and its speed. Runs in BenchMARL's venv."""
    import torch
    from torch import nn
    from benchmarl.algorithms import MappoConfig, QmixConfig
    from benchmarl.environments import PettingZooTask
    from benchmarl.experiment import Experiment, ExperimentConfig
    from benchmarl.models.mlp import MlpConfig

    from benchmarks._benchmarl import TeamReturns

    torch.set_num_threads(1)
    task = PettingZooTask.SIMPLE_SPREAD.get_from_yaml()
    task.config.update({key: value for key, value in SCENARIO.items() if key != "continuous_actions"})
    config = ExperimentConfig.get_from_yaml()
    config.prefer_continuous_actions = SCENARIO["continuous_actions"]
    config.max_n_frames = budget
    config.evaluation_interval = budget
    config.evaluation_episodes = eval_episodes
    config.evaluation_deterministic_actions = True
    config.loggers, config.create_json, config.render, config.checkpoint_at_end = [], True, False, False
    for key, value in settings["experiment"].items():
        setattr(config, key, value)
    algorithm = (MappoConfig if algo == "mappo" else QmixConfig).get_from_yaml()
    for key, value in settings["algorithm"].items():
        setattr(algorithm, key, value)
    model = MlpConfig(num_cells=settings["hidden_sizes"], activation_class=nn.ReLU, layer_class=nn.Linear)
    with scratch_dir() as folder:
        config.save_folder = str(folder)
        start = time.perf_counter()
        team_returns = TeamReturns()
        experiment = Experiment(task=task, algorithm_config=algorithm, model_config=model, critic_model_config=model,
                                seed=seed, config=config, callbacks=[team_returns])
        experiment.run()
        wall = time.perf_counter() - start
    return {"side": f"benchmarl_{algo}", "seed": seed, "final_return": team_returns.means[-1],
            "env_steps": experiment.total_frames, "wall_s": round(wall, 1),
            "steps_per_s": experiment.total_frames / wall}


def benchmarl_settings(algo: str) -> Dict[str, Any]:
    """Our entry's hyperparameters in BenchMARL's names: ``experiment`` and ``algorithm`` config values and the
    MLP's ``hidden_sizes`` (the module docstring lists what has no counterpart)."""
    from conveyor.zoo import load_entry

    cfg = load_entry(ENTRIES[algo]).main_config
    policy, learn, envs = cfg.policy, cfg.policy.learn, cfg.env.collector_env_num
    experiment = {"gamma": policy.discount_factor, "lr": learn.learning_rate, "clip_grad_norm": True,
                  "clip_grad_val": learn.get("grad_clip", 10.0), "share_policy_params": True}
    if algo == "mappo":
        experiment.update(adam_eps=1e-5, on_policy_collected_frames_per_batch=policy.collect.n_sample,
                          on_policy_n_envs_per_worker=envs, on_policy_minibatch_size=learn.batch_size,
                          on_policy_n_minibatch_iters=learn.epoch_per_collect)  # passes over the rollout: epochs
        algorithm = {"share_param_critic": True, "clip_epsilon": learn.clip_ratio, "entropy_coef": learn.entropy_coef,
                     "critic_coef": learn.get("value_coef", 1.0), "lmbda": policy.gae_lambda,
                     "loss_critic_type": "l2"}
        return {"experiment": experiment, "algorithm": algorithm, "hidden_sizes": list(policy.model.hidden_sizes)}
    episode = policy.collect.n_sample // envs  # the sequence our QMIX learns on: one episode per env per round
    eps = policy.other.eps
    experiment.update(adam_eps=1e-8, off_policy_collected_frames_per_batch=policy.collect.n_sample,
                      off_policy_n_envs_per_worker=envs, off_policy_n_optimizer_steps=learn.update_per_collect,
                      off_policy_train_batch_size=learn.batch_size * episode,
                      off_policy_memory_size=policy.other.replay_buffer.size * episode,
                      off_policy_init_random_frames=0, soft_target_update=True, polyak_tau=learn.target_theta,
                      exploration_eps_init=eps.start, exploration_eps_end=eps.end,
                      exploration_anneal_frames=eps.decay)
    algorithm = {"mixing_embed_dim": policy.model.get("mixing_embed_dim", 32), "delay_value": True,
                 "loss_function": "l2"}
    hidden = [*policy.model.hidden_sizes, policy.model.get("rnn_hidden_size", 64)]  # a dense layer for the GRU
    return {"experiment": experiment, "algorithm": algorithm, "hidden_sizes": hidden}


def random_team_return(episodes: int = RANDOM_EPISODES, seed: int = 0) -> float:
    """The mean team return of uniformly random actions on :data:`SCENARIO` (mpe2, as our envs)."""
    import numpy as np
    from mpe2 import simple_spread_v3

    env, rng, total = simple_spread_v3.parallel_env(**SCENARIO), np.random.default_rng(seed), 0.0
    for episode in range(episodes):
        env.reset(seed=seed + episode)
        while env.agents:
            _, rewards, _, _, _ = env.step({agent: int(rng.integers(env.action_space(agent).n))
                                            for agent in env.agents})
            total += sum(rewards.values())
    env.close()
    return total / episodes


def return_ratio(ours_return: float, theirs: float) -> Optional[float]:
    """Above 1 when ours is better: theirs / ours for two negative returns, ours / theirs for two positive ones,
    None for mixed signs (no such ratio means anything)."""
    if ours_return < 0 and theirs < 0:
        return theirs / ours_return
    if ours_return > 0 and theirs > 0:
        return ours_return / theirs
    return None


def median_or_none(values: List[Optional[float]]) -> Optional[float]:
    """The median of ``values``, None if any is None or there are none."""
    return round(statistics.median(values), 3) if values and None not in values else None


WORKERS = {"mappo": ours, "qmix": ours, "benchmarl_mappo": benchmarl, "benchmarl_qmix": benchmarl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=100, help="seeds run are first-seed, first-seed + 1, ...")
    parser.add_argument("--max-env-step", type=int, default=12_000,
                        help="env steps per run, both sides (a multiple of 800: whole rollouts of either algorithm)")
    parser.add_argument("--eval-episodes", type=int, default=EVAL_EPISODES)
    parser.add_argument("--algos", nargs="+", choices=sorted(ENTRIES), default=list(ENTRIES),
                        help="the comparisons to run (default both); the JSON line has the keys of those run")
    parser.add_argument("--jobs", type=int, choices=(1, 2), default=1,
                        help="2: the two sides of a seed run at the same time, one core each (half the wall time on "
                             "2 idle cores; their speeds are then measured side by side rather than one after the "
                             "other)")
    parser.add_argument("--quick", action="store_true",
                        help=f"ours only, 1 seed, {QUICK['mappo']} env steps of mpe/mappo and {QUICK['qmix']} of "
                             f"mpe/qmix, {QUICK_EVAL_EPISODES} evaluation and random-action episodes")
    add_worker_option(parser, SIDES)
    parser.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if worker_done(args, lambda side: WORKERS[side](side.removeprefix("benchmarl_"), args.seed, args.max_env_step,
                                                    args.eval_episodes, json.loads(args.settings))):
        return
    if not args.quick and args.max_env_step % 800:
        parser.error(f"--max-env-step {args.max_env_step}: give a multiple of 800 (whole rollouts of mpe/mappo, "
                     f"800 env steps, and of mpe/qmix, 200), e.g. {max(800, args.max_env_step // 800 * 800)}")
    budgets = QUICK if args.quick else {algo: args.max_env_step for algo in ENTRIES}
    eval_episodes = QUICK_EVAL_EPISODES if args.quick else args.eval_episodes
    seeds = list(range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds)))

    peer, peer_error = None, None
    if not args.quick:  # the smoke run installs and runs no peer
        try:
            peer = peer_python("benchmarl", BENCHMARL)
        except PeerInstallError as exc:
            peer_error = str(exc)
            print(f"BenchMARL's side is left out: {peer_error}", file=sys.stderr, flush=True)
    settings = {algo: benchmarl_settings(algo) for algo in args.algos}
    rows: Dict[str, List[Dict[str, Any]]] = {side: [] for side in SIDES}
    for i, seed in enumerate(seeds):
        for algo in args.algos:
            sides = [algo] + ([f"benchmarl_{algo}"] if peer else [])
            if args.quick:  # ours only, in this process: a smoke run of each entry
                results = {algo: ours(algo, seed, budgets[algo], eval_episodes, settings[algo])}
            else:
                extra = ["--seed", str(seed), "--max-env-step", str(budgets[algo]), "--eval-episodes",
                         str(eval_episodes), "--settings", json.dumps(settings[algo])]

                def run_side(side: str) -> Dict[str, Any]:
                    return run_worker(side, extra, timeout=3 * 3600,
                                      python=peer if side.startswith("benchmarl") else None)

                order = sides if i % 2 == 0 else sides[::-1]
                with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # --jobs 2: both sides of a seed at once
                    results = dict(zip(order, pool.map(run_side, order)))
            for side in sides:
                rows[side].append(results[side])
                print(f"  {side} seed {seed}: {json.dumps(results[side])}", file=sys.stderr, flush=True)  # progress

    random_return = random_team_return(QUICK_EVAL_EPISODES if args.quick else RANDOM_EPISODES)
    print(f"MPE simple_spread_v3 (N=3, 25 steps, local_ratio 0.5, discrete): mean team return of {eval_episodes} "
          f"greedy episodes after {budgets['mappo']} (MAPPO) and {budgets['qmix']} (QMIX) env steps; random "
          f"actions {random_return:.1f}")
    print(f"{'seed':>5} {'algo':>6} {'ours':>8} {'BenchMARL':>10} {'ratio':>7} {'ours steps/s':>13} "
          f"{'theirs steps/s':>15}")
    summary: Dict[str, Any] = {"seeds": seeds, "max_env_step": budgets, "eval_episodes": eval_episodes,
                               "scenario": SCENARIO, "random_return": round(random_return, 2),
                               "benchmarl_requirements": list(BENCHMARL), "benchmarl_error": peer_error}
    for algo in args.algos:
        mine, theirs = rows[algo], rows[f"benchmarl_{algo}"] or [None] * len(seeds)
        ratios = [None if b is None else return_ratio(a["final_return"], b["final_return"])
                  for a, b in zip(mine, theirs)]
        for a, b, ratio in zip(mine, theirs, ratios):
            cells = ("-", "-", "-") if b is None else (f"{b['final_return']:.1f}", f"{ratio:.3f}",
                                                      f"{b['steps_per_s']:.0f}")
            print(f"{a['seed']:>5} {algo:>6} {a['final_return']:>8.1f} {cells[0]:>10} {cells[1]:>7} "
                  f"{a['steps_per_s']:>13.0f} {cells[2]:>15}")
        prefix = "" if algo == "mappo" else "qmix_"
        speed = median_or_none([a["steps_per_s"] for a in mine])
        their_speed = median_or_none([b and b["steps_per_s"] for b in theirs])
        summary.update({
            f"{algo}_return": round(statistics.fmean(a["final_return"] for a in mine), 2),
            f"benchmarl_{algo}_return": None if None in theirs else
            round(statistics.fmean(b["final_return"] for b in theirs), 2),
            f"{algo}_returns": [round(a["final_return"], 2) for a in mine],
            f"benchmarl_{algo}_returns": [b and round(b["final_return"], 2) for b in theirs],
            f"{prefix}return_ratio": median_or_none(ratios),
            f"{prefix}steps_per_s": speed, f"benchmarl_{prefix}steps_per_s": their_speed,
            f"{prefix}speed_ratio": median_or_none([b and a["steps_per_s"] / b["steps_per_s"]
                                                    for a, b in zip(mine, theirs)]),
            f"{algo}_wall_s": [a["wall_s"] for a in mine], f"benchmarl_{algo}_wall_s": [b and b["wall_s"] for b in theirs]})
    print(f"MAPPO: return ratio {summary.get('return_ratio', '-')} (target >= 1.0), speed ratio "
          f"{summary.get('speed_ratio', '-')} (target >= 1.5); QMIX: return ratio "
          f"{summary.get('qmix_return_ratio', '-')} (target >= 1.0), speed ratio {summary.get('qmix_speed_ratio', '-')}")
    print_json_line(summary)


if __name__ == "__main__":
    sys.exit(main())
