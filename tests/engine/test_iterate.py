"""task.iterate(): the run loop as a generator, one item per iteration."""
import threading

import pytest

from conveyor.engine import FINISH_EVENT, OnlineRLContext, PipelineError, declares, task


def collect(ctx):
    ctx.env_step += 10


def train(ctx):
    ctx.train_iter += 1
    if ctx.train_iter % 2 == 0:
        ctx.eval_value = float(ctx.train_iter)


def finishes(endings):
    task.on(FINISH_EVENT, endings.append)


def test_each_item_has_the_counters_the_eval_value_and_each_middlewares_time():
    with task.start(ctx=OnlineRLContext()):
        task.use(collect)
        task.use(train)
        logs = list(task.iterate(max_step=3))
    assert [(log["total_step"], log["env_step"], log["train_iter"], log["eval_value"]) for log in logs] == [
        (0, 10, 1, float("-inf")), (1, 20, 2, 2.0), (2, 30, 3, float("-inf"))]  # -inf: no evaluation
    assert set(logs[0]["time_s"]) == {"collect", "train"} and all(t >= 0 for t in logs[0]["time_s"].values())
    assert "trajectories" not in logs[0] and "collect_kwargs" not in logs[0]  # only scalar fields


def test_nothing_runs_between_items():
    calls = []
    with task.start(ctx=OnlineRLContext()):
        task.use(lambda ctx: calls.append(ctx.total_step))
        for log in task.iterate(max_step=3):
            assert calls[-1] == log["total_step"] and task.ctx.total_step == log["total_step"] + 1


def test_leaving_the_loop_early_ends_the_run_cleanly_and_a_later_run_goes_on():
    endings = []
    with task.start(ctx=OnlineRLContext()):
        task.use(collect)
        finishes(endings)
        threads = threading.active_count()
        for log in task.iterate():
            if log["total_step"] == 1:
                break
        assert endings == [None] and not task.running and threading.active_count() == threads
        task.run(max_step=2)
        assert task.ctx.total_step == 4 and task.ctx.env_step == 40
    assert endings == [None, None]


def test_leaving_task_start_ends_a_loop_left_open():
    endings = []
    with task.start(ctx=OnlineRLContext()):
        task.use(collect)
        finishes(endings)
        steps = task.iterate(max_step=10)
        next(steps)
    assert endings == [None]
    with task.start(ctx=OnlineRLContext()):
        task.use(collect)
        assert [log["total_step"] for log in task.iterate(max_step=2)] == [0, 1]


def test_a_middleware_error_comes_out_of_the_loop_and_finishes_the_run():
    endings = []

    def fail_second(ctx):
        if ctx.total_step == 1:
            raise ValueError("boom")

    with task.start(ctx=OnlineRLContext()):
        task.use(collect)
        task.use(fail_second)
        finishes(endings)
        steps = task.iterate(max_step=5)
        assert next(steps)["total_step"] == 0
        with pytest.raises(ValueError, match="boom"):
            next(steps)
        assert task.ctx.env_step == 10 and not task.running  # kept fields as the completed iteration left them
    assert len(endings) == 1 and isinstance(endings[0], ValueError)


def test_finish_stops_the_loop():
    def stop(ctx):
        task.finish = ctx.total_step == 1

    with task.start(ctx=OnlineRLContext()):
        task.use(stop)
        assert [log["total_step"] for log in task.iterate()] == [0, 1]


def test_a_second_run_while_iterating_and_async_mode_are_refused():
    with task.start(ctx=OnlineRLContext()):
        task.use(collect)
        steps = task.iterate(max_step=3)
        next(steps)
        with pytest.raises(RuntimeError, match="a run is already in progress"):
            task.run(max_step=1)
        steps.close()
    with task.start(async_mode=True, ctx=OnlineRLContext()):
        task.use(collect)
        with pytest.raises(RuntimeError, match="in async mode iterations overlap, so use task.run()"):
            task.iterate(max_step=1)


def test_the_declared_fields_are_checked_when_iterate_is_called():
    @declares(reads=("train_data",))
    def learner(ctx):
        pass

    with task.start(ctx=OnlineRLContext()):
        task.use(learner)
        with pytest.raises(PipelineError, match="'learner' .* reads ctx.train_data"):
            task.iterate(max_step=1)
