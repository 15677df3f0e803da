"""``conveyor train --launcher slurm|kubernetes``: a scheduler's task becomes the node of its rank; the job files
``conveyor slurm-script`` and ``conveyor k8s-manifest`` print. (Runs of the printed commands: test_launchers_run.py.)"""
import argparse

import pytest

from conveyor.cli import main as cli_main
from conveyor.cli import _distributed as distributed
from conveyor.engine.parallel.cluster import KubernetesError, kubernetes_task

from tests.cli_helpers import assert_usage_error

SECRET = "s" * 64
SLURM = {"SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "gpu[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2,1",
         "CONVEYOR_SECRET": SECRET}
K8S = {"CONVEYOR_NODES": "3", "CONVEYOR_NODE_HOST": "run-{index}.run", "CONVEYOR_SECRET": SECRET}


def train_args(*argv):
    parser = argparse.ArgumentParser()
    distributed.add_arguments(parser)
    return parser.parse_args(list(argv))


def placed(argv, environ, n_nodes=3):
    from conveyor.cli.task import launch_options
    args = train_args(*argv)
    return distributed.placed(args, launch_options(args, environ), n_nodes, environ)


def test_a_slurm_task_is_the_node_of_its_rank_listening_on_its_host_and_dialing_the_others():
    where = placed(["--collectors", "2", "--launcher", "slurm", "--ports", "5000"], {**SLURM, "SLURM_PROCID": "1"})
    assert where["node_ids"] == [1] and where["address"] == "gpu1" and where["ports"] == [5001]
    assert where["protocol"] == "tcp" and where["attach_to"] == ["tcp://gpu1:5000", "tcp://gpu2:5002"]
    assert where["secret"] == SECRET.encode()


def test_a_pod_of_an_indexed_job_is_the_node_of_its_index_and_node_0_is_the_first_pods_service_name():
    where = placed(["--collectors", "2", "--launcher", "kubernetes"], {**K8S, "JOB_COMPLETION_INDEX": "2"})
    assert where["node_ids"] == [2] and where["address"] == "run-2.run" and where["ports"] == [29652]
    assert where["attach_to"] == ["tcp://run-0.run:29650", "tcp://run-1.run:29651"]


def test_one_host_for_every_pod_gives_each_its_own_port():
    assert kubernetes_task({**K8S, "CONVEYOR_NODE_HOST": "127.0.0.1", "JOB_COMPLETION_INDEX": "0"}).hosts == \
        ["127.0.0.1"] * 3


@pytest.mark.parametrize("env, fragment", [
    ({"JOB_COMPLETION_INDEX": "0"}, "CONVEYOR_NODES is not"),
    ({"JOB_COMPLETION_INDEX": "x", "CONVEYOR_NODES": "2"}, "JOB_COMPLETION_INDEX='x' is not an integer"),
    ({"JOB_COMPLETION_INDEX": "2", "CONVEYOR_NODES": "2"}, "is not a rank"),
    ({"JOB_COMPLETION_INDEX": "0", "CONVEYOR_NODES": "2"}, "CONVEYOR_NODE_HOST=''"),
    ({"JOB_COMPLETION_INDEX": "0", "CONVEYOR_NODES": "2", "CONVEYOR_NODE_HOST": "a-{i}"}, "{index}"),
])
def test_a_bad_indexed_job_environment_is_a_one_line_error(env, fragment):
    with pytest.raises(KubernetesError) as caught:
        kubernetes_task(env)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_outside_an_indexed_job_or_with_one_pod_there_is_no_task():
    assert kubernetes_task({}) is None
    assert kubernetes_task({"JOB_COMPLETION_INDEX": "0", "CONVEYOR_NODES": "1"}) is None


@pytest.mark.parametrize("argv, env, fragments", [
    (["--launcher", "slurm"], {}, ["SLURM_PROCID is not set", "srun -n 3"]),
    (["--launcher", "kubernetes"], {}, ["JOB_COMPLETION_INDEX is not set", "indexed Job of 3 completions"]),
    (["--launcher", "slurm"], {**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                               "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, ["has 4 nodes", "needs 3", "srun -n 3"]),
    (["--launcher", "slurm", "--node-ids", "1"], {**SLURM, "SLURM_PROCID": "0"}, ["decides --node-ids"]),
    (["--launcher", "slurm"], {**SLURM, "SLURM_PROCID": "0", "CONVEYOR_SECRET": None}, ["same secret"]),
    (["--launcher", "slurm", "--ports", "5000,5001"], {**SLURM, "SLURM_PROCID": "0"}, ["the first port"]),
])
def test_a_launcher_outside_its_job_or_for_another_layout_is_one_line(argv, env, fragments, monkeypatch, capsys,
                                                                       tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in [*SLURM, *K8S, "SLURM_PROCID", "JOB_COMPLETION_INDEX"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    code = cli_main(["train", "cartpole/dqn", "--collectors", "2", *argv, "--no-progress"])
    assert_usage_error(code, capsys, *fragments)
    assert not (tmp_path / "runs").exists()


def test_a_launcher_without_collectors_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_usage_error(cli_main(["train", "cartpole/dqn", "--launcher", "slurm"]), capsys,
                       "--launcher slurm needs --collectors N")
