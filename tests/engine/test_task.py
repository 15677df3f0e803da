"""The task runtime in sync mode: building, running, finishing, failing and composing."""
import threading

import pytest

from conveyor import Context, OnlineRLContext, Task, task


def test_use_returns_the_task_for_chaining():
    with task.start():
        assert task.use(lambda ctx: None).use(lambda ctx: None) is task
        assert len(task.middleware) == 2


def test_use_rejects_a_non_callable_naming_it():
    with task.start():
        with pytest.raises(TypeError, match="42"):
            task.use(42)


def test_use_rejects_a_class_and_suggests_an_instance():
    class Collector:
        def __init__(self, cfg):
            pass

        def __call__(self, ctx):
            pass

    with task.start():
        with pytest.raises(TypeError, match=r"Collector is a class: pass an instance"):
            task.use(Collector)


def test_use_rejects_a_factory_and_suggests_calling_it():
    def data_pusher(cfg, buffer):
        return lambda ctx: None

    with task.start():
        with pytest.raises(TypeError, match=r"task.use\(data_pusher\(...\)\)"):
            task.use(data_pusher)


def test_use_outside_start_is_an_error():
    with pytest.raises(RuntimeError, match="inside `with task.start"):
        task.use(lambda ctx: None)


def test_use_while_running_is_an_error():
    errors = []

    def adder(ctx):
        try:
            task.use(lambda c: None)
        except RuntimeError as exc:
            errors.append(exc)

    with task.start():
        task.use(adder)
        task.run(max_step=1)
    assert "while the task is running" in str(errors[0])


def test_middleware_have_readable_reprs():
    def data_pusher(cfg):
        def _push(ctx):
            pass
        return _push

    with task.start():
        task.use(data_pusher(None), lock=True)
        assert repr(task.middleware[0]) == "<Middleware data_pusher (locked)>"
        assert "data_pusher" in repr(task)


def test_run_stops_after_max_step_and_renews_between_iterations():
    seen = []
    with task.start(ctx=OnlineRLContext()):
        def step(ctx):
            assert ctx.obs is None  # never carried over
            ctx.obs = "x"
            ctx.env_step += 1
            seen.append(ctx.total_step)
        task.use(step)
        task.run(max_step=4)
        assert seen == [0, 1, 2, 3]
        assert task.ctx.env_step == 4 and task.ctx.total_step == 4


def test_start_without_ctx_gives_a_plain_context():
    with task.start():
        assert type(task.ctx) is Context


def test_finish_set_in_the_forward_part_ends_that_iteration():
    log = []
    with task.start():
        def stopper(ctx):
            log.append(ctx.total_step)
            if ctx.total_step == 2:
                task.finish = True
        task.use(stopper).use(lambda ctx: log.append("after"))
        task.run()
    assert log == [0, "after", 1, "after", 2, "after"]


def test_finish_set_in_the_backward_part_ends_that_iteration():
    log = []
    with task.start():
        def outer(ctx):
            yield
            if ctx.total_step == 1:
                task.finish = True
        task.use(outer).use(lambda ctx: log.append(ctx.total_step))
        task.run()
    assert log == [0, 1]


def test_onion_order_with_nested_serial():
    log = []

    def rec(name):
        def mw(ctx):
            log.append(f"{name}>")
            yield
            log.append(f"<{name}")
        mw.__name__ = name
        return mw

    with task.start():
        task.use(rec("a"))
        task.use(task.serial(rec("b"), task.serial(rec("c"), lambda ctx: log.append("f")), rec("d")))
        task.use(rec("e"))
        task.run(max_step=1)
    assert log == ["a>", "b>", "c>", "f", "d>", "e>", "<e", "<d", "<c", "<b", "<a"]


def test_exception_propagates_with_the_middleware_name_and_runs_cleanup():
    cleaned = []

    def guarded(ctx):
        try:
            yield
        finally:
            cleaned.append(True)

    def learner(ctx):
        raise ValueError("nan loss")

    with task.start():
        task.use(guarded).use(learner)
        with pytest.raises(ValueError, match="nan loss") as info:
            task.run(max_step=3)
    assert "in middleware 'test_exception_propagates_with_the_middleware_name_and_runs_cleanup.<locals>.learner'" \
        not in info.value.__notes__  # names are the readable form
    assert any("learner" in note for note in info.value.__notes__)
    assert cleaned == [True]


def test_task_is_reusable_after_an_exception_inside_the_block():
    with pytest.raises(RuntimeError):
        with task.start():
            task.use(lambda ctx: (_ for _ in ()).throw(RuntimeError("x")))
            task.run(max_step=1)
    with task.start():
        assert task.middleware == [] and task.finish is False
        ran = []
        task.use(lambda ctx: ran.append(1))
        task.run(max_step=2)
        assert ran == [1, 1]


def test_leaving_the_block_resets_middleware_handlers_and_flags():
    with task.start():
        task.use(lambda ctx: None)
        task.on("evt", lambda: None)
        task.finish = True
    with task.start():
        assert task.middleware == []
        assert task.finish is False
        assert task._events.handlers("evt") == []


def test_nested_start_is_an_error():
    with task.start():
        with pytest.raises(RuntimeError, match="already active"):
            with task.start():
                pass


def test_run_with_no_middleware_and_no_bound_is_refused():
    with task.start():
        with pytest.raises(RuntimeError, match="loop forever"):
            task.run()


def test_forward_and_backward_run_the_two_halves_in_a_hand_written_loop():
    log = []

    def mw(ctx):
        log.append(("fwd", ctx.total_step))
        yield
        log.append(("bwd", ctx.total_step))

    with task.start():
        for _ in range(2):
            task.forward(mw)
            task.forward(lambda ctx: log.append("plain"))
            task.backward()
            task.renew()
        assert task.ctx.total_step == 2
    assert log == [("fwd", 0), "plain", ("bwd", 0), ("fwd", 1), "plain", ("bwd", 1)]


def test_renew_runs_pending_backward_parts():
    log = []

    def mw(ctx):
        yield
        log.append("bwd")

    with task.start(ctx=OnlineRLContext()):
        task.ctx.env_step = 3
        task.forward(mw)
        task.renew()
        assert log == ["bwd"] and task.ctx.env_step == 3


def test_wrap_lets_a_middleware_call_another_directly():
    log = []

    def inner(ctx):
        log.append("inner>")
        yield
        log.append("<inner")

    with task.start():
        wrapped = task.wrap(inner)

        def outer(ctx):
            back = wrapped(ctx)
            log.append("between")
            back()

        task.use(outer)
        task.run(max_step=1)
    assert log == ["inner>", "between", "<inner"]


def test_parallel_runs_all_members_then_backward_parts_in_reverse():
    log = []

    def rec(name):
        def mw(ctx):
            log.append(f"{name}>")
            yield
            log.append(f"<{name}")
        return mw

    with task.start():
        task.use(task.parallel(rec("a"), rec("b")))
        task.run(max_step=1)
    assert sorted(log[:2]) == ["a>", "b>"] and log[2:] == ["<b", "<a"]


def test_parallel_runs_members_concurrently_in_async_mode():
    barrier = threading.Barrier(2, timeout=10)  # deadlocks (then times out) unless both run at once

    def member(ctx):
        barrier.wait()

    with task.start(async_mode=True):
        task.use(task.parallel(member, member))
        task.run(max_step=1)


def test_stats_report_calls_and_times_per_middleware():
    def collector(ctx):
        pass

    def learner(ctx):
        yield

    with task.start():
        task.use(collector).use(learner)
        task.run(max_step=5)
        stats = task.stats()
    assert set(stats) == {"collector", "learner"}
    for entry in stats.values():
        assert entry["calls"] == 5
        assert entry["total_s"] >= 0 and entry["p95_s"] >= 0
        assert entry["mean_s"] == pytest.approx(entry["total_s"] / 5)


def test_stats_tell_apart_two_middleware_of_the_same_name():
    def logger(ctx):
        pass

    with task.start():
        task.use(logger).use(logger)
        task.run(max_step=1)
        assert set(task.stats()) == {"logger", "logger#2"}


def test_a_separate_task_instance_is_independent_of_the_global_one():
    other = Task()
    with other.start():
        other.use(lambda ctx: None)
        with task.start():
            assert task.middleware == []


def test_finish_event_is_emitted_with_none_or_the_error_that_ended_the_run():
    from conveyor.engine import FINISH_EVENT
    seen = []
    with task.start():
        task.on(FINISH_EVENT, lambda error: seen.append(error))
        task.use(lambda ctx: None)
        task.run(max_step=2)
    with task.start():
        task.on(FINISH_EVENT, lambda error: seen.append(error))
        task.use(lambda ctx: 1 / 0)
        with pytest.raises(ZeroDivisionError) as info:
            task.run(max_step=2)
    assert seen == [None, info.value]


def test_finish_set_ahead_of_a_run_before_its_start_block_ends_that_run_as_it_starts_with_its_finish_event():
    from conveyor.engine import FINISH_EVENT
    other, seen, iterations = Task(), [], []
    with other.ahead_of_run():
        other.finish = True  # e.g. a worker's SIGTERM while the pipeline is still being built
        with other.start():
            assert other.run_ahead
            other.on(FINISH_EVENT, seen.append)
            other.use(lambda ctx: iterations.append(ctx.total_step))
            other.run(max_step=3)
            assert not other.run_ahead
    assert (iterations, seen, other.run_ahead) == ([], [None], False)


def test_close_event_is_emitted_when_the_start_block_exits_not_when_run_ends():
    from conveyor.engine import CLOSE_EVENT
    log = []
    with task.start():
        task.on(CLOSE_EVENT, lambda: log.append("close"))
        task.use(lambda ctx: None)
        task.run(max_step=1)
        task.run(max_step=1)
        assert log == []
    assert log == ["close"]


# --- between_iterations ----------------------------------------------------------------------------------

def test_between_iterations_runs_right_after_the_current_iteration_in_sync_mode():
    log = []

    def outer(ctx):
        log.append(("enter", ctx.total_step))
        if ctx.total_step == 1:
            task.between_iterations(lambda: log.append(("between", task.ctx.total_step)))
        yield
        log.append(("leave", ctx.total_step))

    with task.start():
        task.use(outer)
        task.run(max_step=3)
    assert log == [("enter", 0), ("leave", 0), ("enter", 1), ("leave", 1), ("between", 2), ("enter", 2),
                   ("leave", 2)]


def test_pending_callbacks_run_when_the_run_ends_before_finish_event():
    from conveyor.engine import FINISH_EVENT
    log = []

    def stopper(ctx):
        task.finish = True
        task.between_iterations(lambda: log.append("callback"))

    with task.start():
        task.on(FINISH_EVENT, lambda error: log.append("finish"))
        task.use(stopper)
        task.run()
    assert log == ["callback", "finish"]


def test_between_iterations_outside_run_calls_at_once_and_rejects_non_callables():
    log = []
    with task.start():
        task.between_iterations(lambda: log.append(1))
        assert log == [1]
        with pytest.raises(TypeError, match="callable"):
            task.between_iterations(42)


# --- end_iteration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("async_mode", [False, True])
def test_end_iteration_skips_the_rest_of_the_chain_but_runs_backward_parts(async_mode):
    log, lock = [], threading.Lock()

    def outer(ctx):
        yield
        with lock:
            log.append(("outer back", ctx.total_step))

    def gate(ctx):
        if ctx.total_step == 1:
            task.end_iteration()

    def inner(ctx):
        with lock:
            log.append(("inner", ctx.total_step))

    with task.start(async_mode=async_mode, ctx=OnlineRLContext()):
        task.use(outer).use(task.serial(gate, inner)).use(inner)
        task.run(max_step=3)
        assert task.ctx.total_step == 3  # an ended iteration is a completed one
    assert ("inner", 1) not in log and ("outer back", 1) in log
    assert log.count(("inner", 0)) == 2 and log.count(("inner", 2)) == 2


def test_end_iteration_with_finish_ends_the_run_right_there():
    log = []

    def evaluator(ctx):
        log.append("evaluate")
        task.finish = True
        task.end_iteration()

    with task.start():
        task.use(evaluator).use(lambda ctx: log.append("train"))
        task.run()
        assert task.ctx.total_step == 1
    assert log == ["evaluate"]


def test_end_iteration_outside_run_is_an_error():
    with task.start():
        with pytest.raises(RuntimeError, match="while task.run"):
            task.end_iteration()


def test_parallel_gathers_every_member_error_and_closes_the_members_that_suspended():
    closed = []

    def member(ctx):
        try:
            yield
        finally:
            closed.append(True)

    def bad(name):
        def mw(ctx):
            raise ValueError(name)
        return mw

    with task.start():
        task.use(task.parallel(member, bad("first"), bad("second")))
        with pytest.raises(ValueError, match="first") as info:
            task.run(max_step=1)
    assert closed == [True]
    assert any("also raised ValueError: second" in n for n in info.value.__notes__)
