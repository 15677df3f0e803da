"""Data-parallel learners (conveyor.policy.data_parallel): two CPU learners (gloo) in their own processes."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import treetensor.torch as ttorch

from conveyor.policy import DataParallel, DataParallelError, SignedStore
from tests.policy import data_parallel_workers as workers


def run_learners(algos: list[str], fault: str | None = None, timeout: float = 20.0) -> dict[int, object]:
    """Both learners' results by rank (``{algo: weights}``, or an error message); every process is ended, also when
    the test fails."""
    ctx = mp.get_context("spawn")
    port_queue, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=workers.learner, args=(rank, algos, port_queue, results, fault, timeout), daemon=True)
             for rank in range(2)]
    try:
        for p in procs:
            p.start()
        if fault is not None:
            return dict([results.get(timeout=120)])  # rank 0's error; rank 1 died or is killed below
        out = dict(results.get(timeout=120) for _ in range(2))
        for p in procs:
            p.join(timeout=60)
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        assert not any(p.is_alive() for p in procs)


ALGOS = ["dqn", "ppo", "ppo-target-kl", "ppo-norm", "sac"]


@pytest.fixture(scope="module")
def two_learners():
    """``two_learners(algo)``: both learners' weights after each step of ``algo``; one pair of processes learns every
    algorithm of ``ALGOS`` for the module, at the first test that asks."""
    runs: dict[int, object] = {}

    def get(algo: str) -> dict[int, object]:
        if not runs:
            runs.update(run_learners(ALGOS))
        assert all(isinstance(r, dict) for r in runs.values()), runs
        return {rank: r[algo] for rank, r in runs.items()}
    return get


@pytest.mark.slow  # two learner processes
@pytest.mark.parametrize("algo", ["dqn", "ppo", "ppo-target-kl", "ppo-norm"])
def test_two_learners_on_half_batches_reach_the_weights_of_one_learner_on_whole_batches(algo, two_learners):
    results = two_learners(algo)
    single = workers.make_policy(algo)
    for step, batch in enumerate(workers.batches(algo)):
        workers.learn(single, batch)
        torch.testing.assert_close(torch.from_numpy(results[0][step]), workers.flat_weights(single),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two learner processes
@pytest.mark.parametrize("algo", ["dqn", "ppo", "sac", "ppo-norm"])  # SAC's actions are sampled: whole batches only
def test_the_learners_weights_are_bitwise_identical_after_every_step(algo, two_learners):
    results = two_learners(algo)
    assert len(results[0]) == len(results[1]) == workers.STEPS
    for mine, theirs in zip(results[0], results[1]):
        assert mine.tobytes() == theirs.tobytes()


@pytest.mark.slow  # two learner processes
def test_a_learner_that_dies_ends_the_other_with_an_error_naming_the_collective():
    results = run_learners(["dqn"], fault="die")
    message = results[0]
    assert isinstance(message, str), "rank 0 should have failed, not finished"
    assert "learner rank 0 of 2" in message and "gradient all-reduce" in message


@pytest.mark.slow  # two learner processes, and a 3 s timeout
def test_a_learner_that_stops_answering_ends_the_other_at_the_groups_timeout():
    results = run_learners(["dqn"], fault="hang", timeout=3.0)
    message = results[0]
    assert isinstance(message, str), "rank 0 should have failed, not finished"
    assert "learner rank 0 of 2" in message and "gradient all-reduce" in message and "3 s" in message


def make_store():
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5),
                         wait_for_workers=False)


def test_the_store_refuses_a_value_written_without_the_secret():
    store = make_store()
    store.set("addr", b"10.0.0.1:1234")
    with pytest.raises(DataParallelError, match="not signed"):
        SignedStore(store, workers.SECRET, b"s1").get("addr")


def test_the_store_refuses_a_value_signed_in_another_session_or_with_another_secret():
    store = make_store()
    SignedStore(store, workers.SECRET, b"s1").set("addr", b"x")
    assert SignedStore(store, workers.SECRET, b"s1").get("addr") == b"x"
    with pytest.raises(DataParallelError, match="not signed"):
        SignedStore(store, workers.SECRET, b"s2").get("addr")
    with pytest.raises(DataParallelError, match="not signed"):
        SignedStore(store, b"t" * 32, b"s1").get("addr")


def test_a_group_of_one_learner_learns_bitwise_as_no_group():
    alone, grouped = workers.make_policy("dqn"), workers.make_policy("dqn")
    group = DataParallel(0, 1, host="127.0.0.1", port=0, secret=workers.SECRET, session=b"s", timeout=10).connect()
    try:
        grouped.learn_mode.join_data_parallel(group)
        for batch in workers.batches("dqn"):
            alone.learn_mode.forward(batch)
            grouped.learn_mode.forward(group.shard(batch))
    finally:
        group.close()
    assert torch.equal(workers.flat_weights(alone), workers.flat_weights(grouped))


class Probe(torch.autograd.Function):
    """Identity whose backward records how many all-reduces were launched by the time the pass reaches it."""

    seen: list[int] = []
    launched: list[int] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        Probe.seen.append(len(Probe.launched))
        return grad


def test_backward_all_reduces_the_last_layers_while_the_first_layers_gradients_are_still_computed(monkeypatch):
    real = dist.all_reduce
    Probe.seen, Probe.launched = [], []
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: Probe.launched.append(t.numel()) or real(t, *a, **k))
    torch.manual_seed(0)
    first, rest, unused = torch.nn.Linear(8, 64), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                                                      torch.nn.ReLU(), torch.nn.Linear(64, 1)), \
        torch.nn.Linear(2, 2)
    params = [*unused.parameters(), *first.parameters(), *rest.parameters()]  # in a backward pass's reverse order
    x = torch.randn(4, 8)
    rest(first(x)).pow(2).mean().backward()
    plain = [p.grad.clone() for p in [*first.parameters(), *rest.parameters()]]
    for p in params:
        p.grad = None
    group = DataParallel(0, 1, host="127.0.0.1", port=0, secret=workers.SECRET, session=b"s", timeout=10,
                         bucket_bytes=1024).connect()
    try:
        group.backward(rest(Probe.apply(first(x))).pow(2).mean(), params)
    finally:
        group.close()
    assert Probe.seen[0] >= 2, "the last layers' buckets should travel before the first layer's gradients exist"
    assert len(Probe.launched) >= 4  # the first layer's buckets and the unused layer's, after the pass
    assert all(torch.equal(p.grad, g) for p, g in zip([*first.parameters(), *rest.parameters()], plain))
    assert all(p.grad is None for p in unused.parameters())  # no gradient on any learner: optimizers skip it


def test_shares_cover_the_batch_once():
    shares = [DataParallel(r, 3, host="127.0.0.1", port=1, secret=workers.SECRET, session=b"s").shard(list(range(10)))
              for r in (1, 2)]
    assert shares == [[3, 4, 5], [6, 7, 8, 9]]


def test_a_tree_is_shared_by_its_rows_not_its_keys():
    batch = workers.batches("dqn")[0]
    share = DataParallel(1, 2, host="127.0.0.1", port=1, secret=workers.SECRET, session=b"s").shard(batch)
    assert torch.equal(share.obs, batch.obs[workers.BATCH // 2:])


def test_sequences_are_shared_by_their_batch_dimension():
    batch = ttorch.Tensor({"reward": torch.arange(12.0).reshape(3, 4)})  # [L, B]
    share = DataParallel(0, 2, host="127.0.0.1", port=1, secret=workers.SECRET, session=b"s").shard(batch, dim=1)
    assert torch.equal(share.reward, batch.reward[:, :2])
