"""The policy base class: one model, three views (learn / collect / eval), one checkpoint format.

A policy is built from its ``cfg.policy`` section and exposes what each part of a pipeline needs
through a small view, in the spirit of Tianshou 2's split between acting and learning:

- ``collect_mode.forward(obs, **kwargs) -> dict(action=..., ...)`` and ``collect_mode.reset(env_ids)``
  for the collector (exploration, per-env recurrent state); an actor-critic policy's collect view
  (:class:`ActorCriticCollectMode`) adds ``value(obs, **state)`` for advantage estimators;
- ``eval_mode.forward(obs) -> dict(action=...)`` and ``eval_mode.reset(env_ids)`` for the evaluator;
- ``learn_mode.forward(batch) -> dict`` of float metrics (plus ``priority`` for prioritized replay),
  ``learn_mode.train_iter`` and the checkpoint methods for the learner.

The views convert their input to tensors once (``to_tensor``) and run acting under ``torch.no_grad``,
then call the subclass's hooks: :meth:`Policy._forward_learn`, :meth:`Policy._forward_collect`,
:meth:`Policy._forward_eval`, :meth:`Policy._value` and, for per-env state, :meth:`Policy._reset`.
Hooks are ordinary overridden methods; nothing is looked up by name. Whatever a subclass adds to the
checkpoint (a target network, an optimizer, an observation normaliser) it hands to
:meth:`Policy.register_state` once, in its constructor. Optimizers are :class:`LazyOptimizer` objects, made on
first use: a process that only acts never makes one (making a torch optimizer imports ``torch._dynamo``,
about 1.5 s of CPU).

Versioned weights. Learning updates ``policy.model`` in place; acting never reads it. :meth:`Policy.publish`
copies the model's weights into an immutable acting copy and numbers it (:attr:`Policy.version`); the
collect and eval views act on the newest published copy, pinned for the whole of one ``forward``, so a
reader in another thread sees one complete version even while a learner steps. Learners publish once
per call (``OffPolicyLearner``, the on-policy trainers), so a sync pipeline acts exactly as if it read
the live weights. The initial weights are version 0 (published on first use); loading a checkpoint
publishes its weights under the version number saved with them. The acting hooks receive an
:class:`Acting`: the version's ``model`` (a copy: never train it), its ``extras`` (what else acting reads
and a learner changes, taken at publish: PPO's observation statistics, see :meth:`Policy._acting_extras`)
and the view's ``memory`` (per-env state such as a recurrent policy's hidden state; each view and each
snapshot has its own). Copies are recycled once no reader pins them, so publishing copies tensors into
spare storage and allocates only while readers hold every older copy.
"""
from __future__ import annotations

import abc
import copy
import threading
import weakref
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
import treetensor.torch as ttorch
from easydict import EasyDict
from torch import nn

from conveyor import schema
from conveyor.data.batch import to_tensor
from conveyor.schema import ConfigError, Option

__all__ = ["Policy", "LearnMode", "CollectMode", "ActorCriticCollectMode", "EvalMode", "Snapshot", "Acting", "Stateful",
           "LazyOptimizer", "make_target", "hard_update", "soft_update", "TargetSync"]


@runtime_checkable
class Stateful(Protocol):
    """Anything checkpointed with a policy: modules, optimizers, normalisers, RNG wrappers."""

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any: ...


class LazyOptimizer:
    """``optimizer_cls(module.parameters(), **options)``, made on first use: a step, any attribute of the
    optimizer (``param_groups``, ``zero_grad``...), a checkpoint. A process that only acts (a distributed
    collector or evaluator, a collector process) never makes it, and so never imports ``torch._dynamo``,
    which torch imports when an optimizer is made (about 1.5 s of CPU). :attr:`base_lrs`: the learning rates
    it was made with."""

    def __init__(self, optimizer_cls: Callable[..., torch.optim.Optimizer], module: nn.Module, **options: Any) -> None:
        self._cls, self._module, self._options = optimizer_cls, module, options
        self._optimizer: torch.optim.Optimizer | None = None
        self._lock = threading.Lock()
        self.base_lrs: list[float] = []

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, made now if it was not yet."""
        with self._lock:
            if self._optimizer is None:
                self._optimizer = self._cls(self._module.parameters(), **self._options)
                self.base_lrs = [float(group["lr"]) for group in self._optimizer.param_groups]
            return self._optimizer

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state (a fresh one's if nothing made it yet)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the optimizer's state."""
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"LazyOptimizer({self._optimizer!r})" if self._optimizer is not None else "LazyOptimizer(not made yet)"


class _GeneratorState:
    """Checkpoints a numpy ``Generator`` so exploration continues exactly after a resume."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.rng.bit_generator.state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = dict(state_dict)


class _Version:
    """One published copy of the acting weights: a frozen module, the extras taken with it, its readers' pins."""

    __slots__ = ("number", "model", "tensors", "extras", "pins")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.tensors = [*model.parameters(), *model.buffers()]
        self.number = -1
        self.extras: Any = None
        self.pins = 0


class Acting:
    """What an acting hook works with: one published version's ``model`` and ``extras``, and the calling view's
    ``memory`` (a dict for per-env state, e.g. a recurrent policy's hidden state). ``version`` is its number."""

    __slots__ = ("model", "extras", "memory", "version")

    def __init__(self, version: _Version, memory: dict) -> None:
        self.model = version.model
        self.extras = version.extras
        self.memory = memory
        self.version = version.number


_OWN_EXTRAS = object()  # _publish's default: take the extras from the policy itself
_SPARE_COPIES = 2  # unpinned old versions kept for reuse, so publishing copies into them instead of allocating


def _hidden_sizes_check(value: Sequence[int]) -> str | None:
    ok = len(value) > 0 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    return None if ok else "must be a non-empty list of positive ints"


def _optional_positive(value: Any) -> str | None:
    return None if value is None or value > 0 else "must be > 0 (or None to disable)"


class Policy(abc.ABC):
    """Base class of all policies: builds the model, validates the config, owns counters and checkpoints.

    ``cfg`` is the ``cfg.policy`` section; keys it leaves out take their defaults and unknown keys are
    errors (see :meth:`config_schema`). ``model`` overrides the one :meth:`build_model` makes from
    ``cfg.model``. ``device`` defaults to ``"cuda"`` if ``cfg.cuda`` else ``"cpu"``. ``seed`` seeds
    :attr:`rng`, the generator for exploration noise (drawn from torch's global generator when
    ``None``, so ``torch.manual_seed`` makes a run reproducible).
    """

    def __init__(self, cfg: Mapping[str, Any], model: nn.Module | None = None, *,
                 device: str | torch.device | None = None, seed: int | None = None) -> None:
        self.cfg: EasyDict = schema.validate(cfg, self.config_schema(), path="policy")
        if device is None:
            device = "cuda" if self.cfg.cuda else "cpu"
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{type(self).__name__} was asked to run on {device} (policy.cuda or device=) but "
                              "torch sees no CUDA device: set policy.cuda=False")
        self.device = torch.device(device)
        self._input_device = None if self.device.type == "cpu" else self.device
        self.model: nn.Module = (model if model is not None else self.build_model(self.cfg.model)).to(self.device)
        if seed is None:  # follow torch's global generator, so torch.manual_seed also fixes exploration
            seed = int(torch.randint(0, 2**62, ()).item())
        self.rng = np.random.default_rng(seed)
        self.train_iter = 0
        self._stateful: dict[str, Stateful] = {}
        # Held by a learning step and by checkpointing, so an async pipeline never saves a half-applied update.
        self._learn_lock = threading.RLock()
        self.register_state("model", self.model)
        self.register_state("rng", _GeneratorState(self.rng))
        # Published acting copies (see the module doc): the newest, and spares no reader pins any more.
        self._versions_lock = threading.Lock()
        self._newest: _Version | None = None
        self._spare: list[_Version] = []
        self._model_tensors: list[torch.Tensor] | None = None
        self._base_lrs: dict[str, list[float]] = {}
        self._learn_mode = LearnMode(self)
        self._collect_mode = CollectMode(self)
        self._eval_mode = EvalMode(self)

    # --- config ----------------------------------------------------------------------------------
    @classmethod
    def config_schema(cls) -> dict:
        """The options of ``cfg.policy``; subclasses extend it with ``schema.merge_schemas``."""
        return {
            "cuda": Option(False, "Run the policy on CUDA (unless built with an explicit device=)."),
            "discount_factor": Option(0.99, "Discount factor gamma of future rewards.", type=float,
                                      check=schema.unit_interval),
            "model": {
                "obs_shape": Option(None, "Observation shape: an int, a tuple, or a dict of shapes for Dict "
                                          "observations (set from the env).", type=(int, list, tuple, dict)),
                "action_shape": Option(None, "Number of discrete actions, or the action dimension for "
                                             "continuous control (set from the env).", type=(int, list, tuple)),
                "hidden_sizes": Option([64, 64], "Widths of the hidden layers of each encoder.", type=list,
                                       check=_hidden_sizes_check),
            },
            "learn": {
                "batch_size": Option(64, "Transitions per gradient step.", check=schema.positive),
                "learning_rate": Option(1e-3, "Adam learning rate.", type=float, check=schema.positive),
                "update_per_collect": Option(1, "Gradient steps per collection round.", check=schema.positive),
                "grad_clip": Option(None, "Clip the gradient's global L2 norm to this (None: no clipping).",
                                    type=float, check=_optional_positive),
                "learning_starts": Option(0, "Transitions in the replay buffer before off-policy training starts "
                                             "(at least batch_size).", check=schema.non_negative),
            },
            "collect": {
                "n_sample": Option(64, "Transitions collected per collection round (over all envs).",
                                   check=schema.positive),
                "n_episode": Option(None, "Episodes per collection round, for episode collectors.", type=int,
                                    check=_optional_positive),
            },
            "eval": {
                "evaluator": {
                    "eval_freq": Option(500, "Evaluate every this many gradient steps.", check=schema.positive),
                    "eval_env_step_freq": Option(None, "Also evaluate every this many env steps (None: only by "
                                                       "gradient steps).", type=int, check=_optional_positive),
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
    def _forward_learn(self, batch: ttorch.Tensor) -> dict[str, Any]:
        """One update on a batch of tensors on ``self.device``; float metrics and optional ``priority``."""

    @abc.abstractmethod
    def _forward_collect(self, acting: Acting, obs: Any, **kwargs: Any) -> dict[str, Any]:
        """Exploring actions for a batch of observation tensors, as numpy (runs under ``no_grad``), computed
        with ``acting.model`` (the published weights), never ``self.model``."""

    @abc.abstractmethod
    def _forward_eval(self, acting: Acting, obs: Any) -> dict[str, Any]:
        """Greedy / deterministic actions for a batch of observation tensors, as numpy (under ``no_grad``),
        computed with ``acting.model``."""

    def _value(self, acting: Acting, obs: Any, **state: Any) -> np.ndarray:
        """State values ``[B]`` (numpy float32) of a batch of observation tensors (under ``no_grad``) by
        ``acting.model``; ``state`` holds a recurrent policy's state before ``obs`` (e.g. ``hidden``) as tensors."""
        raise NotImplementedError(f"{type(self).__name__} has no value function: advantage estimators such as "
                                  f"gae_estimator need an actor-critic policy (e.g. PPOPolicy)")

    def _reset(self, memory: dict, env_ids: Sequence[int] | None) -> None:
        """Clear a view's per-env state in ``memory`` for ``env_ids`` (``None``: every env)."""
        if env_ids is None:
            memory.clear()

    def _acting_extras(self) -> Any:
        """What acting reads besides the model's weights, taken when a version is published (under the learn
        lock) and handed to the acting hooks as ``acting.extras``; it must never change afterwards."""
        return None

    # --- versioned weights -----------------------------------------------------------------------
    def publish(self) -> int:
        """Make the learning model's current weights the newest acting version (an immutable copy); its number.

        Learners call it once per call; readers that are mid-``forward`` finish on the version they pinned.
        """
        with self._learn_lock:
            self._ensure_published()
            return self._publish(self._newest.number + 1)

    @property
    def version(self) -> int:
        """The number of the newest published version (0: the initial weights)."""
        return self._ensure_published().number

    def _ensure_published(self) -> _Version:
        newest = self._newest
        if newest is None:
            with self._learn_lock:
                if self._newest is None:
                    self._publish(0)
                newest = self._newest
        return newest

    def _publish(self, number: int, extras: Any = _OWN_EXTRAS) -> int:
        """Copy the weights into a spare (or new) version numbered ``number`` and make it the newest; the caller
        holds the learn lock, so no gradient step runs during the copy. ``extras`` defaults to this policy's own."""
        if extras is _OWN_EXTRAS:
            extras = self._acting_extras()
        with self._versions_lock:
            version = self._spare.pop() if self._spare else None
        if version is None:
            model = copy.deepcopy(self.model)
            model.requires_grad_(False)
            version = _Version(model)
        else:
            if self._model_tensors is None:
                self._model_tensors = [*self.model.parameters(), *self.model.buffers()]
            with torch.no_grad():
                torch._foreach_copy_(version.tensors, self._model_tensors)
        version.number, version.extras = number, extras
        with self._versions_lock:
            old, self._newest = self._newest, version
            if old is not None and old.pins == 0:
                self._retire(old)
        return number

    def acting_state(self, out: Sequence[torch.Tensor] | None = None) -> dict[str, Any]:
        """The newest version as plain data, for a replica of this policy that acts elsewhere (a collector
        process): ``version`` (its number), ``tensors`` (the model's parameters then buffers, in module order)
        and ``extras``. The tensors are copied into ``out`` when given (e.g. shared memory), else cloned."""
        version = self._pin()
        try:
            if out is None:
                tensors = [t.detach().clone() for t in version.tensors]
            else:
                with torch.no_grad():
                    torch._foreach_copy_(list(out), version.tensors)
                tensors = list(out)
            return {"version": version.number, "tensors": tensors, "extras": version.extras}
        finally:
            self._unpin(version)

    def load_acting_state(self, state: Mapping[str, Any]) -> None:
        """Publish a version received from another policy's :meth:`acting_state` as this one's newest, under
        the same number, so an acting replica follows the learner's versions (and records them)."""
        with self._learn_lock, torch.no_grad():
            torch._foreach_copy_([*self.model.parameters(), *self.model.buffers()], list(state["tensors"]))
            self._publish(int(state["version"]), state["extras"])

    def _retire(self, version: _Version) -> None:
        if len(self._spare) < _SPARE_COPIES:
            self._spare.append(version)

    def _pin(self) -> _Version:
        """The newest version, pinned: it is not recycled until :meth:`_unpin`."""
        if self._newest is None:
            self._ensure_published()
        with self._versions_lock:
            version = self._newest
            version.pins += 1
            return version

    def _unpin(self, version: _Version) -> None:
        with self._versions_lock:
            version.pins -= 1
            if version.pins == 0 and version is not self._newest:
                self._retire(version)

    # --- learning rate ---------------------------------------------------------------------------
    def set_lr_factor(self, factor: float) -> None:
        """Set every registered optimizer's learning rate to ``factor`` times its configured one (annealing)."""
        if not 0.0 <= factor:
            raise ValueError(f"{type(self).__name__}.set_lr_factor: factor must be >= 0, got {factor!r}")
        with self._learn_lock:
            for name, component in self._stateful.items():
                if isinstance(component, LazyOptimizer):
                    optimizer = component.optimizer
                    base = component.base_lrs
                elif isinstance(component, torch.optim.Optimizer):
                    optimizer, base = component, self._base_lrs[name]
                else:
                    continue
                for group, lr in zip(optimizer.param_groups, base):
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
        return batch if self._input_device is None else batch.to(self._input_device)

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
        ``cfg.learn.grad_clip``; the norm if clipped."""
        for p in parameters:  # what optimizer.zero_grad(set_to_none=True) does, at a tenth of its cost
            p.grad = None
        loss.backward()
        grad_norm = None
        if self.cfg.learn.grad_clip is not None:
            grad_norm = nn.utils.clip_grad_norm_(parameters, self.cfg.learn.grad_clip)
        optimizer.step()
        return grad_norm

    # --- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: registered components (model, optimizer, ...) and counters
        (``train_iter``, and ``version``: the newest published version's number).

        A deep copy taken between learning steps, so it stays consistent while training goes on.
        """
        return self._checkpoint(None)

    def _checkpoint(self, version: _Version | None) -> dict[str, Any]:
        """:meth:`state_dict`, with the model's weights (and version number) of ``version`` when given."""
        with self._learn_lock:
            newest = self._ensure_published()
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
            self._publish(int(state_dict["counters"].get("version", 0)))


def nstep_option() -> Option:
    """The ``nstep`` option of policies whose targets go through :meth:`Policy._bootstrap_discount`."""
    return Option(1, "N-step return length; the pipeline's n-step enhancer reads it and writes 'discount' into "
                     "batches.", check=schema.positive)


def replay_buffer_schema(size: int) -> dict:
    """The ``other.replay_buffer`` options of off-policy policies, read by the pipeline to build a DequeBuffer."""
    return {
        "size": Option(size, "Replay buffer capacity in transitions.", check=schema.positive),
        "prioritized": Option(False, "Prioritized experience replay."),
        "alpha": Option(0.6, "Priority exponent of prioritized replay.", type=float, check=schema.unit_interval),
        "beta": Option(0.4, "Importance-weight exponent of prioritized replay at the start.", type=float,
                       check=schema.unit_interval),
        "beta_end": Option(1.0, "The importance-weight exponent reached after beta_anneal_steps (1 corrects the whole "
                                "sampling bias, as the PER paper anneals to).", type=float, check=schema.unit_interval),
        "beta_anneal_steps": Option(100_000, "Transitions added to the buffer (env steps) over which beta rises "
                                             "linearly to beta_end; the schedule is saved with the buffer (None: beta "
                                             "stays fixed).", type=int, check=_optional_positive),
    }


def offline_schema(max_train_iter: int) -> dict:
    """The options every offline policy adds: its dataset, its gradient-step budget, one step per minibatch."""
    return {
        "learn": {
            "max_train_iter": Option(max_train_iter, "Gradient steps of an offline run (the zoo entry stops there).",
                                     check=schema.positive),
            "update_per_collect": Option(1, "Gradient steps per minibatch the offline data fetcher hands over.",
                                         check=schema.positive),
        },
        "other": {
            "dataset": {
                "id": Option(None, "Dataset to train on: a Minari dataset id (in the local Minari root), or the path "
                                   "of a Minari dataset directory, .npz or HDF5 transition file.", type=str),
            },
        },
    }


def fused_adam(device: torch.device) -> bool:
    """Whether Adam's fused kernel can run on ``device``: CUDA, or CPU from torch 2.4 on. On a small MLP it
    steps about 3x faster than the per-tensor loop."""
    if device.type == "cuda":
        return True
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return device.type == "cpu" and (major, minor) >= (2, 4)


class LearnMode:
    """The learner's view of a policy."""

    __slots__ = ("_policy",)

    def __init__(self, policy: Policy) -> None:
        self._policy = policy

    def forward(self, batch: Any) -> dict[str, Any]:
        """One update on ``batch`` (a ttorch tree of transitions); float metrics, maybe ``priority``."""
        policy = self._policy
        batch = policy._batch_to_tensor(batch)
        if policy._newest is None:
            policy._ensure_published()  # version 0 holds the initial weights, never updated ones
        with policy._learn_lock:
            return policy._forward_learn(batch)

    def publish(self) -> int:
        """Make the current weights the newest acting version (see :meth:`Policy.publish`); its number."""
        return self._policy.publish()

    def set_lr_factor(self, factor: float) -> None:
        """Scale the configured learning rates by ``factor`` (see :meth:`Policy.set_lr_factor`)."""
        self._policy.set_lr_factor(factor)

    @property
    def train_iter(self) -> int:
        """Gradient steps taken so far."""
        return self._policy.train_iter

    def state_dict(self) -> dict[str, Any]:
        """The policy's checkpoint (see :meth:`Policy.state_dict`)."""
        return self._policy.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the policy from a checkpoint (see :meth:`Policy.load_state_dict`)."""
        self._policy.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"<learn_mode of {type(self._policy).__name__}>"


def _collect(policy: Policy, version: _Version, memory: dict, obs: Any, kwargs: dict) -> dict[str, Any]:
    with torch.no_grad():
        out = policy._forward_collect(Acting(version, memory), policy._obs_to_tensor(obs), **kwargs)
    out["weight_version"] = np.full(len(out["action"]), version.number, dtype=np.int64)
    return out


def _evaluate(policy: Policy, version: _Version, memory: dict, obs: Any) -> dict[str, Any]:
    with torch.no_grad():
        return policy._forward_eval(Acting(version, memory), policy._obs_to_tensor(obs))


class _ActingView:
    """What the collect and eval views share: the policy, the view's per-env memory, reset and version."""

    __slots__ = ("_policy", "_memory")
    _name = "acting view"

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._memory: dict = {}

    def reset(self, env_ids: Sequence[int] | None = None) -> None:
        """Forget per-env state of ``env_ids`` (all envs for ``None``), e.g. when their episodes restart."""
        self._policy._reset(self._memory, env_ids)

    @property
    def version(self) -> int:
        """The newest published version, which the next ``forward`` acts on."""
        return self._policy.version

    def __repr__(self) -> str:
        return f"<{self._name} of {type(self._policy).__name__}>"


class CollectMode(_ActingView):
    """The collector's view of a policy: acts on the newest published version of the weights."""

    __slots__ = ()
    _name = "collect_mode"

    def forward(self, obs: Any, **kwargs: Any) -> dict[str, Any]:
        """Actions (numpy ``[N, ...]``) for an env manager's batch of observations, exploring per ``kwargs``,
        and ``weight_version`` (int64 ``[N]``): the published version that chose them."""
        policy = self._policy
        version = policy._pin()
        try:
            return _collect(policy, version, self._memory, obs, kwargs)
        finally:
            policy._unpin(version)

    def snapshot(self) -> Snapshot:
        """A collect view pinned to the newest version (see :class:`Snapshot`)."""
        return Snapshot(self._policy, "collect")

    def state_dict(self) -> dict[str, Any]:
        """What collecting carries from one call to the next: the per-env state (``memory``: a recurrent policy's
        hidden state) and the exploration generator (``rng``). A replica that acts elsewhere (a collector
        process) is checkpointed with it; the learner's own policy saves its ``rng`` in :meth:`Policy.state_dict`."""
        return {"memory": copy.deepcopy(self._memory), "rng": copy.deepcopy(self._policy.rng.bit_generator.state)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on collecting from :meth:`state_dict`."""
        self._memory.clear()
        self._memory.update(copy.deepcopy(dict(state["memory"])))
        self._policy.rng.bit_generator.state = dict(state["rng"])


class ActorCriticCollectMode(CollectMode):
    """The collector's view of a policy with a critic: also ``value(obs, **state)`` (via :meth:`Policy._value`),
    which advantage estimators bootstrap with. Such a policy installs it in its constructor:
    ``self._collect_mode = ActorCriticCollectMode(self)``."""

    __slots__ = ()

    def value(self, obs: Any, **state: Any) -> np.ndarray:
        """State values (numpy float32 ``[B]``) of a batch of observations, numpy or tensors, by the newest
        published version. A recurrent policy also takes its state before ``obs`` (e.g. ``hidden=``, as stored
        in the trajectory)."""
        policy = self._policy
        version = policy._pin()
        try:
            with torch.no_grad():
                return policy._value(Acting(version, self._memory), policy._obs_to_tensor(obs),
                                     **{k: policy._obs_to_tensor(v) for k, v in state.items()})
        finally:
            policy._unpin(version)


class EvalMode(_ActingView):
    """The evaluator's view of a policy: acts on the newest published version of the weights."""

    __slots__ = ()
    _name = "eval_mode"

    def forward(self, obs: Any) -> dict[str, Any]:
        """Greedy / deterministic actions (numpy ``[N, ...]``) for a batch of observations."""
        policy = self._policy
        version = policy._pin()
        try:
            return _evaluate(policy, version, self._memory, obs)
        finally:
            policy._unpin(version)

    def snapshot(self) -> Snapshot:
        """An eval view pinned to the newest version, so a whole evaluation sees one version (see :class:`Snapshot`)."""
        return Snapshot(self._policy, "eval")


class Snapshot:
    """A collect or eval view pinned to one published version: every ``forward`` acts on it, however many
    versions are published meanwhile. It has its own per-env state (start it with ``reset()``), and
    ``state_dict()`` is the policy's checkpoint with this version's model weights (and version number) and
    the other parts as they are now. The version stays pinned (its copy is not recycled) while the snapshot
    is referenced.
    """

    __slots__ = ("_policy", "_version", "_mode", "_memory", "__weakref__")

    def __init__(self, policy: Policy, mode: str) -> None:
        self._policy = policy
        self._version = policy._pin()
        self._mode = mode
        self._memory: dict = {}
        weakref.finalize(self, policy._unpin, self._version)

    @property
    def version(self) -> int:
        """The number of the version this snapshot acts on."""
        return self._version.number

    def forward(self, obs: Any, **kwargs: Any) -> dict[str, Any]:
        """As the view it was taken from (``collect_mode.forward`` / ``eval_mode.forward``), on this version."""
        if self._mode == "collect":
            return _collect(self._policy, self._version, self._memory, obs, kwargs)
        if kwargs:
            raise TypeError(f"an eval snapshot's forward takes only obs, got {sorted(kwargs)}")
        return _evaluate(self._policy, self._version, self._memory, obs)

    def reset(self, env_ids: Sequence[int] | None = None) -> None:
        """Forget this snapshot's per-env state of ``env_ids`` (all envs for ``None``)."""
        self._policy._reset(self._memory, env_ids)

    def state_dict(self) -> dict[str, Any]:
        """The policy's checkpoint whose model weights are exactly this version's (see :meth:`Policy.state_dict`)."""
        return self._policy._checkpoint(self._version)

    def model_state_dict(self) -> dict[str, Any]:
        """A copy of this version's model weights alone, as a dict (without the rest of :meth:`state_dict`, for
        which a policy would make its optimizers)."""
        return {name: tensor.clone() for name, tensor in self._version.model.state_dict().items()}

    def __repr__(self) -> str:
        return f"<{self._mode} snapshot of {type(self._policy).__name__}, version {self.version}>"


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
