"""episode_recorder: the episodes an online pipeline collects become a Minari dataset, whole and exact."""
import gymnasium as gym
import numpy as np
import pytest
from easydict import EasyDict

from conveyor import OnlineRLContext, task
from conveyor.config import compile_config
from conveyor.data import DatasetWriter, concat_datasets, load_dataset, to_numpy
from conveyor.envs import SyncEnvManager
from conveyor.middleware import EpisodeCollector, StepCollector, episode_recorder, nstep_reward_enhancer
from conveyor.policy import DQNPolicy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FIELDS = (("obs", "observations"), ("action", "actions"), ("reward", "rewards"), ("next_obs", "next_observations"),
          ("terminated", "terminations"), ("truncated", "truncations"))


@pytest.fixture
def cfg():
    return compile_config(EasyDict(dict(
        exp_name="record", seed=0, env=dict(env_id="CartPole-v1", collector_env_num=2),
        policy=dict(nstep=1, collect=dict(n_sample=16, n_episode=3), model=dict(hidden_sizes=[8])))), policy=DQNPolicy)


def make_envs(request):
    # 14-step time limit: random CartPole episodes both fall (terminated) and run out of time (truncated)
    env = SyncEnvManager([lambda: gym.make("CartPole-v1", max_episode_steps=14)] * 2, seed=0)
    request.addfinalizer(env.close)
    return env


@pytest.fixture
def envs(request):
    return make_envs(request)


def writer(tmp_path, envs, dataset_id="test/recorded-v0"):
    return DatasetWriter(dataset_id, envs.observation_space, envs.action_space, root=tmp_path)


def episodes_of(columns):
    """Reference: each env's rows, cut after every terminated or truncated row; unfinished tails dropped."""
    out = []
    for env_rows in columns:
        start = 0
        for t in np.flatnonzero(env_rows["terminated"] | env_rows["truncated"]):
            out.append({k: v[start:t + 1] for k, v in env_rows.items()})
            start = t + 1
    return out


def test_step_collector_episodes_are_recorded_whole_across_calls(cfg, envs, tmp_path):
    policy = DQNPolicy(cfg.policy, seed=0)
    batches = []
    with task.start(ctx=OnlineRLContext()):
        task.use(lambda ctx: ctx.collect_kwargs.update(eps=1.0))
        task.use(StepCollector(cfg, policy.collect_mode, envs))
        task.use(episode_recorder(writer(tmp_path, envs)))
        task.use(lambda ctx: batches.append(to_numpy(ctx.trajectories)))
        task.run(max_step=6)  # 48 steps per env: several episodes, some cut by call boundaries
    data = load_dataset("test/recorded-v0", root=tmp_path)
    columns = [{k: np.concatenate([b[k][:, i] for b in batches]) for k, _ in FIELDS} for i in range(2)]
    expected = episodes_of(columns)
    got = list(data.episodes())
    assert data.terminations.any() and data.truncations.any()
    key = lambda ep: ep["obs"][0].tobytes()  # noqa: E731 - episodes from two envs interleave; match by first obs
    for want, have in zip(sorted(expected, key=key), sorted((ep.as_batch() for ep in got), key=key)):
        for name, _ in FIELDS:
            assert np.array_equal(np.asarray(want[name], dtype=have[name].dtype), have[name]), name
    assert len(got) == len(expected) and len(data) == sum(len(ep["reward"]) for ep in expected)


def test_episode_collector_episodes_are_recorded_as_handed_out(cfg, envs, tmp_path):
    policy = DQNPolicy(cfg.policy, seed=0)
    handed = []
    with task.start(ctx=OnlineRLContext()):
        task.use(lambda ctx: ctx.collect_kwargs.update(eps=1.0))
        task.use(EpisodeCollector(cfg, policy.collect_mode, envs))
        task.use(episode_recorder(writer(tmp_path, envs)))
        task.use(lambda ctx: handed.extend(to_numpy(ep) for ep in ctx.episodes))
        task.run(max_step=2)
    data = load_dataset("test/recorded-v0", root=tmp_path)
    assert data.num_episodes == len(handed) == 6
    for ep, have in zip(handed, data.episodes()):
        assert np.array_equal(ep["obs"], have.observations) and np.array_equal(ep["action"], have.actions)
        assert np.array_equal(ep["terminated"], have.terminations) and np.array_equal(ep["truncated"], have.truncations)


def test_recorder_after_an_nstep_enhancer_is_refused(cfg, envs, tmp_path):
    cfg.policy.nstep = 3
    policy = DQNPolicy(cfg.policy, seed=0)
    with task.start(ctx=OnlineRLContext()):
        task.use(lambda ctx: ctx.collect_kwargs.update(eps=1.0))
        task.use(StepCollector(cfg, policy.collect_mode, envs))
        task.use(nstep_reward_enhancer(cfg))
        task.use(episode_recorder(writer(tmp_path, envs)))
        with pytest.raises(ValueError, match="place the recorder right after the collector"):
            task.run(max_step=3)


def record(cfg, request, tmp_path, dataset_id, steps, state=None):
    """``steps`` iterations of collector + recorder (from ``state`` if given); the pipeline's state at the end."""
    envs = make_envs(request)
    policy = DQNPolicy(cfg.policy, seed=0)
    with task.start(ctx=OnlineRLContext()):
        task.register_state("policy", policy)
        task.use(lambda ctx: ctx.collect_kwargs.update(eps=1.0))
        task.use(StepCollector(cfg, policy.collect_mode, envs))
        task.use(episode_recorder(writer(tmp_path, envs, dataset_id)))
        if state is not None:
            task.load_state_dict(state)
        task.run(max_step=steps)
        return task.state_dict()


def test_a_resumed_recording_finishes_the_episodes_running_at_the_checkpoint(cfg, request, tmp_path):
    record(cfg, request, tmp_path, "test/whole-v0", steps=6)
    state = record(cfg, request, tmp_path, "test/first-v0", steps=3)
    record(cfg, request, tmp_path, "test/second-v0", steps=3, state=state)
    whole = load_dataset("test/whole-v0", root=tmp_path)
    first, second = (load_dataset(f"test/{name}-v0", root=tmp_path) for name in ("first", "second"))
    assert first.num_episodes and second.num_episodes
    joined = concat_datasets([first, second])
    for _, name in FIELDS + (("", "episode_ids"),):
        assert np.array_equal(getattr(joined, name), getattr(whole, name)), name
