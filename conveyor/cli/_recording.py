"""Recording a dataset with a trained policy: :func:`collect_dataset`, what ``conveyor collect`` and
``conveyor collect --d4rl`` (:mod:`conveyor.cli.d4rl`) both call."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from conveyor.cli._common import message

__all__ = ["CollectError", "collect_dataset"]


class CollectError(ValueError):
    """The checkpoint or the arguments do not make a policy that can collect for this entry."""


class _NoisyActor:
    """The greedy (eval) view of a policy, with epsilon-random or Gaussian action noise; what a collector drives."""

    def __init__(self, eval_mode: Any, action_space: Any, noise: float, seed: Optional[int]) -> None:
        self._eval = eval_mode
        self._space = action_space
        self._noise = noise
        self._rng = np.random.default_rng(seed)

    def forward(self, obs: Any, **kwargs: Any) -> Dict[str, Any]:
        action = np.asarray(self._eval.forward(obs)["action"])
        if self._noise == 0.0:
            return {"action": action}
        if hasattr(self._space, "n"):
            explore = self._rng.random(action.shape) < self._noise
            random = self._space.start + self._rng.integers(0, self._space.n, action.shape)
            return {"action": np.where(explore, random, action).astype(action.dtype)}
        low, high = self._space.low, self._space.high
        noisy = action + self._rng.normal(size=action.shape) * self._noise * (high - low)
        return {"action": np.clip(noisy, low, high).astype(action.dtype)}

    def reset(self, env_ids: Optional[List[int]] = None) -> None:
        self._eval.reset(env_ids)


def _policy_class(state: Dict[str, Any], ckpt: Path) -> type:
    import conveyor.policy
    from conveyor.policy import Policy
    name = state.get("meta", {}).get("policy")
    cls = getattr(conveyor.policy, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise CollectError(f"{ckpt} names no known policy class (meta.policy={name!r}): pass a checkpoint a "
                           f"`conveyor train` run wrote (runs/<exp>/ckpt/eval_best.pth.tar)")
    return cls


def _run_config(entry: Any, name: str, cls: type, ckpt: Path, env_id: Optional[str] = None) -> Any:
    """The config the checkpoint's run saved (its policy must be ``cls``), else the entry's; checked to fit both
    (the env: ``env_id``, else the entry's)."""
    import json

    from conveyor.config import compile_config
    from conveyor.schema import ConfigError
    try:
        compile_config(entry.main_config, policy=cls, infer_shapes=False)
    except ConfigError as exc:
        raise CollectError(f"{ckpt} holds a {cls.__name__}, which entry {name} does not train ({message(exc)}); "
                           f"pass the entry whose run wrote the checkpoint") from None
    raw = entry.main_config
    saved = ckpt.parent.parent / "config.json"
    if saved.is_file():
        try:
            run_cfg = json.loads(saved.read_text())
        except (OSError, ValueError):
            run_cfg = {}
        if run_cfg.get("policy") == cls.__name__ and isinstance(run_cfg.get("config"), dict):
            raw = run_cfg["config"]
    expected = env_id or entry.main_config["env"]["env_id"]
    if raw["env"]["env_id"] != expected:
        raise CollectError(f"{ckpt} comes from a run in {raw['env']['env_id']}, entry {name} acts in "
                           f"{expected}: pass the entry whose run wrote the checkpoint")
    return compile_config(raw, policy=cls)


def collect_dataset(entry_name: str, ckpt: Any, episodes: Optional[int], *, dataset_id: str, noise: float = 0.0,
                    seed: Optional[int] = None, dataset_dir: Any = None, overwrite: bool = False,
                    progress: bool = False, transitions: Optional[int] = None, env_id: Optional[str] = None,
                    metadata: Optional[Dict[str, Any]] = None) -> tuple:
    """Record ``episodes`` episodes of the checkpoint's policy as Minari dataset ``dataset_id`` (see the module
    docstring); returns ``(dataset folder, transitions, episode returns)``. A failed run leaves no dataset.

    ``transitions`` instead of ``episodes``: whole episodes until at least that many transitions are recorded.
    ``env_id``: the env the entry's run was told to train in (``--set env.env_id=...``), when not the entry's
    default. ``metadata``: more keys for the dataset's metadata (:class:`~conveyor.data.DatasetWriter`)."""
    from easydict import EasyDict

    from conveyor.data import DatasetWriter
    from conveyor.envs import make_env_manager
    from conveyor.middleware import EpisodeCollector, episode_recorder, load_checkpoint, restore
    from conveyor.zoo import load_entry
    from conveyor.run.control import seed_everything

    if (episodes is None) == (transitions is None):
        raise CollectError("give the number of episodes (--episodes) or of transitions, not both or neither")
    if episodes is not None and (not isinstance(episodes, int) or episodes <= 0):
        raise CollectError(f"--episodes must be an int > 0, got {episodes!r}")
    if transitions is not None and (not isinstance(transitions, int) or transitions <= 0):
        raise CollectError(f"the number of transitions must be an int > 0, got {transitions!r}")
    if not np.isfinite(noise) or noise < 0:
        raise CollectError(f"--noise must be a number >= 0, got {noise!r}")
    entry = load_entry(entry_name)
    ckpt = Path(ckpt)
    cls = _policy_class(load_checkpoint(ckpt), ckpt)
    cfg = _run_config(entry, entry_name, cls, ckpt, env_id)
    seed = cfg.seed if seed is None else seed
    seed_everything(seed)  # and one torch thread: a second one only slows small networks down
    policy = cls(cfg.policy, seed=seed)
    try:
        restore(ckpt, policy)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise CollectError(f"{ckpt}: its {cls.__name__} weights do not fit entry {entry_name}'s network "
                           f"({' '.join(str(exc).split())[:200]})") from None
    with make_env_manager(cfg.env, "collector", seed=seed) as env:
        if hasattr(env.action_space, "n") and noise > 1:
            raise CollectError(f"--noise is a probability for discrete actions: give a number in [0, 1], got {noise}")
        actor = _NoisyActor(policy.eval_mode, env.action_space, noise, seed)
        amount = f"{episodes} episodes" if episodes is not None else f"{transitions} transitions (whole episodes)"
        writer = DatasetWriter(dataset_id, env.observation_space, env.action_space, root=dataset_dir, overwrite=overwrite,
                               env_id=cfg.env.env_id, algorithm_name=f"{cls.__name__} ({entry_name}), noise {noise}",
                               description=f"{amount} of {ckpt} on {cfg.env.env_id}, noise {noise}, seed {seed}",
                               metadata=metadata)
        try:
            _record(EpisodeCollector(EasyDict(seed=seed, policy=dict(collect=dict(n_episode=1))), actor, env),
                    episode_recorder(writer), episodes, transitions, progress)
        except BaseException:
            shutil.rmtree(writer.path, ignore_errors=True)
            raise
        writer.close()
    return writer.path, writer.steps_written, np.asarray(writer.episode_returns)


def _record(collector: Any, recorder: Any, episodes: Optional[int], transitions: Optional[int],
            progress: bool) -> None:
    """Run collector and recorder for ``episodes`` iterations (one episode each), or until the recorder's writer
    holds ``transitions`` transitions, with a progress bar if asked."""
    from tqdm import tqdm

    from conveyor.engine import OnlineRLContext, task
    writer = recorder.writer
    total, unit = (episodes, "episode") if episodes is not None else (transitions, "transition")

    def count(ctx: Any) -> None:
        done = len(writer.episode_returns) if episodes is not None else writer.steps_added
        bar.update(done - bar.n)
        if done >= total:
            task.finish = True

    with tqdm(total=total, unit=unit, disable=not progress, file=sys.stdout) as bar:
        with task.start(ctx=OnlineRLContext()):
            task.use(collector)
            task.use(recorder)
            task.use(count)
            task.run()
