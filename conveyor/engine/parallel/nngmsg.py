"""Messages laid out straight into the nng message that is sent: no copy between a batch and the socket.

``Socket.send(data)`` allocates an nng message and copies ``data`` into it, so a batch joined into a ``bytearray``
first was copied twice on its way out (and the ``bytearray`` of up to ``batch_bytes`` allocated and freed each time).
An :class:`Outgoing` is the nng message itself: the batch's pieces are written into its body once, the tag is written
there in place, and ``nng_sendmsg`` hands the message to nng as it is.

A piece of :data:`GIL_FREE_BYTES` or more is copied by nng (``nng_msg_append``, a C call that releases the GIL), so
the thread that lays out a large batch lets the thread that publishes the next one run meanwhile; smaller pieces cost
less through a ``memoryview`` than the call would.
"""
from __future__ import annotations

from typing import Any, Sequence

import pynng
from pynng import ffi, lib
from pynng.exceptions import check_err

from conveyor.engine.parallel.frame import Buffer

__all__ = ["GIL_FREE_BYTES", "Outgoing"]

GIL_FREE_BYTES = 8 << 10
"""Pieces at least this long are copied with the GIL released: the calls cost about 1 µs a piece here, what copying
8-40 KB under the GIL takes (cold and hot caches)."""


class Outgoing:
    """An nng message of ``size`` bytes, written through :meth:`write` or :attr:`body` (a writable memoryview) and then
    sent once with :meth:`send`. One that is never sent, or whose send fails, is freed with this object (pynng's
    ``Message``)."""

    __slots__ = ("body", "_msg", "_at", "_size")

    def __init__(self, size: int) -> None:
        pointer = ffi.new("nng_msg **")
        check_err(lib.nng_msg_alloc(pointer, size))
        self._msg = pynng.Message(pointer[0])  # owns the nng message until nng_sendmsg takes it
        self._at, self._size = lib.nng_msg_body(pointer[0]), size
        self.body = memoryview(ffi.buffer(ffi.cast("char *", self._at), size))

    @classmethod
    def join(cls, parts: Sequence[Buffer]) -> "Outgoing":
        """A message holding ``parts`` end to end (each copied once, into the message nng will send)."""
        out = cls(sum(len(p) for p in parts))
        at = 0
        for part in parts:
            at = out.write(at, part)
        return out

    def write(self, at: int, part: Buffer) -> int:
        """Copy ``part`` (bytes-like, one byte per item) into the body at offset ``at``; returns where it ends."""
        end = at + len(part)
        if end > len(self.body):
            raise ValueError(f"Outgoing.write: {len(part)} bytes at {at} run past the message's {len(self.body)}")
        if end - at < GIL_FREE_BYTES:
            self.body[at:end] = part
            return end
        msg = self._msg._nng_msg  # nng's length is set back to the body's in send()
        check_err(lib.nng_msg_realloc(msg, at))  # within the allocation: nothing moves, nothing is copied
        check_err(lib.nng_msg_append(msg, ffi.from_buffer(part), end - at))  # copies to nng's length end: to ``at``
        if lib.nng_msg_body(msg) != self._at:  # nng kept its word here; never write through a stale view
            raise RuntimeError("nng moved a message's body while it was written: this nng is not supported")
        return end

    def send(self, sock: Any, block: bool = True) -> None:
        """Send on pynng socket ``sock`` (its send timeout applies); :attr:`body` is released first, as nng owns and
        frees the message once it is sent. Raises what ``Socket.send`` raises."""
        if not self._msg._mem_freed:  # pynng's flag: nng has not taken it yet (a second send raises below)
            check_err(lib.nng_msg_realloc(self._msg._nng_msg, self._size))  # no copy, nothing zeroed
        self.body.release()
        sock.send_msg(self._msg, block=block)
