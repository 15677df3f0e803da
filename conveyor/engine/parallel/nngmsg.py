"""Messages laid out straight into the nng message that is sent: no copy between a batch and the socket.

``Socket.send(data)`` allocates an nng message and copies ``data`` into it, so a batch joined into a ``bytearray``
first was copied twice on its way out (and the ``bytearray`` of up to ``batch_bytes`` allocated and freed each time).
An :class:`Outgoing` is the nng message itself: the batch's pieces are written into its body once, the tag is written
there in place, and ``nng_sendmsg`` hands the message to nng as it is.
"""
from __future__ import annotations

from typing import Any, Sequence

import pynng
from pynng import ffi, lib
from pynng.exceptions import check_err

from conveyor.engine.parallel.frame import Buffer

__all__ = ["Outgoing"]


class Outgoing:
    """An nng message of ``size`` bytes, written through :attr:`body` (a writable memoryview) and then sent once with
    :meth:`send`. One that is never sent, or whose send fails, is freed with this object (pynng's ``Message``)."""

    __slots__ = ("body", "_msg")

    def __init__(self, size: int) -> None:
        pointer = ffi.new("nng_msg **")
        check_err(lib.nng_msg_alloc(pointer, size))
        self._msg = pynng.Message(pointer[0])  # owns the nng message until nng_sendmsg takes it
        self.body = memoryview(ffi.buffer(ffi.cast("char *", lib.nng_msg_body(pointer[0])), size))

    @classmethod
    def join(cls, parts: Sequence[Buffer]) -> "Outgoing":
        """A message holding ``parts`` end to end (each copied once, into the message nng will send)."""
        out = cls(sum(len(p) for p in parts))
        body, at = out.body, 0
        for part in parts:
            end = at + len(part)
            body[at:end] = part
            at = end
        return out

    def send(self, sock: Any, block: bool = True) -> None:
        """Send on pynng socket ``sock`` (its send timeout applies); :attr:`body` is released first, as nng owns and
        frees the message once it is sent. Raises what ``Socket.send`` raises."""
        self.body.release()
        sock.send_msg(self._msg, block=block)
