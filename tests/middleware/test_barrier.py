"""Barrier: the named nodes meet at one point of the pipeline; the wait is bounded and skips lost nodes."""
import threading

import pytest

from conveyor import Task
from conveyor.engine import PEER_LOST_EVENT
from conveyor.engine.parallel import generate_secret
from conveyor.engine.parallel.router import Router
from conveyor.middleware import Barrier

WAIT = 20


class _Router:
    """A stand-in router for node ``node_id``: records what is published, ``on_publish`` sees it."""

    def __init__(self, node_id, on_publish=None):
        self.node_id, self.sent, self.on_publish = node_id, [], on_publish

    def publish(self, topic, payload):
        self.sent.append((topic, payload))
        if self.on_publish is not None:
            self.on_publish(topic, payload)

    def on(self, topic, fn):
        pass

    def off(self, topic, fn):
        pass


def test_nodes_meet_at_the_barrier_every_iteration():
    secret, log, lock = generate_secret(), [], threading.Lock()
    with Router("a", secret, heartbeat_s=0.05) as a, Router("b", secret, peers=[a.address], heartbeat_s=0.05) as b:
        tasks = {"a": Task(), "b": Task()}
        tasks["a"].attach_router(a)
        tasks["b"].attach_router(b)
        errors = []

        def node(me):
            here = tasks[me]

            def note(when):
                def mw(ctx):
                    with lock:
                        log.append((when, me, ctx.total_step))
                mw.__name__ = when
                return mw

            try:
                with here.start():
                    here.use(note("before")).use(Barrier("a", "b", timeout_s=WAIT, runtime=here)).use(note("after"))
                    here.run(max_step=5)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=node, args=(me,)) for me in tasks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * WAIT)
        for here in tasks.values():
            here.detach_router()
    assert errors == []
    for k in range(5):
        positions = {(when, me): i for i, (when, me, step) in enumerate(log) if step == k}
        assert max(positions[("before", me)] for me in "ab") < min(positions[("after", me)] for me in "ab")


def test_a_node_that_never_arrives_ends_the_wait_with_an_error_naming_it():
    here = Task()
    here.attach_router(_Router("a"))
    try:
        with here.start():
            here.use(Barrier("a", "ghost", timeout_s=0.2, resend_s=0.05, runtime=here))
            with pytest.raises(TimeoutError, match=r"node\(s\) ghost did not arrive at pass 0 within 0.2s"):
                here.run(max_step=1)
    finally:
        here.detach_router()


def test_a_node_lost_while_others_wait_is_not_waited_for():
    here = Task()

    def lose_b(topic, payload):  # b is lost right after this node announced its arrival
        threading.Thread(target=here.emit, args=(PEER_LOST_EVENT, "b"), kwargs={"only_local": True}).start()

    router = _Router("a", on_publish=lose_b)
    here.attach_router(router)
    try:
        with here.start():
            here.use(Barrier("a", "b", timeout_s=WAIT, runtime=here))
            here.run(max_step=2)
            assert here.ctx.total_step == 2
    finally:
        here.detach_router()
    assert router.sent[0] == ("conveyor.barrier.barrier", ("a", 0, False))


def test_nodes_not_named_and_single_processes_pass_straight_through():
    for router in (None, _Router("c")):
        here = Task()
        if router is not None:
            here.attach_router(router)
        with here.start():
            here.use(Barrier("a", "b", timeout_s=0.1, runtime=here))
            here.run(max_step=3)
            assert here.ctx.total_step == 3
        here.detach_router()
        assert router is None or router.sent == []


def test_bad_arguments_say_what_to_give():
    with pytest.raises(ValueError, match="name the nodes"):
        Barrier()
    with pytest.raises(ValueError, match="timeout_s"):
        Barrier(0, 1, timeout_s=0)


def test_finish_set_while_waiting_ends_the_iteration_at_the_barrier():
    here, after = Task(), []

    def finish(topic, payload):  # another node finished while this one waits for it
        threading.Thread(target=setattr, args=(here, "finish", True)).start()

    here.attach_router(_Router("a", on_publish=finish))
    try:
        with here.start():
            here.use(Barrier("a", "b", timeout_s=WAIT, resend_s=0.05, runtime=here)).use(lambda ctx: after.append(1))
            here.run(max_step=5)
            assert here.ctx.total_step == 1 and after == []
    finally:
        here.detach_router()
