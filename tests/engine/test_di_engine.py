"""DI-engine's own framework tests (ding/framework/tests, middleware/tests), ported to Conveyor's API as a check
that a DI-engine user's code behaves as they expect; docs/di-engine.md lists the one-line changes made here."""
import functools

import pytest

from conveyor.engine import OfflineRLContext, OnlineRLContext, Parallel, task
from tests.engine import _di_engine_mains as mains

FAST = dict(heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0)


def runner(n, topology="star"):
    return Parallel.runner(n, topology, ready_timeout_s=mains.WAIT, router_options=FAST)


def test_emit_reaches_every_handler():  # DI-engine: test_emit
    greets = []
    with task.start():
        task.on("Greeting", greets.append)
        task.use(lambda ctx: task.emit("Greeting", "Hi"))
        task.run(max_step=10)
    assert greets == ["Hi"] * 10


def test_wait_for_in_async_mode():  # DI-engine: test_wait_for
    greets = []
    with task.start(async_mode=True):
        def step1(ctx):
            greets.append(task.wait_for("Greeting", timeout=mains.WAIT)[0])  # DI-engine: wait_for(...)[0][0]

        def step2(ctx):
            task.emit("Greeting", "Hi")

        task.use(task.parallel(step1, step2))  # DI-engine runs one iteration's middleware at once in async mode
        task.run(max_step=10)
    assert greets == ["Hi"] * 10
    with task.start(async_mode=True):
        task.use(lambda ctx: task.wait_for("Greeting", timeout=0.3))
        with pytest.raises(TimeoutError):
            task.run(max_step=1)


@pytest.mark.parametrize("cls", [OnlineRLContext, OfflineRLContext])
def test_contexts_start_eval_value_at_minus_infinity_and_renew_it(cls):  # DI-engine: test_online, test_offline
    ctx = cls()
    assert ctx.train_iter == 0 and ctx.eval_value == float("-inf")
    ctx.train_iter += 1
    ctx.eval_value = 1
    new = ctx.renew()
    assert new.train_iter == 1 and new.eval_value == float("-inf")


def test_use_wrapper_wraps_every_middleware():  # DI-engine: test_step_timer
    records = {}

    def step_timer(fn):
        @functools.wraps(fn)
        def timed(ctx):
            records.setdefault(fn.__name__, []).append(ctx.total_step)
            return fn(ctx)
        return timed

    def step1(ctx):
        pass

    def step2(ctx):
        pass

    with task.start(async_mode=True):
        task.use_wrapper(step_timer)
        task.use(step1)
        task.use(step2)
        assert len(task.middleware) == 2
        task.run(max_step=3)
    assert records == {"step1": [0, 1, 2], "step2": [0, 1, 2]}


@pytest.mark.slow
def test_finish_set_on_one_node_ends_every_node():  # DI-engine: test_broadcast_finish
    steps = runner(3, "mesh")(mains.broadcast_finish, 10_000)
    assert steps[1] == 2 and all(s < 10_000 for s in steps)


@pytest.mark.slow
def test_barrier_makes_every_node_meet_before_and_after_each_step():  # DI-engine: test_barrier (star_barrier)
    n, steps = 3, 3
    seen = runner(n, "mesh")(mains.star_barrier, n, steps)  # DI-engine: a star; ours: named nodes must hear each other
    assert seen == [[n - 1] * (2 * steps)] * n  # every pass: each node had heard every other one get there


def test_context_exchanger_feeds_the_learner_and_paces_the_collector():  # DI-engine: test_context_exchanger
    learner, collector = Parallel.runner(n_parallel_workers=2)(mains.context_exchanger)
    ends = [1, 1, 1, 1]  # DI-engine's list of end indices, a list again on the learner
    assert learner == [(2, ends, 8, 1, 1), (2, ends, 8, 2, 2), (2, ends, 8, 3, 3)]  # one batch each, counts summed
    assert collector == [0, 1, 2]  # skip_n_iter=1: from its second iteration on, it waits for the learner's train_iter
