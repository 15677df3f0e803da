"""mpe/qmix: the sequence replay buffer, the entry in one process, async and distributed, exact resume, learning."""
from __future__ import annotations

import copy
import pickle
import re

import numpy as np
import pytest
import torch

from conveyor.data import SequenceBuffer
from easydict import EasyDict

from conveyor.cli import main as cli
from conveyor.engine import OnlineRLContext
from conveyor.middleware import OffPolicyLearner, StepCollector, data_pusher, eps_greedy_handler
from conveyor.policy import QMIXPolicy
from conveyor.zoo import load_entry

from tests.policy.policy_testing import TeamMatching, greedy_reward

from .resume_bar import differences, straight_and_split

T, N, AGENTS = 6, 2, 3


def chunk(terminated=(), valid_false=()):
    """A collector's time-major chunk [T, N]: step values t * 10 + n, team observations, per-agent rewards."""
    steps = np.arange(T)[:, None] * 10 + np.arange(N)[None, :]
    term = np.zeros((T, N), dtype=bool)
    for t, n in terminated:
        term[t, n] = True
    valid = np.ones((T, N), dtype=bool)
    for t, n in valid_false:
        valid[t, n] = False
    obs = {"obs": np.repeat(steps[..., None, None], AGENTS, 2).astype(np.float32) * np.ones(4, np.float32),
           "state": steps[..., None].astype(np.float32) * np.ones(5, np.float32),
           "agent_mask": np.ones((T, N, AGENTS), dtype=bool)}
    return {"obs": obs, "next_obs": copy.deepcopy(obs), "action": np.zeros((T, N, AGENTS), dtype=np.int64),
            "reward": np.repeat(steps[..., None], AGENTS, 2).astype(np.float32), "terminated": term,
            "truncated": np.zeros((T, N), dtype=bool), "valid": valid, "step": steps}


def stored(buffer, n=400):
    """The distinct sequences a buffer samples, as tuples of their real steps' values."""
    batch = buffer.sample(n)
    return {tuple(batch.step[:, b][batch.mask[:, b]].tolist()) for b in range(n)}


# --- the sequence buffer ------------------------------------------------------------------------------
def test_sequences_are_cut_at_episode_ends_and_every_sequence_length_steps():
    buffer = SequenceBuffer(100, sequence_length=4, seed=0)
    buffer.extend(chunk(terminated=[(1, 0)]))
    # env 0: an episode ends at step 1, the next runs on (4 steps); env 1: 6 steps cut at 4
    assert stored(buffer) == {(0, 10), (20, 30, 40, 50), (1, 11, 21, 31), (41, 51)}
    assert len(buffer) == 4


def test_a_sample_is_time_major_with_the_team_axis_kept():
    buffer = SequenceBuffer(100, sequence_length=T, seed=0)
    buffer.extend(chunk())
    batch = buffer.sample(5)
    assert batch.obs.obs.shape == (T, 5, AGENTS, 4) and batch.obs.state.shape == (T, 5, 5)
    assert batch.reward.shape == (T, 5, AGENTS) and batch.mask.shape == (T, 5) and batch.index.shape == (5,)
    assert "valid" not in batch and bool(batch.mask.all())


def test_padded_steps_are_masked_zeros_and_crashed_steps_are_left_out():
    buffer = SequenceBuffer(100, sequence_length=T, seed=0)
    buffer.extend(chunk(terminated=[(2, 1)], valid_false=[(3, 0)]))
    batch = buffer.sample(200)
    assert stored(buffer) == {(0, 10, 20), (40, 50), (1, 11, 21), (31, 41, 51)}
    lengths = batch.mask.sum(0)
    for b in range(200):
        real = int(lengths[b])
        assert bool(batch.mask[:real, b].all()) and not bool(batch.mask[real:, b].any())
        assert float(batch.reward[real:, b].abs().sum()) == 0.0 and float(batch.obs.obs[real:, b].abs().sum()) == 0.0


def test_the_buffer_keeps_at_most_size_sequences_the_newest():
    buffer = SequenceBuffer(3, sequence_length=2, seed=0)
    buffer.extend(chunk())  # 6 sequences: (0,10) (20,30) (40,50) of env 0, then env 1's
    assert len(buffer) == 3 and buffer.size == 3
    assert stored(buffer) == {(1, 11), (21, 31), (41, 51)}
    buffer.extend(chunk(terminated=[(0, 0)]))
    assert len(buffer) == 3


def test_a_state_round_trip_restores_contents_and_the_sampling_stream():
    buffer = SequenceBuffer(10, sequence_length=3, seed=4)
    buffer.extend(chunk(terminated=[(1, 1)]))
    buffer.sample(2)
    state = copy.deepcopy(buffer.state_dict())
    restored = SequenceBuffer(10, sequence_length=3, seed=99)
    restored.load_state_dict(state)
    a, b = buffer.sample(7), restored.sample(7)
    assert len(restored) == len(buffer) and torch.equal(a.index, b.index) and torch.equal(a.step, b.step)
    with pytest.raises(ValueError, match="sequence_length=3"):
        SequenceBuffer(10, sequence_length=5).load_state_dict(state)


def test_bad_buffer_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="sequence_length must be a positive int"):
        SequenceBuffer(10, sequence_length=0)
    with pytest.raises(ValueError, match="time-major chunk"):
        SequenceBuffer(10, sequence_length=2).extend({"obs": np.zeros((4, 3))})
    with pytest.raises(ValueError, match="empty"):
        SequenceBuffer(10, sequence_length=2).sample(1)


def test_the_data_pusher_hands_a_sequence_buffer_the_whole_chunk():
    buffer = SequenceBuffer(100, sequence_length=T, seed=0)
    ctx = OnlineRLContext()
    ctx.trajectories = chunk(terminated=[(2, 0)])
    data_pusher(None, buffer)(ctx)
    assert ctx.trajectories is None and stored(buffer) == {(0, 10, 20), (30, 40, 50), (1, 11, 21, 31, 41, 51)}


# --- the entry ----------------------------------------------------------------------------------------
TINY = ["--set", "env.collector_env_num=2", "--set", "env.evaluator_env_num=2", "--set", "env.n_evaluator_episode=2",
        "--set", "policy.collect.n_sample=50", "--set", "policy.learn.batch_size=4",
        "--set", "policy.eval.evaluator.eval_freq=4", "--set", "policy.model.hidden_sizes=[16]",
        "--set", "policy.model.rnn_hidden_size=16"]


def evaluations(run_dir):
    """(env_step, team return) of every evaluation in a run's log."""
    text = (run_dir / "log.txt").read_text()
    return [(int(s), float(r)) for s, r in re.findall(r"env_step (\d+): mean return team ([-0-9.]+)", text)]


@pytest.mark.parametrize("layout", [  # QMIX's own mixer in one process: the exact-resume test's runs below
    pytest.param(["--set", "policy.model.mixer=vdn"], id="vdn-one-process"),
    pytest.param(["--async"], id="async"),
    pytest.param(["--collectors", "2"], id="collectors"),
])
def test_mpe_qmix_trains_and_evaluates_the_team(tmp_path, monkeypatch, capsys, layout):
    monkeypatch.chdir(tmp_path)  # `conveyor train` in this process, which has torch loaded already
    done = cli(["train", "mpe/qmix", *TINY, *layout, "--exp-name", "smoke", "--max-env-step", "300", "--no-progress"])
    assert done == 0, capsys.readouterr().err[-3000:]
    from conveyor.middleware import load_checkpoint
    final = load_checkpoint(tmp_path / "runs" / "smoke" / "ckpt" / "final.pth.tar")
    assert final["ctx"]["env_step"] >= 300 and final["ctx"]["train_iter"] > 0
    assert evaluations(tmp_path / "runs" / "smoke")  # the team's return was measured


def same_state(a, b, path=""):
    """Where two unpickled objects' states differ: containers item by item, generators by their state, objects by
    their attributes, pygame's rendering handles (which have neither, rebuilt at load) by type."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        return [d for k in a.keys() | b.keys() for d in same_state(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths differ"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same_state(x, y, f"{path}[{i}]")]
    if isinstance(a, np.random.Generator):
        return [] if a.bit_generator.state == b.bit_generator.state else [path]
    if isinstance(a, (np.ndarray, torch.Tensor, np.generic, str, bytes, int, float, bool)) or a is None:
        return differences(a, b, path)
    if not hasattr(a, "__dict__"):
        return []
    return same_state(vars(a), vars(b), path)


@pytest.mark.slow
def test_stopping_and_resuming_mpe_qmix_ends_exactly_where_a_straight_run_ends(tmp_path):
    a, b = straight_and_split(tmp_path, "mpe/qmix", (*TINY, "--seed", "3"), 200)
    assert a["ctx"]["env_step"] >= 400 and a["ctx"]["train_iter"] > 0
    envs = [ckpt["middleware"]["2:StepCollector"]["env"]["per_env"].pop("envs") for ckpt in (a, b)]
    assert differences(a, b) == []  # policy, target net, optimizer, the buffer's sequences and RNG, counters
    # MPE's envs pickle by their attributes: a straight run's pickle may share one numpy dtype object where a resumed
    # run's has two equal ones, so their bytes differ; their states must not
    assert len(envs[0]) == len(envs[1]) == 2
    assert [d for x, y in zip(*envs) for d in same_state(pickle.loads(x), pickle.loads(y))] == []
@pytest.mark.slow
def test_qmix_learns_from_sequences_sampled_from_the_buffer():
    """The learner's half of off_policy.q_mixing (collector, eps schedule, pusher, sequence buffer, learner) on the
    team test double: greedy agents go from chance to right on nearly every step."""
    env = TeamMatching()
    policy = QMIXPolicy({"model": {"n_agents": env.agents, "obs_shape": env.actions, "action_shape": env.actions,
                                   "state_shape": env.agents * env.actions, "hidden_sizes": [32],
                                   "rnn_hidden_size": 16, "mixing_embed_dim": 8, "hypernet_hidden": 16},
                         "learn": {"learning_rate": 5e-3, "target_theta": 0.05, "batch_size": 16,
                                   "update_per_collect": 2},
                         "collect": {"n_sample": env.env_num * env.length}, "discount_factor": 0.5,
                         "other": {"eps": {"kind": "linear", "start": 1.0, "end": 0.1, "decay": 400}}}, seed=0)
    cfg = EasyDict(seed=0, policy=policy.cfg)
    buffer = SequenceBuffer(200, env.length, seed=0)
    chain = [eps_greedy_handler(cfg), StepCollector(cfg, policy.collect_mode, env), data_pusher(cfg, buffer),
             OffPolicyLearner(cfg, policy.learn_mode, buffer)]
    ctx = OnlineRLContext()
    before = greedy_reward(policy)
    for _ in range(60):
        for middleware in chain:
            middleware(ctx)
    assert len(buffer) == 200 and ctx.train_iter > 80
    assert before < 0.7 and greedy_reward(policy) > 0.9

