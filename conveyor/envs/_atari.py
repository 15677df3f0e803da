"""Atari through ale-py and Gymnasium: ``cfg.env.atari``, the env factory and the game wrapper.

An ``ALE/<Game>-v5`` id is built as ``gymnasium.make(id, frameskip=1)`` wrapped in Gymnasium's own
``AtariPreprocessing`` (frame skip with max-pooling, no-op starts, grayscale, resize) and
``FrameStackObservation``: observations are uint8 ``[frame_stack, screen_size, screen_size]``.
:class:`AtariGame` sits between them: for collector envs it ends training episodes on a life loss and
clips rewards to their sign; in every env it reports the whole game (unclipped return, agent steps) in
``info["game"]`` at each episode end, which the env managers turn into ``info["episode"]`` at game over.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping, SupportsFloat

import gymnasium as gym
import numpy as np

from conveyor.envs._core import GAME_INFO
from easydict import EasyDict

from conveyor.schema import ConfigError, Option, defaults, non_negative, positive, validate

__all__ = ["ATARI_OPTION", "ATARI_SCHEMA", "atari_options", "AtariFactory", "AtariGame", "is_atari_id", "require_extra"]

def _probability(value: float) -> str | None:
    return None if 0 <= value < 1 else "must be in [0, 1)"


ATARI_SCHEMA: dict[str, Option] = {
    "frame_skip": Option(4, "emulator frames per agent step (the observation max-pools the last two)", type=int,
                         check=positive),
    "screen_size": Option(84, "observations are resized to screen_size x screen_size grayscale", type=int,
                          check=positive),
    "frame_stack": Option(4, "observations stack this many last frames: uint8 [frame_stack, H, W]", type=int,
                          check=positive),
    "noop_max": Option(30, "each game starts after 1 to noop_max random no-op steps (0: none)", type=int,
                       check=non_negative),
    "repeat_action_probability": Option(0.25, "sticky actions: chance each emulator frame repeats the previous "
                                              "action (0.25 as the v5 envs)", type=float, check=_probability),
    "terminal_on_life_loss": Option(True, "collector envs end a training episode when a life is lost (the game "
                                          "goes on); evaluation always plays full games", type=bool),
    "fire_reset": Option(False, "press FIRE when a game starts and after each lost life, in games that have it "
                                "(SB3's and CleanRL's FireResetEnv, envpool's use_fire_reset)", type=bool),
    "clip_reward": Option(True, "collector envs clip rewards to their sign; evaluation and logged returns "
                                "are unclipped", type=bool),
}
"""The keys of the ``cfg.env.atari`` group, applied to ``ALE/...`` env ids (see :class:`AtariFactory`)."""


def atari_options(group: Mapping[str, Any] | None) -> EasyDict:
    """``cfg.env.atari`` checked against :data:`ATARI_SCHEMA` and completed with its defaults."""
    return validate(group or {}, ATARI_SCHEMA, "env.atari")


def _check_atari(group: Mapping[str, Any]) -> None:
    atari_options(group)  # raises ConfigError naming env.atari.<key>


ATARI_OPTION = Option(dict(defaults(ATARI_SCHEMA)), "Atari preprocessing for ALE/ ids, a group of keys: "
                      + ", ".join(ATARI_SCHEMA) + " (see docs/envs.md)", type=dict, check=_check_atari)
"""``cfg.env.atari`` as one option of :data:`~conveyor.envs.ENV_SCHEMA` (a partial dict is completed with
defaults where it is used)."""


def require_extra(extra: str, *modules: str, why: str) -> None:
    """Import ``modules``; if one is missing raise a one-line :class:`ConfigError` with the pip command."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"{why} needs the '{module}' package ({exc}): pip install \"conveyor[{extra}]\"") \
                from None


def is_atari_id(env_id: str) -> bool:
    """Whether ``env_id`` names an ale-py env (``ALE/<Game>-v5``), which gets the Atari preprocessing."""
    return env_id.startswith("ALE/")


def register_atari(env_id: str) -> None:
    """Register ale-py's envs with Gymnasium (needs the ``atari`` extra: ale-py and OpenCV), its log kept to
    warnings and errors: its banner ("A.L.E: Arcade Learning Environment ...") is not printed for every env."""
    require_extra("atari", "ale_py", "cv2", why=f"env.env_id {env_id!r}")
    import ale_py

    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Warning)
    gym.register_envs(ale_py)


class AtariGame(gym.Wrapper):
    """Keeps score of the whole game across training episodes; optionally ends episodes on a life loss and
    clips rewards.

    At every episode end ``info["game"]`` is ``{"over": bool, "r": unclipped game return, "l": agent steps}``.
    After a life-loss end ``reset()`` goes on with the same game from its current screen; a seeded reset,
    or one after the game ended, starts a new game. Pickles exactly: the emulator state (its RNG included) and
    the env's RNG travel with the wrapper (ale-py pickles an env by building a fresh one from its arguments).
    """

    def __init__(self, env: gym.Env, terminal_on_life_loss: bool = False, clip_reward: bool = False,
                 fire_reset: bool = False) -> None:
        super().__init__(env)
        self.terminal_on_life_loss = terminal_on_life_loss
        self.clip_reward = clip_reward
        self.fire_reset = fire_reset and self.unwrapped.get_action_meanings()[1:2] == ["FIRE"]
        self._game_return = 0.0
        self._game_length = 0
        self._lives = 0
        self._in_game = False
        self._last_obs: Any = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        if self._in_game and seed is None and options is None:
            self._in_game = False
            obs, info = self._last_obs, {"lives": self._lives}
        else:
            self._in_game = False
            obs, info = self.env.reset(seed=seed, options=options)
            self._game_return, self._game_length = 0.0, 0
            self._lives = self.unwrapped.ale.lives()
        if self.fire_reset:
            obs = self._fire(obs)
        self._last_obs = obs
        return obs, info

    def _fire(self, obs: Any) -> Any:
        """Press FIRE, which some games (Breakout) need to go on; its reward counts, its step is no agent step."""
        obs, reward, terminated, truncated, _ = self.env.step(1)
        self._game_return += float(reward)
        if terminated or truncated:  # the game ended within those frames: start another one as it is
            obs, _ = self.env.reset()
            self._game_return, self._game_length = 0.0, 0
        self._lives = self.unwrapped.ale.lives()
        return obs

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._game_return += float(reward)
        self._game_length += 1
        lives = self.unwrapped.ale.lives()
        life_lost = lives < self._lives
        self._lives = lives
        game_over = terminated or truncated
        if self.fire_reset and life_lost and not game_over and not self.terminal_on_life_loss:
            # The game goes on across lives (evaluation): press FIRE as a reset after a lost life would, within
            # this agent step; if the game ends during it, this step ends it.
            obs, fire_reward, terminated, truncated, info = self.env.step(1)
            reward = float(reward) + float(fire_reward)
            self._game_return += float(fire_reward)
            self._lives = self.unwrapped.ale.lives()
            game_over = terminated or truncated
        if self.terminal_on_life_loss and life_lost and not game_over:
            self._in_game, self._last_obs, terminated = True, obs, True
        if terminated or truncated:
            info = {**info, GAME_INFO: {"over": game_over, "r": self._game_return, "l": self._game_length}}
        if self.clip_reward:
            reward = float(np.sign(reward))
        return obs, reward, terminated, truncated, info

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_emulator"] = (self.unwrapped.ale.cloneState(include_rng=True), self.unwrapped.np_random)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        ale_state, np_random = state.pop("_emulator")
        self.__dict__.update(state)
        self.unwrapped.ale.restoreState(ale_state)
        self.unwrapped.np_random = np_random


@dataclass(frozen=True)
class AtariFactory:
    """A picklable factory of one preprocessed ALE env (see the module docstring); ``cfg.env.atari`` options
    as fields. The env manager builds collector envs with ``terminal_on_life_loss`` and ``clip_reward`` as
    configured and evaluator envs with both off."""

    env_id: str
    frame_skip: int = 4
    screen_size: int = 84
    frame_stack: int = 4
    noop_max: int = 30
    repeat_action_probability: float = 0.25
    terminal_on_life_loss: bool = False
    clip_reward: bool = False
    fire_reset: bool = False
    max_episode_steps: int | None = None
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, env_cfg: Mapping[str, Any], collector: bool) -> "AtariFactory":
        """The factory ``cfg.env`` (validated) asks for; life loss and clipping only for collector envs."""
        atari = atari_options(env_cfg.get("atari"))
        for key, instead in (("frameskip", "env.atari.frame_skip"), ("max_episode_steps", "env.max_episode_steps"),
                             ("repeat_action_probability", "env.atari.repeat_action_probability")):
            if key in env_cfg["env_kwargs"]:
                raise ConfigError(f"env.env_kwargs.{key} is set by {instead} for Atari envs: set that key instead")
        return cls(env_cfg["env_id"], atari["frame_skip"], atari["screen_size"], atari["frame_stack"],
                   atari["noop_max"], atari["repeat_action_probability"],
                   collector and atari["terminal_on_life_loss"], collector and atari["clip_reward"],
                   atari["fire_reset"], env_cfg["max_episode_steps"], dict(env_cfg["env_kwargs"]))

    def __call__(self) -> gym.Env:
        register_atari(self.env_id)
        env = gym.make(self.env_id, frameskip=1, repeat_action_probability=0.0, **self.env_kwargs)
        if self.repeat_action_probability > 0:  # per emulator frame as ALE does, but with state that pickles
            env = gym.wrappers.StickyAction(env, self.repeat_action_probability)
        env = gym.wrappers.AtariPreprocessing(env, noop_max=self.noop_max, frame_skip=self.frame_skip,
                                              screen_size=self.screen_size)
        if self.max_episode_steps is not None:  # in agent steps, not emulator frames
            env = gym.wrappers.TimeLimit(env, self.max_episode_steps)
        env = AtariGame(env, self.terminal_on_life_loss, self.clip_reward, self.fire_reset)
        return gym.wrappers.FrameStackObservation(env, self.frame_stack)
