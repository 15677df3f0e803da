"""Prioritized replay: sampling in proportion to priority ** alpha, IS weights, priority updates."""
import numpy as np
import pytest
import torch

from conveyor.data import DequeBuffer


def filled(size: int, n: int | None = None, **kwargs) -> DequeBuffer:
    buffer = DequeBuffer(size, prioritized=True, seed=0, **kwargs)
    buffer.extend({"id": np.arange(size if n is None else n)})
    return buffer


def frequencies(buffer: DequeBuffer, n: int = 20_000) -> np.ndarray:
    return np.bincount(buffer.sample(n).index.numpy(), minlength=len(buffer)) / n


def test_sampling_frequencies_follow_priorities():
    buffer = filled(4, alpha=1.0, eps=0.0)
    buffer.update_priority(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]))
    assert np.allclose(frequencies(buffer), [0.1, 0.2, 0.3, 0.4], atol=0.01)


def test_alpha_tempers_priorities():
    buffer = filled(4, alpha=0.5, eps=0.0)
    buffer.update_priority(np.arange(4), np.array([1.0, 4.0, 9.0, 16.0]))  # ** 0.5 -> 1, 2, 3, 4
    assert np.allclose(frequencies(buffer), [0.1, 0.2, 0.3, 0.4], atol=0.01)


def test_alpha_zero_samples_uniformly():
    buffer = filled(4, alpha=0.0)
    buffer.update_priority(np.arange(4), np.array([1.0, 10.0, 100.0, 1000.0]))
    sample = buffer.sample(20_000)
    assert np.allclose(np.bincount(sample.index.numpy()) / 20_000, 0.25, atol=0.01)
    assert torch.all(sample.weight == 1.0)


def test_sampling_follows_priorities_in_a_deep_tree():
    buffer = filled(40_000, alpha=1.0, eps=0.0)  # big enough for several tree levels
    buffer.update_priority(np.arange(40_000), np.zeros(40_000))
    hot = np.array([7, 1234, 20_001, 39_999])
    buffer.update_priority(hot, np.array([1.0, 2.0, 3.0, 4.0]))
    index = buffer.sample(20_000).index.numpy()
    assert set(index.tolist()) == set(hot.tolist())
    assert np.allclose([np.mean(index == h) for h in hot], [0.1, 0.2, 0.3, 0.4], atol=0.01)


def test_stratified_sampling_draws_each_of_equal_priorities_once():
    buffer = filled(64)
    assert sorted(buffer.sample(64).index.tolist()) == list(range(64))


def test_importance_weights_match_a_hand_computed_case():
    buffer = filled(4, alpha=0.5, beta=0.4, eps=0.0)
    buffer.update_priority(np.arange(4), np.array([1.0, 4.0, 9.0, 16.0]))
    # P = [.1, .2, .3, .4], N = 4: w = (N P) ** -0.4 / max w = (P_min / P) ** 0.4
    expected = np.array([1.0, 0.5 ** 0.4, (1 / 3) ** 0.4, 0.25 ** 0.4])
    sample = buffer.sample(256)
    assert sample.weight.dtype == torch.float32
    assert np.allclose(sample.weight.numpy(), expected[sample.index.numpy()], rtol=1e-6)


def test_importance_weights_follow_a_changed_beta():
    buffer = filled(2, alpha=1.0, beta=0.4, eps=0.0)
    buffer.update_priority(np.array([0, 1]), np.array([1.0, 4.0]))
    buffer.beta = 1.0
    sample = buffer.sample(64)
    assert np.allclose(sample.weight.numpy(), np.where(sample.index.numpy() == 1, 0.25, 1.0))


def test_update_priority_shifts_sampling_towards_the_raised_transition():
    buffer = filled(10, alpha=1.0)
    buffer.update_priority(torch.tensor([3]), torch.tensor([1000.0]))
    assert frequencies(buffer)[3] > 0.98


def test_zero_priority_without_eps_is_never_sampled():
    buffer = filled(4, alpha=1.0, eps=0.0)
    buffer.update_priority(np.array([1, 2]), np.array([0.0, 0.0]))
    assert set(buffer.sample(1000).index.tolist()) == {0, 3}


def test_new_transitions_get_the_max_priority_seen_so_far():
    buffer = filled(4, n=2, alpha=1.0, eps=0.0)
    buffer.update_priority(np.array([0, 1]), np.array([1.0, 5.0]))
    buffer.push({"id": np.int64(2)})
    buffer.extend({"id": np.array([3])})
    assert np.allclose(frequencies(buffer), [1 / 16, 5 / 16, 5 / 16, 5 / 16], atol=0.01)


def test_overwritten_slots_take_the_max_priority_not_the_old_one():
    buffer = filled(2, alpha=1.0, eps=0.0)
    buffer.update_priority(np.array([0, 1]), np.array([3.0, 1.0]))
    buffer.extend({"id": np.array([2])})  # overwrites slot 0 with max priority 3
    buffer.update_priority(np.array([1]), np.array([3.0]))
    assert np.allclose(frequencies(buffer), [0.5, 0.5], atol=0.01)


def test_extend_across_the_ring_end_gives_every_new_slot_the_max_priority():
    buffer = filled(4, n=3, alpha=1.0, eps=0.0)
    buffer.update_priority(np.arange(3), np.array([1.0, 1.0, 2.0]))
    buffer.extend({"id": np.array([3, 4, 5])})  # slots 3, 0, 1 take the max priority, 2
    assert np.allclose(frequencies(buffer), [0.25, 0.25, 0.25, 0.25], atol=0.01)


def test_extend_into_a_deep_tree_makes_the_new_slots_sampleable():
    buffer = filled(40_000, alpha=1.0, eps=0.0)
    buffer.update_priority(np.arange(40_000), np.zeros(40_000))
    buffer.extend({"id": np.arange(100)})  # the ring is full, so this overwrites slots 0..99
    index = buffer.sample(10_000).index.numpy()
    assert index.max() < 100
    assert np.allclose(np.bincount(index, minlength=100) / 10_000, 0.01, atol=0.005)


def test_beta_rises_linearly_to_beta_end_over_the_transitions_added():
    buffer = DequeBuffer(100, prioritized=True, beta=0.4, beta_end=1.0, beta_anneal_steps=10, seed=0)
    betas = []
    for _ in range(6):
        betas.append(buffer.beta)
        buffer.extend({"x": np.zeros(4, np.float32)})
    assert betas == pytest.approx([0.4, 0.64, 0.88, 1.0, 1.0, 1.0])


def test_the_beta_schedule_and_sampling_rng_are_saved_with_the_buffer():
    def fill(buffer):
        buffer.extend({"x": np.arange(5, dtype=np.float32)})
        buffer.update_priority(np.arange(5), np.arange(1.0, 6.0))

    original = DequeBuffer(10, prioritized=True, beta=0.2, beta_end=1.0, beta_anneal_steps=20, seed=3)
    fill(original)
    restored = DequeBuffer(10, prioritized=True)
    restored.load_state_dict(original.state_dict())
    assert restored.beta == original.beta == pytest.approx(0.2 + 0.8 * 5 / 20)
    a, b = original.sample(8), restored.sample(8)
    assert torch.equal(a.index, b.index) and torch.equal(a.weight, b.weight)
    for buffer in (original, restored):
        buffer.extend({"x": np.zeros(5, np.float32)})
    assert restored.beta == original.beta == pytest.approx(0.6)
