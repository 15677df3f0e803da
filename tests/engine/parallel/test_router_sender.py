"""``Router.sender``: inside a handler, the authenticated sender of the message it handles; None elsewhere."""
import queue

from tests.engine.parallel._wire import WAIT


def test_a_handler_learns_who_sent_the_message_it_handles(make_router):
    hub = make_router("hub", listen="tcp://127.0.0.1:0")
    a, b = make_router("a", peers=[hub.address]), make_router("b", peers=[hub.address])
    got = queue.Queue()
    hub.on("x", lambda payload: got.put((payload, hub.sender)))
    for peer in (a, b):
        peer.wait_for_subscribers("x", 1, WAIT)
    a.publish("x", "from a, it says")
    b.publish("x", "from a, it says")  # what a payload claims is not who sent it
    assert sorted(got.get(timeout=WAIT) for _ in range(2)) == [("from a, it says", "a"), ("from a, it says", "b")]
    assert hub.sender is None


def test_no_peer_can_tell_a_worker_that_another_node_finished(make_router):
    from conveyor.engine.parallel.worker import FINISHED_TOPIC, WorkerRouter
    hub = make_router("0", listen="tcp://127.0.0.1:0")
    peer = make_router("9", peers=[hub.address])
    worker = WorkerRouter(hub, 0, 3)
    left = queue.Queue()
    worker.on_peer_lost(left.put)
    peer.wait_for_subscribers(FINISHED_TOPIC, 1, WAIT)
    peer.publish(FINISHED_TOPIC, "1")  # node 1, the learner, is alive: node 9 says otherwise
    peer.publish(FINISHED_TOPIC, "9")
    assert left.get(timeout=WAIT) == "9" and left.empty()
    assert worker.stats()["rejected_finished"] == 1


def test_only_the_nodes_that_may_end_the_run_can_set_task_finish_for_this_node(peer_with_the_secret):
    import threading

    from conveyor.engine import task
    from conveyor.engine.task_events import FINISH_TOPIC
    mine, peer = peer_with_the_secret  # this node is "0", the peer "9"
    probed, finish_seen = threading.Event(), []

    def probe(ctx):
        peer.wait_for_subscribers(FINISH_TOPIC, 1, WAIT)
        peer.wait_for_subscribers("probe", 1, WAIT)
        peer.publish(FINISH_TOPIC, ("0",))  # in node 0's name: only node 0 may end the run
        peer.publish("probe", [])  # delivered after it: once heard, the finish was handled
        assert probed.wait(WAIT)
        finish_seen.append(task.finish)

    with task.start():
        task.finish_from(["0"])
        task.on("probe", probed.set)
        task.use(probe)
        task.run(max_step=1)
    assert finish_seen == [False] and task.refused_finish == 1
