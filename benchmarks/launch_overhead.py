"""Launch overhead per launcher (issue 20): seconds from the command to the first collected step of cartpole/dqn
with 1 learner and 2 collectors (a tiny config: the run ends soon after), started

- local: ``conveyor train cartpole/dqn --collectors 2`` (the nodes are processes of this host);
- slurm: ``sbatch`` of the script ``conveyor slurm-script ... --nodes 1`` prints, on a one-node Slurm cluster
  the benchmark starts beforehand (``benchmarks/_cluster.py``: Debian's ``slurm-wlm``, as root) and stops at the
  end; where none can start, the same script run by a stand-in ``srun`` (``benchmarks/_cluster.py`` too: one
  process per task, no scheduler). The table and the JSON line say which;
- ray: ``conveyor train cartpole/dqn --collectors 2 --launcher ray``, which starts a local Ray cluster (its
  start is part of the figure).

Each command is the real CLI, as a user types it; the ``conveyor`` on PATH (also the one the Slurm tasks run) is a
probe that runs the CLI and, when ``conveyor train`` returns, appends the node summaries of its run
(``DistributedRun.nodes``) to a file as JSON lines. The figure is the earliest ``first_step_at`` of a collector (the
``time.time()`` of its first collected step) minus the wall time just before the command started. The launchers
take turns, the order reversed every other round (``_harness.alternate``); the medians are reported, and their
ratios to local.

    python -m benchmarks.launch_overhead [--quick] [--rounds N] [--launchers local,slurm,ray]

``--quick``: one round. ``--launchers``: the launchers measured (local always; the default all three). The last
line is JSON: ``local_s``, ``slurm_s``, ``ray_s`` (medians, seconds; null for a launcher not measured),
``slurm_vs_local``, ``ray_vs_local`` (ratios), ``slurm_mode`` (``cluster``, ``stand-in srun`` or null), ``rounds``.

Measured 2026-11-27 on 2 cores shared with other sessions (load 4-8), 3 rounds, Slurm 22.05 cluster: local
4.79 s, Slurm 12.79 s (2.67x), Ray 20.52 s (4.28x).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from benchmarks._cluster import SRUN, Cluster, marked_jobs, stand_in_sbatch, unavailable
from benchmarks._harness import alternate, free_ports, print_json_line, scratch_dir

WAIT = 300.0  # seconds: the bound on each run
SETS = ["--set", "env.collector_env_num=2", "--set", "env.evaluator_env_num=2", "--set", "env.n_evaluator_episode=2",
        "--set", "policy.model.hidden_sizes=[8]", "--set", "policy.eval.evaluator.eval_freq=8",
        "--set", "policy.other.replay_buffer.size=500"]
"""The tiny config of every launcher's run: 2 envs a side, 8 hidden units, an evaluation every 8 iterations."""
BUDGET = ["--max-env-step", "200"]
LAUNCHERS = ("local", "slurm", "ray")

PROBE = '''
import json, os, sys

import conveyor.cli._distributed as distributed
from conveyor.cli import main

train = distributed.train


def reporting(args, cfg=None):
    """The CLI's own distributed train, and the node summaries of its run appended to $LAUNCH_PROBE."""
    run = train(args, cfg)
    with open(os.environ["LAUNCH_PROBE"], "a") as out:
        out.write("".join(json.dumps(node) + "\\n" for node in run.nodes))
    return run


if __name__ == "__main__":  # the zygote imports this main module again: it must not start a run
    distributed.train = reporting
    sys.exit(main(sys.argv[1:]))
'''
"""``conveyor`` as the runs see it: the CLI, reporting what each ``conveyor train`` process's nodes did."""


def slurm_script_command(exp_name: str, port: int) -> List[str]:
    """``conveyor slurm-script`` for the Slurm run: the job script sbatch is given, the same run as the others."""
    return [sys.executable, "-m", "conveyor", "slurm-script", "cartpole/dqn", "--collectors", "2", "--nodes", "1",
            "--port", str(port), "--exp-name", exp_name, *SETS, *BUDGET]


class Launches:
    """Starts each launcher's command in ``workdir`` (marked processes: none outlives the benchmark) and times it."""

    def __init__(self, workdir: Path, jobs: Any, cluster: Optional[Cluster]) -> None:
        self.workdir, self.jobs, self.cluster, self.count = workdir, jobs, cluster, 0

    def measure(self, launcher: str) -> Dict[str, Any]:
        """One run of ``launcher``: seconds from its command to the first collected step, and to its end."""
        self.count += 1
        probe = self.workdir / f"nodes-{self.count}.jsonl"
        self.jobs.env["LAUNCH_PROBE"] = str(probe)  # every process of the run gets it (sbatch passes it on)
        log = self.workdir / f"{launcher}-{self.count}.out"
        if launcher == "slurm":
            script = self.workdir / f"job-{self.count}.sh"
            script.write_text(subprocess.run(slurm_script_command(f"slurm-{self.count}", free_ports(3)),
                                             env=self.jobs.env, capture_output=True, text=True, check=True).stdout)
        started = time.time()
        if launcher == "slurm" and self.cluster is not None:
            job_id = self.cluster.sbatch(script, self.jobs.env)
            state, code = self.cluster.wait_ended(job_id, WAIT)
            failed = None if (state, code) == ("COMPLETED", "0:0") else f"job {state} {code}"
            log = self.workdir / f"slurm-{job_id}.out"
        else:
            if launcher == "slurm":
                proc, log = stand_in_sbatch(self.jobs, script, str(self.count)), self.workdir / f"job-{self.count}.out"
            else:
                train = [str(self.workdir / "bin" / "conveyor"), "train", "cartpole/dqn", "--collectors", "2", *SETS,
                         *BUDGET, "--exp-name", f"{launcher}-{self.count}", "--no-progress"]
                if launcher == "ray":
                    train += ["--launcher", "ray", "--ports", str(free_ports(3))]
                proc = self.jobs(train, {}, self.workdir, log)
            code = proc.wait(timeout=WAIT)
            failed = None if code == 0 else f"exit code {code}"
        ended = time.time()
        if failed:
            raise SystemExit(f"{launcher}: the run failed ({failed}); its output:\n{log.read_text()[-3000:]}")
        firsts = [node["first_step_at"] for node in self._nodes(probe) if node["role"] == "collector"]
        if len(firsts) != 2 or None in firsts:
            raise SystemExit(f"{launcher}: expected 2 collectors that collected, got {firsts}")
        return {"first_step_s": min(firsts) - started, "last_first_step_s": max(firsts) - started,
                "wall_s": ended - started}

    @staticmethod
    def _nodes(probe: Path) -> List[Dict[str, Any]]:
        return [json.loads(line) for line in probe.read_text().splitlines()] if probe.is_file() else []


@contextlib.contextmanager
def slurm_cluster(workdir: Path) -> Iterator[Optional[Cluster]]:
    """A one-node Slurm cluster of the benchmark's own, or None (saying why) where none can start here."""
    why = unavailable()
    if why is not None:
        print(f"slurm: no local cluster ({why}); the script runs under a stand-in srun", file=sys.stderr)
        yield None
        return
    root = workdir / "slurm"
    root.mkdir()
    with Cluster(root) as cluster:
        yield cluster


def _launchers(text: str) -> tuple:
    """``--launchers``' value: the named launchers in the benchmark's order, local always among them."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = names - set(LAUNCHERS)
    if unknown or "local" not in names:
        raise argparse.ArgumentTypeError(f"{text!r}: name launchers among {','.join(LAUNCHERS)}, local among them "
                                         f"(the others are measured against it)")
    return tuple(name for name in LAUNCHERS if name in names)


@contextlib.contextmanager
def _no_cluster(workdir: Path) -> Iterator[Optional[Cluster]]:
    """No Slurm cluster: Slurm is not measured."""
    yield None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each launcher (median reported)")
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--launchers", type=_launchers, default=LAUNCHERS,
                        help="comma-separated launchers to measure, local among them (default: local,slurm,ray)")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    slurm = slurm_cluster if "slurm" in args.launchers else _no_cluster
    with scratch_dir() as workdir, slurm(workdir) as cluster:
        tools = {"conveyor": f"#!{sys.executable}\n{PROBE}"}
        if cluster is None:
            tools["srun"] = f"#!{sys.executable}\n{SRUN}"  # only here: on PATH, it would hide Slurm's own srun
        with marked_jobs(workdir / "bin", tools) as jobs:
            results = alternate(args.launchers, rounds, Launches(workdir, jobs, cluster).measure)
    mode, command = ("cluster", "sbatch") if cluster is not None else ("stand-in srun", "the script")
    median = {launcher: statistics.median(r["first_step_s"] for r in runs) for launcher, runs in results.items()}
    seconds = {launcher: round(median[launcher], 3) if launcher in median else None for launcher in LAUNCHERS}
    versus = {launcher: round(median[launcher] / median["local"], 3) if launcher in median else None
              for launcher in LAUNCHERS}
    labels = {"local": "local (conveyor train)", "slurm": f"slurm ({mode}, from {command})",
              "ray": "ray (local cluster started)"}
    print(f"cartpole/dqn, 1 learner + 2 collectors: seconds from the command to the first collected step "
          f"({rounds} round{'s' * (rounds != 1)})")
    print(f"{'launcher':<36}{'median s':>10}{'vs local':>10}   rounds (first step / last collector's / end)")
    for launcher, runs in results.items():
        print(f"{labels[launcher]:<36}{median[launcher]:>10.2f}{versus[launcher]:>10.2f}   " +
              ", ".join(f"{r['first_step_s']:.1f}/{r['last_first_step_s']:.1f}/{r['wall_s']:.1f}" for r in runs))
    print_json_line({"local_s": seconds["local"], "slurm_s": seconds["slurm"], "ray_s": seconds["ray"],
                     "slurm_vs_local": versus["slurm"], "ray_vs_local": versus["ray"],
                     "slurm_mode": mode if "slurm" in median else None, "rounds": rounds})


if __name__ == "__main__":
    main()
