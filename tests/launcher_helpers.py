"""What the tests of the jobs ``conveyor slurm-script`` / ``conveyor k8s-manifest`` print share: a tiny
cartpole/dqn run, a ``conveyor`` on PATH, and a starter that marks every process a job starts (the mark is in
their environment, which srun, slurmd and the nodes pass on) so that none outlives the test."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from conveyor.cli import main as cli_main

from tests.cli_helpers import TINY
from tests.test_cli_task import free_ports

ROOT = Path(__file__).resolve().parents[1]
WAIT = 240  # seconds: bound on each job (a healthy one takes about 30 on these machines)
SETS = [word for flag, value in zip(TINY[::2], TINY[1::2]) if flag == "--set" for word in (flag, value)]
"""The ``--set`` options of :data:`~tests.cli_helpers.TINY`: a job's run of a few seconds."""

SRUN = '''
import json, os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):  # srun's own options
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
step = {"SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_TASKS_PER_NODE": str(n), "SLURM_STEPID": "0"}
tasks = [subprocess.Popen(args, env={**os.environ, **step, "SLURM_PROCID": str(rank)}) for rank in range(n)]
path = os.environ["SRUN_PIDS"]
with open(path + ".tmp", "w") as f:
    json.dump([task.pid for task in tasks], f)
os.replace(path + ".tmp", path)
codes = [task.wait() for task in tasks]
sys.exit(next((code if code > 0 else 128 - code for code in codes if code), 0))
'''
"""srun as far as a job step's tasks see it: one process per task, its rank and the step's hosts set."""


def stand_in_sbatch(jobs, path, job_id):
    """Start the script as sbatch does on one host: in the submit directory, with the batch step's variables (the
    ``jobs`` of :func:`marked_jobs` must have :data:`SRUN` as ``srun``). Its srun writes the tasks' pids to
    ``pids-<job id>`` there; the job's output goes to ``job-<job id>.out``."""
    ntasks = re.search(r"^#SBATCH --ntasks=(\d+)$", path.read_text(), re.MULTILINE).group(1)
    env = {"SLURM_JOB_ID": job_id, "SLURM_SUBMIT_DIR": str(path.parent), "SLURM_NTASKS": ntasks,
           "SLURM_NNODES": "1", "SLURM_NODELIST": "127.0.0.1", "SRUN_PIDS": str(path.parent / f"pids-{job_id}")}
    (path.parent / f"pids-{job_id}").unlink(missing_ok=True)
    return jobs(["bash", str(path)], env, path.parent, path.parent / f"job-{job_id}.out")


def slurm_script(tmp_path, capsys, *argv):
    """``tmp_path / "job.sh"``: the sbatch script of a job of 1 learner and 2 collectors on one host, with ``argv``
    added to ``conveyor slurm-script`` (a test's capsys takes its output)."""
    assert cli_main(["slurm-script", "cartpole/dqn", "--collectors", "2", "--nodes", "1", "--port",
                     str(free_ports(3)), *SETS, *argv]) == 0
    path = tmp_path / "job.sh"
    path.write_text(capsys.readouterr().out)
    return path


def processes_with(mark):
    """Pids of the processes whose environment holds ``LAUNCHER_TEST=mark`` (every process a job started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"LAUNCHER_TEST={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def group_gone(pgid):
    """Whether process group ``pgid`` has no member left (a zombie, killed but not reaped yet, still counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)  # polling a file the job writes; nothing here orders processes


def ended_at(run_dir):
    """The env steps at which each start of the run ended, from its log."""
    return [int(n) for n in re.findall(r"run ended at env_step=(\d+)", (run_dir / "log.txt").read_text())]


@contextlib.contextmanager
def marked_jobs(bin_dir, tools=None):
    """Yield ``start(argv, env, cwd, log)``, which starts a job's process (its own session, output appended to
    ``log``) with ``bin_dir`` on PATH holding a ``conveyor`` of this interpreter and ``tools`` (name: script text).
    ``start.mark`` is the mark of this block's processes, ``start.env`` their environment; every one still there
    at the end is killed, also when the test fails, and the block checks that none is left."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "conveyor").write_text(f'#!/bin/sh\nexec {sys.executable} -m conveyor "$@"\n')
    for name, text in (tools or {}).items():
        (bin_dir / name).write_text(text)
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    mark = uuid.uuid4().hex
    started = []
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CONVEYOR_", "JOB_COMPLETION"))}
    base.update(PATH=f"{bin_dir}:{base['PATH']}", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LAUNCHER_TEST=mark)

    def start(argv, env, cwd, log):
        with open(log, "a") as out:
            proc = subprocess.Popen(argv, env={**base, **env}, cwd=cwd, start_new_session=True, stdout=out,
                                    stderr=subprocess.STDOUT)
        started.append(proc)
        return proc

    start.mark, start.env = mark, base
    try:
        yield start
    finally:
        for pid in processes_with(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in started:
            proc.wait(timeout=WAIT)
    wait_until(lambda: processes_with(mark) == [], WAIT, "every marked process to end")
