"""Authenticated messages: every byte that crosses a socket carries an AES-GMAC tag of a per-link key.

:func:`seal` packs a topic, a sequence number, the sender's id and payload frames (from
:func:`conveyor.engine.parallel.codec.encode`) into one message addressed from one *incarnation* to
another; :func:`open_frame` checks it and gives them back. A message is a *batch*: :func:`join` puts
several :func:`pack`-ed messages of one sender under one header, one counter and one tag (the router's
sender thread does, :mod:`~conveyor.engine.parallel.outbox`), and :func:`open_batch` gives them all back.

Keys. An incarnation is 16 bytes a router draws when it starts (a restarted process draws new ones): its
start time in nanoseconds (8 bytes, big-endian, so incarnations of one node order by age) and 8 random bytes. The key of a message is derived with HKDF-SHA256 from the shared secret and the pair (sender's
incarnation, receiver's incarnation), so a message only authenticates for the receiver incarnation it
was sealed for: traffic recorded in another run, or before a restart, is refused (:class:`ReplayError`).
A sender that does not know its peer's incarnation yet may only send a *hello*, addressed to
:data:`HELLO` (all zeros); the router accepts nothing but its membership state that way. The tag is
AES-256-GCM with nothing to encrypt (GMAC) over the whole message; its 96-bit nonce is the link
``counter`` the sender numbers its messages to one receiver incarnation with, so a key never sees a
nonce twice, and the receiver refuses a counter it has seen (a replay within the run).

The order of checks in :func:`open_frame` is the security property: the message's length against
``max_size`` first (no work for a flood), then the tag in constant time (with the key named by the two
incarnations at fixed offsets, the only bytes read before it), and only then is any variable part
parsed: first the batch's message count and length (at most :data:`MAX_BATCH_MESSAGES` messages of at
least 16 bytes each, and exactly the bytes between header and tag), before anything is allocated for them.
A refused message raises a :class:`RejectedMessage` subclass so the receiver counts and drops it; one in
an older format (``CNV2``, before batches) a :class:`VersionError` that names both versions.

Layout (little-endian; the tag covers everything before it)::

    magic "CNV3" | sender incarnation (16) | receiver incarnation (16) | counter u64
    | n_msgs u32 | sender_len u16 | 0 u16 | body_len u64 | sender | padding to 16
    | n_msgs messages (body_len bytes), each:
        seq u64 | topic_len u16 | 0 u16 | n_frames u32 | topic | n_frames x u64 frame length
        | padding to 16 | each frame, padded to 16
    | GMAC tag (16)

Messages and frames start at multiples of 16 so arrays decoded in place from a buffer that is itself aligned are
aligned too. Confidentiality is not provided: payloads travel in clear (see docs/distributed.md, Threat
model). Secrets come from :func:`load_secret`: a ``--secret-file``, else ``CONVEYOR_SECRET``, else a fresh one.
"""
from __future__ import annotations

import functools
import os
import secrets
import math
import stat
import struct
import time
from typing import Any, List, Mapping, NamedTuple, Optional, Sequence, Union

__all__ = ["AuthError", "Frame", "HELLO", "INCARNATION_BYTES", "MIN_SECRET_BYTES", "MalformedFrame",
           "MAX_BATCH_MESSAGES", "OversizeError", "RejectedMessage", "ReplayError", "SECRET_ENV", "SecretError",
           "VersionError", "batch_parts", "generate_secret", "check_secret_strength", "incarnation_started", "join",
           "load_secret", "new_incarnation", "open_batch", "open_frame", "pack", "seal", "sign"]

Buffer = Union[bytes, bytearray, memoryview]
WritableBuffer = Union[bytearray, memoryview]

MAGIC = b"CNV3"
_OLD_MAGIC = {b"CNV2": "Conveyor before batched messages"}
MAX_BATCH_MESSAGES = 4096
"""Messages one batch may carry: a bound on what a peer's header makes the receiver allocate."""
TAG_BYTES = 16
ALIGN = 16
INCARNATION_BYTES = 16
MIN_SECRET_BYTES = 32
MIN_SECRET_DISTINCT = 8
"""Distinct byte values a secret must hold: a hex secret of 64 characters from ``secrets`` has about 16."""
MIN_SECRET_BITS = 96.0
"""Shannon-entropy floor of a secret, in bits (its length times the entropy of its byte frequencies): a hex
secret of 64 characters from ``secrets`` estimates about 240, 32 random bytes (:func:`generate_secret`) about 150."""
GOOD_SECRET_COMMAND = "(umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > FILE)"
SECRET_ENV = "CONVEYOR_SECRET"
HELLO = bytes(INCARNATION_BYTES)
"""The receiver incarnation of a hello: sent to a peer whose incarnation is not known yet."""
_LINK = struct.Struct("<4s16s16sQ")  # magic, sender incarnation, receiver incarnation, counter: picks the key
_BATCH = struct.Struct("<IHHQ")  # n_msgs, sender_len, 0, body_len
_HEAD = struct.Struct("<QHHI")  # one message: seq, topic_len, 0, n_frames
_PREFIX = struct.Struct(f"<{_LINK.size}x{_BATCH.format.lstrip('<')}")  # the link part left zero for sign()
_MIN_SIZE = _LINK.size + _BATCH.size + TAG_BYTES
_PADDING = bytes(ALIGN)
_TAG_PLACEHOLDER = bytes(TAG_BYTES)
_KDF_SALT = b"conveyor/2 link key"


class RejectedMessage(Exception):
    """A received message that was dropped before anything in it was used."""


class AuthError(RejectedMessage):
    """The message's tag does not match: forged, corrupted, truncated, or sealed with another secret."""


class ReplayError(RejectedMessage):
    """An authentic message sealed for another incarnation: recorded in another run or before a restart."""


class OversizeError(RejectedMessage):
    """The message is larger than the receiver's ``max_size``; it was refused before its tag was computed."""


class MalformedFrame(RejectedMessage):
    """The tag matched but the layout did not: a peer with the secret and another version or a bug."""


class VersionError(AuthError):
    """The message is in an older frame format: the node that sent it runs another version of Conveyor."""


class SecretError(ValueError):
    """A secret that cannot be used: unreadable, readable by others, empty, too short or too regular."""


class Frame(NamedTuple):
    """An opened message. ``payload`` views the received buffer; decode it with ``codec.decode``."""
    topic: str
    seq: int
    sender: str
    payload: List[memoryview]
    sender_incarnation: bytes = HELLO
    receiver_incarnation: bytes = HELLO
    counter: int = 0


def _pad(n: int) -> int:
    return -n % ALIGN


def _check_secret(secret: bytes) -> None:
    if type(secret) is not bytes:
        raise TypeError(f"the secret must be bytes, got {type(secret).__name__}; load one with load_secret()")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the secret has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")


def _check_incarnation(name: str, value: bytes) -> None:
    if type(value) is not bytes or len(value) != INCARNATION_BYTES:
        raise ValueError(f"{name} must be {INCARNATION_BYTES} bytes (see new_incarnation()), got {value!r}")


@functools.lru_cache(maxsize=1024)
def _link_key(secret: bytes, sender_inc: bytes, receiver_inc: bytes) -> Any:
    """The AES-GCM object of one direction of one link (HKDF-SHA256 of the secret and both incarnations)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    key = HKDF(hashes.SHA256(), 32, salt=_KDF_SALT, info=sender_inc + receiver_inc).derive(secret)
    return AESGCM(key)


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(8, "little") + b"\0\0\0\0"


def new_incarnation() -> bytes:
    """Fresh incarnation bytes, drawn once by each router that starts: its start time, then random bytes."""
    return time.time_ns().to_bytes(8, "big") + secrets.token_bytes(INCARNATION_BYTES - 8)


def incarnation_started(incarnation: bytes) -> int:
    """When the router of ``incarnation`` started, in nanoseconds since the epoch (as its clock said)."""
    return int.from_bytes(incarnation[:8], "big")


def pack(topic: str, seq: int, sender: str, payload: Sequence[Buffer], max_size: Optional[int] = None) -> bytearray:
    """An unsigned message carrying ``payload`` (a list of byte buffers); :func:`sign` addresses and tags it.

    With ``max_size``, a message that the receiver would refuse raises :class:`OversizeError` here instead.
    The buffers are copied into the message; the caller may reuse them afterwards. One packed message can
    be signed and sent to several receivers in turn, or :func:`join`-ed with others of its sender first.
    """
    topic_b, sender_b = topic.encode(), sender.encode()
    if len(topic_b) > 0xFFFF or len(sender_b) > 0xFFFF:
        raise ValueError(f"topic and sender must be under 64 KiB encoded (topic {topic[:40]!r}, sender {sender[:40]!r})")
    if not 0 <= seq < 1 << 64:
        raise ValueError(f"seq must be in [0, 2**64), got {seq}")
    # bytes and bytearrays as they are; any other buffer as a flat byte view, so that len() is its size
    views = [p if type(p) is bytes or type(p) is bytearray else memoryview(p).cast("B") for p in payload]
    lengths = [len(v) for v in views]
    head = _HEAD.pack(seq, len(topic_b), 0, len(views)) + topic_b + _lengths(len(views)).pack(*lengths)
    pad = _pad(len(head))
    parts: List[Buffer] = [head, _PADDING[:pad]]
    body = len(head) + pad
    for v, n in zip(views, lengths):
        pad = _pad(n)
        parts += (v, _PADDING[:pad])
        body += n + pad
    prefix = _prefix(1, sender_b, body)
    size = len(prefix) + body + TAG_BYTES
    if max_size is not None and size > max_size:
        raise OversizeError(f"message on topic {topic!r} is {size} bytes, over the limit of {max_size}; "
                            f"raise max_message_size on every node or send less at once")
    return bytearray().join([prefix, *parts, _TAG_PLACEHOLDER])  # one copy of the payload, as a send would make


def _prefix(n_msgs: int, sender_b: bytes, body_len: int) -> bytes:
    """The header of a batch, up to its first message, with the link part left for :func:`sign`."""
    return _PREFIX.pack(n_msgs, len(sender_b), 0, body_len) + sender_b + _PADDING[:_pad(_PREFIX.size + len(sender_b))]


@functools.lru_cache(maxsize=64)
def _lengths(n_frames: int) -> struct.Struct:
    """The struct of a message's ``n_frames`` frame lengths, made once per count."""
    return struct.Struct(f"<{n_frames}Q")


def join(messages: Sequence[bytearray]) -> bytearray:
    """One unsigned batch of several :func:`pack`-ed messages (or batches) of one sender, in their order: one
    header, one counter and one tag for all of them. :func:`open_batch` gives them back."""
    return bytearray().join(batch_parts(messages))


def batch_parts(messages: Sequence[Buffer]) -> List[Buffer]:
    """The pieces that, laid end to end, make :func:`join` of ``messages``: a header, views of the messages' bodies
    and the tag's place; for a caller that writes the batch straight where it is sent."""
    n_msgs, body_len, sender_b, bodies = 0, 0, None, []
    for message in messages:
        n, sender_len, _, length = _BATCH.unpack_from(message, _LINK.size)
        start = _LINK.size + _BATCH.size
        this_sender = bytes(message[start:start + sender_len])
        if sender_b is not None and this_sender != sender_b:
            raise ValueError(f"join: messages of senders {sender_b!r} and {this_sender!r}; a batch has one sender")
        sender_b = this_sender
        n_msgs, body_len = n_msgs + n, body_len + length
        bodies.append(memoryview(message)[len(message) - TAG_BYTES - length:len(message) - TAG_BYTES])
    if sender_b is None or n_msgs > MAX_BATCH_MESSAGES:
        raise ValueError(f"join: a batch carries 1 to {MAX_BATCH_MESSAGES} messages, got {n_msgs}")
    return [_prefix(n_msgs, sender_b, body_len), *bodies, _TAG_PLACEHOLDER]


def sign(message: WritableBuffer, secret: bytes, sender_incarnation: bytes, receiver_incarnation: bytes,
         counter: int) -> WritableBuffer:
    """Address a :func:`pack`-ed message to ``receiver_incarnation`` (:data:`HELLO` for a hello) and write its
    tag in place; ``counter`` must never repeat for one (sender, receiver) pair of incarnations."""
    _check_secret(secret)
    _check_incarnation("sender_incarnation", sender_incarnation)
    _check_incarnation("receiver_incarnation", receiver_incarnation)
    if not 0 <= counter < 1 << 64:
        raise ValueError(f"counter must be in [0, 2**64), got {counter}")
    _LINK.pack_into(message, 0, MAGIC, sender_incarnation, receiver_incarnation, counter)
    mv = memoryview(message)
    mv[-TAG_BYTES:] = _link_key(secret, sender_incarnation, receiver_incarnation).encrypt(
        _nonce(counter), b"", mv[:-TAG_BYTES])
    return message


def seal(secret: bytes, topic: str, seq: int, sender: str, payload: Sequence[Buffer],
         max_size: Optional[int] = None, *, sender_incarnation: bytes = HELLO, receiver_incarnation: bytes = HELLO,
         counter: int = 0) -> bytes:
    """:func:`pack` and :func:`sign` in one: one message from one incarnation to another, as bytes."""
    return bytes(sign(pack(topic, seq, sender, payload, max_size), secret, sender_incarnation,
                      receiver_incarnation, counter))


def open_frame(secret: bytes, data: Buffer, max_size: int, receiver_incarnation: Optional[bytes] = None) -> Frame:
    """Check and unpack a message from :func:`seal`, a batch of one (:func:`open_batch` has the checks);
    a batch of several is a :class:`MalformedFrame`."""
    frames = open_batch(secret, data, max_size, receiver_incarnation)
    if len(frames) != 1:
        raise MalformedFrame(f"a batch of {len(frames)} messages where one was expected; open it with open_batch")
    return frames[0]


def open_batch(secret: bytes, data: Buffer, max_size: int, receiver_incarnation: Optional[bytes] = None
               ) -> List[Frame]:
    """Check and unpack a batch (:func:`seal`, :func:`join`): its messages, in order, sharing one sender,
    incarnations and counter. Raises a :class:`RejectedMessage` subclass if refused.

    ``max_size`` is checked first, then the tag (in constant time); only then is the message parsed, its
    message count and body length before anything else. With ``receiver_incarnation``, an authentic message
    addressed to another incarnation (but not a hello) raises :class:`ReplayError`; the caller decides what
    a hello may carry.
    """
    _check_secret(secret)
    view = memoryview(data).cast("B")
    size = view.nbytes
    if size > max_size:
        raise OversizeError(f"message of {size} bytes is over the limit of {max_size}")
    if size < _MIN_SIZE:
        raise AuthError(f"message of {size} bytes is too short to carry a tag")
    magic, sender_inc, receiver_inc, counter = _LINK.unpack_from(view)
    if magic in _OLD_MAGIC:
        raise VersionError(f"message in frame format {bytes(magic).decode()} ({_OLD_MAGIC[magic]}); this node "
                           f"speaks {MAGIC.decode()}: run the same Conveyor version on every node")
    if magic != MAGIC:
        raise AuthError(f"message starts with {bytes(magic)!r}, not {MAGIC!r}: not sealed by this version of Conveyor")
    body = view[:-TAG_BYTES]
    try:
        _link_key(secret, sender_inc, receiver_inc).decrypt(_nonce(counter), view[-TAG_BYTES:].tobytes(), body)
    except Exception:  # cryptography's InvalidTag; nothing else can come of well-typed arguments
        raise AuthError(f"message of {size} bytes failed its tag check (forged, corrupted, or another secret)") from None
    if receiver_incarnation is not None and receiver_inc != receiver_incarnation and receiver_inc != HELLO:
        raise ReplayError(f"an authentic message sealed for incarnation {receiver_inc.hex()}, not this one "
                          f"({receiver_incarnation.hex()}): recorded in another run or before a restart")
    n_msgs, sender_len, _, body_len = _BATCH.unpack_from(body, _LINK.size)
    at = _LINK.size + _BATCH.size + sender_len
    at += _pad(at)
    if not (1 <= n_msgs <= MAX_BATCH_MESSAGES and at + body_len == len(body) and n_msgs * _HEAD.size <= body_len):
        raise MalformedFrame(f"batch header says {n_msgs} messages in {body_len} bytes, after a sender of "
                             f"{sender_len} bytes, in a message of {size} bytes")
    try:
        sender = str(body[_LINK.size + _BATCH.size:_LINK.size + _BATCH.size + sender_len], "utf-8")
    except UnicodeDecodeError:
        raise MalformedFrame("message sender is not UTF-8") from None
    frames = []
    for _ in range(n_msgs):
        topic, seq, payload, at = _parse(body, at)
        frames.append(Frame(topic, seq, sender, payload, sender_inc, receiver_inc, counter))
    if at != len(body):
        raise MalformedFrame(f"message has {len(body) - at} bytes after its last frame")
    return frames


def _parse(body: memoryview, at: int) -> tuple:
    """The message at offset ``at`` of ``body``: its topic, seq, payload views and where the next one starts."""
    if at + _HEAD.size > len(body):
        raise MalformedFrame("message header runs past its end")
    seq, topic_len, _, n_frames = _HEAD.unpack_from(body, at)
    at += _HEAD.size
    end = at + topic_len + 8 * n_frames
    if end > len(body):
        raise MalformedFrame("message header runs past its end")
    try:
        topic = str(body[at:at + topic_len], "utf-8")
    except UnicodeDecodeError:
        raise MalformedFrame("message topic is not UTF-8") from None
    lengths = _lengths(n_frames).unpack_from(body, at + topic_len)
    at = end + _pad(end)
    payload = []
    for n in lengths:
        if at + n > len(body):
            raise MalformedFrame("message frames run past its end")
        payload.append(body[at:at + n])
        at += n + _pad(n)
    return topic, seq, payload, at


def generate_secret() -> bytes:
    """A fresh random secret (32 bytes from :mod:`secrets`), for a local launch to hand to its children."""
    return secrets.token_bytes(32)


def check_secret_strength(secret: bytes, where: str = "the secret") -> None:
    """Refuse a guessable secret: fewer than :data:`MIN_SECRET_DISTINCT` distinct bytes, or a Shannon-entropy
    estimate (length times the entropy of its byte frequencies) under :data:`MIN_SECRET_BITS`.

    An estimate from the secret alone: it catches repeated or patterned text (32 ``a``, ``abab...``), not a
    password that merely looks random. Every secret :func:`generate_secret` or ``token_hex(32)`` makes passes
    with a wide margin.
    """
    counts = [secret.count(b) for b in set(secret)]
    bits = max(0.0, -sum(c * math.log2(c / len(secret)) for c in counts))
    if len(counts) < MIN_SECRET_DISTINCT or bits < MIN_SECRET_BITS:
        raise SecretError(f"{where} is too easy to guess ({len(counts)} distinct bytes, about {bits:.0f} bits of "
                          f"entropy; at least {MIN_SECRET_DISTINCT} and {MIN_SECRET_BITS:.0f} are needed); make a "
                          f"random one with: {GOOD_SECRET_COMMAND}")


def load_secret(secret_file: Optional[Union[str, os.PathLike]] = None, *, environ: Optional[Mapping[str, str]] = None,
                generate: bool = True) -> bytes:
    """The shared secret: the contents of ``secret_file`` (``--secret-file``), else ``$CONVEYOR_SECRET``,
    else a new one from :func:`generate_secret` (or a ``SecretError`` when ``generate`` is False).

    A secret file that its group or others may read is refused, as ssh refuses such a key. Trailing
    whitespace (a newline) is stripped from the file and the variable; what remains must be at least
    ``MIN_SECRET_BYTES`` bytes and pass :func:`check_secret_strength`. Every node must load the same secret.
    """
    hint = f"make one with: {GOOD_SECRET_COMMAND}"
    if secret_file is not None:
        name = os.fspath(secret_file)
        try:
            with open(secret_file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if mode & (stat.S_IRWXG | stat.S_IRWXO):
                    raise SecretError(f"the secret file {name!r} is accessible by group or others (mode "
                                      f"{stat.S_IMODE(mode):03o}); anyone who reads it can join or end your runs. "
                                      f"Fix it with: chmod 600 {name}")
                secret = f.read().rstrip()
        except OSError as e:
            raise SecretError(f"cannot read the secret file {name!r}: {e.strerror or e}") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"the secret file {name!r} holds {len(secret)} bytes, at least "
                              f"{MIN_SECRET_BYTES} are needed; {hint}")
        check_secret_strength(secret, f"the secret file {name!r}")
        return secret
    value = (os.environ if environ is None else environ).get(SECRET_ENV)
    if value is not None:
        secret = value.encode().rstrip()
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"${SECRET_ENV} holds {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed; "
                              f"set it to the output of: python -c 'import secrets; print(secrets.token_hex(32))'")
        check_secret_strength(secret, f"${SECRET_ENV}")
        return secret
    if not generate:
        raise SecretError(f"no secret: pass --secret-file FILE or set ${SECRET_ENV} (the same on every node); {hint}")
    return generate_secret()
