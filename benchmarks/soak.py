"""Soak (issue 34): do long runs grow? Two runs side by side for ``--minutes`` M, as a user starts them:

- ``conveyor train cartpole/dqn --collectors 2 --evaluators 1 --no-stop`` (1 learner, 2 collectors, 1 evaluator:
  four node processes and their launcher);
- ``conveyor train atari/ppo --async --no-stop`` (the trainer and its collector process).

Every ``--interval`` seconds (default 60) the benchmark samples each of their processes (found by a marker in their
environment, ``benchmarks._cluster.processes_with``): resident memory (``VmRSS``: the lowest of :data:`RSS_READS`
reads since the last sample), open file descriptors, threads, and the shared-memory files it maps (``/dev/shm``);
and the number of files in ``/dev/shm``. After a warm-up (default ``M / 3`` minutes: replay buffers fill, allocators
settle, the first checkpoints are written; on a loaded machine atari/ppo's trainer took more than 5 minutes), it
fits a least-squares line to each process's RSS and reports the steepest, in MB an hour; fds, threads and
shared-memory files are compared between the first and the last sample after the warm-up (a leak of one per minute
shows as growth, a steady count as 0). At the end both runs get SIGTERM (they write their final checkpoints) and
must end within 120 s.

    python -m benchmarks.soak --minutes 30            # the issue's figure: rss_growth_mb_per_h <= 20, the rest 0
    python -m benchmarks.soak --quick                 # 12 s, a sample every 2 s: a smoke run of the script

The last line is JSON: ``rss_growth_mb_per_h`` (the largest slope over processes), ``fd_growth``, ``thread_growth``,
``shm_growth`` (the largest growth over processes: of the /dev/shm files each maps), ``shm_dir_growth`` (files in
``/dev/shm`` at the end of the soak less at the end of the warm-up: every process's on this machine, so a figure only
where nothing else runs),
``minutes``, ``warmup_minutes``, ``samples``, ``processes`` (sampled), ``ended_cleanly`` (both runs ended on
SIGTERM with their final checkpoint).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from benchmarks._cluster import processes_with
from benchmarks._harness import print_json_line, scratch_dir

RUNS = {
    "dqn_dist": ["cartpole/dqn", "--collectors", "2", "--evaluators", "1"],
    "ppo_async": ["atari/ppo", "--async"],
}
QUICK_SETTINGS = {"ppo_async": ["--set", "env.collector_env_num=2", "--set", "policy.collect.n_sample=64",
                                 "--set", "policy.learn.batch_size=32"]}
"""Smaller Atari rollouts for ``--quick`` (the run updates within the smoke run)."""
RSS_READS = 12
"""RSS reads per process between two samples; a sample's RSS is their lowest. A trainer's RSS is a sawtooth (a
rollout's and an update's buffers come and go: +-50 MB for atari/ppo), and a slope fitted to points read at
arbitrary phases of it is noise of tens of MB an hour over 30 minutes; the floor is what a leak raises."""
END_S = 120.0
"""How long the runs get to end after SIGTERM (a final checkpoint each)."""


def sample(pid: int) -> Optional[Dict[str, Any]]:
    """One process's RSS (MB), open fds, threads and mapped /dev/shm files, or None when it has ended."""
    proc = Path(f"/proc/{pid}")
    try:
        status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        fds = len(os.listdir(proc / "fd"))
        shm = {line.split(None, 5)[-1] for line in (proc / "maps").read_text().splitlines()
               if "/dev/shm/" in line}
        name = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        name = name.split(" -m ", 1)[-1].split(" -c ", 1)[-1]  # after the interpreter: the module or the code
    except (OSError, ValueError):
        return None
    return {"rss_mb": int(status["VmRSS"].split()[0]) / 1024, "fds": fds, "threads": int(status["Threads"]),
            "shm": len(shm), "name": name}


def rss_mb(pid: int) -> Optional[float]:
    """A process's resident memory in MB, or None when it has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:")), None)


def shm_files() -> int:
    try:
        return len(os.listdir("/dev/shm"))
    except OSError:
        return 0


def slope_per_hour(times: List[float], values: List[float]) -> float:
    """Least-squares slope of ``values`` over ``times`` (seconds), per hour."""
    if len(times) < 3:
        return 0.0
    return float(np.polyfit(np.asarray(times) / 3600.0, np.asarray(values), 1)[0])


def start(name: str, argv: List[str], mark: str) -> subprocess.Popen:
    env = {**os.environ, "LAUNCHER_TEST": mark, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))}
    with open(f"{name}.out", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "conveyor", "train", *argv, "--exp-name", name, "--no-stop",
                                 "--max-env-step", str(10 ** 12), "--no-progress"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: Dict[str, subprocess.Popen]) -> bool:
    """SIGTERM to each run's process group; whether every run ended within ``END_S`` with its final checkpoint."""
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    clean = True
    for name, proc in procs.items():
        try:
            proc.wait(timeout=END_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group: the run's nodes too
            proc.wait()
            clean = False
        clean = clean and Path("runs", name, "ckpt", "final.pth.tar").is_file()
    return clean


def soak(minutes: float, interval: float, warmup: float, quick: bool) -> Dict[str, Any]:
    marks = {name: uuid.uuid4().hex for name in RUNS}
    procs = {name: start(name, [*argv, *(QUICK_SETTINGS.get(name, []) if quick else [])], marks[name])
             for name, argv in RUNS.items()}
    series: Dict[int, Dict[str, Any]] = {}  # pid -> its run, name and samples (t, sample)
    shm_total: List[tuple] = []
    floors: Dict[int, float] = {}  # pid -> its lowest RSS read since its last sample
    began = time.monotonic()
    try:
        while True:
            now = time.monotonic() - began
            for run, mark in marks.items():
                for pid in processes_with(mark):
                    got = sample(pid)
                    if got is not None:
                        got["rss_mb"] = min(got["rss_mb"], floors.pop(pid, got["rss_mb"]))
                        entry = series.setdefault(pid, {"run": run, "name": got["name"], "samples": []})
                        entry["samples"].append((now, got))
            shm_total.append((now, shm_files()))
            ended = [name for name, proc in procs.items() if proc.poll() is not None]
            if ended:
                tail = Path(f"{ended[0]}.out").read_text().strip().splitlines()[-5:]
                raise RuntimeError(f"run {ended[0]} ended before the soak did (exit {procs[ended[0]].returncode}): "
                                   + " | ".join(tail))
            if now >= minutes * 60:
                break
            for _ in range(RSS_READS - 1):  # the floor of the sawtooth between two samples
                time.sleep(max(0.0, now + interval * (_ + 1) / RSS_READS - (time.monotonic() - began)))
                for pid in series:
                    rss = rss_mb(pid)
                    if rss is not None:
                        floors[pid] = min(rss, floors.get(pid, rss))
            time.sleep(max(0.0, interval - (time.monotonic() - began - now)))
    finally:
        clean = stop(procs)
    return report(series, shm_total, minutes, warmup, clean)


def report(series: Dict[int, Dict[str, Any]], shm_total: List[tuple], minutes: float, warmup: float,
           clean: bool) -> Dict[str, Any]:
    rows = []
    for pid, entry in series.items():
        after = [(t, s) for t, s in entry["samples"] if t >= warmup * 60]
        if len(after) < 2:
            continue  # a short-lived helper (a zygote that handed over, a probe)
        first, last = after[0][1], after[-1][1]
        rows.append({"run": entry["run"], "pid": pid, "name": entry["name"][:60], "samples": len(after),
                     "rss_first": first["rss_mb"], "rss_last": last["rss_mb"],
                     "rss_mb_per_h": slope_per_hour([t for t, _ in after], [s["rss_mb"] for _, s in after]),
                     "fd_growth": last["fds"] - first["fds"], "thread_growth": last["threads"] - first["threads"],
                     "shm_growth": last["shm"] - first["shm"], "fds": last["fds"], "threads": last["threads"]})
    print(f"soak: {minutes:g} min, warm-up {warmup:g} min; per process after the warm-up")
    print(f"{'run':<10} {'pid':>7} {'RSS MB first':>12} {'last':>8} {'MB/h':>8} {'fds':>5} {'+fds':>5} "
          f"{'thr':>4} {'+thr':>5} {'+shm':>5}  command")
    for r in sorted(rows, key=lambda r: (r["run"], r["pid"])):
        print(f"{r['run']:<10} {r['pid']:>7} {r['rss_first']:>12.1f} {r['rss_last']:>8.1f} {r['rss_mb_per_h']:>8.1f} "
              f"{r['fds']:>5} {r['fd_growth']:>5} {r['threads']:>4} {r['thread_growth']:>5} {r['shm_growth']:>5}  "
              f"{r['name']}")
    if rows:  # the series behind the figure: a leak climbs, a warm-up levels off
        steep = max(rows, key=lambda r: r["rss_mb_per_h"])
        floors = [round(s["rss_mb"]) for t, s in series[steep["pid"]]["samples"] if t >= warmup * 60]
        print(f"steepest: pid {steep['pid']} ({steep['run']}), RSS MB a sample after the warm-up: {floors}")
    after = [n for t, n in shm_total if t >= warmup * 60]
    shm_dir_growth = after[-1] - after[0] if len(after) >= 2 else 0
    print(f"/dev/shm files: {after[0] if after else '-'} -> {after[-1] if after else '-'}")
    def worst(key: str) -> Any:
        return max((r[key] for r in rows), default=0)

    return {"rss_growth_mb_per_h": round(worst("rss_mb_per_h"), 2), "fd_growth": worst("fd_growth"),
            "thread_growth": worst("thread_growth"), "shm_growth": worst("shm_growth"),
            "shm_dir_growth": shm_dir_growth,
            "minutes": minutes, "warmup_minutes": warmup, "samples": max((r["samples"] for r in rows), default=0),
            "processes": len(rows), "ended_cleanly": clean}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long both runs go on (default 30)")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between samples (default 60)")
    parser.add_argument("--warmup", type=float, default=None, help="minutes left out of the fits (default M / 3)")
    parser.add_argument("--quick", action="store_true", help="12 s, a sample every 2 s, smaller Atari rollouts")
    args = parser.parse_args()
    minutes, interval = (12 / 60, 2.0) if args.quick else (args.minutes, args.interval)
    warmup = args.warmup if args.warmup is not None else minutes / 3
    if minutes <= 0 or interval <= 0 or not 0 <= warmup < minutes:
        parser.error("--minutes and --interval must be > 0 and --warmup within [0, --minutes)")
    with scratch_dir():
        figures = soak(minutes, interval, warmup, args.quick)
    print_json_line(figures)


if __name__ == "__main__":
    main()
