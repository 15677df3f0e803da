"""D4RL-style datasets generated from the zoo's own runs (``conveyor collect mujoco/sac --d4rl KIND``).

    conveyor collect mujoco/sac --d4rl medium --env HalfCheetah-v5 [--seed N] [--max-env-step N] \\
        [--target-return R] [--transitions N] [--noise EPS] [--set KEY=VALUE ...] [--dataset-dir DIR] [--overwrite]

One run of the entry (its config, ``env.env_id`` set to ``--env``, ``--set`` on top) trains until its greedy
evaluation reaches ``--target-return`` (``env.stop_value``), at most ``--max-env-step`` env steps. From that
one run come both datasets, as in D4RL (Fu et al. 2020, arXiv:2004.07219):

- ``medium-replay``: every whole episode the run collected up to its end (its uniformly random warm-up
  episodes included), recorded by ``episode_recorder`` inside the training pipeline; the episode running
  when the run stopped is left out;
- ``medium``: the run's best evaluated policy (``eval_best``: the one that reached the target, else the best
  one of the budget) acting greedily (``--noise`` as ``conveyor collect``) for whole episodes until at least
  ``--transitions`` transitions are recorded (D4RL records 1M; default :data:`DEFAULT_TRANSITIONS`).

The default target is a third of the way from D4RL's random to its expert reference score
(:data:`REFERENCE_SCORES`, ``d4rl/infos.py``: measured on the ``-v2`` envs of mujoco-py, close to but not
the same as Gymnasium's ``-v5``): a normalised score of 33.3. Both datasets go to the local Minari folder
(``--dataset-dir``, else ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``) as
:func:`dataset_id` names them; the run itself is ``runs/d4rl_<env>_s<seed>/`` (its ``ckpt/eval_best``
is the medium policy). Each dataset's metadata holds ``ref_min_score`` / ``ref_max_score`` (what
``minari.get_normalized_score`` reads) and, under ``conveyor_generation``, the entry, the run's whole
config and seed, the request, the env steps taken, the medium policy's evaluation return and whether the
target was reached. A second call with the same request reuses both datasets; another request for ids that
exist is refused unless ``--overwrite`` (which also replaces the run directory).
"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

import numpy as np

KINDS = ("medium", "medium-replay")
"""The dataset kinds: D4RL's names."""

ENTRIES = ("mujoco/sac",)
"""The entries that can generate them (their pipeline takes ``record``: pendulum/sac's)."""

REFERENCE_SCORES: Dict[str, Tuple[float, float]] = {
    "HalfCheetah-v5": (-280.178953, 12135.0),
    "Hopper-v5": (-20.272305, 3234.3),
    "Walker2d-v5": (1.629008, 4592.3),
    "Ant-v5": (-325.6, 3879.7),
}
"""D4RL's (random, expert) reference returns per env (``REF_MIN_SCORE`` / ``REF_MAX_SCORE`` of ``d4rl/infos.py``)."""

MEDIUM_FRACTION = 1 / 3
"""A medium policy's normalised score, as a fraction of expert: D4RL's "about 1/3 of the expert"."""

DEFAULT_TRANSITIONS = 100_000
"""Transitions in a ``medium`` dataset unless ``--transitions`` says otherwise (D4RL: 1M)."""

DEFAULT_MAX_ENV_STEP = 1_000_000
"""Env steps of the generating run at most unless ``--max-env-step`` says otherwise."""


class D4RLError(ValueError):
    """The request cannot generate datasets: a bad argument, or datasets or a run of other settings in the way."""


def medium_target(env_id: str) -> float:
    """The default target return of env ``env_id``: random + (expert - random) / 3 of :data:`REFERENCE_SCORES`."""
    if env_id not in REFERENCE_SCORES:
        raise D4RLError(f"no D4RL reference score for {env_id} (known: {', '.join(REFERENCE_SCORES)}): give the "
                        f"medium policy's return with --target-return")
    low, high = REFERENCE_SCORES[env_id]
    return low + MEDIUM_FRACTION * (high - low)


def dataset_id(env_id: str, kind: str, seed: int) -> str:
    """The Minari id of a generated dataset: ``conveyor/<env>/<kind>-s<seed>-v0``, e.g.
    ``conveyor/halfcheetah/medium-replay-s0-v0``."""
    return f"conveyor/{env_id.split('-')[0].lower()}/{kind}-s{seed}-v0"


def d4rl_dataset(entry_name: str, kind: str, env_id: str, *, seed: int = 0, max_env_step: Optional[int] = None,
                 target_return: Optional[float] = None, transitions: int = DEFAULT_TRANSITIONS, noise: float = 0.0,
                 overrides: Iterable[str] = (), dataset_dir: Any = None, overwrite: bool = False,
                 progress: bool = False) -> Tuple[Path, bool]:
    """The folder of the ``kind`` dataset of this request (see the module docstring), generating both kinds
    unless a previous call with the same request did; returns ``(folder, reused)``."""
    from conveyor.data import dataset_metadata, dataset_root

    if entry_name.lower() not in ENTRIES:
        raise D4RLError(f"--d4rl datasets come from a run of {' or '.join(ENTRIES)}, not {entry_name}")
    if kind not in KINDS:
        raise D4RLError(f"--d4rl must be one of {', '.join(KINDS)}, got {kind!r}")
    for name, value in (("--transitions", transitions), ("--max-env-step", max_env_step)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise D4RLError(f"{name} must be an int > 0, got {value!r}")
    if not np.isfinite(noise) or noise < 0:
        raise D4RLError(f"--noise must be a number >= 0, got {noise!r}")
    request = {"entry": entry_name.lower(), "env_id": env_id, "seed": seed,
               "target_return": float(medium_target(env_id) if target_return is None else target_return),
               "max_env_step": DEFAULT_MAX_ENV_STEP if max_env_step is None else max_env_step,
               "transitions": transitions, "noise": float(noise), "overrides": list(overrides)}
    root = dataset_root(dataset_dir)
    ids = {k: dataset_id(env_id, k, seed) for k in KINDS}
    there = [k for k in KINDS if (root / ids[k]).exists()]
    if there and not overwrite:
        if len(there) == len(KINDS):
            saved = [dataset_metadata(ids[k], root=root).get("conveyor_generation", {}).get("request") for k in KINDS]
            if all(s == request for s in saved):
                return (root / ids[kind]).absolute(), True
            differ = sorted(k for k in request if not isinstance(saved[0], dict) or saved[0].get(k) != request[k])
        else:
            differ = [f"{', '.join(k for k in KINDS if k not in there)} missing"]
        raise D4RLError(f"{root / ids[there[0]]} holds a dataset of another request ({', '.join(differ)}): repeat "
                        f"that request to reuse it, or pass --overwrite to generate it again")
    paths = _generate(request, ids, root, overwrite, progress)
    return paths[kind], False


def _generate(request: Dict[str, Any], ids: Dict[str, str], root: Path, overwrite: bool,
              progress: bool) -> Dict[str, Path]:
    """Train the generating run with the medium-replay recorder inside, then record the medium dataset."""
    from conveyor.cli._recording import collect_dataset
    from conveyor.config import apply_overrides, compile_config
    from conveyor.data import DatasetWriter
    from conveyor.envs import make_env_manager
    from conveyor.middleware import load_checkpoint
    from conveyor.policy import SACPolicy
    from conveyor.zoo import load_entry
    from conveyor.run.directory import read_run_config, run_directory

    entry = load_entry(request["entry"])
    env_id, seed = request["env_id"], request["seed"]
    cfg = apply_overrides(copy.deepcopy(entry.main_config), request["overrides"])
    cfg.env.env_id, cfg.env.stop_value = env_id, request["target_return"]
    exp_name = f"d4rl_{env_id.split('-')[0].lower()}_s{seed}"
    run_dir = run_directory(cfg, exp_name)
    if run_dir.exists():
        if not overwrite:
            raise D4RLError(f"{run_dir} holds a run already: pass --overwrite to replace it and its datasets, or "
                            f"move it away")
        shutil.rmtree(run_dir)
    compiled = compile_config(cfg, policy=SACPolicy)
    with make_env_manager(compiled.env, "collector", seed=seed) as env:
        spaces = env.observation_space, env.action_space
    low_high = REFERENCE_SCORES.get(env_id)
    refs = {} if low_high is None else {"ref_min_score": low_high[0], "ref_max_score": low_high[1]}
    paths = {kind: (root / ids[kind]).absolute() for kind in ids}
    try:
        writer = DatasetWriter(ids["medium-replay"], *spaces, root=root, overwrite=overwrite, env_id=env_id,
                               algorithm_name=f"{request['entry']} training run (every whole episode collected)",
                               description=f"medium-replay: the episodes of {exp_name} until its greedy evaluation "
                                           f"reached {request['target_return']:.1f} (seed {seed})", metadata=refs)
        ctx = entry.main(cfg, seed=seed, exp_name=exp_name, max_env_step=request["max_env_step"], progress=progress,
                         record=writer)
        writer.close()
        if writer.episodes_written == 0:
            raise D4RLError(f"run {run_dir} finished no whole episode in {ctx.env_step} env steps (its first "
                            f"evaluation may have reached the target already): raise --max-env-step or "
                            f"--target-return, with --overwrite (the run directory stays)")
        ckpt = run_dir / "ckpt" / "eval_best.pth.tar"
        best = load_checkpoint(ckpt)["eval"]["mean"]
        generation = {"entry": request["entry"], "env_id": env_id, "seed": seed,
                      "config": read_run_config(run_dir)["config"], "request": request, "run": str(run_dir.absolute()),
                      "env_steps": int(ctx.env_step), "train_iter": int(ctx.train_iter),
                      "medium_policy": str(ckpt.absolute()), "medium_eval_return": float(best),
                      "target_return": request["target_return"], "target_reached": bool(best >= request["target_return"])}
        writer.update_metadata({"conveyor_generation": {**generation, "kind": "medium-replay"}})
        collect_dataset(request["entry"], ckpt, None, transitions=request["transitions"], dataset_id=ids["medium"],
                        noise=request["noise"], seed=seed, dataset_dir=root, overwrite=overwrite, progress=progress,
                        env_id=env_id, metadata={**refs, "conveyor_generation": {**generation, "kind": "medium"}})
    except BaseException:
        for path in paths.values():
            shutil.rmtree(path, ignore_errors=True)
        raise
    return paths

