"""Versioned weights: the immutable, numbered acting copies of a model that a learner updates in place.

Learning updates ``policy.model`` in place; acting never reads it. :meth:`VersionedWeights.publish` copies the
model's weights into an immutable acting copy and numbers it; the collect and eval views act on the newest
published copy, pinned for the whole of one ``forward`` (:meth:`VersionedWeights.pin`), so a reader in another
thread sees one complete version even while a learner steps. Learners publish once per call, so a sync pipeline
acts exactly as if it read the live weights. The initial weights are version 0 (published on first use). Each
version also holds ``extras``: what else acting reads and a learner changes, taken at publish (PPO's observation
statistics). Copies are recycled once no reader pins them, so publishing copies tensors into spare storage and
allocates only while readers hold every older copy.

:meth:`VersionedWeights.acting_state` / :meth:`VersionedWeights.load` carry a version as plain data to a replica
that acts elsewhere (a collector process, a distributed collector or evaluator: the ModelExchanger), which
publishes it under the same number. :class:`ModuleVersions` gives a bare ``nn.Module`` the same interface.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn

from conveyor.policy.normaliser import FrozenNormaliser

__all__ = ["Acting", "Version", "VersionedWeights", "ModuleVersions", "WIRE_TYPES"]

_SPARE_COPIES = 2  # unpinned old versions kept for reuse, so publishing copies into them instead of allocating
_OWN_EXTRAS = object()  # publish's default: take the extras from the weights' owner

WIRE_TYPES: List[Tuple[type, str, Callable[[Any], Any], Callable[[Any], Any]]] = [
    (FrozenNormaliser, "conveyor.FrozenNormaliser", FrozenNormaliser.wire, lambda d: FrozenNormaliser(**d)),
]
"""``(type, name, to_wire, from_wire)`` of the types a version's extras hold, for a codec that sends versions."""


class Version:
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

    def __init__(self, version: Version, memory: dict) -> None:
        self.model = version.model
        self.extras = version.extras
        self.memory = memory
        self.version = version.number


class VersionedWeights:
    """The published versions of ``model``'s weights. ``lock`` is held by whoever changes the model (the policy's
    learn lock), so a copy never sees half an update; ``extras()`` gives what a new version acts with besides
    the weights (called under ``lock`` when a version is published)."""

    def __init__(self, model: nn.Module, lock: threading.RLock, extras: Callable[[], Any]) -> None:
        self._model, self._lock, self._extras = model, lock, extras
        self._versions_lock = threading.Lock()
        self._newest: Version | None = None
        self._spare: List[Version] = []
        self._model_tensors: List[torch.Tensor] | None = None

    def newest(self) -> Version:
        """The newest version (the initial weights, version 0, published now if none is yet)."""
        newest = self._newest
        if newest is None:
            with self._lock:
                if self._newest is None:
                    self._copy(0, _OWN_EXTRAS)
                newest = self._newest
        return newest

    def publish(self, number: int | None = None) -> int:
        """Copy the model's weights into the newest version, numbered ``number`` (default: one more than the
        newest); its number. Readers mid-``forward`` finish on the version they pinned."""
        with self._lock:
            return self._copy(self.newest().number + 1 if number is None else number, _OWN_EXTRAS)

    def _copy(self, number: int, extras: Any) -> int:
        """Copy the weights into a spare (or new) version numbered ``number`` and make it the newest (the caller
        holds the lock, so no gradient step runs during the copy)."""
        if extras is _OWN_EXTRAS:
            extras = self._extras()
        with self._versions_lock:
            version = self._spare.pop() if self._spare else None
        if version is None:
            model = copy.deepcopy(self._model)
            model.requires_grad_(False)
            version = Version(model)
        else:
            if self._model_tensors is None:
                self._model_tensors = [*self._model.parameters(), *self._model.buffers()]
            with torch.no_grad():
                torch._foreach_copy_(version.tensors, self._model_tensors)
        version.number, version.extras = number, extras
        with self._versions_lock:
            old, self._newest = self._newest, version
            if old is not None and old.pins == 0:
                self._retire(old)
        return number

    def acting_state(self, out: Sequence[torch.Tensor] | None = None) -> Dict[str, Any]:
        """The newest version as plain data: ``version`` (its number), ``tensors`` (the model's parameters then
        buffers, in module order) and ``extras``. The tensors are copied into ``out`` when given (e.g. shared
        memory), else cloned."""
        version = self.pin()
        try:
            if out is None:
                tensors = [t.detach().clone() for t in version.tensors]
            else:
                with torch.no_grad():
                    torch._foreach_copy_(list(out), version.tensors)
                tensors = list(out)
            return {"version": version.number, "tensors": tensors, "extras": version.extras}
        finally:
            self.unpin(version)

    def load(self, state: Mapping[str, Any]) -> None:
        """Publish a version from another's :meth:`acting_state` as the newest, under the same number (the model
        takes its weights too)."""
        with self._lock, torch.no_grad():
            torch._foreach_copy_([*self._model.parameters(), *self._model.buffers()], list(state["tensors"]))
            self._copy(int(state["version"]), state["extras"])

    def pin(self) -> Version:
        """The newest version, pinned: it is not recycled until :meth:`unpin`."""
        if self._newest is None:
            self.newest()
        with self._versions_lock:
            version = self._newest
            version.pins += 1
            return version

    def unpin(self, version: Version) -> None:
        """Release a :meth:`pin`."""
        with self._versions_lock:
            version.pins -= 1
            if version.pins == 0 and version is not self._newest:
                self._retire(version)

    def _retire(self, version: Version) -> None:
        if len(self._spare) < _SPARE_COPIES:
            self._spare.append(version)


class ModuleVersions:
    """A bare ``nn.Module`` seen as a versioned policy (``publish``, ``acting_state``, ``load_acting_state``):
    the module's live weights, one version per :meth:`publish`. A ModelExchanger given a module uses it."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.version = model, 0
        self._lock = threading.Lock()

    def _tensors(self) -> List[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def publish(self) -> int:
        """Number a new version (the module's weights as they are now); its number."""
        self.version += 1
        return self.version

    def acting_state(self) -> Dict[str, Any]:
        """The module's weights as :meth:`VersionedWeights.acting_state` gives them."""
        with self._lock:
            return {"version": self.version, "tensors": [t.detach().clone() for t in self._tensors()], "extras": None}

    def load_acting_state(self, state: Mapping[str, Any]) -> None:
        """Copy a received version's weights into the module and take its number."""
        with self._lock, torch.no_grad():
            for mine, theirs in zip(self._tensors(), state["tensors"]):
                mine.copy_(theirs)
            self.version = int(state["version"])
