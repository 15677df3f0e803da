"""Publishing through the outbox: bursts of small messages go as batches, whole and in order; close sends what is
queued; a slow peer makes publish wait, then drop and count, as a direct send did."""
import queue
import threading

import numpy as np

from conveyor.engine.parallel.router import CONTROL_TOPIC
from tests.engine.parallel._wire import WAIT, eventually, join_as, raw_sender

SMALL = {"obs": list(range(8)), "reward": 1.0}


def test_a_burst_of_small_messages_arrives_whole_and_in_order_in_fewer_sends_than_messages(make_router):
    hub = make_router("hub", listen="tcp://127.0.0.1:0")
    peer = make_router("peer", peers=[hub.address])
    got = queue.Queue()
    peer.on("x", lambda payload: got.put(payload["n"]))
    hub.wait_for_subscribers("x", 1, WAIT)
    for n in range(1000):
        assert hub.publish("x", {**SMALL, "n": n}) == 1
    assert [got.get(timeout=WAIT) for _ in range(1000)] == list(range(1000))
    eventually(lambda: hub.stats()["sent"] == 1000, "the hub counts every message sent")
    assert hub.stats()["sent_batches"] < 1000 and peer.stats()["received"] == 1000
    assert peer.stats()["lost"] == peer.stats()["duplicated"] == peer.stats()["malformed"] == 0


def test_close_sends_what_is_still_queued(make_router):
    hub = make_router("hub", listen="tcp://127.0.0.1:0")
    peer = make_router("peer", peers=[hub.address])
    got = queue.Queue()
    peer.on("x", got.put)
    hub.wait_for_subscribers("x", 1, WAIT)
    for n in range(300):
        hub.publish("x", n)
    hub.close()
    assert [got.get(timeout=WAIT) for _ in range(300)] == list(range(300))


def test_a_slow_peer_makes_publish_wait_then_drop_and_count_and_the_link_recovers(make_router):
    hub = make_router("hub", listen="tcp://127.0.0.1:0", send_timeout_s=0.3, batch_bytes=64 << 10)
    peer = make_router("peer", peers=[hub.address], max_backlog_bytes=16 << 10)
    release, got = threading.Event(), queue.Queue()

    def slow(payload):
        assert release.wait(WAIT)
        got.put(payload[:5])

    peer.on("x", slow)
    hub.wait_for_subscribers("x", 1, WAIT)
    try:
        published = 0
        while published < 4000 and hub.publish("x", b"data " + bytes(8 << 10)) == 1:
            published += 1
        assert published < 4000 and hub.stats()["send_timeouts"] >= 1
    finally:
        release.set()
    eventually(lambda: hub.publish("x", b"after") == 1, "the hub queues again once the peer caught up")
    assert all(item == b"data " for item in iter(lambda: got.get(timeout=WAIT), b"after"))  # then "after" arrives


def test_a_peers_batch_is_delivered_whole_and_one_mixing_in_a_membership_message_is_refused(make_router):
    hub = make_router("hub")
    got = queue.Queue()
    hub.on("x", got.put)
    with raw_sender(hub.address) as raw:
        sealed = join_as(raw, hub)
        raw.send(sealed("x", 0, "a", also=[("x", 1, "b"), ("x", 2, "c")]))
        assert [got.get(timeout=WAIT) for _ in range(3)] == ["a", "b", "c"]
        raw.send(sealed("x", 3, "d", also=[(CONTROL_TOPIC, 99, {"kind": "bye"})]))
        raw.send(sealed(CONTROL_TOPIC, 100, {"kind": "bye"}, also=[("x", 4, "e")]))
        eventually(lambda: hub.stats()["malformed"] == 2, "both mixed batches are counted as malformed")
        raw.send(sealed("x", 5, "f"))
        assert got.get(timeout=WAIT) == "f"  # neither mixed batch was delivered, nor did one say goodbye
    assert hub.stats()["received"] == 4 and "injector" in hub.peers()


def test_one_publish_to_several_peers_reaches_each_whole_and_in_order(make_router):
    hub = make_router("hub", listen="tcp://127.0.0.1:0", max_message_size=8 << 20)
    got = {}
    for name in ("p1", "p2", "p3"):
        peer = make_router(name, peers=[hub.address], max_message_size=8 << 20)
        got[name] = queue.Queue()
        peer.on("x", got[name].put)
    hub.wait_for_subscribers("x", 3, WAIT)
    sent = [{"n": n, "data": np.full((1 << 16) if n % 3 else 4, n, np.float32)} for n in range(60)]
    for payload in sent:
        assert hub.publish("x", payload) == 3
    for name, q in got.items():
        for payload in sent:
            value = q.get(timeout=WAIT)
            assert value["n"] == payload["n"] and np.array_equal(value["data"], payload["data"]), name
