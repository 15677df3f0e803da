"""Task.state_dict / load_state_dict / register_state: a pipeline's whole state, gathered in one call."""
import pytest

from conveyor import OnlineRLContext, task


class Counter:
    """A stateful middleware: counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, ctx):
        self.calls += 1
        ctx.env_step += 1

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


class Stateless:
    def __call__(self, ctx):
        pass


class Box:
    """A registered object, e.g. a replay buffer."""

    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def build(counter, member, box):
    task.use(counter).use(Stateless()).use(task.serial(lambda ctx: None, member))
    task.register_state("buffer", box)


def test_state_dict_gathers_ctx_every_stateful_middleware_and_registered_objects():
    with task.start(ctx=OnlineRLContext()):
        build(Counter(), Counter(), Box("full"))
        task.run(max_step=3)
        state = task.state_dict()
    assert state["ctx"]["env_step"] == 6 and state["ctx"]["total_step"] == 3
    assert state["middleware"] == {"0:Counter": {"calls": 3}, "2.1:Counter": {"calls": 3}}
    assert state["objects"] == {"buffer": {"value": "full"}}


def test_load_state_dict_restores_into_a_new_pipeline_of_the_same_script():
    with task.start(ctx=OnlineRLContext()):
        build(Counter(), Counter(), Box("full"))
        task.run(max_step=3)
        state = task.state_dict()
    counter, member, box = Counter(), Counter(), Box()
    with task.start(ctx=OnlineRLContext()):
        build(counter, member, box)
        task.load_state_dict(state)
        assert (task.ctx.env_step, task.ctx.total_step) == (6, 3)
        assert (counter.calls, member.calls, box.value) == (3, 3, "full")
        task.run(max_step=1)
        assert task.state_dict()["ctx"] == {**state["ctx"], "env_step": 8, "total_step": 4}


def test_load_state_dict_of_another_pipeline_names_the_keys_that_differ():
    with task.start(ctx=OnlineRLContext()):
        build(Counter(), Counter(), Box())
        state = task.state_dict()
    with task.start(ctx=OnlineRLContext()):
        task.use(Counter())
        task.register_state("buffer", Box())
        with pytest.raises(ValueError, match=r"middleware differ.*missing \[\], unexpected \['2.1:Counter'\]"):
            task.load_state_dict(state)


def test_register_state_refuses_a_duplicate_name_and_objects_without_state():
    with task.start():
        task.register_state("policy", Box())
        with pytest.raises(ValueError, match="'policy'.*already registered"):
            task.register_state("policy", Box())
        with pytest.raises(TypeError, match="state_dict"):
            task.register_state("rng", object())


def test_registered_state_is_forgotten_when_the_block_exits():
    with task.start():
        task.register_state("policy", Box())
    with task.start():
        task.register_state("policy", Box())
        assert list(task.state_dict()["objects"]) == ["policy"]
