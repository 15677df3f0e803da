"""Training throughput on Breakout against Sample Factory 2.1.1: atari/ppo against its synchronous PPO, atari/impala
against its APPO (V-trace), env frames/s over the same seconds on the same envs and cores.

Each run is a command line started from scratch, as a user would start it, in a scratch folder, stopped after
``--seconds`` wall seconds; its frames/s is measured over a window from ``--warmup`` seconds after its start to its
last progress point (process start, imports, env start-up and the first updates fall outside it):

- ours: ``conveyor train atari/ppo`` (synchronous, one process: 8 envs x 128 steps, 4 epochs of 4 minibatches) and
  ``conveyor train atari/impala --collectors C`` (a learner and C collector processes, 8 envs each; C = 1 on 2
  cores), on ``--device``, as they ship except that evaluation is one game on one env at the start (Sample Factory
  evaluates nothing while training). They end on SIGTERM after ``--seconds`` (the iteration in progress finishes).
  Our figure is agent steps from the progress lines the run writes to a pipe every 5 s or more (``train: N/... step
  ...``, at the end of an iteration), stamped when read, in the window: (last N - first N) / (last time - first
  time), times 4 (Atari's frame skip: an agent step is 4 emulator frames). (TensorBoard's points come every 100
  gradient steps, about 35 s apart for atari/ppo here: too few.)
- theirs: ``python -m sf_examples.atari.train_atari --env=atari_breakout`` with ``--num_workers=CORES
  --num_envs_per_worker=ENVS/CORES``, stopped as ours (SIGTERM to its process group; its ``--train_for_seconds``
  counts from later than its start) (its Atari defaults: rollout 128, batch 256, 4
  batches an epoch, 4 epochs, Nature CNN, frame skip 4, 4 stacked frames), synchronous (``--async_rl=False``, its
  Atari default) and with ``--async_rl=True --with_vtrace=True --normalize_returns=False --recurrence=128`` (APPO:
  V-trace refuses normalised returns and a recurrence other than the rollout's length; Sample Factory 2.1.1's
  learner then fails on its first batch, 'AttrDict' object has no attribute 'advantages', a bug fixed upstream after
  2.1.1 that the ``sitecustomize.py`` below works around for the summaries only). Sample Factory counts env frames (its Atari default ``summaries_use_frameskip``:
  agent steps x 4); its log's ``Fps is (10 sec: X, ...). Total num frames: N``
  lines (every 5 s), stamped when read, give (last N - first N) / (last time - first time) in the same window, N
  taken from the line that first shows it (it grows a training batch, 4,096 frames, at a time); the mean of the
  10-sec values there is shown beside it. Installed by this script into a virtualenv of its own
  (``benchmarks._harness.peer_python``): it pins gymnasium < 1.0 and numpy < 2; ale-py 0.9 registers the ALE envs
  with gymnasium when imported, which a ``sitecustomize.py`` written into that virtualenv does in every process.

Sides alternate (ours, theirs for PPO, then ours, theirs for APPO; the order reversed every other round), each pair
adjacent in time: the machine is shared. Sample Factory's synchronous PPO counts its frames a training batch (4,096)
at a time: its window needs several batches, which 80 s runs did not give it at a load average of 5-7 on 2 cores.
``ppo_fps_ratio`` and ``appo_fps_ratio`` are ours / theirs of the medians over rounds. Targets on 2 CPU cores:
both >= 1.3; with ``--device cuda`` (both on the GPU, every core: Sample Factory one rollout worker per core, ours
a collector per two), both >= 1.0.

    python -m benchmarks.vs_sample_factory                    # 150 s a run, 1 round: about 11 min on 2 cores
    python -m benchmarks.vs_sample_factory --rounds 2         # ours, theirs, theirs, ours: about 22 min
    python -m benchmarks.vs_sample_factory --device cuda                # on a GPU machine
    python -m benchmarks.vs_sample_factory --quick      # ours only, tiny iterations, no Sample Factory: each run
                                                        # stopped at its first progress line (at most 240 s)
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks._harness import PeerInstallError, device_name, peer_python, print_json_line, scratch_dir

SAMPLE_FACTORY = ("torch==2.13.0", "sample-factory==2.1.1", "ale-py==0.9.0")
"""Sample Factory's virtualenv: its last release, ale-py 0.9.0 (ROMs bundled, no gymnasium requirement: Sample
Factory's gymnasium < 1.0 stays) and our torch (the CPU build where pip is given one)."""
SITECUSTOMIZE = '''try:
    import ale_py  # registers ALE/*-v5 with gymnasium, in every process
except ImportError:
    pass

import importlib.abc
import importlib.machinery
import sys


class _VtraceSummaries(importlib.abc.MetaPathFinder):
    """Sample Factory 2.1.1's learner reads the minibatch's GAE advantages when it records summaries; V-trace
    computes none, so APPO fails on its first batch ('AttrDict' object has no attribute 'advantages'). Fixed
    upstream after 2.1.1 (alex-petrenko/sample-factory#286, #332: the advantage stats are skipped); here V-trace
    minibatches get NaN advantages for the summaries only, so the stats read NaN and training is untouched."""

    def find_spec(self, name, path, target=None):
        if name != "sample_factory.algo.learning.learner":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            record = module.Learner._record_summaries

            def _record_summaries(self, train_loop_vars):
                if "advantages" not in train_loop_vars.mb:
                    train_loop_vars.mb["advantages"] = module.torch.full((1,), float("nan"))
                return record(self, train_loop_vars)

            module.Learner._record_summaries = _record_summaries

        spec.loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _VtraceSummaries())
'''
"""The ``sitecustomize.py`` of Sample Factory's virtualenv: ALE registered in every process, and its APPO's summary
bug worked around (the class docstring)."""
FRAME_SKIP = 4
"""Emulator frames per agent step, both sides (ALE v5's frame skip on ours, Sample Factory's ``env_frameskip``)."""
ENVS = 8
QUICK = {"seconds": 240.0, "warmup": 0.0, "points": 1}
"""The smoke run: ours only, tiny iterations (2 envs; PPO rollouts of 2 x 32 steps and one epoch, IMPALA unrolls
of 10 steps one a batch), each run stopped at its first progress line (5 s into training), its window from the
run's start (start-up included: a smoke figure), ``seconds`` only bounding a run too slow to write it."""
OUR_PROGRESS = re.compile(r"^train: (\d+)")
SF_FPS = re.compile(r"Fps is \(10 sec: ([-\d.naninf]+).*?Total num frames: (\d+)")
ALGOS = ("ppo", "appo")


def layout(device: str, quick: bool = False) -> Dict[str, int]:
    """Cores, envs and our IMPALA collectors: 8 envs on this machine's cores on CPU (2 here: one collector and the
    learner); on a GPU every core, 4 envs a core; ``quick``: 2 envs."""
    cores = os.cpu_count() or 1
    if quick:
        return {"cores": cores, "envs": 2, "collectors": 1}
    if device == "cpu":
        return {"cores": cores, "envs": ENVS, "collectors": max(1, cores // 2)}
    return {"cores": cores, "envs": 4 * cores, "collectors": max(1, cores // 2)}


def ours_command(algo: str, device: str, shape: Dict[str, int], quick: bool = False) -> List[str]:
    """``conveyor train`` for our side of ``algo``: evaluation reduced to one game at the start, run until stopped;
    ``quick``: :data:`QUICK`'s tiny iterations."""
    common = ["--set", "env.evaluator_env_num=1", "--set", "env.n_evaluator_episode=1",
              "--set", "policy.eval.evaluator.eval_freq=1000000000", "--device", device,
              "--max-env-step", "1000000000", "--exp-name", f"vs_sf_{algo}"]
    if algo == "ppo":
        tiny = ["--set", "policy.learn.batch_size=64", "--set", "policy.learn.epoch_per_collect=1"] if quick else []
        return ["atari/ppo", *common, *tiny, "--set", f"env.collector_env_num={shape['envs']}",
                "--set", f"policy.collect.n_sample={shape['envs'] * (32 if quick else 128)}"]
    per_collector = shape["envs"] // shape["collectors"]
    tiny = ["--set", "policy.learn.batch_size=1"] if quick else []
    return ["atari/impala", *common, *tiny, "--collectors", str(shape["collectors"]),
            "--set", f"env.collector_env_num={per_collector}",
            "--set", f"policy.collect.n_sample={per_collector * (10 if quick else 20)}"]


def sf_command(algo: str, device: str, shape: Dict[str, int], train_dir: Path) -> List[str]:
    """Sample Factory's Atari example on Breakout, on the same envs and cores, run until stopped."""
    command = ["-m", "sf_examples.atari.train_atari", "--env=atari_breakout", f"--experiment=vs_{algo}",
               f"--train_dir={train_dir}", f"--num_workers={shape['cores']}",
               f"--num_envs_per_worker={shape['envs'] // shape['cores']}",
               f"--device={'gpu' if device == 'cuda' else 'cpu'}", "--save_every_sec=1000000", "--seed=0"]
    # V-trace refuses its Atari defaults of normalised returns and of recurrence 1 (it needs recurrence = rollout,
    # 128: no RNN, so only how the learner slices its batch); ours normalises no returns either.
    appo = ["--async_rl=True", "--with_vtrace=True", "--normalize_returns=False", "--recurrence=128"]
    return command + (appo if algo == "appo" else [])


def _stop(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the process's group, then SIGKILL to it if it has not ended within ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def timed_lines(command: Sequence[str], seconds: float, grace: float,
                enough: Optional[Callable[[List[Tuple[float, str]]], bool]] = None
                ) -> Tuple[float, List[Tuple[float, str]], int]:
    """Run ``command`` in a new session for at most ``seconds``, or until ``enough(lines so far)`` holds (SIGTERM to
    its group then, ``grace`` seconds to finish); its start (``time.time()``), every output line stamped when read,
    and its exit code."""
    start = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines: List[Tuple[float, str]] = []
    done = threading.Event()  # set once enough lines came, or the process ended

    def read() -> None:
        for line in process.stdout:
            lines.append((time.time(), line.rstrip("\n")))
            if enough is not None and enough(lines):
                done.set()

    def watch() -> None:
        process.wait()
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    threading.Thread(target=watch, daemon=True).start()
    try:
        done.wait(timeout=seconds)
    finally:
        _stop(process, grace)
    reader.join(timeout=10)
    return start, lines, process.returncode


def window_rate(points: Sequence[Tuple[float, float]], since: float) -> Optional[Tuple[float, float, float]]:
    """``(count per second, first time, last time)`` between the first and last ``(time, count)`` point at or after
    ``since``; None with fewer than two there."""
    inside = [p for p in points if p[0] >= since]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return (n1 - n0) / (t1 - t0), t0, t1


def ours(algo: str, device: str, seconds: float, warmup: float, quick: bool = False) -> Dict[str, Any]:
    """Our side of ``algo`` for ``seconds`` (``quick``: until its first progress line): env frames/s in
    the window after ``warmup``."""
    args = ours_command(algo, device, layout(device, quick), quick)
    enough = (lambda lines: sum(bool(OUR_PROGRESS.search(line)) for _, line in lines) >= QUICK["points"]) \
        if quick else None
    with scratch_dir():
        start, lines, code = timed_lines([sys.executable, "-m", "conveyor", "train", *args], seconds, grace=120,
                                         enough=enough)
    points = [(wall, int(match.group(1))) for wall, line in lines for match in [OUR_PROGRESS.search(line)] if match]
    rate = window_rate(([(start, 0)] if quick else []) + points, start + warmup)
    if rate is None:
        tail = "\n".join(line for _, line in lines[-20:])
        raise RuntimeError(f"conveyor train {' '.join(args)} wrote {len(points)} progress lines, fewer than 2 "
                           f"after {warmup} s (exit code {code}): give more --seconds\n{tail}")
    return {"side": f"ours_{algo}", "fps": FRAME_SKIP * rate[0], "agent_steps_per_s": rate[0],
            "window_s": [round(rate[1] - start, 1), round(rate[2] - start, 1)], "exit_code": code}


def theirs(python: str, algo: str, device: str, seconds: float, warmup: float) -> Dict[str, Any]:
    """Sample Factory's side of ``algo`` for ``seconds``: env frames/s in the window after ``warmup``."""
    shape = layout(device)
    with scratch_dir() as folder:
        command = [python, *sf_command(algo, device, shape, folder / "train_dir")]
        start, lines, code = timed_lines(command, seconds, grace=30)
    found = [(wall, match) for wall, line in lines for match in [SF_FPS.search(line)] if match]
    # The total grows a training batch (4,096 frames) at a time: each count from the line first showing it.
    points = [(wall, int(m.group(2))) for k, (wall, m) in enumerate(found)
              if k == 0 or m.group(2) != found[k - 1][1].group(2)]
    rate = window_rate(points, start + warmup)
    if rate is None:
        tail = "\n".join(line for _, line in lines[-20:])
        raise RuntimeError(f"Sample Factory logged {len(found)} 'Fps is' lines, fewer than 2 after {warmup} s "
                           f"(exit code {code}): give more --seconds\n{tail}")
    tens = [float(m.group(1)) for wall, m in found if rate[1] <= wall <= rate[2] and m.group(1) != "nan"]
    return {"side": f"sf_{algo}", "fps": rate[0], "fps_10s_mean": statistics.fmean(tens) if tens else None,
            "window_s": [round(rate[1] - start, 1), round(rate[2] - start, 1)], "exit_code": code}


def sf_python() -> str:
    """Sample Factory's interpreter (installed on first use) with the ``sitecustomize.py`` that registers ALE."""
    python = peer_python("sample-factory", SAMPLE_FACTORY)
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    site = Path(purelib) / "sitecustomize.py"
    if not site.exists() or site.read_text() != SITECUSTOMIZE:
        site.write_text(SITECUSTOMIZE)
    return python


def median_or_none(values: List[float]) -> Optional[float]:
    return round(statistics.median(values), 1) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="wall seconds a run, start-up included")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds after a run's start before its window")
    parser.add_argument("--rounds", type=int, default=1, help="runs per side and algorithm, alternating")
    parser.add_argument("--algos", default="ppo,appo", help="'ppo', 'appo' or both")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true",
                        help=f"ours only, tiny iterations, each run until its first progress line "
                             f"(at most {QUICK['seconds']:.0f} s), no warm-up, 1 round")
    args = parser.parse_args()
    algos = [algo for algo in args.algos.split(",") if algo]
    if not algos or set(algos) - set(ALGOS):
        parser.error(f"--algos {args.algos}: give 'ppo', 'appo' or 'ppo,appo'")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("torch sees no CUDA device: run --device cuda where a GPU is (the CPU figures: --device cpu)")
    if args.quick:
        args.seconds, args.warmup, args.rounds = QUICK["seconds"], QUICK["warmup"], 1
    elif args.warmup >= args.seconds:
        parser.error(f"--warmup {args.warmup} is not below --seconds {args.seconds}: the window would be empty")

    python, sf_error = None, None
    if not args.quick:  # the smoke run installs and runs no peer
        try:
            python = sf_python()
        except PeerInstallError as exc:
            sf_error = str(exc)
            print(f"Sample Factory's side is left out: {sf_error}", file=sys.stderr, flush=True)
    shape = layout(args.device, args.quick)
    rows: Dict[str, List[Dict[str, Any]]] = {f"{side}_{algo}": [] for algo in algos for side in ("ours", "sf")}
    for i in range(args.rounds):
        for algo in algos:
            sides = ["ours"] + (["sf"] if python else [])
            for side in (sides if i % 2 == 0 else sides[::-1]):
                if side == "ours":
                    row = ours(algo, args.device, args.seconds, args.warmup, args.quick)
                else:  # a run too slow for its window is reported, and the other runs go on
                    try:
                        row = theirs(python, algo, args.device, args.seconds, args.warmup)
                    except RuntimeError as exc:
                        print(exc, file=sys.stderr, flush=True)  # with the tail of its log
                        row = {"side": f"sf_{algo}", "fps": None, "fps_10s_mean": None,
                               "error": str(exc).splitlines()[0]}
                rows[f"{side}_{algo}"].append(row)
                print(f"  {row}", file=sys.stderr, flush=True)  # progress

    length = "each run until its first progress line" if args.quick else f"{args.seconds:.0f} s a run"
    print(f"Breakout, {shape['envs']} envs, {shape['cores']} cores, {device_name(args.device)}, {length}, "
          f"window from {args.warmup:.0f} s to the last progress point, {args.rounds} round(s): env frames/s "
          f"(agent steps x {FRAME_SKIP})")
    print(f"{'algo':>5} {'ours (median)':>14} {'SF (median)':>12} {'ratio':>6}   rounds: ours | SF")
    summary: Dict[str, Any] = {"device": device_name(args.device), "seconds": args.seconds, "warmup_s": args.warmup,
                               "rounds": args.rounds, **shape, "sf_requirements": list(SAMPLE_FACTORY),
                               "sf_error": sf_error if not args.quick else "not measured (--quick)"}
    for algo in ALGOS:
        mine = median_or_none([r["fps"] for r in rows.get(f"ours_{algo}", [])])
        their = median_or_none([r["fps"] for r in rows.get(f"sf_{algo}", []) if r["fps"] is not None])
        ratio = round(mine / their, 3) if mine and their else None
        summary.update({f"{algo}_fps_ratio": ratio, f"ours_{algo}_fps": mine, f"sf_{algo}_fps": their,
                        f"ours_{algo}_rounds": [round(r["fps"], 1) for r in rows.get(f"ours_{algo}", [])],
                        f"sf_{algo}_rounds": [r["fps"] and round(r["fps"], 1) for r in rows.get(f"sf_{algo}", [])],
                        f"sf_{algo}_errors": [r["error"] for r in rows.get(f"sf_{algo}", []) if "error" in r],
                        f"sf_{algo}_fps_10s_mean": median_or_none([r["fps_10s_mean"] for r in
                                                                   rows.get(f"sf_{algo}", []) if r["fps_10s_mean"]])})
        if algo in algos:
            print(f"{algo:>5} {mine if mine is not None else '-':>14} {their if their is not None else '-':>12} "
                  f"{ratio if ratio is not None else '-':>6}   {summary[f'ours_{algo}_rounds']} | "
                  f"{summary[f'sf_{algo}_rounds']}")
    print(f"targets on CPU: ppo_fps_ratio >= 1.3 ({summary['ppo_fps_ratio']}), appo_fps_ratio >= 1.3 "
          f"({summary['appo_fps_ratio']})")
    print_json_line(summary)


if __name__ == "__main__":
    sys.exit(main())
