"""``Router.sender``: inside a handler, the authenticated sender of the message it handles; None elsewhere."""
import queue

from tests.engine.parallel._wire import WAIT


def test_a_handler_learns_who_sent_the_message_it_handles(make_router):
    hub = make_router("hub", listen="tcp://127.0.0.1:0")
    a, b = make_router("a", peers=[hub.address]), make_router("b", peers=[hub.address])
    got = queue.Queue()
    hub.on("x", lambda payload: got.put((payload, hub.sender)))
    for peer in (a, b):
        peer.wait_for_subscribers("x", 1, WAIT)
    a.publish("x", "from a, it says")
    b.publish("x", "from a, it says")  # what a payload claims is not who sent it
    assert sorted(got.get(timeout=WAIT) for _ in range(2)) == [("from a, it says", "a"), ("from a, it says", "b")]
    assert hub.sender is None
