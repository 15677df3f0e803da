"""The Task's public face: every public member documented, and the members no other test file covers."""
import functools
import inspect
import queue
import threading

import pytest

from conveyor import OnlineRLContext, Task, task
from conveyor.engine import STOP_EVENT, declares
from conveyor.engine.parallel import generate_secret
from conveyor.engine.parallel.router import Router
from conveyor.engine.task_events import FINISH_TOPIC
from tests.engine.test_state import Counter

WAIT = 20


def test_every_public_member_of_task_has_a_docstring():
    undocumented = [name for name, member in inspect.getmembers(Task)
                    if not name.startswith("_") and not (inspect.getdoc(member) or "").strip()]
    assert undocumented == []


def test_async_mode_and_running_say_how_and_whether_the_task_runs():
    seen = []
    with task.start(async_mode=True):
        assert task.async_mode and not task.running
        task.use(lambda ctx: seen.append(task.running))
        task.run(max_step=1)
        assert not task.running
    with task.start():
        assert not task.async_mode
    assert seen == [True]


def test_repr_names_the_mode_and_the_chain():
    def collect(ctx):
        pass

    with task.start(async_mode=True):
        task.use(collect)
        assert repr(task) == "<Task async: collect>"


def test_has_role_and_roles_report_the_roles_added():
    with task.start():
        assert task.roles == frozenset() and task.has_role(task.role.LEARNER)
        task.add_role(task.role.COLLECTOR)
        assert task.roles == {task.role.COLLECTOR}
        assert task.has_role(task.role.COLLECTOR) and not task.has_role(task.role.LEARNER)


def tag(calls, label):
    def wrapper(fn):
        @functools.wraps(fn)
        def wrapped(ctx):
            calls.append(f"{label}>")
            fn(ctx)
            calls.append(f"<{label}")
        return wrapped
    return wrapper


def test_use_wrapper_wraps_the_middleware_already_added_and_those_added_later():
    calls = []

    @declares(writes=("env_step",))
    def collect(ctx):
        calls.append("collect")

    with task.start(ctx=OnlineRLContext()):
        task.use(lambda ctx: calls.append("before"))
        assert task.use_wrapper(tag(calls, "a")) is task
        task.use(collect)
        task.use_wrapper(tag(calls, "b"))
        assert task.describe()[1].writes == ("env_step",)  # functools.wraps kept the declaration
        task.run(max_step=1)
    assert calls == ["b>", "a>", "before", "<a", "<b", "b>", "a>", "collect", "<a", "<b"]
    with task.start():
        task.use(lambda ctx: calls.append("unwrapped"))  # wrappers end with their block
        task.run(max_step=1)
    assert calls[-1] == "unwrapped"


def test_a_wrapped_stateful_middleware_keeps_its_state_and_its_timing_name():
    counter, calls = Counter(), []
    with task.start(ctx=OnlineRLContext()):
        task.use(counter)
        task.use_wrapper(tag(calls, "a"))
        task.run(max_step=2)
        assert task.state_dict()["middleware"] == {"0:Counter": {"calls": 2}}
        assert task.stats()["Counter"]["calls"] == 2


def test_use_wrapper_refuses_a_non_callable_and_works_only_inside_start():
    with pytest.raises(RuntimeError, match="inside `with task.start"):
        task.use_wrapper(lambda fn: fn)
    with task.start():
        with pytest.raises(TypeError, match="42"):
            task.use_wrapper(42)


def test_once_and_off_through_the_task():
    got = []
    with task.start():
        task.once("x", got.append)
        task.emit("x", 1)
        task.emit("x", 2)
        task.on("y", got.append)
        task.off("y", got.append)
        task.emit("y", 3)
    assert got == [1]


def test_renew_moves_a_hand_written_loop_to_a_fresh_context():
    with task.start(ctx=OnlineRLContext()):
        task.ctx.env_step, task.ctx.obs = 5, "seen"
        task.renew()
        assert (task.ctx.total_step, task.ctx.env_step, task.ctx.obs) == (1, 5, None)


def test_inspecting_with_no_iterations_reads_the_pipeline_without_running_it():
    ran = []
    with task.inspecting() as found:
        with task.start():
            task.use(lambda ctx: ran.append(1))
            task.run(max_step=5)
            ran.append("after run")  # never reached: the run call leaves the code that built the pipeline
    assert ran == [] and len(found.table) == 1 and found.completed == 0


def test_inspecting_with_iterations_bounds_each_run_and_counts_them():
    ran = []
    with task.inspecting(iterations=2) as found:
        with task.start():
            task.use(lambda ctx: ran.append(ctx.total_step))
            task.run(max_step=5)
    assert ran == [0, 1] and found.completed == 2


class _Router:
    """A stand-in router that records what is published."""

    def __init__(self):
        self.sent, self.handlers = [], {}

    def publish(self, topic, payload):
        self.sent.append((topic, payload))

    def on(self, topic, fn):
        self.handlers.setdefault(topic, []).append(fn)

    def off(self, topic, fn):
        self.handlers[topic].remove(fn)


def test_detach_router_stops_publishing_and_removes_the_subscriptions():
    here, router = Task(), _Router()
    here.attach_router(router)
    assert here.router is router
    with here.start():
        here.on("x", lambda: None)
        here.emit("x")
        here.detach_router()
        here.emit("x")
    assert here.router is None
    assert router.sent == [("x", ())] and router.handlers == {"x": []}


def test_finish_set_during_a_run_is_told_to_the_other_nodes_when_the_run_ends():
    here, router = Task(), _Router()
    here.attach_router(router)
    with here.start():
        here.use(lambda ctx: setattr(here, "finish", True))
        here.run(max_step=10)
        assert here.ctx.total_step == 1
    assert [topic for topic, _ in router.sent] == [FINISH_TOPIC]
    assert router.handlers[FINISH_TOPIC] == []  # listened to only while the run was in progress


def test_finish_set_outside_a_run_is_told_to_the_other_nodes_at_once():
    here, router, told = Task(), _Router(), threading.Event()
    router.publish = lambda topic, payload: told.set() if topic == FINISH_TOPIC else None
    here.attach_router(router)
    with here.start():
        here.use(lambda ctx: None)
        here.run(max_step=2)
        here.finish = True  # DI-engine's early stop: this node ran its steps, the others end too
        assert told.wait(WAIT)
    here.detach_router()


def test_finish_set_on_one_node_ends_the_run_on_every_node():
    secret = generate_secret()
    with Router("a", secret, heartbeat_s=0.05) as a, Router("b", secret, peers=[a.address], heartbeat_s=0.05) as b:
        here, there = Task(), Task()
        here.attach_router(a)
        there.attach_router(b)
        running, stopped, ended = threading.Event(), threading.Event(), queue.Queue()

        def other_node():
            with there.start():
                there.on(STOP_EVENT, stopped.set)
                there.use(lambda ctx: (running.set(), stopped.wait(0.01)))
                there.run()  # unbounded: only the finish from node a ends it
                ended.put(there.finish)

        thread = threading.Thread(target=other_node)
        thread.start()
        try:
            assert running.wait(WAIT)
            a.wait_for_subscribers(FINISH_TOPIC, 1, WAIT)
            with here.start():
                here.use(lambda ctx: setattr(here, "finish", True))
                here.run()
            assert ended.get(timeout=WAIT) is True and stopped.is_set()
        finally:
            there.finish = True
            thread.join(WAIT)
            here.detach_router()
            there.detach_router()
        assert not thread.is_alive()
