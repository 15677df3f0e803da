"""What a peer holding the secret can make of the exchangers: batches no env could have made, claims of env steps
it did not send, batches in another node's name, versions from a node that is no learner. Each is refused and
counted; honest traffic goes on."""
import logging
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch
import treetensor.torch as ttorch

from conveyor.engine import PEER_LOST_EVENT, OnlineRLContext, task
from conveyor.middleware import CkptSaver
from conveyor.middleware.exchanger import DATA_TOPIC, MODEL_REQUEST_TOPIC, MODEL_TOPIC, ContextExchanger, ModelExchanger
from tests.middleware import _exchanger_mains as mains
from tests.middleware.test_exchanger import fake_router  # noqa: F401 (a fixture)

WAIT = 20
CARTPOLE = (gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2))


def transitions(n=2, **changes):
    """``n`` CartPole transitions as a collector sends them, with ``changes`` to some of their arrays."""
    arrays = {"obs": np.zeros((n, 4), np.float32), "next_obs": np.zeros((n, 4), np.float32),
              "action": np.zeros(n, np.int64), "reward": np.ones(n, np.float32),
              "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool)}
    return ttorch.Tensor({key: torch.from_numpy(value) for key, value in {**arrays, **changes}.items()})


def batch(node="9", env_step=2, **changes):
    return {"node": node, "trajectories": transitions(**changes), "episodes": None, "train_data": None,
            "env_step": env_step, "env_episode": 0}


def learner_taking(peer, exchanger, until_env_step):
    """Run a learner with ``exchanger`` until its ``env_step`` reaches ``until_env_step``; the batches it trained on."""
    trained = []

    def learn(ctx):
        trained.append(ctx.trajectories)
        task.finish = ctx.env_step >= until_env_step

    task.use(exchanger).use(learn)
    peer.wait_for_subscribers(DATA_TOPIC, 1, WAIT)
    return trained


def test_a_learner_drops_batches_no_env_could_have_made_and_says_who_sent_them(peer_with_the_secret, caplog):
    mine, peer = peer_with_the_secret
    nan, inf = np.full((2, 4), np.nan, np.float32), np.array([1.0, np.inf], np.float32)
    wrong = [batch(action=np.array([0, 7])),  # CartPole has 2 actions: an index out of every table
             batch(action=np.array([-1, 0])), batch(obs=nan), batch(next_obs=nan), batch(reward=inf),
             batch(reward=np.array([np.nan, 1.0], np.float32)), batch(obs=np.zeros((2, 5), np.float32)),
             batch(obs=np.zeros((2, 4), np.int64)), batch(action=np.zeros(2, np.float32)),
             batch(terminated=np.array([0.0, 2.0], np.float32)), batch(value=np.array([0.0, np.inf], np.float32))]
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=WAIT, spaces=CARTPOLE)
        trained = learner_taking(peer, exchanger, until_env_step=2)
        for payload in wrong:  # before any good batch: what is refused is the values, not another layout
            peer.publish(DATA_TOPIC, payload)
        peer.publish(DATA_TOPIC, batch(action=np.array([1, 0])))
        with caplog.at_level(logging.WARNING, logger="conveyor.middleware.exchanger"):
            task.run(max_step=10)
        assert task.ctx.env_step == 2 and [t.action.tolist() for t in trained] == [[1, 0]]
    assert exchanger.stats()["rejected"] == len(wrong) and mine.stats()["handler_errors"] == 0
    assert "dropped a message on 'conveyor.exchange.data' from node 9: its trajectories.action holds values " \
           "outside Discrete(2)" in caplog.text
    assert caplog.text.count("dropped a message") == 1  # once a minute, not per batch


def test_a_learner_checks_episodes_and_training_data_too(fake_router):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=WAIT, spaces=CARTPOLE)
        [deliver] = fake_router.handlers[DATA_TOPIC]
        deliver({**batch(), "trajectories": None, "episodes": [transitions(action=np.array([0, 9]))]})
        deliver({**batch(), "trajectories": None, "train_data": transitions(obs=np.full((2, 4), np.inf, np.float32))})
    assert exchanger.stats()["rejected"] == 2


def test_a_box_action_must_lie_within_its_bounds():
    from conveyor.middleware.batch_check import BadMessage, SpaceCheck
    check = SpaceCheck(CARTPOLE[0], gym.spaces.Box(-2.0, 2.0, (1,), np.float32))
    check("trajectories", {"action": np.array([[-2.0], [2.0]], np.float32)})  # its bounds are in it
    for wrong in ([[2.5], [0.0]], [[0.0, 0.0], [0.0, 0.0]]):
        with pytest.raises(BadMessage):
            check("trajectories", {"action": np.array(wrong, np.float32)})


def test_a_collector_is_credited_no_more_env_steps_than_the_transitions_it_sent(fake_router, caplog):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=WAIT)
        [deliver] = fake_router.handlers[DATA_TOPIC]
        steps = []
        task.use(exchanger).use(lambda ctx: steps.append(ctx.env_step))
        deliver(batch(node="3", env_step=640))  # 2 transitions
        with caplog.at_level(logging.WARNING, logger="conveyor.middleware.exchanger"):
            task.run(max_step=1)
        # an n-step enhancer keeps rows back: a claim ahead of the rows sent is credited as they arrive, uncounted
        deliver({**batch(node="4", env_step=4), "trajectories": transitions(3)})
        deliver({**batch(node="4", env_step=4), "trajectories": transitions(5)})
        task.run(max_step=1)
    assert steps == [2, 2 + 8] and exchanger.received == {"3": 2, "4": 8}
    assert exchanger.stats()["credit_capped"] == 1
    assert "node 3 claims 640 env steps in all but sent 2 transitions" in caplog.text


def test_a_batch_in_another_nodes_name_is_dropped_so_a_made_up_node_never_holds_the_learner(peer_with_the_secret):
    mine, peer = peer_with_the_secret
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=WAIT, grace_s=0.05)
        trained = learner_taking(peer, exchanger, until_env_step=10 ** 6)
        task.use(lambda ctx: task.emit(PEER_LOST_EVENT, "9"))  # its collector leaves after one batch
        peer.publish(DATA_TOPIC, batch(node="ghost", action=np.array([0, 0]), env_step=0))  # no such collector
        peer.publish(DATA_TOPIC, batch())
        task.run(max_step=5)
        assert len(trained) == 1 and task.finish  # after grace_s, not a wait of timeout_s for "ghost"
    assert exchanger.stats()["rejected"] == 1 and exchanger.received == {"9": 2}


def test_a_learner_given_its_collectors_drops_the_batches_of_any_other_node(peer_with_the_secret):
    mine, peer = peer_with_the_secret
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=0.5, collectors=[3, 4])
        arrived = threading.Event()
        mine.on(DATA_TOPIC, lambda payload: arrived.set())  # handled after the exchanger's handler
        peer.wait_for_subscribers(DATA_TOPIC, 1, WAIT)
        peer.publish(DATA_TOPIC, batch())
        assert arrived.wait(WAIT)
    assert exchanger.stats()["rejected"] == 1


def test_when_a_learners_wait_times_out_the_run_still_ends_with_its_final_checkpoint(fake_router, policy, tmp_path):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        task.use(ContextExchanger(timeout_s=0.2))
        task.use(CkptSaver(policy, tmp_path))
        with pytest.raises(TimeoutError, match="no collected data"):
            task.run(max_step=1)
    assert (tmp_path / "ckpt" / "final.pth.tar").is_file()


def weights(version):
    return {"version": version, "tensors": [torch.full((1, 2), 1.0), torch.full((1,), 1.0)], "extras": {"eps": 1.0}}


@pytest.mark.timeout(60)
def test_a_receiver_takes_versions_only_from_a_learner_whatever_their_number(peer_with_the_secret):
    mine, peer = peer_with_the_secret
    policy = mains.FakePolicy()
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        exchanger = ModelExchanger(policy, max_staleness=0, timeout_s=WAIT)
        loaded = []
        task.use(exchanger).use(lambda ctx: loaded.append(exchanger.loaded_version))
        arrived = threading.Event()
        mine.on(MODEL_TOPIC, lambda payload: arrived.set())  # handled after the exchanger's handler
        peer.wait_for_subscribers(MODEL_TOPIC, 1, WAIT)
        peer.publish(MODEL_TOPIC, weights(1 << 62))  # node 9 answers no request: it is no learner
        assert arrived.wait(WAIT)
        peer.on(MODEL_REQUEST_TOPIC, lambda request: None)  # now it is one, and numbers its versions as it likes
        mine.wait_for_subscribers(MODEL_REQUEST_TOPIC, 1, WAIT)
        peer.publish(MODEL_TOPIC, weights(3))
        task.run(max_step=1)
        peer.publish(MODEL_TOPIC, weights(4))  # a version newer than 3: not one newer than 2**62
        task.run(max_step=1)
    assert loaded == [3, 4] and exchanger.stats() == {"rejected": 1}


def test_a_receiver_given_its_learners_drops_versions_from_any_other_node(peer_with_the_secret):
    mine, peer = peer_with_the_secret
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.COLLECTOR)
        exchanger = ModelExchanger(mains.FakePolicy(), timeout_s=WAIT, learners=[0])
        arrived = threading.Event()
        mine.on(MODEL_TOPIC, lambda payload: arrived.set())
        peer.on(MODEL_REQUEST_TOPIC, lambda request: None)
        mine.wait_for_subscribers(MODEL_REQUEST_TOPIC, 1, WAIT)
        peer.wait_for_subscribers(MODEL_TOPIC, 1, WAIT)
        peer.publish(MODEL_TOPIC, weights(5))
        assert arrived.wait(WAIT)
        assert exchanger.loaded_version is None
    assert exchanger.stats() == {"rejected": 1}


def test_a_list_of_transitions_di_engines_form_is_checked_item_by_item(fake_router):
    def one(action):
        return {"obs": np.zeros(4, np.float32), "next_obs": np.zeros(4, np.float32), "action": np.array(action),
                "reward": np.float32(1.0), "terminated": np.bool_(False), "truncated": np.bool_(False)}

    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=WAIT, spaces=CARTPOLE)
        [deliver] = fake_router.handlers[DATA_TOPIC]
        deliver({**batch(), "trajectories": [one(0), one(7)]})
        deliver({**batch(), "trajectories": [one(0), one(1)]})
    assert exchanger.stats()["rejected"] == 1


def test_a_batch_whose_dict_has_both_1_and_the_text_1_as_keys_is_taken_not_a_handler_error(fake_router):
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        exchanger = ContextExchanger(timeout_s=WAIT)
        [deliver] = fake_router.handlers[DATA_TOPIC]
        deliver({**batch(), "trajectories": {1: 5, "1": np.zeros(2), "reward": np.ones(2)}})
    assert exchanger.stats()["rejected"] == 0
