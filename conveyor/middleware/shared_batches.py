"""Collected batches through shared memory between a collector and a learner on one host (:class:`ContextExchanger`).

Across hosts a batch travels in its router message (nng). On one host its large arrays (an Atari rollout is tens of
MB) go through a shared-memory block, and the message carries only where they are (:class:`SharedArray`):

- Same host, proved: the learner draws a random block prefix ``cvsb_<pid>-<random>.`` and makes a small *probe*
  block, named after it, holding a random nonce; it sends both (:meth:`SharedBatches.offer`) with each
  ``train_iter``, an authenticated message. A collector that maps the probe and finds the nonce in it shares the
  learner's /dev/shm; one on another host (or in another container) finds no such block and keeps sending its arrays
  in the message. The first batch, sent before any ``train_iter``, always goes in its message.
- A collector writes a batch's arrays of :data:`MIN_SHARED_BYTES` or more into one of its blocks, named
  ``<prefix><node id>.<pid>-<n>``. The learner maps only blocks named so for the message's authenticated sender,
  checks every descriptor (block, ticket, offset, dtype, shape) against the block's size before it makes an array,
  copies the arrays out and marks the block free. A descriptor that fails (no such block, one too small, another
  name, a block not holding that batch) drops the batch as a :class:`BadMessage` (counted, logged); the receive
  loop goes on.
- Flow control: a block's header holds its state (free / full) and the ticket of the batch in it. A collector
  writes only into a free block; with all its ``blocks`` full (the learner behind, or a message lost on the way),
  a batch goes in its message. The learner frees a block once it copied the batch out, also when it drops it.
- Lifetime: blocks are made without a resource tracker (one started by a worker would outlive it as an orphan:
  ``create_shared_block(..., track=False)``) and named after their maker's pid, so that
  :func:`~conveyor.processes.remove_stale_blocks` frees those whose maker is gone: the learner those of a collector it
  lost, at its close those of every collector gone, and when it starts those of learners gone (their probes, and
  blocks named after them); a collector, when its learner is lost, the learner's probe. A collector frees its own
  blocks when its learner goes, and at its end once the learner took what is in them; a learner its probe at its end.

The collector and learner must be the same user on one host: a process of that user could also signal the other.
``transport`` ``"nng"`` (the config key, ``--set transport=nng``) turns all this off on the side given it.
"""
from __future__ import annotations

import importlib
import logging
import os
import re
import secrets
import struct
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from conveyor.engine.parallel import codec
from conveyor.engine.ratelimit import RateLimitedLog
from conveyor.middleware.messages import BadMessage
from conveyor.processes import (attach_shared_block, create_shared_block, release_shared_block,
                                remove_stale_blocks)

__all__ = ["BLOCK_FAMILY", "MIN_SHARED_BYTES", "SharedArray", "SharedBatches", "SharedTree"]

log = logging.getLogger("conveyor.middleware.exchanger")

BLOCK_FAMILY = "cvsb_"
"""The start of every block name of this module: ``cvsb_<learner pid>-<random>.`` is a learner's prefix."""
MIN_SHARED_BYTES = 1 << 16
"""Arrays from this size on go through shared memory; smaller ones stay in the message."""
BLOCKS = 4
"""Blocks a collector keeps at most: batches in flight through shared memory."""
CLOSE_WAIT_S = 5.0
"""How long a collector that ends waits for its learner to take the batches still in its blocks before it frees them."""
_HEADER = 64  # state (int64: 0 free, 1 full) and ticket (int64), then padding; arrays start after it
_ALIGN = 64
_ROUND = 1 << 20  # blocks are made in whole MiB, a quarter larger than asked, so that they rarely grow
_NUMPY_KINDS = "biufcmM"
_PREFIX = re.compile(re.escape(BLOCK_FAMILY) + r"\d{1,10}-[0-9a-f]{12}\.")
_NODE = re.compile(r"[0-9A-Za-z_-]{1,64}")


def _module(name: str) -> Any:
    """``numpy``, ``torch`` or ``treetensor.torch``, imported when first needed: the exchangers load none of them."""
    return sys.modules.get(name) or importlib.import_module(name)


class SharedArray:
    """Where one array of a batch is: ``[block, ticket, offset, kind ("n" numpy, "T" torch), dtype, shape]``.
    As received, its fields are unchecked (:meth:`SharedBatches.take` checks them)."""

    def __init__(self, fields: Any) -> None:
        self.fields = fields


class SharedTree:
    """A ``treetensor`` tree whose leaves may be :class:`SharedArray`: ``{key: child}``, unchecked as received."""

    def __init__(self, children: Any) -> None:
        self.children = children


codec.register(SharedArray, "conveyor.shared_batches.array", lambda a: a.fields, SharedArray)
codec.register(SharedTree, "conveyor.shared_batches.tree", lambda t: t.children, SharedTree)


def _rebuild(value: Any, into: type, leaf: Callable[[Any], Any], tree: Callable[[Dict[str, Any]], Any]) -> Any:
    """``value`` with each leaf replaced by ``leaf(it)``, through dicts, lists, tuples and the trees of type ``into``
    (``ttorch.Tensor`` or :class:`SharedTree`, rebuilt by ``tree(children)``)."""
    t = type(value)
    if t is dict:
        return {k: _rebuild(v, into, leaf, tree) for k, v in value.items()}
    if t is list or t is tuple:
        return t(_rebuild(v, into, leaf, tree) for v in value)
    if t is into:
        items = value.children if t is SharedTree else value.items()
        if t is SharedTree and (type(items) is not dict or not all(type(k) is str for k in items)):
            raise BadMessage("a shared tree that is not a dict of named children")
        return tree({k: _rebuild(v, into, leaf, tree) for k, v in dict(items).items()})
    return leaf(value)


def _found(value: Any, into: type, wanted: Callable[[Any], bool]) -> List[Any]:
    """The leaves of ``value`` (as :func:`_rebuild` walks it) for which ``wanted`` holds."""
    found: List[Any] = []
    _rebuild(value, into, lambda v: found.append(v) if wanted(v) else None, lambda children: None)
    return found


def _shareable(value: Any) -> int:
    """The bytes of ``value`` if it goes through shared memory (a large plain numpy array, not Fortran-ordered, or a
    large CPU tensor), else 0: the codec's form of the others is kept."""
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if np is not None and type(value) is np.ndarray:
        flags = value.flags
        ok = value.dtype.kind in _NUMPY_KINDS and not value.dtype.fields and not (flags.f_contiguous
                                                                              and not flags.c_contiguous)
        return value.nbytes if ok and value.nbytes >= MIN_SHARED_BYTES else 0
    if torch is not None and isinstance(value, torch.Tensor) and value.layout == torch.strided \
            and not value.is_quantized and value.device.type == "cpu":
        nbytes = value.numel() * value.element_size()
        return nbytes if nbytes >= MIN_SHARED_BYTES else 0
    return 0


def _plain(children: Dict[str, Any], tree: type) -> Dict[str, Any]:
    """``children`` with their ``tree`` (``ttorch.Tensor``) as plain dicts, which ``tree`` builds a nested tree from."""
    return {k: _plain(dict(v.items()), tree) if type(v) is tree else v for k, v in children.items()}


class _Block:
    """One of a collector's blocks: its mapping and the ticket of the batch last written into it."""

    def __init__(self, name: str, size: int) -> None:
        self.shm = create_shared_block(size, name, track=False)
        self.ticket = 0

    def full(self) -> bool:
        return struct.unpack_from("<q", self.shm.buf, 0)[0] != 0

    def mark(self, state: int) -> None:
        struct.pack_into("<q", self.shm.buf, 0, state)


class SharedBatches:
    """One node's side of shared-memory batches (module docstring): a learner's (:meth:`offer`, :meth:`take`), a
    collector's (:meth:`offered`, :meth:`pack`, :meth:`cancel`), or nothing (``enabled`` False, an evaluator). Its
    handlers run on the router's threads, the rest on the pipeline's: all of it holds one lock."""

    def __init__(self, node: str, *, learner: bool, collector: bool, enabled: bool = True,
                 blocks: int = BLOCKS) -> None:
        self.node, self.blocks = str(node), blocks
        self.learner, self.collector = learner and enabled, collector and enabled
        self._lock = threading.Lock()
        self._offer: Optional[Dict[str, Any]] = None
        self._probe: Any = None
        self._prefix: Optional[str] = None  # learner: its own; collector: that of the learner proved on its host
        self._judged: Dict[str, Tuple[str, bool]] = {}  # collector: learner node -> (its prefix, on this host?)
        self._ring: List[_Block] = []  # collector's blocks
        self._made = 0  # collector: blocks made, numbering their names
        self._mapped: Dict[str, Dict[str, Any]] = {}  # learner: by collector node, its blocks mapped (name -> shm)
        self._nodes: set = set()  # learner: the collectors whose blocks it mapped, or that it lost: swept at its close
        self.taken = 0  # learner: batches taken through shared memory
        self._log = RateLimitedLog(log)
        if self.learner:
            remove_stale_blocks(BLOCK_FAMILY)  # those of learners gone (killed: their tracker may live on)
            self._prefix = f"{BLOCK_FAMILY}{os.getpid()}-{secrets.token_hex(6)}."
            nonce = secrets.token_bytes(32)
            try:
                self._probe = create_shared_block(len(nonce), self._prefix + "probe", track=False)
            except OSError as e:
                log.warning("node %s: collected batches come in their messages: %s", self.node, e)
                return
            self._probe.buf[:len(nonce)] = nonce
            self._offer = {"shm": {"prefix": self._prefix, "nonce": nonce.hex()}}

    def offer(self) -> Dict[str, Any]:
        """Learner: what to send with each ``train_iter`` (``{"shm": {"prefix", "nonce"}}``, or {} when off)."""
        return self._offer or {}

    # --- collector ---------------------------------------------------------------------------------------------
    def offered(self, learner: Any, offer: Any) -> None:
        """Collector: a learner's offer (from its ``train_iter``); proves once per learner prefix whether it shares
        this host's shared memory. Anything malformed counts as another host."""
        if not self.collector or learner is None or type(offer) is not dict:
            return
        learner, prefix, nonce = str(learner), offer.get("prefix"), offer.get("nonce")
        if type(prefix) is not str or not _PREFIX.fullmatch(prefix) or type(nonce) is not str:
            return
        with self._lock:
            if self._judged.get(learner, ("",))[0] == prefix:
                return
        try:
            probe = attach_shared_block(prefix + "probe", track=False)
        except (OSError, ValueError):
            here = False
        else:
            here = secrets.compare_digest(bytes(probe.buf[:len(nonce) // 2]), bytes.fromhex(nonce)) \
                if len(nonce) == 64 and all(c in "0123456789abcdef" for c in nonce) else False
            release_shared_block(probe, unlink=False)
        with self._lock:
            if self._prefix is not None and self._prefix != prefix:
                self._release_ring()  # a learner restarted: its new prefix names new blocks
            self._judged[learner] = prefix, here
        log.info("node %s: collected batches to learner %s go %s", self.node, learner,
                 "through shared memory" if here else "in their messages (not on this host's shared memory)")

    def pack(self, payload: Dict[str, Any], learners: List[str]) -> Tuple[Dict[str, Any], Optional[_Block]]:
        """Collector: ``payload`` with its large arrays written into a free block (and that block), when it goes to
        one learner proved on this host and a block is free; else ``(payload, None)``, to send as it is."""
        prefix, here = self._judged.get(str(learners[0]), ("", False)) if self.collector and len(learners) == 1 \
            else ("", False)
        if not here:
            return payload, None
        tree = _module("treetensor.torch").Tensor
        arrays = _found(payload, tree, _shareable)
        if not arrays:
            return payload, None
        with self._lock:
            self._prefix = prefix
            block = self._free_block(_HEADER + sum(-(-_shareable(a) // _ALIGN) * _ALIGN for a in arrays))
            if block is None:
                return payload, None
            block.ticket += 1
            places: Dict[int, Tuple[Any, SharedArray]] = {}  # id -> the array (kept: its id stays its own), place
            offset = _HEADER

            def place(value: Any) -> Any:
                nonlocal offset
                nbytes = _shareable(value)
                if not nbytes:
                    return value
                if id(value) not in places:  # an array met twice is written once
                    places[id(value)] = value, self._write(block, value, offset)
                    offset += -(-nbytes // _ALIGN) * _ALIGN
                return places[id(value)][1]

            packed = _rebuild(payload, tree, place, SharedTree)
            struct.pack_into("<q", block.shm.buf, 8, block.ticket)
            block.mark(1)
            return packed, block

    def cancel(self, block: Optional[_Block]) -> None:
        """Collector: the batch packed into ``block`` was not sent: the block is free again."""
        if block is not None:
            with self._lock:
                if block in self._ring:
                    block.mark(0)

    def _free_block(self, size: int) -> Optional[_Block]:
        """A free block of at least ``size`` bytes: one of the ring, one made in place of a free one too small, or
        a new one while fewer than ``blocks``; None when all are full."""
        free = [b for b in self._ring if not b.full()]
        fits = [b for b in free if b.shm.size >= size]
        if fits:
            return fits[0]
        if free:
            self._ring.remove(free[0])
            release_shared_block(free[0].shm, unlink=True)
        elif len(self._ring) >= self.blocks:
            return None
        self._made += 1
        name, size = f"{self._prefix}{self.node}.{os.getpid()}-{self._made}", -(-size * 5 // 4 // _ROUND) * _ROUND
        try:
            block = _Block(name, size)
        except OSError as e:  # /dev/shm full: this batch goes in its message
            self._log.log("full", "node %s: batches go in their messages: %s", self.node, e)
            return None
        self._ring.append(block)
        return block

    @staticmethod
    def _write(block: _Block, value: Any, offset: int) -> SharedArray:
        np, torch = _module("numpy"), _module("torch")
        if type(value) is np.ndarray:
            np.copyto(np.ndarray(value.shape, value.dtype, buffer=block.shm.buf, offset=offset), value)
            return SharedArray([block.shm.name, block.ticket, offset, "n", value.dtype.str, list(value.shape)])
        flat = value.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()
        np.copyto(np.ndarray(flat.shape, np.uint8, buffer=block.shm.buf, offset=offset), flat)  # numpy: one thread
        return SharedArray([block.shm.name, block.ticket, offset, "T", str(value.dtype).removeprefix("torch."),
                            list(value.shape)])

    def _release_ring(self) -> None:
        for block in self._ring:
            release_shared_block(block.shm, unlink=True)
        self._ring, self._prefix = [], None

    # --- learner -----------------------------------------------------------------------------------------------
    def take(self, sender: Any, payload: Any) -> Any:
        """Learner: ``payload`` from ``sender`` with its :class:`SharedArray` copied out of their block (which is
        then free); BadMessage, the block freed where it is this sender's, when a descriptor fails its checks."""
        shared: List[Any] = []
        _rebuild(payload, SharedTree, lambda v: shared.append(v) if type(v) is SharedArray else None, shared.append)
        if not shared:
            return payload  # sent in its message
        if not self.learner:
            raise BadMessage("it holds shared-memory descriptors, but this learner offered no shared memory")
        opened: List[Any] = []  # [shm, ticket] of the batch's block once mapped

        def leaf(value: Any) -> Any:
            return self._copy_out(str(sender), value.fields, opened) if type(value) is SharedArray else value

        tree = _module("treetensor.torch").Tensor
        with self._lock:
            try:
                taken = _rebuild(payload, SharedTree, leaf, lambda children: tree(_plain(children, tree)))
                self.taken += 1
                return taken
            except (RuntimeError, TypeError, ValueError) as e:  # BadMessage is a ValueError: kept as it is
                raise e if isinstance(e, BadMessage) else BadMessage(f"a shared-memory descriptor failed: {e}")
            finally:
                if opened:
                    struct.pack_into("<q", opened[0].buf, 0, 0)

    def _copy_out(self, sender: str, fields: Any, opened: List[Any]) -> Any:
        np, torch = _module("numpy"), _module("torch")
        if type(fields) is not list or len(fields) != 6:
            raise BadMessage("a shared-memory descriptor that is not [block, ticket, offset, kind, dtype, shape]")
        name, ticket, offset, kind, dtype, shape = fields
        if not opened:
            shm = self._map(sender, name)
            state, held = struct.unpack_from("<qq", shm.buf, 0)
            if state != 1 or held != ticket:
                raise BadMessage(f"shared-memory block {name!r} does not hold this batch (ticket {ticket!r}, the "
                                 f"block's {held}{', free' if state != 1 else ''})")
            opened[:] = [shm, ticket]
        shm, ticket_opened = opened
        if name != shm.name or ticket != ticket_opened:
            raise BadMessage("a batch whose shared-memory descriptors name more than one block or ticket")
        if kind == "n" and type(dtype) is str and len(dtype) <= 16:
            try:
                np_dtype = np.dtype(dtype)
            except (TypeError, ValueError):
                np_dtype = None
            ok = np_dtype is not None and np_dtype.kind in _NUMPY_KINDS and not np_dtype.fields \
                and np_dtype.subdtype is None and np_dtype.itemsize > 0
            itemsize = np_dtype.itemsize if ok else 0
        elif kind == "T" and type(dtype) is str:
            torch_dtype = getattr(torch, dtype, None)
            ok = isinstance(torch_dtype, torch.dtype)
            itemsize = torch_dtype.itemsize if ok else 0
        else:
            ok, itemsize = False, 0
        if not ok:
            raise BadMessage(f"a shared-memory descriptor of kind {kind!r} with dtype {dtype!r}")
        if type(shape) is not list or len(shape) > 32 or not all(type(n) is int and n >= 0 for n in shape):
            raise BadMessage(f"a shared-memory descriptor with shape {shape!r}")
        count = 1
        for n in shape:
            count *= n
        if type(offset) is not int or not _HEADER <= offset <= shm.size or count * itemsize > shm.size - offset:
            raise BadMessage(f"a shared-memory descriptor for {count * itemsize} bytes at offset {offset!r} of "
                             f"block {name!r}, which holds {shm.size}")
        if kind == "n":
            return np.frombuffer(shm.buf, np_dtype, count, offset).reshape(shape).copy()
        if not count:
            return torch.empty(shape, dtype=torch_dtype)
        raw = np.frombuffer(shm.buf, np.uint8, count * itemsize, offset).copy()  # torch's copy may take two threads
        return torch.from_numpy(raw).view(torch_dtype).reshape(shape)

    def _map(self, sender: str, name: Any) -> Any:
        """Sender's block ``name`` mapped (kept, at most ``blocks`` per sender), if named as its blocks are."""
        if not _NODE.fullmatch(sender) or type(name) is not str \
                or not re.fullmatch(re.escape(f"{self._prefix}{sender}.") + r"\d{1,10}-\d{1,12}", name):
            raise BadMessage(f"a shared-memory block {str(name)[:80]!r} that is not one of node {sender}'s for "
                             f"this learner")
        mapped = self._mapped.setdefault(sender, {})
        if name not in mapped:
            try:
                shm = attach_shared_block(name, track=False)
            except (OSError, ValueError) as e:
                raise BadMessage(f"shared-memory block {name!r} cannot be mapped ({type(e).__name__}: {e})") from None
            if shm.size < _HEADER:
                release_shared_block(shm, unlink=False)
                raise BadMessage(f"shared-memory block {name!r} holds {shm.size} bytes, less than its header")
            while len(mapped) >= self.blocks:
                release_shared_block(mapped.pop(next(iter(mapped))), unlink=False)
            mapped[name] = shm
            self._nodes.add(sender)
        return mapped[name]

    # --- both --------------------------------------------------------------------------------------------------
    def forget(self, node: str) -> None:
        """A peer is gone. Learner: unmap a collector's blocks and remove those whose maker is gone. Collector:
        its learner's offer is forgotten and its blocks freed."""
        node = str(node)
        with self._lock:
            if self.learner:
                for shm in self._mapped.pop(node, {}).values():
                    release_shared_block(shm, unlink=False)
                if _NODE.fullmatch(node):  # also one whose batch never reached this learner
                    self._nodes.add(node)
                    remove_stale_blocks(f"{self._prefix}{node}.")
            elif self.collector and self._judged.pop(node, ("", False))[1]:
                self._release_ring()
                remove_stale_blocks(BLOCK_FAMILY)  # the probe of a learner that died (and blocks named after it)

    def close(self, wait: bool = False) -> None:
        """Free what this side holds (a learner: its probe, and the blocks of collectors gone; a collector: its
        blocks, with ``wait`` (a learner still there) once the learner took the batches in them, at most
        :data:`CLOSE_WAIT_S`: its last batch may still be on its way). Idempotent."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while wait and time.monotonic() < deadline:
            with self._lock:
                if not any(b.full() for b in self._ring):
                    break
            time.sleep(0.005)  # the learner frees a block from another process: nothing to wait on but the block
        with self._lock:
            for blocks in self._mapped.values():
                for shm in blocks.values():
                    release_shared_block(shm, unlink=False)
            for node in self._nodes:  # a killed one may have ended after it was lost
                remove_stale_blocks(f"{self._prefix}{node}.")
            self._mapped, self._nodes = {}, set()
            if self._probe is not None:
                release_shared_block(self._probe, unlink=True)
                self._probe, self._offer = None, None
            self._release_ring()
