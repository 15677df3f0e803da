"""What the benchmark scripts share: the ``--worker`` self-call (one side measured in a fresh interpreter), sides
taken in turns, the final JSON line, peer frameworks installed into the running interpreter or into a virtualenv
of their own, a scratch folder, free ports, and reading a Conveyor run's TensorBoard log. Nothing here imports
torch or Conveyor at import time: a parent that only starts workers stays light, and a worker run by a peer's own
interpreter (which has no Conveyor dependencies) can import this module.

Peers (Stable-Baselines3, BenchMARL) are installed by the benchmark that compares against them, never copied into
the project, and imported only inside the measurement that uses them.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
"""The checkout holding this package: a worker imports ``benchmarks`` (and Conveyor) from here, as its parent."""


def ensure_package(requirement: str, module: str) -> None:
    """Import ``module`` or pip-install ``requirement`` into this interpreter first, saying so."""
    if importlib.util.find_spec(module) is not None:
        return
    print(f"{module} is missing: installing it with `{sys.executable} -m pip install {requirement}`", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", requirement], check=True)
    importlib.invalidate_caches()


PEER_CACHE = Path(os.environ.get("CONVEYOR_BENCHMARK_CACHE") or Path.home() / ".cache" / "conveyor" / "benchmarks")
"""Where the benchmarks keep what outlives a run: a peer's own virtualenv in ``venvs/NAME``
(``$CONVEYOR_BENCHMARK_CACHE`` moves it)."""


class PeerInstallError(RuntimeError):
    """A peer's virtualenv could not be made or its packages installed; the message is one line saying which."""


def peer_python(name: str, requirements: Sequence[str]) -> str:
    """The interpreter of a virtualenv of its own for peer ``name`` (``PEER_CACHE/venvs/NAME``) holding
    ``requirements``: made and pip-installed on first use, saying so, kept while the requirements stay the same,
    remade when they change. For a peer whose pins clash with ours; :class:`PeerInstallError` if pip fails."""
    venv = PEER_CACHE / "venvs" / name
    python, stamp = venv / "bin" / "python", venv / "conveyor-requirements.txt"
    wanted = "".join(f"{requirement}\n" for requirement in requirements)
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return str(python)
    print(f"{name}: installing {' '.join(requirements)} into {venv} (a virtualenv of its own: its pins differ "
          f"from ours)", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    for step in ([sys.executable, "-m", "venv", "--clear", str(venv)],
                 [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements]):
        out = subprocess.run(step, capture_output=True, text=True)
        if out.returncode != 0:
            said = [line.strip() for line in (out.stderr + out.stdout).splitlines() if line.strip()]
            errors = [line for line in said if line.startswith("ERROR")] or said or [f"exit code {out.returncode}"]
            raise PeerInstallError(f"{name} could not be installed into {venv}: `{' '.join(step[1:4])} ...` "
                                   f"said: {errors[-1]}")
    stamp.write_text(wanted)
    return str(python)


TRAIN_EPISODES = 20
"""Training episodes :func:`final_train_return` averages, per run (the last ones of its budget)."""


def final_train_return(returns: Sequence[float]) -> Optional[float]:
    """The mean of the last :data:`TRAIN_EPISODES` training episodes' returns (None before any ended)."""
    last = list(returns)[-TRAIN_EPISODES:]
    return statistics.fmean(last) if last else None


def device_name(device: str) -> str:
    """What ``device`` is on this machine, for a benchmark's table: the GPU's name, or the CPU's core count."""
    if device == "cuda":
        import torch

        return f"CUDA {torch.cuda.get_device_name(0)}"
    return f"CPU ({os.cpu_count()} cores)"


def add_worker_option(parser: argparse.ArgumentParser, sides: Optional[Iterable[str]] = None) -> None:
    """The hidden ``--worker SIDE`` option (``sides``: its choices) through which :func:`run_worker` calls a script."""
    parser.add_argument("--worker", choices=None if sides is None else sorted(sides), default=None,
                        help=argparse.SUPPRESS)


def worker_done(args: argparse.Namespace, measure: Callable[[str], Mapping[str, Any]]) -> bool:
    """In a worker (``--worker SIDE`` given): print ``measure(SIDE)`` as the JSON line and return True (the script
    then ends); otherwise False."""
    if args.worker is None:
        return False
    print_json_line(measure(args.worker))
    return True


def run_worker(side: str, args: Sequence[str] = (), *, module: Optional[str] = None, timeout: float = 1800,
               python: Optional[str] = None) -> Dict:
    """Run ``python -m MODULE --worker SIDE ARGS`` in a fresh interpreter (its own threads, imports and allocator)
    and return the JSON object it prints as its last line. ``module``: the running script by default; ``python``:
    this interpreter by default, or another (a peer's, from :func:`peer_python`)."""
    module = module or _running_script()
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([python or sys.executable, "-m", module, "--worker", side, *args], capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": path})
    if out.returncode != 0:
        raise RuntimeError(f"{module} --worker {side} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _running_script() -> str:
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None:
        raise RuntimeError("run the benchmark as `python -m benchmarks.NAME` from the checkout's root: its workers "
                           "start the same way")
    return spec.name


def print_json_line(figures: Mapping[str, Any]) -> None:
    """The benchmark's last line: its figures as one JSON object (nothing prints after it)."""
    print(json.dumps(figures), flush=True)


def alternate(sides: Sequence[str], rounds: int, measure: Callable[[str], Dict]) -> Dict[str, List[Dict]]:
    """``measure(side)`` for every side, ``rounds`` times, the order reversed every other round (the machine's
    load drifts: both sides should see it alike)."""
    results: Dict[str, List[Dict]] = {side: [] for side in sides}
    for i in range(rounds):
        for side in (sides if i % 2 == 0 else list(sides)[::-1]):
            results[side].append(measure(side))
            print(f"  {side}: {json.dumps(results[side][-1])}", file=sys.stderr, flush=True)  # progress
    return results


def print_sides(results: Mapping[str, List[Dict]], labels: Mapping[str, str], unit: str = "steps/s") -> Dict[str, Any]:
    """A table of each side's median ``steps_per_s`` and its rounds; returns the medians by side."""
    median = {side: statistics.median(r["steps_per_s"] for r in runs) for side, runs in results.items()}
    width = max(len(labels[side]) for side in results) + 2
    print(f"{'side':<{width}}{'median ' + unit:>18}   rounds")
    for side, runs in results.items():
        print(f"{labels[side]:<{width}}{median[side]:>18.1f}   " + ", ".join(f"{r['steps_per_s']:.1f}" for r in runs))
    return median


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """Work in a fresh temporary folder (a run's ``runs/`` lands there), then go back and remove it."""
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as workdir:
        os.chdir(workdir)
        try:
            yield Path(workdir)
        finally:
            os.chdir(cwd)


_PORT_PICKER = random.SystemRandom()
"""Not the global generator, which the tests seed alike: two test workers would try the same ports at once."""


def free_ports(n: int) -> int:
    """A first port p with p..p+n-1 all free on every interface now, from 20000-32767: below the kernel's
    ephemeral range (32768 up), whose ports any outgoing connection (Ray's many among them) may take between this
    check and the run's bind, and above Ray's worker ports (10002-19999)."""
    for _ in range(50):
        first = _PORT_PICKER.randrange(20000, 32768 - n)
        held = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                held.append(s)
                s.bind(("", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no free ports")


def tensorboard_scalars(logdir: Path) -> Dict[str, List[Tuple[int, float, float]]]:
    """Every scalar in the TensorBoard event files under ``logdir``: ``{tag: [(step, value, wall_time), ...]}``
    by step (TFRecord framing read directly: u64 length, u32 crc, payload, u32 crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars: Dict[str, List[Tuple[int, float, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            payload = data[offset + 12: offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((int(event.step), float(value.simple_value),
                                                          float(event.wall_time)))
    return {tag: sorted(points) for tag, points in scalars.items()}


def tensorboard_events(logdir: Path, tag: str) -> List[Tuple[int, float, float]]:
    """``(step, value, wall_time)`` of every ``tag`` scalar under ``logdir``, by step."""
    return tensorboard_scalars(logdir).get(tag, [])
