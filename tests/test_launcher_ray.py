"""``conveyor train ... --launcher ray`` on a local Ray cluster that the tests share (a private temp dir,
``ray.shutdown`` at the end; never ``ray stop``, which ends every Ray process on the machine): cartpole/dqn with
1 learner and 2 collectors as Ray actors over loopback; and the cluster's token authentication, on as the launcher
starts its own (:class:`conveyor.cli._ray_local.LocalCluster`) even where the user's environment says
``RAY_AUTH_MODE=disabled``, the token in a private file, on no command line."""
import builtins
import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from conveyor.cli import main as cli_main
from conveyor.cli._ray_local import LocalCluster
from conveyor.middleware import load_checkpoint

from benchmarks._cluster import processes_with, wait_until
from benchmarks._harness import free_ports
from tests.cli_helpers import TINY, assert_usage_error

LEARNER_HELD = Path(__file__).resolve().parent / "zoo" / "_learner_held_entry.py"
WAIT = 240  # seconds: bound on each run (a healthy one takes about 20 here)
SETS = [word for flag, value in zip(TINY[::2], TINY[1::2]) if flag == "--set" for word in (flag, value)]
CLIENT_S = 120  # seconds: bound on a client's connection
TRIES = {"RAY_gcs_server_port_wait_time_s": "2"}
"""How many connection attempts, a second apart, a client makes before it gives up (Ray's default, 20, makes a refused
one take about 25 s here; it is refused at every attempt, so two show the same refusal)."""
CLIENT = """import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except ConnectionError as exc:
    print("refused:", " ".join(str(exc.__cause__).split()))
else:
    print("connected:", ray.get(ray.remote(lambda: 42).remote()))
"""
REFUSAL = "AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing or incorrect"
"""What Ray 2.60 says when the GCS refuses a missing or wrong token (its last connection error, in its message)."""
USER = {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "the user's own token"}
"""What the user's environment says (and the cluster must not heed)."""


class Cluster:
    """The local Ray cluster of 3 CPUs that this module's tests take turns on (starting one takes about 5 s here,
    stopping one 1.5 s), started when a test needs it as the launcher starts its own (token authentication on),
    under :data:`USER`'s variables. Ray starts every worker in the directory the cluster started in,
    ``workdir``: each run goes to its ``runs``."""

    def __init__(self, ray, workdir):
        self.ray, self.workdir, self.local = ray, workdir, None

    def start(self):
        if self.ray.is_initialized():
            return
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(self.workdir)
            self.local = LocalCluster(self.ray, 3).start()

    def stop(self):
        if self.local is not None:
            self.local.stop()
            self.local = None
        self.ray.shutdown()

    def idle(self):
        """Whether every CPU of the cluster is free: no actor is left."""
        return self.ray.available_resources().get("CPU") == 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The module's :class:`Cluster`, stopped at the end; the module runs under :data:`USER`'s variables."""
    shared = Cluster(pytest.importorskip("ray", reason="the ray extra is not installed"),
                     tmp_path_factory.mktemp("ray-workdir"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in USER.items():
            patch.setenv(name, value)
        yield shared
        if not any(driver.is_alive() for driver in DRIVERS):
            shared.stop()


@pytest.fixture
def ray_cluster(cluster, tmp_path, monkeypatch):
    """The shared cluster, idle, with the driver in its ``workdir``, whose ``runs`` is this test's own
    ``tmp_path / "runs"`` (a link). After the test every actor it started must be gone (Ray frees their CPUs at
    once); else the cluster is stopped, so that the next test starts on a new one, and the test fails."""
    cluster.start()
    (tmp_path / "runs").mkdir()
    link = cluster.workdir / "runs"
    link.unlink(missing_ok=True)
    link.symlink_to(tmp_path / "runs")
    monkeypatch.chdir(cluster.workdir)
    yield cluster
    for driver in DRIVERS:
        driver.join(WAIT)
    if any(driver.is_alive() for driver in DRIVERS):  # a hung run: left to its cluster, which the next tests find busy
        raise AssertionError(f"a driver of the test still runs {WAIT} s after it ended")
    try:
        wait_until(cluster.idle, 30, "every actor of the test to end")
    except AssertionError:
        cluster.stop()
        raise


def train(*argv):
    return cli_main(["train", "cartpole/dqn", "--collectors", "2", "--launcher", "ray", "--ports", str(free_ports(3)),
                     *SETS, "--no-progress", *argv])


def rows(run_dir):
    try:
        return {row["node_id"]: row for row in json.loads((run_dir / "nodes.json").read_text())}
    except (OSError, ValueError):
        return {}


def actor_process(pid):
    """The Ray actor process above the node process ``pid`` (its Parallel.runner launcher, titled ``ray::...``)."""
    while not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::"):
        pid = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("PPid:")))
        assert pid > 1, "no Ray actor above the node"
    return pid


DRIVERS = []
"""The driver threads the module's tests started: the cluster is never shut down under one still in Ray's calls
(that aborts the process, and with it the test worker)."""


def in_background(*argv):
    """``train(*argv)`` in a thread; its exit code lands in the returned list."""
    codes = []
    driver = threading.Thread(target=lambda: codes.append(train(*argv)), daemon=True)
    DRIVERS.append(driver)
    driver.start()
    return driver, codes


def trained(run_dir):
    """Whether the learner has evaluated after training on collected steps (its log's evaluation lines)."""
    try:
        text = (run_dir / "log.txt").read_text()
    except OSError:
        return False
    return any(int(train_iter) > 0 for train_iter in re.findall(r"evaluation at train_iter (\d+),", text))


def checkpointed(run_dir):
    """The counters (``ctx``) of the run's latest checkpoint once the learner has trained before writing it, else
    None (the file is replaced atomically: a read sees a whole checkpoint)."""
    try:
        saved = load_checkpoint(run_dir / "ckpt" / "latest.pth.tar")["ctx"]
    except FileNotFoundError:
        return None
    return saved if saved["train_iter"] > 0 else None


def taken(run_dir):
    """The transitions the learner took from each collector (node id as a string), as its latest checkpoint's
    transition ledger counts them over all its lives."""
    return load_checkpoint(run_dir / "ckpt" / "latest.pth.tar")["objects"]["ledger"]["taken"]


def evaluated_after_resume(run_dir):
    """(train_iter, env_step) of each evaluation the learner logged after it resumed."""
    log = (run_dir / "log.txt").read_text()
    resumed = log.split("run 'cartpole_dqn' resumed")[1] if "run 'cartpole_dqn' resumed" in log else ""
    return [(int(i), int(e)) for i, e in re.findall(r"evaluation at train_iter (\d+), env_step (\d+)", resumed)]


@pytest.mark.slow
@pytest.mark.timeout(3 * WAIT)
def test_with_auto_recover_a_killed_node_process_and_killed_collector_and_learner_actors_all_come_back(
        ray_cluster, tmp_path, capsys, caplog, monkeypatch):
    """One run, three faults in turn: collector 1's node process dies (its actor's runner starts it again), collector
    2's actor dies (Ray restarts it, its node rejoins), the learner's actor dies (Ray restarts it, it resumes from the
    latest checkpoint and both collectors feed it); then SIGTERM to the learner's node ends the run gracefully."""
    import conveyor.cli._ray as launcher

    runs = []  # what the driver returns: every node's summary
    real = launcher.train_on_ray
    monkeypatch.setattr(launcher, "train_on_ray", lambda *a: runs.append(real(*a)) or runs[-1])
    run_dir = tmp_path / "runs" / "cartpole_dqn"
    driver, codes = in_background("--max-env-step", "1000000", "--no-stop", "--auto-recover", "--max-retries", "1",
                                  "--ckpt-interval", "0.5")
    wait_until(lambda: len(rows(run_dir)) == 3 or codes, WAIT, "every node in nodes.json")
    first = rows(run_dir)
    os.kill(first[1]["pid"], signal.SIGKILL)  # the node process, not its actor
    wait_until(lambda: rows(run_dir)[1]["pid"] != first[1]["pid"] or codes, WAIT, "collector 1 restarted in its actor")
    wait_until(lambda: trained(run_dir) or codes, WAIT, "the learner's first evaluation after training")
    os.kill(actor_process(first[2]["pid"]), signal.SIGKILL)  # the actor process dies, its node with it
    wait_until(lambda: rows(run_dir)[2]["pid"] != first[2]["pid"] or codes, WAIT, "collector 2's restarted actor")
    wait_until(lambda: checkpointed(run_dir) or codes, WAIT, "the learner's first checkpoint after training")
    saved = checkpointed(run_dir)  # the learner resumes from this one or a later one it wrote before it died
    os.kill(actor_process(first[0]["pid"]), signal.SIGKILL)
    wait_until(lambda: rows(run_dir)[0]["pid"] != first[0]["pid"] or codes, WAIT, "the restarted learner")
    wait_until(lambda: evaluated_after_resume(run_dir) or codes, WAIT, "the resumed learner to evaluate")
    loaded = taken(run_dir)  # at least what the resumed learner loaded: it has resumed, the old one is gone
    wait_until(lambda: all(taken(run_dir).get(n, 0) > loaded.get(n, 0) for n in ("1", "2")) or codes, WAIT,
               "both collectors' batches in a checkpoint of the resumed learner")
    wait_until(lambda: len(evaluated_after_resume(run_dir)) > 1 or codes, WAIT, "the resumed learner to train")
    assert not codes, capsys.readouterr().err
    os.kill(rows(run_dir)[0]["pid"], signal.SIGTERM)  # the learner's node ends the run after its iteration
    driver.join(WAIT)
    assert codes == [0], capsys.readouterr().err
    assert (run_dir / "ckpt" / "final.pth.tar").is_file()
    assert [row["roles"] for row in rows(run_dir).values()] == [["evaluator", "learner"], ["collector"],
                                                                 ["collector"]]
    nodes = {node["node_id"]: node for node in runs[0].nodes}
    assert nodes[1]["restarts"] == 1 and nodes[1]["pid"] == rows(run_dir)[1]["pid"] != first[1]["pid"]
    assert "the Ray actor of node 2 died; Ray restarts it (restart 1 of 1) and its node rejoins the run" in caplog.text
    assert nodes[2]["restarts"] == 1 and nodes[2]["pid"] == rows(run_dir)[2]["pid"] != first[2]["pid"]
    assert ("the Ray actor of node 0 died; Ray restarts it (restart 1 of 1) and its node resumes the run from its "
            "latest checkpoint") in caplog.text
    assert nodes[0]["restarts"] == 1 and nodes[0]["pid"] == rows(run_dir)[0]["pid"] != first[0]["pid"]
    assert all(nodes[0]["received_from"].get(str(n), 0) > 0 for n in (1, 2))  # both fed the resumed learner
    assert (run_dir / "log.txt").read_text().count("run 'cartpole_dqn' resumed") == 1
    counters = evaluated_after_resume(run_dir)
    assert all(i >= saved["train_iter"] and e >= saved["env_step"] for i, e in counters), counters
    assert runs[0].train_iter > saved["train_iter"]


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_a_collector_actor_dead_beyond_max_retries_is_done_without_then_named_in_one_line(ray_cluster, tmp_path,
                                                                                          capsys):
    run_dir = tmp_path / "runs" / "cartpole_dqn"
    driver, codes = in_background("--max-env-step", "3000", "--no-stop", "--auto-recover", "--max-retries", "0")
    wait_until(lambda: (len(rows(run_dir)) == 3 and trained(run_dir)) or codes, WAIT, "the learner's first evaluation")
    os.kill(actor_process(rows(run_dir)[1]["pid"]), signal.SIGKILL)
    driver.join(WAIT)
    err = capsys.readouterr().err
    assert codes == [1], err
    assert err.strip().splitlines()[-1] == ("conveyor: error: the Ray actor of node 1 (ActorDiedError) died after 0 "
                                            "restarts (--max-retries 0); the other nodes ended the run; run "
                                            "directory runs/cartpole_dqn"), err
    ended = re.findall(r"run ended at env_step=(\d+)", (run_dir / "log.txt").read_text())
    assert int(ended[-1]) >= 3000 and (run_dir / "ckpt" / "final.pth.tar").is_file()  # on the other collector


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_a_killed_collector_actor_ends_the_run_with_its_final_checkpoint_and_one_line(ray_cluster, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "cartpole_dqn"
    driver, codes = in_background("--max-env-step", "1000000")
    wait_until(lambda: len(rows(run_dir)) == 3 or codes, WAIT, "every node in nodes.json")
    os.kill(actor_process(rows(run_dir)[1]["pid"]), signal.SIGKILL)  # the actor process dies, not just its node
    driver.join(WAIT)
    err = capsys.readouterr().err
    assert codes == [1], err
    assert "the Ray actor of node 1 (ActorDiedError) died (Ray restarts actors only with --auto-recover)" in err, err
    assert (run_dir / "ckpt" / "final.pth.tar").is_file()
    pids = [row["pid"] for row in rows(run_dir).values()]  # the orphaned node ends on its own, maybe after the driver
    wait_until(lambda: not [pid for pid in pids if Path(f"/proc/{pid}").exists()], WAIT, "every node process to end")


@pytest.mark.slow
@pytest.mark.timeout(2 * WAIT)
def test_sigterm_to_the_driver_writes_the_final_checkpoint_and_leaves_no_process_and_ray_no_notice(tmp_path):
    pytest.importorskip("ray", reason="the ray extra is not installed")
    mark = uuid.uuid4().hex  # every process the driver starts (Ray's own too) inherits it
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "LAUNCHER_TEST": mark}
    env.pop("RAY_AUTH_MODE", None)  # as most users have it: the launcher sets the mode itself, and Ray prints no notice
    argv = [sys.executable, "-m", "conveyor", "train", str(LEARNER_HELD), "--collectors", "2", "--launcher", "ray",
            "--ports", str(free_ports(3)), *SETS, "--no-progress", "--max-env-step", "1000000"]
    with open(tmp_path / "driver.out", "w") as out:
        driver = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "runs" / "cartpole_dqn"
    try:  # the learner held before its task.run, run directory made: the window a loaded machine opened in the flake
        wait_until(lambda: (run_dir / "held").is_file() or driver.poll() is not None, WAIT, "the learner to hold")
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=WAIT) == 143, (tmp_path / "driver.out").read_text()
        out = (tmp_path / "driver.out").read_text()
        assert (run_dir / "ckpt" / "final.pth.tar").is_file(), out
        assert "Token authentication" not in out, out
        assert out.strip().splitlines()[-1] == ("conveyor: interrupted by SIGTERM; final and latest checkpoints "
                                                "written, continue with --resume; run directory runs/cartpole_dqn"), out
        # the driver's Ctrl-C reached the learner's node (Ray blocks SIGINT in its actors unless the run lets it in)
        assert "worker 0: asked to stop" in (run_dir / "log.txt").read_text()
        wait_until(lambda: processes_with(mark) == [], WAIT, "every process of the run to end")
    finally:
        for pid in processes_with(mark):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(WAIT)
def test_a_layout_the_cluster_cannot_place_is_a_one_line_error(ray_cluster, monkeypatch, capsys):
    import conveyor.cli._ray as launcher

    monkeypatch.setattr(launcher, "_PLACE_S", 1.0)
    code = cli_main(["train", "cartpole/dqn", "--collectors", "3", "--launcher", "ray", *TINY])  # 4 actors, 3 CPUs
    assert_usage_error(code, capsys, "Ray placed not all 4 actors within 1 s", "'CPU': 3.0")


@pytest.fixture
def local(cluster):
    """The shared cluster, started: its :class:`~conveyor.cli._ray_local.LocalCluster`."""
    cluster.start()
    return cluster.local


def clients(local, tmp_path, **envs):
    """What :data:`CLIENT` printed, connecting to ``local`` with each of ``envs``' Ray variables (none of the
    user's or the cluster's, and a home without Ray's default token file), the clients run side by side."""
    base = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    started = {name: subprocess.Popen([sys.executable, "-c", CLIENT, local.address], text=True,
                                      env={**base, "HOME": str(tmp_path), **env}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
               for name, env in envs.items()}
    try:
        return {name: client.communicate(timeout=CLIENT_S)[0].strip().splitlines()[-1:]
                for name, client in started.items()}
    finally:
        for client in started.values():
            if client.poll() is None:
                client.kill()
                client.wait()


def test_the_token_file_is_mode_600_in_a_directory_of_mode_700(local):
    assert local.token_path.parent == local.private
    assert local.private.stat().st_mode & 0o777 == 0o700
    assert local.token_path.stat().st_mode & 0o777 == 0o600
    assert len(local.token_path.read_text()) == 64


def test_a_client_without_the_token_or_with_another_is_refused(local, tmp_path):
    printed = clients(local, tmp_path, none=TRIES, wrong={**TRIES, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
                      users={**TRIES, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": USER["RAY_AUTH_TOKEN"]})
    assert {name: lines[0].startswith("refused:") and REFUSAL in lines[0] for name, lines in printed.items()} == {
        "none": True, "wrong": True, "users": True}, printed


def test_a_client_given_the_token_file_connects_and_runs_a_task(local, tmp_path):
    assert clients(local, tmp_path, token={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(local.token_path)}
                   ) == {"token": ["connected: 42"]}


def test_the_clusters_workers_run_at_the_launchers_niceness_not_rays_background_15(local):
    ray = local.ray
    worker = ray.get(ray.remote(lambda: os.getpriority(os.PRIO_PROCESS, 0)).remote())
    assert worker == os.getpriority(os.PRIO_PROCESS, 0)  # the launcher's (this process's), not 15 more


def test_the_token_is_on_no_command_line_and_in_no_environment(local):
    ray = local.ray
    assert ray.get(ray.remote(lambda: os.environ.get("RAY_AUTH_TOKEN_PATH")).remote()) == str(local.token_path)
    token = local.token_path.read_bytes()
    ray_processes, found = 0, []
    for proc in Path("/proc").iterdir():
        try:
            cmdline, environ = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
        except OSError:  # ended, or not ours
            continue
        ray_processes += str(local.private).encode() in cmdline + environ
        found += [f"{proc.name} {part}" for part, text in (("cmdline", cmdline), ("environ", environ)) if token in text]
    assert ray_processes >= 3, "the GCS, the raylet and a worker should name the cluster's private directory"
    assert found == []


def test_stopping_restores_the_users_variables_and_removes_the_token(cluster):
    assert not any(driver.is_alive() for driver in DRIVERS), "a hung driver of an earlier test still runs in Ray"
    cluster.start()
    private = cluster.local.private
    assert os.environ["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in os.environ
    cluster.stop()
    assert not cluster.ray.is_initialized()
    assert {name: os.environ.get(name) for name in (*USER, "RAY_AUTH_TOKEN_PATH")} == {**USER,
                                                                                      "RAY_AUTH_TOKEN_PATH": None}
    assert not private.exists()


def test_several_learners_with_auto_recover_are_refused_before_ray_starts(cluster, capsys):
    assert not any(driver.is_alive() for driver in DRIVERS), "a hung driver of an earlier test still runs in Ray"
    cluster.stop()  # the shared one, if it runs
    assert_usage_error(train("--learners", "2", "--auto-recover", *TINY), capsys,
                       "--learners > 1 with --auto-recover")
    assert not cluster.ray.is_initialized()


def test_a_local_cluster_that_does_not_start_is_a_one_line_error_with_the_way_out(cluster, monkeypatch, capsys):
    assert not any(driver.is_alive() for driver in DRIVERS), "a hung driver of an earlier test still runs in Ray"
    cluster.stop()  # the shared one, if it runs
    before = {name: os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    private = []

    def overloaded(**kwargs):  # as Ray's node.py raises it when its helpers miss the raylet's fixed wait
        private.append(Path(kwargs["_temp_dir"]).parent)
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.\n(more of Ray's words)")

    monkeypatch.setattr(cluster.ray, "init", overloaded)
    code = train(*TINY)
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("conveyor: error: the local Ray cluster did not start (The current node timed out during "
                          "startup.") and "ray start --head" in err and "--ray-address" in err, err
    assert private and not private[0].exists() and not cluster.ray.is_initialized()
    assert {name: os.environ.get(name) for name in before} == before


def test_without_ray_the_launcher_is_a_one_line_error_naming_the_extra(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    assert_usage_error(train(*TINY), capsys, '--launcher ray needs Ray: pip install "conveyor[ray]"')


def test_ray_address_is_for_the_ray_launcher(capsys):
    code = cli_main(["train", "cartpole/dqn", "--collectors", "2", "--ray-address", "auto", *TINY])
    assert_usage_error(code, capsys, "--ray-address is for --launcher ray, not --launcher local")
