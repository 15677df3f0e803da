"""The job ``conveyor slurm-script`` prints, submitted with ``sbatch`` to a real one-node Slurm cluster that the
tests start (:class:`tests.slurm_cluster.Cluster`: its own ``slurm.conf`` in a temporary directory, slurmctld and
slurmd stopped by their pids at the end): 1 learner and 2 collectors on cartpole/dqn.

Where Slurm is missing (``apt-get install slurm-wlm``; ``.ci/run`` installs it), or where this is not root
(slurmd starts a job's tasks as their user), the tests are skipped, except under CI (``$CI`` set): there
they fail, saying why."""
import os
import re

import pytest

from benchmarks._cluster import Cluster, marked_jobs, processes_with, unavailable, wait_until
from tests.launcher_helpers import WAIT, slurm_script

UNAVAILABLE = unavailable()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(UNAVAILABLE is not None and not os.environ.get("CI"), reason=str(UNAVAILABLE))]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node Slurm cluster of this module's own, stopped at the end, also when a test fails."""
    if UNAVAILABLE is not None:
        pytest.fail(f"CI is set, so these tests must run: {UNAVAILABLE}")
    with Cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def jobs(tmp_path):
    """Every process of the jobs a test submits carries a mark (sbatch passes its environment on to the job), so
    the test finds them: none may outlive it."""
    with marked_jobs(tmp_path / "bin") as start:
        yield start


def test_sbatch_of_the_slurm_script_trains_to_its_final_checkpoint(tmp_path, capsys, cluster, jobs):
    path = slurm_script(tmp_path, capsys, "--max-env-step", "300")
    job_id = cluster.sbatch(path, jobs.env)
    output = tmp_path / f"slurm-{job_id}.out"
    assert cluster.wait_ended(job_id, WAIT) == ("COMPLETED", "0:0"), output.read_text()
    run_dir = tmp_path / "runs" / f"cartpole_dqn-{job_id}"
    assert (run_dir / "ckpt" / "final.pth.tar").is_file()
    ended = re.findall(r"run ended at env_step=(\d+) train_iter=(\d+)", (run_dir / "log.txt").read_text())
    assert len(ended) == 1 and int(ended[0][0]) >= 300 and int(ended[0][1]) > 0
    assert (tmp_path / ".conveyor" / f"job-{job_id}" / "secret").stat().st_mode & 0o777 == 0o600
    wait_until(lambda: processes_with(jobs.mark) == [], 30, "every process of the job to end")


def scancel_after_checkpoint(cluster, jobs, job_id, run_dir, seen, *options):
    """Wait until the learner has written a latest checkpoint newer than ``seen``, then ``scancel`` the job with
    ``options``; returns the job's state once no process of it is left."""
    latest = run_dir / "ckpt" / "latest.pth.tar"
    wait_until(lambda: latest.is_file() and latest.stat().st_mtime_ns != seen, WAIT, f"{latest}")
    assert processes_with(jobs.mark), "the job runs"
    cluster.command("scancel", *options, job_id)
    state = cluster.wait_ended(job_id, WAIT)
    wait_until(lambda: processes_with(jobs.mark) == [], 30, "every process of the job to end")
    return state


def evaluated_at(log):
    """The env steps of the evaluations in a part of the run's log."""
    return [int(n) for n in re.findall(r"evaluation at train_iter \d+, env_step (\d+)", log)]


def test_scancel_signal_term_stops_with_a_final_checkpoint_and_scancel_kills_and_both_jobs_resume(
        tmp_path, capsys, cluster, jobs):
    """``scancel --signal=TERM`` signals every process of the tasks: one stop each, so the learner ends its
    iteration and writes its final checkpoint; a plain ``scancel`` kills the tasks (srun answers Slurm's SIGTERM
    so), leaving the latest checkpoint. Either way no process is left and the next job of the run resumes it."""
    secret = tmp_path / "secret"
    secret.write_text("eb70d51b4816e77666c9785419aec972050f7f15ccc832e36d90a4f82c2d631a")
    secret.chmod(0o600)
    path = slurm_script(tmp_path, capsys, "--max-env-step", "1000000", "--ckpt-interval", "1", "--exp-name", "long",
                        "--secret-file", str(secret))
    run_dir = tmp_path / "runs" / "long"
    final = run_dir / "ckpt" / "final.pth.tar"
    scancel_after_checkpoint(cluster, jobs, cluster.sbatch(path, jobs.env), run_dir, None, "--signal=TERM")
    assert final.is_file(), (run_dir / "log.txt").read_text()[-2000:]
    stopped = (run_dir / "ckpt" / "latest.pth.tar").stat().st_mtime_ns  # written with the final one
    state, _ = scancel_after_checkpoint(cluster, jobs, cluster.sbatch(path, jobs.env), run_dir, stopped)
    assert state == "CANCELLED"
    first, resumed = (run_dir / "log.txt").read_text().split("run 'long' resumed")
    assert "run 'long' started" in first and "run 'long' resumed" not in resumed
    assert re.search(r"run ended at env_step=\d+", first)  # the first job ended its run: the final checkpoint
    assert evaluated_at(resumed)[0] > evaluated_at(first)[0]  # from the first job's checkpoint, not from scratch
