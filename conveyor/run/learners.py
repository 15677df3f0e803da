"""Data-parallel learners in a distributed run (``--learners L``): nodes ``0..L-1`` train one policy together.

The mechanism is :class:`conveyor.policy.DataParallel` (a ``torch.distributed`` group whose gradients are averaged
in every step); this module fits it into the zoo's layout (conveyor/run/nodes.py):

- Rendezvous (:func:`join_learners`): rank 0 (node 0) binds the group's store on a free port of its host and sends
  ``{"host", "port", "session"}`` on :data:`LEARNERS_TOPIC` over the run's router (authenticated with the run's
  secret) to the other learners; the store's values are signed with that secret (``SignedStore``), so the group is
  not joinable without it. Every learner then joins and takes rank 0's weights.
- Data: collector ``i`` (the i-th, from 0) sends to learner ``i mod L`` only (its ``ContextExchanger`` publishes on
  that learner's topic), so nothing is sent twice; each learner counts what it received, by collector.
- Agreement (:class:`LearnerSync`, after the exchangers on every learner): once per iteration, before anything
  trains, the learners all-reduce what they received (so every ``ctx.env_step`` is the run's, and
  ``OffPolicyLearner`` takes the same number of gradient steps everywhere), whether any of them is ending, the
  smallest replay shard (:class:`ShardBuffer`: training starts when every shard holds its part of
  ``learning_starts``, one iteration after the last one got there) and, for an entry without a replay buffer, the
  fewest rows of ``ctx.train_data`` (below). A learner that ends its run first (its collectors gone, a stop heard)
  makes one last such all-reduce, marked as an end, which the others meet in their next iteration; so every learner
  runs the same gradient steps and no collective waits for nothing.
- On-policy data (PPO's rollouts, IMPALA's unrolls: entries without a replay buffer): every learner trains, in each
  iteration, on the same number of rows (transitions, or unrolls) of what it received, the smallest number any
  learner received (:func:`newest_rows`): the newest ones, and the older rows beyond them are dropped, never kept
  for a later iteration (they were collected by older weights, and a backlog kept on the learner whose collectors
  are faster would only grow staler), and counted (:attr:`LearnerSync.dropped`, in env steps). The trainers' own
  loops (PPO's epochs of minibatches, IMPALA's batches of unrolls) then take the same number of steps everywhere:
  each learner's minibatch is ``batch_size / L`` (:func:`~conveyor.run.nodes.learner_share`), so the group's
  is ``batch_size``, and PPO's ``target_kl`` early stop and advantage normalisation are taken over the group
  (:meth:`DataParallel.mean`), as are its observation and reward statistics (``PPOPolicy``'s ``gather``).
- Replay: each learner's buffer is its shard; a step samples ``batch_size / L`` from it (the group's batch stays
  ``batch_size``), and a prioritized update goes to the shard it sampled from: the sample is local, so the shard
  that owns it is this one, by construction.
- Failure: a collective that fails (another learner died, or stopped answering within the group's timeout) ends
  this learner's run normally (rank 0 writes its final checkpoint: the failed step never stepped) and
  :class:`~conveyor.run.Run` raises the :class:`~conveyor.policy.DataParallelError` afterwards.
"""
from __future__ import annotations

import hashlib
import logging
import math
import secrets
import threading
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple
from urllib.parse import urlparse

import torch

from conveyor.data.batch import sample_dim
from conveyor.engine import FINISH_EVENT, OnlineRLContext, declares, task
from conveyor.middleware.messages import Rejections, check_fields
from conveyor.policy import DataParallel, DataParallelError
from conveyor.schema import ConfigError

__all__ = ["LEARNERS_TOPIC", "LearnerSync", "ShardBuffer", "check_learner_gpus", "join_learners", "learner_device",
           "learner_local_rank",
           "newest_rows", "parameters_digest"]

log = logging.getLogger("conveyor.run")

LEARNERS_TOPIC = "conveyor.zoo.learners"
"""Rank 0 -> the other learners: ``{"host", "port", "session"}`` of the group's rendezvous store."""


def _host(address: str) -> str:
    """The host of a router address: a tcp address's, else (ipc: every node on this host) loopback."""
    parsed = urlparse(address)
    return parsed.hostname if parsed.scheme == "tcp" and parsed.hostname else "127.0.0.1"


def join_learners(policy: Any, rank: int, world_size: int, timeout_s: float) -> DataParallel:
    """Form the learners' group (every learner calls it, inside ``task.start``) and join ``policy`` to it; returns
    the group. Rank 0 serves the rendezvous and sends its address over the router; the others wait for it (at most
    ``timeout_s``, which also bounds every collective of the group)."""
    router = task.router
    device = getattr(policy, "device", "cpu")
    if rank == 0:
        session = secrets.token_bytes(16)
        host = _host(router.address)
        group = DataParallel(0, world_size, host=host, port=0, secret=router.secret, session=session,
                             timeout=timeout_s, device=device)
        router.wait_for_subscribers(LEARNERS_TOPIC, world_size - 1, timeout=timeout_s)
        router.publish(LEARNERS_TOPIC, {"host": host, "port": group.port, "session": session.hex()})
    else:
        found: Dict[str, Any] = {}
        arrived = threading.Event()
        rejections = Rejections(f"the learners' rendezvous on node {router.node_id}")

        def got(payload: Any) -> None:
            check_fields(payload, host=lambda v: isinstance(v, str),
                         port=lambda v: isinstance(v, int) and 0 < v < 65536,
                         session=lambda v: isinstance(v, str) and len(v) == 32)
            found.update(payload)
            arrived.set()

        handler = rejections(got, LEARNERS_TOPIC)
        router.on(LEARNERS_TOPIC, handler)
        try:
            if not arrived.wait(timeout_s):
                raise DataParallelError(f"learner rank {rank}: learner rank 0 (node 0) sent no rendezvous address "
                                        f"within {timeout_s}s (live peers: {router.peers()}); is it running?")
        finally:
            router.off(LEARNERS_TOPIC, handler)
        group = DataParallel(rank, world_size, host=found["host"], port=found["port"], secret=router.secret,
                             session=bytes.fromhex(found["session"]), timeout=timeout_s, device=device)
    group.connect()
    policy.learn_mode.join_data_parallel(group)
    return group


def learner_local_rank(node_id: int, started_here: Sequence[int], learners: int, environ: Mapping[str, str]) -> int:
    """Learner ``node_id``'s rank among the learners on its host. A launch that started several nodes here (the
    local launcher, or one host's ``--node-ids``) knows them: its index among the learner nodes it started. A launch
    of one node (one Slurm task, pod or Ray actor per node) takes Slurm's ``SLURM_LOCALID`` where set (the learners
    come first in Slurm's block order, so on each host they are its first tasks), else 0."""
    here = sorted(i for i in started_here if i < learners)
    slurm = environ.get("SLURM_LOCALID", "")
    if len(started_here) == 1 and slurm.isdigit():
        return int(slurm)
    return here.index(node_id) if node_id in here else 0


def learner_device(device: str, local_rank: int, device_count: Callable[[], int]) -> str:
    """Where a learner of several puts its policy: ``device`` (``policy.device``) as configured, but a plain
    ``'cuda'`` (no index) becomes ``cuda:<local_rank mod device_count()>``, so that the learners of one host spread
    over its GPUs instead of all taking the first. ``device_count`` (``torch.cuda.device_count``) is called for a
    plain ``'cuda'`` only, never for ``'cpu'``; where it sees no GPU, ``'cuda'`` stays for the policy to refuse."""
    parsed = torch.device(device)
    if parsed.type != "cuda" or parsed.index is not None:
        return str(parsed)
    count = device_count()
    return f"cuda:{local_rank % count}" if count > 0 else "cuda"


def check_learner_gpus(device: str, learners_here: int, device_count: Callable[[], int]) -> None:
    """Refuse, in one line and before any process starts, ``learners_here`` CUDA learners on one host that has fewer
    GPUs, or that all name one (``cuda:N``): NCCL takes one GPU per rank, and two ranks on one GPU fail as the
    group forms (torch's "INTERNAL ASSERT FAILED ... Not implemented" on an H100). ``device_count`` is asked only for a
    CUDA device."""
    parsed = torch.device(device)
    if parsed.type != "cuda" or learners_here < 2:
        return
    if parsed.index is not None:
        raise ConfigError(f"--learners: {learners_here} learners on this host all on policy.device='{device}'; NCCL "
                          f"needs one GPU per learner: set policy.device=cuda (each takes cuda:<local rank>)")
    count = device_count()
    if learners_here > count:
        raise ConfigError(f"--learners: {learners_here} learners on this host with policy.device=cuda, but torch sees "
                          f"{count} GPU(s) here; NCCL needs one GPU per learner: start at most {count} learner(s) on "
                          f"this host (--node-ids), or train on policy.device=cpu")


def _rows(data: Any) -> int:
    """The samples of a batch of on-policy data along its sample dim (:func:`~conveyor.data.batch.sample_dim`):
    transitions, IMPALA's unrolls or a recurrent policy's sequences (0 for none)."""
    return 0 if data is None else int(data.reward.shape[sample_dim(data)])


def _steps(data: Any) -> int:
    """The env steps a batch of on-policy data holds: its real steps (``mask``, in padded sequences), else every
    entry of its ``reward``."""
    if data is None:
        return 0
    return int(data.mask.sum()) if "mask" in data else math.prod(data.reward.shape)


def newest_rows(data: Any, rows: int) -> Tuple[Any, int]:
    """``data``'s last ``rows`` samples (rows, or sequences side by side; None for none) and the env steps in
    those left out. The exchanger joins the collectors' batches in the order they arrived, so the ones kept are the
    newest."""
    size = _rows(data)
    if rows >= size:
        return data, 0
    if rows <= 0:
        return None, _steps(data)
    kept = data[size - rows:] if sample_dim(data) == 0 else data[:, size - rows:]
    return kept, _steps(data) - _steps(kept)


def parameters_digest(policy: Any) -> str:
    """SHA-256 of every tensor of ``policy.state_dict()`` (networks and optimizer state), by key: equal on learners
    whose weights are bitwise equal."""
    digest = hashlib.sha256()

    def feed(key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(key.encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(value, dict):
            for name in sorted(value, key=str):
                feed(f"{key}.{name}", value[name])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                feed(f"{key}.{i}", item)

    state = policy.state_dict()
    feed("", {name: value for name, value in state.items() if name != "counters"})
    return digest.hexdigest()


class ShardBuffer:
    """This learner's shard of the run's replay buffer: ``extend`` and ``update_priority`` are the shard's own,
    ``sample(n)`` takes this rank's part of ``n`` (the group's samples add up to ``n``), and ``len()`` is what
    the group agreed on at the start of the iteration (:class:`LearnerSync`): ``L`` times the smallest shard, so
    a learner waiting for ``learning_starts`` waits for every shard. Everything else is the shard's."""

    def __init__(self, buffer: Any, group: DataParallel) -> None:
        self.shard, self._group = buffer, group
        self.agreed = 0

    def __len__(self) -> int:
        return self.agreed

    def sample(self, n: int) -> Any:
        """This rank's part of ``n`` transitions, from this shard."""
        rank, size = self._group.rank, self._group.world_size
        return self.shard.sample(n * (rank + 1) // size - n * rank // size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shard, name)

    def __repr__(self) -> str:
        return f"ShardBuffer(rank {self._group.rank} of {self._group.world_size}, {len(self.shard)} here)"


@declares(reads=("env_step", "env_episode", "train_data"), writes=("env_step", "env_episode", "train_data"),
          optional=("train_data",))
class LearnerSync:
    """Every learner's agreement once per iteration, after the exchangers and before the entry's middleware (see
    the module docstring): the run's ``env_step`` and ``env_episode`` (the sums of what each learner received),
    whether to end (any learner's ``task.finish``: the iteration then ends on every learner before anything
    trains, and what came in it is left out of the counters), the replay shards' agreed size (:meth:`shard`) and,
    with ``agree_rows`` (an entry without a replay buffer), the rows of ``ctx.train_data`` every learner trains on:
    the newest of what it received, as many as the learner that received fewest (:func:`newest_rows`).
    :attr:`received` counts the env steps this learner received and, with ``agree_rows``, :attr:`kept` those it
    handed on to train on (the same on every learner) and :attr:`dropped` those it left out (older rows beyond the
    agreed ones); :attr:`error` holds the group's failure, if any.

    Reads / writes ctx: ``env_step``, ``env_episode`` (this learner's, then the run's), ``train_data`` (with
    ``agree_rows``: what this learner received, then its agreed rows, None for none).
    """

    def __init__(self, group: DataParallel, agree_rows: bool = False) -> None:
        self.group = group
        self.agree_rows = agree_rows
        self.received = 0
        self.kept = 0
        self.dropped = 0
        self.error: Optional[DataParallelError] = None
        self._ended = False  # the group agreed to end, or failed: no collective follows
        self._step = int(getattr(task.ctx, "env_step", 0) or 0)
        self._episode = int(getattr(task.ctx, "env_episode", 0) or 0)
        self._buffer: Optional[ShardBuffer] = None
        task.on(FINISH_EVENT, self._finish)

    def __repr__(self) -> str:
        return f"LearnerSync(rank {self.group.rank} of {self.group.world_size})"

    def shard(self, buffer: Any) -> ShardBuffer:
        """``buffer`` as this learner's shard, its size agreed by the group."""
        self._buffer = ShardBuffer(buffer, self.group)
        return self._buffer

    def _agree(self, steps: int, episodes: int, end: bool, rows: int = 0) -> tuple:
        device = self.group.device  # NCCL reduces tensors on the GPU only
        sums = torch.tensor([steps, episodes, int(end)], dtype=torch.float64, device=device)
        self.group.all_reduce(sums, "sum", "the learners' agreement on the iteration")
        shard = len(self._buffer.shard) if self._buffer is not None else 0
        least = torch.tensor([shard, rows], dtype=torch.float64, device=device)
        self.group.all_reduce(least, "min", "the learners' agreement on the replay shards and the rows to train on")
        return int(sums[0]), int(sums[1]), bool(sums[2] > 0), int(least[0]), int(least[1])

    def __call__(self, ctx: OnlineRLContext) -> Iterator[None]:
        steps, episodes = ctx.env_step - self._step, ctx.env_episode - self._episode
        self.received += steps
        rows = _rows(ctx.train_data) if self.agree_rows else 0
        try:
            total_steps, total_episodes, end, smallest, rows = self._agree(steps, episodes, bool(task.finish), rows)
        except DataParallelError as exc:
            ctx.env_step, ctx.env_episode = self._step, self._episode  # the run's counters as the group last agreed
            self._failed(exc)
            task.end_iteration()
            yield
            return
        if end:  # what came in this iteration is not trained on: the run's counters stay as every learner has them
            ctx.env_step, ctx.env_episode = self._step, self._episode
            self._ended = True
            task.finish = True
            task.end_iteration()
            yield
            return
        self._step = ctx.env_step = self._step + total_steps
        self._episode = ctx.env_episode = self._episode + total_episodes
        if self._buffer is not None:
            self._buffer.agreed = smallest * self.group.world_size
        if self.agree_rows:
            ctx.train_data, dropped = newest_rows(ctx.train_data, rows)
            self.dropped += dropped
            self.kept += _steps(ctx.train_data)
        try:
            yield
        except DataParallelError as exc:  # a gradient all-reduce: the step failed before it stepped
            self._failed(exc)

    def _failed(self, exc: DataParallelError) -> None:
        log.error("learner rank %d: the learners' group failed, this learner ends its run: %s", self.group.rank, exc)
        self.error, self._ended = exc, True
        task.finish = True

    def _finish(self, error: Optional[BaseException]) -> None:
        """The run ended here: meet the others' next agreement with an end (unless the group already agreed to end
        or failed), then leave the group."""
        if not self._ended and error is None:
            try:
                self._agree(0, 0, True)
            except DataParallelError as exc:
                self._failed(exc)
        self._ended = True
        self.group.close()
