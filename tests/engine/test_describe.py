"""task.describe() and the check task.run makes of the declared fields before the first iteration."""
import dataclasses
import functools

import pytest

from conveyor.engine import (Context, OfflineRLContext, OnlineRLContext, PipelineError, compose, declares, fields_of,
                             task)


@declares(writes=("trajectories", "env_step"), reads=("env_step",))
def collector(ctx):
    ctx.trajectories = [1, 2]
    ctx.env_step += 2


@declares(reads=("trajectories",), writes=("train_data",))
def estimator(ctx):
    ctx.train_data = list(ctx.trajectories)


@declares(reads=("train_data", "train_iter"), writes=("train_iter", "train_output"))
def learner(ctx):
    ctx.train_iter += len(ctx.train_data)
    ctx.train_output = {"loss": 0.0}


@declares(backward_reads=("train_output", "env_step"), optional=("train_output",))
def logger(ctx):
    yield
    logger.seen.append((ctx.train_output, ctx.env_step))


logger.seen = []


def test_describe_lists_each_middleware_with_its_fields_and_role():
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER)
        task.use(collector, role=task.role.COLLECTOR)
        task.use(estimator)
        task.use(learner, role=task.role.LEARNER)
        task.use(lambda ctx: None)
        table = task.describe()
    assert [(r.position, r.name, r.reads, r.writes, r.role, r.active) for r in table] == [
        (1, "collector", ("env_step",), ("trajectories", "env_step"), "collector", False),
        (2, "estimator", ("trajectories",), ("train_data",), None, True),
        (3, "learner", ("train_data", "train_iter"), ("train_iter", "train_output"), "learner", True),
        (4, "<lambda>", None, None, None, True)]
    text = str(table)
    assert "collector (not in this process)" in text and "(undeclared)" in text
    assert text.splitlines()[0].split() == ["#", "middleware", "reads", "writes", "role"]


def test_the_table_marks_optional_reads_and_what_the_part_after_yield_reads():
    with task.start(ctx=OnlineRLContext()):
        task.use(logger)
        row = str(task.describe()).splitlines()[1]
    assert "after: train_output?, env_step" in row


def test_run_rejects_a_learner_placed_before_its_collector_naming_both():
    with task.start(ctx=OnlineRLContext()):
        task.use(learner)
        task.use(collector)
        task.use(estimator)
        with pytest.raises(PipelineError) as info:
            task.run(max_step=1)
        assert task.ctx.total_step == 0 and task.ctx.env_step == 0  # nothing ran
    message = str(info.value)
    assert "'learner' (#1) reads ctx.train_data, which only the later 'estimator' (#3)" in message
    assert "from ctx.trajectories of 'collector' (#2)" in message and "place 'learner' after 'estimator'" in message


def test_a_read_nothing_writes_is_named_with_the_fix():
    with task.start(ctx=OnlineRLContext()):
        task.use(estimator)
        with pytest.raises(PipelineError, match=r"'estimator' \(#1\) reads ctx.trajectories, which no middleware "
                                                r"before it writes and which is not kept"):
            task.run(max_step=1)


def test_kept_optional_and_earlier_written_reads_pass_and_the_pipeline_runs():
    logger.seen.clear()
    with task.start(ctx=OnlineRLContext()):
        task.use(logger)  # reads after its yield what the others wrote
        task.use(collector)  # env_step is kept
        task.use(estimator)
        task.use(learner)
        assert task.describe().problems == []
        task.run(max_step=2)
        assert task.ctx.train_iter == 4
    assert logger.seen == [({"loss": 0.0}, 2), ({"loss": 0.0}, 4)]


def test_a_backward_read_that_nothing_writes_is_an_error():
    @declares(backward_reads=("eval_value",))
    def report(ctx):
        yield

    with task.start(ctx=OnlineRLContext()):
        task.use(report)
        with pytest.raises(PipelineError, match=r"'report' \(#1\) reads ctx.eval_value after its yield"):
            task.run(max_step=1)


def test_reads_after_an_undeclared_middleware_are_not_checked():
    def writes_trajectories(ctx):
        ctx.trajectories = [0]

    with task.start(ctx=OnlineRLContext()):
        task.use(writes_trajectories)
        task.use(estimator)
        assert task.describe().problems == []
        task.run(max_step=1)


def test_a_field_set_before_the_run_counts_only_if_kept():
    @dataclasses.dataclass
    class MyContext(Context):
        batch: list = dataclasses.field(default_factory=list)
        seen: int = 0

    @declares(reads=("batch", "seen"), writes=("seen",))
    def use_batch(ctx):
        ctx.seen += len(ctx.batch)

    with task.start(ctx=MyContext(batch=[1])):
        task.use(use_batch)
        assert [p.split(",")[0] for p in task.describe().problems] == [
            "'use_batch' (#1) reads ctx.batch", "'use_batch' (#1) reads ctx.seen"]
        task.ctx.keep("batch", "seen")
        task.run(max_step=2)
        assert task.ctx.seen == 2


def test_fields_of_sees_through_wrappers_and_groups():
    class Step:
        @declares(reads=("env_step",), writes=("obs",))
        def act(self, ctx):
            pass

    @declares(reads=("obs",), writes=("action",))
    class Policy:
        def __call__(self, ctx, scale=1):
            pass

    def plain(ctx):
        pass

    def make_policy() -> Policy:
        return Policy()

    assert fields_of(Step().act).writes == ("obs",)
    assert fields_of(functools.partial(Policy(), scale=2)).reads == ("obs",)
    assert fields_of(plain) is None
    assert fields_of(make_policy).reads == ("obs",)  # a factory annotated to return a declared class
    both = fields_of(compose(Step().act, Policy()))
    assert (both.reads, both.writes) == (("env_step",), ("obs", "action"))  # obs comes from inside the group
    with task.start():
        assert fields_of(task.serial(Step().act, Policy())) == both
        at_once = fields_of(task.parallel(Step().act, Policy()))
        assert at_once.reads == ("env_step", "obs")  # members running at once do not feed each other
        assert fields_of(task.serial(Policy(), plain)) is None
        task.use(Policy())
        assert fields_of(task.middleware[0]).reads == ("obs",)


def test_a_declared_factory_marks_what_it_builds_unless_that_declares_itself():
    @declares(reads=("env_step", "train_iter"), factory=True)
    def budget(limit=None):
        @declares(reads=("env_step",))
        def _precise(ctx):
            pass

        def _plain(ctx):
            pass

        return _precise if limit else _plain

    assert budget.reads == ("env_step", "train_iter") and budget.__name__ == "budget"
    assert fields_of(budget(limit=3)).reads == ("env_step",)
    assert fields_of(budget()).reads == ("env_step", "train_iter")


def test_attributes_declare_too_and_bad_declarations_are_refused():
    class Reader:
        reads, writes = ("obs",), ()

        def __call__(self, ctx):
            pass

    assert fields_of(Reader()).reads == ("obs",)
    with pytest.raises(TypeError, match=r"give a tuple of field names, e.g. \('obs',\)"):
        declares(reads="obs")
    with pytest.raises(ValueError, match="not among the reads"):
        declares(reads=("obs",), optional=("action",))


def test_a_field_the_context_class_lacks_is_named_with_the_class():
    @declares(reads=("env_step",), writes=("train_data",))
    def online_only(ctx):
        pass

    with task.start(ctx=OfflineRLContext()):
        task.use(online_only)
        assert len(task.describe().problems) == 1
        with pytest.raises(PipelineError, match=r"'online_only' \(#1\) uses ctx.env_step, but OfflineRLContext "
                                                r"has no field 'env_step'"):
            task.run(max_step=1)


def test_a_read_optional_in_one_member_of_a_group_but_needed_by_another_is_needed():
    @declares(reads=("collect_kwargs",), optional=("collect_kwargs",), writes=("obs",))
    def act(ctx):
        pass

    @declares(reads=("collect_kwargs", "obs"))
    def needs(ctx):
        pass

    group = fields_of(compose(act, needs))
    assert group.reads == ("collect_kwargs",) and group.optional == ()
    assert fields_of(compose(act)).optional == ("collect_kwargs",)
