"""Batched inference on a host: an InferenceServer acting for collectors in one forward pass, RemoteActing views
asking it, over real routers in this process."""
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch

from benchmarks._cluster import wait_until
from conveyor.engine import OnlineRLContext, task
from conveyor.engine.parallel import generate_secret
from conveyor.engine.parallel.router import Router
from conveyor.envs import SyncEnvManager
from conveyor.middleware import StepCollector
from conveyor.middleware.double_buffer import EnvGroups
from conveyor.middleware.inference import (REQUEST_TOPIC, InferenceServer, InferenceServerLost, RemoteActing,
                                           reply_topic)

WAIT = 20
FAST = dict(heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0)
OBS_SPACE = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)


class CountingView:
    """A collect view that counts its forwards and acts by a rule the test can check: action = round(obs[:, 0])."""

    version = 3

    def __init__(self):
        self.calls = []

    def forward(self, obs, **kwargs):
        self.calls.append((len(obs), kwargs))
        return {"action": obs[:, 0].round().astype(np.int64), "logp": np.zeros(len(obs), np.float32),
                "weight_version": np.full(len(obs), self.version, np.int64)}

    def state_dict(self):
        return {"memory": {}}

    def reset(self, env_ids=None):
        pass


@pytest.fixture
def routers():
    """The server's router (node "0") and two collectors' ("1", "2"), all ready, with one secret."""
    secret = generate_secret()
    with Router("0", secret, **FAST) as server, Router("1", secret, peers=[server.address], **FAST) as one, \
            Router("2", secret, peers=[server.address, one.address], **FAST) as two:
        for router in (server, one, two):
            router.wait_for_peers(2, WAIT)
        with task.start(ctx=OnlineRLContext()):
            yield server, one, two


def serving(server_router, view, **options):
    """An InferenceServer on ``server_router`` for collectors 1 and 2, acting on version 3 with ``view``."""
    options = {"max_rows": 8, "gather_s": WAIT, **options}
    return InferenceServer(view, lambda: 3, OBS_SPACE, ["1", "2"], router=server_router, **options)


def replies(router):
    """Replies reaching ``router``'s node, and an event set at each."""
    got, arrived = [], threading.Event()

    def take(payload):
        got.append(payload)
        arrived.set()
    router.on(reply_topic(router.node_id), take)
    router.wait_for_subscribers(REQUEST_TOPIC, 1, WAIT)
    return got, arrived


def request(seq, rows=2, version=3, **changes):
    obs = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    return {"seq": seq, "version": version, "obs": obs, "kwargs": {}, **changes}


def test_the_requests_of_every_live_collector_are_served_by_one_forward_each_collector_getting_its_rows(routers):
    server_router, one, two = routers
    view = CountingView()
    server = serving(server_router, view)
    got_one, _ = replies(one)
    got_two, _ = replies(two)
    one.publish(REQUEST_TOPIC, request(7, rows=2))
    two.publish(REQUEST_TOPIC, request(9, rows=3))
    assert server.serve(WAIT) == 2
    assert view.calls == [(5, {})] and server.stats()["forwards"] == 1
    wait_until(lambda: got_one and got_two, WAIT, "both replies")
    (first,), (second,) = got_one, got_two
    assert first["seq"] == 7 and first["out"]["action"].tolist() == [0, 4]
    assert second["seq"] == 9 and second["out"]["action"].tolist() == [0, 4, 8]


def test_a_reply_waits_for_the_collectors_subscription_when_its_request_came_first(routers):
    """A collector announces its reply topic apart from its requests, so the server can hold a request from a
    collector it does not yet know to take replies: the reply waits for the subscription instead of being lost."""
    server_router, one, _ = routers
    view = CountingView()
    server = serving(server_router, view, gather_s=0.05)
    one.wait_for_subscribers(REQUEST_TOPIC, 1, WAIT)
    one.publish(REQUEST_TOPIC, request(7, rows=2))
    served = []
    worker = threading.Thread(target=lambda: served.append(server.serve(WAIT)))
    worker.start()
    wait_until(lambda: server.stats()["forwards"] == 1, WAIT, "the server's forward")
    got, arrived = replies(one)  # subscribes only now
    assert arrived.wait(WAIT), "the reply was lost"
    worker.join(WAIT)
    assert served == [1] and got[0]["seq"] == 7 and got[0]["out"]["action"].tolist() == [0, 4]


def test_requests_with_other_exploration_arguments_are_acted_on_apart(routers):
    server_router, one, two = routers
    view = CountingView()
    server = serving(server_router, view)
    replies(one), replies(two)
    one.publish(REQUEST_TOPIC, request(1, kwargs={"eps": 0.5}))
    two.publish(REQUEST_TOPIC, request(1, kwargs={"eps": 0.1}))
    assert server.serve(WAIT) == 2
    assert sorted(kwargs["eps"] for _, kwargs in view.calls) == [0.1, 0.5]


def test_a_request_for_a_newer_version_than_the_servers_waits_for_it(routers):
    server_router, one, _ = routers
    loaded = [3]
    server = InferenceServer(CountingView(), lambda: loaded[0], OBS_SPACE, ["1", "2"], max_rows=8, gather_s=0.01,
                             router=server_router)
    got, arrived = replies(one)
    one.publish(REQUEST_TOPIC, request(1, version=4))
    assert server.serve(0.3) == 0 and not got
    loaded[0] = 4  # the server's ModelExchanger loaded version 4
    assert server.serve(WAIT) == 1 and arrived.wait(WAIT)


def test_when_the_run_has_ended_the_server_answers_until_every_collector_has_left(routers):
    """However the run's finish came (here from this node, between its iterations), the collectors still collecting
    get their actions: the server drains as the run ends, on any version."""
    server_router, one, two = routers
    server = serving(server_router, CountingView(), gather_s=0.01)
    got, arrived = replies(one)
    one.publish(REQUEST_TOPIC, request(1, version=4))  # newer than the server's version 3: held while the run goes on

    def leave():
        arrived.wait(WAIT)
        one.close()
        two.close()
    collectors = threading.Thread(target=leave)
    collectors.start()
    task.use(server).use(lambda ctx: setattr(task, "finish", True))
    task.run()
    collectors.join(WAIT)
    assert [r["seq"] for r in got] == [1] and server.stats()["served"] == 1


@pytest.mark.parametrize("bad", [
    "not a dict", {"seq": 1, "version": 3, "obs": np.zeros((2, 4), np.float32)},  # no kwargs
    request(1, obs=np.zeros((2, 5), np.float32)), request(1, obs=np.zeros((2, 4), np.float64)),
    request(1, obs=np.zeros(4, np.float32)), request(1, obs={"x": np.zeros((2, 4), np.float32)}),
    request(1, rows=9), {**request(1), "seq": -1}, request(1, kwargs={"eps": "high"}), request(1, kwargs={1: 0.5}),
    request(1, kwargs={f"k{i}": 0 for i in range(9)}),
], ids=["not-a-dict", "no-kwargs", "wide", "float64", "unbatched", "dict", "too-many-rows", "negative-seq",
        "text-kwarg", "int-key", "many-kwargs"])
def test_a_malformed_request_is_dropped_counted_and_the_server_goes_on_serving(routers, bad):
    server_router, one, _ = routers
    view = CountingView()
    server = serving(server_router, view, gather_s=0.01)
    got, arrived = replies(one)
    one.publish(REQUEST_TOPIC, bad)
    one.publish(REQUEST_TOPIC, request(2))
    assert server.serve(WAIT) == 1 and arrived.wait(WAIT)
    assert [r["seq"] for r in got] == [2] and view.calls == [(2, {})]
    assert server.stats()["rejected"] == 1


def test_a_node_that_is_no_collector_of_the_run_is_not_served(routers):
    server_router, one, two = routers
    server = InferenceServer(CountingView(), lambda: 3, OBS_SPACE, ["1"], max_rows=8, gather_s=0.01,
                             router=server_router)
    two.wait_for_subscribers(REQUEST_TOPIC, 1, WAIT)
    assert two.publish(REQUEST_TOPIC, request(1)) == 1
    wait_until(lambda: server.stats()["rejected"] == 1, WAIT, "the rejection")
    assert server.serve(0.2) == 0


def cartpoles(n, seed):
    return SyncEnvManager([lambda: gym.make("CartPole-v1")] * n, seed=seed)


@pytest.mark.parametrize("groups", [False, True], ids=["one-group", "double-buffered"])
def test_a_collector_acting_through_the_server_collects_the_batch_it_would_collect_itself(routers, groups):
    """Same seeds, same weights: the batch of a StepCollector acting through the server, its envs in one group or
    double-buffered in two, is the one it collects with its own collect view, key for key, value for value (floats
    to their last bits: a forward over more rows may round them otherwise)."""
    from conveyor.policy import PPOPolicy
    from conveyor.config import compile_config
    from easydict import EasyDict

    server_router, one, _ = routers
    cfg = compile_config(EasyDict(dict(exp_name="t", seed=0, env=dict(env_id="CartPole-v1", collector_env_num=3),
                                       policy=dict(collect=dict(n_sample=12), learn=dict(batch_size=12),
                                                   model=dict(hidden_sizes=[8])))),
                         policy=PPOPolicy)
    served, local = PPOPolicy(cfg.policy, seed=5), PPOPolicy(cfg.policy, seed=5)
    served.load_acting_state(local.acting_state())  # the server's replica, on the collector's weights
    batches = []
    for view in (RemoteActing(local.collect_mode, "0", timeout_s=WAIT, router=one), local.collect_mode):
        remote = isinstance(view, RemoteActing)
        with (EnvGroups(cartpoles(1, 0), cartpoles(2, 1)) if remote and groups else cartpoles(3, 0)) as env:
            collect, ctx = StepCollector(cfg, view, env), OnlineRLContext()
            if remote:
                server = InferenceServer(served.collect_mode, lambda: 0, env.observation_space, ["1"], max_rows=3,
                                         router=server_router)
                stop = threading.Event()
                thread = threading.Thread(target=lambda: [server.serve(0.05) for _ in iter(stop.is_set, True)])
                thread.start()
                try:
                    collect(ctx)
                finally:
                    stop.set()
                    thread.join(WAIT)
                assert server.stats()["served"] == 4 * (1 + groups)  # each step, a request per group
                assert server.stats()["forwards"] == 4 or groups  # one per step of the 3 envs in one group
            else:
                collect(ctx)
            batches.append(ctx.trajectories)
    remote, own = batches
    assert sorted(remote.keys()) == sorted(own.keys())
    for key in own.keys():
        assert remote[key].shape == own[key].shape and remote[key].dtype == own[key].dtype, key
        if own[key].is_floating_point():  # a forward over other rows beside may round the last bit otherwise
            assert torch.allclose(remote[key], own[key], rtol=1e-5, atol=1e-6), key
        else:
            assert (remote[key] == own[key]).all(), key


def test_a_lost_server_ends_the_collectors_wait_with_one_line_naming_it(routers):
    server_router, one, _ = routers
    acting = RemoteActing(CountingView(), "0", timeout_s=WAIT, router=one)
    asked = threading.Event()
    server_router.on(REQUEST_TOPIC, lambda payload: asked.set())  # takes requests, never answers
    seq = acting.request(np.zeros((2, 4), np.float32))
    assert asked.wait(WAIT)
    server_router.close()
    with pytest.raises(InferenceServerLost, match=r"^node 1: the inference server \(node 0\) was lost; .*"
                                                  r"--inference local\)$"):
        acting.result(seq)


def test_a_collector_with_no_server_stops_with_a_clear_timeout(routers):
    _, one, _ = routers
    acting = RemoteActing(CountingView(), "0", timeout_s=0.3, router=one)
    with pytest.raises(InferenceServerLost, match=r"no inference server \(node 0\) took requests within 0.3s"):
        acting.forward(np.zeros((2, 4), np.float32))


def test_replies_from_another_node_or_for_no_request_are_dropped(routers):
    server_router, one, two = routers
    acting = RemoteActing(CountingView(), "0", timeout_s=WAIT, router=one)
    server_router.on(REQUEST_TOPIC, lambda payload: None)
    seq = acting.request(np.zeros((2, 4), np.float32))
    out = {"action": np.zeros(2, np.int64)}
    one.wait_for_subscribers(REQUEST_TOPIC, 1, WAIT)
    server_router.wait_for_subscribers(reply_topic("1"), 1, WAIT)
    two.wait_for_subscribers(reply_topic("1"), 1, WAIT)
    two.publish(reply_topic("1"), {"seq": seq, "out": out})  # not the server
    server_router.publish(reply_topic("1"), {"seq": seq + 1, "out": out})  # no such request
    server_router.publish(reply_topic("1"), {"seq": seq, "out": {"action": np.zeros(3, np.int64)}})  # wrong rows
    server_router.publish(reply_topic("1"), {"seq": seq, "out": out})
    assert acting.result(seq)["action"].tolist() == [0, 0]
    # node 2's reply comes over another link: nothing orders it before node 0's, so it may be read after the answer
    wait_until(lambda: acting.stats()["rejected"] == 3, WAIT, "all three bad replies rejected")
    assert acting.stats()["rejected"] == 3
