"""The message layer of multi-process and multi-node runs: payload codec and authenticated frames.

Not imported by :mod:`conveyor.engine`, and importing it loads no numpy, torch or pynng either: the codec
imports numpy / torch / treetensor only when it decodes one of their values.

- :mod:`~conveyor.engine.parallel.codec`: ``encode(obj) -> [header, *buffers]``, ``decode(frames)``,
  ``register``, ``Codec``, ``PickleCodec`` (opt-in), ``DecodeError``.
- :mod:`~conveyor.engine.parallel.frame`: ``seal(secret, topic, seq, sender, frames, ...) -> bytes`` (AES-GMAC
  with a key bound to the sender's and the receiver's incarnations), ``open_frame(secret, data, max_size,
  receiver_incarnation) -> Frame``, ``open_batch`` (several messages under one tag), ``RejectedMessage`` / ``AuthError`` / ``ReplayError`` / ``OversizeError`` /
  ``MalformedFrame``, ``load_secret``, ``generate_secret``.
- :mod:`~conveyor.engine.parallel.router`: ``Router`` (topics between nodes over pynng). Imported on first
  use of ``Router``, so the names above stay free of pynng.

``Parallel.runner`` is in :mod:`~conveyor.engine.parallel.runner` (its face and argument checks), with the
launcher's side (start, supervision, restarts) in :mod:`~conveyor.engine.parallel.launch` and the worker's in
:mod:`~conveyor.engine.parallel.worker`; processes themselves are :mod:`conveyor.processes`'s.
"""
from conveyor.engine.parallel.codec import Codec, DecodeError, PickleCodec, decode, encode, register
from conveyor.engine.parallel.frame import (AuthError, Frame, MalformedFrame, OversizeError, RejectedMessage, ReplayError,
                                            SecretError, generate_secret, load_secret, open_batch, open_frame,
                                            seal)

__all__ = ["AuthError", "Codec", "DecodeError", "Frame", "MalformedFrame", "OversizeError", "PickleCodec",
           "RejectedMessage", "ReplayError", "SecretError", "decode", "encode", "generate_secret", "load_secret", "open_batch",
           "open_frame", "register", "seal"]  # Router is not here: a star import must not load pynng


def __getattr__(name: str):
    if name == "Router":
        from conveyor.engine.parallel.router import Router
        return Router
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
