"""Collected batches through shared memory on one host (conveyor/middleware/shared_batches.py): equal bit for bit to
those sent in their messages, forged descriptors dropped, flow control, and no block left behind."""
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
import torch
import treetensor.torch as ttorch

from conveyor.engine import OnlineRLContext, Parallel, task
from conveyor.engine.parallel import codec
from conveyor.engine.parallel.launch import WorkerError
from conveyor.middleware.exchanger import DATA_TOPIC, ContextExchanger
from conveyor.middleware.messages import BadMessage
from conveyor.processes import create_shared_block
from conveyor.middleware.shared_batches import (BLOCK_FAMILY, BLOCKS, CLOSE_WAIT_S, SharedArray, SharedBatches,
                                               SharedTree)
from tests.middleware import _shared_batches_mains as mains
from tests.middleware.test_exchanger import fake_router  # noqa: F401 (a fixture)

FAST = dict(heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0)


def our_blocks(learner_pid=None):
    """The blocks of this module in /dev/shm; with ``learner_pid``, only those of that learner's run (its prefix):
    another test's run, on the other worker, makes and frees its own meanwhile."""
    prefix = BLOCK_FAMILY if learner_pid is None else f"{BLOCK_FAMILY}{learner_pid}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


@pytest.fixture
def pair():
    """A learner's side and a collector's (node 1) that proved they share this host."""
    learner = SharedBatches("0", learner=True, collector=False)
    collector = SharedBatches("1", learner=False, collector=True)
    collector.offered("0", learner.offer()["shm"])
    yield learner, collector
    collector.close()
    learner.close()


def wire(payload):
    return codec.decode(codec.encode(payload))


def payload(node=1, index=0):
    return {"node": str(node), "trajectories": mains.batch(node, index), "episodes": [np.arange(9000, dtype=np.int64)],
            "train_data": {"adv": np.linspace(0, 1, 20000, dtype=np.float32).reshape(100, 200)},
            "env_step": mains.ROWS, "env_episode": 0}


def same(a, b):
    """Equal type, dtype, shape and bytes, through dicts, lists and trees."""
    if isinstance(a, ttorch.Tensor):
        return type(b) is ttorch.Tensor and set(a.keys()) == set(b.keys()) and all(same(a[k], b[k]) for k in a.keys())
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return type(b) is list and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape \
            and a.contiguous().view(torch.uint8).numpy().tobytes() == b.contiguous().view(torch.uint8).numpy().tobytes()
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def test_a_batch_through_shared_memory_equals_the_one_sent_in_its_message_bit_for_bit(pair):
    learner, collector = pair
    sent = payload()
    message, block = collector.pack(sent, ["0"])
    assert block is not None and sum(len(f) for f in codec.encode(message)) < 4096  # a small descriptor only
    assert same(learner.take("1", wire(message)), wire(sent)) and learner.taken == 1
    assert not block.full()  # copied out: free for the next batch


def test_a_collector_whose_learner_is_elsewhere_sends_its_arrays_in_the_message(pair):
    learner, _ = pair
    elsewhere = SharedBatches("2", learner=False, collector=True)
    offer = dict(learner.offer()["shm"], prefix=f"{BLOCK_FAMILY}1-000000000000.")  # a probe this host has not
    elsewhere.offered("0", offer)
    sent = payload(2)
    assert elsewhere.pack(sent, ["0"]) == (sent, None)
    forced = SharedBatches("3", learner=False, collector=True, enabled=False)  # transport: nng
    forced.offered("0", learner.offer()["shm"])
    assert forced.pack(sent, ["0"]) == (sent, None)


def test_a_collector_never_writes_into_a_block_the_learner_has_not_taken(pair):
    learner, collector = pair
    packed = [collector.pack(payload(1, i), ["0"]) for i in range(BLOCKS + 1)]
    assert all(block is not None for _, block in packed[:BLOCKS]) and len({id(b) for _, b in packed[:BLOCKS]}) == BLOCKS
    assert packed[BLOCKS][1] is None  # every block full: this batch goes in its message
    for i, (message, _) in enumerate(packed[:BLOCKS]):
        assert same(learner.take("1", wire(message)), wire(payload(1, i)))  # none overwritten
    assert collector.pack(payload(1, 9), ["0"])[1] is not None  # taken: free again


def forged(value, **changes):
    """``value`` (a packed message) with the fields of every descriptor changed."""
    names = ["block", "ticket", "offset", "kind", "dtype", "shape"]
    if isinstance(value, SharedArray):
        fields = dict(zip(names, value.fields), **changes)
        return SharedArray([fields[n] for n in names])
    if isinstance(value, SharedTree):
        return SharedTree(forged(value.children, **changes))
    if isinstance(value, dict):
        return {k: forged(v, **changes) for k, v in value.items()}
    if isinstance(value, list):
        return [forged(v, **changes) for v in value]
    return value


@pytest.mark.parametrize("change, why", [
    ({"block": "psm_0123abcd"}, "not one of node 1's"),  # a block outside this run's pattern
    ({"block": f"{BLOCK_FAMILY}1-000000000000.1.1-1"}, "not one of node 1's"),  # another learner's prefix
    ("another_node", "not one of node 2's"),  # its own name, from another sender
    ("missing", "cannot be mapped"),
    ({"offset": 1 << 40}, "which holds"),
    ({"shape": [1 << 20, 4, 64, 64]}, "which holds"),
    ({"offset": 8}, "which holds"),  # inside the header
    ({"shape": [-1, 4]}, "shape"),
    ({"dtype": "O"}, "dtype 'O'"),
    ({"dtype": "f4,f4"}, "dtype"),
    ({"kind": "T", "dtype": "Tensor"}, "dtype 'Tensor'"),
    ({"ticket": 99}, "does not hold this batch"),
])
def test_a_forged_descriptor_drops_its_batch_and_the_learner_takes_the_next(fake_router, pair, change, why, caplog):
    _, collector = pair
    fake_router.sender = "1"
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=5)
        got = []
        task.use(exchanger).use(lambda ctx: got.append(ctx.trajectories))
        [handler] = fake_router.handlers[DATA_TOPIC]
        handler(payload(1, 0))  # the first batch, in its message
        task.run(max_step=1)
        [offer] = [m for t, m in fake_router.sent if t == "conveyor.exchange.train_iter"]
        collector.offered("0", offer["shm"])
        message, block = collector.pack(payload(1, 1), ["0"])
        if change == "another_node":
            fake_router.sender = "2"
            handler(dict(message, node="2"))
            fake_router.sender = "1"
        elif change == "missing":
            block.shm.unlink()
            handler(message)
            block.shm = create_shared_block(block.shm.size, block.shm.name, track=False)  # for the close
        else:
            handler(forged(message, **change))
        assert exchanger.stats()["rejected"] == 1 and why in caplog.text
        message, _ = collector.pack(payload(1, 2), ["0"])  # the block, freed by the drop where it was node 1's
        handler(message)
        task.run(max_step=1)
    assert same(got[-1], mains.batch(1, 2)) and exchanger.shared.taken == 1


def test_a_learner_offered_nothing_drops_descriptors(fake_router, pair):
    _, collector = pair
    fake_router.sender = "1"
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=5, shared_memory=False)
        [handler] = fake_router.handlers[DATA_TOPIC]
        handler(collector.pack(payload(1, 0), ["0"])[0])
        assert exchanger.stats()["rejected"] == 1 and exchanger.shared.offer() == {}


def runner(n):
    return Parallel.runner(n, protocol="ipc", ready_timeout_s=mains.WAIT, router_options=FAST)


@pytest.mark.parametrize("shared_memory", [True, False])
def test_batches_between_processes_arrive_equal_bit_for_bit_through_shared_memory_or_nng(shared_memory):
    batches = 4
    learner, *collectors = runner(3)(mains.exchange, batches, shared_memory)
    sent = {key: value for c in collectors for key, value in c["digests"].items()}
    assert len(sent) == 2 * batches and learner["digests"] == sent
    # each collector's first batch in its message, unless the other's made the learner's offer reach it first
    assert 2 * (batches - 1) <= learner["shared"] <= 2 * batches - 1 if shared_memory else learner["shared"] == 0
    assert our_blocks(learner["pid"]) == set()  # every block of the run freed at its end


def test_no_shared_block_is_left_after_a_run_whose_collector_was_killed():
    with pytest.raises(WorkerError, match="worker 1 .* killed by SIGKILL") as info:
        runner(3)(mains.exchange, 4, True, 2)
    learner = next(r for r in info.value.results if r is not None and r["shared"] is not None)
    assert learner["shared"] >= 3  # the killed collector's second batch, the other's three after its first
    assert our_blocks(learner["pid"]) == set()


def test_the_transport_key_is_auto_or_nng():
    from conveyor.config import ConfigError, compile_config
    from conveyor.policy import DQNPolicy
    from conveyor.zoo import load_entry
    cfg = load_entry("cartpole/dqn").main_config
    assert compile_config(cfg, policy=DQNPolicy).transport == "auto"
    assert compile_config({**cfg, "transport": "nng"}, policy=DQNPolicy).transport == "nng"
    with pytest.raises(ConfigError, match="'transport' must be one of \\['auto', 'nng'\\], got 'shm'"):
        compile_config({**cfg, "transport": "shm"}, policy=DQNPolicy)


def test_a_collector_whose_learner_is_gone_frees_its_blocks_and_sends_in_messages(pair):
    _, collector = pair
    _, block = collector.pack(payload(), ["0"])
    name = block.shm.name
    assert name in our_blocks()
    collector.forget("0")
    assert name not in our_blocks() and collector.pack(payload(), ["0"])[1] is None


FIELDS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=40), st.binary(max_size=8),
                   st.lists(st.integers(-5, 1 << 40), max_size=6))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_descriptors_are_dropped_as_bad_messages_and_valid_ones_still_taken(pair, data):
    learner, collector = pair
    small = {"node": "1", "trajectories": ttorch.Tensor({"obs": torch.arange(1 << 16, dtype=torch.int32)})}
    message, _ = collector.pack(small, ["0"])
    names = ["block", "ticket", "offset", "kind", "dtype", "shape"]
    keep = data.draw(st.sets(st.sampled_from(names), max_size=5))
    bad = forged(message, **{n: data.draw(FIELDS, label=n) for n in names if n not in keep})
    if data.draw(st.booleans(), label="malformed"):
        bad = {**bad, "trajectories": SharedArray(data.draw(st.one_of(FIELDS, st.lists(FIELDS, max_size=7))))}
    try:
        learner.take("1", wire(bad))
    except BadMessage:
        pass
    good, _ = collector.pack(small, ["0"])  # the block was freed by the drop, or another is free
    assert same(learner.take("1", wire(good)), wire(small))


def test_a_collector_that_finds_no_room_in_dev_shm_sends_in_the_message(pair, monkeypatch, caplog):
    from conveyor.middleware import shared_batches

    def full(size, name=None, track=True):
        raise OSError(28, "no room for a shared-memory block in /dev/shm")

    _, collector = pair
    monkeypatch.setattr(shared_batches, "create_shared_block", full)
    sent = payload()
    assert collector.pack(sent, ["0"]) == (sent, None) and "batches go in their messages" in caplog.text


def test_a_collector_that_ends_frees_a_block_only_once_its_learner_took_the_batch_in_it(pair):
    learner, collector = pair
    message, block = collector.pack(payload(), ["0"])  # its last batch, still on its way
    closing = threading.Thread(target=collector.close, kwargs={"wait": True})
    closing.start()
    got = learner.take("1", wire(message))
    closing.join(timeout=CLOSE_WAIT_S + 10)
    assert not closing.is_alive() and same(got, wire(payload())) and block.shm.name not in our_blocks()
