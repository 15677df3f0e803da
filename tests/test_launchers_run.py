"""The job ``conveyor slurm-script`` / ``conveyor k8s-manifest`` prints, run here without Slurm or Kubernetes:
C + 1 local processes, each with the environment its rank gets from srun (a stand-in ``srun`` on PATH that
starts the tasks as srun does) or from an indexed Job, on cartpole/dqn over loopback."""
import json
import os
import signal
import stat
import sys

import pytest
import yaml

from conveyor.cli import main as cli_main

from benchmarks._cluster import SRUN, marked_jobs, processes_with, stand_in_sbatch, unavailable, wait_until
from benchmarks._harness import free_ports
from tests.launcher_helpers import SETS, WAIT, ended_at, slurm_script

pytestmark = pytest.mark.slow

under_real_slurm = pytest.mark.skipif(
    unavailable() is None, reason="Slurm runs here: tests/test_slurm_cluster.py scancels the same script's jobs on a real "
                                  "cluster and resumes the run")
"""For machines without Slurm; where it runs, the real cluster's test covers the same and more (both signals)."""

@pytest.fixture
def jobs(tmp_path):
    """Start jobs with a stand-in srun and a ``conveyor`` on PATH; every process they started is killed at the
    end (found by a mark in their environment), also when the test fails."""
    with marked_jobs(tmp_path / "bin", {"srun": f"#!{sys.executable}\n{SRUN}"}) as start:
        yield start


def test_the_slurm_script_trains_to_its_final_checkpoint_and_a_requeued_job_resumes_the_run(tmp_path, capsys, jobs):
    path = slurm_script(tmp_path, capsys, "--max-env-step", "300")
    job = stand_in_sbatch(jobs, path, "101")
    assert job.wait(timeout=WAIT) == 0, (tmp_path / "job-101.out").read_text()
    run_dir = tmp_path / "runs" / "cartpole_dqn-101"
    assert (run_dir / "ckpt" / "final.pth.tar").is_file()
    roles = [row["roles"] for row in json.loads((run_dir / "nodes.json").read_text())]
    assert roles == [["evaluator", "learner"], ["collector"], ["collector"]]  # no evaluator node: the learner evaluates
    secret = tmp_path / ".conveyor" / "job-101" / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_bytes()) == 64
    first = secret.read_bytes()
    assert processes_with(jobs.mark) == []
    requeued = stand_in_sbatch(jobs, path, "101")  # the same job started again: the run goes on, with the job's secret
    assert requeued.wait(timeout=WAIT) == 0, (tmp_path / "job-101.out").read_text()
    assert "resumed" in (run_dir / "log.txt").read_text() and secret.read_bytes() == first
    assert len(ended_at(run_dir)) == 2 and ended_at(run_dir)[1] >= ended_at(run_dir)[0] >= 300


def scancel(jobs, path, job_id, run_dir, seen):
    """Wait until the learner has written a latest checkpoint newer than ``seen``, then SIGTERM every task (as
    scancel does); returns when every process of the job has ended."""
    latest = run_dir / "ckpt" / "latest.pth.tar"
    wait_until(lambda: latest.is_file() and latest.stat().st_mtime_ns != seen, WAIT, f"{latest}")
    pids = path.parent / f"pids-{job_id}"
    wait_until(pids.is_file, WAIT, "the tasks' pids")
    for pid in json.loads(pids.read_text()):
        os.kill(pid, signal.SIGTERM)
    wait_until(lambda: processes_with(jobs.mark) == [], WAIT, "every process of the job to end")
    return latest.stat().st_mtime_ns


@under_real_slurm
def test_scancel_writes_the_final_checkpoint_leaves_no_process_and_the_requeued_job_resumes(tmp_path, capsys, jobs):
    path = slurm_script(tmp_path, capsys, "--max-env-step", "1000000", "--ckpt-interval", "1")
    run_dir = tmp_path / "runs" / "cartpole_dqn-7"
    job = stand_in_sbatch(jobs, path, "7")
    seen = scancel(jobs, path, "7", run_dir, None)
    assert job.wait(timeout=WAIT) == 143, (tmp_path / "job-7.out").read_text()
    assert (run_dir / "ckpt" / "final.pth.tar").is_file() and len(ended_at(run_dir)) == 1
    requeued = stand_in_sbatch(jobs, path, "7")
    scancel(jobs, path, "7", run_dir, seen)
    assert requeued.wait(timeout=WAIT) == 143, (tmp_path / "job-7.out").read_text()
    first, second = ended_at(run_dir)
    assert second > first and "resumed" in (run_dir / "log.txt").read_text()


def test_the_pods_of_the_k8s_manifest_train_to_the_final_checkpoint(tmp_path, capsys, jobs):
    port = free_ports(3)
    assert cli_main(["k8s-manifest", "cartpole/dqn", "--collectors", "2", "--image", "conveyor:test", "--port",
                     str(port), "--max-env-step", "300", *SETS]) == 0
    _, job = yaml.safe_load_all(capsys.readouterr().out)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    secret = tmp_path / "secret"  # the mounted Secret: its key 'secret' as a file the pod's user alone reads
    secret.write_text("eb70d51b4816e77666c9785419aec972050f7f15ccc832e36d90a4f82c2d631a")
    secret.chmod(pod["volumes"][0]["secret"]["defaultMode"])
    command = [str(secret) if word == "/etc/conveyor/secret" else word for word in container["command"]]
    env = {item["name"]: item["value"] for item in container["env"]}
    env["CONVEYOR_NODE_HOST"] = "127.0.0.1"  # no cluster DNS here: every pod on loopback, each its own port
    pods = [jobs(command, {**env, "JOB_COMPLETION_INDEX": str(index)}, tmp_path, tmp_path / f"pod-{index}.out")
            for index in range(job["spec"]["completions"])]
    for index, proc in enumerate(pods):
        assert proc.wait(timeout=WAIT) == 0, (tmp_path / f"pod-{index}.out").read_text()
    assert (tmp_path / "runs" / "cartpole_dqn" / "ckpt" / "final.pth.tar").is_file()
