"""Async mode: iterations overlap like items on a conveyor belt, in order, bounded, and stop cleanly."""
import dataclasses
import threading

import pytest

from conveyor import Context, OnlineRLContext, task

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


# --- failures: run() returns promptly with the oldest error, no thread left (issue 7, items 1 and 2) ---------

@pytest.mark.timeout(30)
def test_cleanup_raising_in_a_cancelled_iteration_neither_hangs_nor_hides_the_first_error():
    a_in_newer = threading.Event()

    def a(ctx):
        if ctx.total_step == 1:
            a_in_newer.set()
        try:
            yield
        finally:
            if ctx.total_step == 1:  # raises while iteration 1 is being cancelled
                raise RuntimeError("cleanup failed")

    def b(ctx):
        if ctx.total_step == 0:
            assert a_in_newer.wait(TIMEOUT)
            raise ValueError("diverged")

    with task.start(async_mode=True, max_inflight=3):
        task.use(a).use(b)
        with pytest.raises(ValueError, match="diverged") as info:
            task.run(max_step=100)
        assert task.ctx.total_step == 0
    assert any("iteration 1 also raised RuntimeError: cleanup failed" in n for n in info.value.__notes__)
    assert pipeline_threads() == []


@pytest.mark.timeout(30)
def test_a_generator_that_ignores_its_cancellation_is_reported_and_the_run_still_ends():
    newer_in = threading.Event()

    def stubborn(ctx):
        if ctx.total_step == 1:
            newer_in.set()
        ignored = False
        while True:  # yields again when first closed: Python raises RuntimeError from close()
            try:
                yield
                return
            except GeneratorExit:
                if ignored:
                    raise
                ignored = True

    def learner(ctx):
        if ctx.total_step == 0:
            assert newer_in.wait(TIMEOUT)
            raise ValueError("bad batch")

    with task.start(async_mode=True, max_inflight=2):
        task.use(stubborn).use(learner)
        with pytest.raises(ValueError, match="bad batch") as info:
            task.run()
    assert any("iteration 1 also raised RuntimeError" in n for n in info.value.__notes__)
    assert pipeline_threads() == []


@pytest.mark.timeout(30)
def test_a_context_that_cannot_be_created_ends_an_unbounded_run_with_that_error():
    made = [0]

    def fragile_list():
        made[0] += 1
        if made[0] == 4:
            raise MemoryError("no room for the next context")
        return []

    @dataclasses.dataclass
    class FragileContext(Context):
        items: list = dataclasses.field(default_factory=fragile_list)

    with task.start(async_mode=True, ctx=FragileContext(), max_inflight=2):
        task.use(lambda ctx: None)
        with pytest.raises(MemoryError, match="no room"):
            task.run()  # no max_step: before the fix the workers looped over every index
        assert task.ctx.total_step <= 3
    assert pipeline_threads() == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("async_mode", [False, True])
def test_after_a_failed_run_the_context_is_the_same_in_sync_and_async(async_mode):
    newer_collected = threading.Event()

    def collector(ctx):
        ctx.env_step += 1
        if ctx.total_step == 5:
            newer_collected.set()

    def learner(ctx):
        if ctx.total_step == 3:
            if async_mode:  # iterations 4 and 5 have collected (and are cancelled): their writes do not count
                assert newer_collected.wait(TIMEOUT)
            raise ValueError("diverged")
        ctx.train_iter += 1

    start = OnlineRLContext()
    with task.start(async_mode=async_mode, ctx=start, max_inflight=3):
        task.use(collector).use(learner)
        with pytest.raises(ValueError):
            task.run(max_step=10)
        assert task.ctx.total_step == 3  # the completed iterations, never the cancelled ones
        assert (task.ctx.env_step, task.ctx.train_iter) == (3, 3)  # what iteration 2 left
        assert start.env_step == 3


@pytest.mark.parametrize("async_mode", [False, True])
def test_the_start_ctx_is_the_first_iteration_and_shares_kept_values_in_both_modes(async_mode):
    start = OnlineRLContext()
    firsts = []

    def collector(ctx):
        if ctx.total_step == 0:
            firsts.append(ctx)
        ctx.env_step += 2

    with task.start(async_mode=async_mode, ctx=start):
        task.use(collector)
        task.run(max_step=5)
        assert (task.ctx.env_step, task.ctx.total_step) == (10, 5)
        assert start.env_step == 10 and firsts == [start]
        task.run(max_step=1)
        assert (task.ctx.env_step, task.ctx.total_step, start.env_step) == (12, 6, 12)


def test_task_ctx_inside_parallel_members_is_the_calling_iteration_context():
    mismatches, seen = [], []
    both_in = threading.Barrier(2, timeout=TIMEOUT)  # the members really run on two threads at once

    def member(ctx):
        both_in.wait()
        seen.append(ctx.total_step)
        if task.ctx is not ctx:
            mismatches.append(ctx.total_step)

    with task.start(async_mode=True, max_inflight=2):
        task.use(task.parallel(member, member))
        task.run(max_step=6)
    assert sorted(seen) == sorted(list(range(6)) * 2) and mismatches == []


# --- between_iterations and end_iteration in async mode -----------------------------------------------

@pytest.mark.timeout(30)
def test_between_iterations_runs_when_no_middleware_is_running_then_the_pipeline_goes_on():
    tracker = Tracker()
    seen = []

    def callback():
        seen.append((tracker.inflight, task.state_dict()["ctx"]["total_step"], threading.current_thread().name))

    def collector(ctx):
        if ctx.total_step == 3:
            task.between_iterations(callback)

    with task.start(async_mode=True, max_inflight=3):
        task.use(tracker).use(collector).use(lambda ctx: None)
        task.run(max_step=10)
        assert task.ctx.total_step == 10
    (inflight, total_step, thread), = seen
    assert inflight == 0 and total_step >= 4 and thread == threading.current_thread().name


def test_once_finish_is_set_iterations_that_have_not_entered_any_middleware_are_not_run():
    entered, lock = [], threading.Lock()

    def first(ctx):
        with lock:
            entered.append(ctx.total_step)

    def stopper(ctx):
        if ctx.total_step == 2:
            task.finish = True
            task.end_iteration()

    with task.start(async_mode=True, max_inflight=3):
        task.use(first).use(stopper).use(lambda ctx: None)
        task.run()
        last = max(entered)
        assert task.ctx.total_step == last + 1  # every iteration that entered completed; no other counted
    assert last <= 4 and entered == list(range(last + 1))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("async_mode", [False, True])
def test_a_context_class_that_can_never_be_renewed_still_ends_the_run_cleanly(async_mode):
    made = [0]

    def only_once():
        made[0] += 1
        if made[0] > 1:
            raise LookupError("no more lists")
        return []

    @dataclasses.dataclass
    class BrokenContext(Context):
        items: list = dataclasses.field(default_factory=only_once)

    with task.start(async_mode=async_mode, ctx=BrokenContext()):
        task.use(lambda ctx: None)
        with pytest.raises(LookupError):
            task.run()
        assert task.ctx.total_step == 1 and not task.running
    assert pipeline_threads() == []


def test_pipeline_and_parallel_threads_use_the_processs_torch_thread_count():
    """torch applies set_num_threads per thread (OpenMP reads it thread-locally): a worker that ignored it would
    run small operators on every core with spinning helpers (docs/engine.md, "When async pays")."""
    import ctypes

    import torch
    gomp = next((line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line), None)
    if gomp is None:
        pytest.skip("torch is not built with GNU OpenMP here")
    omp_get_max_threads = ctypes.CDLL(gomp).omp_get_max_threads
    seen = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with task.start(async_mode=True):
            task.use(lambda ctx: seen.append(omp_get_max_threads()))
            task.use(task.parallel(lambda ctx: seen.append(omp_get_max_threads()),
                                   lambda ctx: seen.append(omp_get_max_threads())))
            task.run(max_step=4)
    finally:
        torch.set_num_threads(before)
    assert seen == [1] * 12
