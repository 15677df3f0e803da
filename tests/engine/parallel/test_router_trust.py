"""Trust, round two: a recorded message of a replaced incarnation, a forged counter or seq, messages or a new
incarnation sealed in a live peer's name through another connection, a node id flood and a node with another
secret knocking on a listener are each refused, counted, and never cut an honest peer off."""
import logging
import queue
import time

import pytest

from conveyor.engine.parallel import encode, generate_secret, open_batch, seal
from conveyor.engine.parallel import peers as peers_module
from conveyor.engine.parallel.frame import new_incarnation
from conveyor.engine.parallel.peers import RETIRED_PER_NODE, Peer, PeerTable
from conveyor.engine.parallel.router import CONTROL_TOPIC
from tests.engine.parallel._wire import FAST, SECRET, WAIT, eventually, join_as, raw_sender
from tests.engine.parallel.test_router_hostile import Tap, pair, still_receives


def forged_state(sender, receiver, *, incarnation=None, seq=0, counter=1 << 31, address=None):
    """A state message as ``sender`` (or a made-up incarnation of its node id) would seal it for ``receiver``."""
    state = {"kind": "state", "address": address or receiver.address, "topics": ["x"], "heard": [receiver.node_id]}
    return seal(SECRET, CONTROL_TOPIC, seq, sender.node_id, encode(state), counter=counter,
                sender_incarnation=incarnation or bytes.fromhex(sender.incarnation),
                receiver_incarnation=bytes.fromhex(receiver.incarnation))


@pytest.fixture
def tapped(make_router, tmp_path):
    """``tapped(**receiver_options)``: a receiver, a sender whose messages to it pass a :class:`Tap` (what anyone
    on the wire reads), the queue of what the receiver gets on "x", and the tap (closed at the end)."""
    taps = []

    def make(**receiver_options):
        receiver_listen, tap_listen = f"ipc://{tmp_path}/receiver.ipc", f"ipc://{tmp_path}/tap.ipc"
        receiver = make_router("receiver", listen=receiver_listen, advertise=tap_listen, **receiver_options)
        taps.append(Tap(tap_listen, receiver_listen))
        sender = make_router("sender", peers=[tap_listen])
        got = queue.Queue()
        receiver.on("x", got.put)
        sender.wait_for_subscribers("x", 1, WAIT)
        eventually(lambda: receiver.peers() == ["sender"], "the receiver hears the sender through the tap")
        return receiver, sender, got, taps[-1]

    yield make
    for tap in taps:
        tap.close()


def keyed(tap, receiver):
    """The frames the tap relayed sealed for ``receiver``'s incarnation (incarnations and counters are in clear)."""
    frames = [open_batch(SECRET, data, 1 << 30)[0] for data in tap.recorded]  # a batch shares its incarnations
    return [(f, data) for f, data in zip(frames, tap.recorded) if f.receiver_incarnation.hex() == receiver.incarnation]


@pytest.mark.parametrize("ahead", [1000, 1 << 31])
def test_messages_sealed_ahead_in_a_live_peers_name_through_another_connection_are_refused(tapped, ahead):
    receiver, sender, got, tap = tapped()
    counter = max(f.counter for f, _ in keyed(tap, receiver)) + ahead  # a little ahead of the honest one
    keys = dict(sender_incarnation=bytes.fromhex(sender.incarnation),
                receiver_incarnation=bytes.fromhex(receiver.incarnation))
    hello = {"kind": "state", "address": receiver.address, "topics": ["x"], "heard": []}
    with raw_sender(receiver.listen_address) as raw:  # the forger's own connection, past the tap
        raw.send(seal(SECRET, CONTROL_TOPIC, 1 << 20, "sender", encode(hello), counter=counter,
                      sender_incarnation=keys["sender_incarnation"]))  # a hello: answered, binds and moves nothing
        raw.send(seal(SECRET, "x", 1 << 20, "sender", encode("forged"), counter=counter, **keys))
        raw.send(forged_state(sender, receiver, seq=1 << 20, counter=counter + 1))
        raw.send(seal(SECRET, CONTROL_TOPIC, 1 << 20, "sender", encode({"kind": "bye"}), counter=counter + 2, **keys))
        eventually(lambda: receiver.stats()["rejected_foreign_pipe"] == 3, "the three forged messages refused")
    assert sender.publish("x", "honest") == 1 and got.get(timeout=WAIT) == "honest"
    stats = receiver.stats()
    assert stats["peers_lost"] == 0 and stats["peers"] == ["sender"] and stats["rejected_foreign_pipe"] == 3


def test_a_new_incarnation_announced_in_a_live_nodes_name_through_another_connection_is_refused(make_router,
                                                                                                caplog):
    caplog.set_level(logging.WARNING, logger="conveyor.engine.parallel.router")
    receiver, sender, got = pair(make_router)
    with raw_sender(receiver.address) as raw:
        raw.send(forged_state(sender, receiver, incarnation=new_incarnation(), counter=0))
        eventually(lambda: receiver.stats()["rejected_impersonation"] == 1, "the made-up incarnation refused")
    assert sender.publish("x", "honest") == 1 and got.get(timeout=WAIT) == "honest"
    stats = receiver.stats()
    assert stats["peers_lost"] == 0 and stats["peers"] == ["sender"]
    assert any("announced in its name" in r.getMessage() for r in caplog.records)


def test_a_recorded_message_replayed_on_a_new_connection_does_not_make_it_a_peers(tapped):
    receiver, sender, got, tap = tapped(auth_timeout_s=1.0)
    assert sender.publish("x", "once") == 1 and got.get(timeout=WAIT) == "once"
    recorded = keyed(tap, receiver)[-1][1]
    closed = receiver.stats()["rejected_connections"]
    with raw_sender(receiver.listen_address) as raw:
        raw.send(recorded)
        eventually(lambda: receiver.stats()["rejected_connections"] > closed, "its connection closed as a stranger's")
    stats = receiver.stats()
    assert stats["rejected_foreign_pipe"] == 1 and stats["peers_lost"] == 0
    assert sender.publish("x", "after") == 1 and got.get(timeout=WAIT) == "after"


def test_a_peer_whose_connection_broke_is_heard_through_its_new_one(tapped):
    receiver, sender, got, tap = tapped()
    tap.reconnect(lambda: receiver.stats()["connections"] == 0)
    assert sender.publish("x", "after") == 1 and got.get(timeout=WAIT) == "after"
    stats = receiver.stats()
    assert stats["peers_lost"] == 0 and stats["rejected_foreign_pipe"] == 0 and stats["connections"] == 1


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


def test_a_link_counter_near_two_to_the_64_does_not_cut_its_incarnation_off(make_router, caplog):
    caplog.set_level(logging.WARNING, logger="conveyor.engine.parallel.router")
    receiver = make_router("receiver")
    got = queue.Queue()
    receiver.on("x", got.put)
    state = {"kind": "state", "address": receiver.address, "topics": [], "heard": []}
    with raw_sender(receiver.address) as raw:  # its own connection: what reaches its window
        sealed = join_as(raw, receiver)
        raw.send(sealed("x", 1 << 20, "far", counter=2 ** 64 - 1))
        raw.send(sealed(CONTROL_TOPIC, 1, state, counter=2 ** 64 - 2))
        raw.send(sealed("x", 0, "next"))  # its own next counter: still new
        assert got.get(timeout=WAIT) == "next"
    assert got.empty() and receiver.stats()["malformed"] == 2
    assert any("numbered far past" in r.getMessage() for r in caplog.records)


def test_a_state_number_near_two_to_the_64_does_not_silence_its_incarnation(make_router):
    receiver = make_router("receiver")
    state = {"kind": "state", "address": receiver.address, "topics": [], "heard": []}
    with raw_sender(receiver.address) as raw:
        sealed = join_as(raw, receiver)
        raw.send(sealed(CONTROL_TOPIC, 2 ** 64 - 1, state))
        raw.send(sealed(CONTROL_TOPIC, 1, {"kind": "bye"}))  # its next state number: taken, so it leaves
        eventually(lambda: receiver.peers() == [], "its goodbye taken")
    assert receiver.stats()["malformed"] == 1 and receiver.stats()["peers_lost"] == 1


def test_node_ids_are_bounded_and_a_live_peer_is_never_forgotten_for_a_new_one(make_router, monkeypatch):
    monkeypatch.setattr(peers_module, "MAX_PEERS", 4)
    receiver, sender, got = pair(make_router)
    injector = make_router("injector", peers=[receiver.address])
    injector.wait_for_subscribers("x", 1, WAIT)
    state = {"kind": "state", "address": receiver.address, "topics": [], "heard": []}

    def ghost(name):
        return seal(SECRET, CONTROL_TOPIC, 0, name, encode(state), counter=0, sender_incarnation=new_incarnation(),
                    receiver_incarnation=bytes.fromhex(receiver.incarnation))
    with raw_sender(receiver.address) as raw:
        for i in range(10):
            raw.send(ghost(f"ghost {i}"))
        eventually(lambda: receiver.stats()["rejected_peers"] == 8, "the ghosts beyond the bound refused")
        assert sorted(receiver.peers()) == ["ghost 0", "ghost 1", "injector", "sender"]
        eventually(lambda: sorted(receiver.peers()) == ["injector", "sender"], "the ghosts silent, so dead")
    with raw_sender(receiver.address) as raw:  # a new connection: the dead ghosts' was closed with them
        raw.send(ghost("late"))
        eventually(lambda: "late" in receiver.peers(), "a new id taken in a dead one's room")
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
