"""Authenticated messages: every byte that crosses a socket is sealed with an HMAC-SHA256 of a shared secret.

:func:`seal` packs a topic, a sequence number, the sender's id and payload frames (from
:func:`conveyor.engine.parallel.codec.encode`) into one message; :func:`open_frame` checks it and gives them
back. The order of checks in :func:`open_frame` is the security property: the message's length against
``max_size`` first (no hashing of a flood), then the tag with :func:`hmac.compare_digest` over everything
else, and only then is a single byte of it parsed. A refused message raises :class:`AuthError` or
:class:`OversizeError` (both :class:`RejectedMessage`) so the receiver counts and drops it.

Layout (little-endian; the tag covers everything before it)::

    magic "CNV1" | seq u64 | topic_len u16 | sender_len u16 | n_frames u32 | topic | sender
    | n_frames x u64 frame length | padding to 16 | each frame, padded to 16 | HMAC-SHA256 tag (32)

Frames start at multiples of 16 so arrays decoded in place from a buffer that is itself aligned (a
``bytes`` or ``bytearray`` is) are aligned too. There is no replay window here: the receiver uses ``seq``
(with ``sender``) to spot duplicated or lost messages.

Secrets come from :func:`load_secret`: a ``--secret-file``, else ``CONVEYOR_SECRET``, else a fresh one.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from typing import List, Mapping, NamedTuple, Optional, Sequence, Union

__all__ = ["AuthError", "Frame", "MIN_SECRET_BYTES", "MalformedFrame", "OversizeError", "RejectedMessage",
           "SECRET_ENV", "SecretError", "generate_secret", "load_secret", "open_frame", "seal"]

Buffer = Union[bytes, bytearray, memoryview]

MAGIC = b"CNV1"
TAG_BYTES = 32
ALIGN = 16
MIN_SECRET_BYTES = 32
SECRET_ENV = "CONVEYOR_SECRET"
_PREFIX = struct.Struct("<4sQHHI")
_PADDING = bytes(ALIGN)


class RejectedMessage(Exception):
    """A received message that was dropped before anything in it was used."""


class AuthError(RejectedMessage):
    """The message's HMAC does not match: forged, corrupted, truncated, or sealed with another secret."""


class OversizeError(RejectedMessage):
    """The message is larger than the receiver's ``max_size``; it was refused before its HMAC was computed."""


class MalformedFrame(RejectedMessage):
    """The HMAC matched but the layout did not: a peer with the secret and another version or a bug."""


class SecretError(ValueError):
    """A secret that cannot be used: unreadable, empty or too short."""


class Frame(NamedTuple):
    """An opened message. ``payload`` views the received buffer; decode it with ``codec.decode``."""
    topic: str
    seq: int
    sender: str
    payload: List[memoryview]


def _pad(n: int) -> int:
    return -n % ALIGN


def _check_secret(secret: bytes) -> None:
    if type(secret) is not bytes:
        raise TypeError(f"the secret must be bytes, got {type(secret).__name__}; load one with load_secret()")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the secret has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")


def seal(secret: bytes, topic: str, seq: int, sender: str, payload: Sequence[Buffer],
         max_size: Optional[int] = None) -> bytes:
    """One message carrying ``payload`` (a list of byte buffers), tagged with HMAC-SHA256 of ``secret``.

    With ``max_size``, a message that the receiver would refuse raises :class:`OversizeError` here instead.
    The buffers are copied into the message; the caller may reuse them afterwards.
    """
    _check_secret(secret)
    topic_b, sender_b = topic.encode(), sender.encode()
    if len(topic_b) > 0xFFFF or len(sender_b) > 0xFFFF:
        raise ValueError(f"topic and sender must be under 64 KiB encoded (topic {topic[:40]!r}, sender {sender[:40]!r})")
    if not 0 <= seq < 1 << 64:
        raise ValueError(f"seq must be in [0, 2**64), got {seq}")
    views = [memoryview(p).cast("B") for p in payload]
    lengths = [v.nbytes for v in views]
    head = _PREFIX.pack(MAGIC, seq, len(topic_b), len(sender_b), len(views)) + topic_b + sender_b
    head += struct.pack(f"<{len(views)}Q", *lengths)
    parts: List[Buffer] = [head, _PADDING[:_pad(len(head))]]
    for v, n in zip(views, lengths):
        parts += (v, _PADDING[:_pad(n)])
    size = sum(len(p) for p in parts) + TAG_BYTES
    if max_size is not None and size > max_size:
        raise OversizeError(f"message on topic {topic!r} is {size} bytes, over the limit of {max_size}; "
                            f"raise max_size on every node or send less at once")
    body = b"".join(parts)  # measured faster than feeding the HMAC part by part, even with the tag's concatenation
    return body + hmac.digest(secret, body, hashlib.sha256)


def open_frame(secret: bytes, data: Buffer, max_size: int) -> Frame:
    """Check and unpack a message from :func:`seal`; raises a :class:`RejectedMessage` subclass if refused.

    ``max_size`` is checked first, then the HMAC (in constant time); only then is the message parsed.
    """
    _check_secret(secret)
    view = memoryview(data).cast("B")
    size = view.nbytes
    if size > max_size:
        raise OversizeError(f"message of {size} bytes is over the limit of {max_size}")
    if size < _PREFIX.size + TAG_BYTES:
        raise AuthError(f"message of {size} bytes is too short to carry a tag")
    body = view[:-TAG_BYTES]
    if not hmac.compare_digest(hmac.digest(secret, body, hashlib.sha256), view[-TAG_BYTES:]):
        raise AuthError(f"message of {size} bytes failed its HMAC check (forged, corrupted, or another secret)")
    return _parse(body)


def _parse(body: memoryview) -> Frame:
    magic, seq, topic_len, sender_len, n_frames = _PREFIX.unpack_from(body)
    if magic != MAGIC:
        raise MalformedFrame(f"message has format {bytes(magic)!r}, this node speaks {MAGIC!r}; run one version everywhere")
    at = _PREFIX.size
    end = at + topic_len + sender_len + 8 * n_frames
    if end > len(body):
        raise MalformedFrame("message header runs past its end")
    try:
        topic = str(body[at:at + topic_len], "utf-8")
        sender = str(body[at + topic_len:at + topic_len + sender_len], "utf-8")
    except UnicodeDecodeError:
        raise MalformedFrame("message topic or sender is not UTF-8") from None
    lengths = struct.unpack_from(f"<{n_frames}Q", body, at + topic_len + sender_len)
    at = end + _pad(end)
    payload = []
    for n in lengths:
        if at + n > len(body):
            raise MalformedFrame("message frames run past its end")
        payload.append(body[at:at + n])
        at += n + _pad(n)
    if at != len(body):
        raise MalformedFrame(f"message has {len(body) - at} bytes after its last frame")
    return Frame(topic, seq, sender, payload)


def generate_secret() -> bytes:
    """A fresh random secret (32 bytes from :mod:`secrets`), for a local launch to hand to its children."""
    return secrets.token_bytes(32)


def load_secret(secret_file: Optional[Union[str, os.PathLike]] = None, *, environ: Optional[Mapping[str, str]] = None,
                generate: bool = True) -> bytes:
    """The shared secret: the contents of ``secret_file`` (``--secret-file``), else ``$CONVEYOR_SECRET``,
    else a new one from :func:`generate_secret` (or a ``SecretError`` when ``generate`` is False).

    Trailing whitespace (a newline) is stripped from the file and the variable; what remains must be at
    least ``MIN_SECRET_BYTES`` bytes. Every node must load the same secret.
    """
    hint = "make one with: python -c 'import secrets; print(secrets.token_hex(32))' > FILE"
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read().rstrip()
        except OSError as e:
            raise SecretError(f"cannot read the secret file {os.fspath(secret_file)!r}: {e.strerror or e}") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"the secret file {os.fspath(secret_file)!r} holds {len(secret)} bytes, at least "
                              f"{MIN_SECRET_BYTES} are needed; {hint}")
        return secret
    value = (os.environ if environ is None else environ).get(SECRET_ENV)
    if value is not None:
        secret = value.encode().rstrip()
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"${SECRET_ENV} holds {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed; "
                              f"set it to the output of: python -c 'import secrets; print(secrets.token_hex(32))'")
        return secret
    if not generate:
        raise SecretError(f"no secret: pass --secret-file FILE or set ${SECRET_ENV} (the same on every node); {hint}")
    return generate_secret()
