"""What every offline zoo entry does: train a policy from a recorded dataset, evaluating it on live envs.

The pipeline (in an ``OfflineRLContext``): evaluator, offline data fetcher, trainer, checkpoint saver,
offline logger, the train-iteration budget and the progress bar. The run directory, its config, exact
resume and signals follow the online rules (see ``conveyor/zoo/_online.py`` and docs/checkpoints.md): the
fetcher's shuffling order and epoch are part of every checkpoint.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Type

from conveyor.data import dataset_root, load_dataset
from conveyor.engine import OfflineRLContext, task
from conveyor.envs import make_env_manager
from conveyor.middleware import (interaction_evaluator, offline_data_fetcher, offline_logger, progress_bar,
                                 termination_checker, trainer)
from conveyor.schema import ConfigError
from conveyor.zoo._online import experiment_dir, prepare, run_pipeline, seed_everything

__all__ = ["train_offline", "DatasetMissing"]


class DatasetMissing(FileNotFoundError):
    """An offline entry's dataset is not in the local dataset folder; the message says which commands build it."""


def train_offline(main_config: Mapping[str, Any], policy_cls: Type[Any], cfg: Optional[Mapping[str, Any]] = None, *,
                  build_dataset: str, seed: Optional[int] = None, exp_name: Optional[str] = None,
                  max_env_step: Optional[int] = None, max_train_iter: Optional[int] = None, resume: bool = False,
                  async_mode: bool = False, progress: bool = True, ckpt_freq: int = 1000,
                  ckpt_interval: Optional[float] = None) -> OfflineRLContext:
    """Train ``policy_cls`` offline on the dataset ``policy.other.dataset.id`` of ``cfg`` (default
    ``main_config``) until ``max_train_iter`` gradient steps (default ``policy.learn.max_train_iter``) or an
    evaluation reaching ``env.stop_value``; returns the final context.

    ``build_dataset`` is the command line that records the dataset, quoted when it is missing.
    ``latest.pth.tar`` is written every ``ckpt_freq`` gradient steps and every ``ckpt_interval`` seconds.
    """
    if max_env_step is not None:
        raise ConfigError(f"max_env_step={max_env_step}: an offline entry takes no env steps; bound it with "
                          f"max_train_iter (--max-train-iter) or policy.learn.max_train_iter")
    if max_train_iter is not None and (not isinstance(max_train_iter, int) or max_train_iter <= 0):
        raise ConfigError(f"max_train_iter={max_train_iter!r}: must be an int > 0")
    # A new run finds its dataset before prepare() makes its run directory, so a missing one leaves nothing behind.
    dataset = None if resume else _load(cfg if cfg is not None else main_config, build_dataset)
    cfg = prepare(main_config, policy_cls, cfg, seed=seed, exp_name=exp_name, resume=resume)
    if dataset is None:
        dataset = _load(cfg, build_dataset)
    seed_everything(cfg.seed)
    policy = policy_cls(cfg.policy)
    budget = max_train_iter if max_train_iter is not None else cfg.policy.learn.max_train_iter

    with make_env_manager(cfg.env, "evaluator", seed=cfg.seed) as evaluator_env:
        def build() -> None:
            task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env))
            task.use(offline_data_fetcher(cfg, dataset, observation_space=evaluator_env.observation_space,
                                          action_space=evaluator_env.action_space))
            task.use(trainer(cfg, policy.learn_mode))

        def report() -> None:
            task.use(offline_logger(str(experiment_dir(cfg) / "tb")))
            task.use(termination_checker(max_train_iter=budget))
            if progress:
                task.use(progress_bar(budget, counter="train_iter"))

        return run_pipeline(cfg, policy, OfflineRLContext(), build, report, resume=resume, async_mode=async_mode,
                            ckpt_freq=ckpt_freq, ckpt_interval=ckpt_interval)


def is_offline(entry: Any) -> bool:
    """Whether zoo ``entry`` (a module from ``load_entry``) trains from a dataset: its config names
    ``policy.other.dataset``, as every entry built on :func:`train_offline` must."""
    config = getattr(entry, "main_config", None) or {}
    return "dataset" in config.get("policy", {}).get("other", {})


def _load(cfg: Mapping[str, Any], build_dataset: str) -> Any:
    """The dataset ``policy.other.dataset.id`` of a (raw or compiled) config names."""
    source = cfg.get("policy", {}).get("other", {}).get("dataset", {}).get("id")
    if source is None:
        raise ConfigError("config key 'policy.other.dataset.id' is not set: name the dataset to train on (a Minari "
                          f"dataset id or a file path); build one with: {build_dataset}")
    try:
        return load_dataset(source)
    except FileNotFoundError:
        raise DatasetMissing(f"dataset '{source}' is not in {dataset_root()} (nothing is downloaded); build it "
                             f"with: {build_dataset}") from None
