"""Events: on/once/off/emit/wait_for, thread-safe."""
import threading

import pytest

from conveyor import task


def test_on_receives_every_emit_with_args():
    got = []
    with task.start():
        task.on("eval", lambda value, step: got.append((value, step)))
        task.emit("eval", 1.0, 10)
        task.emit("eval", 2.0, 20)
    assert got == [(1.0, 10), (2.0, 20)]


def test_once_fires_only_once():
    got = []
    with task.start():
        task.once("ping", lambda: got.append(1))
        task.emit("ping")
        task.emit("ping")
    assert got == [1]


def test_off_removes_one_handler_or_all():
    got = []
    a, b = (lambda: got.append("a")), (lambda: got.append("b"))
    with task.start():
        task.on("x", a)
        task.on("x", b)
        task.off("x", a)
        task.emit("x")
        task.off("x")
        task.emit("x")
    assert got == ["b"]


def test_only_remote_is_not_delivered_locally():
    got = []
    with task.start():
        task.on("x", lambda: got.append(1))
        task.emit("x", only_remote=True)
        task.emit("x", only_local=True)
    assert got == [1]


def test_wait_for_returns_the_args_emitted_from_another_thread():
    with task.start():
        subscribed = threading.Event()
        original_once = task._events.once

        def once_and_signal(name, fn):
            original_once(name, fn)
            subscribed.set()

        task._events.once = once_and_signal
        emitter = threading.Thread(target=lambda: (subscribed.wait(10), task.emit("ready", "learner", 3)))
        emitter.start()
        assert task.wait_for("ready", timeout=10) == ("learner", 3)
        emitter.join()


def test_wait_for_times_out_with_timeout_error():
    with task.start():
        with pytest.raises(TimeoutError, match="'never'"):
            task.wait_for("never", timeout=0.01)
        assert task._events.handlers("never") == []


def test_concurrent_emitters_deliver_every_event_and_once_exactly_once():
    n_threads, per_thread = 8, 500
    counts = {"on": 0, "once": 0}
    lock = threading.Lock()

    def on_handler(i):
        with lock:
            counts["on"] += 1

    def once_handler(i):
        with lock:
            counts["once"] += 1

    with task.start():
        task.on("tick", on_handler)
        task.once("tick", once_handler)
        barrier = threading.Barrier(n_threads)

        def emitter():
            barrier.wait()
            for i in range(per_thread):
                task.emit("tick", i)

        threads = [threading.Thread(target=emitter) for _ in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert counts == {"on": n_threads * per_thread, "once": 1}


def test_handlers_may_subscribe_and_emit_from_inside_a_handler():
    got = []
    with task.start():
        def first():
            task.on("second", lambda: got.append("second"))
            task.emit("second")
        task.on("first", first)
        task.emit("first")
    assert got == ["second"]


def test_non_callable_handler_is_rejected():
    with task.start():
        with pytest.raises(TypeError, match="must be callable"):
            task.on("x", 3)
