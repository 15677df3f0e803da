"""Collectors: step the collector envs with the collect policy and hand the transitions on.

Each lock-step of all envs appends its arrays to per-key lists, stacked once per call into a time-major
treetensor batch ``[T, N]`` (docs/design.md): nothing is built per transition.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from conveyor.data.batch import stack_nested, to_tensor
from conveyor.engine import OnlineRLContext, declares, task
from conveyor.envs import agent_returns
from conveyor.middleware.protocols import CollectPolicy

__all__ = ["StepCollector", "EpisodeCollector", "eps_greedy_handler", "EPISODE_EVENT"]

EPISODE_EVENT = "collector.episode"
"""Emitted by collectors for every finished training episode with ``(env_index, return, length)``; a team's
episode (its info's ``episode`` holds ``agent_r``) adds a fourth argument, the list of each agent's return, and
``return`` is the team's (the sum over agents)."""


def _random_actions(space: Any, n: int) -> np.ndarray:
    return np.stack([np.asarray(space.sample()) for _ in range(n)])


def team_trajectory_layout(env: Any, steps: int) -> Optional[str]:
    """The shape of each key of ``trajectories`` collected from a team's ``env`` (an env manager) in ``steps`` steps,
    with the agent axis; None for one agent's envs."""
    try:
        team = env.agent_spaces
    except (AttributeError, ValueError, TypeError):  # one agent's envs (or a stand-in whose spaces are unknown)
        return None
    lead = f"[T={steps}, N_env={env.env_num}"
    agents = f"{lead}, N_agent={team.agent_num}"
    act = "" if team.discrete else f", {team.action_space.shape[0]}"
    mask = f"; obs.action_mask {agents}, {team.action_space.n}]" if team.discrete else ""
    return (f"obs.obs {agents}, {team.obs_dim}]; obs.state {lead}, {team.state_dim}]; obs.agent_mask {agents}]{mask}; "
            f"action {agents}{act}]; reward and the policy's outputs {agents}]; terminated, truncated {lead}]")


def emit_episode(env_index: int, episode: Mapping[str, Any]) -> None:
    """Emit :data:`EPISODE_EVENT` for one finished episode (its info's ``episode``: ``r``, ``l``, a team's
    ``agent_r``)."""
    agents = agent_returns(episode)
    task.emit(EPISODE_EVENT, env_index, float(episode["r"]), int(episode["l"]), *([] if agents is None else [agents]))


@declares(reads=("collect_kwargs", "env_step", "env_episode"), optional=("collect_kwargs",),
          writes=("trajectories", "trajectory_end_idx", "env_step", "env_episode"))
class StepCollector:
    """Collects ``cfg.policy.collect.n_sample`` transitions per call from all collector envs.

    Each call steps every env ``ceil(n_sample / env_num)`` times with the collect policy (random
    actions while ``ctx.env_step < random_collect_size``), resetting the policy's per-env state at
    episode ends. Envs in groups that act through an inference server (an ``env`` with
    ``act_and_step``, :class:`~conveyor.middleware.double_buffer.EnvGroups`) act and step through it. Rows where an env crashed are marked ``valid = False``; the transition before the
    crash is marked truncated so it can bootstrap.

    Reads ctx: ``collect_kwargs``, ``env_step``.
    Writes ctx: ``trajectories`` (batch with leading dims ``[T, N]``), ``trajectory_end_idx`` (flat
    indices of episode ends), ``env_step``, ``env_episode``.
    """

    def __init__(self, cfg: Any, policy: CollectPolicy, env: Any, random_collect_size: int = 0) -> None:
        n_sample = cfg.policy.collect.n_sample
        if not isinstance(n_sample, int) or n_sample <= 0:
            raise ValueError(f"StepCollector: cfg.policy.collect.n_sample must be an int > 0, got {n_sample!r}")
        self._policy = policy
        self._env = env
        self._steps = math.ceil(n_sample / env.env_num)
        self._seed = cfg.get("seed")
        self._random_collect_size = random_collect_size
        self._obs: Any = None

    def __repr__(self) -> str:
        return f"StepCollector(envs={self._env.env_num}, steps_per_call={self._steps})"

    def field_layouts(self) -> Dict[str, str]:
        """For a team's envs, the shape of each key of ``trajectories`` with its agent axis, as ``conveyor describe``
        shows it (nothing for one agent's: ``[T, N]`` as the class says)."""
        layout = team_trajectory_layout(self._env, self._steps)
        return {} if layout is None else {"trajectories": layout}

    def state_dict(self) -> Dict[str, Any]:
        """The env manager's state (envs, current observations, episode bookkeeping; None before the first call)
        and the acting view's (a recurrent policy's hidden state per env, its exploration generator)."""
        return {"env": None if self._obs is None else self._env.state_dict(), "policy": _acting_state(self._policy)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`: the envs continue their episodes (reseeded where they do not pickle)."""
        restored = _restore_envs(self._env, self._policy, state)
        self._obs = None if restored is None else restored.obs

    def __call__(self, ctx: OnlineRLContext) -> None:
        env, policy = self._env, self._policy
        if self._obs is None:
            self._obs = env.reset(seed=self._seed)
            if self._seed is not None:
                env.action_space.seed(self._seed)  # random warm-up actions are reproducible too
        n = env.env_num
        rows: Dict[str, List[Any]] = {"obs": [], "reward": [], "next_obs": [], "terminated": [], "truncated": []}
        crashes: List[Any] = []
        episodes = 0
        obs = self._obs
        random = ctx.env_step < self._random_collect_size
        kwargs = ctx.collect_kwargs
        act_and_step = getattr(env, "act_and_step", None)
        for t in range(self._steps):
            if random:
                out: Dict[str, Any] = {"action": _random_actions(env.action_space, n)}
                if hasattr(policy, "version"):  # the keys a versioned policy's rows have; -1: no weights chose these
                    out["weight_version"] = np.full(n, -1, dtype=np.int64)
                ts = env.step(out["action"])
            elif act_and_step is not None:
                out, ts = act_and_step(policy, obs, kwargs, last=t == self._steps - 1)
            else:
                out = policy.forward(obs, **kwargs)
                ts = env.step(out["action"])
            rows["obs"].append(obs)  # env managers and policies return fresh arrays: no copies needed
            for key, value in out.items():
                rows.setdefault(key, []).append(value)
            rows["reward"].append(ts.reward)
            rows["next_obs"].append(ts.next_obs)
            rows["terminated"].append(ts.terminated)
            rows["truncated"].append(ts.truncated)
            obs = ts.obs
            ended = ts.terminated | ts.truncated
            if ts.crashed.any():
                crashes.append((t, ts.crashed))
                ended = ended | ts.crashed
            if ended.any():
                ids = np.flatnonzero(ended).tolist()
                if not random:
                    policy.reset(ids)
                for i in ids:
                    episode = None if ts.crashed[i] else ts.info[i].get("episode")
                    if episode is not None:
                        episodes += 1
                        emit_episode(i, episode)
        self._obs = obs
        data = {key: stack_nested(values) for key, values in rows.items()}
        valid = np.ones((self._steps, n), dtype=bool)
        for t, crashed in crashes:
            valid[t] = ~crashed
            if t > 0:  # the transition before a crash ends its dropped episode: nothing bootstraps across it
                data["truncated"][t - 1] |= crashed & valid[t - 1] & ~data["terminated"][t - 1]
        data["valid"] = valid
        done = (data["terminated"] | data["truncated"]) & valid
        ctx.trajectories = to_tensor(data)
        ctx.trajectory_end_idx = np.flatnonzero(done.reshape(-1))
        ctx.env_step += int(valid.sum())
        ctx.env_episode += episodes


@declares(reads=("collect_kwargs", "env_step", "env_episode"), optional=("collect_kwargs",),
          writes=("episodes", "trajectories", "trajectory_end_idx", "env_step", "env_episode"))
class EpisodeCollector:
    """Collects exactly ``cfg.policy.collect.n_episode`` complete episodes per call.

    Episodes still running when a call returns continue in the next call, and episodes that finish in
    the same step beyond the ``n_episode`` asked for are handed out first by the next call; an episode
    whose env crashes is dropped whole.

    Reads ctx: ``collect_kwargs``.
    Writes ctx: ``episodes`` (list of batches, one per episode, leading dim = episode length),
    ``trajectories`` (the episodes concatenated), ``trajectory_end_idx`` (index of each episode's last
    transition in ``trajectories``), ``env_step``, ``env_episode``.
    """

    def __init__(self, cfg: Any, policy: CollectPolicy, env: Any) -> None:
        n_episode = cfg.policy.collect.get("n_episode")
        if not isinstance(n_episode, int) or n_episode <= 0:
            raise ValueError(f"EpisodeCollector: cfg.policy.collect.n_episode must be an int > 0, got {n_episode!r}")
        self._n_episode = n_episode
        self._policy = policy
        self._env = env
        self._seed = cfg.get("seed")
        self._obs: Any = None
        self._running: List[List[Dict[str, Any]]] = [[] for _ in range(env.env_num)]
        self._finished: List[Dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"EpisodeCollector(envs={self._env.env_num}, n_episode={self._n_episode})"

    def state_dict(self) -> Dict[str, Any]:
        """The env manager's state, the episodes still running and the finished ones not handed out yet."""
        return {"env": None if self._obs is None else self._env.state_dict(), "policy": _acting_state(self._policy),
                "running": self._running, "finished": self._finished}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`; the running episode of an env that had to be reseeded is dropped."""
        self._running = [list(rows) for rows in state["running"]]
        self._finished = list(state["finished"])
        restored = _restore_envs(self._env, self._policy, state)
        self._obs = None if restored is None else restored.obs
        for i in [] if restored is None else restored.reseeded:
            self._running[i] = []

    def __call__(self, ctx: OnlineRLContext) -> None:
        env, policy = self._env, self._policy
        if self._obs is None:
            self._obs = env.reset(seed=self._seed)
        finished = self._finished
        steps = 0
        obs = self._obs
        while len(finished) < self._n_episode:
            out = policy.forward(obs, **ctx.collect_kwargs)
            ts = env.step(out["action"])
            ended = ts.terminated | ts.truncated | ts.crashed
            for i in range(env.env_num):
                if ts.crashed[i]:
                    self._running[i] = []
                    continue
                row = {key: _row(value, i) for key, value in out.items()}
                row.update(obs=_row(obs, i), reward=ts.reward[i], next_obs=_row(ts.next_obs, i),
                           terminated=ts.terminated[i], truncated=ts.truncated[i])
                self._running[i].append(row)
                steps += 1
                if ended[i]:
                    finished.append(stack_nested(self._running[i]))
                    self._running[i] = []
                    episode = ts.info[i].get("episode")
                    if episode is not None:
                        emit_episode(i, episode)
            if ended.any():
                policy.reset(np.flatnonzero(ended).tolist())
            obs = ts.obs
        self._obs = obs
        finished, self._finished = finished[:self._n_episode], finished[self._n_episode:]
        ctx.episodes = [to_tensor(ep) for ep in finished]
        ctx.trajectories = to_tensor(_concat(finished))
        ctx.trajectory_end_idx = np.cumsum([len(ep["reward"]) for ep in finished]) - 1
        ctx.env_step += steps
        ctx.env_episode += len(finished)


def _acting_state(policy: CollectPolicy) -> Optional[Dict[str, Any]]:
    """The acting view's state where it has one (``collect_mode``: per-env memory and exploration generator)."""
    return policy.state_dict() if callable(getattr(policy, "state_dict", None)) else None


def _restore_envs(env: Any, policy: CollectPolicy, state: Dict[str, Any]) -> Any:
    """Load a collector's state: the acting view's, then the env manager's (None: not started, the envs begin with a
    reset at the next call); the policy's per-env state is reset where an env had to be reseeded. Returns the
    manager's ``Restored``."""
    acting = state.get("policy")  # absent from checkpoints saved before collectors kept it
    if acting is not None and callable(getattr(policy, "load_state_dict", None)):
        policy.load_state_dict(acting)
    if state["env"] is None:
        return None
    restored = env.load_state_dict(state["env"])
    if restored.reseeded:
        policy.reset(restored.reseeded)
    return restored


def _row(batch: Any, i: int) -> Any:
    return {k: _row(v, i) for k, v in batch.items()} if isinstance(batch, dict) else batch[i]


def _concat(episodes: List[Dict[str, Any]]) -> Dict[str, Any]:
    first = episodes[0]
    return {k: (_concat([ep[k] for ep in episodes]) if isinstance(first[k], dict)
                else np.concatenate([ep[k] for ep in episodes])) for k in first}


@declares(reads=("env_step", "collect_kwargs"), optional=("collect_kwargs",), writes=("collect_kwargs",), factory=True)
def eps_greedy_handler(cfg: Any):
    """Sets the exploration rate for the collect policy from the env step count.

    ``cfg.policy.other.eps``: ``kind`` ``"exp"`` (``end + (start - end) * exp(-env_step / decay)``) or
    ``"linear"`` (from ``start`` to ``end`` over ``decay`` env steps).

    Reads ctx: ``env_step``. Writes ctx: ``collect_kwargs['eps']``.
    """
    eps_cfg = cfg.policy.other.eps
    kind, start, end, decay = eps_cfg.kind, eps_cfg.start, eps_cfg.end, eps_cfg.decay
    if kind not in ("exp", "linear"):
        raise ValueError(f"cfg.policy.other.eps.kind must be 'exp' or 'linear', got {kind!r}")
    if decay <= 0:
        raise ValueError(f"cfg.policy.other.eps.decay must be > 0 env steps, got {decay!r}")

    def _eps_greedy(ctx: OnlineRLContext) -> None:
        if kind == "exp":
            eps = end + (start - end) * math.exp(-ctx.env_step / decay)
        else:
            eps = start + (end - start) * min(1.0, ctx.env_step / decay)
        ctx.collect_kwargs["eps"] = eps

    return _eps_greedy
