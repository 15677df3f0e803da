"""Faults in a multi-process run: killed collectors (with and without auto_recover), no collector left,
SIGTERM to the launcher, bad messages while training goes on, subscriptions that end with their block."""
import os
import queue
import select
import signal
import time
from pathlib import Path

import pytest
import torch

from conveyor.engine import Parallel, Task, task
from conveyor.engine.parallel import generate_secret
from conveyor.engine.parallel.router import Router
from conveyor.engine.parallel.runner import WorkerError
from tests.engine.parallel import _fault_mains as mains
from tests.engine.parallel._groups import script_groups

WAIT = mains.WAIT
# A silent peer would be declared dead only after peer_timeout_s: far longer than these tests take, so a
# killed collector must be lost through its closed connection, at once.
SLOW_TIMEOUT = dict(heartbeat_s=0.05, peer_timeout_s=10 * WAIT, send_timeout_s=5.0)
LAUNCHER = Path(__file__).with_name("_fault_launcher.py")


def runner(n, **kwargs):
    return Parallel.runner(n, protocol="ipc", ready_timeout_s=WAIT, router_options=SLOW_TIMEOUT, **kwargs)


def test_a_killed_collector_is_lost_at_once_and_the_learner_trains_on_with_the_other():
    started = time.monotonic()
    with pytest.raises(WorkerError, match="worker 2 .* was killed by SIGKILL") as info:
        runner(3)(mains.learn_through_faults, {2: 2}, ("trained_after_loss", 5))
    assert time.monotonic() - started < SLOW_TIMEOUT["peer_timeout_s"]  # not found dead by a timeout
    learner, collector, killed = info.value.results
    assert killed is None and learner["lost"] == ["2"] and learner["stats"]["peers_lost"] == 1
    assert learner["train_iter"] >= learner["train_iter_at_loss"][0] + 5
    at_loss = learner["train_iter_at_loss"][0]
    assert {b["node"] for b in learner["batches"] if b["learner_version"] > at_loss + 1} == {1}  # the other one
    assert len(collector["sent"]) >= 5  # and it ended when the learner did


@pytest.mark.slow  # three workers started, then one again
def test_auto_recover_restarts_a_killed_collector_which_collects_on_the_newest_weights():
    learner, _, restarted = runner(3, auto_recover=True, max_retries=1)(
        mains.learn_through_faults, {2: 2}, ("restarted_sent", 2, 3))
    assert restarted["restarts"] == 1 and learner["lost"] == ["2"]
    first_life = [b for b in learner["batches"] if b["node"] == 2 and b["restarts"] == 0]
    second_life = [b for b in learner["batches"] if b["node"] == 2 and b["restarts"] == 1]
    assert len(first_life) <= 2 and len(second_life) >= 3
    assert second_life[0]["version"] >= learner["version_at_loss"][0]  # the late joiner got the newest weights
    assert learner["train_iter"] > learner["train_iter_at_loss"][0]


def test_with_no_collector_left_the_learner_stops_after_grace_s_and_writes_its_final_checkpoint(tmp_path):
    with pytest.raises(WorkerError, match="worker 1 .* was killed by SIGKILL") as info:
        runner(2)(mains.learn_through_faults, {1: 2}, None, 0.5, str(tmp_path))
    learner = info.value.results[0]
    assert learner["lost"] == ["1"] and learner["train_iter"] == 2
    final = torch.load(tmp_path / "ckpt" / "final.pth.tar", weights_only=False)
    assert final["ctx"]["train_iter"] == 2 and final["objects"]["policy"] == {"version": 2}


def test_auto_recover_arguments_are_checked():
    with pytest.raises(ValueError, match="need auto_recover=True"):
        Parallel.runner(2, max_retries=2)
    with pytest.raises(ValueError, match="max_retries=-1"):
        Parallel.runner(2, auto_recover=True, max_retries=-1)


@pytest.fixture
def launcher(tmp_path):
    """Start ``_fault_launcher.py`` in its own session; kill its process group at the end."""
    with script_groups(WAIT) as start:
        yield lambda protocol, where: start(LAUNCHER, tmp_path, protocol, where)


def free_ports(n):
    """``n`` consecutive tcp ports on 127.0.0.1 that nothing listens on now."""
    for first in range(47400, 48400, n):
        try:
            for port in range(first, first + n):
                Router("probe", generate_secret(), listen=f"tcp://127.0.0.1:{port}").close()
        except OSError:
            continue
        return list(range(first, first + n))
    raise RuntimeError("no free tcp ports in 47400-48400")


@pytest.mark.parametrize("protocol, whole_group", [("ipc", False), ("tcp", False), ("ipc", True)],
                         ids=["ipc", "tcp", "ipc-every-process"])
def test_sigterm_to_the_launcher_ends_the_run_with_a_final_checkpoint_and_leaves_nothing(tmp_path, launcher, protocol,
                                                                                       whole_group):
    """``whole_group``: every process of the launch gets the SIGTERM, as Slurm's ``scancel --signal=TERM`` sends it
    to every process of a task; a worker then hears it twice (its own and the launcher's), which is one stop."""
    ipc_dir = tmp_path / "ipc"
    ipc_dir.mkdir()
    ports = free_ports(2) if protocol == "tcp" else []
    proc = launcher(protocol, ipc_dir if protocol == "ipc" else ports[0])
    ready, _, _ = select.select([proc.stdout], [], [], 2 * WAIT)
    assert ready and proc.stdout.readline() == b"training\n", f"not training (launcher exit code {proc.poll()})"
    if whole_group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=2 * WAIT) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no worker is left
    assert list(ipc_dir.iterdir()) == []
    if protocol == "tcp":
        for port in ports:  # the ports are free for the next run
            Router("next", generate_secret(), listen=f"tcp://127.0.0.1:{port}").close()
    final = torch.load(tmp_path / "ckpt" / "final.pth.tar", weights_only=False)
    assert final["ctx"]["train_iter"] >= 2


def test_forged_wrong_secret_and_oversize_messages_are_refused_and_counted_while_training_goes_on(tmp_path):
    options = dict(SLOW_TIMEOUT, max_message_size=1 << 16)
    result = Parallel.runner(3, protocol="ipc", address=str(tmp_path), ready_timeout_s=WAIT, router_options=options)(
        mains.learn_under_attack, f"ipc://{tmp_path}/node0.ipc", 5)
    learner = result[0]
    assert result[2] == "sent" and learner["refused_at"] is not None
    assert learner["train_iter"] >= learner["refused_at"] + 5
    stats = learner["stats"]
    assert (stats["rejected_auth"], stats["rejected_size"], stats["malformed"]) == (2, 1, 0)
    assert learner["senders"] == [1]  # the forged batch never reached the learner


def test_event_subscriptions_made_in_a_start_block_end_with_it():
    secret = generate_secret()
    with Router("a", secret, heartbeat_s=0.05) as a, Router("b", secret, peers=[a.address], heartbeat_s=0.05) as b:
        here = Task()
        here.attach_router(a)
        got = queue.Queue()
        here.on("outside", got.put)
        with here.start():
            here.on("inside", got.put)
            assert a.topics() == ["inside", "outside"]
            b.wait_for_subscribers("inside", 1, WAIT)
            here.off("outside", got.put)
            assert a.topics() == ["inside"]
        assert a.topics() == []
        here.detach_router()


def test_exchangers_unsubscribe_when_their_block_closes():
    from conveyor.middleware.exchanger import DATA_TOPIC, MODEL_REQUEST_TOPIC, ContextExchanger, ModelExchanger
    with Router("learner", generate_secret()) as router:
        here = task
        here.attach_router(router)
        try:
            with here.start():
                here.add_role(here.role.LEARNER)
                here.use(ModelExchanger(torch.nn.Linear(1, 1))).use(ContextExchanger())
                assert router.topics() == [DATA_TOPIC, MODEL_REQUEST_TOPIC]
            assert router.topics() == []
        finally:
            here.detach_router()
