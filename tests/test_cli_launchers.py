"""``conveyor train --launcher slurm|kubernetes``: a scheduler's task becomes the node of its rank; the job files
``conveyor slurm-script`` and ``conveyor k8s-manifest`` print. (Runs of the printed commands: test_launchers_run.py.)"""
import argparse

import pytest

from conveyor.cli import main as cli_main
from conveyor.cli import _distributed as distributed
from conveyor.engine.parallel.cluster import KubernetesError, kubernetes_task

from tests.cli_helpers import assert_usage_error

SECRET = "eb70d51b4816e77666c9785419aec972050f7f15ccc832e36d90a4f82c2d631a"
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


def printed(capsys, *argv):
    assert cli_main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_the_slurm_script_asks_for_a_task_per_node_and_sruns_the_train_command_of_the_layout(capsys):
    text = printed(capsys, "slurm-script", "cartpole/dqn", "--collectors", "3", "--evaluators", "1", "--nodes", "2",
                   "--time", "01:30:00", "--partition", "cpu", "--set", "policy.model.hidden_sizes=[8]")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert sbatch == ["#SBATCH --job-name=conveyor-cartpole_dqn", "#SBATCH --nodes=2", "#SBATCH --ntasks=5",
                      "#SBATCH --requeue", "#SBATCH --time=01:30:00", "#SBATCH --partition=cpu"]
    assert "EXP_NAME=cartpole_dqn-$SLURM_JOB_ID" in lines
    assert lines[-1] == ("exec srun conveyor train cartpole/dqn --collectors 3 --evaluators 1 "
                         "--launcher slurm --secret-file \"$SECRET_FILE\" --exp-name \"$EXP_NAME\" --resume-if-exists "
                         "--no-progress --set 'policy.model.hidden_sizes=[8]'")


def test_the_slurm_script_writes_the_resources_asked_for_as_sbatch_lines(capsys):
    text = printed(capsys, "slurm-script", "cartpole/dqn", "--collectors", "2", "--nodes", "1", "--account", "rl-lab",
                   "--cpus-per-task", "4", "--mem", "16G", "--output", "logs/%x-%j.out", "--time", "1-00:00:00")
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch[4:] == ["#SBATCH --time=1-00:00:00", "#SBATCH --account=rl-lab", "#SBATCH --cpus-per-task=4",
                          "#SBATCH --mem=16G", "#SBATCH --output=logs/%x-%j.out"]


def test_a_slurm_job_of_several_learners_places_them_first_and_is_not_requeued(capsys):
    text = printed(capsys, "slurm-script", "cartpole/dqn", "--learners", "2", "--collectors", "2", "--evaluators", "1",
                   "--nodes", "1")
    lines = text.splitlines()
    assert "#SBATCH --ntasks=5" in lines and "#SBATCH --no-requeue" in lines and "#SBATCH --requeue" not in lines
    assert ("# conveyor train cartpole/dqn: nodes 0..1 the data-parallel learners, 2..3 collectors, 4..4 evaluators, "
            "one task each.") in lines
    assert "# A run of several learners cannot resume yet: the job is not requeued." in lines
    assert lines[-1].startswith("exec srun conveyor train cartpole/dqn --collectors 2 --learners 2 --evaluators 1 ")


def test_without_a_secret_file_the_script_makes_one_readable_by_its_owner_only_once_per_job(capsys):
    text = printed(capsys, "slurm-script", "cartpole/dqn", "--collectors", "1", "--nodes", "1")
    assert 'SECRET_FILE="$SLURM_SUBMIT_DIR/.conveyor/job-$SLURM_JOB_ID/secret"' in text
    assert 'if [ ! -s "$SECRET_FILE" ]' in text and "umask 077" in text
    given = printed(capsys, "slurm-script", "cartpole/dqn", "--collectors", "1", "--nodes", "1", "--secret-file",
                    "/shared/my secret", "--exp-name", "mine", "--gpus-per-learner", "2", "--port", "40000",
                    "--ckpt-interval", "60")
    assert "SECRET_FILE='/shared/my secret'" in given and "umask" not in given and "EXP_NAME=mine\n" in given
    assert "#SBATCH --gres=gpu:2" in given
    assert given.rstrip().endswith("--ckpt-interval 60.0 --ports 40000 --device cuda")


@pytest.mark.parametrize("argv, fragment", [
    (["--learners", "0"], "--learners 0: must be an int >= 1"),
    (["--collectors", "0"], "--collectors 0: must be an int >= 1"),
    (["--nodes", "4"], "--nodes 4: the job has 3 tasks"),
    (["--nodes", "0"], "--nodes 0"),
    (["--time", "2h"], "--time '2h': expected HH:MM:SS"),
    (["--partition", "a b"], "--partition 'a b'"),
    (["--exp-name", "a/b"], "is not a run name"),
    (["--gpus-per-learner", "-1"], "--gpus-per-learner must be >= 0"),
    (["--port", "65535"], "--port 65535"),
    (["--ckpt-interval", "0"], "--ckpt-interval must be a number of seconds > 0"),
    (["--peer-timeout", "0"], "--peer-timeout 0.0: must be a number of seconds > 0"),
    (["--account", "a;b"], "--account 'a;b': expected an account name"),
    (["--cpus-per-task", "0"], "--cpus-per-task must be >= 1, got 0"),
    (["--mem", "16 GB"], "--mem '16 GB': expected a size such as 16G"),
    (["--output", "my log.out"], "--output 'my log.out': expected a file name without spaces"),
    (["--entry-typo"], "unrecognized arguments"),
])
def test_bad_slurm_script_input_is_one_line(argv, fragment, capsys):
    base = {"--collectors": "2", "--nodes": "2"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    rest = [word for flag, value in base.items() for word in (flag, value)]
    code = cli_main(["slurm-script", "cartpole/dqn", *rest, *(argv if len(argv) % 2 else [])])
    assert_usage_error(code, capsys, fragment)


def test_an_unknown_or_offline_entry_is_one_line(capsys):
    assert_usage_error(cli_main(["slurm-script", "cartpole/dqm", "--collectors", "1", "--nodes", "1"]), capsys,
                       "did you mean 'cartpole/dqn'")
    from conveyor.zoo import entries, load_entry
    from conveyor.run.nodes import is_offline
    offline = next((name for name in entries() if is_offline(load_entry(name).main_config)), None)
    if offline is not None:
        assert_usage_error(cli_main(["k8s-manifest", offline, "--collectors", "1", "--image", "x"]), capsys,
                           "trains offline")


SAMPLE = ["k8s-manifest", "cartpole/dqn", "--collectors", "2", "--image", "conveyor:latest"]
"""The command docs/k8s/cartpole_dqn.yaml was printed by."""


def test_the_sample_manifest_in_docs_is_what_k8s_manifest_prints_now(capsys):
    from pathlib import Path
    page = Path(__file__).resolve().parents[1] / "docs" / "k8s" / "cartpole_dqn.yaml"
    assert page.read_text() == printed(capsys, *SAMPLE), (
        "docs/k8s/cartpole_dqn.yaml differs from what the command prints: run `conveyor " + " ".join(SAMPLE) +
        " > docs/k8s/cartpole_dqn.yaml` in the repository root and commit it")


def test_the_manifest_is_a_headless_service_and_an_indexed_job_of_one_pod_per_node(capsys):
    import yaml
    service, job = yaml.safe_load_all(printed(capsys, *SAMPLE[:3], "4", *SAMPLE[4:], "--evaluators", "1",
                                              "--runs-claim", "runs-pvc", "--cpu", "2", "--memory", "4Gi"))
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    name = service["metadata"]["name"]
    assert name == "cartpole-dqn" and service["spec"]["selector"] == {"job-name": name}
    assert job["kind"] == "Job" and job["metadata"]["name"] == name
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 6
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == name and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["CONVEYOR_NODES"] == "6" and env["CONVEYOR_NODE_HOST"] == f"{name}-{{index}}.{name}"
    assert container["command"][:8] == ["conveyor", "train", "cartpole/dqn", "--collectors", "4", "--evaluators",
                                        "1", "--launcher"]
    assert container["command"][8] == "kubernetes" and "--resume-if-exists" in container["command"]
    secret_file = container["command"][container["command"].index("--secret-file") + 1]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert secret_file == mounts["secret"]["mountPath"] + "/secret" and mounts["secret"]["readOnly"] is True
    assert volumes["secret"]["secret"] == {"secretName": f"{name}-secret", "defaultMode": 0o400}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "runs-pvc"}
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}


def test_the_job_files_pass_the_peer_timeout_to_every_nodes_train_command(capsys):
    import yaml
    script = printed(capsys, "slurm-script", "cartpole/dqn", "--collectors", "2", "--nodes", "1", "--peer-timeout", "2")
    assert script.rstrip().splitlines()[-1].endswith("--peer-timeout 2.0")
    _, job = yaml.safe_load_all(printed(capsys, *SAMPLE, "--peer-timeout", "30"))
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--peer-timeout") + 1] == "30.0"
    args = train_args("--collectors", "2", "--peer-timeout", "2")
    assert distributed.requested(args) and args.peer_timeout == 2.0


def test_failed_pods_are_retried_and_the_manifest_says_where_checkpoints_live(capsys):
    import yaml
    text = printed(capsys, *SAMPLE)
    assert "# Runs go to an emptyDir: its checkpoints are LOST with the pod" in text and "--runs-claim PVC" in text
    assert list(yaml.safe_load_all(text))[1]["spec"]["backoffLimit"] == 3
    text = printed(capsys, *SAMPLE, "--runs-claim", "runs-pvc", "--backoff-limit", "5")
    assert "# Runs go to the PersistentVolumeClaim runs-pvc: checkpoints outlive the pods" in text
    assert list(yaml.safe_load_all(text))[1]["spec"]["backoffLimit"] == 5
    several = printed(capsys, *SAMPLE, "--learners", "2")  # a retried pod would resume: refused for several learners
    assert list(yaml.safe_load_all(several))[1]["spec"]["backoffLimit"] == 0


def test_pods_of_the_manifest_read_the_layout_the_local_one_has(capsys):
    import yaml
    _, job = yaml.safe_load_all(printed(capsys, *SAMPLE))
    env = {item["name"]: item["value"] for item in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    hosts = [kubernetes_task({**env, "JOB_COMPLETION_INDEX": str(i)}).hosts for i in range(3)]
    assert hosts == [["cartpole-dqn-0.cartpole-dqn", "cartpole-dqn-1.cartpole-dqn", "cartpole-dqn-2.cartpole-dqn"]] * 3


@pytest.mark.parametrize("argv, fragment", [
    (["--learners", "0"], "--learners 0: must be an int >= 1"),
    (["--cpu", "lots"], "--cpu 'lots'"),
    (["--exp-name", "a" * 70], "DNS label"),
    (["--secret-name", "My_Secret"], "--secret-name 'My_Secret'"),
    (["--backoff-limit", "-1"], "--backoff-limit must be >= 0, got -1"),
    (["--learners", "2", "--backoff-limit", "1"], "--backoff-limit 1 with --learners 2"),
    (["--peer-timeout", "-2"], "--peer-timeout -2.0: must be a number of seconds > 0"),
])
def test_bad_k8s_manifest_input_is_one_line(argv, fragment, capsys):
    assert_usage_error(cli_main([*SAMPLE, *argv]), capsys, fragment)


def test_resume_if_exists_starts_a_new_run_then_continues_it(tmp_path, monkeypatch, capsys):
    from tests.cli_helpers import TINY
    monkeypatch.chdir(tmp_path)
    argv = ["train", "cartpole/dqn", *TINY, "--exp-name", "again", "--resume-if-exists"]
    assert cli_main(argv) == 0, capsys.readouterr().err
    assert cli_main(argv) == 0, capsys.readouterr().err
    log = (tmp_path / "runs" / "again" / "log.txt").read_text()
    assert "'again' started" in log and "'again' resumed" in log
