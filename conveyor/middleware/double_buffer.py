"""Double-buffered collection for collectors acting through an inference server (``--inference server``,
:mod:`conveyor.middleware.inference`): a collector's envs in two groups, one stepping while the server makes the
other's actions.

:class:`EnvGroups` is an env manager of two managers (the first ``env_num // 2`` envs, then the rest, seeded as
one manager's: env ``i`` with ``seed + i``) for :class:`~conveyor.middleware.StepCollector`, which then acts
through :meth:`EnvGroups.act_and_step`: within a call, the request for a group's next step leaves as soon as the
group has stepped, so the server works on it while the other group steps. Rows, episodes, crashes and the
``[T, N]`` batch are those of one manager of all the envs (env ``i`` of the second group is env ``n_a + i``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from conveyor.data.batch import concat_nested, map_nested
from conveyor.envs import Restored, Timestep

__all__ = ["EnvGroups"]


def _rows(value: Any, start: int, stop: int) -> Any:
    return map_nested(lambda leaf: leaf[start:stop], value)


class EnvGroups:
    """Two env managers ``first`` and ``second`` as one (the env-manager methods StepCollector uses), stepped group
    by group by :meth:`act_and_step`. Closing it closes both."""

    def __init__(self, first: Any, second: Any) -> None:
        self.groups = (first, second)
        self._bounds = ((0, first.env_num), (first.env_num, first.env_num + second.env_num))
        self._tickets: Optional[List[int]] = None  # the requests in flight within a call, one per group

    # --- what an env manager has ------------------------------------------------------------------------
    @property
    def env_num(self) -> int:
        """Envs of both groups."""
        return self._bounds[1][1]

    def __getattr__(self, name: str) -> Any:  # spaces, env_id, reward_shape, agent_spaces: the first group's
        return getattr(self.groups[0], name)

    def __repr__(self) -> str:
        return f"<EnvGroups {' + '.join(repr(group) for group in self.groups)}>"

    def reset(self, seed: Optional[int] = None) -> Any:
        """Reset both groups (env ``i`` seeded with ``seed + i``); the observations of all envs."""
        self._tickets = None
        offset = self._bounds[1][0]
        return concat_nested([self.groups[0].reset(seed), self.groups[1].reset(None if seed is None else seed + offset)])

    def step(self, action: Any) -> Timestep:
        """Step every env with its row of ``action``, group by group."""
        return _joined([group.step(_rows(action, a, b)) for group, (a, b) in zip(self.groups, self._bounds)])

    def state_dict(self) -> Dict[str, Any]:
        """Each group's manager's state."""
        return {"groups": [group.state_dict() for group in self.groups]}

    def load_state_dict(self, state: Dict[str, Any]) -> Restored:
        """Go on from :meth:`state_dict`; reseeded envs numbered across the groups."""
        self._tickets = None
        restored = [group.load_state_dict(part) for group, part in zip(self.groups, state["groups"])]
        return Restored(concat_nested([r.obs for r in restored]),
                        [i + a for r, (a, _) in zip(restored, self._bounds) for i in r.reseeded])

    def close(self) -> None:
        """Close both groups."""
        for group in self.groups:
            group.close()

    def __enter__(self) -> "EnvGroups":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # --- double-buffered acting ------------------------------------------------------------------------
    def act_and_step(self, policy: Any, obs: Any, kwargs: Dict[str, Any],
                     last: bool) -> Tuple[Dict[str, Any], Timestep]:
        """One step of every env acting through ``policy`` (a :class:`~conveyor.middleware.inference.RemoteActing`:
        ``request`` / ``result``) on ``obs``: each group waits for its actions, steps, and sends its next request
        at once unless this is the ``last`` step of the call (the next call may act on newer weights). Returns the
        policy's output and the timestep of all envs, as ``policy.forward`` and ``step`` would."""
        if self._tickets is None:
            self._tickets = [policy.request(_rows(obs, a, b), **kwargs) for a, b in self._bounds]
        outs, steps = [], []
        try:
            for g, (group, (a, b)) in enumerate(zip(self.groups, self._bounds)):
                out = policy.result(self._tickets[g])
                ts = group.step(out["action"])
                if not last:
                    self._tickets[g] = policy.request(ts.obs, **kwargs)
                outs.append(out)
                steps.append(ts)
        except BaseException:
            self._tickets = None
            raise
        if last:
            self._tickets = None
        return concat_nested(outs), _joined(steps)


def _joined(steps: List[Timestep]) -> Timestep:
    return Timestep(obs=concat_nested([ts.obs for ts in steps]), next_obs=concat_nested([ts.next_obs for ts in steps]),
                    reward=np.concatenate([ts.reward for ts in steps]),
                    terminated=np.concatenate([ts.terminated for ts in steps]),
                    truncated=np.concatenate([ts.truncated for ts in steps]),
                    crashed=np.concatenate([ts.crashed for ts in steps]), info=[i for ts in steps for i in ts.info])
