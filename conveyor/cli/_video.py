"""Recording one episode of a policy as a GIF or an MP4 (imageio), for ``conveyor eval --record``."""
from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path
from typing import Any, List, Tuple

import gymnasium as gym
import numpy as np

from conveyor.envs import SyncEnvManager, env_factory, is_mujoco_id
from conveyor.middleware import evaluate

__all__ = ["record_episode", "offscreen_gl", "check_renderer"]

_OFFSCREEN = {"egl": "EGL", "osmesa": "OSMesa"}
"""MuJoCo's offscreen renderers (``MUJOCO_GL``) in the order tried without a display, and the library each loads."""


def _headless() -> bool:
    return not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def offscreen_gl() -> None:
    """Without a display, point MuJoCo at the first offscreen renderer whose library is here (EGL, then OSMesa) by
    setting ``MUJOCO_GL`` before mujoco is imported: its default, GLFW, aborts the process without a display."""
    if _headless() and "MUJOCO_GL" not in os.environ and "mujoco" not in sys.modules:
        found = [gl for gl, library in _OFFSCREEN.items() if ctypes.util.find_library(library)]
        if found:
            os.environ["MUJOCO_GL"] = found[0]


def check_renderer(env_id: str) -> None:
    """Refuse in one line to render a MuJoCo env without a display or an offscreen renderer (GLFW would abort)."""
    if is_mujoco_id(env_id) and _headless() and os.environ.get("MUJOCO_GL") not in _OFFSCREEN:
        raise ImportError(f"--record: rendering {env_id} without a display needs MuJoCo's EGL or OSMesa renderer "
                          f"(MUJOCO_GL={os.environ.get('MUJOCO_GL', 'glfw')} here): apt install libegl1 (or "
                          f"libosmesa6) and leave MUJOCO_GL unset, or run with a DISPLAY")


class _Frames(gym.Wrapper):
    """Keeps the ``rgb_array`` frame after the first reset and after each step of the first episode in
    ``frames``, and the env's frame rate in ``fps``."""

    def __init__(self, env: gym.Env, frames: List[np.ndarray], fps: List[int]) -> None:
        super().__init__(env)
        self._frames = frames
        self._done = False
        fps.append(int(env.metadata.get("render_fps") or 30))

    def reset(self, **kwargs: Any) -> Any:
        out = self.env.reset(**kwargs)
        if not self._done:
            self._frames.append(self.env.render())
        return out

    def step(self, action: Any) -> Any:
        out = self.env.step(action)
        if not self._done:
            self._frames.append(self.env.render())
            self._done = bool(out[2] or out[3])
        return out


def _write_gif(out: Path, video: np.ndarray, duration_ms: int) -> None:
    """Write ``video`` (frames, height, width, 3) as a looping GIF with one 256-colour palette taken from up to 16
    frames spread over the episode: Pillow's default (a median-cut palette per frame) spends ~35 ms a 600x400
    frame, 17 s of a 500-step CartPole episode; this takes ~2 ms a frame, and frames share their colours."""
    from PIL import Image

    sample = video[np.linspace(0, len(video) - 1, min(16, len(video))).astype(int)]
    palette = Image.fromarray(np.concatenate(list(sample), axis=0)).quantize(256)
    images = [Image.fromarray(frame).quantize(palette=palette, dither=Image.Dither.NONE) for frame in video]
    images[0].save(out, save_all=True, append_images=images[1:], duration=duration_ms, loop=0)


def record_episode(cfg: Any, policy: Any, out: Path, seed: int) -> Tuple[float, int]:
    """Play one episode of ``policy.eval_mode`` on ``cfg.env`` rendering ``rgb_array`` frames (as the evaluator
    plays them, :func:`~conveyor.middleware.evaluate`) and write them to ``out`` (``.gif`` or ``.mp4``) at the
    env's ``render_fps``; returns the episode's return and length. Without a display, call :func:`offscreen_gl`
    before mujoco is imported."""
    try:
        import imageio.v3 as iio
    except ImportError:
        raise ImportError("--record needs imageio: pip install imageio (and imageio-ffmpeg for .mp4)") from None
    check_renderer(cfg.env.env_id)
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # rgb_array frames need no window (pygame's envs)
    # As the evaluator builds it (an Atari id preprocessed, whole games), rendering rgb_array frames.
    make = env_factory({**cfg.env, "env_kwargs": dict(cfg.env.env_kwargs, render_mode="rgb_array")}, "evaluator")
    frames: List[np.ndarray] = []
    fps: List[int] = []
    try:
        with SyncEnvManager([lambda: _Frames(make(), frames, fps)], env_id=cfg.env.env_id) as env:
            result = evaluate(policy.eval_mode, env, 1, seed=seed)
    except gym.error.DependencyNotInstalled as exc:
        raise ImportError(f"--record: rendering {cfg.env.env_id} needs a package that is missing: {exc}") from None
    video = np.stack(frames)
    if out.suffix.lower() == ".gif":
        _write_gif(out, video, 1000 // fps[0])
    else:
        try:
            iio.imwrite(out, video, fps=fps[0], plugin="FFMPEG", macro_block_size=1)
        except (ImportError, RuntimeError) as exc:
            raise ImportError(f"--record {out}: writing MP4 needs imageio-ffmpeg (pip install imageio-ffmpeg), or "
                              f"record a .gif ({' '.join(str(exc).split())[:120]})") from None
    return result["returns"][0], result["lengths"][0]
