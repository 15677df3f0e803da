"""The router's outbox: per-link bounded queues whose sender threads send what piled up as one batch."""
import logging
import queue
import threading

import pytest

from conveyor.engine.parallel.outbox import Outbox
from conveyor.engine.ratelimit import RateLimitedLog

WAIT = 10


class Sender:
    """A ``send`` that records batches per link; a link named in ``hold`` waits for its event on each batch."""

    def __init__(self, hold=(), fail_first=False):
        self.batches = queue.Queue()
        self.hold = {link: threading.Event() for link in hold}
        self.entered = {link: threading.Event() for link in hold}
        self.fail_first = fail_first

    def __call__(self, link, messages):
        if link in self.hold:
            self.entered[link].set()
            assert self.hold[link].wait(WAIT)
        if self.fail_first:
            self.fail_first = False
            raise RuntimeError("a bug in send")
        self.batches.put((link, [bytes(m) for m in messages]))


@pytest.fixture
def make_outbox():
    made = []

    def make(send, **kw):
        kw = {"max_bytes": 1000, "batch_bytes": 100, "timeout_s": WAIT, "idle_s": 0.2, **kw}
        box = Outbox(send, log=RateLimitedLog(logging.getLogger("test_outbox")), name="t", **kw)
        made.append(box)
        return box
    yield make
    for box in made:
        box.close()


def test_a_lone_message_is_sent_at_once_as_a_batch_of_one(make_outbox):
    send = Sender()
    assert make_outbox(send).put("a", bytearray(b"one"))
    assert send.batches.get(timeout=WAIT) == ("a", [b"one"])


def test_messages_queued_while_a_batch_is_sent_go_out_together_in_order(make_outbox):
    send = Sender(hold=["a"])
    box = make_outbox(send)
    box.put("a", bytearray(b"first"))
    assert send.entered["a"].wait(WAIT)
    for i in range(5):
        assert box.put("a", bytearray(b"m%d" % i))
    send.hold["a"].set()
    assert send.batches.get(timeout=WAIT) == ("a", [b"first"])
    assert send.batches.get(timeout=WAIT) == ("a", [b"m0", b"m1", b"m2", b"m3", b"m4"])


def test_a_batch_holds_at_most_batch_bytes_but_always_one_message(make_outbox):
    send = Sender(hold=["a"])
    box = make_outbox(send, batch_bytes=30)
    box.put("a", bytearray(b"x"))
    assert send.entered["a"].wait(WAIT)
    for data in (b"1" * 10, b"2" * 10, b"3" * 10, b"4" * 10, b"5" * 50):
        box.put("a", bytearray(data))
    send.hold["a"].set()
    sizes = [[len(m) for m in send.batches.get(timeout=WAIT)[1]] for _ in range(4)]
    assert sizes == [[1], [10, 10, 10], [10], [50]]


def test_a_full_queue_makes_put_wait_then_refuse_the_message_after_its_timeout(make_outbox):
    send = Sender(hold=["slow"])
    box = make_outbox(send, max_bytes=20, batch_bytes=20, timeout_s=0.2)
    box.put("slow", bytearray(b"x"))
    assert send.entered["slow"].wait(WAIT)
    assert box.put("slow", bytearray(b"y" * 15))
    assert not box.put("slow", bytearray(b"z" * 10))  # 25 bytes would be over 20: waited 0.2 s, refused
    assert box.put("fast", bytearray(b"f"))  # another link is not held up by the slow one
    assert send.batches.get(timeout=WAIT) == ("fast", [b"f"])
    send.hold["slow"].set()
    assert [send.batches.get(timeout=WAIT) for _ in range(2)] == [("slow", [b"x"]), ("slow", [b"y" * 15])]


def test_a_put_waiting_for_room_goes_in_once_the_sender_takes_a_batch(make_outbox):
    send = Sender(hold=["a"])
    box = make_outbox(send, max_bytes=10, batch_bytes=10)
    box.put("a", bytearray(b"x"))
    assert send.entered["a"].wait(WAIT)
    box.put("a", bytearray(b"y" * 10))
    waiting = threading.Thread(target=box.put, args=("a", bytearray(b"z")))
    waiting.start()
    send.hold["a"].set()
    waiting.join(WAIT)
    assert box.flush(WAIT)
    assert [send.batches.get(timeout=WAIT)[1] for _ in range(3)] == [[b"x"], [b"y" * 10], [b"z"]]


def test_flush_returns_once_everything_was_sent_and_close_stops_the_threads(make_outbox):
    send = Sender()
    box = make_outbox(send, idle_s=WAIT)
    before = threading.active_count()
    for i in range(50):
        box.put(i % 3, bytearray(b"%d" % i))
    assert box.flush(WAIT) and box.queued() == 0
    assert sum(len(send.batches.get_nowait()[1]) for _ in range(send.batches.qsize())) == 50
    box.close()
    assert threading.active_count() <= before
    assert not box.put(0, bytearray(b"late"))


def test_a_failing_send_is_logged_and_the_link_keeps_sending(make_outbox, caplog):
    send = Sender(fail_first=True)
    box = make_outbox(send)
    with caplog.at_level(logging.WARNING, "test_outbox"):
        box.put("a", bytearray(b"lost"))
        assert box.flush(WAIT)
        box.put("a", bytearray(b"next"))
        assert send.batches.get(timeout=WAIT) == ("a", [b"next"])
    assert "a bug in send" in caplog.text
