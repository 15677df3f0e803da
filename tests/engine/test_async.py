"""Async mode: iterations overlap like items on a conveyor belt, in order, bounded, and stop cleanly."""
import threading

import pytest

from conveyor import OnlineRLContext, task

TIMEOUT = 10


def pipeline_threads():
    return [t for t in threading.enumerate() if t.name.startswith("conveyor-pipeline")]


class Tracker:
    """First middleware of a chain: counts iterations in flight (entered, backward part not yet done)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.inflight = 0
        self.max_inflight = 0

    def __call__(self, ctx):
        with self.lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            yield
        finally:
            with self.lock:
                self.inflight -= 1


def test_collection_of_the_next_iteration_overlaps_training_on_this_one():
    barrier = threading.Barrier(2, timeout=TIMEOUT)  # broken (error) unless collector and learner meet

    def collector(ctx):
        if ctx.total_step == 1:
            barrier.wait()

    def learner(ctx):
        if ctx.total_step == 0:
            barrier.wait()

    with task.start(async_mode=True):
        task.use(collector).use(learner)
        task.run(max_step=3)


@pytest.mark.parametrize("max_inflight", [1, 2, 3])
def test_in_flight_iterations_reach_but_never_exceed_the_bound(max_inflight):
    tracker = Tracker()
    reached = threading.Event()

    def collector(ctx):
        if ctx.total_step == max_inflight - 1:
            reached.set()

    def learner(ctx):
        if ctx.total_step == 0:  # hold the oldest iteration until the collector is as far ahead as allowed
            assert reached.wait(TIMEOUT)

    with task.start(async_mode=True, max_inflight=max_inflight):
        task.use(tracker).use(collector).use(learner)
        task.run(max_step=12)
    assert tracker.max_inflight == max_inflight


def test_each_middleware_sees_iterations_in_order_and_the_chain_order_holds_within_one():
    log, lock = [], threading.Lock()

    def stage(k):
        def mw(ctx):
            with lock:
                log.append(("start", k, ctx.total_step))
            with lock:
                log.append(("end", k, ctx.total_step))
        mw.__name__ = f"stage{k}"
        return mw

    with task.start(async_mode=True, max_inflight=3):
        for k in range(4):
            task.use(stage(k))
        task.run(max_step=30)
    for k in range(4):
        assert [i for what, s, i in log if s == k and what == "start"] == list(range(30))
    for i in range(30):
        mine = [(what, s) for what, s, it in log if it == i]
        assert mine == [(w, k) for k in range(4) for w in ("start", "end")]


def test_backward_parts_also_see_iterations_in_order():
    seen, lock = [], threading.Lock()

    def outer(ctx):
        yield
        with lock:
            seen.append(ctx.total_step)

    with task.start(async_mode=True, max_inflight=3):
        task.use(outer).use(lambda ctx: None)
        task.run(max_step=20)
    assert seen == list(range(20))


def test_every_iteration_has_its_own_total_step_and_own_non_kept_fields():
    mismatches = []

    def collector(ctx):
        ctx.obs = ctx.total_step

    def learner(ctx):
        if ctx.obs != ctx.total_step:
            mismatches.append((ctx.obs, ctx.total_step))

    with task.start(async_mode=True, ctx=OnlineRLContext()):
        task.use(collector).use(learner)
        task.run(max_step=50)
        assert task.ctx.total_step == 50
    assert mismatches == []


def test_kept_fields_are_shared_and_counters_never_go_backwards():
    reads = []
    ahead = threading.Event()

    def collector(ctx):
        ctx.env_step += 10
        if ctx.total_step == 1:
            ahead.set()

    def learner(ctx):
        if ctx.total_step == 0:
            assert ahead.wait(TIMEOUT)
        reads.append(ctx.env_step)
        ctx.train_iter += 1

    with task.start(async_mode=True, ctx=OnlineRLContext()):
        task.use(collector).use(learner)
        task.run(max_step=20)
        assert task.ctx.env_step == 200 and task.ctx.train_iter == 20
    assert reads[0] == 20  # iteration 0's learner sees what iteration 1's collector wrote
    assert reads == sorted(reads)


def test_locked_middleware_never_run_at_the_same_time():
    active, peak, lock = [0], [0], threading.Lock()
    other_in = [threading.Event(), threading.Event()]

    def locked(me):
        def mw(ctx):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            other_in[me].set()
            other_in[1 - me].wait(0.02)  # give the other a chance to enter if the lock let it
            with lock:
                active[0] -= 1
        return mw

    with task.start(async_mode=True):
        task.use(locked(0), lock=True).use(locked(1), lock=True)
        task.run(max_step=10)
    assert peak[0] == 1


def test_unlocked_middleware_do_run_at_the_same_time():
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    met = []

    def a(ctx):
        if ctx.total_step == 1:
            met.append(barrier.wait())

    def b(ctx):
        if ctx.total_step == 0:
            met.append(barrier.wait())

    with task.start(async_mode=True):
        task.use(a).use(b)
        task.run(max_step=2)
    assert len(met) == 2


def test_a_shared_lock_object_excludes_the_chosen_middleware():
    shared = threading.Lock()
    holders = []

    def a(ctx):
        holders.append(shared.locked())

    with task.start(async_mode=True):
        task.use(a, lock=shared)
        task.run(max_step=3)
    assert holders == [True, True, True]


def test_finish_drains_iterations_in_flight_and_leaves_no_thread():
    done, lock = [], threading.Lock()

    def collector(ctx):
        pass

    def learner(ctx):
        yield
        with lock:
            done.append(ctx.total_step)
        if ctx.total_step == 5:
            task.finish = True

    with task.start(async_mode=True, max_inflight=2):
        task.use(collector).use(learner)
        task.run()
    assert pipeline_threads() == []
    assert done[:6] == [0, 1, 2, 3, 4, 5] and len(done) <= 7
    assert done == sorted(done)


def test_exception_stops_the_pipeline_cancels_newer_iterations_and_leaves_no_thread():
    closed, lock = [], threading.Lock()
    collector_at_4 = threading.Event()

    def collector(ctx):
        if ctx.total_step == 4:
            collector_at_4.set()
        try:
            yield
        finally:
            with lock:
                closed.append(ctx.total_step)

    def learner(ctx):
        if ctx.total_step == 3:
            assert collector_at_4.wait(TIMEOUT)
            raise ValueError("diverged")

    with pytest.raises(ValueError, match="diverged") as info:
        with task.start(async_mode=True):
            task.use(collector).use(learner)
            task.run(max_step=100)
    assert any("learner" in note for note in info.value.__notes__)
    assert pipeline_threads() == []
    assert sorted(closed) == [0, 1, 2, 3, 4]  # iteration 4 was cancelled: its generator was closed
    with task.start(async_mode=True):
        ran = []
        task.use(lambda ctx: ran.append(ctx.total_step))
        task.run(max_step=3)
        assert ran == [0, 1, 2]


def test_an_exception_handled_upstream_lets_the_pipeline_go_on():
    handled, ran = [], []

    def guard(ctx):
        try:
            yield
        except KeyError:
            handled.append(ctx.total_step)

    def flaky(ctx):
        ran.append(ctx.total_step)
        if ctx.total_step == 2:
            raise KeyError("transient")

    with task.start(async_mode=True):
        task.use(guard).use(flaky)
        task.run(max_step=5)
    assert handled == [2] and ran == [0, 1, 2, 3, 4]


def test_exception_in_a_forward_part_stops_the_run_before_that_middleware_runs_again():
    calls = []

    def learner(ctx):
        calls.append(ctx.total_step)
        raise RuntimeError("bad batch")

    with task.start(async_mode=True, max_inflight=3):
        task.use(lambda ctx: None).use(learner)
        with pytest.raises(RuntimeError):
            task.run(max_step=10)
    assert calls == [0]


def test_task_ctx_inside_async_middleware_is_the_iteration_context():
    mismatches = []

    def mw(ctx):
        if task.ctx is not ctx:
            mismatches.append(ctx.total_step)

    with task.start(async_mode=True):
        task.use(mw).use(mw)
        task.run(max_step=10)
    assert mismatches == []
