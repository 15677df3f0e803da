"""What a learning step needs besides the model: its typed result, lazy optimizers and target networks.

- :class:`LearnResult` is what ``learn_mode.forward(batch)`` returns: the step's float ``metrics``, the new
  ``priorities`` of a prioritized replay batch, and ``early_stop`` when the policy declined the step.
- :func:`masked_mean` reduces a loss over the valid steps of padded sequences.
- :class:`LazyOptimizer` makes its torch optimizer on first use, so a process that only acts never makes one.
- :func:`make_target` / :class:`TargetSync` keep a frozen target network in step with its source.
- :class:`FiniteSteps` skips an optimizer step whose loss or gradients are not finite, so weights never become NaN.
"""
from __future__ import annotations

import copy
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional

import numpy as np
import torch
from torch import nn

__all__ = ["FiniteSteps", "LearnResult", "LazyOptimizer", "fused_adam", "make_target", "hard_update", "soft_update",
           "TargetSync", "masked_mean"]

log = logging.getLogger(__name__)

_NOT_METRICS = {"priority": "priorities", "early_stop": "early_stop"}  # the keys learn() outputs once carried


@dataclass(eq=False)
class LearnResult:
    """What one learning step reports.

    ``metrics``: losses and charts by name (``"losses/td"``, ``"charts/q_mean"``...), floats, as loggers show
    them (a trainer puts them in ``ctx.train_output``). ``priorities``: with a prioritized replay batch (one that
    carries ``weight``), each sample's new priority, numpy ``[B]``; the learner writes them back to the buffer.
    ``early_stop``: the policy declined this step (no gradient step was taken, ``train_iter`` did not grow) and
    asks the trainer to end its round, as PPO does past ``learn.target_kl``. ``result[name]`` reads a metric.
    """

    metrics: Dict[str, Any] = field(default_factory=dict)
    priorities: Optional[np.ndarray] = None
    early_stop: bool = False

    def __getitem__(self, name: str) -> Any:
        if name not in self.metrics and name in _NOT_METRICS:
            raise KeyError(f"{name!r} is not a metric of a LearnResult: read result.{_NOT_METRICS[name]}")
        return self.metrics[name]

    def __contains__(self, name: object) -> bool:
        return name in self.metrics

    __iter__ = None  # not a dict: iterate result.metrics

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LearnResult):
            return NotImplemented
        mine, theirs = self.priorities, other.priorities
        same = mine is theirs or (mine is not None and theirs is not None and np.array_equal(mine, theirs))
        return same and self.metrics == other.metrics and self.early_stop == other.early_stop

    @classmethod
    def of(cls, output: LearnResult | Mapping[str, Any], where: str) -> LearnResult:
        """``output`` of a learning hook as a LearnResult: one as is, a dict of metrics wrapped. A dict holding
        ``priority`` or ``early_stop`` (the keys of old) is refused, so neither is taken for a metric."""
        if isinstance(output, LearnResult):
            return output
        if not isinstance(output, Mapping):
            raise TypeError(f"{where}: a learning step returns a LearnResult (or a dict of metrics), got "
                            f"{type(output).__name__}")
        stale = sorted(set(output) & set(_NOT_METRICS))
        if stale:
            raise TypeError(f"{where}: return LearnResult(metrics, priorities=..., early_stop=...) instead of the "
                            f"keys {stale} in the metrics dict")
        return cls(dict(output))


_WHERE_IT_RUNS = ("capturable", "fused")
"""Optimizer options that follow the device an optimizer runs on, not the checkpoint it loads."""


class LazyOptimizer:
    """``optimizer_cls(module.parameters(), **options)``, made on first use: a step, or any attribute of the
    optimizer (``param_groups``, ``zero_grad``...). A process that only acts (a distributed collector or
    evaluator, a collector process) never makes it, and so never imports ``torch._dynamo``, which torch imports
    when an optimizer is made (about 1.5 s of CPU). Checkpoints do not make it either: one never made saves
    ``{"state": {}}`` (nothing learned yet), and a state loaded before it is made is kept and loaded into it
    when it is. :attr:`base_lrs`: the learning rates it was made with."""

    def __init__(self, optimizer_cls: Callable[..., torch.optim.Optimizer], module: nn.Module, **options: Any) -> None:
        self._cls, self._module, self._options = optimizer_cls, module, options
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending: Mapping[str, Any] | None = None  # a state loaded before the optimizer was made
        self._lr_factor: float | None = None  # set_lr_factor's factor, until the optimizer is made
        self._lock = threading.RLock()
        self.base_lrs: list[float] = []

    @property
    def made(self) -> bool:
        """Whether the optimizer exists yet."""
        return self._optimizer is not None

    @property
    def lr_factor(self) -> float | None:
        """The factor :meth:`set_lr_factor` last set (None: never set, the configured rates)."""
        return self._lr_factor

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, made now if it was not yet (with the state and learning-rate factor given before)."""
        with self._lock:
            if self._optimizer is None:
                optimizer = self._cls(self._module.parameters(), **self._options)
                self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
                if self._pending is not None:
                    self._load_into(optimizer, self._pending)
                self._optimizer, self._pending = optimizer, None
                if self._lr_factor is not None:
                    self.set_lr_factor(self._lr_factor)
            return self._optimizer

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def set_lr_factor(self, factor: float) -> None:
        """Set every group's learning rate to ``factor`` times the one it was made with (when it is made)."""
        with self._lock:
            self._lr_factor = factor
            if self._optimizer is not None:
                for group, lr in zip(self._optimizer.param_groups, self.base_lrs):
                    group["lr"] = lr * factor

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state; without making it, the state loaded into it (or ``{"state": {}}``)."""
        with self._lock:
            if self._optimizer is None and self._lr_factor is None:  # as torch's, it holds references, not copies
                return dict(self._pending) if self._pending is not None else {"state": {}}
            return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the optimizer's state (into it when it is made); ``{"state": {}}`` makes it fresh again."""
        with self._lock:
            fresh = "param_groups" not in state_dict
            if self._optimizer is not None and not fresh:
                self._load_into(self._optimizer, state_dict)
                return
            self._optimizer, self._lr_factor = None, None
            self._pending = None if fresh else state_dict

    def _load_into(self, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
        """``optimizer.load_state_dict``, keeping the options that depend on where it runs: torch takes a saved
        group's ``capturable`` and ``fused`` for the loading one's, so a checkpoint from a CUDA-graph run would
        make a CPU optimizer capturable (which CPU tensors cannot be), and a CPU one would make a graph's optimizer
        not capturable. Step counters go to the parameters' device where those options need them."""
        optimizer.load_state_dict(state_dict)
        for group in optimizer.param_groups:
            group.update({key: optimizer.defaults[key] for key in _WHERE_IT_RUNS if key in optimizer.defaults})
            if not (group.get("capturable") or group.get("fused")):
                continue
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                step = state.get("step")
                if torch.is_tensor(step) and step.device != param.device:
                    state["step"] = step.to(device=param.device, dtype=torch.float32)

    def __repr__(self) -> str:
        return f"LazyOptimizer({self._optimizer!r})" if self._optimizer is not None else "LazyOptimizer(not made yet)"


def fused_adam(device: torch.device) -> bool:
    """Whether Adam's fused kernel can run on ``device``: CUDA, or CPU from torch 2.4 on. On a small MLP it
    steps about 3x faster than the per-tensor loop."""
    if device.type == "cuda":
        return True
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return device.type == "cpu" and (major, minor) >= (2, 4)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of ``x`` over the entries where ``mask`` is 1 (all of them when ``mask`` is None): a recurrent
    policy's loss over the valid steps of padded sequences; 0 when none is."""
    if mask is None:
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp(min=1)


def make_target(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` to compute bootstrap targets with."""
    target = copy.deepcopy(model)
    target.requires_grad_(False)
    return target


def hard_update(target: nn.Module, source: nn.Module) -> None:
    """Copy ``source``'s parameters and buffers into ``target``."""
    TargetSync(target, source).hard()


def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Polyak averaging: ``target = (1 - tau) * target + tau * source`` (buffers are copied)."""
    TargetSync(target, source).soft(tau)


class TargetSync:
    """Keeps a target network in step with its source, softly (Polyak averaging) or by copying.

    It gathers both networks' tensors once: walking the module tree on every gradient step costs more
    than the update itself on the small networks RL uses. Loading a state dict copies into those same
    tensors, but moving a network to another device or dtype replaces its buffers: build the sync after
    the networks are in place.
    """

    def __init__(self, target: nn.Module, source: nn.Module) -> None:
        self._target = list(target.parameters())
        self._source = list(source.parameters())
        self._target_buffers = list(target.buffers())
        self._source_buffers = list(source.buffers())
        same = [t.shape for t in self._target] == [s.shape for s in self._source]
        if not same or len(self._target_buffers) != len(self._source_buffers):
            raise ValueError("TargetSync: target and source networks differ in shape; make the target with "
                             "make_target(source)")

    def after_step(self, train_iter: int, theta: float | None, every: int) -> None:
        """The update after gradient step ``train_iter``: soft by ``theta`` when it is set (``learn.target_theta``),
        else a copy every ``every`` steps (``learn.target_update_freq``)."""
        if theta is not None:
            self.soft(theta)
        elif train_iter % every == 0:
            self.hard()

    @torch.no_grad()
    def soft(self, tau: float) -> None:
        """``target = (1 - tau) * target + tau * source`` for parameters; buffers (e.g. norm statistics) are copied."""
        torch._foreach_lerp_(self._target, self._source, tau)  # one kernel for all tensors
        self._copy_buffers()

    @torch.no_grad()
    def hard(self) -> None:
        """``target = source``."""
        for t, s in zip(self._target, self._source):
            t.copy_(s)
        self._copy_buffers()

    def _copy_buffers(self) -> None:
        for t, s in zip(self._target_buffers, self._source_buffers):
            t.copy_(s)


class FiniteSteps:
    """Which optimizer steps go ahead: one whose loss (or, among data-parallel learners, averaged gradients: the same
    on every learner) is not finite is skipped, parameters and optimizer state untouched; :attr:`skipped` counts
    them, warned at the 1st, 2nd, 4th, 8th... so a stream of bad batches logs a bounded number of lines."""

    def __init__(self, owner: str) -> None:
        self.owner, self.skipped = owner, 0

    def allow(self, loss: torch.Tensor, parameters: Any, averaged: bool) -> bool:
        """Whether to step, after the backward pass of ``loss`` into ``parameters``' gradients; one host read of a
        device flag (none while a CUDA graph is captured: such a step is left unchecked)."""
        if loss.is_cuda and torch.cuda.is_current_stream_capturing():
            return True
        if averaged:
            grads = [p.grad for p in parameters if p.grad is not None]
            finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        else:
            finite = torch.isfinite(loss.detach()).all()
        if bool(finite):
            return True
        for p in parameters:
            p.grad = None
        self.skipped += 1
        if self.skipped & (self.skipped - 1) == 0:
            log.warning("%s: skipped an update with a loss or gradients that are not finite (a batch with NaN or "
                        "infinite values?); %d skipped so far", self.owner, self.skipped)
        return False
