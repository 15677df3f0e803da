"""Payloads as frames: a small JSON header that describes the value, then the raw bytes of its arrays.

``encode(obj)`` returns ``[header, buf_1, buf_2, ...]``: ``header`` (bytes) is the value's structure in
JSON, each ``buf_i`` a ``memoryview`` straight over an array's memory (a copy is made only for a
non-contiguous array or a tensor that lives on a GPU). ``decode(frames)`` rebuilds the value. There is no
single-bytes form on purpose: :func:`conveyor.engine.parallel.frame.seal` joins the frames into one
authenticated message, and :func:`~conveyor.engine.parallel.frame.open_frame` hands back views of them.

What round-trips, exactly (type, value, dtype, byte order, shape):

- ``None``, ``bool``, ``int`` (any size), ``float`` (NaN, inf and -0.0 too), ``str``, ``bytes``, ``bytearray``;
- ``dict`` (any hashable supported keys, order kept), ``list``, ``tuple``, nested up to 64 deep;
- numpy arrays of every dtype except ``object`` (bool, big-endian, structured, datetime, 0-d, empty,
  non-contiguous, Fortran order kept) and numpy scalars (``np.float32(1)`` comes back as one);
- torch tensors (any dtype, bool and bfloat16 too). What does not travel: the device (a CUDA tensor is
  copied to the CPU and arrives on the CPU), ``requires_grad`` and the autograd graph, the memory format
  (arrives contiguous), the ``Parameter`` subclass (arrives as a plain ``Tensor``). Sparse and quantized
  tensors are refused;
- ``treetensor.torch.Tensor`` trees, nested, with the above as leaves;
- types registered with :meth:`Codec.register`.

Anything else raises a one-line ``TypeError`` naming the type, where it sits (``payload['batch'][3]``) and
the two ways out: register the type, or use :class:`PickleCodec` (arbitrary objects through pickle), which
both ends must choose and which decodes only messages that passed the tag check.

numpy, torch and treetensor are imported only when a value of theirs is decoded (encoding never imports
them: a value of theirs can only exist once they are loaded), so a process that sends plain values loads none.

Decoded arrays and tensors are always writable. They share memory with the frames when those are writable
(``bytearray``, a writable ``memoryview``) and are copied out of read-only frames (``bytes``, as
``pynng``'s ``recv`` returns); ``decode(frames, copy=True)`` always copies.
"""
from __future__ import annotations

import functools
import importlib
import json
import pickle
import sys
from typing import Any, Callable, Dict, List, Tuple, Union

__all__ = ["Codec", "DecodeError", "PickleCodec", "decode", "encode", "register"]

Frame = Union[bytes, bytearray, memoryview]

MAX_DEPTH = 64
MAX_HEADER_BYTES = 4 << 20
"""The largest structure header encoded or decoded: parsing it is the one step whose memory is not bounded
by the payload's own bytes (JSON becomes Python objects), so it is bounded here. Send arrays, not long lists."""
MAX_HEADER_ITEMS = 1 << 17
"""The most containers and items a structure header may hold, counted as its ``[``, ``{`` and ``,`` characters
before it is parsed (brackets inside strings count too: an over-estimate). Without it 4 MiB of ``[],`` parse
into over a million lists (some 100 MiB); with it a header parses into a few MiB at most."""

# Header tags. A JSON object in the header is always one of these single-key nodes; lists are lists and
# JSON scalars are themselves, so a user's dict can never be mistaken for a tag.
_TUPLE, _STR_DICT, _DICT, _BYTES, _BYTEARRAY = "t", "D", "d", "b", "B"
_NDARRAY, _NPSCALAR, _TENSOR, _TREE, _CUSTOM, _PICKLE = "n", "s", "T", "tt", "x", "p"
# built once: json.dumps with options builds an encoder per call. No circular check: the tree is made here.
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)
_JSON_DECODER = json.JSONDecoder()
# json's C encoder made once (JSONEncoder.encode builds it anew for every call); the pure-Python json has none
_c_encode = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, _JSON_ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)


def _to_json(tree: Any) -> str:
    """``tree`` as compact JSON text, as ``_JSON_ENCODER.encode`` writes it, through the prebuilt C encoder."""
    if _c_encode is None:
        return _JSON_ENCODER.encode(tree)
    return "".join(_c_encode(tree, 0))


class DecodeError(ValueError):
    """A payload that cannot be decoded: malformed, or pickled while pickle was not allowed."""


class _Unsupported(Exception):
    """Raised deep inside ``encode``; each level adds its key on the way out so the message names the path."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.what, self.fix = what, fix
        self.path: List[str] = []


class Codec:
    """Encodes values to frames and back; holds the registered types. ``allow_pickle`` opens the fallback.

    The module's :func:`encode`, :func:`decode` and :func:`register` use a shared default ``Codec()``.
    """

    def __init__(self, *, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self._by_type: Dict[type, Tuple[str, Callable[[Any], Any]]] = {}
        self._by_name: Dict[str, Callable[[Any], Any]] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(allow_pickle={self.allow_pickle}, registered={sorted(self._by_name)})"

    def register(self, cls: type, name: str, to_wire: Callable[[Any], Any], from_wire: Callable[[Any], Any]) -> None:
        """Send instances of exactly ``cls`` as ``to_wire(obj)`` (built of supported values); ``from_wire``
        rebuilds them. ``name`` identifies the type on the wire: both ends register the same name."""
        if not isinstance(cls, type):
            raise TypeError(f"register() takes a class first, got {cls!r}")
        if not callable(to_wire) or not callable(from_wire):
            raise TypeError(f"register({cls.__name__}, {name!r}, ...) needs two callables: to_wire and from_wire")
        if name in self._by_name and self._by_type.get(cls, (None,))[0] != name:
            raise ValueError(f"codec name {name!r} is already registered for another type; pick another name")
        self._by_type[cls] = (name, to_wire)
        self._by_name[name] = from_wire

    # ---- encoding -----------------------------------------------------------------------------------------

    def encode(self, obj: Any) -> List[Frame]:
        """``[header, *buffers]`` for ``obj``; ``TypeError`` naming the path of an unsupported value."""
        buffers: List[Frame] = []
        try:
            tree = self._node(obj, buffers, 0)
        except _Unsupported as e:
            where = "payload" + "".join(reversed(e.path))
            raise TypeError(f"cannot encode {e.what} at {where}: {e.fix}").with_traceback(None) from None
        text = _to_json(tree)
        header = text.encode()
        items = _items(text)
        if len(header) > MAX_HEADER_BYTES or items > MAX_HEADER_ITEMS:
            raise TypeError(f"cannot encode a payload whose structure takes {len(header)} bytes and {items} "
                            f"items, over the limit of {MAX_HEADER_BYTES} bytes or {MAX_HEADER_ITEMS} items: send "
                            f"long sequences of numbers as numpy arrays or tensors")
        return [header, *buffers]

    def _node(self, obj: Any, buffers: List[Frame], depth: int) -> Any:
        t = type(obj)
        if obj is None or t is bool or t is int or t is float or t is str:
            return obj
        if depth >= MAX_DEPTH:
            raise _Unsupported(f"a value nested deeper than {MAX_DEPTH} levels", "is there a cycle?")
        depth += 1
        if t is list:
            return self._items(obj, buffers, depth)
        if t is dict:
            if all(type(k) is str for k in obj):
                out, node = {}, self._node
                try:
                    for k, v in obj.items():
                        out[k] = node(v, buffers, depth)
                except _Unsupported as e:
                    e.path.append(f"[{k!r}]")
                    raise
                return {_STR_DICT: out}
            return {_DICT: [[self._child(k, buffers, depth, f".keys()[{i}]"), self._child(v, buffers, depth, f"[{k!r}]")]
                            for i, (k, v) in enumerate(obj.items())]}
        if t is tuple:
            return {_TUPLE: self._items(obj, buffers, depth)}
        if t is bytes or t is bytearray:
            buffers.append(obj)
            return {_BYTES if t is bytes else _BYTEARRAY: len(buffers)}
        if t in self._by_type:
            name, to_wire = self._by_type[t]
            return {_CUSTOM: [name, self._child(to_wire(obj), buffers, depth, "")]}
        np = sys.modules.get("numpy")
        if np is not None and t is np.ndarray and not obj.dtype.hasobject:
            return {_NDARRAY: _array_node(np, obj, buffers)}
        torch, ttorch = sys.modules.get("torch"), sys.modules.get("treetensor.torch")
        if np is not None and isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return {_NPSCALAR: _array_node(np, np.asarray(obj), buffers)}
        if ttorch is not None and t is ttorch.Tensor:
            return {_TREE: {k: self._child(v, buffers, depth, f"[{k!r}]") for k, v in obj.items()}}
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized:
                raise _Unsupported(f"a {obj.layout} {'quantized ' if obj.is_quantized else ''}torch tensor",
                                   "send .to_dense() / .dequantize(), or use PickleCodec")
            return {_TENSOR: _tensor_node(obj, buffers)}
        if self.allow_pickle:
            buffers.append(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            return {_PICKLE: len(buffers)}
        kind = "numpy array of dtype object" if np is not None and t is np.ndarray else f"{t.__module__}.{t.__qualname__}"
        raise _Unsupported(kind, f"register it with conveyor.engine.parallel.codec.register({t.__name__}, name, "
                                 f"to_wire, from_wire), or use PickleCodec (both ends, trusted peers only)")

    def _items(self, seq: Any, buffers: List[Frame], depth: int) -> List[Any]:
        return [self._child(v, buffers, depth, f"[{i}]") for i, v in enumerate(seq)]

    def _child(self, obj: Any, buffers: List[Frame], depth: int, step: str) -> Any:
        try:
            return self._node(obj, buffers, depth)
        except _Unsupported as e:
            e.path.append(step)
            raise

    # ---- decoding -----------------------------------------------------------------------------------------

    def decode(self, frames: List[Frame], *, copy: bool = False) -> Any:
        """The value ``frames`` (from :meth:`encode`) describe. ``copy=True``: arrays never share the frames' memory.

        Bounded for hostile input: a header over :data:`MAX_HEADER_BYTES` or :data:`MAX_HEADER_ITEMS` is refused
        before it is parsed, and
        each buffer may back one value only, so the arrays and bytes decoded never exceed the frames' size.
        """
        if not frames:
            raise DecodeError("no frames to decode: a payload has at least its header frame")
        if len(frames[0]) > MAX_HEADER_BYTES:
            raise DecodeError(f"payload header of {len(frames[0])} bytes is over the limit of {MAX_HEADER_BYTES}")
        header = frames[0]
        tree = _header_tree(bytes(header)) if len(header) <= CACHED_HEADER_BYTES else _parse_header(header)
        try:
            return self._value(tree, _Buffers(frames), copy)
        except DecodeError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError) as e:
            raise DecodeError(f"malformed payload: {type(e).__name__}: {e}") from None

    def _value(self, node: Any, frames: _Buffers, copy: bool) -> Any:
        if type(node) is list:
            return [self._value(v, frames, copy) for v in node]
        if type(node) is not dict:
            return node
        if len(node) != 1:
            raise DecodeError(f"malformed payload: a tag node has {len(node)} keys")
        (tag, body), = node.items()
        if tag == _STR_DICT:
            return {k: self._value(v, frames, copy) for k, v in body.items()}
        if tag == _NDARRAY:
            return _array(body, frames, copy)
        if tag == _TENSOR:
            return _tensor(body, frames, copy)
        if tag == _DICT:
            return {self._value(k, frames, copy): self._value(v, frames, copy) for k, v in body}
        if tag == _TUPLE:
            return tuple(self._value(v, frames, copy) for v in body)
        if tag == _BYTES:
            return bytes(frames.take(body))
        if tag == _BYTEARRAY:
            return bytearray(frames.take(body))
        if tag == _NPSCALAR:
            return _array(body, frames, True)[()]
        if tag == _TREE:
            ttorch = _module("treetensor.torch")
            return ttorch.Tensor(self._tree_dict(body, frames, copy))
        if tag == _CUSTOM:
            name, inner = body
            if name not in self._by_name:
                raise DecodeError(f"payload holds a value of registered type {name!r}, which this end has not "
                                  f"registered: call codec.register(..., {name!r}, ...) here too")
            return self._by_name[name](self._value(inner, frames, copy))
        if tag == _PICKLE:
            if not self.allow_pickle:
                raise DecodeError("payload holds a pickled value and pickle is not allowed here: decode with "
                                  "PickleCodec only for peers you trust")
            return pickle.loads(frames.take(body))
        raise DecodeError(f"malformed payload: unknown tag {tag!r}")

    def _tree_dict(self, body: Dict[str, Any], frames: _Buffers, copy: bool) -> Dict[str, Any]:
        # a sub-tree arrives as a nested tree node; ttorch.Tensor(dict) rebuilds it from plain dicts
        return {k: self._tree_dict(v[_TREE], frames, copy) if type(v) is dict and _TREE in v
                else self._value(v, frames, copy) for k, v in body.items()}


def _parse_header(header: Frame) -> Any:
    """The structure tree of a payload header: checked (UTF-8, :data:`MAX_HEADER_ITEMS`, nothing after the value) and
    parsed. The tree is only read by ``Codec._value``, never changed, so one parse may serve many payloads."""
    try:
        text = str(header, "utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"payload header is not valid JSON: {e}") from None
    items = _items(text)
    if items > MAX_HEADER_ITEMS:
        raise DecodeError(f"payload header holds up to {items} containers and items, over the limit of "
                          f"{MAX_HEADER_ITEMS}")
    try:
        tree, end = _JSON_DECODER.raw_decode(text)  # what encode writes: no whitespace around the value
    except (ValueError, RecursionError) as e:
        raise DecodeError(f"payload header is not valid JSON: {e}") from None
    if end != len(text):
        raise DecodeError(f"payload header is not valid JSON: {len(text) - end} bytes after its value")
    return tree


CACHED_HEADER_BYTES = 2048
"""Headers up to this size are parsed once and their trees kept (the last 64, a few MiB at most whatever peers send):
a stream of payloads of one structure (the same keys, dtypes and shapes each step) repeats one header, and parsing it
cost as much as the rest of decoding a small payload."""
_header_tree = functools.lru_cache(maxsize=64)(_parse_header)


def _items(header: str) -> int:
    """An upper bound on the containers and items a JSON header parses into (see :data:`MAX_HEADER_ITEMS`).
    A header has at most one per character, so one no longer than the limit is not counted."""
    if len(header) <= MAX_HEADER_ITEMS:
        return len(header)
    return header.count("[") + header.count("{") + header.count(",")


class PickleCodec(Codec):
    """A :class:`Codec` that also sends arbitrary objects through pickle. Opt-in on both ends; use it only
    among trusted peers, and decode only what passed :func:`~conveyor.engine.parallel.frame.open_frame`."""

    def __init__(self) -> None:
        super().__init__(allow_pickle=True)


class _Buffers:
    """The frames of one payload being decoded; each buffer can be taken once, so that no message decodes
    into more bytes than it carries (many arrays over one buffer would multiply it)."""

    def __init__(self, frames: List[Frame]) -> None:
        self.frames = frames
        self.taken: set = set()

    def take(self, index: Any) -> memoryview:
        if type(index) is not int or not 1 <= index < len(self.frames):
            raise DecodeError(f"malformed payload: buffer {index!r} does not exist ({len(self.frames) - 1} buffers)")
        if index in self.taken:
            raise DecodeError(f"malformed payload: buffer {index} backs two values")
        self.taken.add(index)
        return memoryview(self.frames[index])


def _module(name: str) -> Any:
    """The module ``name``, from ``sys.modules`` once loaded (``import_module`` costs microseconds per call)."""
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


def _raw(frames: _Buffers, index: Any, nbytes: int) -> memoryview:
    """Buffer ``index`` as a flat byte view, checked to hold ``nbytes``; the caller copies it if it must."""
    view = frames.take(index)
    if view.ndim != 1 or view.format != "B" or not view.c_contiguous:
        view = view.cast("B")
    if view.nbytes != nbytes:
        raise DecodeError(f"malformed payload: buffer {index} has {view.nbytes} bytes, its header says {nbytes}")
    return view


def _array_node(np: Any, a: Any, buffers: List[Frame]) -> List[Any]:
    flags = a.flags
    if flags.c_contiguous:  # the common case: its bytes as they lie, in one call instead of four
        try:
            buffers.append(memoryview(a).cast("B"))
            return [_descr(a.dtype), list(a.shape), "C", len(buffers)]
        except (TypeError, ValueError):  # a dtype the buffer protocol does not carry (datetime): as below
            pass
    order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
    flat = (a.T if order == "F" else a if flags.c_contiguous else np.ascontiguousarray(a)).reshape(-1)
    buffers.append(memoryview(flat.view(np.uint8)) if flat.dtype.itemsize else b"")
    return [_descr(a.dtype), list(a.shape), order, len(buffers)]


def _array(body: List[Any], frames: _Buffers, copy: bool) -> Any:
    np = _module("numpy")
    descr, shape, order, index = body
    dtype = _dtype(descr) if type(descr) is str else np.lib.format.descr_to_dtype(_tuples(descr))
    if dtype.hasobject:
        raise DecodeError("malformed payload: an array of dtype object cannot come without pickle")
    count = _element_count(shape, "array")
    view = _raw(frames, index, count * dtype.itemsize)
    if not count or not dtype.itemsize:
        flat = np.empty(count, dtype)
    else:  # numpy copies with the GIL released: the thread that receives the next batch runs meanwhile
        flat = np.frombuffer(view, dtype=dtype, count=count)
        if copy or view.readonly:
            flat = flat.copy()
    return flat.reshape(shape[::-1]).T if order == "F" else flat.reshape(shape)


def _element_count(shape: Any, what: str) -> int:
    """The number of elements of a received shape, refusing anything but non-negative ints."""
    count = 1
    for n in shape:
        if type(n) is not int or n < 0:
            raise DecodeError(f"malformed payload: bad {what} shape {shape!r}")
        count *= n
    return count


@functools.lru_cache(maxsize=256)
def _descr(dtype: Any) -> Any:
    return _module("numpy").lib.format.dtype_to_descr(dtype)


@functools.lru_cache(maxsize=256)
def _dtype(descr: str) -> Any:
    return _module("numpy").lib.format.descr_to_dtype(descr)


def _tuples(descr: Any) -> Any:
    """JSON turned the tuples of a structured dtype's descr into lists; numpy wants them back."""
    if type(descr) is list:
        return [tuple(_tuples(x) if type(x) is list and i == 1 else (tuple(x) if type(x) is list else x)
                      for i, x in enumerate(field)) for field in descr]
    return descr


def _tensor_node(t: Any, buffers: List[Frame]) -> List[Any]:
    t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    import torch  # loaded already: t is one of its tensors
    buffers.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    return [str(t.dtype).removeprefix("torch."), list(t.shape), len(buffers)]


def _tensor(body: List[Any], frames: _Buffers, copy: bool) -> Any:
    torch = _module("torch")
    name, shape, index = body
    dtype = getattr(torch, name, None) if type(name) is str else None
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(f"malformed payload: {name!r} is not a torch dtype")
    count = _element_count(shape, "tensor")
    raw = _raw(frames, index, count * dtype.itemsize)
    raw = bytearray(raw) if copy or raw.readonly else raw
    if not count:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


_default = Codec()


def encode(obj: Any, *, allow_pickle: bool = False) -> List[Frame]:
    """``[header, *buffers]`` for ``obj`` with the default codec; ``allow_pickle`` as :class:`PickleCodec`."""
    return (_pickling if allow_pickle else _default).encode(obj)


def decode(frames: List[Frame], *, allow_pickle: bool = False, copy: bool = False) -> Any:
    """The value of ``frames`` with the default codec; pickled parts only with ``allow_pickle=True``."""
    return (_pickling if allow_pickle else _default).decode(frames, copy=copy)


def register(cls: type, name: str, to_wire: Callable[[Any], Any], from_wire: Callable[[Any], Any]) -> None:
    """Register ``cls`` with the default codec (and its pickling twin); see :meth:`Codec.register`."""
    _default.register(cls, name, to_wire, from_wire)
    _pickling.register(cls, name, to_wire, from_wire)


_pickling = PickleCodec()
