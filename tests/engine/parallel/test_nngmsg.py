"""Outgoing nng messages: written in place, sent without a copy, freed when a send fails."""
import gc

import pynng
import pytest

from conveyor.engine.parallel.nngmsg import GIL_FREE_BYTES, Outgoing
from tests.engine.parallel._wire import WAIT


@pytest.fixture
def pair(tmp_path):
    """A Push0 dialing a Pull0 over ipc, closed at the end of the test."""
    pull = pynng.Pull0(listen=f"ipc://{tmp_path}/in.ipc", recv_timeout=WAIT * 1000)
    push = pynng.Push0(dial=f"ipc://{tmp_path}/in.ipc", send_timeout=WAIT * 1000)
    yield push, pull
    push.close()
    pull.close()


def test_a_message_arrives_as_its_parts_end_to_end_with_what_was_written_into_it_in_place(pair):
    push, pull = pair
    out = Outgoing.join([b"head", bytearray(b"-body-"), memoryview(bytes(range(256))).cast("B")[10:20], b"tail"])
    out.body[:4] = b"HEAD"
    out.send(push)
    assert pull.recv() == b"HEAD-body-" + bytes(range(10, 20)) + b"tail"


def test_a_message_holds_its_size_in_a_writable_body():
    out = Outgoing(1 << 16)
    assert len(out.body) == 1 << 16 and not out.body.readonly
    out.body[-1:] = b"x"


def test_a_message_whose_send_fails_raises_and_is_freed_with_its_object(tmp_path):
    with pynng.Push0() as push:  # no peer: a send that may not wait fails at once
        out = Outgoing.join([b"x" * 100])
        with pytest.raises(pynng.TryAgain):
            out.send(push, block=False)
        del out
        gc.collect()


def test_a_message_can_be_sent_only_once(pair):
    push, pull = pair
    out = Outgoing.join([b"once"])
    out.send(push)
    with pytest.raises(ValueError):  # the body was released: nng owns the message now
        out.body[:1] = b"x"
    with pytest.raises(pynng.MessageStateError):
        out.send(push)
    assert pull.recv() == b"once"


def test_large_and_small_pieces_written_out_of_order_arrive_as_laid_out(pair):
    push, pull = pair
    big = bytes(range(256)) * (GIL_FREE_BYTES // 128)  # copied by nng, with the GIL released
    out = Outgoing(8 + 2 * len(big) + 4)
    assert out.write(8 + len(big), bytearray(big[::-1])) == 8 + 2 * len(big)
    assert out.write(8, memoryview(big)) == 8 + len(big)
    out.write(0, b"12345678")
    out.body[-4:] = b"tail"
    assert bytes(out.body) == b"12345678" + big + big[::-1] + b"tail"
    out.send(push)
    assert pull.recv() == b"12345678" + big + big[::-1] + b"tail"


def test_a_write_past_the_message_is_refused():
    out = Outgoing(16)
    with pytest.raises(ValueError, match="run past"):
        out.write(10, b"x" * 7)
