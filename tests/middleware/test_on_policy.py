"""On-policy trainers: epochs of shuffled minibatches, full-batch steps, and the on-policy pipeline as written."""
import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch
import treetensor.torch as ttorch
from easydict import EasyDict

from conveyor import OnlineRLContext, task
from conveyor.config import compile_config
from conveyor.envs import SyncEnvManager
from conveyor.middleware import (CkptSaver, StepCollector, gae_estimator, interaction_evaluator, multistep_trainer,
                                 trainer)
from conveyor.policy import LearnResult, PPOPolicy


class RecordingLearner:
    """A learn view that records the batches it is given."""

    def __init__(self):
        self.batches = []
        self.published_after = []  # how many batches had been seen at each publish

    def forward(self, batch):
        self.batches.append(batch)
        return {"losses/x": 0.0}

    def publish(self):
        self.published_after.append(len(self.batches))
        return len(self.published_after)


def learn_cfg(**learn):
    return EasyDict(seed=0, policy=dict(learn=dict(learn)))


def flat_batch(n):
    return ttorch.Tensor({"obs": torch.arange(n, dtype=torch.float32), "reward": torch.zeros(n),
                          "adv": torch.zeros(n)})


def train(mw, data):
    ctx = OnlineRLContext()
    ctx.train_data = data
    mw(ctx)
    return ctx


def test_multistep_trainer_runs_epochs_of_shuffled_minibatches_covering_every_row():
    learner = RecordingLearner()
    ctx = train(multistep_trainer(learn_cfg(epoch_per_collect=3, batch_size=4), learner), flat_batch(10))
    assert ctx.train_iter == 3 * 3 == len(ctx.train_output)  # minibatches of 4, 4 and the remaining 2
    assert [len(b.obs) for b in learner.batches] == [4, 4, 2] * 3
    for epoch in range(3):
        seen = torch.cat([b.obs for b in learner.batches[3 * epoch:3 * epoch + 3]])
        assert sorted(seen.tolist()) == list(range(10))
    assert learner.batches[0].obs.tolist() != learner.batches[3].obs.tolist()  # reshuffled every epoch
    assert learner.published_after == [9]  # the weights are published once, after the round


def test_multistep_trainer_cuts_sequence_batches_into_whole_sequences():
    learner = RecordingLearner()
    seqs = ttorch.Tensor({"obs": torch.arange(24.0).reshape(4, 6), "reward": torch.zeros(4, 6),  # [L = 4, B = 6]
                          "episode_start": torch.zeros(4, 6, dtype=torch.bool)})
    ctx = train(multistep_trainer(learn_cfg(epoch_per_collect=1, batch_size=8), learner), seqs)
    assert ctx.train_iter == 3  # 8 transitions = 2 sequences of 4 per minibatch
    assert all(tuple(b.obs.shape) == (4, 2) for b in learner.batches)
    columns = sorted(int(c) for b in learner.batches for c in b.obs[0])
    assert columns == list(range(6))


def test_a_step_the_policy_declines_ends_the_round_and_is_not_counted():
    class Drifting(RecordingLearner):
        def forward(self, batch):
            super().forward(batch)
            return LearnResult({"charts/approx_kl": 0.01}, early_stop=len(self.batches) == 4)  # declines the 4th

    learner = Drifting()
    ctx = train(multistep_trainer(learn_cfg(epoch_per_collect=4, batch_size=4, target_kl=0.02), learner),
                flat_batch(8))
    assert len(learner.batches) == 4 and ctx.train_iter == 3  # three gradient steps, then the declined one
    assert len(ctx.train_output) == 4 and all("early_stop" not in out for out in ctx.train_output)
    assert learner.published_after == [4]


class LrRecorder(RecordingLearner):
    def __init__(self):
        super().__init__()
        self.factors = []

    def set_lr_factor(self, factor):
        self.factors.append(factor)


@pytest.mark.parametrize("unit, env_steps, expected", [
    ("env_step", [0, 50, 100, 150], [1.0, 0.5, 0.0, 0.0]),
    ("iteration", [0, 1000, 2000, 3000], [1.0, 0.5, 0.0, 0.0]),
])
def test_learning_rate_anneals_by_env_steps_or_rounds_never_by_gradient_steps(unit, env_steps, expected):
    learner = LrRecorder()
    steps = 100 if unit == "env_step" else 2
    mw = multistep_trainer(learn_cfg(epoch_per_collect=3, batch_size=2, lr_anneal_steps=steps, lr_anneal_unit=unit),
                           learner)
    for step in env_steps:
        ctx = OnlineRLContext()
        ctx.env_step, ctx.train_data = step, flat_batch(8)
        mw(ctx)
    assert learner.factors == pytest.approx(expected)


def test_a_resumed_trainer_shuffles_and_anneals_as_an_uninterrupted_one():
    def rounds(mw, learner, n):
        for _ in range(n):
            train(mw, flat_batch(10))
        return [b.obs.tolist() for b in learner.batches]

    cfg = learn_cfg(epoch_per_collect=2, batch_size=4, lr_anneal_steps=10, lr_anneal_unit="iteration")
    straight = LrRecorder()
    expected = rounds(multistep_trainer(cfg, straight), straight, 4)
    first, second = LrRecorder(), LrRecorder()
    mw = multistep_trainer(cfg, first)
    rounds(mw, first, 2)
    resumed = multistep_trainer(cfg, second)
    resumed.load_state_dict(pickle.loads(pickle.dumps(mw.state_dict())))
    assert first.batches and [b.obs.tolist() for b in first.batches] + rounds(resumed, second, 2) == expected
    assert first.factors + second.factors == straight.factors


def test_a_minibatch_as_large_as_the_batch_is_the_batch_itself():
    learner = RecordingLearner()
    data = flat_batch(8)
    train(multistep_trainer(learn_cfg(epoch_per_collect=2, batch_size=8), learner), data)
    assert [b is data for b in learner.batches] == [True, True]


def test_trainer_takes_update_per_collect_steps_on_the_whole_batch():
    learner = RecordingLearner()
    data = flat_batch(10)
    ctx = train(trainer(learn_cfg(update_per_collect=2), learner), data)
    assert ctx.train_iter == 2 and len(ctx.train_output) == 2
    assert all(b is data for b in learner.batches)
    assert learner.published_after == [2]


def test_trainers_do_nothing_without_train_data():
    learner = RecordingLearner()
    for mw in (trainer(learn_cfg(), learner), multistep_trainer(learn_cfg(epoch_per_collect=2, batch_size=4), learner)):
        ctx = train(mw, None)
        assert ctx.train_iter == 0 and ctx.train_output is None
    assert learner.batches == []


def test_bad_trainer_config_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="epoch_per_collect"):
        multistep_trainer(learn_cfg(epoch_per_collect=0, batch_size=4), RecordingLearner())


# --- the on-policy pipeline as users write it ------------------------------------------------------------
@pytest.fixture
def ppo_cfg():
    return compile_config(EasyDict(dict(
        exp_name="onpolicy", seed=0,
        env=dict(env_id="CartPole-v1", collector_env_num=4, evaluator_env_num=2, n_evaluator_episode=2),
        policy=dict(model=dict(hidden_sizes=[16]), collect=dict(n_sample=64),
                    learn=dict(epoch_per_collect=2, batch_size=32), eval=dict(evaluator=dict(eval_freq=8))),
    )), policy=PPOPolicy)


@pytest.mark.parametrize("async_mode", [False, True])
def test_the_on_policy_pipeline_runs_as_written(ppo_cfg, tmp_path, request, async_mode):
    cfg = ppo_cfg
    policy = PPOPolicy(cfg.policy)
    collector_env = SyncEnvManager([lambda: gym.make("CartPole-v1")] * 4, seed=0)
    evaluator_env = SyncEnvManager([lambda: gym.make("CartPole-v1")] * 2, seed=1)
    request.addfinalizer(collector_env.close)
    request.addfinalizer(evaluator_env.close)
    with task.start(async_mode=async_mode, ctx=OnlineRLContext()):
        task.use(interaction_evaluator(cfg, policy.eval_mode, evaluator_env))
        task.use(StepCollector(cfg, policy.collect_mode, collector_env))
        task.use(gae_estimator(cfg, policy.collect_mode))
        task.use(multistep_trainer(cfg, policy.learn_mode))
        task.use(CkptSaver(policy, tmp_path / cfg.exp_name, train_freq=100))
        task.run(max_step=5)
        ctx = task.ctx
    assert ctx.env_step == 5 * 64
    assert ctx.train_iter == policy.learn_mode.train_iter == 5 * 2 * 2
    assert ctx.last_eval_value is not None
    assert (tmp_path / cfg.exp_name / "ckpt" / "eval_best.pth.tar").is_file()
    assert np.isfinite(list(policy.state_dict()["model"].values())[0].numpy()).all()
