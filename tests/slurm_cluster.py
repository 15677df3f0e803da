"""A one-node Slurm cluster of a test's (or a benchmark's) own: its ``slurm.conf`` (``auth/none``,
``proctrack/linuxproc``, loopback, ports free now) in a directory it is given, ``slurmctld`` and ``slurmd`` as its
children, stopped by their pids. Nothing of a system-wide Slurm is read or touched: every command it runs gets
its ``SLURM_CONF``. Debian's ``slurm-wlm`` provides the daemons (``.ci/run`` installs it)."""
import os
import re
import shutil
import signal
import subprocess

from tests.launcher_helpers import wait_until
from tests.test_cli_task import free_ports

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
        return "slurmd starts a job's tasks as their user, which needs root: run these tests as root"
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
