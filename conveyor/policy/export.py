"""A policy's greedy acting as a plain torch module, which ``conveyor export`` traces into an ONNX or TorchScript
file: an observation batch in, an action batch out, and a recurrent policy's state as further inputs and outputs.

The module runs the policy's own :meth:`~conveyor.policy.Policy._greedy` hook on one published version of its
weights, with whatever that version acts with besides them (PPO's observation normaliser), and takes observations
as the env gives them (uint8 frames are scaled inside the image encoders, float64 becomes float32 as the views do).
Files are traced: ONNX through torch's TorchScript-based exporter (``dynamo=False``, a dynamic batch axis by
``dynamic_axes``), as the torch.export-based one needs ``onnxscript``; TorchScript by ``torch.jit.trace``.
"""
from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from typing import Any, Dict, Iterator, Tuple, Union

import numpy as np
import torch
from torch import nn

from conveyor.policy.base import Policy
from conveyor.policy.weights import Acting

__all__ = ["GreedyModule", "quiet_tracing"]


class GreedyModule(nn.Module):
    """``forward(obs, *state) -> action`` (feed-forward) or ``(action, *next_state)`` (recurrent): the greedy actions
    of ``policy``'s newest published version, for a batch of observations of any size.

    A recurrent policy's state is what its greedy step keeps in its view's memory (PPO's GRU: ``hidden [B, H]``),
    found by one step on ``sample_obs``; pass zeros at an episode's start and each step's ``next_<name>`` to the next.
    Raises ValueError, in one line, for a policy it cannot express: a team's (dict observations) or one without
    a greedy hook.
    """

    def __init__(self, policy: Policy, sample_obs: Any) -> None:
        super().__init__()
        name = type(policy).__name__
        if policy.multi_agent or isinstance(sample_obs, dict):
            acts = "for a team on dict observations" if policy.multi_agent else "on dict observations"
            raise ValueError(f"{name} acts {acts}, which export does not take: it exports "
                             f"single-agent policies on array observations (DQN, PPO, PPO-GRU, IMPALA, SAC, TD3, BC, "
                             f"CQL, IQL)")
        if type(policy)._greedy is Policy._greedy:
            raise ValueError(f"{name} has no greedy hook (Policy._greedy): only policies that define it export")
        weights = policy._weights
        self._version = weights.pin()
        weakref.finalize(self, weights.unpin, self._version)
        self._policy = policy
        self.model = self._version.model  # registered, so its weights are the exported graph's parameters
        memory: Dict[str, Any] = {}
        with torch.no_grad():
            policy._greedy(Acting(self._version, memory), policy._obs_to_tensor(np.asarray(sample_obs)))
        # each recurrent state's name and its shape after the batch axis (none for a feed-forward policy)
        self.state_shapes: Dict[str, Tuple[int, ...]] = {
            key: tuple(value.shape[1:]) for key, value in memory.items() if isinstance(value, torch.Tensor)}

    @property
    def input_names(self) -> Tuple[str, ...]:
        """``obs``, then each recurrent state's name."""
        return ("obs", *self.state_shapes)

    @property
    def output_names(self) -> Tuple[str, ...]:
        """``action``, then ``next_<name>`` for each recurrent state."""
        return ("action", *(f"next_{key}" for key in self.state_shapes))

    def initial_state(self, batch: int) -> Tuple[torch.Tensor, ...]:
        """The recurrent state at the start of ``batch`` episodes (zeros), one tensor per state."""
        return tuple(torch.zeros(batch, *shape, device=self._policy.device) for shape in self.state_shapes.values())

    def forward(self, obs: torch.Tensor, *state: torch.Tensor) -> Any:
        """The greedy actions of ``obs`` (after ``state``), and the state after them when the policy has one."""
        if len(state) != len(self.state_shapes):
            raise ValueError(f"{type(self._policy).__name__}'s greedy module takes obs and {len(self.state_shapes)} "
                             f"state tensor(s) ({', '.join(self.state_shapes) or 'none'}), got {len(state)}")
        memory = dict(zip(self.state_shapes, state))
        action = self._policy._greedy(Acting(self._version, memory), self._policy._obs_to_tensor(obs))
        if not self.state_shapes:
            return action
        return (action, *(memory[key] for key in self.state_shapes))

    def inputs(self, obs: Any) -> Tuple[torch.Tensor, ...]:
        """The inputs for a numpy batch of observations: the observations as a tensor, then a zero recurrent state."""
        return (torch.from_numpy(np.asarray(obs)).to(self._policy.device), *self.initial_state(len(obs)))

    def save_onnx(self, path: Union[str, os.PathLike], obs: Any) -> None:
        """Trace this module on ``obs`` (a numpy batch) into an ONNX file whose inputs and outputs are named
        (:attr:`input_names`, :attr:`output_names`) and have a dynamic batch axis; needs the ``onnx`` package."""
        names = (*self.input_names, *self.output_names)
        with quiet_tracing(), torch.no_grad():
            torch.onnx.export(self, self.inputs(obs), str(path), input_names=list(self.input_names),
                              output_names=list(self.output_names), dynamic_axes={n: {0: "batch"} for n in names},
                              dynamo=False)

    def save_torchscript(self, path: Union[str, os.PathLike], obs: Any) -> None:
        """Trace this module on ``obs`` (a numpy batch) into a TorchScript file (``torch.jit.load`` reads it)."""
        with quiet_tracing(), torch.no_grad():
            torch.jit.trace(self, self.inputs(obs)).save(str(path))


@contextlib.contextmanager
def quiet_tracing() -> Iterator[None]:
    """Without torch's notices while tracing or loading a traced file: its deprecation of TorchScript and of the
    TorchScript-based ONNX exporter (both still work in torch 2.13), and the tracer's note on shapes read as Python
    values (a recurrent policy compares its state's batch size with the observations')."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        yield
