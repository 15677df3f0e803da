"""What every online zoo entry does around its pipeline: compile the config, build envs, resume, run."""
from __future__ import annotations

import contextlib
import copy
import random
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Type

import numpy as np
import torch
from easydict import EasyDict

from conveyor.config import compile_config
from conveyor.engine import OnlineRLContext
from conveyor.envs import make_env_manager
from conveyor.engine import task
from conveyor.middleware import online_logger, progress_bar, restore, termination_checker

__all__ = ["prepare", "experiment_dir", "seed_everything", "env_managers", "resume_into", "use_reporting"]

RUNS = Path("runs")


def prepare(main_config: Mapping[str, Any], policy: Type[Any], cfg: Optional[Mapping[str, Any]] = None, *,
            seed: Optional[int] = None, exp_name: Optional[str] = None) -> EasyDict:
    """The compiled config of an entry: ``cfg`` (default ``main_config``) with the command-line overrides."""
    raw = EasyDict(copy.deepcopy(dict(cfg if cfg is not None else main_config)))
    if seed is not None:
        raw.seed = seed
    if exp_name is not None:
        raw.exp_name = exp_name
    return compile_config(raw, policy=policy)


def experiment_dir(cfg: Mapping[str, Any]) -> Path:
    """``runs/<exp_name>``: where an entry's logs and checkpoints go."""
    return RUNS / cfg["exp_name"]


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch, and use one intra-op thread: on these small networks a second
    thread costs 2-3x the CPU for no wall-clock gain."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)


@contextlib.contextmanager
def env_managers(cfg: Mapping[str, Any]) -> Iterator[tuple]:
    """The collector's and the evaluator's env managers, closed on the way out whatever happens."""
    with make_env_manager(cfg["env"], "collector", seed=cfg["seed"]) as collector_env, \
            make_env_manager(cfg["env"], "evaluator", seed=cfg["seed"]) as evaluator_env:
        yield collector_env, evaluator_env


def resume_into(cfg: Mapping[str, Any], policy: Any, ctx: OnlineRLContext, buffer: Any = None) -> Path:
    """Load ``runs/<exp_name>/ckpt/latest.pth.tar`` into the policy, the context and the buffer."""
    path = experiment_dir(cfg) / "ckpt" / "latest.pth.tar"
    if not path.is_file():
        raise FileNotFoundError(f"cannot resume '{cfg['exp_name']}': no checkpoint at {path}; start without "
                                f"--resume, or pass the --exp-name of an earlier run")
    restore(path, policy, ctx, buffer)
    return path


def use_reporting(cfg: Mapping[str, Any], max_env_step: Optional[int], progress: bool) -> None:
    """The tail of every zoo pipeline: TensorBoard logger, the env-step budget if any, the progress bar."""
    task.use(online_logger(str(experiment_dir(cfg) / "tb")))
    if max_env_step is not None:
        task.use(termination_checker(max_env_step=max_env_step))
    if progress:
        task.use(progress_bar(max_env_step))
