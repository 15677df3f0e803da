"""Jobs as a cluster starts them, on this host, for the launcher tests and ``benchmarks.launch_overhead``: a one-node
Slurm cluster of one's own (:class:`Cluster`), a stand-in ``srun`` and ``sbatch`` where none can start, and job
processes marked so that none outlives the block that started them (:func:`marked_jobs`).

The cluster: its ``slurm.conf`` (``auth/none``, ``proctrack/linuxproc``, loopback, ports free now) in a directory it
is given, ``slurmctld`` and ``slurmd`` as its children, stopped by their pids. Nothing of a system-wide Slurm is
read or touched: every command it runs gets its ``SLURM_CONF``. Debian's ``slurm-wlm`` provides the daemons
(``.ci/run`` installs it)."""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from benchmarks._harness import ROOT, free_ports

ENDS_WITHIN = 240  # seconds: bound on the processes of a block's jobs to end once killed

INSTALL = "apt-get install -y --no-install-recommends slurm-wlm"
TOOLS = ("slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo", "squeue")
SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # the daemons live in sbin
ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "TIMEOUT"}
"""Job states after which none of the job's processes runs (COMPLETING is not one: its tasks may still end)."""


def unavailable():
    """Why no cluster can start here (Slurm missing, not root), or None."""
    missing = [tool for tool in TOOLS if shutil.which(tool, path=SEARCH) is None]
    if missing:
        return f"Slurm is not installed here ({', '.join(missing)} not found): {INSTALL}"
    if os.geteuid() != 0:
        return "slurmd starts a job's tasks as their user, which needs root: run as root"
    return None


CONF = """\
ClusterName=conveyortest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=conveyor Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
"""One node, ``localhost``: the job's step lists it, so its tasks find node 0 on loopback. ``CPUs=4`` with
``config_overrides``: a job of 3 tasks fits a machine of 2 cores. ``KillWait=30``: Slurm's default, between
the SIGTERM of a cancelled job and its SIGKILL."""


class Cluster:
    """slurmctld and slurmd of a cluster of one node in ``root``, and the Slurm commands run against them: in a
    ``with`` block, the daemons run and the node is idle; on the way out, what is left of the jobs is cancelled
    and the daemons are stopped by their pids, also when the block fails."""

    def __init__(self, root):
        self.root, self.conf = root, root / "slurm.conf"
        (root / "state").mkdir()
        (root / "spool").mkdir()
        ctld_port = free_ports(2)
        self.conf.write_text(CONF.format(root=root, ctld_port=ctld_port, slurmd_port=ctld_port + 1))
        self.env = {"SLURM_CONF": str(self.conf)}
        self.daemons = []

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc):
        self._stop()

    def _start(self):
        for argv in (["slurmctld", "-D", "-f", str(self.conf)],
                     ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)]):
            with open(self.root / f"{argv[0]}.out", "w") as out:
                self.daemons.append(subprocess.Popen([shutil.which(argv[0], path=SEARCH), *argv[1:]], stdout=out,
                                                     stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                                     start_new_session=True))
        wait_until(lambda: self.command("sinfo", "-h", "-o", "%t").strip() == "idle", 60, "the node to be idle "
                   f"(logs in {self.root})")

    def command(self, *argv, env=None):
        """A Slurm command's output, against this cluster."""
        return subprocess.run([shutil.which(argv[0], path=SEARCH), *argv[1:]], env={**(env or os.environ), **self.env},
                              capture_output=True, text=True, timeout=60).stdout

    def job(self, job_id):
        """The job's state and exit code (``COMPLETED``, ``0:0``)."""
        text = self.command("scontrol", "-o", "show", "job", job_id)
        return re.search(r"JobState=(\S+)", text).group(1), re.search(r"ExitCode=(\S+)", text).group(1)

    def sbatch(self, path, env):
        """Submit the script ``path`` from its directory with the environment ``env`` (which its job gets); the
        job id."""
        out = subprocess.run([shutil.which("sbatch", path=SEARCH), "--parsable", str(path)], cwd=path.parent,
                             env={**env, **self.env}, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch {path} failed: {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def wait_ended(self, job_id, timeout):
        """The job's state and exit code once it has ended (none of its processes left)."""
        wait_until(lambda: self.job(job_id)[0] in ENDED, timeout, f"job {job_id} to end")
        return self.job(job_id)

    def _stop(self):
        """Cancel what is left of the jobs, then stop the daemons by their pids (SIGTERM, SIGKILL after 30 s)."""
        if self.daemons and self.daemons[0].poll() is None:
            left = self.command("squeue", "-h", "-o", "%i").split()  # pending, running or completing
            if left:
                self.command("scancel", *left)
                try:
                    wait_until(lambda: not self.command("squeue", "-h", "-o", "%i").split(), 60, "the jobs to end")
                except AssertionError:
                    pass  # the daemons are stopped all the same
        for daemon in reversed(self.daemons):  # slurmd first, then the controller
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def wait_until(predicate, timeout, what):
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)  # polling a file the job writes; nothing here orders processes


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


@contextlib.contextmanager
def marked_jobs(bin_dir, tools=None):
    """Yield ``start(argv, env, cwd, log)``, which starts a job's process (its own session, output appended to
    ``log``) with ``bin_dir`` on PATH holding a ``conveyor`` of this interpreter and ``tools`` (name: script text).
    ``start.mark`` is the mark of this block's processes, ``start.env`` their environment; every one still there
    at the end is killed, also when the block fails, and the block checks that none is left."""
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
            proc.wait(timeout=ENDS_WITHIN)
    wait_until(lambda: processes_with(mark) == [], ENDS_WITHIN, "every marked process to end")
