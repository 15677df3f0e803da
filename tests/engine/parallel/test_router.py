"""The router: topic delivery to subscribers only, authentication, sequence counting, membership, binding."""
import contextlib
import errno
import gc
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pynng
import pytest

from conveyor.engine import Task
from conveyor.engine.parallel import generate_secret
from conveyor.engine.parallel.guard import close_socket
from conveyor.engine.parallel.router import CONTROL_TOPIC, Router
from tests.engine.parallel._groups import kill_group
from tests.engine.parallel._wire import FAST, SECRET, WAIT, as_peer, eventually, join_as, raw_sender

PEER_SCRIPT = Path(__file__).with_name("_router_peer.py")
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def spawn_peer(tmp_path):
    """Start ``_router_peer.py`` in its own session; kill its process group at the end."""
    procs = []

    def spawn(node_id, listen, *peers):
        env = {**os.environ, "CONVEYOR_TEST_SECRET": SECRET.hex(), "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, str(PEER_SCRIPT), node_id, listen, *peers], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], WAIT * 2)
        assert ready, f"peer {node_id} did not start within {WAIT * 2}s"
        address = proc.stdout.readline().decode().strip()
        assert address, f"peer {node_id} exited with {proc.wait(timeout=WAIT)}"
        return proc, address

    yield spawn
    for proc in procs:
        kill_group(proc, WAIT)


def collect(router, topic):
    got = queue.Queue()
    router.on(topic, got.put)
    return got


def test_a_message_reaches_only_the_peers_subscribed_to_its_topic(make_router):
    hub = make_router("hub", listen="tcp://127.0.0.1:0")
    wants = make_router("wants", peers=[hub.address])
    other = make_router("other", peers=[hub.address])
    got = collect(wants, "x")
    other_got = collect(other, "y")
    hub.wait_for_peers(2, WAIT)
    assert hub.wait_for_subscribers("x", 1, WAIT) == ["wants"]
    assert hub.publish("x", {"n": 1}) == 1
    assert got.get(timeout=WAIT) == {"n": 1}
    assert hub.publish("y", [2]) == 1  # ordered behind nothing "other" could have received on "x"
    assert other_got.get(timeout=WAIT) == [2]
    assert other.stats()["received"] == 1 and wants.stats()["received"] == 1
    eventually(lambda: hub.stats()["sent"] == 2, "the sender threads count both messages once sent")


def test_the_handshake_makes_every_node_know_the_live_peers(make_router):
    a = make_router("a", listen="tcp://127.0.0.1:0")
    b = make_router("b", peers=[a.address])
    c = make_router("c", peers=[a.address, b.address])
    assert a.wait_for_peers(2, WAIT) == ["b", "c"]
    assert b.wait_for_peers(2, WAIT) == ["a", "c"]
    assert c.wait_for_peers(2, WAIT) == ["a", "b"]
    assert c.stats()["peers"] == ["a", "b"]


def test_waiting_for_a_peer_that_never_answers_names_the_address(make_router, tmp_path):
    absent = f"ipc://{tmp_path}/absent.ipc"
    lonely = make_router("lonely", peers=[absent])
    with pytest.raises(TimeoutError, match="absent.ipc"):
        lonely.wait_for_peers(1, timeout=0.2)


def test_three_routers_in_two_processes_exchange_messages(make_router, spawn_peer):
    hub = make_router("hub", listen="tcp://127.0.0.1:0")
    side = make_router("side", peers=[hub.address])
    pongs = collect(hub, "pong")
    side_pongs = collect(side, "pong")
    proc, address = spawn_peer("far", "tcp://127.0.0.1:0", hub.address, side.address)
    assert hub.wait_for_peers(2, WAIT) == ["far", "side"]
    hub.wait_for_subscribers("ping", 1, WAIT)
    side.wait_for_subscribers("ping", 1, WAIT)
    assert hub.publish("ping", {"i": 1}) == 1
    assert pongs.get(timeout=WAIT) == {"from": "far", "echo": {"i": 1}}
    assert side_pongs.get(timeout=WAIT) == {"from": "far", "echo": {"i": 1}}
    assert side.publish("ping", b"\x00" * 100_000) == 1
    assert len(pongs.get(timeout=WAIT)["echo"]) == 100_000


def test_forged_corrupted_and_oversize_messages_are_dropped_and_counted(make_router, tmp_path):
    receiver = make_router("receiver", listen=f"ipc://{tmp_path}/receiver.ipc", max_message_size=1 << 16)
    sender = make_router("sender", peers=[receiver.address])
    got = collect(receiver, "x")
    sender.wait_for_subscribers("x", 1, WAIT)
    with raw_sender(receiver.address) as raw:
        sealed = join_as(raw, receiver)  # a known peer whose messages we make by hand
        flipped = bytearray(sealed("x", 100, "good"))
        flipped[len(flipped) // 2] ^= 0x01
        raw.send(sealed("x", 100, "forged", key=generate_secret()))
        raw.send(bytes(flipped))
        raw.send(sealed("x", 101, b"\x00" * (1 << 16)))  # over max, under nng's 2x cut-off
        assert sender.publish("x", "from the sender") == 1  # good traffic still flows
        raw.send(sealed("x", 102, "after"))  # same link: the bad ones were handled first
        assert {got.get(timeout=WAIT), got.get(timeout=WAIT)} == {"from the sender", "after"}
    stats = receiver.stats()
    assert (stats["rejected_auth"], stats["rejected_size"], stats["received"]) == (2, 1, 2)


def test_gaps_count_as_lost_and_repeats_are_dropped_as_duplicated(make_router):
    receiver = make_router("receiver")
    got = collect(receiver, "x")
    with raw_sender(receiver.address) as raw:
        sealed = join_as(raw, receiver)
        for seq in (0, 1, 3, 3, 2, 4, 5):
            raw.send(sealed("x", seq, seq))
        assert [got.get(timeout=WAIT) for _ in range(5)] == [0, 1, 3, 4, 5]
    stats = receiver.stats()
    assert (stats["received"], stats["lost"], stats["duplicated"]) == (5, 1, 2)


def test_a_killed_peer_is_declared_dead_within_the_timeout(make_router, spawn_peer):
    hub = make_router("hub", listen="tcp://127.0.0.1:0", peer_timeout_s=0.5)
    lost = queue.Queue()
    hub.on_peer_lost(lost.put)
    proc, _ = spawn_peer("victim", "tcp://127.0.0.1:0", hub.address)
    hub.wait_for_peers(1, WAIT)
    os.killpg(proc.pid, signal.SIGKILL)
    assert lost.get(timeout=0.5 + 2) == "victim"  # peer_timeout_s, plus slack for a loaded machine
    assert hub.stats()["peers"] == [] and hub.stats()["peers_lost"] == 1
    assert hub.publish("ping", 1) == 0


def test_a_peer_timeout_under_the_default_heartbeat_works_alone_with_a_heartbeat_of_a_quarter_of_it():
    with Router("a", SECRET, peer_timeout_s=0.4) as a, Router("b", SECRET, peers=[a.address], peer_timeout_s=0.4) as b:
        lost = queue.Queue()
        a.on_peer_lost(lost.put)
        a.wait_for_peers(1, WAIT)
        b.wait_for_peers(1, WAIT)
        with pytest.raises(queue.Empty):  # five timeouts long, the heartbeats keep each side alive
            lost.get(timeout=5 * 0.4)
        assert (a.heartbeat_s, a.peers(), b.peers()) == (0.1, ["b"], ["a"])


def test_a_closed_peer_is_dropped_at_once(make_router):
    a = make_router("a", peer_timeout_s=60)
    b = make_router("b", peers=[a.address])
    a.wait_for_peers(1, WAIT)
    lost = queue.Queue()
    a.on_peer_lost(lost.put)
    b.close()
    assert lost.get(timeout=WAIT) == "b"


def test_a_port_in_use_is_an_immediate_error_naming_the_address(make_router):
    first = make_router("first", listen="tcp://127.0.0.1:0")
    with pytest.raises(OSError, match="already in use") as info:
        make_router("second", listen=first.address)
    assert info.value.errno == errno.EADDRINUSE and first.address in str(info.value)


def test_an_ipc_path_too_long_for_a_unix_socket_is_refused_naming_its_size(make_router, tmp_path):
    folder = tmp_path / ("d" * (120 - len(str(tmp_path))))
    folder.mkdir()
    with pytest.raises(OSError, match=r"cannot listen: the path of ipc://.* is 1\d\d bytes, more than the 107 a "
                                      r"Unix socket takes; use a shorter folder") as info:
        make_router("long", listen=f"ipc://{folder}/node.ipc")
    assert info.value.errno == errno.ENAMETOOLONG


def test_a_non_loopback_address_without_a_secret_is_refused():
    with pytest.raises(ValueError, match="without a secret"):
        Router("open", None, listen="tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="without a secret"):
        Router("open", None, peers=["tcp://192.0.2.1:5555"])  # refused before any dial


def test_without_a_secret_routers_on_loopback_share_a_generated_one(make_router):
    a = make_router("a", None, listen="tcp://127.0.0.1:0")
    b = make_router("b", a.secret, peers=[a.address])  # as a local launcher hands it to its children
    assert a.local_only and not b.local_only
    assert b.wait_for_peers(1, WAIT) == ["a"]


def test_close_leaves_no_thread_and_no_ipc_file(tmp_path):
    before = set(threading.enumerate())
    a = Router("a", SECRET, listen=f"ipc://{tmp_path}/a.ipc", **FAST)
    b = Router("b", SECRET, peers=[a.address], **FAST)
    own_dir = Path(b.address[len("ipc://"):]).parent
    b.wait_for_peers(1, WAIT)
    b.close()
    a.close()
    assert set(threading.enumerate()) == before
    assert list(tmp_path.iterdir()) == [] and not own_dir.exists()


def test_a_closed_socket_outlives_its_last_reference_so_a_late_pipe_callback_finds_it(tmp_path):
    listener = pynng.Pull0(listen=f"ipc://{tmp_path}/l.ipc")
    dialer = pynng.Push0(dial=f"ipc://{tmp_path}/l.ipc")
    dialer.add_post_pipe_remove_cb(lambda pipe: None)  # a pipe callback: nng holds a handle to the Socket
    refs = [weakref.ref(listener), weakref.ref(dialer)]
    close_socket(listener)
    close_socket(dialer)
    del listener, dialer
    gc.collect()
    assert all(ref() is not None for ref in refs)  # held a while by close_socket, not collected



def test_task_events_cross_nodes_through_an_attached_router(make_router):
    here, there = Task(), Task()
    a = make_router("a")
    b = make_router("b", peers=[a.address])
    here.attach_router(a)
    there.attach_router(b)
    heard, local = queue.Queue(), []
    there.on("trained", lambda *args: heard.put(args))
    here.on("trained", lambda *args: local.append(args))
    a.wait_for_subscribers("trained", 1, WAIT)
    here.emit("trained", 3, {"loss": 0.5}, only_local=True)
    here.emit("trained", 4, {"loss": 0.25})
    assert heard.get(timeout=WAIT) == (4, {"loss": 0.25})
    assert local == [(3, {"loss": 0.5}), (4, {"loss": 0.25})]
    here.emit("trained", 5, None, only_remote=True)
    assert heard.get(timeout=WAIT) == (5, None) and len(local) == 2


@pytest.mark.parametrize("ends", ["closes", "is killed"])
def test_a_node_restarted_at_the_same_address_is_heard_again_by_those_dialing_it(make_router, spawn_peer,
                                                                                   tmp_path, ends):
    address = f"ipc://{tmp_path}/learner.ipc"
    if ends == "closes":
        learner = make_router("learner", listen=address)
        collector = make_router("collector", peers=[address])
        learner.on("data", lambda payload: None)
        collector.wait_for_subscribers("data", 1, WAIT)
        learner.close()
        # until its goodbye is handled the collector still sees the old learner's subscription, and what it
        # publishes is sealed for the old incarnation, which the new one refuses (delivery is at most once)
        eventually(lambda: "learner" not in collector.peers(), "the collector handles the goodbye")
    else:  # no goodbye: its process dies and the kernel closes its sockets
        proc, _ = spawn_peer("learner", address)
        collector = make_router("collector", peers=[address])
        collector.wait_for_subscribers("ping", 1, WAIT)
        kill_group(proc, WAIT)
    got = queue.Queue()
    restarted = make_router("learner", listen=address)
    restarted.on("data", got.put)
    collector.wait_for_subscribers("data", 1, WAIT)
    assert collector.publish("data", "to the new one") == 1
    assert got.get(timeout=WAIT) == "to the new one"


def test_a_late_state_of_a_dead_incarnation_does_not_keep_its_restarted_node_from_hearing_those_dialing_it(
        make_router, tmp_path):
    # chaos (issue 34): a stopped collector read its dead learner's last states after their connection closed, so its
    # link named that incarnation again and its reconnection to the restarted learner carried no hello: never heard
    address = f"ipc://{tmp_path}/learner.ipc"
    learner = make_router("learner", listen=address)
    collector = make_router("collector", peers=[address])
    learner.on("data", lambda payload: None)
    collector.wait_for_subscribers("data", 1, WAIT)
    late = as_peer(learner, collector, SECRET)  # what the learner sent before it ended, read afterwards
    learner.close()
    eventually(lambda: "learner" not in collector.peers() and collector.stats()["connections"] == 0,
               "the collector handles the goodbye and the closed connections")
    with raw_sender(collector.address) as raw:
        raw.send(late(CONTROL_TOPIC, 1 << 20, {"kind": "state", "address": address, "topics": ["data"],
                                               "heard": ["collector"]}))
        eventually(lambda: "learner" in collector.peers(), "the collector takes the late state")
    got = queue.Queue()
    restarted = make_router("learner", listen=address, auth_timeout_s=60.0)  # its inbox never drops the collector
    restarted.on("data", got.put)
    eventually(lambda: "collector" in restarted.peers(), "the restarted learner hears the collector")
    collector.wait_for_subscribers("data", 1, WAIT)
    assert collector.publish("data", "to the new one") == 1
    assert got.get(timeout=WAIT) == "to the new one"


def test_a_goodbye_is_not_logged_as_a_loss_even_when_the_closing_connection_is_seen_first(make_router, caplog):
    caplog.set_level(logging.INFO, logger="conveyor.engine.parallel.router")
    hub = make_router("hub")
    for i in range(10):  # the bye and the closed connection race: each time the bye must win
        leaving = make_router(f"leaving-{i}", peers=[hub.address])
        hub.on("x", lambda payload: None)
        leaving.wait_for_subscribers("x", 1, WAIT)
        leaving.close()
    def lost():
        return [r for r in caplog.records if "router hub" in r.getMessage() and "lost" in r.getMessage()]

    eventually(lambda: len(lost()) == 10, "every leaving peer's loss logged")  # logged after it is counted
    assert all(r.levelno == logging.INFO and "it closed" in r.getMessage() for r in lost())


def test_a_peer_that_said_goodbye_is_not_taken_back_by_a_state_it_sent_after_it(make_router, caplog):
    """A closing node's goodbye is its last word: a state its control thread announces meanwhile (woken by the loss
    of peers that close at the same time, as a run's nodes do at its end) must not follow it and revive it."""
    caplog.set_level(logging.INFO, logger="conveyor.engine.parallel.router")
    for _ in range(10):
        hub = make_router("hub")
        leaves = [make_router(f"leaf-{j}", peers=[hub.address]) for j in range(3)]
        hub.on("x", lambda payload: None)
        for leaf in leaves:
            leaf.on("x", lambda payload: None)
            leaf.wait_for_subscribers("x", 1, WAIT)
        hub.wait_for_subscribers("x", 3, WAIT)
        closing = [threading.Thread(target=router.close) for router in [hub, *leaves]]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join(WAIT)
    assert "lost (it closed)" in caplog.text and "is back" not in caplog.text


def lines_until(proc, last, unread={}):
    """The lines ``proc`` prints (after its address; blank ones skipped) up to the first that starts with ``last``,
    bounded by WAIT; read from its pipe unbuffered (``unread`` keeps what came after that line, per process)."""
    lines, deadline = [], time.monotonic() + WAIT
    while not lines or not lines[-1].startswith(last):
        data = unread.get(proc.pid, b"")
        if b"\n" not in data:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no line {last!r} within {WAIT}s; got {lines}"
            data += os.read(proc.stdout.fileno(), 4096)
        line, _, unread[proc.pid] = data.partition(b"\n")
        lines += [line.decode().strip()] if line.strip() else []
    return lines


def stopped_past_the_timeout(node, proc, peer_id):
    """SIGSTOP ``proc`` until ``node`` has lost it (its peer timeout); the caller sends SIGCONT."""
    os.kill(proc.pid, signal.SIGSTOP)
    eventually(lambda: peer_id not in node.peers(), f"{node.node_id} losing the stopped {peer_id}")


def test_a_peer_stopped_past_the_peer_timeout_is_taken_back_when_continued_and_loses_nobody_itself(make_router,
                                                                                                   spawn_peer, caplog):
    learner = make_router("learner")
    pongs = collect(learner, "pong")
    proc, _ = spawn_peer("collector", "tcp://127.0.0.1:0", learner.address)
    learner.wait_for_subscribers("ping", 1, WAIT)
    stopped_past_the_timeout(learner, proc, "collector")
    os.kill(proc.pid, signal.SIGCONT)
    learner.wait_for_subscribers("ping", 1, WAIT)  # taken back: live, and reachable again
    eventually(lambda: learner.publish("ping", "again") == 1 and not pongs.empty(), "an answer from the collector")
    assert pongs.get() == {"from": "collector", "echo": "again"}  # once its link to us is proven afresh too
    assert learner.publish("ask", None) == 1
    # the continued node's own silence is no loss of its peers: it never lost the learner
    assert lines_until(proc, "peers_lost") == ["peers_lost 0"]
    assert learner.stats()["peers_lost"] == 1 and learner.peers() == ["collector"]
    assert "router learner: peer collector is back, heard again after" in caplog.text  # one line, as its loss


def open_sockets():
    """This process's open socket descriptors (the pipes to a spawned peer's stdin and stdout are not sockets)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            found += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return found


def test_a_link_kept_for_a_peer_lost_while_stopped_is_closed_after_rejoin_s_leaving_no_descriptor_or_thread(
        make_router, spawn_peer, caplog):
    caplog.set_level(logging.INFO, logger="conveyor.engine.parallel.router")
    learner = make_router("learner", rejoin_s=2.0)
    sockets, threads = open_sockets(), threading.active_count()  # the node before it had a peer
    proc, _ = spawn_peer("collector", "tcp://127.0.0.1:0", learner.address)
    learner.wait_for_subscribers("ping", 1, WAIT)
    assert learner.publish("ping", "a link's sender thread starts") == 1
    stopped_past_the_timeout(learner, proc, "collector")  # never continued: its host might be gone
    assert open_sockets() > sockets  # the link dialed back to it is kept for it to come back (rejoin_s)
    eventually(lambda: open_sockets() == sockets and threading.active_count() == threads, "the kept link closed, and "
               "the node back to its descriptors and threads without a peer")
    assert "router learner: closed the link kept for the peer at tcp://127.0.0.1:" in caplog.text
    assert learner.publish("ping", "to nobody", to_lost=True) == 0


def test_a_closing_node_leaves_its_last_words_and_goodbye_for_a_peer_it_lost_while_that_one_was_stopped(make_router,
                                                                                                      spawn_peer):
    learner = make_router("learner")
    proc, _ = spawn_peer("collector", "tcp://127.0.0.1:0", learner.address)
    learner.wait_for_subscribers("note", 1, WAIT)
    stopped_past_the_timeout(learner, proc, "collector")
    assert learner.publish("note", "over") == 0  # to live peers only
    assert learner.publish("note", "the end", to_lost=True) == 0  # queued on the open connection, not counted
    learner.close()
    os.kill(proc.pid, signal.SIGCONT)
    lines = lines_until(proc, "lost")  # the goodbye is taken on receipt, the note delivered apart: either first
    if "note the end" not in lines:
        lines += lines_until(proc, "note")
    assert sorted(lines) == ["lost learner", "note the end"]
