"""The payload codec: what round-trips exactly, what is refused and how, and when memory is shared."""
import math
import pickle
import tracemalloc

import numpy as np
import pytest
import torch
import treetensor.torch as ttorch

from conveyor.engine.parallel import Codec, DecodeError, PickleCodec, decode, encode
from conveyor.engine.parallel.codec import MAX_HEADER_BYTES, MAX_HEADER_ITEMS
from tests.engine.parallel._bomb import Bomb


def roundtrip(obj, **kw):
    return decode(encode(obj, **kw), **kw)


def assert_same(a, b):
    """Equal in type, value, dtype, byte order, shape and layout, recursively (NaN equals NaN)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.dtype.str == b.dtype.str and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif isinstance(a, ttorch.Tensor):
        assert sorted(a.keys()) == sorted(b.keys())  # a tree's key order is not part of its value
        for k in a.keys():
            assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and b.device.type == "cpu"
        assert torch.equal(a.cpu(), b) or (a.numel() and torch.equal(a.isnan(), b.isnan()))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


PLAIN = [None, True, False, 0, -1, 2 ** 100, 1.5, -0.0, float("inf"), float("nan"), "", "héllo \ud800", b"", b"\x00\xff",
         bytearray(b"ab"), [], (), {}, [1, [2, (3, {"a": None})]], (1,), {"a": 1, "b": [1.0, "x"]},
         {1: "int key", (2, "t"): "tuple key", None: 0, "s": "str key"}, {"D": 1, "t": [2]}]


@pytest.mark.parametrize("obj", PLAIN, ids=repr)
def test_plain_python_values_round_trip_exactly(obj):
    assert_same(obj, roundtrip(obj))


ARRAYS = {
    "float32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "bool": np.array([True, False, True]),
    "big_endian_f8": np.arange(5, dtype=">f8"),
    "big_endian_i4": np.arange(5, dtype=">i4"),
    "zero_d": np.array(3.5),
    "empty": np.zeros((0, 3), np.int16),
    "empty_zero_d_dims": np.zeros((2, 0, 4)),
    "complex": np.array([1 + 2j, -3j], np.complex64),
    "non_contiguous": np.arange(40, dtype=np.int64).reshape(5, 8)[::2, 1::3],
    "fortran": np.asfortranarray(np.arange(6, dtype=np.uint8).reshape(2, 3)),
    "negative_strides": np.arange(10)[::-1],
    "structured": np.zeros(2, dtype=[("a", "<f4"), ("b", ">i8", (2,)), ("c", [("q", "u1")])]),
    "datetime": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]"),
    "unicode": np.array(["ab", "ĉd"]),
    "float16": np.linspace(0, 1, 7, dtype=np.float16),
}


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_numpy_arrays_round_trip_exactly(name):
    a = ARRAYS[name]
    b = roundtrip(a)
    assert_same(a, b)
    assert b.flags.writeable


def test_fortran_order_is_kept():
    assert roundtrip(ARRAYS["fortran"]).flags.f_contiguous


@pytest.mark.parametrize("scalar", [np.float32(1.25), np.int8(-3), np.bool_(True), np.float64("nan"), np.uint64(2 ** 63)],
                         ids=repr)
def test_numpy_scalars_come_back_as_numpy_scalars(scalar):
    assert_same(scalar, roundtrip(scalar))


TENSORS = {
    "float": torch.randn(3, 4),
    "bool": torch.tensor([True, False]),
    "bfloat16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "int64": torch.arange(6),
    "uint8": torch.arange(6, dtype=torch.uint8),
    "zero_d": torch.tensor(7.0),
    "empty": torch.empty(0, 5),
    "complex": torch.tensor([1 + 1j]),
    "non_contiguous": torch.arange(24.0).reshape(4, 6).T[1:, ::2],
    "conjugated": torch.tensor([1 + 2j]).conj(),
}


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_torch_tensors_round_trip_exactly(name):
    assert_same(TENSORS[name].resolve_conj(), roundtrip(TENSORS[name]))


def test_tensors_arrive_without_grad_and_parameters_as_plain_tensors():
    p = torch.nn.Parameter(torch.ones(3))
    out = roundtrip({"w": p, "y": p * 2})
    assert type(out["w"]) is torch.Tensor and not out["w"].requires_grad and not out["y"].requires_grad
    assert torch.equal(out["y"], torch.full((3,), 2.0))


@pytest.mark.cuda
def test_cuda_tensors_arrive_on_the_cpu():
    assert_same(torch.arange(4.0), roundtrip(torch.arange(4.0, device="cuda")))


def test_nested_treetensor_trees_round_trip_exactly():
    tree = ttorch.Tensor({"obs": torch.randn(4, 3), "done": torch.tensor([True, False, False, True]),
                          "next": {"obs": torch.randn(4, 3), "deep": {"n": torch.arange(4, dtype=torch.int32)}}})
    out = roundtrip({"batch": tree, "meta": [tree.next]})
    assert_same(tree, out["batch"])
    assert type(out["batch"].next.deep) is ttorch.Tensor
    assert_same(tree.next, out["meta"][0])


def test_a_mixed_payload_round_trips():
    payload = {"episode": [{"obs": np.ones((2, 4), np.float32), "reward": 1.0, "info": {"ok": True}}],
               "weights": {"fc.weight": torch.randn(2, 2), "fc.bias": torch.zeros(2)}, "version": (3, "v")}
    assert_same(payload, roundtrip(payload))


def test_payloads_of_one_structure_decode_to_their_own_values_each_time():
    first = {"obs": np.arange(4.0), "info": {"ids": [1, 2]}, "pair": (1, "a")}
    second = {"obs": np.arange(4.0) + 10, "info": {"ids": [1, 2]}, "pair": (1, "a")}
    frames = encode(first), encode(second)
    assert bytes(frames[0][0]) == bytes(frames[1][0])  # one header: parsed once
    got = decode(frames[0])
    got["info"]["ids"].append(3)  # changing what one decode returned changes nothing the next one returns
    got["info"]["new"] = True
    again, other = decode(frames[0]), decode(frames[1])
    assert again["info"] == {"ids": [1, 2]} and again["pair"] == (1, "a")
    np.testing.assert_array_equal(again["obs"], first["obs"])
    np.testing.assert_array_equal(other["obs"], second["obs"])


def test_contiguous_arrays_are_sent_without_copying():
    a = np.arange(1000, dtype=np.float64)
    t = torch.arange(1000, dtype=torch.float32)
    header, fa, ft = encode([a, t])
    assert np.shares_memory(np.asarray(fa), a)
    assert np.shares_memory(np.asarray(ft), t.numpy())
    assert b"1000" in header and len(header) < 200


def test_arrays_decode_in_place_from_writable_frames_and_copied_from_read_only_ones():
    frames = encode({"a": np.arange(4, dtype=np.int32), "t": torch.arange(4, dtype=torch.int32)})
    writable = [frames[0]] + [bytearray(f) for f in frames[1:]]
    shared = decode(writable)
    writable[1][0] = 99
    writable[2][0] = 77
    assert shared["a"][0] == 99 and shared["t"][0] == 77
    readonly = [frames[0]] + [bytes(f) for f in frames[1:]]
    out = decode(readonly)
    out["a"][0] = 5  # writable, and not the frame's memory
    out["t"][0] = 5
    assert readonly[1][0] == 0 and readonly[2][0] == 0
    copied = decode(writable, copy=True)
    writable[1][0] = 1
    assert copied["a"][0] == 99


def test_an_unknown_type_is_a_one_line_type_error_naming_the_type_the_path_and_the_fix():
    class Odd:
        pass

    with pytest.raises(TypeError) as e:
        encode({"payload": 1, "batch": [0, 1, 2, Odd()]})
    msg = str(e.value)
    assert "\n" not in msg
    assert "Odd" in msg and "payload['batch'][3]" in msg and "register" in msg and "PickleCodec" in msg


def test_object_arrays_and_sparse_tensors_are_refused_with_their_path():
    with pytest.raises(TypeError, match=r"dtype object at payload\['x'\]"):
        encode({"x": np.array([{}, 1], dtype=object)})
    with pytest.raises(TypeError, match=r"sparse.*payload\[0\]"):
        encode([torch.eye(2).to_sparse()])


def test_subclasses_of_builtins_are_refused_rather_than_silently_changed():
    from collections import OrderedDict, namedtuple
    with pytest.raises(TypeError, match="OrderedDict"):
        encode(OrderedDict(a=1))
    with pytest.raises(TypeError, match="Point"):
        encode(namedtuple("Point", "x y")(1, 2))


def test_a_cycle_is_refused_not_a_recursion_error():
    loop = []
    loop.append(loop)
    with pytest.raises(TypeError, match="nested deeper"):
        encode(loop)


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y


def test_a_registered_type_round_trips_and_an_unregistered_name_is_a_clear_decode_error():
    sender, receiver = Codec(), Codec()
    sender.register(Point, "test.point", lambda p: (p.x, p.y), lambda xy: Point(*xy))
    receiver.register(Point, "test.point", lambda p: (p.x, p.y), lambda xy: Point(*xy))
    p = receiver.decode(sender.encode({"p": Point(1, np.arange(2))}))["p"]
    assert type(p) is Point and p.x == 1 and p.y.tolist() == [0, 1]
    with pytest.raises(DecodeError, match="test.point"):
        Codec().decode(sender.encode(Point(1, 2)))


def test_pickle_is_used_only_when_both_ends_opt_in():
    with pytest.raises(TypeError):
        encode({"x": Bomb()})
    frames = encode({"x": Bomb()}, allow_pickle=True)
    Bomb.exploded.clear()
    with pytest.raises(DecodeError, match="pickle is not allowed"):
        decode(frames)
    assert Bomb.exploded == []
    decode(frames, allow_pickle=True)
    assert Bomb.exploded == ["boom"]


def test_pickle_codec_sends_arbitrary_objects_and_still_sends_arrays_raw():
    codec = PickleCodec()
    value = {"point": Point(1, 2), "a": np.arange(3)}
    frames = codec.encode(value)
    assert np.shares_memory(np.asarray(frames[2]).view(np.int64), value["a"])
    out = codec.decode(frames)
    assert out["point"].y == 2 and out["a"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("frames", [[], [b"{not json"], [b'{"n":["<f4",[4],"C",1]}', b"\x00" * 3],
                                    [b'{"n":["|O",[1],"C",1]}', b"\x00" * 8], [b'{"T":["load",[1],1]}', b"\x00"],
                                    [b'{"b":5}'], [b'{"zz":1}'], [b'{"a":1,"b":2}']],
                         ids=["none", "bad_json", "short_buffer", "object_dtype", "not_a_dtype", "no_buffer",
                              "unknown_tag", "two_keys"])
def test_malformed_payloads_raise_decode_error(frames):
    with pytest.raises(DecodeError):
        decode(frames)


def test_pickle_data_never_reaches_the_default_codec_even_if_tagged_by_hand():
    frames = [b'{"p":1}', pickle.dumps(Bomb())]
    Bomb.exploded.clear()
    with pytest.raises(DecodeError):
        decode(frames)
    assert Bomb.exploded == []


@pytest.mark.parametrize("unit", [b"[],", b"{},", b"0,"])
def test_a_header_of_a_million_small_items_is_refused_before_it_is_parsed(unit):
    header = b"[" + unit * ((MAX_HEADER_BYTES - 8) // len(unit)) + b"[]]"
    assert len(header) <= MAX_HEADER_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match="containers and items"):
            decode([header])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_HEADER_BYTES  # the header's text, not a Python object per item


def test_long_honest_structures_still_decode_and_longer_ones_are_refused_when_encoded():
    value = {"ids": list(range(MAX_HEADER_ITEMS // 2)), "rows": [{"a": [1.5, "x"]}] * 1000}
    assert decode(encode(value)) == value
    with pytest.raises(TypeError, match="numpy arrays or tensors"):
        encode([[]] * MAX_HEADER_ITEMS)


def test_the_header_is_the_compact_json_of_the_structure_whatever_the_value():
    value = {"é": [1, -0.0, float("inf"), float("nan"), "\u2603\n\"", None, True], "n": np.arange(3), "t": (b"x",)}
    header = bytes(encode(value)[0])
    reference = b'{"D":{"\\u00e9":[1,-0.0,Infinity,NaN,"\\u2603\\n\\"",null,true],"n":{"n":["<i8",[3],"C",1]},' \
                b'"t":{"t":[{"b":2}]}}}'
    assert header == reference
    assert_same(roundtrip(value)["é"][:3], value["é"][:3])


@pytest.mark.parametrize("header", [b'{"D":{}} ', b' {"D":{}}', b'{"D":{}}{"D":{}}', b'{"D":{}}\x00'],
                         ids=["trailing_space", "leading_space", "two_values", "trailing_nul"])
def test_a_header_with_anything_around_its_value_is_a_decode_error(header):
    assert decode([b'{"D":{}}']) == {}
    with pytest.raises(DecodeError, match="not valid JSON"):
        decode([header])


@pytest.mark.parametrize("frame", [lambda b: memoryview(np.frombuffer(b, np.float32)),
                                   lambda b: memoryview(bytearray(b)).cast("B", (4, len(b) // 4)),
                                   lambda b: memoryview(bytearray(b + b))[::2]],
                         ids=["float_view", "two_dimensional_view", "strided_view"])
def test_array_buffers_given_as_any_memoryview_decode_or_raise_decode_error(frame):
    a = np.arange(8, dtype=np.float32)
    header, raw = encode({"a": a})
    view = frame(bytes(raw))
    if view.c_contiguous:
        assert_same(decode([header, view])["a"], a)
    else:
        with pytest.raises(DecodeError):
            decode([header, view])
