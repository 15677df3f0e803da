"""Distributed zoo runs: 1 learner, collectors and evaluators as processes; nodes.json, resume, the CLI's flags."""
import contextlib
import copy
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.cli import main as cli_main
from conveyor.engine import Role
from conveyor.engine.parallel.router import Router
from conveyor.middleware import load_checkpoint
from conveyor.middleware.distributed import EXCHANGE_TIMEOUT_S
from conveyor.middleware.ledger import transition_account
from conveyor.schema import ConfigError
from conveyor.zoo import load_entry
from conveyor.run import Layout, train_distributed
from benchmarks._cluster import wait_until
from benchmarks._harness import free_ports
from tests.cli_helpers import TINY, assert_usage_error
from tests.launcher_helpers import group_gone
from tests.zoo._short_grace_entry import GRACE_S as SHORT_GRACE_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def by_role(run, role):
    return [node for node in run.nodes if node["role"] == role]


def test_dqn_learner_trains_on_both_collectors_nodes_json_names_every_worker_and_a_normal_end_logs_no_lost_peer(
        in_tmp, capfd, caplog):
    """One run of 1 learner, 2 collectors and 1 evaluator checked for three properties: the learner trained on both
    collectors' batches, nodes.json names every worker, and no node or launcher logged a lost peer (the workers'
    warnings go to the inherited stderr, the launcher's to logging)."""
    run = train_distributed(load_entry("cartpole/dqn"), collectors=2, evaluators=1, exp_name="dist", max_env_step=300,
                            progress=False)
    learner, = by_role(run, "learner")
    collectors = by_role(run, "collector")
    assert run.env_step == learner["env_step"] >= 300 and run.train_iter > 0 and run.last_eval_value is not None
    assert len(collectors) == 2 and all(c["collected"] > 0 for c in collectors)
    # it trained on both collectors' batches (what a collector collected can exceed what the learner took from it:
    # the batches it collected ahead of the learner's last iteration, the rows its n-step enhancer still held)
    assert sorted(learner["received_from"]) == ["1", "2"] and all(learner["received_from"].values())
    assert sum(learner["received_from"].values()) == run.env_step
    assert run.transitions["unaccounted"] == 0 and run.transitions["collected"] == sum(c["offered"] for c in collectors)
    rows = json.loads((in_tmp / "runs" / "dist" / "nodes.json").read_text())
    assert [(r["node_id"], r["roles"]) for r in rows] == [(0, ["learner"]), (1, ["collector"]), (2, ["collector"]),
                                                          (3, ["evaluator"])]
    assert sorted(r["pid"] for r in rows) == sorted(n["pid"] for n in run.nodes)
    assert all(r["address"].startswith("ipc://") for r in rows)
    final = load_checkpoint(in_tmp / "runs" / "dist" / "ckpt" / "final.pth.tar")
    assert final["ctx"]["env_step"] == run.env_step and final["ctx"]["last_eval_value"] == run.last_eval_value
    assert (in_tmp / "runs" / "dist" / "ckpt" / "eval_best.pth.tar").is_file()
    err = capfd.readouterr().err
    assert "lost" not in err and "lost" not in caplog.text, err + caplog.text


def test_without_evaluator_nodes_the_learner_evaluates_and_the_stop_value_ends_the_run(in_tmp):
    cfg = copy.deepcopy(load_entry("cartpole/dqn").main_config)
    cfg.env.stop_value = 0.0  # the first evaluation reaches it
    run = train_distributed(load_entry("cartpole/dqn"), collectors=2, cfg=cfg, exp_name="selfeval", max_env_step=10**6,
                            progress=False)
    assert run.last_eval_value is not None and run.env_step < 10**6
    rows = json.loads((in_tmp / "runs" / "selfeval" / "nodes.json").read_text())
    assert [(r["node_id"], r["roles"]) for r in rows] == [(0, ["evaluator", "learner"]), (1, ["collector"]),
                                                          (2, ["collector"])]


@pytest.mark.slow
def test_resume_continues_a_distributed_run_from_the_learners_checkpoint(in_tmp):
    first = train_distributed(load_entry("cartpole/dqn"), collectors=2, exp_name="again", max_env_step=200, progress=False)
    saved = load_checkpoint(in_tmp / "runs" / "again" / "ckpt" / "latest.pth.tar")
    assert saved["ctx"]["env_step"] == first.env_step
    second = train_distributed(load_entry("cartpole/dqn"), collectors=2, exp_name="again", max_env_step=500, resume=True,
                               progress=False)
    assert second.env_step >= 500 and second.train_iter > first.train_iter
    collected = sum(c["collected"] for c in by_role(second, "collector"))
    assert second.env_step - first.env_step <= collected < second.env_step  # counting went on from the checkpoint


@pytest.mark.slow
def test_two_launches_on_loopback_tcp_share_one_run(tmp_path):
    """As two hosts would: the learner and the evaluator in one launch, the collectors in another, one secret."""
    secret = tmp_path / "secret"
    secret.write_text("eb70d51b4816e77666c9785419aec972050f7f15ccc832e36d90a4f82c2d631a")
    secret.chmod(0o600)
    runs = {"A": tmp_path / "a", "B": tmp_path / "b"}
    port = free_ports(4)
    common = ["train", "cartpole/dqn", "--collectors", "2", "--evaluators", "1", "--protocol", "tcp", "--address",
              "127.0.0.1", "--secret-file", str(secret), "--max-env-step", "200", "--no-progress", "--exp-name", "two"]
    argv = {"A": [*common, "--node-ids", "0,3", "--ports", f"{port},{port + 1}"],
            "B": [*common, "--node-ids", "1,2", "--ports", f"{port + 2},{port + 3}", "--attach-to",
                  f"tcp://127.0.0.1:{port}"]}
    procs = {}
    try:
        for host, folder in runs.items():
            folder.mkdir()
            procs[host] = subprocess.Popen([sys.executable, "-m", "conveyor", *argv[host]], cwd=folder,
                                           env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        outs = {host: proc.communicate(timeout=300) for host, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    assert [procs[h].returncode for h in "AB"] == [0, 0], outs
    rows = json.loads((runs["A"] / "runs" / "two" / "nodes.json").read_text())
    assert [(r["node_id"], r["address"].rsplit(":", 1)[1]) for r in rows] == [
        (0, str(port)), (1, str(port + 2)), (2, str(port + 3)), (3, str(port + 1))]
    assert not (runs["B"] / "runs").exists()  # the collectors' host writes nothing
    assert outs["A"][0].startswith("budget reached: env step ") and "env step None" not in outs["B"][0]


@pytest.mark.slow
def test_ppo_runs_with_two_collectors_and_an_evaluator(in_tmp):
    run = train_distributed(load_entry("cartpole/ppo"), collectors=2, evaluators=1, exp_name="ppo", max_env_step=1024,
                            progress=False)
    assert run.env_step >= 1024 and run.train_iter > 0 and run.last_eval_value is not None
    assert all(c["collected"] > 0 for c in by_role(run, "collector"))


def sigtermed(in_tmp, exp_name, ready, *argv, entry="cartpole/dqn", collectors="2"):
    """``conveyor train ENTRY --collectors COLLECTORS ARGV`` in its own process group, SIGTERMed once ``ready()``
    has returned; its final checkpoint, after checking the exit code 143 and that no process of the group is left."""
    proc = subprocess.Popen([sys.executable, "-m", "conveyor", "train", entry, "--collectors", collectors, *argv,
                             "--exp-name", exp_name, "--no-progress", "--ckpt-interval", "0.2"], cwd=in_tmp,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready(proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 143, err[-2000:]
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    return load_checkpoint(in_tmp / "runs" / exp_name / "ckpt" / "final.pth.tar")


def sigterm_after_a_first_evaluation(in_tmp, exp_name, *argv, entry="cartpole/dqn"):
    """:func:`sigtermed` with 4 nodes, once the run has evaluated and the learner has trained."""
    ckpt = in_tmp / "runs" / exp_name / "ckpt"
    nodes = in_tmp / "runs" / exp_name / "nodes.json"

    def ready(proc):
        wait_until(lambda: nodes.is_file() and len(json.loads(nodes.read_text())) == 4, 240, "4 nodes in nodes.json")
        wait_until(lambda: (ckpt / "eval_best.pth.tar").is_file(), 120, "a first evaluation")
        # An evaluator node evaluates the first weights before the learner has trained, maybe before its task.run;
        # the learner's first interval checkpoint is written between its iterations: it trains.
        wait_until(lambda: (ckpt / "latest.pth.tar").is_file(), 120, "the learner's first checkpoint")

    return sigtermed(in_tmp, exp_name, ready, *argv, entry=entry)


LEARNER_STARTS_LATE = str(Path(__file__).with_name("_learner_starts_late_entry.py"))


@pytest.mark.slow
def test_sigterm_to_the_launcher_writes_the_learners_final_checkpoint_and_leaves_no_process(in_tmp):
    """cartpole/dqn with an evaluator node, whose learner starts late (the race the SIGTERM's wait pins): once it
    trains, the run is a plain cartpole/dqn one, SIGTERMed at the same point, so one run checks both (the plain run
    with two learners: test_data_parallel_layout's SIGTERM test)."""
    final = sigterm_after_a_first_evaluation(in_tmp, "sig", "--evaluators", "1", entry=LEARNER_STARTS_LATE)
    assert final["ctx"]["env_step"] > 0


LEARNER_HELD = Path(__file__).with_name("_learner_held_entry.py")


def test_sigterm_before_the_learner_runs_still_writes_its_final_checkpoint_and_leaves_no_process(in_tmp):
    """SIGTERM to the launcher while the learner, its run directory made, has not built its pipeline yet (held there
    until asked to stop: the window a loaded machine opens between the handshake and ``task.run``): the run ends as
    it starts, with its final checkpoint, exit code 143 and no process left."""
    held = in_tmp / "runs" / "held" / "held"

    def ready(proc):
        wait_until(lambda: held.is_file() or proc.poll() is not None, 120, "the learner to hold its start")

    assert sigtermed(in_tmp, "held", ready, entry=str(LEARNER_HELD), collectors="1")["ctx"]["env_step"] == 0


def test_a_name_that_holds_a_run_is_refused_in_one_line(in_tmp, capsys):
    (in_tmp / "runs" / "taken").mkdir(parents=True)
    (in_tmp / "runs" / "taken" / "config.json").write_text("{}")
    assert cli_main(["train", "cartpole/dqn", "--collectors", "1", "--exp-name", "taken", "--no-progress"]) == 2
    assert "already holds a run: continue it with --resume" in capsys.readouterr().err


def files_of(folder):
    """Every file and folder under ``folder``, with its size and modification time."""
    return {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in folder.rglob("*")}


@pytest.mark.parametrize("first, then, fragment", [
    ([], ["--collectors", "2"], "cannot resume 'layout' as a distributed run: it was trained in one process "
                                "(runs/layout has no nodes.json); resume it without --collectors and --evaluators"),
    (["--collectors", "2"], [], "cannot resume 'layout' in one process: it was trained as 1 learner and 2 collectors "
                                "(runs/layout/nodes.json); resume it with --collectors 2"),
])
def test_resuming_in_another_layout_is_one_line_naming_both_and_leaves_the_run_directory_as_it_was(
        in_tmp, capsys, first, then, fragment):
    assert cli_main(["train", "cartpole/dqn", *TINY, *first, "--exp-name", "layout"]) == 0
    capsys.readouterr()
    before = files_of(in_tmp / "runs")
    code = cli_main(["train", "cartpole/dqn", "--resume", "--max-env-step", "128", "--no-progress", *then,
                     "--exp-name", "layout"])
    assert_usage_error(code, capsys, fragment)
    assert files_of(in_tmp / "runs") == before


def test_a_distributed_run_whose_start_failed_is_started_over_by_resume(in_tmp, capsys):
    with pytest.raises(RuntimeError, match="the learner fails at its start"):
        train_distributed(load_entry(str(Path(__file__).with_name("_learner_fails_at_start_entry.py"))), collectors=2,
                          exp_name="again", max_env_step=64, progress=False)
    assert (in_tmp / "runs" / "again" / "config.json").is_file() and not (in_tmp / "runs" / "again" / "ckpt").exists()
    assert cli_main(["train", "cartpole/dqn", "--collectors", "2", "--resume", "--exp-name", "again", "--max-env-step",
                     "64", "--no-progress"]) == 0, capsys.readouterr().err
    assert load_checkpoint(in_tmp / "runs" / "again" / "ckpt" / "final.pth.tar")["ctx"]["env_step"] >= 64


def test_a_collector_whose_first_batch_comes_after_the_learner_finished_ends_with_the_run(in_tmp):
    """The learner reaches its budget on collector 1's batches and unsubscribes before collector 2 (slow to start)
    sends its first: collector 2 drops it and ends its run at once, it does not wait for a learner that is gone."""
    started = time.monotonic()
    run = train_distributed(load_entry(str(Path(__file__).with_name("_late_collector_entry.py"))), collectors=2,
                            exp_name="late", max_env_step=64, progress=False)
    learner, = by_role(run, "learner")
    late = next(n for n in run.nodes if n["node_id"] == 2)
    assert late["collected"] > 0 and "2" not in learner["received_from"] and run.env_step >= 64
    assert run.transitions["dropped"]["no_learner"] == late["offered"] > 0 and run.transitions["unaccounted"] == 0
    assert time.monotonic() - started < EXCHANGE_TIMEOUT_S  # no wait ran out
    assert load_checkpoint(in_tmp / "runs" / "late" / "ckpt" / "final.pth.tar")["ctx"]["env_step"] == run.env_step


def test_roles_follow_node_ids():
    layout = Layout(collectors=2, evaluators=1)
    assert [layout.role(i) for i in range(layout.n_nodes)] == [Role.LEARNER, Role.COLLECTOR, Role.COLLECTOR,
                                                               Role.EVALUATOR]
    with pytest.raises(ConfigError, match="nodes 0..3"):
        layout.role(4)
    # collectors each their own env stream; the first evaluator the run's seed, so the episodes one process evaluates on
    assert [Layout(2, 2).seed_offset(i) for i in range(5)] == [0, 1, 2, 0, 1]
    assert Layout(2).roles(0) == [Role.LEARNER, Role.EVALUATOR] and Layout(2, 1).roles(0) == [Role.LEARNER]
    with pytest.raises(ConfigError, match="--collectors 0"):
        Layout(collectors=0)


@pytest.mark.parametrize("argv, fragment", [
    (["--evaluators", "1"], "needs --collectors"),
    (["--collectors", "0"], "--collectors 0: must be an int >= 1"),
    (["--collectors", "2", "--evaluators", "-1"], "--evaluators -1"),
    (["--collectors", "2", "--async"], "--async is for one process"),
    (["--collectors", "2", "--node-ids", "1,5"], "node id 5: this run has nodes 0..2"),
    (["--collectors", "2", "--protocol", "tpc"], "did you mean 'tcp'"),
    (["--collectors", "2", "--protocol", "tcp", "--address", "192.0.2.1"], "refusing tcp://192.0.2.1"),
    (["--collectors", "2", "--secret-file", "/no/such/secret"], "cannot read the secret file"),
    (["--collectors", "2", "--max-retries", "2"], "restarts need --auto-recover"),
    (["--collectors", "2", "--auto-recover", "--max-retries", "-1"], "--max-retries -1: must be >= 0"),
    (["--collectors", "2", "--peer-timeout", "0"], "--peer-timeout 0.0: must be a number of seconds > 0"),
    (["--collectors", "2", "--peer-timeout", "-1"], "--peer-timeout -1.0: must be a number of seconds > 0"),
    (["--peer-timeout", "2"], "--peer-timeout 2 needs --collectors N"),
])
def test_bad_distributed_flags_are_one_line_errors_before_any_process_starts(in_tmp, capsys, argv, fragment):
    assert cli_main(["train", "cartpole/dqn", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
    assert not (in_tmp / "runs").exists()


def test_a_peer_timeout_that_is_not_a_positive_number_is_refused_by_train_distributed_before_any_start(in_tmp):
    for bad in (0, -1.5, float("nan"), True, "2"):
        with pytest.raises(ConfigError, match="must be a number of seconds > 0"):
            train_distributed(load_entry("cartpole/dqn"), collectors=2, peer_timeout_s=bad)
    assert not (in_tmp / "runs").exists()


def test_an_offline_entry_refuses_collectors_before_any_process_starts(in_tmp, capsys):
    assert cli_main(["train", "cartpole/bc", "--collectors", "2"]) == 2
    err = capsys.readouterr().err
    assert "trains offline from a dataset" in err and err.count("\n") == 1
    assert not (in_tmp / "runs").exists()


DYING_ENTRY = str(Path(__file__).with_name("_collector_dies_entry.py"))


def test_with_auto_recover_a_killed_collector_is_restarted_and_the_run_reaches_its_budget(in_tmp):
    run = train_distributed(load_entry(DYING_ENTRY), collectors=2, exp_name="recover", max_env_step=600, progress=False,
                            auto_recover=True, max_retries=1)
    restarted = next(n for n in run.nodes if n["node_id"] == 1)
    assert restarted["restarts"] == 1 and restarted["collected"] > 0
    assert run.env_step >= 600 and (in_tmp / "runs" / "recover" / "ckpt" / "final.pth.tar").exists()


def test_without_auto_recover_a_killed_collector_is_named_once_the_others_end(in_tmp):
    from conveyor.engine.parallel.runner import WorkerError
    with pytest.raises(WorkerError, match="worker 1 .* killed by SIGKILL") as info:
        train_distributed(load_entry(DYING_ENTRY), collectors=2, exp_name="norecover", max_env_step=600, progress=False)
    learner = next(r for r in info.value.results if r is not None and r["role"] == "learner")
    assert learner["env_step"] >= 600  # trained on with the other collector


LEARNER_DIES = Path(__file__).with_name("_learner_dies_entry.py")


def test_when_the_learner_dies_the_other_nodes_end_their_runs_at_once(in_tmp):
    from conveyor.engine.parallel.runner import WorkerError
    with pytest.raises(WorkerError, match="worker 0 .* killed by SIGKILL") as info:
        train_distributed(load_entry(str(LEARNER_DIES)), collectors=2, evaluators=1, exp_name="nolearner", max_env_step=2000,
                          progress=False, ready_timeout_s=EXCHANGE_TIMEOUT_S)
    # not ended by a wait running out: counted from the learner's death (the entry's DIED_AT), not from the launch,
    # whose start alone took 30-60 s at load 15-30
    assert time.monotonic() - float((in_tmp / "learner_died_at").read_text()) < EXCHANGE_TIMEOUT_S / 2
    others = [r for r in info.value.results if r is not None]
    assert sorted(r["role"] for r in others) == ["collector", "collector", "evaluator"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_with_auto_recover_a_killed_learner_resumes_from_the_latest_checkpoint_and_the_others_rejoin_it(in_tmp):
    run = train_distributed(load_entry(str(LEARNER_DIES)), collectors=2, evaluators=1, exp_name="relearn", max_env_step=600,
                            progress=False, auto_recover=True, max_retries=1, ckpt_interval=0.01)
    learner, = by_role(run, "learner")
    lives = [[int(n) for n in line.split()] for line in (in_tmp / "learner_lives.txt").read_text().splitlines()]
    assert [restarts for restarts, _, _ in lives] == [0, 1] and learner["restarts"] == 1
    assert lives[0][1] == 0 and lives[1][1] > 0  # the restarted learner's first iteration went on from a checkpoint
    assert run.env_step >= 600 and (in_tmp / "runs" / "relearn" / "ckpt" / "final.pth.tar").is_file()
    assert run.transitions["unaccounted"] == 0  # what the killed learner took after its checkpoint: dropped
    others = [node for node in run.nodes if node["role"] != "learner"]  # the first processes, fed the new learner
    assert sorted(n["role"] for n in others) == ["collector", "collector", "evaluator"]
    assert all(n["restarts"] == 0 for n in others)
    rows = json.loads((in_tmp / "runs" / "relearn" / "nodes.json").read_text())
    assert sorted(r["pid"] for r in rows) == sorted(n["pid"] for n in run.nodes)  # the new learner and the others


SHORT_GRACE = str(Path(__file__).with_name("_short_grace_entry.py"))  # cartpole/dqn whose learner waits SHORT_GRACE_S
PEER_TIMEOUT_S = inspect.signature(Router).parameters["peer_timeout_s"].default
SHORT_PEER_TIMEOUT_S = 2  # --peer-timeout of the tests that wait for a lost node but are not about the default
MARGIN_S = 20  # the end of the run after the wait: a final checkpoint, closing four processes on a busy machine


@pytest.fixture
def launch(in_tmp):
    """Start ``conveyor train ENTRY --collectors 2`` (cartpole/dqn by default) in its own session; its group is killed
    at the end."""
    procs = []

    def start(exp, entry="cartpole/dqn", *extra):
        proc = subprocess.Popen([sys.executable, "-m", "conveyor", "train", entry, "--collectors", "2",
                                 "--exp-name", exp, "--no-progress", "--ckpt-interval", "0.2", *extra], cwd=in_tmp,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc, in_tmp / "runs" / exp

    yield start
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):  # a stopped learner too: SIGKILL ends it
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        wait_until(lambda: group_gone(proc.pid), 30, f"the end of process group {proc.pid}")


def training_nodes(run):
    """nodes.json's rows once every node runs and the learner has trained (its first interval checkpoint)."""
    nodes = run / "nodes.json"
    wait_until(lambda: nodes.is_file() and len(json.loads(nodes.read_text())) == 3, 240, "3 nodes in nodes.json")
    wait_until(lambda: (run / "ckpt" / "latest.pth.tar").is_file(), 120, "the learner's first checkpoint")
    return json.loads(nodes.read_text())


def running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_when_every_collector_is_killed_the_learner_ends_within_grace_s_with_its_final_checkpoint(launch):
    proc, run = launch("nocollector", SHORT_GRACE)  # the end of the wait, not its default length
    learner, *collectors = training_nodes(run)
    for row in collectors:
        os.kill(row["pid"], signal.SIGKILL)
    killed = time.monotonic()
    out, err = proc.communicate(timeout=SHORT_GRACE_S + MARGIN_S + 30)
    assert time.monotonic() - killed < SHORT_GRACE_S + MARGIN_S, err[-2000:]
    assert proc.returncode == 1 and (run / "ckpt" / "final.pth.tar").is_file(), err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("conveyor: error: ") and last.count("killed by SIGKILL") == 2, err[-2000:]
    assert "no collector left (lost: " in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_collectors_end_within_the_peer_timeout_of_a_stopped_learner_which_ends_when_continued(launch):
    proc, run = launch("stopped", SHORT_GRACE, "--peer-timeout", str(SHORT_PEER_TIMEOUT_S))  # not the defaults
    learner, *collectors = training_nodes(run)
    os.kill(learner["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    wait_until(lambda: not any(running(row["pid"]) for row in collectors), SHORT_PEER_TIMEOUT_S + MARGIN_S,
               "the collectors' end")
    assert time.monotonic() - stopped < SHORT_PEER_TIMEOUT_S + MARGIN_S
    os.kill(learner["pid"], signal.SIGCONT)
    continued = time.monotonic()
    out, err = proc.communicate(timeout=SHORT_GRACE_S + MARGIN_S + 30)
    assert time.monotonic() - continued < SHORT_GRACE_S + MARGIN_S, err[-2000:]
    assert proc.returncode == 0 and (run / "ckpt" / "final.pth.tar").is_file(), err[-2000:]
    assert "the learner (node 0) is lost" in err and "Traceback" not in err


class Watched:
    """A launch of ``conveyor train cartpole/dqn --collectors 2 --auto-recover`` (``recover=False``: without it), its
    output read as it comes."""

    def __init__(self, cwd, exp, *extra, recover=True):
        import threading
        self.run = cwd / "runs" / exp
        self.proc = subprocess.Popen([sys.executable, "-m", "conveyor", "train", "cartpole/dqn", "--collectors", "2",
                                      *["--auto-recover"] * recover, "--exp-name", exp, "--no-progress",
                                      "--ckpt-interval", "0.2", *extra], cwd=cwd,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)},
                                     start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out, self.err = [], []
        self._readers = [threading.Thread(target=lines.extend, args=(stream,), daemon=True)
                         for lines, stream in ((self.out, self.proc.stdout), (self.err, self.proc.stderr))]
        for reader in self._readers:
            reader.start()

    def said(self, text):
        """Whether the launch (its nodes share its stderr) has logged ``text``."""
        return any(text in line for line in list(self.err))

    def taken(self, node):
        """The transitions from collector ``node`` in the learner's latest checkpoint (its transition ledger)."""
        return load_checkpoint(self.run / "ckpt" / "latest.pth.tar")["objects"]["ledger"]["taken"].get(str(node), 0)

    def ended(self, timeout):
        """The launch's exit code, once it ended within ``timeout`` seconds; its stderr's tail in the error."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launch still runs {timeout}s on: {''.join(self.err)[-3000:]}") from None
        for reader in self._readers:
            reader.join(timeout=30)
        return code

    def stop(self):
        with contextlib.suppress(ProcessLookupError):  # a stopped node too: SIGKILL ends it
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        wait_until(lambda: group_gone(self.proc.pid), 30, f"the end of process group {self.proc.pid}")


@pytest.fixture
def watched(in_tmp):
    """Start :class:`Watched` launches; each one's process group is killed at the end."""
    started = []
    yield lambda exp, *extra, recover=True: started.append(Watched(in_tmp, exp, *extra, recover=recover)) or started[-1]
    for launch in started:
        launch.stop()


def a_collector_stopped_past_the_peer_timeout(watched, exp, max_env_step, *extra, recover=True):
    """A :class:`Watched` launch to ``max_env_step`` with ``--peer-timeout`` :data:`SHORT_PEER_TIMEOUT_S` whose
    collector 1, once the learner trains, is SIGSTOPped until the learner has lost it; (the launch, the learner's and
    that collector's rows of nodes.json)."""
    launch = watched(exp, "--max-env-step", str(max_env_step), "--peer-timeout", str(SHORT_PEER_TIMEOUT_S), *extra,
                     recover=recover)
    learner, stopped, _ = training_nodes(launch.run)
    os.kill(stopped["pid"], signal.SIGSTOP)
    wait_until(lambda: launch.said("router 0: peer 1 lost (silent"), SHORT_PEER_TIMEOUT_S + MARGIN_S,
               "the learner losing the stopped collector")
    return launch, learner, stopped


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_collector_stopped_is_lost_within_the_peer_timeout_given_on_the_command_line_not_the_default(watched):
    launch = watched("short", "--max-env-step", "100000", "--no-stop", "--peer-timeout", str(SHORT_PEER_TIMEOUT_S))
    _, stopped, _ = training_nodes(launch.run)
    os.kill(stopped["pid"], signal.SIGSTOP)
    since = time.monotonic()
    wait_until(lambda: launch.said("router 0: peer 1 lost (silent"), PEER_TIMEOUT_S + MARGIN_S,
               "the learner losing the stopped collector")
    assert time.monotonic() - since < PEER_TIMEOUT_S, "".join(launch.err)[-3000:]  # 2 s and a heartbeat, not 5
    assert launch.said(f"router 0: peer 1 lost (silent for {float(SHORT_PEER_TIMEOUT_S)}s)")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("recover", [True, False], ids=["auto-recover", "no-auto-recover"])
def test_a_collector_stopped_past_the_peer_timeout_feeds_the_learner_again_when_continued(watched, recover):
    """With or without --auto-recover (which restarts processes that died: this one did not), the continued collector
    rejoins: the learner takes it back, saying so in one line."""
    launch, _, stopped = a_collector_stopped_past_the_peer_timeout(watched, "rejoin", 4000, "--no-stop",  # its budget
                                                                   recover=recover)
    before = launch.taken(1)
    os.kill(stopped["pid"], signal.SIGCONT)
    wait_until(lambda: launch.taken(1) > before or launch.proc.poll() is not None, 120, "its batches taken again")
    assert launch.taken(1) > before, "the run ended before the continued collector fed the learner again"
    wait_until(lambda: (launch.run / "ckpt" / "final.pth.tar").is_file(), 300, "the learner's end at its budget")
    assert launch.ended(SHORT_PEER_TIMEOUT_S + MARGIN_S) == 0 and "".join(launch.out).startswith("budget reached")
    err = "".join(launch.err)
    assert "waiting up to" not in err and "router 1: peer 0 lost" not in err and "Traceback" not in err, err[-3000:]
    assert "router 0: peer 1 is back" in err and "collector stops" not in err
    assert transition_account(launch.run)["unaccounted"] == 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_collector_stopped_past_the_learners_end_learns_the_run_is_over_when_continued_and_exits_with_it(watched):
    launch, learner, stopped = a_collector_stopped_past_the_peer_timeout(watched, "over", 1500)
    assert not (launch.run / "ckpt" / "final.pth.tar").is_file(), "the run ended before the collector was stopped"
    wait_until(lambda: not running(learner["pid"]), 120, "the learner's end")
    os.kill(stopped["pid"], signal.SIGCONT)
    continued = time.monotonic()
    assert launch.ended(EXCHANGE_TIMEOUT_S / 2) == 0, "".join(launch.err)[-3000:]
    assert time.monotonic() - continued < SHORT_PEER_TIMEOUT_S + MARGIN_S  # told, not left to wait for a rejoin
    assert "Traceback" not in "".join(launch.err)
    assert transition_account(launch.run)["unaccounted"] == 0  # what it offered while out is counted by its reason


def test_a_collectors_clock_drops_and_counts_wrong_progress_from_a_peer_with_the_secret(peer_with_the_secret):
    from conveyor.engine import OnlineRLContext, task
    from conveyor.middleware.distributed import PROGRESS_TOPIC, LearnerClock
    mine, peer = peer_with_the_secret
    good = {"node": "9", "train_iter": 3, "env_step": 7, "stop": False}
    wrong = [[1, 2], "stop", {"node": "9"}, {**good, "stop": "yes"}, {**good, "env_step": -7}, {**good, "node": 9}]
    with task.start(ctx=OnlineRLContext()):
        task.add_role(Role.COLLECTOR)
        clock = LearnerClock(lead=1, timeout_s=20)

        def send(ctx):  # after the first iteration; the second waits for the learner's counters to move
            if ctx.total_step == 0:
                peer.wait_for_subscribers(PROGRESS_TOPIC, 1, 20)
                for payload in [*wrong, good]:
                    peer.publish(PROGRESS_TOPIC, payload)

        task.use(clock).use(send)
        task.run(max_step=2)
        assert (task.ctx.train_iter, task.ctx.env_step) == (3, 7) and not task.finish
    assert clock.stats() == {"rejected": len(wrong)} and mine.stats()["handler_errors"] == 0


def test_a_collectors_clock_follows_the_learner_only_so_no_other_node_can_stop_it(peer_with_the_secret):
    import threading

    from conveyor.engine import OnlineRLContext, task
    from conveyor.middleware.distributed import PROGRESS_TOPIC, LearnerClock
    mine, peer = peer_with_the_secret
    forged = [{"node": "9", "train_iter": 1 << 62, "env_step": 1 << 62, "stop": True},  # node 9 is not the learner
              {"node": "0", "train_iter": 1 << 62, "env_step": 1 << 62, "stop": True}]  # node 9 in node 0's name
    with task.start(ctx=OnlineRLContext()):
        task.add_role(Role.COLLECTOR)
        clock = LearnerClock(lead=5, timeout_s=20, learner=0)
        arrived, seen = threading.Event(), []
        mine.on(PROGRESS_TOPIC, lambda payload: seen.append(payload) or len(seen) == len(forged) and arrived.set())
        task.use(clock)
        peer.wait_for_subscribers(PROGRESS_TOPIC, 1, 20)
        for payload in forged:
            peer.publish(PROGRESS_TOPIC, payload)
        assert arrived.wait(20)
        task.run(max_step=2)
        assert (task.ctx.train_iter, task.ctx.env_step) == (0, 0) and not task.finish
    assert clock.stats() == {"rejected": len(forged)}


def test_the_learner_drops_and_counts_wrong_evaluations_from_a_peer_with_the_secret(peer_with_the_secret):
    import threading

    from conveyor.engine import OnlineRLContext, task
    from conveyor.middleware import EVAL_EVENT
    from conveyor.middleware.distributed import RemoteEvaluations
    mine, peer = peer_with_the_secret
    wrong = [[[1]], [{"train_iter": 2}], [{"mean": "high", "train_iter": 2}], [{"mean": 5.0, "train_iter": -1}],
             [{"mean": float("inf"), "train_iter": 2}], [{"mean": float("nan"), "train_iter": 2}],
             [{"mean": 5.0, "train_iter": 3}]]  # past the learner's train_iter
    with task.start(ctx=OnlineRLContext()):
        task.add_role(Role.LEARNER)
        task.ctx.train_iter = 2
        evaluations = RemoteEvaluations(policy=None)
        arrived = threading.Event()
        task.on(EVAL_EVENT, lambda result: arrived.set() if result == {"mean": 5.0, "train_iter": 2} else None)
        peer.wait_for_subscribers(EVAL_EVENT, 1, 20)
        for args in [*wrong, [{"mean": 5.0, "train_iter": 2}]]:  # a task event travels as its argument list
            peer.publish(EVAL_EVENT, args)
        assert arrived.wait(20)
        evaluations(task.ctx)
        assert (task.ctx.last_eval_value, task.ctx.last_eval_iter) == (5.0, 2)
    assert evaluations.stats() == {"rejected": len(wrong)}


def test_the_learner_takes_evaluations_from_its_evaluator_nodes_only_so_no_other_node_ends_the_run(
        peer_with_the_secret):
    import threading

    from conveyor.engine import OnlineRLContext, task
    from conveyor.middleware import EVAL_EVENT
    from conveyor.middleware.distributed import RemoteEvaluations
    mine, peer = peer_with_the_secret  # the peer is node "9"; the run's evaluator is node "3"
    with task.start(ctx=OnlineRLContext()):
        task.add_role(Role.LEARNER)
        evaluations = RemoteEvaluations(policy=None, stop_value=100.0, evaluators=[3])
        arrived = threading.Event()
        task.on(EVAL_EVENT, lambda result: arrived.set())
        peer.wait_for_subscribers(EVAL_EVENT, 1, 20)
        peer.publish(EVAL_EVENT, [{"mean": 500.0, "train_iter": 0}])
        assert arrived.wait(20)
        evaluations(task.ctx)
        assert not task.finish and task.ctx.last_eval_value is None
    assert evaluations.stats() == {"rejected": 1}


def test_a_collector_waits_past_timeout_s_while_a_busy_learner_keeps_sending_its_counters(peer_with_the_secret):
    import threading

    from conveyor.engine import OnlineRLContext, task
    from conveyor.middleware.distributed import PROGRESS_TOPIC, LearnerClock
    mine, peer = peer_with_the_secret
    still = {"node": "9", "train_iter": 1, "env_step": 1, "stop": False}
    done = threading.Event()

    def busy_learner():  # its counters stand still for 3 timeouts, said every quarter timeout, then move
        for _ in range(12):
            peer.publish(PROGRESS_TOPIC, still)
            done.wait(0.25)
        peer.publish(PROGRESS_TOPIC, {**still, "train_iter": 2, "env_step": 5})

    with task.start(ctx=OnlineRLContext()):
        task.add_role(Role.COLLECTOR)
        clock = LearnerClock(lead=1, timeout_s=1.0)

        def start(ctx):
            if ctx.total_step == 0:
                peer.wait_for_subscribers(PROGRESS_TOPIC, 1, 20)
                threading.Thread(target=busy_learner, daemon=True).start()

        task.use(clock).use(start)
        task.run(max_step=3)
        assert (task.ctx.train_iter, task.ctx.env_step) == (2, 5)
    done.set()


def test_a_learners_last_iteration_says_stop_with_its_counters_so_no_collector_runs_ahead_for_nothing(
        peer_with_the_secret):
    """The counters a learner sends after its last iteration carry ``stop``: a collector that heard them starts no
    iteration of the ``lead`` they would otherwise give it, whose batches no learner takes (before, a collector
    could collect up to 2 * lead batches the learner never received, beyond what the tests allow for)."""
    import queue

    from conveyor.engine import OnlineRLContext, task
    from conveyor.middleware.distributed import PROGRESS_TOPIC, LearnerClock
    mine, peer = peer_with_the_secret
    heard = queue.Queue()
    peer.on(PROGRESS_TOPIC, lambda progress: heard.put((progress["train_iter"], progress["stop"])))
    with task.start(ctx=OnlineRLContext()):
        task.add_role(Role.LEARNER)
        clock = LearnerClock(timeout_s=20)

        def train(ctx):
            ctx.train_iter = ctx.total_step + 1
            if ctx.total_step == 1:
                task.finish = True  # the budget reached

        mine.wait_for_subscribers(PROGRESS_TOPIC, 1, 20)
        task.use(clock).use(train)
        task.run(max_step=5)
    assert [heard.get(timeout=20) for _ in range(3)] == [(1, False), (2, True), (2, True)]  # then once more at the end


def test_a_learner_in_a_long_iteration_keeps_sending_its_counters(peer_with_the_secret):
    import threading

    from conveyor.engine import OnlineRLContext, task
    from conveyor.middleware.distributed import PROGRESS_TOPIC, LearnerClock
    mine, peer = peer_with_the_secret
    heard, beats = [], threading.Event()

    def got(progress):
        heard.append((progress["train_iter"], progress["env_step"]))
        if len(heard) >= 3:
            beats.set()

    peer.on(PROGRESS_TOPIC, got)
    with task.start(ctx=OnlineRLContext()):
        task.add_role(Role.LEARNER)
        clock = LearnerClock(timeout_s=0.4)

        def long_second_iteration(ctx):
            ctx.train_iter, ctx.env_step = ctx.total_step + 1, 10 * (ctx.total_step + 1)
            if ctx.total_step == 1:
                assert beats.wait(20), heard  # the first iteration's counters, said again while this one runs

        mine.wait_for_subscribers(PROGRESS_TOPIC, 1, 20)
        task.use(clock).use(long_second_iteration)
        task.run(max_step=2)
    assert heard[:3] == [(1, 10)] * 3
