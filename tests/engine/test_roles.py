"""Roles and labels: which middleware run in which process, and the no-op middleware."""
import pytest

from conveyor import task
from conveyor.engine import Role


class _Labelled:
    """A stand-in for a worker's router: publish/on and labels."""

    def __init__(self, labels):
        self.labels = frozenset(labels)

    def publish(self, topic, payload):
        return 0

    def on(self, topic, fn):
        pass


def run_chain():
    ran = []
    task.use(lambda ctx: ran.append("learn"), role=task.role.LEARNER)
    task.use(lambda ctx: ran.append("collect"), role=task.role.COLLECTOR)
    task.use(lambda ctx: ran.append("eval"), role=task.role.EVALUATOR)
    task.use(lambda ctx: ran.append("any"))
    task.run(max_step=1)
    return ran


def test_with_no_role_added_a_process_has_every_role_and_runs_every_middleware():
    with task.start():
        assert all(task.has_role(r) for r in Role) and task.roles == frozenset()
        assert run_chain() == ["learn", "collect", "eval", "any"]


def test_middleware_of_a_role_the_process_lacks_are_no_ops():
    with task.start():
        task.add_role(task.role.COLLECTOR).add_role(task.role.EVALUATOR)
        assert task.has_role(task.role.COLLECTOR) and not task.has_role(task.role.LEARNER)
        assert run_chain() == ["collect", "eval", "any"]


def test_roles_are_cleared_when_the_start_block_exits():
    with task.start():
        task.add_role(task.role.LEARNER)
    with task.start():
        assert task.has_role(task.role.COLLECTOR) and task.roles == frozenset()


def test_adding_a_role_after_role_bound_middleware_is_refused_with_the_fix():
    with task.start():
        task.use(lambda ctx: None, role=task.role.LEARNER)
        with pytest.raises(RuntimeError, match="add roles first"):
            task.add_role(task.role.COLLECTOR)


def test_bad_roles_are_refused_naming_the_choices():
    with task.start():
        with pytest.raises(TypeError, match="task.role.LEARNER"):
            task.add_role("learner")
        with pytest.raises(TypeError, match="task.role.COLLECTOR"):
            task.use(lambda ctx: None, role="collector")
        with pytest.raises(TypeError, match="42"):
            task.use(42, role=task.role.LEARNER)  # checked even where it would be left out


def test_void_is_a_middleware_that_does_nothing():
    with task.start():
        task.use(task.void())
        task.run(max_step=2)
        assert task.ctx.total_step == 2


def test_labels_come_from_the_router_and_match_fnmatch_patterns():
    assert task.labels == set() and not task.match_labels("*")
    task.attach_router(_Labelled({"gpu0", "host-a"}))
    try:
        assert task.labels == {"gpu0", "host-a"}
        assert task.match_labels("gpu*") and task.match_labels(["cpu*", "host-[ab]"])
        assert not task.match_labels("GPU*") and not task.match_labels([])
        with pytest.raises(TypeError, match="strings"):
            task.match_labels([1])
    finally:
        task.detach_router()
