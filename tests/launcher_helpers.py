"""What the tests of the jobs ``conveyor slurm-script`` / ``conveyor k8s-manifest`` print share: a tiny
cartpole/dqn run and its sbatch script; the marked job starter and the Slurm cluster are in
:mod:`benchmarks._cluster` (launch_overhead starts its jobs with them too)."""
import os
import re

from benchmarks._harness import free_ports
from conveyor.cli import main as cli_main

from tests.cli_helpers import TINY

WAIT = 240  # seconds: bound on each job (a healthy one takes about 30 on these machines)
SETS = [word for flag, value in zip(TINY[::2], TINY[1::2]) if flag == "--set" for word in (flag, value)]
"""The ``--set`` options of :data:`~tests.cli_helpers.TINY`: a job's run of a few seconds."""


def slurm_script(tmp_path, capsys, *argv):
    """``tmp_path / "job.sh"``: the sbatch script of a job of 1 learner and 2 collectors on one host, with ``argv``
    added to ``conveyor slurm-script`` (a test's capsys takes its output)."""
    assert cli_main(["slurm-script", "cartpole/dqn", "--collectors", "2", "--nodes", "1", "--port",
                     str(free_ports(3)), *SETS, *argv]) == 0
    path = tmp_path / "job.sh"
    path.write_text(capsys.readouterr().out)
    return path


def group_gone(pgid):
    """Whether process group ``pgid`` has no member left (a zombie, killed but not reaped yet, still counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def ended_at(run_dir):
    """The env steps at which each start of the run ended, from its log."""
    return [int(n) for n in re.findall(r"run ended at env_step=(\d+)", (run_dir / "log.txt").read_text())]
