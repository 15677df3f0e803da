"""DequeBuffer(frame_stack=...): each frame stored once, samples equal to a plain buffer's fed the same data."""
import pickle

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch

import conveyor.data.frames as frames_module
from conveyor.data import DequeBuffer, flatten_batch, to_tensor
from conveyor.middleware.enhancer import NStepEnhancer

K, H, W = 4, 6, 5


class Envs:
    """Atari-like envs stepped in lock-step: obs are stacks of the last K frames, a reset stack repeats its first
    frame (Gymnasium's FrameStackObservation), frames come from a small palette so identical frames recur across
    envs and episodes, and episodes end (terminated or truncated) at random."""

    def __init__(self, n_envs: int, seed: int = 0, palette: int = 40) -> None:
        self.rng = np.random.default_rng(seed)
        self.palette = self.rng.integers(0, 256, (palette, H, W), dtype=np.uint8)
        self.n = n_envs
        self.stacks = [self._reset() for _ in range(n_envs)]

    def _frame(self) -> np.ndarray:
        return self.palette[self.rng.integers(len(self.palette))]

    def _reset(self) -> np.ndarray:
        return np.stack([self._frame()] * K)

    def collect(self, steps: int) -> ttorch.Tensor:
        """A time-major batch [steps, n_envs] as StepCollector writes it."""
        rows = {key: [] for key in ("obs", "next_obs", "action", "reward", "terminated", "truncated")}
        for _ in range(steps):
            obs = np.stack(self.stacks)
            nxt = np.stack([np.concatenate([s[1:], self._frame()[None]]) for s in self.stacks])
            end = self.rng.random(self.n)
            terminated, truncated = end < 0.08, (end >= 0.08) & (end < 0.12)
            for key, value in (("obs", obs), ("next_obs", nxt), ("action", self.rng.integers(0, 4, self.n)),
                               ("reward", self.rng.standard_normal(self.n).astype(np.float32)),
                               ("terminated", terminated), ("truncated", truncated)):
                rows[key].append(value)
            self.stacks = [self._reset() if terminated[i] or truncated[i] else nxt[i] for i in range(self.n)]
        return to_tensor({key: np.stack(value) for key, value in rows.items()})


def pair(size: int, prioritized: bool = False, frame_stack="auto") -> tuple[DequeBuffer, DequeBuffer]:
    kwargs = dict(prioritized=prioritized, seed=3)
    return DequeBuffer(size, **kwargs), DequeBuffer(size, frame_stack=frame_stack, **kwargs)


def feed(buffers, envs: Envs, calls: int, steps: int) -> ttorch.Tensor:
    """``calls`` collections of ``steps`` steps from every env, extended into each buffer; returns the last batch."""
    for _ in range(calls):
        batch = flatten_batch(envs.collect(steps), 2)
        for buffer in buffers:
            buffer.extend(batch)
    return batch


def assert_same_samples(plain: DequeBuffer, frames: DequeBuffer, n: int = 64, rounds: int = 3) -> None:
    for _ in range(rounds):
        a, b = plain.sample(n), frames.sample(n)
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        if plain.prioritized:
            priority = torch.rand(n, generator=torch.Generator().manual_seed(len(plain)))
            plain.update_priority(a.index, priority)
            frames.update_priority(b.index, priority)


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_samples_equal_a_plain_buffer_over_episodes_envs_and_ring_wrap_around(prioritized):
    plain, frames = pair(50, prioritized)
    envs = Envs(n_envs=3)
    for call in range(12):  # 12 calls x 3 envs x 5 steps = 180 transitions through a ring of 50
        feed([plain, frames], envs, calls=1, steps=5)
        assert_same_samples(plain, frames)
    assert len(frames) == 50


def test_each_frame_is_stored_once():
    plain, frames = pair(300)
    batch = feed([frames], Envs(n_envs=4, palette=10_000), calls=10, steps=5)
    episodes = int((batch.terminated | batch.truncated).sum())
    assert len(frames) == 200
    assert frames.frame_count < 200 + 4 * K + 200 * 0.2 + episodes  # about one new frame per transition


def test_n_step_next_obs_from_the_enhancer_samples_exactly():
    plain, frames = pair(60, prioritized=True)
    envs, enhancer = Envs(n_envs=3, seed=1), NStepEnhancer(0.99, 3)
    for _ in range(10):
        batch = enhancer.process(envs.collect(4))
        if len(batch.reward):
            plain.extend(batch)
            frames.extend(batch)
    assert_same_samples(plain, frames)


def test_pushed_one_at_a_time_equals_extended():
    plain, frames = pair(20)
    batch = flatten_batch(Envs(n_envs=2).collect(15), 2)
    plain.extend(batch)
    for i in range(len(batch.reward)):
        frames.push(batch[i])
    assert_same_samples(plain, frames)


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_state_dict_round_trip_restores_frames_and_continues_the_ring(prioritized):
    plain, frames = pair(40, prioritized)
    envs = Envs(n_envs=3, seed=2)
    feed([plain, frames], envs, calls=8, steps=4)
    restored = DequeBuffer(40, prioritized=prioritized, frame_stack="auto")
    restored.load_state_dict(pickle.loads(pickle.dumps(frames.state_dict())))
    assert restored.frame_count == frames.frame_count
    feed([plain, restored], envs, calls=4, steps=4)
    assert_same_samples(plain, restored)


def test_a_plain_buffers_state_loads_into_a_frame_buffer():
    plain, frames = pair(30)
    plain.extend(flatten_batch(Envs(n_envs=2).collect(20), 2))
    frames.load_state_dict(plain.state_dict())
    assert 0 < frames.frame_count < 30 * 2 * K
    assert_same_samples(plain, frames)


def test_a_frame_buffers_state_into_a_plain_buffer_says_how_to_fix_it():
    _, frames = pair(10)
    frames.extend(flatten_batch(Envs(n_envs=2).collect(3), 2))
    with pytest.raises(ValueError, match="frame_stack"):
        DequeBuffer(10).load_state_dict(frames.state_dict())


def test_frames_whose_hashes_collide_are_still_returned_exactly(monkeypatch):
    monkeypatch.setattr(frames_module, "hash", lambda data: 7, raising=False)
    plain, frames = pair(30, prioritized=True)
    feed([plain, frames], Envs(n_envs=2, seed=4), calls=6, steps=4)
    assert_same_samples(plain, frames)


def test_cleared_buffer_stores_frames_anew():
    plain, frames = pair(16)
    envs = Envs(n_envs=2)
    feed([frames], envs, calls=1, steps=6)
    frames.clear()
    assert frames.frame_count == 0
    feed([plain, frames], envs, calls=1, steps=6)
    assert_same_samples(plain, frames)


def test_auto_leaves_float_and_single_frame_observations_as_they_are():
    buffer = DequeBuffer(8, frame_stack="auto")
    buffer.extend({"obs": np.zeros((4, 3), np.float32), "next_obs": np.zeros((4, 3), np.float32)})
    assert buffer.frame_count == 0 and buffer.sample(2).obs.shape == (2, 3)


def test_forced_frame_stack_stores_other_dtypes_as_frames():
    plain, frames = pair(10, frame_stack=2)
    data = {"obs": np.random.default_rng(0).standard_normal((6, 2, 3, 3)).astype(np.float32), "action": np.arange(6)}
    data["next_obs"] = np.concatenate([data["obs"][:, 1:], data["obs"][:, :1]], axis=1)
    plain.extend(data)
    frames.extend(data)
    assert frames.frame_count == 12
    assert_same_samples(plain, frames)


def test_forced_frame_stack_with_other_shapes_says_how_to_fix_it():
    buffer = DequeBuffer(8, frame_stack=4)
    with pytest.raises(ValueError, match=r"frame_stack=4 needs observations of shape \[4, H, W\].*'auto'"):
        buffer.extend({"obs": np.zeros((2, 3, 84, 84), np.uint8)})
    buffer.extend({"obs": np.zeros((2, 4, 84, 84), np.uint8)})  # the bad data fixed no layout
    assert len(buffer) == 2


@pytest.mark.parametrize("value", ["yes", 0, 2.0, True])
def test_bad_frame_stack_values_are_refused(value):
    with pytest.raises(ValueError, match="frame_stack must be 'auto', an int >= 1"):
        DequeBuffer(8, frame_stack=value)


def test_a_batch_larger_than_the_ring_keeps_its_newest_rows():
    plain, frames = pair(10)
    feed([plain, frames], Envs(n_envs=3), calls=2, steps=7)
    assert len(frames) == 10 and frames.frame_count <= 10 * 2 * K
    assert_same_samples(plain, frames)


def test_frame_stacks_inside_dict_observations_are_deduplicated():
    plain, frames = pair(30)
    batch = flatten_batch(Envs(n_envs=2).collect(10), 2)
    nested = {key: batch[key] for key in ("action", "reward")}
    for key in ("obs", "next_obs"):
        nested[key] = {"image": batch[key], "speed": batch[key][:, 0, 0, :2].float()}
    plain.extend(nested)
    frames.extend(nested)
    assert 0 < frames.frame_count < 20 * K
    assert_same_samples(plain, frames)


def test_off_policy_replay_options_default_to_auto_and_refuse_bad_values():
    from conveyor.policy import DQNPolicy, SACPolicy
    from conveyor.schema import ConfigError, validate

    for policy in (DQNPolicy, SACPolicy):
        assert policy.default_config().other.replay_buffer.frame_stack == "auto"
    schema = DQNPolicy.config_schema()
    assert validate({"other": {"replay_buffer": {"frame_stack": None}}}, schema).other.replay_buffer.frame_stack is None
    with pytest.raises(ConfigError, match=r"other\.replay_buffer\.frame_stack.*'auto', an int >= 1"):
        validate({"other": {"replay_buffer": {"frame_stack": 0}}}, schema)
