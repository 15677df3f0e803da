"""Where the nodes of a job are: Slurm's or a Kubernetes indexed Job's environment read into ``Parallel.runner``
arguments, and the table of every node's id, roles, pid and address (``nodes.json``).

Slurm: ``srun -N2 -n4 conveyor task ...`` starts the same command once per task. Each task reads
``SLURM_PROCID`` (its rank), ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST`` (else ``SLURM_NODELIST``) and, when
several tasks share a host, ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``); tasks are laid
out on the hosts in Slurm's default block order. Each task becomes one node: node id = its rank, listening
on its host at ``port + rank``, dialing every other task. Across hosts every task must load the same
secret (``--secret-file`` on a shared file system, or ``$CONVEYOR_SECRET``).

Kubernetes: an indexed Job (``completionMode: Indexed``) starts one pod per node; each reads its rank from
``JOB_COMPLETION_INDEX`` (set by Kubernetes), the number of nodes from ``CONVEYOR_NODES`` and the host of
every rank from ``CONVEYOR_NODE_HOST``, a template with ``{index}`` (``train-{index}.train``: the pod's own
DNS name under the Job's headless Service, so node 0 is ``train-0.train``), both set by the manifest
(``conveyor k8s-manifest`` writes one). As under Slurm, node id = rank, listening at ``port + rank``, dialing
every other node; the secret comes from a Kubernetes Secret mounted as a file.

Node table: every node publishes its :func:`node_record` on :data:`NODES_TOPIC`; a :class:`NodeTable`
(on one node, e.g. the learner) gathers them and rewrites a JSON file as nodes join, so users can see
which process is which. A node writes only its own row: a row is kept only from the node it describes (the
router's authenticated sender), in :func:`node_record`'s schema (short strings, an int pid), and the table
holds at most :data:`MAX_ROWS` rows; any other row is refused, counted and logged at a bounded rate.
"""
from __future__ import annotations

import json
import logging
import os
import re
import reprlib
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

from conveyor.engine.ratelimit import RateLimitedLog
from conveyor.engine.task import Role, task

__all__ = ["DEFAULT_PORT", "HOST_ENV", "KubernetesError", "MAX_ROWS", "NODES_ENV", "NODES_TOPIC", "NodeTable",
           "SlurmError", "SlurmTask", "kubernetes_task", "node_record", "row_problem", "slurm_task", "write_text_whole"]

log = logging.getLogger(__name__)

def write_text_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file beside it, renamed over it): a reader never
    sees half a file, also when the writer is killed mid-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


DEFAULT_PORT = 29650
"""The first port of a Slurm or Kubernetes job's nodes when none is given (node ``r`` listens on
``DEFAULT_PORT + r``)."""

NODES_ENV = "CONVEYOR_NODES"
"""In a Kubernetes indexed Job: how many nodes (pods) the job has, set by the manifest."""

HOST_ENV = "CONVEYOR_NODE_HOST"
"""In a Kubernetes indexed Job: the host of node ``i`` with ``{index}`` for ``i``, set by the manifest."""

NODES_TOPIC = "conveyor.cluster.nodes"
"""Every node -> the node keeping the table: its :func:`node_record`."""

MAX_ROWS = 1024
"""The most rows a :class:`NodeTable` keeps (a row per node; a peer with the secret may make up node ids)."""
_MAX_TEXT = 255  # characters of a host name (RFC 1035's bound), an address, a label, a role
_MAX_ITEMS = 64  # roles or labels of one row
_MAX_ID, _MAX_PID = 1 << 31, 1 << 22  # Linux pids stay below 2**22 (pid_max's ceiling)

_COUNTS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class SlurmError(ValueError):
    """Slurm's environment is missing a variable or holds one that cannot be read."""


class KubernetesError(ValueError):
    """A Kubernetes indexed Job's environment is missing a variable or holds one that cannot be read."""


@dataclass(frozen=True)
class SlurmTask:
    """This process's place in a job of one task per node (a Slurm job step, a Kubernetes indexed Job): its rank
    and the host of every task, by rank."""

    rank: int
    hosts: List[str]

    @property
    def n_tasks(self) -> int:
        """How many tasks the step has."""
        return len(self.hosts)

    def runner_arguments(self, port: int = DEFAULT_PORT) -> Dict[str, Any]:
        """``Parallel.runner`` keyword arguments that make this task node ``rank``: one worker listening on its
        host at ``port + rank`` and attached to every other task."""
        if not isinstance(port, int) or not 0 < port or port + self.n_tasks > 65536:
            raise SlurmError(f"port {port!r}: tasks listen on port + rank, so it must be an int in "
                             f"1..{65536 - self.n_tasks}")
        urls = [f"tcp://{_bracketed(host)}:{port + rank}" for rank, host in enumerate(self.hosts)]
        return {"n_parallel_workers": 1, "protocol": "tcp", "address": self.hosts[self.rank],
                "ports": [port + self.rank], "node_ids": [self.rank],
                "attach_to": urls[:self.rank] + urls[self.rank + 1:]}


def slurm_task(environ: Optional[Mapping[str, str]] = None) -> Optional[SlurmTask]:
    """This process's Slurm task, read from ``environ`` (default ``os.environ``); None outside a Slurm step
    (``SLURM_PROCID`` unset) or in a step of one task."""
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env:
        return None
    rank, n_tasks = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if n_tasks < 1 or not 0 <= rank < n_tasks:
        raise SlurmError(f"SLURM_PROCID={rank} is not a rank of SLURM_NTASKS={n_tasks} tasks")
    if n_tasks == 1:
        return None
    name = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_NODELIST"
    if name not in env:
        raise SlurmError("SLURM_PROCID is set but neither SLURM_STEP_NODELIST nor SLURM_NODELIST is: run under srun")
    import hostlist  # python-hostlist: Slurm's own syntax, node[01-03,07],gpu5, with its edge cases
    try:
        nodes = hostlist.expand_hostlist(env[name])
    except hostlist.BadHostlist as e:
        raise SlurmError(f"{name}={env[name]!r} is not a Slurm host list: {e}") from None
    per_node = _tasks_per_node(env, len(nodes), n_tasks)
    hosts = [host for host, count in zip(nodes, per_node) for _ in range(count)]
    if len(hosts) != n_tasks:
        raise SlurmError(f"{name} and the tasks per node give {len(hosts)} tasks, but SLURM_NTASKS={n_tasks}")
    return SlurmTask(rank, hosts)


def kubernetes_task(environ: Optional[Mapping[str, str]] = None) -> Optional[SlurmTask]:
    """This pod's place in a Kubernetes indexed Job, read from ``environ`` (default ``os.environ``): rank
    ``JOB_COMPLETION_INDEX``, :data:`NODES_ENV` nodes whose hosts :data:`HOST_ENV` names; None outside an
    indexed Job (``JOB_COMPLETION_INDEX`` unset) or in a job of one node."""
    env = os.environ if environ is None else environ
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    fix = "the manifest sets it (conveyor k8s-manifest writes one)"
    values = []
    for name in ("JOB_COMPLETION_INDEX", NODES_ENV):
        if name not in env:
            raise KubernetesError(f"JOB_COMPLETION_INDEX is set but {name} is not: {fix}")
        try:
            values.append(int(env[name]))
        except ValueError:
            raise KubernetesError(f"{name}={env[name]!r} is not an integer") from None
    rank, n_nodes = values
    if n_nodes < 1 or not 0 <= rank < n_nodes:
        raise KubernetesError(f"JOB_COMPLETION_INDEX={rank} is not a rank of {NODES_ENV}={n_nodes} nodes")
    if n_nodes == 1:
        return None
    template = env.get(HOST_ENV, "")
    try:
        hosts = [template.format(index=i) for i in range(n_nodes)]
    except (KeyError, IndexError, ValueError):
        hosts = [""]
    if not all(hosts):
        raise KubernetesError(f"{HOST_ENV}={template!r}: expected the host of node {{index}}, e.g. "
                              f"'train-{{index}}.train' (pod train-<index> under the headless Service train); {fix}")
    return SlurmTask(rank, hosts)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise SlurmError(f"SLURM_PROCID is set but {name} is not: run under srun") from None
    except ValueError:
        raise SlurmError(f"{name}={env[name]!r} is not an integer") from None


def _tasks_per_node(env: Mapping[str, str], n_nodes: int, n_tasks: int) -> List[int]:
    """Tasks on each node, from Slurm's compressed ``2(x3),1`` form, else spread evenly in blocks."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in env:
            counts: List[int] = []
            for part in env[name].split(","):
                match = _COUNTS.match(part.strip())
                if match is None:
                    raise SlurmError(f"{name}={env[name]!r}: expected counts such as '2(x3),1'")
                counts += [int(match.group(1))] * int(match.group(2) or 1)
            if len(counts) != n_nodes:
                raise SlurmError(f"{name}={env[name]!r} names {len(counts)} nodes, the node list {n_nodes}")
            return counts
    if n_tasks % n_nodes:
        raise SlurmError(f"{n_tasks} tasks on {n_nodes} nodes: set SLURM_STEP_TASKS_PER_NODE (srun does) to say "
                         f"which node runs which task")
    return [n_tasks // n_nodes] * n_nodes


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def node_record() -> Dict[str, Any]:
    """This process as one row of the node table: ``node_id``, ``roles``, ``pid``, ``host``, ``address``,
    ``labels``. Roles: those added with ``task.add_role`` (every role when none was)."""
    router = task.router
    roles = task.roles or frozenset(Role)
    return {"node_id": getattr(router, "node_id", 0), "roles": sorted(role.value for role in roles),
            "pid": os.getpid(), "host": socket.gethostname(), "address": getattr(router, "address", None),
            "labels": sorted(task.labels)}


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _MAX_TEXT


def _count(value: Any, below: int, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < below


def row_problem(row: Any) -> Optional[str]:
    """What makes ``row`` no :func:`node_record` (None if it is one): its keys, ``node_id`` an int in
    ``[0, 2**31)``, ``pid`` one in ``[1, 2**22)``, ``host`` a string of 1 to 255 characters, ``address`` one or
    None, ``roles`` and ``labels`` lists of at most 64 such strings (roles among :class:`Role`'s values)."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not a dict"
    if set(row) != _ROW_KEYS:
        return f"keys {sorted(map(str, row))[:8]}, expected {sorted(_ROW_KEYS)}"
    roles = {role.value for role in Role}
    for key, ok in (("node_id", _count(row["node_id"], _MAX_ID)), ("pid", _count(row["pid"], _MAX_PID, 1)),
                    ("host", _text(row["host"])), ("address", row["address"] is None or _text(row["address"])),
                    ("roles", _texts(row["roles"]) and set(row["roles"]) <= roles), ("labels", _texts(row["labels"]))):
        if not ok:
            return f"{key} cannot be {reprlib.repr(row[key])}"
    return None


def _texts(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= _MAX_ITEMS and all(_text(v) for v in value)


_ROW_KEYS = frozenset(("node_id", "roles", "pid", "host", "address", "labels"))


class NodeTable:
    """Gathers every node's :func:`node_record` and keeps them in the JSON file ``path`` (rewritten atomically
    as nodes join), beginning with this node's own. The other nodes call :meth:`announce`. ``keep``: start
    from the rows already in the file (a restarted node keeps those of the peers that announced to its
    previous life). A received row is kept only from the node it describes, where :func:`row_problem` finds
    nothing and the table has room (:data:`MAX_ROWS`); :meth:`stats` counts the others."""

    def __init__(self, path: Union[str, "os.PathLike[str]"], keep: bool = False) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._rows: Dict[int, Dict[str, Any]] = {}
        self._rejected = 0
        self._log = RateLimitedLog(log)
        if keep and self.path.is_file():
            self._rows = {row["node_id"]: row for row in json.loads(self.path.read_text())[:MAX_ROWS]
                          if row_problem(row) is None}
        self._router = router = task.router
        if router is not None and getattr(router, "is_active", True):
            router.on(NODES_TOPIC, self._received)
        self._add(node_record())

    def stats(self) -> Dict[str, int]:
        """``rejected``: rows refused (another node's, not a :func:`node_record`, or beyond :data:`MAX_ROWS`)."""
        with self._lock:
            return {"rejected": self._rejected}

    def _received(self, record: Any) -> None:
        """A peer's row (on the router's delivery thread): kept, or refused, counted and logged."""
        sender = getattr(self._router, "sender", None)
        why = row_problem(record)
        if why is None and sender is not None and str(record["node_id"]) != str(sender):
            why = f"it describes node {record['node_id']}, not its sender"
        if why is None and record["node_id"] not in self._rows and len(self._rows) >= MAX_ROWS:
            why = f"the table already holds {MAX_ROWS} rows, the limit"
        if why is None:
            self._add(record)
            return
        with self._lock:
            self._rejected += 1
            count = self._rejected
        self._log.log("row", "node table %s: refused a row from node %s: %s (%d refused so far)", self.path,
                      sender, why, count)

    @property
    def rows(self) -> List[Dict[str, Any]]:
        """The records gathered so far, by node id."""
        with self._lock:
            return [self._rows[k] for k in sorted(self._rows)]

    def _add(self, record: Dict[str, Any]) -> None:
        with self._lock:
            self._rows[int(record["node_id"])] = dict(record)
            write_text_whole(self.path, json.dumps([self._rows[k] for k in sorted(self._rows)], indent=2) + "\n")

    @staticmethod
    def announce(timeout_s: float = 60.0) -> None:
        """Send this node's record to the node keeping the table, once it listens (``TimeoutError`` after
        ``timeout_s``)."""
        router = task.router
        router.wait_for_subscribers(NODES_TOPIC, 1, timeout=timeout_s)
        router.publish(NODES_TOPIC, node_record())
