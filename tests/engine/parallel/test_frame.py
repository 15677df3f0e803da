"""Sealed frames: what an authentic message carries, and every way a bad one is refused before decoding."""
import math
import os
import secrets

import numpy as np
import pynng
import pytest

from conveyor.engine.parallel import (AuthError, OversizeError, RejectedMessage, SecretError, decode, encode,
                                      generate_secret, load_secret, open_frame, seal)
from conveyor.engine.parallel import frame as frame_module
from conveyor.engine.parallel.frame import (HELLO, MIN_SECRET_BITS, MIN_SECRET_DISTINCT, ReplayError,
                                            check_secret_strength, new_incarnation)
from tests.engine.parallel._bomb import Bomb

SECRET = b"k" * 32
FILE_SECRET = "eb70d51b4816e77666c9785419aec972050f7f15ccc832e36d90a4f82c2d631a"  # as token_hex(32) makes them
ENV_SECRET = "b32f8691d6d1e783cb0c7cc35fe239b28745ae528d9a5b4fa60f017095497467"
LIMIT = 1 << 20


def sealed(payload=None, **kw):
    return seal(SECRET, "trajectory", 41, "collector-1", encode({"x": np.arange(10)} if payload is None else payload, **kw))


def receive(data, secret=SECRET, max_size=LIMIT, allow_pickle=False):
    """What a router does with a message: open it, then decode its payload."""
    f = open_frame(secret, data, max_size)
    return f, decode(f.payload, allow_pickle=allow_pickle)


def test_an_authentic_frame_gives_back_topic_seq_sender_and_payload():
    f, value = receive(sealed({"obs": np.ones((2, 3), np.float32), "step": 7}))
    assert (f.topic, f.seq, f.sender) == ("trajectory", 41, "collector-1")
    assert value["step"] == 7 and value["obs"].tolist() == [[1, 1, 1]] * 2


def test_payload_frames_start_aligned_to_16_bytes_in_the_message():
    data = bytearray(sealed({"a": np.arange(3, dtype=np.int8), "b": np.arange(5.0)}))
    f = open_frame(SECRET, data, LIMIT)
    base = np.frombuffer(data, np.uint8).ctypes.data
    assert [np.frombuffer(p, np.uint8).ctypes.data % 16 == base % 16 for p in f.payload[1:]] == [True, True]


def test_unicode_topic_and_sender_and_empty_payload_survive():
    f = open_frame(SECRET, seal(SECRET, "tøpic/ü", 2 ** 64 - 1, "nœud", []), LIMIT)
    assert (f.topic, f.seq, f.sender, f.payload) == ("tøpic/ü", 2 ** 64 - 1, "nœud", [])


def test_every_kind_of_payload_buffer_comes_back_as_its_bytes():
    parts = [b"abc", bytearray(b"de" * 9), memoryview(np.arange(6, dtype=np.int32).reshape(2, 3)),
             np.arange(5.0), memoryview(b"x" * 16), b""]
    f = open_frame(SECRET, seal(SECRET, "t", 1, "n", parts), LIMIT)
    assert [bytes(p) for p in f.payload] == [bytes(memoryview(p).cast("B")) for p in parts]


def test_a_non_contiguous_payload_buffer_is_refused_when_packing():
    with pytest.raises(TypeError):
        seal(SECRET, "t", 1, "n", [memoryview(np.arange(8))[::2]])


def flipped(data, index):
    out = bytearray(data)
    out[index] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize("where", ["magic", "seq", "topic", "frame_lengths", "payload_header", "payload_array",
                                   "tag_first", "tag_last"])
def test_a_single_flipped_bit_anywhere_is_an_auth_error(where):
    data = sealed()
    header_end = 4 + 8 + 2 + 2 + 4
    index = {"magic": 0, "seq": 4, "topic": header_end, "frame_lengths": header_end + len("trajectory") + len("collector-1"),
             "payload_header": 80, "payload_array": len(data) - 40, "tag_first": len(data) - 32, "tag_last": -1}[where]
    with pytest.raises(AuthError):
        receive(flipped(data, index))


def test_a_wrong_secret_is_an_auth_error():
    with pytest.raises(AuthError):
        receive(sealed(), secret=b"x" * 32)


@pytest.mark.parametrize("keep", [0, 1, 20, 51, 52, -1, -32, -33])
def test_a_truncated_frame_is_an_auth_error(keep):
    data = sealed()
    with pytest.raises(AuthError):
        receive(data[:keep])


def test_an_extended_frame_is_an_auth_error():
    with pytest.raises(AuthError):
        receive(sealed() + b"\x00")


def test_a_forged_pickle_payload_is_refused_before_it_is_unpickled():
    Bomb.exploded.clear()
    forged = flipped(seal(b"attacker" * 4, "trajectory", 1, "x", encode(Bomb(), allow_pickle=True)), 0) 
    with pytest.raises(AuthError):
        receive(forged, allow_pickle=True)
    assert Bomb.exploded == []


def test_an_oversize_frame_is_refused_before_its_tag_is_computed_or_anything_decoded(monkeypatch):
    Bomb.exploded.clear()
    data = seal(SECRET, "t", 1, "s", encode({"bomb": Bomb(), "pad": np.zeros(4096)}, allow_pickle=True))

    def no_key(*args, **kwargs):
        raise AssertionError("tag computed for an oversize message")

    monkeypatch.setattr(frame_module, "_link_key", no_key)
    with pytest.raises(OversizeError):
        receive(data, max_size=len(data) - 1, allow_pickle=True)
    assert Bomb.exploded == []


def test_a_frame_at_exactly_max_size_is_accepted():
    data = sealed()
    assert open_frame(SECRET, data, len(data)).seq == 41


def test_the_sender_can_check_the_size_limit_itself():
    with pytest.raises(OversizeError, match="over the limit of 100"):
        seal(SECRET, "t", 1, "s", encode(np.zeros(100)), max_size=100)


def test_both_refusals_are_rejected_messages_for_the_router_to_count():
    assert issubclass(AuthError, RejectedMessage) and issubclass(OversizeError, RejectedMessage)


def test_a_message_opens_only_at_the_receiver_incarnation_it_was_sealed_for():
    a, b, b_restarted = new_incarnation(), new_incarnation(), new_incarnation()
    data = seal(SECRET, "t", 1, "s", encode("hi"), sender_incarnation=a, receiver_incarnation=b, counter=7)
    f = open_frame(SECRET, data, LIMIT, b)
    assert (f.sender_incarnation, f.receiver_incarnation, f.counter) == (a, b, 7)
    with pytest.raises(ReplayError, match="another run or before a restart"):
        open_frame(SECRET, data, LIMIT, b_restarted)
    assert issubclass(ReplayError, RejectedMessage)


def test_a_hello_opens_at_any_incarnation_and_says_it_is_one():
    f = open_frame(SECRET, sealed(), LIMIT, new_incarnation())
    assert f.receiver_incarnation == HELLO


def test_the_incarnations_are_part_of_the_key_not_just_of_the_header():
    a, b = new_incarnation(), new_incarnation()
    data = bytearray(seal(SECRET, "t", 1, "s", encode("hi"), sender_incarnation=a, receiver_incarnation=b))
    data[4:20] = new_incarnation()  # claim another sender incarnation: the tag no longer matches
    with pytest.raises(AuthError):
        open_frame(SECRET, bytes(data), LIMIT, b)


def test_a_short_or_non_bytes_secret_is_refused_when_sealing():
    with pytest.raises(SecretError):
        seal(b"short", "t", 1, "s", [])
    with pytest.raises(TypeError):
        seal("k" * 32, "t", 1, "s", [])


def test_sealed_messages_travel_over_a_pynng_pair_socket(tmp_path):
    address = f"ipc://{tmp_path}/pair.ipc"
    with pynng.Pair0(listen=address, recv_timeout=5000) as rx, pynng.Pair0(dial=address, send_timeout=5000) as tx:
        tx.send(sealed({"obs": np.arange(6.0).reshape(2, 3)}))
        f, value = receive(rx.recv())
    assert f.sender == "collector-1" and value["obs"][1, 2] == 5.0 and value["obs"].flags.writeable


# ---- secrets -------------------------------------------------------------------------------------------------

def private_file(path, text):
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_secret_file_others_may_read_is_refused_with_the_chmod_fix(tmp_path, mode):
    path = private_file(tmp_path / "secret", FILE_SECRET)
    path.chmod(mode)
    with pytest.raises(SecretError) as e:
        load_secret(path)
    assert f"chmod 600 {path}" in str(e.value) and f"{mode:03o}" in str(e.value) and "\n" not in str(e.value)
    path.chmod(0o400)
    assert load_secret(path) == FILE_SECRET.encode()

def test_load_secret_reads_the_file_and_strips_its_newline(tmp_path):
    path = private_file(tmp_path / "secret", FILE_SECRET + "\n")
    assert load_secret(path, environ={"CONVEYOR_SECRET": ENV_SECRET}) == FILE_SECRET.encode()


def test_load_secret_reads_the_environment_when_no_file_is_given():
    assert load_secret(environ={"CONVEYOR_SECRET": ENV_SECRET[:40]}) == ENV_SECRET[:40].encode()


def test_load_secret_generates_a_fresh_one_when_none_is_configured():
    a, b = load_secret(environ={}), load_secret(environ={})
    assert len(a) == 32 and a != b and len(generate_secret()) == 32


def test_load_secret_without_a_secret_and_without_generating_says_how_to_set_one():
    with pytest.raises(SecretError, match="--secret-file.*CONVEYOR_SECRET"):
        load_secret(environ={}, generate=False)


def test_an_unreadable_secret_file_is_a_one_line_error_naming_it(tmp_path):
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(SecretError) as e:
            load_secret(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_a_secret_file_without_read_permission_is_a_one_line_error(tmp_path):
    path = tmp_path / "secret"
    path.write_text(FILE_SECRET)
    path.chmod(0)
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(path)


def test_a_too_short_secret_is_a_one_line_error_with_the_fix(tmp_path):
    path = private_file(tmp_path / "secret", "hunter2\n")
    with pytest.raises(SecretError) as e:
        load_secret(path)
    assert "7 bytes" in str(e.value) and "token_hex" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SecretError, match="CONVEYOR_SECRET holds 3 bytes"):
        load_secret(environ={"CONVEYOR_SECRET": "abc"})


@pytest.mark.parametrize("weak", ["a" * 32, "ab" * 32, "0123" * 16, "password" * 4])
def test_a_low_entropy_secret_is_refused_with_the_command_that_makes_a_good_one(tmp_path, weak):
    path = private_file(tmp_path / "secret", weak)
    for load in (lambda: load_secret(path), lambda: load_secret(environ={"CONVEYOR_SECRET": weak})):
        with pytest.raises(SecretError) as e:
            load()
        message = str(e.value)
        assert "too easy to guess" in message and "secrets.token_hex(32)" in message and "\n" not in message


def test_every_secret_the_project_generates_passes_the_entropy_floor_with_a_margin():
    for _ in range(2000):
        for secret in (generate_secret(), secrets.token_hex(32).encode()):
            counts = [secret.count(b) for b in set(secret)]
            bits = -sum(c * math.log2(c / len(secret)) for c in counts)
            assert len(counts) >= MIN_SECRET_DISTINCT + 4 and bits >= MIN_SECRET_BITS * 1.3
            check_secret_strength(secret)
