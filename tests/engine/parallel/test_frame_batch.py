"""Batches: several messages under one header, counter and tag, and every hostile batch header refused as such."""
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.engine.parallel import AuthError, MalformedFrame, decode, encode
from conveyor.engine.parallel.frame import (MAX_BATCH_MESSAGES, VersionError, batch_parts, join, new_incarnation,
                                            open_batch, open_frame, pack, seal, sign)

SECRET = b"k" * 32
LIMIT = 1 << 20
A, B = new_incarnation(), new_incarnation()
LINK = 4 + 16 + 16 + 8  # magic, incarnations, counter: the bytes sign() writes before the batch header


def signed(message, counter=3):
    return bytes(sign(bytearray(message), SECRET, A, B, counter))


def batch_of(*values, sender="collector-1"):
    return join([pack(f"topic-{i}", 10 + i, sender, encode(v)) for i, v in enumerate(values)])


def test_a_joined_batch_gives_back_each_message_in_order_under_one_counter():
    frames = open_batch(SECRET, signed(batch_of({"x": np.arange(3)}, "two", [1, 2.5])), LIMIT, B)
    assert [(f.topic, f.seq, f.sender, f.counter) for f in frames] == [
        ("topic-0", 10, "collector-1", 3), ("topic-1", 11, "collector-1", 3), ("topic-2", 12, "collector-1", 3)]
    values = [decode(f.payload) for f in frames]
    assert values[0]["x"].tolist() == [0, 1, 2] and values[1:] == ["two", [1, 2.5]]


def test_joining_batches_keeps_every_message_and_its_payload_aligned():
    data = bytearray(signed(join([batch_of(np.arange(5, dtype=np.int8)), batch_of(np.arange(7.0), "x")])))
    frames = open_batch(SECRET, data, LIMIT, B)
    base = np.frombuffer(data, np.uint8).ctypes.data
    assert [f.seq for f in frames] == [10, 10, 11]
    assert all((np.frombuffer(p, np.uint8).ctypes.data - base) % 16 == 0 for f in frames for p in f.payload)


def test_a_batch_of_several_is_not_one_message():
    with pytest.raises(MalformedFrame, match="open_batch"):
        open_frame(SECRET, signed(batch_of(1, 2)), LIMIT, B)


def test_join_refuses_messages_of_two_senders_and_too_many_messages():
    with pytest.raises(ValueError, match="one sender"):
        join([pack("t", 1, "a", encode(1)), pack("t", 2, "b", encode(2))])
    with pytest.raises(ValueError, match=f"1 to {MAX_BATCH_MESSAGES}"):
        join([pack("t", i, "a", []) for i in range(MAX_BATCH_MESSAGES + 1)])


def test_a_message_in_the_old_frame_format_is_refused_naming_both_versions():
    old = bytearray(seal(SECRET, "t", 1, "s", encode("hi")))
    old[:4] = b"CNV2"
    with pytest.raises(VersionError, match="CNV2.*CNV3.*same Conveyor version"):
        open_frame(SECRET, bytes(old), LIMIT)
    assert issubclass(VersionError, AuthError)  # counted as a refusal before authentication


def forged_header(n_msgs=None, body_len=None, sender_len=None):
    """An authentic batch (tag made with the secret, as a buggy or hostile peer holding it could) whose header
    says ``n_msgs`` messages and ``body_len`` bytes of them."""
    message = batch_of(1, 2)
    real = struct.unpack_from("<IHHQ", message, LINK)
    struct.pack_into("<IHHQ", message, LINK, real[0] if n_msgs is None else n_msgs,
                     real[1] if sender_len is None else sender_len, 0, real[3] if body_len is None else body_len)
    return signed(message)


@pytest.mark.parametrize("header", [dict(n_msgs=0), dict(n_msgs=MAX_BATCH_MESSAGES + 1), dict(n_msgs=2 ** 32 - 1),
                                    dict(n_msgs=3), dict(n_msgs=1), dict(body_len=2 ** 64 - 1), dict(body_len=16),
                                    dict(sender_len=0xFFFF), dict(n_msgs=40, body_len=40 * 16 - 1)])
def test_a_hostile_batch_header_is_malformed_before_anything_is_allocated_for_it(header):
    data = forged_header(**header)
    tracemalloc.start()
    try:
        with pytest.raises(MalformedFrame):
            open_batch(SECRET, data, LIMIT, B)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10


def test_a_truncated_or_oversized_inner_message_under_a_valid_tag_is_malformed():
    message = batch_of(np.arange(100), "y")
    body_at = len(message) - 16 - struct.unpack_from("<IHHQ", message, LINK)[3]
    struct.pack_into("<I", message, body_at + 12, 2 ** 32 - 1)  # the first message claims 4G frame lengths
    with pytest.raises(MalformedFrame):
        open_batch(SECRET, signed(message), LIMIT, B)
    message = batch_of(np.arange(100), "y")
    struct.pack_into("<Q", message, body_at + 16 + len("topic-0") + 8, 1 << 40)  # its second frame claims 1 TB
    with pytest.raises(MalformedFrame):
        open_batch(SECRET, signed(message), LIMIT, B)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 400), st.binary(min_size=1, max_size=64), st.data())
def test_random_bytes_over_a_valid_header_and_tag_only_ever_raise_malformed(at, junk, data):
    message = bytearray(batch_of({"x": np.arange(20)}, "two", b"three"))
    at = LINK + min(at, len(message) - 16 - LINK - 1)
    end = min(at + len(junk), len(message) - 16)
    message[at:end] = junk[:end - at]
    if data.draw(st.booleans()):
        message = message[:data.draw(st.integers(LINK + 16 + 16, len(message) - 16))] + bytes(16)
    try:
        frames = open_batch(SECRET, signed(message), LIMIT, B)
    except MalformedFrame:
        return
    assert 1 <= len(frames) <= 3 + len(junk)


def test_the_parts_of_a_batch_laid_end_to_end_are_the_joined_batch():
    messages = [pack("a", 1, "s", encode(np.arange(5))), pack("b", 2, "s", encode("x")), pack("c", 3, "s", [])]
    assert b"".join(bytes(p) for p in batch_parts(messages)) == join(messages)
    assert b"".join(bytes(p) for p in batch_parts(messages[:1])) == join(messages[:1])
