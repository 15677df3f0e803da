"""Exchangers: collected data to learners, train_iter and versioned weights back, over real worker processes."""
import logging
import subprocess
import sys
import time

import numpy as np
import treetensor.torch as ttorch
import pytest
import torch

from conveyor.engine import FINISH_EVENT, PEER_LOST_EVENT, STOP_EVENT, OnlineRLContext, Parallel, task
from conveyor.middleware.exchanger import (COLLECTOR_TOPIC, DATA_TOPIC, MODEL_REQUEST_TOPIC, ContextExchanger,
                                          ModelExchanger)
from tests.middleware import _exchanger_mains as mains

WAIT = 20
FAST = dict(heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0)


def runner(n):
    return Parallel.runner(n, protocol="ipc", ready_timeout_s=WAIT, router_options=FAST)


def test_collectors_feed_the_learner_and_follow_its_versions():
    batches, max_staleness = 3, 0  # one multi-process run (each worker imports torch: seconds); None is unit-tested
    learner, *collectors = runner(3)(mains.learn_and_collect, batches, max_staleness)
    rows = mains.ROWS * batches * 2
    assert (learner["env_step"], learner["env_episode"]) == (rows, batches * 2)
    assert sum(s["rows"] for s in learner["seen"]) == rows
    received = [b for s in learner["seen"] for b in s["batches"]]
    assert all(v <= s["version"] for s in learner["seen"] for _, v in s["batches"])  # no batch from the future
    assert [s["env_step"] for s in learner["seen"]] == sorted(s["env_step"] for s in learner["seen"])
    for node, c in enumerate(collectors, 1):
        versions = [s["version"] for s in c["seen"]]
        assert [v for sender, v in received if sender == node] == versions  # each batch records its version
        assert len(versions) == batches and (c["env_step"], c["env_episode"]) == (mains.ROWS * batches, batches)
        assert versions == sorted(versions)
        for s in c["seen"]:  # train_iter is sent before the weights: a collector on version v knows iteration >= v
            assert s["train_iter"] >= s["version"]
        assert len(set(versions)) == batches  # max_staleness=0: each batch on fresh weights


def test_late_joiners_a_collector_and_an_evaluator_get_the_newest_version():
    assert runner(3)(mains.late_joiner, 3) == [3, [3, 3, 3.0], [3, 3, 3.0]]


class _Router:
    """An in-process stand-in for task.router that nobody answers."""

    is_active, node_id, incarnation = True, 5, "00"

    def __init__(self):
        self.handlers, self.sent = {}, []

    def on(self, topic, fn):
        self.handlers.setdefault(topic, []).append(fn)

    def off(self, topic, fn):
        self.handlers[topic].remove(fn)

    def subscribers(self, topic):
        return []

    def subscriber_incarnations(self, topic):
        return {}

    def publish(self, topic, payload):
        self.sent.append((topic, payload))
        return 0

    def peers(self):
        return []

    def wait_for_subscribers(self, topic, n, timeout):
        raise TimeoutError(f"0 of {n} peers subscribed to {topic!r}")


@pytest.fixture
def fake_router():
    router = _Router()
    task.attach_router(router)
    yield router
    task.detach_router()


def test_without_a_router_both_exchangers_pass_ctx_through_untouched():
    policy = mains.FakePolicy()
    with task.start(ctx=OnlineRLContext()):
        task.use(ModelExchanger(policy, max_staleness=0)).use(ContextExchanger())
        task.use(lambda ctx: setattr(ctx, "env_step", ctx.env_step + 1))
        task.run(max_step=3)
        assert task.ctx.env_step == 3 and task.ctx.trajectories is None and policy.version == 0


def test_a_learner_hearing_no_collector_stops_with_a_clear_timeout(fake_router):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        task.use(ContextExchanger(timeout_s=0.2))
        with pytest.raises(TimeoutError, match="no collected data on 'conveyor.exchange.data' within 0.2s .*is a collector"):
            task.run(max_step=1)
    assert DATA_TOPIC in fake_router.handlers


def test_a_collector_with_no_weights_asks_again_then_stops_with_a_clear_timeout(fake_router):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        task.use(ModelExchanger(torch.nn.Linear(2, 1), timeout_s=0.6))
        with pytest.raises(TimeoutError, match="no weights .* \\(the first version\\) within 0.6s .*is a learner"):
            task.run(max_step=1)
    requests = [t for t, _ in fake_router.sent if t == "conveyor.exchange.model_request"]
    assert len(requests) >= 2  # a request can pass its own subscription: it is repeated while waiting


def test_a_learner_merges_what_several_collectors_sent(fake_router):
    import treetensor.torch as ttorch
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=1)
        got = []
        task.use(exchanger).use(lambda ctx: got.append((ctx.trajectories, ctx.episodes, ctx.env_step, ctx.env_episode)))
        for k in (1, 2):
            [handler] = fake_router.handlers[DATA_TOPIC]
            handler({"node": str(k), "trajectories": ttorch.Tensor({"obs": torch.full((2, 3), float(k))}), "episodes": [k],
                     "train_data": None, "env_step": 2, "env_episode": 1})
        task.run(max_step=1)
    [(trajectories, episodes, env_step, env_episode)] = got
    assert trajectories.obs.shape == (4, 3) and episodes == [1, 2] and (env_step, env_episode) == (4, 2)
    [(topic, message)] = fake_router.sent  # with the learner's shared-memory offer (tests/middleware/test_shared_batches.py)
    assert topic == "conveyor.exchange.train_iter" and message["train_iter"] == 0 and set(message) == {"train_iter", "shm"}


def test_a_learner_joins_recurrent_sequences_side_by_side_and_rows_end_to_end(fake_router):
    import treetensor.torch as ttorch
    sequences = {"reward": torch.zeros(4, 3), "episode_start": torch.zeros(4, 3, dtype=torch.bool)}  # [L, B]
    unrolls = {"reward": torch.zeros(2, 5)}  # IMPALA's [U, T]: rows of unrolls
    got = []
    for data in (sequences, unrolls):
        with task.start(ctx=OnlineRLContext()):
            task.add_role(task.role.LEARNER)
            task.use(ContextExchanger(timeout_s=1)).use(lambda ctx: got.append(tuple(ctx.train_data.reward.shape)))
            for k in (1, 2):
                [handler] = fake_router.handlers[DATA_TOPIC]
                handler({"node": str(k), "trajectories": None, "episodes": None, "train_data": ttorch.Tensor(data),
                         "env_step": 12, "env_episode": 0})
            task.run(max_step=1)
    assert got == [(4, 6), (4, 5)]  # sequences keep their length L; unrolls add up


def test_a_bare_model_follows_the_versions_it_receives(fake_router):
    model = torch.nn.Linear(2, 1)
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.EVALUATOR)
        exchanger = ModelExchanger(model, max_staleness=0, timeout_s=1)
        [handler] = fake_router.handlers["conveyor.exchange.model"]
        handler({"version": 4, "tensors": [torch.ones(1, 2), torch.ones(1)], "extras": None})
        task.use(exchanger)
        task.run(max_step=2)  # an evaluator never waits for newer weights
    assert exchanger.loaded_version == 4 and model.weight.sum().item() == 2.0


def test_exchangers_need_roles_in_a_multi_process_run_and_check_arguments(fake_router):
    with task.start():
        with pytest.raises(RuntimeError, match="task.add_role"):
            ContextExchanger()
        task.add_role(task.role.LEARNER).add_role(task.role.COLLECTOR)
        with pytest.raises(RuntimeError, match="both the LEARNER and the COLLECTOR role"):
            ModelExchanger(torch.nn.Linear(1, 1))
        with pytest.raises(TypeError, match="acting_state"):
            ModelExchanger(object())
        with pytest.raises(ValueError, match="max_staleness"):
            ModelExchanger(torch.nn.Linear(1, 1), max_staleness=-1)


def test_a_collector_reuses_a_version_up_to_max_staleness_then_waits_for_a_newer_one(fake_router):
    policy = mains.FakePolicy()
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        exchanger = ModelExchanger(policy, max_staleness=1, timeout_s=0.3)
        [handler] = fake_router.handlers["conveyor.exchange.model"]
        handler({"version": 1, "tensors": [torch.ones(1, 2), torch.ones(1)], "extras": {}})
        used = []
        task.use(exchanger).use(lambda ctx: used.append(policy.version))
        task.run(max_step=2)
        with pytest.raises(TimeoutError, match="newer than version 1 \\(max_staleness=1 and it served 2 batches\\)"):
            task.run(max_step=1)
        handler({"version": 2, "tensors": [torch.ones(1, 2), torch.ones(1)], "extras": {}})
        task.run(max_step=1)
    assert used == [1, 1, 2]


@pytest.mark.parametrize("make", ["dqn", "ppo_obs_norm"])
def test_a_real_policys_version_crosses_the_codec_and_loads_under_its_number(fake_router, make):
    from conveyor.engine.parallel import codec
    from conveyor.policy import DQNPolicy, PPOPolicy

    def policy():
        if make == "dqn":
            return DQNPolicy({"model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [8]}}, seed=0)
        return PPOPolicy({"model": {"obs_shape": 2, "action_shape": 2, "hidden_sizes": [8], "obs_norm": True}}, seed=0)

    learner, replica = policy(), policy()
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(1.0)
    learner.publish()
    with task.start():
        task.add_role(task.role.LEARNER)
        ModelExchanger(learner)
        [answer] = fake_router.handlers["conveyor.exchange.model_request"]
        answer({"node": "1"})
    [(topic, state)] = fake_router.sent
    state = codec.decode([bytes(f) for f in codec.encode(state)])  # what a receiver gets: plain data, no pickle
    replica.load_acting_state(state)
    assert topic == "conveyor.exchange.model" and replica.version == learner.version == 1
    for mine, theirs in zip(replica.model.state_dict().values(), learner.model.state_dict().values()):
        assert torch.equal(mine, theirs)
    obs = np.array([[0.5, -2.0]], dtype=np.float32)
    mine, theirs = replica.eval_mode.forward(obs), learner.eval_mode.forward(obs)
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    if make == "ppo_obs_norm":
        assert type(state["extras"]).__name__ == "FrozenNormaliser"


def learner_with_a_batch_from_3(router):
    """A learner's ContextExchanger (grace_s 0.05) holding one batch (1 env step) from collector "3"."""
    task.add_role(task.role.LEARNER)
    exchanger = ContextExchanger(timeout_s=60, grace_s=0.05)
    [deliver] = router.handlers[DATA_TOPIC]
    deliver({"node": "3", "trajectories": ttorch.Tensor({"reward": torch.ones(1)}), "episodes": None,
             "train_data": None, "env_step": 1, "env_episode": 1})
    return exchanger


def test_a_learner_whose_last_collector_is_lost_stops_after_grace_s_and_ends_the_run_normally(fake_router, caplog):
    with task.start(ctx=OnlineRLContext()):
        exchanger = learner_with_a_batch_from_3(fake_router)
        ended = []
        task.on(FINISH_EVENT, ended.append)
        trained = []
        task.use(exchanger).use(lambda ctx: trained.append(ctx.env_step))
        task.use(lambda ctx: task.emit(PEER_LOST_EVENT, "3"))  # as the router reports a dead collector
        with caplog.at_level(logging.WARNING, logger="conveyor.middleware.exchanger"):
            task.run(max_step=5)
        assert trained == [1] and ended == [None] and task.finish and task.ctx.total_step == 2
    assert "no collector left (lost: 3)" in caplog.text and "no collector joined within grace_s=0.05s" in caplog.text


def test_a_stop_request_ends_a_receivers_wait_for_weights_at_once(fake_router):
    def publish(topic, payload):  # the exchanger asks for weights: it is waiting; now ask it to stop
        if topic == MODEL_REQUEST_TOPIC:
            task.finish = True
            task.emit(STOP_EVENT)
        return 0

    fake_router.publish = publish
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        collected = []
        task.use(ModelExchanger(torch.nn.Linear(1, 1), timeout_s=60)).use(collected.append)
        task.run(max_step=3)
        assert collected == [] and task.ctx.total_step == 1


@pytest.mark.timeout(20)
def test_a_learner_whose_collectors_are_lost_while_their_batch_waits_trains_on_it_then_stops_after_grace_s(fake_router):
    with task.start(ctx=OnlineRLContext()):
        exchanger = learner_with_a_batch_from_3(fake_router)
        task.emit(PEER_LOST_EVENT, "3")  # lost before the learner took its batch
        trained = []
        task.use(exchanger).use(lambda ctx: trained.append(ctx.env_step))
        task.run(max_step=5)
        assert trained == [1] and task.finish and task.ctx.total_step == 2  # not a wait of timeout_s


def test_a_collector_that_finished_is_a_goodbye_not_a_lost_peer(fake_router, caplog):
    fake_router.peers = lambda: ["3"]  # still a live peer: its main returned (runner's FINISHED), it did not die
    with task.start(ctx=OnlineRLContext()):
        exchanger = learner_with_a_batch_from_3(fake_router)
        task.use(exchanger).use(lambda ctx: task.emit(PEER_LOST_EVENT, "3"))
        with caplog.at_level(logging.INFO, logger="conveyor.middleware.exchanger"):
            task.run(max_step=5)
        assert task.finish and task.ctx.total_step == 2
    assert "no collector left (finished: 3)" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _batch(obs, **changes):
    return {"node": "9", "trajectories": ttorch.Tensor({"obs": obs}), "episodes": None, "train_data": None,
            "env_step": 1, "env_episode": 0, **changes}


def test_a_learner_drops_and_counts_wrong_data_from_a_peer_with_the_secret(peer_with_the_secret, caplog):
    mine, peer = peer_with_the_secret
    wrong = [["not", "a", "dict"], "text", 7, None, {"node": "9"},  # wrong types, missing keys
             _batch(torch.zeros(2, 3), env_step=-1), _batch(torch.zeros(2, 3), node=9),
             _batch(torch.zeros(2, 3), episodes="not a list"),
             _batch(torch.zeros(2, 4)),  # another shape than the first batch's
             _batch(torch.zeros(2, 3, dtype=torch.float64)),  # another dtype
             _batch(torch.zeros(2, 3), trajectories=ttorch.Tensor({"obs": torch.zeros(2, 3), "act": torch.zeros(3)}))]
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=WAIT)
        shapes = []

        def learn(ctx):
            shapes.append(tuple(ctx.trajectories.obs.shape))
            task.finish = ctx.env_step == 2

        task.use(exchanger).use(learn)
        peer.wait_for_subscribers(DATA_TOPIC, 1, WAIT)
        peer.publish(DATA_TOPIC, _batch(torch.zeros(2, 3)))  # accepted: the layout every batch must have
        for payload in wrong:
            peer.publish(DATA_TOPIC, payload)
        peer.publish(DATA_TOPIC, _batch(torch.ones(5, 3)))  # arrives after every wrong one
        with caplog.at_level(logging.WARNING, logger="conveyor.middleware.exchanger"):
            task.run(max_step=10)
        assert task.ctx.env_step == 2 and sum(n for shape in shapes for n in shape[:1]) == 7
    assert exchanger.stats() == {"rejected": len(wrong), "credit_capped": 0} and mine.stats()["handler_errors"] == 0
    assert caplog.text.count("dropped a message on 'conveyor.exchange.data'") == 1  # once a minute, not per message


def test_a_collector_drops_and_counts_wrong_weights_from_a_peer_with_the_secret(peer_with_the_secret):
    mine, peer = peer_with_the_secret
    good = [torch.ones(1, 2), torch.ones(1)]  # FakePolicy: Linear(2, 1)
    wrong = ["weights", {"version": 5}, {"version": -1, "tensors": good, "extras": {}},
             {"version": 5, "tensors": good[:1], "extras": {}}, {"version": 5, "tensors": "ab", "extras": {}},
             {"version": 5, "tensors": [torch.ones(2, 2), torch.ones(1)], "extras": {}},
             {"version": 5, "tensors": [torch.ones(1, 2, dtype=torch.int64), torch.ones(1)], "extras": {}},
             {"version": 5, "tensors": good, "extras": [1]}]
    policy = mains.FakePolicy()
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        exchanger = ModelExchanger(policy, timeout_s=WAIT)
        task.use(exchanger)
        peer.on(MODEL_REQUEST_TOPIC, lambda request: None)  # a learner: it answers requests
        mine.wait_for_subscribers(MODEL_REQUEST_TOPIC, 1, WAIT)
        peer.wait_for_subscribers("conveyor.exchange.model", 1, WAIT)
        for payload in wrong:
            peer.publish("conveyor.exchange.model", payload)
        peer.publish("conveyor.exchange.model", {"version": 3, "tensors": good, "extras": {"eps": 3.0}})
        task.run(max_step=1)  # waits for the first version: the good one, after every wrong one
    assert exchanger.loaded_version == 3 and policy.weight() == 1.0
    assert exchanger.stats() == {"rejected": len(wrong)} and mine.stats()["handler_errors"] == 0


def weights(version):
    return {"version": version, "tensors": [torch.full((1, 2), float(version)), torch.full((1,), float(version))],
            "extras": {"eps": float(version)}}


@pytest.mark.timeout(30)
def test_with_rejoin_s_a_collector_whose_learner_was_lost_goes_on_with_its_restarts_first_version(fake_router):
    learners = ["0"]
    fake_router.subscribers = lambda topic: list(learners)

    def publish(topic, payload):  # the restarted learner answers a request with the version of its checkpoint
        if topic == MODEL_REQUEST_TOPIC and learners:
            deliver(weights(2 if lost else 5))
        return len(learners)

    fake_router.publish, lost = publish, []
    policy = mains.FakePolicy()
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        exchanger = ModelExchanger(policy, max_staleness=None, timeout_s=WAIT, rejoin_s=WAIT)
        [deliver] = fake_router.handlers["conveyor.exchange.model"]
        used = []

        def collect(ctx):
            used.append(policy.version)
            if ctx.total_step == 0:  # the learner dies; a new incarnation subscribes again
                learners.clear()
                lost.append(True)
                task.emit(PEER_LOST_EVENT, "0")
                learners.append("0")

        task.use(exchanger).use(collect)
        task.run(max_step=3)
        assert used == [5, 2, 2] and not task.finish and exchanger.loaded_version == 2


@pytest.mark.parametrize("how", ["finished", "lost_for_good"])
def test_with_rejoin_s_a_collector_ends_its_run_when_its_learner_finished_or_none_rejoins(fake_router, how):
    learners = ["0"]
    fake_router.subscribers = lambda topic: list(learners)
    fake_router.peers = lambda: ["0"] if how == "finished" else []  # a finished peer is live until it closes
    policy = mains.FakePolicy()
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        exchanger = ModelExchanger(policy, timeout_s=WAIT, rejoin_s=0.3)
        [deliver] = fake_router.handlers["conveyor.exchange.model"]
        deliver(weights(1))
        used = []

        def collect(ctx):
            used.append(policy.version)
            learners.clear()
            task.emit(PEER_LOST_EVENT, "0")

        task.use(exchanger).use(collect)
        started = time.monotonic()
        task.run(max_step=3)
        assert used == [1] and task.finish
        assert (time.monotonic() - started < 0.3) == (how == "finished")  # a goodbye is not waited for


@pytest.mark.timeout(20)
def test_a_learner_whose_collectors_are_lost_before_their_first_batch_stops_after_grace_s(fake_router):
    calls = []

    def subscribers(topic):  # both collectors are known by their subscription; on the next look both are gone
        calls.append(topic)
        if topic == COLLECTOR_TOPIC and len(calls) == 2:
            for node in ("1", "2"):
                task.emit(PEER_LOST_EVENT, node)
        return ["1", "2"] if topic == COLLECTOR_TOPIC and len(calls) == 1 else []

    fake_router.subscribers = subscribers
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        trained = []
        task.use(ContextExchanger(timeout_s=60, grace_s=0.05)).use(trained.append)
        task.run(max_step=5)
        assert trained == [] and task.finish and task.ctx.total_step == 1


@pytest.mark.parametrize("end", ["the learner's stop heard", "asked to stop"])
def test_a_collector_whose_run_ends_before_any_learner_took_its_first_batch_drops_it_and_stops(fake_router, end):
    """A learner that reached its budget on the other collectors' batches has finished and unsubscribed before a
    slow collector's first send: that collector ends its run, it does not wait out timeout_s for a subscriber."""
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        seen = []

        def collect(ctx):
            seen.append(ctx.total_step)
            ctx.trajectories = trajectories(1.0)
            if end == "asked to stop":
                task.emit(STOP_EVENT)
            else:
                task.finish = True  # as LearnerClock does on the learner's stop

        task.use(ContextExchanger(timeout_s=WAIT)).use(collect)
        started = time.monotonic()
        task.run(max_step=3)
        assert seen == [0] and task.finish and time.monotonic() - started < WAIT / 2


def test_a_collector_no_learner_subscribes_to_ends_with_a_clear_timeout(fake_router):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        task.use(ContextExchanger(timeout_s=0.3)).use(lambda ctx: setattr(ctx, "trajectories", trajectories(1.0)))
        with pytest.raises(TimeoutError, match="found no learner subscribed to 'conveyor.exchange.data' within 0.3s"):
            task.run(max_step=1)


# --- DI-engine's ContextExchanger: trajectory_end_idx travels, skip_n_iter ----------------------------------
def trajectories(value: float, steps: int = 2, envs: int = 3):
    return ttorch.Tensor({"obs": torch.full((steps, envs), value), "reward": torch.zeros(steps, envs)})


def test_a_collector_sends_trajectory_end_idx_with_its_trajectories(fake_router):
    fake_router.publish = lambda topic, payload: fake_router.sent.append((topic, payload)) or 1  # a learner listens
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)

        def collect(ctx):
            ctx.trajectories, ctx.trajectory_end_idx = trajectories(1.0), np.array([1, 4])

        task.use(ContextExchanger(timeout_s=1)).use(collect)
        task.run(max_step=1)
    [(topic, payload)] = [(t, p) for t, p in fake_router.sent if t == DATA_TOPIC]
    assert payload["trajectory_end_idx"].tolist() == [1, 4]


@pytest.mark.parametrize("second, merged", [(np.array([0, 5]), [1, 4, 6, 11]), (None, None),
                                            (np.array([6]), None)])  # past its 6 transitions: reshaped after it was set
def test_a_learner_shifts_each_collectors_trajectory_end_idx_into_the_merged_trajectories(fake_router, second, merged):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=1)
        [deliver] = fake_router.handlers[DATA_TOPIC]
        for node, end_idx in (("1", np.array([1, 4])), ("2", second)):  # [T=2, N=3]: 6 transitions apiece
            deliver({"node": node, "trajectories": trajectories(float(node)), "trajectory_end_idx": end_idx,
                     "episodes": None, "train_data": None, "env_step": 6, "env_episode": 2})
        got = []
        task.use(exchanger).use(lambda ctx: got.append(ctx.trajectory_end_idx))
        task.run(max_step=1)
    assert (got[0] if merged is None else got[0].tolist()) == merged  # None: where the second's episodes end is unknown


@pytest.mark.parametrize("end_idx, sent", [
    (np.array([[1]]), trajectories(1.0)), (np.array([0.5]), trajectories(1.0)), (np.array([-1]), trajectories(1.0)),
    ([1, -4], trajectories(1.0)), ([1, True], trajectories(1.0)), ([1.0], trajectories(1.0)), ([1 << 63], [0, 1]),
    (np.array([1]), None), (np.array([9]), ttorch.Tensor({"obs": torch.ones(2)}))])
def test_a_learner_drops_a_trajectory_end_idx_that_does_not_index_its_trajectories(fake_router, end_idx, sent):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=1)
        [deliver] = fake_router.handlers[DATA_TOPIC]
        deliver({"node": "1", "trajectories": sent, "trajectory_end_idx": end_idx,
                 "episodes": None, "train_data": None, "env_step": 6, "env_episode": 2})
    assert exchanger.stats() == {"rejected": 1, "credit_capped": 0}


def test_a_learner_joins_di_engines_lists_of_transitions_and_shifts_their_end_indices(fake_router):
    def transition(value):
        return {"obs": np.full(3, value), "reward": np.array(value)}  # a scalar reward: a list's items are rows

    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=1)
        [deliver] = fake_router.handlers[DATA_TOPIC]
        for node, n in (("1", 3), ("2", 2)):  # lists of any length: the list is the batch
            deliver({"node": node, "trajectories": [transition(float(node))] * n, "trajectory_end_idx": [n - 1],
                     "episodes": [[transition(float(node))] * n], "train_data": None, "env_step": n, "env_episode": 1})
        got = []
        task.use(exchanger).use(lambda ctx: got.append(ctx))
        task.run(max_step=1)
    [ctx] = got
    assert [float(t["reward"]) for t in ctx.trajectories] == [1.0] * 3 + [2.0] * 2
    assert ctx.trajectory_end_idx == [2, 4] and [len(ep) for ep in ctx.episodes] == [3, 2]  # DI-engine's form kept


def test_a_learner_takes_an_empty_list_of_transitions_as_no_batch(fake_router):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=1)
        [deliver] = fake_router.handlers[DATA_TOPIC]
        deliver({"node": "1", "trajectories": trajectories(1.0), "episodes": None, "train_data": None, "env_step": 6,
                 "env_episode": 0})
        deliver({"node": "2", "trajectories": [], "trajectory_end_idx": [], "episodes": [[]], "train_data": [],
                 "env_step": 0, "env_episode": 0})
        got = []
        task.use(exchanger).use(lambda ctx: got.append((ctx.trajectories.obs.shape, ctx.episodes, ctx.train_data)))
        task.run(max_step=1)
    assert got == [((2, 3), None, None)] and exchanger.stats() == {"rejected": 0, "credit_capped": 0}


@pytest.mark.parametrize("items", [[np.zeros(3), np.zeros(4)], [np.zeros(3), {"obs": np.zeros(3)}]])
def test_a_learner_drops_a_list_of_transitions_laid_out_differently(fake_router, items):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=1)
        [deliver] = fake_router.handlers[DATA_TOPIC]
        deliver({"node": "1", "trajectories": [np.zeros(3)], "episodes": None, "train_data": None, "env_step": 1,
                 "env_episode": 0})  # accepted: its items' layout is the one every batch's items must have
        deliver({"node": "1", "trajectories": items, "episodes": None, "train_data": None, "env_step": 2,
                 "env_episode": 0})
    assert exchanger.stats() == {"rejected": 1, "credit_capped": 0}


def test_skip_n_iter_must_be_a_count_or_none(fake_router):
    with task.start():
        task.add_role(task.role.COLLECTOR)
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="skip_n_iter"):
                ContextExchanger(skip_n_iter=bad)


@pytest.mark.parametrize("skip_n_iter", [1, 2])
def test_with_skip_n_iter_a_collector_waits_for_the_learner_from_its_skip_n_iter_th_iteration_on(fake_router,
                                                                                                  skip_n_iter):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        seen = []
        task.use(ContextExchanger(timeout_s=0.3, skip_n_iter=skip_n_iter)).use(lambda ctx: seen.append(ctx.total_step))
        with pytest.raises(TimeoutError, match=r"no train_iter .*\(skip_n_iter=%d\) within 0.3s" % skip_n_iter):
            task.run(max_step=skip_n_iter + 5)  # no learner ever sends a train_iter
    assert seen == list(range(skip_n_iter))  # the iterations before skip_n_iter did not wait


def test_with_skip_n_iter_a_collector_runs_in_step_with_the_learners_train_iter(fake_router):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        exchanger = ContextExchanger(timeout_s=0.3, skip_n_iter=1)
        [deliver] = fake_router.handlers["conveyor.exchange.train_iter"]
        seen = []

        def collect(ctx):
            seen.append((ctx.total_step, ctx.train_iter))
            if ctx.total_step < 2:
                deliver({"train_iter": 10 * (ctx.total_step + 1)})  # the learner's answer to this iteration's batch

        task.use(exchanger).use(collect)
        with pytest.raises(TimeoutError, match="no train_iter"):
            task.run(max_step=5)  # the third answer never comes
    assert seen == [(0, 0), (1, 10), (2, 20)]


def test_with_skip_n_iter_a_collector_whose_learners_are_gone_ends_its_run_normally(fake_router):
    learners = ["0"]
    fake_router.subscribers = lambda topic: list(learners) if topic == DATA_TOPIC else []
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.EVALUATOR)
        seen = []

        def evaluate(ctx):
            seen.append(ctx.total_step)
            learners.clear()
            task.emit(PEER_LOST_EVENT, "0")

        task.use(ContextExchanger(timeout_s=WAIT, skip_n_iter=1)).use(evaluate)
        started = time.monotonic()
        task.run(max_step=5)
        assert seen == [0] and task.finish and time.monotonic() - started < WAIT / 2


IMPORT_THE_EXCHANGERS = """
import pathlib, sys, types
import conveyor
# conveyor.middleware's __init__ imports every middleware (torch among them): load the exchangers' modules alone.
package = types.ModuleType("conveyor.middleware")
package.__path__ = [str(pathlib.Path(conveyor.__file__).parent / "middleware")]
sys.modules["conveyor.middleware"] = package
import conveyor.middleware.exchanger, conveyor.middleware.model_exchanger
print(",".join(m for m in ("torch", "numpy", "treetensor") if m in sys.modules) or "none")
"""


def test_the_exchangers_import_no_torch():
    """A process that exchanges context only (or has not made its policy yet) pays no torch import for it."""
    out = subprocess.run([sys.executable, "-c", IMPORT_THE_EXCHANGERS], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["none"], out.stderr[-2000:]


@pytest.mark.timeout(30)
def test_a_collector_whose_learner_is_live_but_out_of_reach_for_a_moment_sends_again_once_it_is_reachable(fake_router):
    """As after this collector stood still past the peer timeout (the learner closed its connection): its link to the
    learner reconnects, and until the learner is proven there again a publish reaches nobody. The learner is still a
    live peer, so the collector waits for it (up to ``timeout_s``) instead of ending for want of a learner, also
    without ``rejoin_s`` (no --auto-recover)."""
    reachable, looks = [True], []
    fake_router.peers = lambda: ["0"]

    def subscribers(topic):
        if not reachable[0]:
            looks.append(topic)
            reachable[0] = len(looks) >= 3  # reachable again after a few looks
        return ["0"] if reachable[0] else []

    def publish(topic, payload):
        fake_router.sent.append((topic, payload))
        return 1 if reachable[0] else 0

    fake_router.subscribers, fake_router.publish = subscribers, publish
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        exchanger = ContextExchanger(timeout_s=WAIT)

        def collect(ctx):
            ctx.episodes, ctx.env_step = [ctx.total_step], ctx.env_step + 1
            if ctx.total_step == 1:
                reachable[0] = False  # its link to the learner reconnecting as the second batch goes out

        task.use(exchanger).use(collect)
        task.run(max_step=3)
        assert not task.finish
    delivered = [p["episodes"] for t, p in fake_router.sent if t == DATA_TOPIC]
    assert delivered == [[0], [1], [1], [2]]  # the second batch again, once reachable


@pytest.mark.timeout(30)
def test_a_collector_without_rejoin_s_whose_learners_are_lost_ends_its_run_at_once(fake_router):
    reached = [1]
    fake_router.subscribers = lambda topic: ["0"] if reached[0] else []
    fake_router.peers = lambda: ["0"] if reached[0] else []  # lost: no longer a live peer

    def publish(topic, payload):
        fake_router.sent.append((topic, payload))
        return reached[0]

    fake_router.publish = publish
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)

        def collect(ctx):
            ctx.episodes, ctx.env_step = [ctx.total_step], ctx.env_step + 1
            reached[0] = 0 if ctx.total_step == 1 else reached[0]

        task.use(ContextExchanger(timeout_s=WAIT)).use(collect)
        started = time.monotonic()
        task.run(max_step=5)
        assert task.finish and task.ctx.total_step == 2 and time.monotonic() - started < WAIT / 2
