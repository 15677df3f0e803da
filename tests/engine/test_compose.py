"""The composer on its own, without the global task: the onion's classic cases."""
import pytest

from conveyor.engine import MiddlewareError, compose


def drive(mw, ctx=None):
    """Run one composed middleware the way the task does: forward, then backward."""
    gen = mw(ctx)
    next(gen)
    with pytest.raises(StopIteration):
        next(gen)


def recorder(log, name):
    def mw(ctx):
        log.append(f"{name}>")
        yield
        log.append(f"<{name}")
    mw.__name__ = name
    return mw


def test_onion_order_over_several_levels():
    log = []
    drive(compose(recorder(log, "a"), compose(recorder(log, "b"), compose(recorder(log, "c"))), recorder(log, "d")),
          None)
    assert log == ["a>", "b>", "c>", "d>", "<d", "<c", "<b", "<a"]


def test_zero_middleware_composes_to_a_no_op():
    drive(compose())


def test_plain_functions_run_in_order_between_generators():
    log = []
    drive(compose(recorder(log, "a"), lambda ctx: log.append("f"), recorder(log, "b")))
    assert log == ["a>", "f", "b>", "<b", "<a"]


def test_error_downstream_is_caught_upstream():
    log = []

    def catcher(ctx):
        try:
            yield
        except ValueError as exc:
            log.append(f"caught {exc}")

    def boom(ctx):
        raise ValueError("boom")

    drive(compose(catcher, recorder(log, "mid"), boom, recorder(log, "never")))
    assert log == ["mid>", "caught boom"]


def test_error_reaches_every_suspended_generator_innermost_first():
    log = []

    def guard(name):
        def mw(ctx):
            try:
                yield
            finally:
                log.append(name)
        return mw

    def boom(ctx):
        raise KeyError("k")

    gen = compose(guard("outer"), guard("inner"), boom)(None)
    with pytest.raises(KeyError) as info:
        next(gen)
    assert log == ["inner", "outer"]
    assert any("boom" in note for note in info.value.__notes__)


def test_generator_that_never_yields_is_reported_with_location():
    def lazy(ctx):
        return
        yield

    gen = compose(lazy)(None)
    with pytest.raises(MiddlewareError, match=r"'lazy' \(.*test_compose.py:\d+\) returned without yielding"):
        next(gen)


def test_generator_that_yields_twice_is_reported():
    def greedy(ctx):
        yield
        yield

    gen = compose(greedy)(None)
    next(gen)
    with pytest.raises(MiddlewareError, match="'greedy'.*yielded more than once"):
        next(gen)


def test_factory_returning_a_callable_is_reported():
    def factory(ctx):
        def inner(ctx):
            pass
        return inner

    gen = compose(factory)(None)
    with pytest.raises(MiddlewareError, match="looks like a factory"):
        next(gen)


def test_non_callable_is_rejected_when_composing():
    with pytest.raises(TypeError, match="must be a callable taking ctx"):
        compose(42)
