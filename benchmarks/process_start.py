"""Process start-up: the runner's zygote against multiprocessing's forkserver with a preload, paired in one run.

``Parallel.runner(3)`` brings up three ready nodes (router handshake done) running a trivial ``main`` that
imports torch, started either by the runner's own zygote (:class:`conveyor.processes.Zygote`: one
``python -c`` that imports torch and Conveyor, then forks each worker and passes it its socket by
SCM_RIGHTS) or by the standard library's forkserver with ``set_forkserver_preload`` (a fresh server per
launch, preloading the same modules; everything after the start, the handshake included, is the runner's
code in both). Figures per launch: ``ready_s``, from the call to the last worker entering ``main``, and
``total_s``, to the runner's return (workers stopped and reaped). The launches alternate (zygote first in
even pairs, forkserver first in odd ones) and the ratios are of the medians, forkserver over zygote: above
1 the zygote is faster. The runner keeps the zygote unless forkserver is within about 10% (a ratio
<= 1.1).

    python -m benchmarks.process_start [--quick] [--pairs N] [--workers N]

``--quick``: two pairs. The last line is JSON: ``workers``, ``pairs``, ``zygote_ready_s``,
``forkserver_ready_s``, ``zygote_total_s``, ``forkserver_total_s`` (medians) and ``ready_ratio``,
``total_ratio`` (forkserver / zygote).

Measured 2026-11-25 on 2 cores shared with five other sessions (load 6.1-7.8), 3 workers, 5 pairs: ready
zygote 7.92 s, forkserver 7.71 s (``ready_ratio`` 0.97); total 8.42 s against 9.07 s (``total_ratio`` 1.08).
As fast, within the noise; the runner keeps the zygote for what forkserver cannot give it (docs/benchmarks.md,
"Process start-up", which also lists the two earlier runs and why their figures do not count).
"""
from __future__ import annotations

import argparse
import ast
import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch  # noqa: F401  at module level, as in a zoo entry: both starters preload this module, so torch too

from benchmarks._harness import print_json_line
from conveyor.engine import Parallel
from conveyor.engine.parallel import launch
from conveyor.processes import preparation
from conveyor.processes._zygote import _forked_child

ENTRY = "conveyor.engine.parallel.worker:serve"


def trivial_main() -> float:
    """What every worker runs: use torch (preloaded by either starter), say when it got here."""
    torch.zeros(1)
    return time.monotonic()


class _ProcessHandle:
    """A forkserver child with the ``subprocess.Popen`` face the runner's supervision uses."""

    def __init__(self, proc: Any) -> None:
        self.proc, self.pid = proc, proc.pid

    def poll(self) -> Optional[int]:
        return self.proc.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.proc.exitcode

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()


def _forkserver_child(conn: Any) -> None:
    """In a forkserver child: the same life as a worker forked by the zygote (the runner's worker entry)."""
    module, _, function = ENTRY.partition(":")
    __import__(module)
    _forked_child(os.dup(conn.fileno()), getattr(sys.modules[module], function))


def main_imports() -> List[str]:
    """The modules the main script imports at its top level. The zygote imports the main module itself; Python
    3.11's forkserver ignores ``"__main__"`` in its preload list (it looks for a ``main_path`` key that the
    preparation data does not have), so a forkserver launch must name what the main module would import."""
    tree = ast.parse(open(sys.modules["__main__"].__file__).read())
    return [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names] + \
        [node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module and not node.level]


class ForkserverStarter:
    """What the runner needs of a zygote (``fork``, ``close``, ``kill``, ``ready_timeout_s``), done by a fresh
    forkserver that preloads ``modules`` and what the main script imports."""

    def __init__(self, modules: Sequence[str], ready_timeout_s: float) -> None:
        mp_forkserver._forkserver._stop()  # a fresh server per launch, as the zygote is
        self.context = mp.get_context("forkserver")
        preload = ["__main__", *main_imports(), *modules, ENTRY.partition(":")[0]]
        self.context.set_forkserver_preload(list(dict.fromkeys(preload)))
        self.ready_timeout_s = ready_timeout_s
        self.preparation = preparation("conveyor-zygote")

    def fork(self, name: str) -> tuple:
        ours, theirs = socket.socketpair()
        child_end = mp_connection.Connection(theirs.detach())
        proc = self.context.Process(target=_forkserver_child, args=(child_end,), name=name)
        proc.start()
        child_end.close()
        conn = mp_connection.Connection(ours.detach())
        conn.send(preparation(name))
        return _ProcessHandle(proc), conn

    def alive(self) -> bool:
        return True

    def kill(self) -> None:
        mp_forkserver._forkserver._stop()

    def close(self, grace_s: float) -> None:
        mp_forkserver._forkserver._stop()


def one_launch(workers: int, starter: str) -> Dict[str, float]:
    """Launch ``workers`` nodes with ``starter`` ("zygote" or "forkserver"); its ready and total seconds."""
    make_zygote = launch._zygote
    if starter == "forkserver":
        launch._zygote = ForkserverStarter
    try:
        start = time.monotonic()
        entered = Parallel.runner(workers, ready_timeout_s=120.0)(trivial_main)
        end = time.monotonic()
    finally:
        launch._zygote = make_zygote
    return {"ready_s": max(entered) - start, "total_s": end - start}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two pairs")
    parser.add_argument("--pairs", type=int, default=None, help="zygote/forkserver pairs (default 5; quick 2)")
    parser.add_argument("--workers", type=int, default=3, help="nodes per launch (default 3)")
    args = parser.parse_args(argv)
    pairs = args.pairs or (2 if args.quick else 5)
    runs: Dict[str, List[Dict[str, float]]] = {"zygote": [], "forkserver": []}
    load_before = round(os.getloadavg()[0], 2)
    print(f"{'pair':>4}  {'starter':<10}  {'ready_s':>8}  {'total_s':>8}", flush=True)
    for pair in range(pairs):
        order = ("zygote", "forkserver") if pair % 2 == 0 else ("forkserver", "zygote")
        for starter in order:
            figures = one_launch(args.workers, starter)
            runs[starter].append(figures)
            print(f"{pair:>4}  {starter:<10}  {figures['ready_s']:>8.3f}  {figures['total_s']:>8.3f}", flush=True)
    median: Callable[[str, str], float] = lambda starter, key: statistics.median(r[key] for r in runs[starter])
    summary: Dict[str, Any] = {"workers": args.workers, "pairs": pairs, "load_before": load_before,
                               "load_after": round(os.getloadavg()[0], 2)}
    for key in ("ready_s", "total_s"):
        summary[f"zygote_{key}"] = round(median("zygote", key), 3)
        summary[f"forkserver_{key}"] = round(median("forkserver", key), 3)
        summary[f"{key[:-2]}_ratio"] = round(median("forkserver", key) / median("zygote", key), 3)
    print(f"medians: zygote ready {summary['zygote_ready_s']} s, total {summary['zygote_total_s']} s; forkserver "
          f"ready {summary['forkserver_ready_s']} s, total {summary['forkserver_total_s']} s; forkserver / zygote: "
          f"ready {summary['ready_ratio']}, total {summary['total_ratio']}")
    print_json_line(summary)


if __name__ == "__main__":
    main()
