"""Trust, round two: a recorded message of a replaced incarnation, a forged counter or seq, a node id flood and a
node with another secret knocking on a listener are each refused, counted, and never cut an honest peer off."""
import logging
import queue
import time

import pytest

from conveyor.engine.parallel import encode, generate_secret, seal
from conveyor.engine.parallel import peers as peers_module
from conveyor.engine.parallel.frame import new_incarnation
from conveyor.engine.parallel.peers import RETIRED_PER_NODE, Peer, PeerTable
from conveyor.engine.parallel.router import CONTROL_TOPIC
from tests.engine.parallel._wire import FAST, SECRET, WAIT, as_peer, eventually, raw_sender
from tests.engine.parallel.test_router_hostile import Tap, pair, still_receives


def forged_state(sender, receiver, *, incarnation=None, seq=0, counter=1 << 31, address=None):
    """A state message as ``sender`` (or a made-up incarnation of its node id) would seal it for ``receiver``."""
    state = {"kind": "state", "address": address or receiver.address, "topics": ["x"], "heard": [receiver.node_id]}
    return seal(SECRET, CONTROL_TOPIC, seq, sender.node_id, encode(state), counter=counter,
                sender_incarnation=incarnation or bytes.fromhex(sender.incarnation),
                receiver_incarnation=bytes.fromhex(receiver.incarnation))


def test_a_recorded_state_of_a_restarted_incarnation_is_refused_and_the_new_one_stays_live(make_router, tmp_path):
    learner_listen, tap_listen = f"ipc://{tmp_path}/learner.ipc", f"ipc://{tmp_path}/tap.ipc"
    learner = make_router("learner", listen=learner_listen, advertise=tap_listen)
    tap = Tap(tap_listen, learner_listen)
    try:
        got = queue.Queue()
        learner.on("data", got.put)
        old = make_router("collector", peers=[tap_listen])
        old.wait_for_subscribers("data", 1, WAIT)
        assert old.publish("data", "old") == 1 and got.get(timeout=WAIT) == "old"
        old.close()  # its goodbye passes the tap after everything else it sent: all of it was delivered
        eventually(lambda: learner.peers() == [], "the old incarnation's goodbye")
        recorded = list(tap.recorded)
        new = make_router("collector", peers=[tap_listen])  # restarted: the same node id, a new incarnation
        new.wait_for_subscribers("data", 1, WAIT)
        assert new.publish("data", "new 0") == 1 and got.get(timeout=WAIT) == "new 0"
        lost = learner.stats()["peers_lost"]
        with raw_sender(learner_listen) as raw:
            for data in recorded:  # its states first, then its data, as recorded
                raw.send(data)
            eventually(lambda: learner.stats()["rejected_replay"] >= len(recorded), "every recorded message refused")
        assert new.publish("data", "new 1") == 1 and got.get(timeout=WAIT) == "new 1"
    finally:
        tap.close()
    assert got.empty(), "a recorded message was delivered"
    stats = learner.stats()
    assert stats["peers_lost"] == lost and stats["peers"] == ["collector"], stats

def test_an_incarnation_replaced_long_ago_stays_refused_however_many_restarts_follow():
    table = PeerTable()
    incarnations = [new_incarnation() for _ in range(3 * RETIRED_PER_NODE)]
    for inc in incarnations[:-1]:
        table.retire(Peer("collector", "ipc://x", inc))
    assert all(table.replaced("collector", inc) for inc in incarnations[:-1])
    assert not table.replaced("collector", incarnations[-1]) and not table.replaced("other", incarnations[0])


def test_a_forged_newer_incarnation_does_not_cut_off_the_live_one(make_router):
    receiver, sender, got = pair(make_router)
    with raw_sender(receiver.address) as raw:
        raw.send(forged_state(sender, receiver, incarnation=new_incarnation()))
        # taken for a restart, until the live incarnation's next state proves it still runs: the forged one is lost
        eventually(lambda: receiver.stats()["peers_lost"] == 2, "the live incarnation taken back")
    still_receives(sender, got)
    assert receiver.peers() == ["sender"] and receiver.stats()["peers_lost"] == 2


def test_a_forged_link_counter_near_two_to_the_64_does_not_cut_off_its_sender(make_router, caplog):
    caplog.set_level(logging.WARNING, logger="conveyor.engine.parallel.router")
    receiver, sender, got = pair(make_router)
    keys = dict(sender_incarnation=bytes.fromhex(sender.incarnation),
                receiver_incarnation=bytes.fromhex(receiver.incarnation))
    with raw_sender(receiver.address) as raw:
        raw.send(seal(SECRET, "x", 1 << 20, "sender", encode("forged"), counter=2 ** 64 - 1, **keys))
        raw.send(forged_state(sender, receiver, counter=2 ** 64 - 2))
        eventually(lambda: receiver.stats()["malformed"] == 2, "both forged counters refused")
    still_receives(sender, got)
    assert got.empty() and receiver.stats()["peers_lost"] == 0
    assert any("numbered far past" in r.getMessage() for r in caplog.records)


def test_a_forged_state_number_near_two_to_the_64_does_not_silence_its_sender(make_router):
    receiver, sender, got = pair(make_router)
    with raw_sender(receiver.address) as raw:
        raw.send(forged_state(sender, receiver, seq=2 ** 64 - 1))
        eventually(lambda: receiver.stats()["malformed"] == 1, "the forged state number refused")
    for i in range(3):  # longer than peer_timeout_s: its states keep it live, so it is still heard
        still_receives(sender, got, f"after {i}")
    assert receiver.stats()["peers_lost"] == 0


def test_node_ids_are_bounded_and_a_live_peer_is_never_forgotten_for_a_new_one(make_router, monkeypatch):
    monkeypatch.setattr(peers_module, "MAX_PEERS", 4)
    receiver, sender, got = pair(make_router)
    injector = make_router("injector", peers=[receiver.address])
    injector.wait_for_subscribers("x", 1, WAIT)
    sealed = as_peer(injector, receiver, SECRET)
    state = {"kind": "state", "address": receiver.address, "topics": [], "heard": []}
    with raw_sender(receiver.address) as raw:
        for i in range(10):
            inc = new_incarnation()
            raw.send(seal(SECRET, CONTROL_TOPIC, 0, f"ghost {i}", encode(state), counter=0, sender_incarnation=inc,
                          receiver_incarnation=bytes.fromhex(receiver.incarnation)))
        eventually(lambda: receiver.stats()["rejected_peers"] == 8, "the ghosts beyond the bound refused")
        assert sorted(receiver.peers()) == ["ghost 0", "ghost 1", "injector", "sender"]
        eventually(lambda: sorted(receiver.peers()) == ["injector", "sender"], "the ghosts silent, so dead")
        raw.send(sealed(CONTROL_TOPIC, 1 << 40, frames=encode({**state, "topics": ["x"]})))
    still_receives(sender, got)
    assert receiver.stats()["rejected_peers"] == 8 and "sender" in receiver.peers()


def test_a_listener_waiting_for_its_peers_names_the_address_with_another_secret_within_seconds(make_router):
    receiver = make_router("receiver", listen="tcp://127.0.0.1:0", auth_timeout_s=1.0)
    make_router("stranger", secret=generate_secret(), peers=[receiver.address], auth_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        receiver.wait_for_peers(1, timeout=30)
    assert time.monotonic() - start < 10  # a few auth timeouts, not the 30 s it was asked to wait
    message = str(e.value)
    assert "127.0.0.1:" in message and "failed authentication" in message and "--secret-file" in message
    assert "CONVEYOR_SECRET" in message and "\n" not in message


def test_one_stray_unauthentic_message_does_not_end_a_node_waiting_for_its_peers(make_router):
    receiver = make_router("receiver", listen="tcp://127.0.0.1:0", auth_timeout_s=0.2)
    with raw_sender(receiver.address) as raw:
        raw.send(b"stray")
        eventually(lambda: receiver.stats()["rejected_auth"] == 1, "the stray message counted")
    late = make_router("late", peers=[receiver.address])
    assert receiver.wait_for_peers(1, timeout=WAIT) == ["late"]
    assert late.peers() == ["receiver"] and FAST["heartbeat_s"] < 0.2
