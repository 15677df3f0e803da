"""Offline RL bars of issues 9 and 19: BC and CQL on CartPole datasets, CQL and IQL on a medium Pendulum dataset,
BC, CQL and IQL on D4RL-style HalfCheetah and Hopper datasets.

Per seed, in one run, everything from scratch in a work folder (``runs/`` and ``datasets/`` there):

1. the CartPole expert: the zoo's DQN (``cartpole/dqn``) until its evaluation reaches 475 (``eval_best``);
2. the expert dataset (100 greedy episodes: 50k transitions) and the mixed one: the first half of those
   episodes and, recorded with random actions at probability 0.5, at least as many transitions again;
3. ``cartpole/bc`` and ``cartpole/cql`` on each;
4. the medium Pendulum behaviour policy: the zoo's SAC (``pendulum/sac``) trained in rounds of env steps until
   its greedy return falls in -600..-400 (else the round closest to -500), recorded with Gaussian noise of
   std 0.1 of the action range; ``behaviour_pendulum`` is the mean episode return of that dataset;
5. ``pendulum/cql`` and ``pendulum/iql`` on it;
6. per MuJoCo env (HalfCheetah-v5, Hopper-v5): ``conveyor collect mujoco/sac --d4rl`` with the seed (docs/offline.md:
   one SAC run until its greedy return reaches a third of D4RL's expert, its whole episodes as medium-replay, its
   best policy's ``medium_transitions`` as medium; generated once and reused from ``--d4rl-dir``), then
   ``mujoco/bc``, ``mujoco/cql`` and ``mujoco/iql`` on each; ``behaviour_<env>_<m|mr>`` is the dataset's mean
   episode return.

Each offline row is the mean return of the run's final policy over the budget's evaluation episodes; the table
shows every seed, the JSON line the median over seeds of the issue 9 rows and the mean over seeds of the
``{bc,cql,iql,behaviour}_{halfcheetah,hopper}_{m,mr}`` rows (issue 19; m = medium, mr = medium-replay).
``fetch_ratio`` comes from ``benchmarks.offline_fetch``'s measure (minibatches/s of ``offline_data_fetcher`` over direct
indexing, same run).
The entries' configs were tuned on seeds 0-2, so the default seeds are others (the MuJoCo entries were not
tuned: they take the papers' settings).

    python -m benchmarks.offline                      # seeds 3 4 5, full budgets (hours a seed: MuJoCo)
    python -m benchmarks.offline --seeds 0 --quick    # tiny budgets: checks that everything runs
    python -m benchmarks.offline --workdir /tmp/off   # keep runs and datasets
    python -m benchmarks.offline --d4rl-dir DIR       # MuJoCo datasets there (default: the local Minari folder,
                                                      # with --quick the work folder's datasets/)
    python -m benchmarks.offline --device cuda        # the MuJoCo offline runs on a GPU (CQL: minutes, not hours)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict

import torch

import conveyor.policy
from benchmarks._fetch import measure_fetch
from benchmarks._harness import print_json_line
from conveyor.cli.collect import collect_dataset
from conveyor.cli.d4rl import d4rl_dataset
from conveyor.config import apply_overrides, compile_config
from conveyor.data import DatasetWriter, concat_datasets, dataset_metadata, dataset_root, load_dataset
from conveyor.envs import make_env_manager
from conveyor.middleware import evaluate, load_checkpoint, restore
from conveyor.zoo import load_entry

ROWS = ("bc_expert", "cql_expert", "bc_mixed", "cql_mixed", "behaviour_pendulum", "cql_pendulum", "iql_pendulum")
MUJOCO_ENVS = {"halfcheetah": "HalfCheetah-v5", "hopper": "Hopper-v5"}
MUJOCO_KINDS = {"m": "medium", "mr": "medium-replay"}
MUJOCO_ROWS = tuple(f"{algo}_{env}_{kind}" for env in MUJOCO_ENVS for kind in MUJOCO_KINDS
                    for algo in ("behaviour", "bc", "cql", "iql"))
MEDIUM = (-600.0, -400.0)


@dataclass(frozen=True)
class Budget:
    """How much each step of one seed may do."""

    expert_env_steps: int  # the DQN expert's env-step budget (it stops earlier at 475)
    expert_episodes: int  # episodes in the expert dataset; the mixed one takes half of them plus as many noisy
    cartpole_iters: int  # gradient steps of each CartPole offline run
    medium_start: int  # SAC env steps of the first round towards the medium Pendulum policy
    medium_round: int  # env steps added per further round
    medium_max: int  # SAC env steps at most
    pendulum_episodes: int  # episodes in the medium dataset
    pendulum_iters: int  # gradient steps of each Pendulum offline run
    eval_episodes: int  # episodes of each final evaluation
    mujoco_max_env_step: int  # env steps of each SAC run towards a medium MuJoCo policy at most
    medium_transitions: int  # transitions of each MuJoCo medium dataset
    mujoco_iters: int  # gradient steps of each MuJoCo offline run (the entries' default: 100k)
    mujoco_eval_episodes: int  # episodes of each MuJoCo final evaluation
    mujoco_set: tuple = ()  # config overrides of the SAC run and of the offline runs (the quick form shrinks them)


FULL = Budget(expert_env_steps=60_000, expert_episodes=100, cartpole_iters=5000, medium_start=1500, medium_round=250,
              medium_max=8000, pendulum_episodes=100, pendulum_iters=5000, eval_episodes=20,
              mujoco_max_env_step=1_000_000, medium_transitions=100_000, mujoco_iters=100_000, mujoco_eval_episodes=10)
TINY_MUJOCO = ("env.max_episode_steps=100", "env.evaluator_env_num=1", "env.n_evaluator_episode=1",
               "policy.model.hidden_sizes=[32]", "policy.learn.batch_size=32")
"""The quick form's MuJoCo runs: 100-step episodes, one evaluation episode, small networks and batches."""
QUICK = Budget(expert_env_steps=600, expert_episodes=4, cartpole_iters=20, medium_start=400, medium_round=200,
               medium_max=600, pendulum_episodes=2, pendulum_iters=20, eval_episodes=2,
               mujoco_max_env_step=250, medium_transitions=200, mujoco_iters=20, mujoco_eval_episodes=1,
               mujoco_set=TINY_MUJOCO)
"""The smoke run: every step of a seed once (the expert's first evaluation is its best checkpoint, two Pendulum
rounds, a MuJoCo run of two whole 100-step episodes, datasets of two episodes: IQL scales rewards by the
returns' range), each as short as still exercises it."""
SAC_QUICK = ("policy.learn.learning_starts=100", "policy.collect.random_collect_size=100",
             "policy.eval.evaluator.eval_freq=64", "policy.other.replay_buffer.size=2000")
"""The quick form's SAC run also learns after 100 env steps and evaluates every 64 gradient steps."""


def final_return(run: Path, ckpt: str, episodes: int, seed: int) -> float:
    """Mean return of the policy in ``run/ckpt/<ckpt>`` over ``episodes`` greedy episodes on fresh evaluator envs."""
    saved = json.loads((run / "config.json").read_text())
    policy_cls = getattr(conveyor.policy, saved["policy"])
    compiled = compile_config(saved["config"], policy=policy_cls)
    policy = policy_cls(compiled.policy, seed=seed)
    restore(run / "ckpt" / ckpt, policy)
    with make_env_manager(compiled.env, "evaluator", seed=seed) as env:
        return evaluate(policy.eval_mode, env, episodes, seed=seed + 7_000_000)["mean"]


def offline_run(entry_name: str, dataset: Path, seed: int, iters: int, budget: Budget, overrides: tuple = (),
                episodes: int = 0) -> float:
    """Train ``entry_name`` (its config with ``overrides``) on ``dataset`` for ``iters`` gradient steps; its final
    policy's mean return over ``episodes`` (default: the budget's ``eval_episodes``)."""
    entry = load_entry(entry_name)
    cfg = apply_overrides(copy.deepcopy(entry.main_config), overrides)
    cfg.policy.other.dataset.id = str(dataset)
    exp_name = f"{entry_name.replace('/', '_')}_{dataset.parent.name}_{dataset.name}_{seed}"
    entry.main(cfg, seed=seed, exp_name=exp_name, max_train_iter=iters, progress=False)
    return final_return(Path("runs") / exp_name, "final.pth.tar", episodes or budget.eval_episodes, seed)


def cartpole_rows(seed: int, budget: Budget, datasets: Path, notes: Dict[str, Any]) -> Dict[str, float]:
    """The expert, its two datasets, and BC and CQL on each."""
    expert = f"expert_{seed}"
    ctx = load_entry("cartpole/dqn").main(seed=seed, exp_name=expert, max_env_step=budget.expert_env_steps,
                                          progress=False)
    best = load_checkpoint(Path("runs") / expert / "ckpt" / "eval_best.pth.tar")["eval"]
    notes["expert_return"], notes["expert_env_steps"] = best["mean"], ctx.env_step
    ckpt = Path("runs") / expert / "ckpt" / "eval_best.pth.tar"
    expert_dir, steps, returns = collect_dataset("cartpole/dqn", ckpt, budget.expert_episodes, seed=seed,
                                                 dataset_id=f"cartpole/expert-s{seed}-v0", dataset_dir=datasets)
    expert_episodes = load_dataset(expert_dir).episodes()
    expert_half = [episode for _, episode in zip(range(budget.expert_episodes // 2), expert_episodes)]
    target = sum(len(episode) for episode in expert_half)
    noisy, count = [], budget.expert_episodes // 2
    while sum(len(part) for part in noisy) < target:  # noisy episodes are shorter: record until they match
        part_dir, _, _ = collect_dataset("cartpole/dqn", ckpt, count, noise=0.5, seed=seed + 1 + len(noisy),
                                         dataset_id=f"cartpole/noisy-s{seed}-{len(noisy)}-v0", dataset_dir=datasets)
        noisy.append(load_dataset(part_dir))
        have = sum(len(part) for part in noisy)
        count = max(1, round((target - have) / (have / sum(part.num_episodes for part in noisy))) + 1)
    noisy_half, have = [], 0
    for episode in concat_datasets(noisy).episodes():  # whole episodes, as few as reach the target
        if have >= target:
            break
        noisy_half.append(episode)
        have += len(episode)
    mixed = concat_datasets([*expert_half, *noisy_half])
    mixed_dir = datasets / f"cartpole/mixed-s{seed}-v0"
    with DatasetWriter(f"cartpole/mixed-s{seed}-v0", mixed.observation_space, mixed.action_space,
                       root=datasets) as writer:
        writer.add_dataset(mixed)
    notes["expert_transitions"], notes["expert_data_return"] = steps, statistics.mean(returns)
    notes["mixed_transitions"], notes["mixed_noisy_share"] = len(mixed), 1 - target / len(mixed)
    notes["noisy_data_return"] = statistics.mean(float(e.episode_returns()[0]) for e in noisy_half)
    rows = {}
    for data, path in (("expert", expert_dir), ("mixed", mixed_dir)):
        for algo in ("bc", "cql"):
            rows[f"{algo}_{data}"] = offline_run(f"cartpole/{algo}", path, seed, budget.cartpole_iters, budget)
    return rows


def pendulum_rows(seed: int, budget: Budget, datasets: Path, notes: Dict[str, Any]) -> Dict[str, float]:
    """The medium SAC policy, its dataset, and CQL and IQL on it."""
    sac = load_entry("pendulum/sac")
    name, steps, rounds = f"medium_{seed}", budget.medium_start, []
    run = Path("runs") / name
    sac.main(seed=seed, exp_name=name, max_env_step=steps, progress=False)
    while True:
        score = final_return(run, "final.pth.tar", budget.eval_episodes, seed)
        kept = f"round_{steps}.pth.tar"
        shutil.copy(run / "ckpt" / "final.pth.tar", run / "ckpt" / kept)
        rounds.append((abs(score - sum(MEDIUM) / 2), steps, score, kept))
        if score >= MEDIUM[0] or steps + budget.medium_round > budget.medium_max:
            break  # in the band or past it: more training only improves it
        steps += budget.medium_round
        sac.main(exp_name=name, max_env_step=steps, resume=True, progress=False)
    _, notes["medium_env_steps"], notes["medium_greedy_return"], kept = min(rounds)
    medium_dir, transitions, returns = collect_dataset(
        "pendulum/sac", run / "ckpt" / kept, budget.pendulum_episodes, noise=0.1, seed=seed,
        dataset_id=f"pendulum/medium-s{seed}-v0", dataset_dir=datasets)
    notes["medium_transitions"] = transitions
    rows = {"behaviour_pendulum": statistics.mean(returns)}
    for algo in ("cql", "iql"):
        rows[f"{algo}_pendulum"] = offline_run(f"pendulum/{algo}", medium_dir, seed, budget.pendulum_iters, budget)
    return rows


def mujoco_rows(seed: int, budget: Budget, datasets: Path, notes: Dict[str, Any],
                device: str = "cpu") -> Dict[str, float]:
    """Per MuJoCo env: the medium and medium-replay datasets of one SAC run, and BC, CQL and IQL on each (learning
    on ``device``; the SAC run generating the datasets stays on the CPU, so that its request matches theirs)."""
    rows = {}
    for env, env_id in MUJOCO_ENVS.items():
        sets = (*budget.mujoco_set, f"env.env_id={env_id}", f"policy.device={device}")
        sac_sets = (*budget.mujoco_set, *(SAC_QUICK if budget.mujoco_set else ()))
        for kind, name in MUJOCO_KINDS.items():
            path, _ = d4rl_dataset("mujoco/sac", name, env_id, seed=seed, max_env_step=budget.mujoco_max_env_step,
                                   transitions=budget.medium_transitions, overrides=sac_sets, dataset_dir=datasets)
            generation = dataset_metadata(path)["conveyor_generation"]
            data = load_dataset(path)
            notes[f"{env}_{kind}_transitions"] = len(data)
            rows[f"behaviour_{env}_{kind}"] = float(data.episode_returns().mean())
            for algo in ("bc", "cql", "iql"):
                rows[f"{algo}_{env}_{kind}"] = offline_run(f"mujoco/{algo}", path, seed, budget.mujoco_iters, budget,
                                                           sets, budget.mujoco_eval_episodes)
        notes[f"{env}_sac_env_steps"] = generation["env_steps"]
        notes[f"{env}_medium_greedy"] = generation["medium_eval_return"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5], help="seeds (default 3 4 5)")
    parser.add_argument("--quick", action="store_true", help="tiny budgets and one seed unless --seeds is given")
    parser.add_argument("--workdir", default=None, help="keep runs/ and datasets/ here (default: a tmp folder)")
    parser.add_argument("--d4rl-dir", default=None,
                        help="generate or reuse the MuJoCo datasets here (default: $MINARI_DATASETS_PATH, else "
                             "~/.minari/datasets; with --quick: the work folder's datasets/)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the MuJoCo offline runs learn (default cpu; on an H100 a CQL update is about 50x "
                             "faster than on one CPU core); their datasets are generated on the CPU either way")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device on this machine; use --device cpu")
    budget = QUICK if args.quick else FULL
    seeds = args.seeds if not args.quick or "--seeds" in sys.argv else args.seeds[:1]
    torch.set_num_threads(1)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="conveyor_offline_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    home = os.getcwd()
    d4rl_dir = (Path(args.d4rl_dir).resolve() if args.d4rl_dir else work / "datasets" if args.quick
                else dataset_root().resolve())
    os.chdir(work)
    results: Dict[int, Dict[str, float]] = {}
    notes: Dict[int, Dict[str, Any]] = {}
    try:
        for seed in seeds:
            start = time.perf_counter()
            notes[seed] = {}
            results[seed] = {**cartpole_rows(seed, budget, work / "datasets", notes[seed]),
                             **pendulum_rows(seed, budget, work / "datasets", notes[seed]),
                             **mujoco_rows(seed, budget, d4rl_dir, notes[seed], args.device)}
            notes[seed]["seconds"] = time.perf_counter() - start
    finally:
        os.chdir(home)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    fetch = measure_fetch(batches=20, repeats=3) if args.quick else measure_fetch()

    print(f"{'row':<26}" + "".join(f"{f'seed {s}':>12}" for s in seeds) + f"{'median':>12}{'mean':>12}")
    summary = {}
    for row in (*ROWS, *MUJOCO_ROWS):
        values = [results[s][row] for s in seeds]
        summary[row] = statistics.median(values) if row in ROWS else statistics.mean(values)
        print(f"{row:<26}" + "".join(f"{v:>12.1f}" for v in values)
              + f"{statistics.median(values):>12.1f}{statistics.mean(values):>12.1f}")
    for key in notes[seeds[0]]:
        print(f"{key:<26}" + "".join(f"{notes[s][key]:>12.1f}" for s in seeds))
    print(f"{'fetch_ratio':<26}{fetch['fetch_ratio']:>12.2f}")
    print_json_line({**{row: round(value, 1) for row, value in summary.items()},
                     "fetch_ratio": round(fetch["fetch_ratio"], 3)})


if __name__ == "__main__":
    main()
