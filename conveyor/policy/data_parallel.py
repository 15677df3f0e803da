"""Data-parallel learners: N processes train one policy, each on its share of every batch.

The learners form a ``torch.distributed`` group (gloo on CPU, NCCL on CUDA). A policy joins it once with
:meth:`Policy.join_data_parallel`, which copies rank 0's weights to every learner; from then on each gradient step
(:meth:`Policy._apply_gradients`, the one place every policy's step goes through) averages the gradients over
the group before clipping and stepping, so the learners' weights stay bitwise identical after every step. The
learners' own losses are means over their shares; with equal shares the average of those gradients is the
gradient of the whole batch's mean loss, so N learners on ``B / N`` transitions each follow one learner on ``B``
up to the rounding of floating-point sums.

Rendezvous and trust. The group meets through a ``TCPStore`` that rank 0 serves at an address the launcher gives
every learner (torch binds it on every interface of rank 0's host, whatever address is given). A store has no
authentication of its own, so every value a learner writes to it is tagged here (:class:`SignedStore`: HMAC-SHA256
keyed by the run's secret, over the group's ``session`` nonce, the key and the value) and every value read is
checked before torch sees it. A process without the secret that reaches the store can delay or break the rendezvous
(it can delete keys or bump counters), which ends in a :class:`DataParallelError`, but it cannot point a learner at
an address of its choosing, and values recorded in another rendezvous (another session) are refused. The gloo
connections that carry the tensors afterwards are plain TCP, neither authenticated nor encrypted: whoever can reach
the learners' ports can read gradients and inject bytes into a collective. Only tensors travel on them (this module
never sends a pickled object, so no injected bytes are ever unpickled), but forged gradients would corrupt the
weights; keep the learners on a private network (``GLOO_SOCKET_IFNAME`` names the interface): unlike the nng data
plane, no message of theirs is authenticated.

Every collective runs under the group's ``timeout``: a learner that fails or stops answering ends the others with a
:class:`DataParallelError` naming the rank and the cause, never a hang. Statistics a loss takes over its whole
batch, or a decision to step, are taken over the group (:meth:`DataParallel.mean`, :meth:`DataParallel.mean_std`;
PPO's advantage normalisation and ``target_kl``), and so are running statistics a policy keeps of the data it
learns from (:meth:`DataParallel.all_gather`: PPO's observation and reward normalisers).
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import time
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DataParallel", "DataParallelError", "SignedStore"]

_TAG_BYTES = 32


def _size(batch: Any, dim: int) -> int:
    """The size of a batch's dimension ``dim``: a tensor's, a sequence's (``dim`` 0), or a tree's (its first leaf's)."""
    if hasattr(batch, "keys") and hasattr(batch, "values"):  # a ttorch tree or a mapping: len() counts its keys
        for value in batch.values():
            return _size(value, dim)
        raise ValueError("DataParallel.shard: an empty batch tree has no size")
    return batch.shape[dim] if hasattr(batch, "shape") else len(batch)


class DataParallelError(RuntimeError):
    """A collective of the learners' group failed: another learner ended, timed out, or the rendezvous was broken."""


class SignedStore(dist.Store):
    """A ``torch.distributed`` store whose values are tagged with the run's secret and checked when read.

    ``inner`` is the store that carries the bytes (a ``TCPStore``); ``session`` is a nonce of this rendezvous, so
    a value recorded in another one is refused. Counters (``add``) cannot be tagged: tampering with them can only
    break the rendezvous, which then fails with its timeout.
    """

    def __init__(self, inner: dist.Store, secret: bytes, session: bytes) -> None:
        super().__init__()
        if type(secret) is not bytes or len(secret) < 16:
            raise ValueError("SignedStore needs the run's secret as at least 16 bytes (see load_secret)")
        self._inner, self._secret, self._session = inner, secret, bytes(session)

    def _tag(self, key: str, value: bytes) -> bytes:
        message = b"%d:%s%d:%s" % (len(self._session), self._session, len(key.encode()), key.encode()) + value
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def set(self, key: str, value: bytes | str) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._tag(key, value) + value)

    def get(self, key: str) -> bytes:
        raw = self._inner.get(key)
        tag, value = raw[:_TAG_BYTES], raw[_TAG_BYTES:]
        if len(tag) != _TAG_BYTES or not hmac.compare_digest(tag, self._tag(key, value)):
            raise DataParallelError(f"the learners' rendezvous store holds a value under {key!r} that is not signed "
                                    "with this run's secret and session: refused (a process without the secret wrote "
                                    "to the store, or a learner of another run shares its address)")
        return value

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)


class DataParallel:
    """This process's membership of the learners' group: rank ``rank`` of ``world_size``.

    Made in two steps, so the rendezvous address can travel before anyone waits on it: the constructor only
    binds (rank 0) or names (the others) the store at ``host:port``, and :meth:`connect` forms the group, which
    returns once every learner has connected. Rank 0 may pass ``port=0`` for a free port, then hand
    :attr:`port` to the others over an authenticated channel before calling :meth:`connect`. ``secret`` is the
    run's secret and ``session`` a fresh nonce of this rendezvous, both the same for every learner. ``timeout``
    (seconds) bounds the rendezvous and every collective. ``backend`` defaults to NCCL for a CUDA ``device``,
    gloo otherwise. ``bucket_bytes`` is the size of the gradient buckets :meth:`backward` all-reduces as they fill
    (DDP's first bucket is as large: small enough to start early, large enough that few messages travel).
    """

    def __init__(self, rank: int, world_size: int, *, host: str, port: int, secret: bytes, session: bytes,
                 timeout: float = 60.0, device: str | torch.device = "cpu", backend: str | None = None,
                 bucket_bytes: int = 1 << 20) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"DataParallel: rank must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.timeout = datetime.timedelta(seconds=timeout)
        self._host, self._secret, self._session = host, secret, bytes(session)
        self._store: dist.TCPStore | None = None
        self.port = port
        self.bucket_bytes = bucket_bytes
        self.wait_s = 0.0  # seconds spent waiting for gradient all-reduces after backward passes: what overlap missed
        if rank == 0:
            self._store = self._call(dist.TCPStore, "binding the rendezvous store", host, port, world_size,
                                     is_master=True, timeout=self.timeout, wait_for_workers=False)
            self.port = self._store.port

    def connect(self) -> "DataParallel":
        """Form the group with the other learners (each calls it); returns ``self``."""
        if dist.is_initialized():
            raise RuntimeError("DataParallel: this process is already in a torch.distributed group; one learner "
                               "group per process")
        if self._store is None:
            self._store = self._call(dist.TCPStore, "reaching the rendezvous store", self._host, self.port,
                                     self.world_size, is_master=False, timeout=self.timeout)
        if self.backend == "nccl" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # NCCL's own work (its barrier) on this learner's GPU, not rank-th
        self._call(dist.init_process_group, "the rendezvous", backend=self.backend,
                   store=SignedStore(self._store, self._secret, self._session), rank=self.rank,
                   world_size=self.world_size, timeout=self.timeout)
        return self

    def _call(self, fn: Any, what: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DataParallelError:
            raise
        except (RuntimeError, dist.DistError) as exc:
            raise DataParallelError(f"learner rank {self.rank} of {self.world_size}: {what} with the other learners "
                                    f"failed (one ended, or none answered within {self.timeout.total_seconds():g} s): "
                                    f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc

    def shard(self, batch: Any, dim: int = 0) -> Any:
        """This learner's share of a batch every learner holds whole: the ``rank``-th of ``world_size`` contiguous
        slices along ``dim`` (equal where its size divides by the group's size); ``dim=1`` for the sequences
        ``[L, B]`` of a recurrent policy."""
        size = _size(batch, dim)
        start, stop = size * self.rank // self.world_size, size * (self.rank + 1) // self.world_size
        return batch[start:stop] if dim == 0 else batch[(slice(None),) * dim + (slice(start, stop),)]

    def mean(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The mean of ``x`` over every learner's share (only where ``mask`` is 1, when given), in one all-reduce:
        what one learner would compute on the whole batch, and the same number on every learner, so a decision
        taken on it (PPO's ``target_kl`` early stop) is taken alike everywhere."""
        weight = torch.ones_like(x) if mask is None else mask.to(x.dtype)
        sums = torch.stack([(x * weight).sum(), weight.sum()])
        self._call(dist.all_reduce, "an all-reduce of batch statistics", sums)
        return sums[0] / sums[1].clamp(min=1)

    def all_reduce(self, x: torch.Tensor, op: str, what: str = "an all-reduce") -> torch.Tensor:
        """Reduce ``x`` in place over the group with ``op`` (``"sum"``, ``"min"`` or ``"max"``), under the group's
        timeout; returns it. ``what`` names the collective in a failure's message."""
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"DataParallel.all_reduce(op={op!r}): must be one of {sorted(ops)}")
        self._call(dist.all_reduce, what, x, op=ops[op])
        return x

    def all_gather(self, x: torch.Tensor, what: str = "an all-gather") -> torch.Tensor:
        """Every learner's ``x`` (of one shape and dtype on all), stacked in rank order: ``[world_size, *x.shape]``,
        the same on every learner, under the group's timeout. ``what`` names the collective in a failure's message."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._call(dist.all_gather, what, parts, x.contiguous())
        return torch.stack(parts)

    def mean_std(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean and (population) standard deviation of ``x`` over every learner's share, as :meth:`mean`, for
        statistics a loss takes over its batch (PPO's advantage normalisation); two all-reduces."""
        mean = self.mean(x, mask)
        return mean, self.mean((x - mean).pow(2), mask).sqrt()

    def backward(self, loss: torch.Tensor, parameters: Iterable[torch.Tensor]) -> None:
        """``loss.backward()``, with each of ``parameters``' gradients averaged over the group as
        :meth:`average_gradients` does, but all-reduced in buckets while the backward pass still runs.

        As torch's ``DistributedDataParallel`` does: a backward pass yields the last layers' gradients first, so
        a bucket of them travels while the earlier layers' gradients are computed, and only what is left when the
        pass ends is waited for (:attr:`wait_s`). The sums are those of one all-reduce, so the result is the same.
        """
        buckets = _GradientBuckets(self, parameters)
        hooks = [p.register_post_accumulate_grad_hook(buckets.ready) for p in buckets.params if p.requires_grad]
        try:
            loss.backward()
        finally:
            for hook in hooks:
                hook.remove()
        buckets.finish()

    def average_gradients(self, parameters: Iterable[torch.Tensor]) -> None:
        """Replace each parameter's gradient by its mean over the group (after a backward pass: :meth:`backward`
        overlaps the two).

        A parameter without a gradient on some learners counts as zero there; one with no gradient on any keeps
        ``None``, so optimizers skip it as they would in one process.
        """
        _GradientBuckets(self, parameters).finish()

    def broadcast_modules(self, modules: Iterable[nn.Module]) -> None:
        """Copy rank 0's parameters and buffers of ``modules`` to every learner (tensors only, in place)."""
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                with torch.no_grad():
                    self._call(dist.broadcast, "broadcasting rank 0's weights", tensor.data, src=0)

    def barrier(self) -> None:
        """Wait until every learner got here (bounded by the group's timeout)."""
        self._call(dist.monitored_barrier if self.backend == "gloo" else dist.barrier, "a barrier",
                   **({"timeout": self.timeout} if self.backend == "gloo" else {}))

    def close(self) -> None:
        """Leave the group (also where the others have already failed)."""
        if dist.is_initialized():
            dist.destroy_process_group()


class _GradientBuckets:
    """One gradient averaging over the group: ``parameters`` in buckets of about ``group.bucket_bytes``, in
    reverse order (a backward pass yields the last layers' gradients first), each all-reduced as one flat tensor
    with a has-a-gradient flag per parameter.

    :meth:`ready` (a post-accumulate-grad hook) launches a bucket once all its gradients are in; buckets launch in
    index order only, so every learner issues the same collectives in the same order even where the two passes
    finish their gradients apart. A parameter that requires a gradient but gets none in this pass holds its bucket
    and those after it back to :meth:`finish`, so ``parameters`` come in the order a model defines its layers.
    :meth:`finish` launches the rest (parameters without a gradient here count as zero), waits for all and
    installs the means as views of the buckets.
    """

    def __init__(self, group: DataParallel, parameters: Iterable[torch.Tensor]) -> None:
        self.group, self.params = group, list(parameters)
        self.buckets: list[list[int]] = []
        size = group.bucket_bytes
        for i in reversed(range(len(self.params))):
            nbytes = self.params[i].numel() * self.params[i].element_size()
            if size + nbytes > group.bucket_bytes and (not self.buckets or self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        self.bucket_of = {id(self.params[i]): k for k, bucket in enumerate(self.buckets) for i in bucket}
        self.missing = [sum(self.params[i].requires_grad for i in bucket) for bucket in self.buckets]
        self.flats: list[torch.Tensor] = []
        self.works: list[Any] = []

    def ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is complete: launch every bucket, in order, whose gradients all are."""
        self.missing[self.bucket_of[id(param)]] -= 1
        while len(self.flats) < len(self.buckets) and self.missing[len(self.flats)] <= 0:
            self._launch()

    def _launch(self) -> None:
        params = [self.params[i] for i in self.buckets[len(self.flats)]]
        grads = [p.grad for p in params]
        like = next((g for g in grads if g is not None), params[0])
        flat = torch.empty(sum(p.numel() for p in params) + len(params), dtype=like.dtype, device=like.device)
        offset = 0
        for p, g in zip(params, grads):
            if g is None:
                flat[offset:offset + p.numel()].zero_()
            else:
                flat[offset:offset + p.numel()].copy_(g.reshape(-1))
            offset += p.numel()
        flat[offset:] = torch.tensor([g is not None for g in grads], dtype=flat.dtype)
        self.works.append(self.group._call(dist.all_reduce, "the gradient all-reduce", flat, async_op=True))
        self.flats.append(flat)

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for every bucket and set each gradient to its mean."""
        start = time.perf_counter()
        while len(self.flats) < len(self.buckets):
            self._launch()
        for work in self.works:
            self.group._call(work.wait, "the gradient all-reduce")
        self.group.wait_s += time.perf_counter() - start
        for bucket, flat in zip(self.buckets, self.flats):
            count = sum(self.params[i].numel() for i in bucket)
            flat[:count] /= self.group.world_size
            offset = 0
            for i, present in zip(bucket, flat[count:].tolist()):
                p = self.params[i]
                p.grad = None if present == 0 else flat[offset:offset + p.numel()].view_as(p)  # views: no copy
                offset += p.numel()
