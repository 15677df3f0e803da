"""Fixtures for the env manager tests: every manager a test builds is closed, also when the test fails."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from conveyor.envs import EnvManager, SubprocessEnvManager, SyncEnvManager

MANAGERS = {"sync": SyncEnvManager, "subprocess": SubprocessEnvManager}


@pytest.fixture
def managers() -> Iterator[Callable[..., Any]]:
    """``managers(kind, env_fns, **kwargs)`` builds a manager that is closed after the test;
    ``managers.track(manager)`` adopts one built elsewhere."""
    made: list[EnvManager] = []

    def make(kind: str, env_fns: list, **kwargs: Any) -> EnvManager:
        manager = MANAGERS[kind](env_fns, **kwargs)
        made.append(manager)
        return manager

    make.track = made.append  # type: ignore[attr-defined]
    yield make
    for manager in made:
        manager.close()


@pytest.fixture(params=sorted(MANAGERS))
def kind(request: pytest.FixtureRequest) -> str:
    """Each manager kind in turn, for behaviour both managers share."""
    return request.param
