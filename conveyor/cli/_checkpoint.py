"""Where a run directory keeps its checkpoints, and a run's policy loaded from one: what ``conveyor eval`` and
``conveyor export`` share."""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Optional, Tuple

__all__ = ["CHECKPOINTS", "locate", "load_policy"]

CHECKPOINTS = ("eval_best.pth.tar", "final.pth.tar", "latest.pth.tar")
"""The checkpoints of a run directory, in the order ``conveyor eval`` and ``conveyor export`` look for them."""


def locate(target: Path) -> Tuple[Path, Path]:
    """The checkpoint ``target`` names (a run directory's best, or a checkpoint file) and the run directory holding
    its ``config.json``; FileNotFoundError in one line when there is none."""
    if target.is_dir():
        for name in CHECKPOINTS:
            if (target / "ckpt" / name).is_file():
                return target / "ckpt" / name, target
        raise FileNotFoundError(f"no checkpoint in {target / 'ckpt'} (looked for {', '.join(CHECKPOINTS)}): train "
                                f"this run first, or give a run directory that holds one")
    if not target.is_file():
        raise FileNotFoundError(f"no run directory or checkpoint file at {target}")
    run_dir = target.parent.parent if target.parent.name == "ckpt" else target.parent
    if target.suffix.lower() in (".json", ".yaml", ".yml", ".txt", ".py"):
        what = "a run's config" if target.name == "config.json" else f"a {target.suffix} file"
        raise FileNotFoundError(f"{target} is {what}, not a checkpoint: pass the run directory ({run_dir}) or a "
                                f".pth.tar checkpoint ({run_dir / 'ckpt' / CHECKPOINTS[0]})")
    return target, run_dir


def load_policy(ckpt: Path, run_dir: Path, device: Optional[str] = None) -> Tuple[Any, Any]:
    """The run's compiled config and its policy with the checkpoint's weights, on ``device`` when given, else where
    the config asks (on CPU without CUDA)."""
    import torch

    import conveyor.policy as policies
    from conveyor.config import compile_config
    from conveyor.middleware import restore
    from conveyor.schema import ConfigError
    from conveyor.run.directory import read_run_config

    saved = read_run_config(run_dir)
    policy_cls = getattr(policies, str(saved.get("policy")), None)
    if not isinstance(policy_cls, type):
        raise ConfigError(f"{run_dir / 'config.json'} names the policy {saved.get('policy')!r}, which "
                          f"conveyor.policy does not have")
    cfg = compile_config(saved["config"], policy=policy_cls)
    if device is None:
        configured = policies.configured_device(cfg.policy)
        device = str(configured) if configured.type == "cpu" or torch.cuda.is_available() else "cpu"
    policy = policy_cls(cfg.policy, device=device)
    try:
        restore(ckpt, policy)
    except (pickle.UnpicklingError, EOFError, KeyError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot load {ckpt} into a {policy_cls.__name__}: {' '.join(str(exc).split())[:200]}") \
            from None
    return cfg, policy
