"""Pushing into a buffer and off-policy learning from it."""
import numpy as np
import torch
import treetensor.torch as ttorch

from conveyor import OnlineRLContext
from conveyor.data import DequeBuffer
from conveyor.middleware import OffPolicyLearner, StepCollector, data_pusher


def time_major(T, N, valid=None):
    batch = ttorch.Tensor({"obs": torch.randn(T, N, 4), "action": torch.zeros(T, N, dtype=torch.long),
                           "reward": torch.ones(T, N), "next_obs": torch.randn(T, N, 4),
                           "terminated": torch.zeros(T, N, dtype=torch.bool),
                           "truncated": torch.zeros(T, N, dtype=torch.bool)})
    batch.valid = torch.ones(T, N, dtype=torch.bool) if valid is None else valid
    return batch


def test_data_pusher_flattens_trajectories_into_the_buffer_and_clears_them(cfg):
    buffer = DequeBuffer(100)
    ctx = OnlineRLContext()
    ctx.trajectories = time_major(3, 4)
    data_pusher(cfg, buffer)(ctx)
    assert len(buffer) == 12 and ctx.trajectories is None


def test_data_pusher_drops_invalid_rows(cfg):
    buffer = DequeBuffer(100)
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[1, 2] = False
    ctx = OnlineRLContext()
    ctx.trajectories = time_major(3, 4, valid)
    data_pusher(cfg, buffer)(ctx)
    assert len(buffer) == 11
    assert "valid" not in buffer.sample(4)


def test_data_pusher_pushes_episodes(cfg):
    buffer = DequeBuffer(100)
    ctx = OnlineRLContext()
    episode = time_major(5, 1)
    del episode["valid"]
    ctx.episodes = [episode[:, 0], episode[:3, 0]]
    data_pusher(cfg, buffer)(ctx)
    assert len(buffer) == 8 and ctx.episodes is None


def test_learner_waits_for_a_full_batch_then_runs_update_per_collect_steps(cfg, policy):
    buffer = DequeBuffer(100)
    learner = OffPolicyLearner(cfg, policy.learn_mode, buffer)
    ctx = OnlineRLContext()
    learner(ctx)
    assert ctx.train_iter == 0 and ctx.train_output is None
    ctx.trajectories = time_major(2, 4)
    data_pusher(cfg, buffer)(ctx)
    learner(ctx)
    assert ctx.train_iter == cfg.policy.learn.update_per_collect == len(ctx.train_output)
    assert all(isinstance(v, float) for v in ctx.train_output[0].values())
    assert policy.learn_mode.train_iter == ctx.train_iter


def test_learner_keeps_the_replay_ratio_whatever_env_steps_arrive_and_resumes_its_fraction(cfg, policy):
    """Fed by collector processes, a call may follow more or fewer env steps than n_sample: the learner takes
    update_per_collect steps per n_sample env steps, carrying fractions over, also across a resume."""
    buffer = DequeBuffer(100)
    ctx = OnlineRLContext()
    ctx.trajectories = time_major(4, 4)
    data_pusher(cfg, buffer)(ctx)
    per, n = cfg.policy.learn.update_per_collect, cfg.policy.collect.n_sample
    learner = OffPolicyLearner(cfg, policy.learn_mode, buffer)
    learner(ctx)  # the first call is one round
    assert ctx.train_iter == per
    ctx.env_step += 3 * n
    learner(ctx)
    assert ctx.train_iter == 4 * per
    ctx.env_step += n // 2 + n // 4  # three quarters of a round
    learner(ctx)
    taken = ctx.train_iter
    assert taken == 4 * per + (3 * per) // 4
    resumed = OffPolicyLearner(cfg, policy.learn_mode, buffer)
    resumed.load_state_dict(learner.state_dict())
    ctx.env_step += n // 4  # the last quarter completes the round the fraction was owed from
    resumed(ctx)
    assert ctx.train_iter == 5 * per


class RecordingBuffer(DequeBuffer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates = []

    def update_priority(self, index, priority):
        self.updates.append((np.asarray(index), np.asarray(priority)))
        super().update_priority(index, priority)


def test_learner_writes_priorities_back_to_a_prioritized_buffer(cfg, policy):
    buffer = RecordingBuffer(64, prioritized=True, seed=0)
    ctx = OnlineRLContext()
    ctx.trajectories = time_major(4, 4)
    data_pusher(cfg, buffer)(ctx)
    OffPolicyLearner(cfg, policy.learn_mode, buffer)(ctx)
    assert len(buffer.updates) == cfg.policy.learn.update_per_collect
    index, priority = buffer.updates[0]
    assert index.shape == priority.shape == (cfg.policy.learn.batch_size,)
    assert (priority >= 0).all()


def test_learner_leaves_a_uniform_buffer_without_priorities(cfg, policy):
    buffer = RecordingBuffer(64)
    ctx = OnlineRLContext()
    ctx.trajectories = time_major(4, 4)
    data_pusher(cfg, buffer)(ctx)
    OffPolicyLearner(cfg, policy.learn_mode, buffer)(ctx)
    assert buffer.updates == [] and ctx.train_iter == cfg.policy.learn.update_per_collect


def run_chain(cfg, policy, envs, buffer):
    """Five iterations of collector, pusher and learner; the final context."""
    from conveyor import task
    with task.start(ctx=OnlineRLContext()):
        task.use(lambda ctx: ctx.collect_kwargs.update(eps=0.5))
        task.use(StepCollector(cfg, policy.collect_mode, envs))
        task.use(data_pusher(cfg, buffer))
        task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer))
        task.run(max_step=5)
        return task.ctx


def test_collector_pusher_learner_chain_trains(cfg, policy, cartpole_envs):
    ctx = run_chain(cfg, policy, cartpole_envs(4), DequeBuffer(1000))
    assert ctx.env_step == 80 and ctx.train_iter == 10


def test_learner_publishes_once_per_call_and_the_buffer_keeps_the_version_of_every_row(cfg, policy, cartpole_envs):
    buffer = DequeBuffer(1000)
    run_chain(cfg, policy, cartpole_envs(4), buffer)
    assert policy.version == 5  # one publish per learner call, however many gradient steps it took
    stored = buffer.state_dict()["storage"]["weight_version"]
    assert stored.dtype == np.int64
    assert sorted(set(stored[:len(buffer)].tolist())) == [0, 1, 2, 3, 4]  # call k collected with version k


def test_learner_refuses_a_view_that_cannot_publish(cfg):
    import pytest

    class StepOnly:
        def forward(self, batch):
            return {}

    with pytest.raises(TypeError, match="publish"):
        OffPolicyLearner(cfg, StepOnly(), DequeBuffer(10))
