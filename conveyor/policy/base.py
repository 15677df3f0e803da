"""The policy base class: one model, three views (learn / collect / eval), one checkpoint format.

A policy is built from its ``cfg.policy`` section and exposes what each part of a pipeline needs
through a small view (:mod:`conveyor.policy.views`), in the spirit of Tianshou 2's split between acting
and learning:

- ``collect_mode.forward(obs, **kwargs) -> dict(action=..., ...)`` and ``collect_mode.reset(env_ids)``
  for the collector (exploration, per-env recurrent state); an actor-critic policy's collect view
  (:class:`ActorCriticCollectMode`) adds ``value(obs, **state)`` and ``scale_reward(reward, done)`` for
  advantage estimators;
- ``eval_mode.forward(obs) -> dict(action=...)`` and ``eval_mode.reset(env_ids)`` for the evaluator;
- ``learn_mode.forward(batch) ->`` :class:`LearnResult` (float metrics, and priorities for prioritized replay
  or an early stop), ``learn_mode.train_iter`` and the checkpoint methods for the learner; a policy that keeps
  statistics of what it learns from (PPO) has an :class:`ActorCriticLearnMode`, which adds ``gather(batch)``.

The views convert their input to tensors once (``to_tensor``) and run acting under ``torch.no_grad``,
then call the subclass's hooks: :meth:`Policy._forward_learn`, :meth:`Policy._forward_collect`,
:meth:`Policy._forward_eval` (by default :meth:`Policy._greedy`'s tensors), :meth:`Policy._value` and, for per-env
state, :meth:`Policy._reset`. Hooks are ordinary overridden methods; nothing is looked up by name. Whatever a
subclass adds to the checkpoint (a target network, an optimizer, an observation normaliser) it hands to
:meth:`Policy.register_state` once, in its constructor. Optimizers are :class:`LazyOptimizer` objects, made on
first use: a process that only acts never makes one (making a torch optimizer imports ``torch._dynamo``,
about 1.5 s of CPU), not even to checkpoint.

Acting never reads the model a learner updates: the views act on its published versions (:meth:`Policy.publish`,
:attr:`Policy.version`, :meth:`Policy.acting_state`). Acting hooks receive an :class:`Acting`: the version's ``model``
(a copy: never train it), its ``extras`` (:meth:`Policy._acting_extras`) and the view's ``memory`` (per-env state,
each view's own). Loading a checkpoint publishes its weights under the version number saved with them.
"""
from __future__ import annotations

import abc
import copy
import threading
from typing import Any, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
import treetensor.torch as ttorch
from easydict import EasyDict
from torch import nn

from conveyor import schema
from conveyor.data.batch import to_host, to_tensor
from conveyor.policy.data_parallel import DataParallel
from conveyor.policy.encoders import ImageEncoder
from conveyor.policy.learning import FiniteSteps, LazyOptimizer, LearnResult
from conveyor.policy.options import encoder_option, hidden_sizes_check, optional_positive
from conveyor.policy.views import CollectMode, EvalMode, LearnMode
from conveyor.policy.weights import Acting, Version, VersionedWeights
from conveyor.schema import ConfigError, Option

__all__ = ["Policy", "Stateful", "GeneratorState", "configured_device"]


@runtime_checkable
class Stateful(Protocol):
    """Anything checkpointed with a policy: modules, optimizers, normalisers, RNG wrappers."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any: ...


class GeneratorState:
    """Checkpoints a numpy ``Generator`` so exploration continues exactly after a resume."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.rng.bit_generator.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = dict(state_dict)


def _device_check(value: str) -> str | None:
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        return "must be a torch device such as 'cpu', 'cuda' or 'cuda:1'"
    return None


def configured_device(cfg: Mapping[str, Any]) -> torch.device:
    """Where ``cfg.policy`` asks a policy to run: ``device`` when set, else CUDA if ``cuda``, else the CPU."""
    return torch.device(cfg.get("device") or ("cuda" if cfg.get("cuda") else "cpu"))


class Policy(abc.ABC):
    """Base class of all policies: builds the model, validates the config, owns counters and checkpoints.

    ``cfg`` is the ``cfg.policy`` section; keys it leaves out take their defaults and unknown keys are
    errors (see :meth:`config_schema`). ``model`` overrides the one :meth:`build_model` makes from
    ``cfg.model``. ``device`` defaults to ``cfg.device``, else ``"cuda"`` if ``cfg.cuda``, else ``"cpu"``. ``seed`` seeds
    :attr:`rng`, the generator for exploration noise (drawn from torch's global generator when
    ``None``, so ``torch.manual_seed`` makes a run reproducible). The published acting copies of the model
    are its :class:`~conveyor.policy.weights.VersionedWeights`.
    """

    multi_agent: ClassVar[bool] = False
    """Whether the policy acts for a team (envs with an agent axis, docs/multi-agent.md): compile_config refuses an
    env of the other kind with a one-line error."""

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        self.cfg: EasyDict = schema.validate(cfg, self.config_schema(), path="policy")
        if device is None:
            device = configured_device(self.cfg)
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{type(self).__name__} was asked to run on {device} (policy.device, policy.cuda or "
                              "device=) but torch sees no CUDA device: set policy.device=cpu and policy.cuda=False")
        self.device = torch.device(device)
        self._input_device = None if self.device.type == "cpu" else self.device
        self.model: nn.Module = (model if model is not None else self.build_model(self.cfg.model)).to(self.device)
        if self.device.type == "cuda" and self.cfg.model.mixed_precision:
            for module in self.model.modules():
                if isinstance(module, ImageEncoder):
                    module.use_mixed_precision()
        if seed is None:  # follow torch's global generator, so torch.manual_seed also fixes exploration
            seed = int(torch.randint(0, 2**62, ()).item())
        self.rng = np.random.default_rng(seed)
        self.train_iter = 0
        self._stateful: dict[str, Stateful] = {}
        # Held by a learning step and by checkpointing, so an async pipeline never saves a half-applied update.
        self._learn_lock = threading.RLock()
        self.finite_steps = FiniteSteps(type(self).__name__)  # steps skipped for a loss that is not finite
        self.register_state("model", self.model)
        self.register_state("rng", GeneratorState(self.rng))
        self._weights = VersionedWeights(self.model, self._learn_lock, self._acting_extras)
        self._replica = False  # acts on versions another policy published (load_acting_state), never learns
        self._data_parallel: DataParallel | None = None  # the learners' group, once joined
        self._base_lrs: dict[str, list[float]] = {}
        self._learn_mode = LearnMode(self)
        self._collect_mode = CollectMode(self)
        self._eval_mode = EvalMode(self)

    # --- config ----------------------------------------------------------------------------------
    @classmethod
    def config_schema(cls) -> dict:
        """The options of ``cfg.policy``; subclasses extend it with ``schema.merge_schemas``."""
        return {
            "cuda": Option(False, "Run the policy on CUDA (unless built with an explicit device=, or policy.device "
                                  "says where)."),
            "device": Option(None, "Where the learner's policy runs: 'cpu', 'cuda' or 'cuda:N' (None: 'cuda' if "
                                   "policy.cuda, else 'cpu'). Collector processes and nodes act on CPU.", type=str,
                             check=_device_check),
            "discount_factor": Option(0.99, "Discount factor gamma of future rewards.", type=float,
                                      check=schema.unit_interval),
            "model": {
                "obs_shape": Option(None, "Observation shape: an int, a tuple, or a dict of shapes for Dict "
                                          "observations (set from the env).", type=(int, list, tuple, dict)),
                "action_shape": Option(None, "Number of discrete actions, or the action dimension for "
                                             "continuous control (set from the env).", type=(int, list, tuple)),
                "hidden_sizes": Option([64, 64], "Widths of the hidden layers of each encoder.", type=list,
                                       check=hidden_sizes_check),
                "encoder": encoder_option(),
                "mixed_precision": Option(False, "On CUDA, run image encoders under bf16 autocast (their features "
                                                 "come out float32: heads and losses stay full precision); no effect "
                                                 "on CPU or on MLP encoders. Off by default: on an H100 it made the "
                                                 "Nature CNN's updates slower (benchmarks/device_path.py).",
                                          type=bool),
            },
            "learn": {
                "batch_size": Option(64, "Transitions per gradient step.", check=schema.positive),
                "learning_rate": Option(1e-3, "Adam learning rate.", type=float, check=schema.positive),
                "update_per_collect": Option(1, "Gradient steps per collection round.", check=schema.positive),
                "grad_clip": Option(None, "Clip the gradient's global L2 norm to this (None: no clipping).",
                                    type=float, check=optional_positive),
                "log_freq": Option(100, "Write the training scalars (losses, charts, timings) to TensorBoard every "
                                        "this many gradient steps.", check=schema.positive),
                "learning_starts": Option(0, "Transitions in the replay buffer before off-policy training starts "
                                             "(at least batch_size).", check=schema.non_negative),
            },
            "collect": {
                "n_sample": Option(64, "Transitions collected per collection round (over all envs).",
                                   check=schema.positive),
                "n_episode": Option(None, "Episodes per collection round, for episode collectors.", type=int,
                                    check=optional_positive),
            },
            "eval": {
                "evaluator": {
                    "eval_freq": Option(500, "Evaluate every this many gradient steps.", check=schema.positive),
                    "eval_env_step_freq": Option(None, "Also evaluate every this many env steps (None: only by "
                                                       "gradient steps).", type=int, check=optional_positive),
                },
            },
            "other": {},
        }

    @classmethod
    def default_config(cls) -> EasyDict:
        """The full default ``cfg.policy`` of this policy class."""
        return schema.defaults(cls.config_schema())

    @classmethod
    def check_config(cls, cfg: Mapping[str, Any], observation_space: Any, action_space: Any) -> None:
        """Checks across keys and against the env's spaces that one key's schema cannot make; ``cfg`` is the
        whole compiled config. Raises :class:`ConfigError` naming the key and the fix, before anything is built."""

    @classmethod
    def _require_action_space(cls, cfg: Mapping[str, Any], action_space: Any, kind: str, fix: str) -> None:
        """Refuse an env whose action space is not ``kind`` (``"Discrete"`` or ``"Box"``), saying ``fix``."""
        if type(action_space).__name__ != kind:
            raise ConfigError(f"{cls.__name__} needs a {kind} action space, but env.env_id='{cfg['env']['env_id']}' "
                              f"has {action_space}: {fix}")

    @classmethod
    @abc.abstractmethod
    def build_model(cls, model_cfg: Mapping[str, Any]) -> nn.Module:
        """The network this policy trains, from the (validated) ``cfg.policy.model`` section."""

    @staticmethod
    def _required(model_cfg: Mapping[str, Any], key: str, example: str) -> Any:
        """``model_cfg[key]``, or a ConfigError saying how to set it when it is unset."""
        value = model_cfg.get(key)
        if value is None:
            raise ConfigError(f"config key 'policy.model.{key}' is not set: set it from the env, e.g. {example}")
        return value

    # --- views -----------------------------------------------------------------------------------
    @property
    def learn_mode(self) -> LearnMode:
        """The learner's view: ``forward(batch)``, ``train_iter``, ``state_dict``, ``load_state_dict``."""
        return self._learn_mode

    @property
    def collect_mode(self) -> CollectMode:
        """The collector's view: ``forward(obs, **kwargs)`` (exploring) and ``reset(env_ids)``."""
        return self._collect_mode

    @property
    def eval_mode(self) -> EvalMode:
        """The evaluator's view: ``forward(obs)`` (greedy / deterministic) and ``reset(env_ids)``."""
        return self._eval_mode

    # --- hooks for subclasses --------------------------------------------------------------------
    @abc.abstractmethod
    def _forward_learn(self, batch: ttorch.Tensor) -> LearnResult:
        """One update on a batch of tensors on ``self.device``: its :class:`LearnResult` (a plain dict of float
        metrics is taken as one without priorities or early stop)."""

    @abc.abstractmethod
    def _forward_collect(self, acting: Acting, obs: Any, **kwargs: Any) -> dict[str, Any]:
        """Exploring actions for a batch of observation tensors, as numpy (runs under ``no_grad``), computed
        with ``acting.model`` (the published weights), never ``self.model``."""

    def _forward_eval(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """Greedy / deterministic actions for a batch of observation tensors, as numpy (under ``no_grad``): those of
        :meth:`_greedy`. A policy whose evaluation is not greedy (DQN's ``eval.eps``) overrides it."""
        return {"action": to_host(self._greedy(acting, obs))[0]}

    def _greedy(self, acting: Acting, obs: Any) -> torch.Tensor:
        """Greedy / deterministic actions as a tensor, by ``acting.model`` in torch operations alone, so that
        ``conveyor export`` can trace them; a recurrent policy reads and writes its state in ``acting.memory``."""
        raise NotImplementedError(f"{type(self).__name__} defines no _greedy: override it (or _forward_eval) to act")

    def _value(self, acting: Acting, obs: Any, **state: Any) -> np.ndarray:
        """State values ``[B]`` (numpy float32) of a batch of observation tensors (under ``no_grad``) by
        ``acting.model``; ``state`` holds a recurrent policy's state before ``obs`` (e.g. ``hidden``) as tensors."""
        raise NotImplementedError(f"{type(self).__name__} has no value function: advantage estimators such as "
                                  f"gae_estimator need an actor-critic policy (e.g. PPOPolicy)")

    def _scale_reward(self, acting: Acting, reward: np.ndarray,
                      done: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The rewards ``[T, N]`` (time-major, numpy; ``done`` ends an episode after its step) as advantage
        estimators should read them, and what of them the learner keeps statistics of (``None``: nothing). As
        they are here; a policy that normalises rewards (PPO's ``reward_norm``) scales them."""
        return reward, None

    def _gather(self, batch: Any) -> None:
        """Take what the policy keeps statistics of from a round's batch (once per round, before its steps)."""

    def _reset(self, memory: dict, env_ids: Sequence[int] | None) -> None:
        """Clear a view's per-env state in ``memory`` for ``env_ids`` (``None``: every env)."""
        if env_ids is None:
            memory.clear()

    def _collect_state(self) -> dict[str, Any]:
        """What collecting keeps outside a view's ``memory`` and must survive a resume where a replica collects
        (a collector process saves it with ``collect_mode.state_dict()``); none by default."""
        return {}

    def _load_collect_state(self, state: Mapping[str, Any]) -> None:
        """Go on collecting from :meth:`_collect_state`."""

    def _acting_extras(self) -> Any:
        """What acting reads besides the model's weights, taken when a version is published (under the learn
        lock) and handed to the acting hooks as ``acting.extras``; it must never change afterwards."""
        return None

    # --- versioned weights (conveyor.policy.weights) ---------------------------------------------
    def publish(self) -> int:
        """Make the learning model's current weights the newest acting version (an immutable copy); its number.

        Learners call it once per call; readers that are mid-``forward`` finish on the version they pinned.
        """
        return self._weights.publish()

    @property
    def version(self) -> int:
        """The number of the newest published version (0: the initial weights)."""
        return self._weights.newest().number

    def acting_state(self, out: Sequence[torch.Tensor] | None = None) -> dict[str, Any]:
        """The newest version as plain data, for a replica of this policy that acts elsewhere (a collector
        process, a ModelExchanger's receivers): ``version``, ``tensors`` (copied into ``out`` when given) and
        ``extras`` (see :meth:`VersionedWeights.acting_state`)."""
        return self._weights.acting_state(out)

    def load_acting_state(self, state: Mapping[str, Any]) -> None:
        """Publish a version received from another policy's :meth:`acting_state` as this one's newest, under
        the same number, so an acting replica follows the learner's versions (and records them). From then on this
        policy is a replica: statistics of what it collects are the learner's to gather (see :meth:`_gather`)."""
        self._replica = True
        extras = state.get("extras")
        if callable(getattr(extras, "to", None)):  # statistics sent from a learner on another device
            state = {**state, "extras": extras.to(self.device)}
        self._weights.load(state)

    # --- learning rate ---------------------------------------------------------------------------
    def set_lr_factor(self, factor: float) -> None:
        """Set every registered optimizer's learning rate to ``factor`` times its configured one (annealing)."""
        if not 0.0 <= factor:
            raise ValueError(f"{type(self).__name__}.set_lr_factor: factor must be >= 0, got {factor!r}")
        with self._learn_lock:
            for name, component in self._stateful.items():
                if isinstance(component, LazyOptimizer):
                    component.set_lr_factor(factor)  # when it is made, if it is not yet
                elif isinstance(component, torch.optim.Optimizer):
                    for group, lr in zip(component.param_groups, self._base_lrs[name]):
                        group["lr"] = lr * factor

    # --- helpers for subclasses ------------------------------------------------------------------
    def register_state(self, name: str, component: Stateful) -> None:
        """Include ``component`` (``state_dict``/``load_state_dict``) in the checkpoint under ``name``."""
        if name in self._stateful or name == "counters":
            raise ValueError(f"policy state {name!r} is already registered: pick another name")
        if not isinstance(component, Stateful):
            raise TypeError(f"policy state {name!r} needs state_dict() and load_state_dict(), "
                            f"got {type(component).__name__}")
        self._stateful[name] = component
        if isinstance(component, torch.optim.Optimizer):
            self._base_lrs[name] = [float(group["lr"]) for group in component.param_groups]

    def _obs_to_tensor(self, obs: Any) -> Any:
        """An env manager's numpy observations as tensors on ``self.device`` (a tree for dict obs)."""
        return to_tensor(obs, self._input_device)

    def _batch_to_tensor(self, batch: Any) -> ttorch.Tensor:
        """A batch (ttorch tree, or dict of numpy arrays) as a tree of tensors on ``self.device``."""
        if not isinstance(batch, ttorch.Tensor):
            return to_tensor(batch, self._input_device)
        return batch if self._input_device is None else to_tensor(batch, self._input_device)  # pinned to CUDA

    def _bootstrap_discount(self, batch: ttorch.Tensor) -> torch.Tensor | float:
        """The factor on each transition's bootstrap value: the batch's ``discount`` (``gamma**k`` after the
        n-step enhancer), else ``cfg.discount_factor``; refuses an n-step config whose batch has no discount."""
        if "discount" in batch:
            return batch.discount
        nstep = self.cfg.get("nstep", 1)
        if nstep > 1:
            raise ValueError(f"{type(self).__name__}: policy.nstep={nstep} but the batch has no 'discount': add the "
                             "n-step enhancer to the pipeline, or set policy.nstep=1")
        return self.cfg.discount_factor

    def _apply_gradients(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | LazyOptimizer,
                         parameters: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """Backward ``loss`` and step ``optimizer`` (whose parameters are ``parameters``), clipping by
        ``cfg.learn.grad_clip``; the norm if clipped. Among data-parallel learners the gradients are averaged over
        the group as the backward pass runs (:meth:`DataParallel.backward`), so every learner clips and steps
        alike. A step whose loss is not finite is skipped (:class:`FiniteSteps`)."""
        for p in parameters:  # what optimizer.zero_grad(set_to_none=True) does, at a tenth of its cost
            p.grad = None
        if self._data_parallel is None:
            loss.backward()
        else:
            self._data_parallel.backward(loss, parameters)
        grad_norm = None
        if self.cfg.learn.grad_clip is not None:
            grad_norm = nn.utils.clip_grad_norm_(parameters, self.cfg.learn.grad_clip)
        if self.finite_steps.allow(loss, parameters, averaged=self._data_parallel is not None):
            optimizer.step()
        return grad_norm

    def _gradient_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | LazyOptimizer,
                       parameters: Sequence[torch.Tensor], metrics: dict[str, Any]) -> LearnResult:
        """One counted gradient step (:meth:`_apply_gradients`, then ``train_iter`` + 1) and its result: ``metrics``,
        with ``charts/grad_norm`` where the gradient was clipped."""
        grad_norm = self._apply_gradients(loss, optimizer, parameters)
        self.train_iter += 1
        if grad_norm is not None:
            metrics["charts/grad_norm"] = grad_norm.item()
        return LearnResult(metrics)

    def _average_gradients(self, parameters: Sequence[torch.Tensor]) -> None:
        """Average ``parameters``' gradients over the learners' group after a backward pass (nothing outside a
        group). A policy that steps an optimizer without :meth:`_apply_gradients` calls it before its step."""
        if self._data_parallel is not None:
            self._data_parallel.average_gradients(parameters)

    def join_data_parallel(self, group: DataParallel) -> None:
        """Learn as one of ``group``'s data-parallel learners (see :mod:`conveyor.policy.data_parallel`): rank 0's
        networks are copied to every learner now, and every gradient step from now on averages over the group.

        Every learner must join, with the same config, before its first step. Only networks are copied: on a resume
        every learner loads the same checkpoint (optimizer state included) before joining. A statistic that decides
        whether to step (PPO's ``learn.target_kl`` early stop) must be taken over the group
        (:meth:`DataParallel.mean`), or the learners could decide apart and wait on each other until the group's
        timeout.
        """
        with self._learn_lock:
            group.broadcast_modules(c for c in self._stateful.values() if isinstance(c, nn.Module))
            self._weights.publish(self.version)  # the acting copy of this version holds rank 0's weights too
            self._data_parallel = group

    # --- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: registered components (model, optimizer, ...) and counters
        (``train_iter``, and ``version``: the newest published version's number).

        A deep copy taken between learning steps, so it stays consistent while training goes on.
        """
        return self._checkpoint(None)

    def _checkpoint(self, version: Version | None) -> dict[str, Any]:
        """:meth:`state_dict`, with the model's weights (and version number) of ``version`` when given."""
        with self._learn_lock:
            newest = self._weights.newest()
            state: dict[str, Any] = {name: component.state_dict() for name, component in self._stateful.items()}
            state["counters"] = {"train_iter": self.train_iter, "version": newest.number}
            if version is not None:
                state["model"] = version.model.state_dict()
                state["counters"]["version"] = version.number
            return copy.deepcopy(state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; its parts must match this policy's registered components."""
        expected = set(self._stateful) | {"counters"}
        if set(state_dict) != expected:
            missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
            raise KeyError(f"{type(self).__name__}.load_state_dict: checkpoint does not match this policy "
                           f"(missing {missing}, unexpected {unexpected}); was it saved by another policy class?")
        with self._learn_lock:
            for name, component in self._stateful.items():
                component.load_state_dict(state_dict[name])
            self.train_iter = int(state_dict["counters"]["train_iter"])
            self._weights.publish(int(state_dict["counters"].get("version", 0)))

