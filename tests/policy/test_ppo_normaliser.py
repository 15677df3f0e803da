"""Observation normalisation: running statistics, when PPO folds collected data in, and checkpoints."""
import numpy as np
import pytest
import torch
import treetensor.torch as ttorch

from conveyor.policy import ObsNormaliser, PPOPolicy, RunningMeanStd
from conveyor.schema import ConfigError


def test_running_statistics_of_batches_equal_those_of_their_concatenation():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 2)) for n in (1, 7, 50)]
    stats = RunningMeanStd((2,))
    for b in batches:
        stats.update(b)
    whole = np.concatenate(batches)
    np.testing.assert_allclose(stats.mean, whole.mean(0))
    np.testing.assert_allclose(stats.var, whole.var(0))
    assert stats.count == len(whole)


def test_normaliser_is_the_identity_until_observations_are_committed():
    norm = ObsNormaliser(2, clip=None)
    obs = torch.tensor([[10.0, -4.0], [14.0, -2.0]])
    norm.observe(obs)
    assert torch.equal(norm(obs), obs)
    assert norm.commit()
    np.testing.assert_allclose(norm(obs).numpy(), [[-1.0, -1.0], [1.0, 1.0]], atol=1e-4)
    assert not norm.commit()  # nothing new


def test_normalised_observations_are_clipped():
    norm = ObsNormaliser(1, clip=2.0)
    norm.observe(torch.tensor([[0.0], [2.0]]))
    norm.commit()
    assert norm(torch.tensor([[100.0]])).item() == 2.0


def normalising_policy():
    return PPOPolicy({"model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [8], "obs_norm": True},
                      "learn": {"batch_size": 4}}, seed=0)


def learn_once(policy, obs, publish=True):
    """Collect on ``obs``, take one step on it, and publish the weights as a trainer does."""
    out = policy.collect_mode.forward(obs)
    n = len(obs)
    policy.learn_mode.forward(ttorch.Tensor({
        "obs": torch.from_numpy(obs), "action": torch.from_numpy(out["action"]),
        "logp": torch.from_numpy(out["logp"]), "value": torch.from_numpy(out["value"]), "adv": torch.ones(n),
        "return": torch.ones(n), "reward": torch.zeros(n)}))
    if publish:
        policy.learn_mode.publish()


def test_ppo_keeps_statistics_fixed_through_a_rollout_and_folds_it_in_when_publishing_after_an_update():
    policy = normalising_policy()
    norm = policy.obs_normaliser
    rollout = np.random.default_rng(0).normal(5.0, 3.0, size=(32, 2)).astype(np.float32)
    for chunk in np.split(rollout, 4):
        policy.collect_mode.forward(chunk)
    assert norm.stats.count == 0  # the rollout is acted on, valued and learned from with the same statistics
    learn_once(policy, rollout[:4], publish=False)
    assert norm.stats.count == 0
    policy.learn_mode.publish()  # the update is published: the rollout is folded in for the next one
    assert norm.stats.count == 32 + 4  # (learn_once collected 4 more)
    np.testing.assert_allclose(norm.stats.mean, np.concatenate([rollout, rollout[:4]]).mean(0), rtol=1e-5)
    policy.collect_mode.forward(rollout[:4])
    assert norm.stats.count == 32 + 4


def test_acting_uses_the_statistics_published_with_the_weights():
    policy = normalising_policy()
    obs = np.random.default_rng(2).normal(5.0, 3.0, size=(16, 2)).astype(np.float32)
    learn_once(policy, obs)
    published = policy.collect_mode.value(obs)
    policy.collect_mode.forward(obs * 10)
    policy.obs_normaliser.commit()  # the live statistics move; the published version keeps its own
    np.testing.assert_array_equal(policy.collect_mode.value(obs), published)


def test_checkpoint_round_trip_restores_the_normaliser():
    policy = normalising_policy()
    obs = np.random.default_rng(1).normal(5.0, 3.0, size=(16, 2)).astype(np.float32)
    learn_once(policy, obs)
    policy.collect_mode.forward(obs)  # commits the 16 learn_once collected, then gathers 16
    policy.collect_mode.forward(obs * 2)  # 16 more gathered, not yet committed
    state = policy.state_dict()
    restored = normalising_policy()
    restored.load_state_dict(state)
    assert restored.obs_normaliser.stats.count == policy.obs_normaliser.stats.count > 0
    probe = torch.from_numpy(obs)
    assert torch.equal(restored.obs_normaliser(probe), policy.obs_normaliser(probe))
    np.testing.assert_array_equal(restored.eval_mode.forward(obs)["action"], policy.eval_mode.forward(obs)["action"])
    np.testing.assert_allclose(restored.collect_mode.value(obs), policy.collect_mode.value(obs))
    assert restored.obs_normaliser.pending.count == policy.obs_normaliser.pending.count == 32


def test_obs_norm_needs_array_observations():
    with pytest.raises(ConfigError, match="obs_norm"):
        PPOPolicy({"model": {"obs_shape": {"a": 2}, "action_shape": 2, "obs_norm": True}})


def test_a_replica_gathers_nothing_itself_and_the_learner_gathers_its_observations_from_the_batch():
    learner, replica = normalising_policy(), normalising_policy()
    replica.load_acting_state(learner.acting_state())  # as a collector process or a distributed collector does
    obs = np.random.default_rng(3).normal(5.0, 3.0, size=(8, 2)).astype(np.float32)
    out = replica.collect_mode.forward(obs)
    assert not out["obs_gathered"].any() and replica.obs_normaliser.state_dict()["pending"]["count"] == 0
    own = learner.collect_mode.forward(obs)  # the learner's own collector gathers as it acts
    assert own["obs_gathered"].all()
    batch = {"obs": np.concatenate([obs, obs]), "obs_gathered": np.concatenate([out["obs_gathered"],
                                                                                own["obs_gathered"]])}
    learner.learn_mode.gather(batch)
    learner.obs_normaliser.commit()
    assert learner.obs_normaliser.stats.count == 16  # 8 gathered while acting, 8 from the replica's rows
