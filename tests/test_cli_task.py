"""`conveyor task`: a user's function on several workers, its one-line errors, and Slurm's environment."""
import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks._harness import free_ports
from conveyor.cli import main as cli_main
from conveyor.cli.task import register, runner_options
from conveyor.engine.parallel.cluster import SlurmError, slurm_task

ROOT = Path(__file__).resolve().parents[1]
SECRET = "eb70d51b4816e77666c9785419aec972050f7f15ccc832e36d90a4f82c2d631a"
WAIT = 60  # seconds: bound on each launch (a healthy one takes a few)

USER_MODULE = textwrap.dedent('''
    import json, os
    from pathlib import Path
    from conveyor.engine import task

    def main():
        router = task.router
        peers = router.peers()  # the runner's ready handshake is done: every peer this node waits for is known
        Path(os.environ["OUT_DIR"], f"{router.node_id}.json").write_text(json.dumps({"peers": peers, "pid": os.getpid()}))
''')


def parse(argv, environ=None):
    """``runner_options`` for a ``conveyor task`` command line."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return runner_options(parser.parse_args(["task", "--main", "m.f", *argv]), environ=environ or {})


@pytest.fixture
def package(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "usermain.py").write_text(USER_MODULE)
    (tmp_path / "out").mkdir()
    return tmp_path


@pytest.fixture
def launch():
    """Start ``conveyor task`` processes in their own sessions; stop every group at the end, even on failure."""
    procs = []

    def start(argv, env):
        env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        proc = subprocess.Popen([sys.executable, "-m", "conveyor", "task", *argv], env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)


def test_task_runs_the_function_of_the_package_on_every_worker(package, launch):
    proc = launch(["--package", str(package / "pkg"), "--main", "usermain.main", "--parallel-workers", "3"],
                  {"OUT_DIR": str(package / "out")})
    out, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 0, err
    seen = {p.stem: json.loads(p.read_text()) for p in (package / "out").iterdir()}
    assert {k: v["peers"] for k, v in seen.items()} == {"0": ["1", "2"], "1": ["0"], "2": ["0"]}
    assert len({v["pid"] for v in seen.values()}) == 3


def test_two_slurm_tasks_on_loopback_find_each_other(package, launch):
    port = free_ports(2)
    slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_TASKS_PER_NODE": "2",
             "CONVEYOR_SECRET": SECRET, "OUT_DIR": str(package / "out")}
    argv = ["--package", str(package / "pkg"), "--main", "usermain.main", "--protocol", "tcp", "--ports", str(port)]
    procs = [launch(argv, {**slurm, "SLURM_PROCID": str(rank)}) for rank in (0, 1)]
    for proc in procs:
        out, err = proc.communicate(timeout=WAIT)
        assert proc.returncode == 0, err
    seen = {p.stem: json.loads(p.read_text())["peers"] for p in (package / "out").iterdir()}
    assert seen == {"0": ["1"], "1": ["0"]}


def test_slurm_environment_becomes_one_node_per_task_attached_to_the_others():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_NODELIST": "node[01-02]",
           "SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_NODELIST": "node[01-09]", "CONVEYOR_SECRET": SECRET}
    options = parse(["--protocol", "tcp", "--ports", "7000"], env)
    assert options["n_parallel_workers"] == 1 and options["node_ids"] == [1]
    assert (options["address"], options["ports"]) == ("node01", [7001])
    assert options["attach_to"] == ["tcp://node01:7000", "tcp://node02:7002"]
    assert options["secret"] == SECRET.encode()


def test_slurm_node_list_syntax_is_expanded_one_task_per_host_by_default():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "5", "SLURM_NODELIST": "node[01-03,07],gpu5"}
    assert slurm_task(env).hosts == ["node01", "node02", "node03", "node07", "gpu5"]
    env.update(SLURM_NTASKS="4", SLURM_TASKS_PER_NODE="2(x2)", SLURM_NODELIST="a[1-2]")
    assert slurm_task(env).hosts == ["a1", "a1", "a2", "a2"]


def test_outside_slurm_or_with_one_task_nothing_changes():
    assert slurm_task({}) is None
    assert slurm_task({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "n1"}) is None
    job = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2]"}
    assert parse([], job)["node_ids"] == [0] and parse(["--no-slurm"], job)["node_ids"] is None


@pytest.mark.parametrize("env, fragment", [
    ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, "SLURM_PROCID='x' is not an integer"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, "is not a rank"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "run under srun"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_NODELIST": "n[1-2]"}, "SLURM_STEP_TASKS_PER_NODE"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-"}, "not a Slurm host list"),
])
def test_bad_slurm_environment_is_a_one_line_error(env, fragment):
    with pytest.raises(SlurmError, match=fragment.replace("[", r"\[")):
        slurm_task(env)


@pytest.mark.parametrize("argv, fragment", [
    (["--main", "nodot"], "expected MODULE.FUNC"),
    (["--main", "usermain.mian"], "did you mean 'main'"),
    (["--main", "nomodule.main"], "no module 'nomodule'"),
    (["--main", "usermain.main", "--package", "/no/such/dir"], "no such folder"),
    (["--main", "usermain.main", "--topology", "stra"], "did you mean 'star'"),
    (["--main", "usermain.main", "--protocol", "tpc"], "did you mean 'tcp'"),
    (["--main", "usermain.main", "--parallel-workers", "0"], "--parallel-workers must be >= 1"),
    (["--main", "usermain.main", "--ports", "x"], "expected an integer"),
    (["--main", "usermain.main", "--ports", "5000"], "ports are for protocol='tcp'"),
    (["--main", "usermain.main", "--node-ids", "1,1"], "distinct"),
    (["--main", "usermain.main", "--secret-file", "/no/such/secret"], "cannot read the secret file"),
    (["--main", "usermain.main", "--protocol", "tcp", "--address", "192.0.2.1"], "refusing tcp://192.0.2.1"),
])
def test_bad_arguments_are_one_line_errors_with_exit_code_2(package, capsys, argv, fragment):
    if "--package" not in argv:
        argv = [*argv, "--package", str(package / "pkg")]
    assert cli_main(["task", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and err.startswith("conveyor: error: ")


def test_slurm_with_several_workers_is_refused(monkeypatch, capsys, package):
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2]"}.items():
        monkeypatch.setenv(name, value)
    assert cli_main(["task", "--package", str(package / "pkg"), "--main", "usermain.main",
                     "--parallel-workers", "2"]) == 2
    assert "each Slurm task is one node" in capsys.readouterr().err
