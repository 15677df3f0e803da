"""Contexts: declared fields only, kept fields survive renew, nothing else is shared."""
import dataclasses

import pytest

from conveyor.engine import Context, OfflineRLContext, OnlineRLContext

ONLINE_FIELDS = {"total_step", "env_step", "env_episode", "train_iter", "train_data", "train_output",
                 "collect_kwargs", "obs", "action", "inference_output", "trajectories", "episodes",
                 "trajectory_end_idx", "eval_value", "eval_output", "last_eval_iter", "last_eval_value",
                 "last_save_iter"}
OFFLINE_FIELDS = {"total_step", "train_epoch", "train_iter", "train_data", "train_output", "eval_value",
                  "eval_output", "last_eval_iter", "last_eval_value", "last_save_iter"}


@dataclasses.dataclass
class CounterContext(Context):
    count: int = 0
    items: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.keep("count")


def test_online_context_declares_the_documented_fields_and_keeps():
    ctx = OnlineRLContext()
    assert {f.name for f in dataclasses.fields(ctx)} == ONLINE_FIELDS
    assert set(ctx.kept_fields) == {"env_step", "env_episode", "train_iter", "last_eval_iter", "last_eval_value",
                                    "last_save_iter"}


def test_offline_context_declares_the_documented_fields_and_keeps():
    ctx = OfflineRLContext()
    assert {f.name for f in dataclasses.fields(ctx)} == OFFLINE_FIELDS
    assert set(ctx.kept_fields) == {"train_epoch", "train_iter", "last_eval_iter", "last_eval_value",
                                    "last_save_iter"}


def test_renew_carries_kept_fields_and_resets_the_rest():
    ctx = OnlineRLContext()
    ctx.env_step, ctx.train_iter, ctx.obs, ctx.eval_value = 10, 3, [1, 2], 4.5
    new = ctx.renew()
    assert type(new) is OnlineRLContext
    assert (new.env_step, new.train_iter) == (10, 3)
    assert new.obs is None and new.eval_value == float("-inf")


def test_renew_never_shares_mutable_defaults():
    ctx = OnlineRLContext()
    ctx.collect_kwargs["eps"] = 0.5
    new = ctx.renew()
    assert new.collect_kwargs == {}
    assert new.collect_kwargs is not ctx.collect_kwargs


def test_renewed_context_is_independent_of_the_old_one():
    ctx = CounterContext()
    new = ctx.renew()
    ctx.count = 7
    assert new.count == 0


def test_user_subclass_keeps_its_own_fields():
    ctx = CounterContext()
    ctx.count, ctx.items = 2, [1]
    new = ctx.renew()
    assert new.count == 2 and new.items == []


def test_keep_at_run_time_survives_later_renewals():
    ctx = CounterContext()
    ctx.keep("items")
    ctx.items.append(1)
    assert ctx.renew().renew().items == [1]


def test_assigning_an_undeclared_field_names_class_field_and_closest_match():
    ctx = OnlineRLContext()
    with pytest.raises(AttributeError, match=r"OnlineRLContext.*'env_stp'.*did you mean 'env_step'"):
        ctx.env_stp = 1


def test_reading_an_undeclared_field_is_an_error_naming_the_closest_field():
    with pytest.raises(AttributeError, match="did you mean 'train_iter'"):
        OnlineRLContext().train_itr


def test_item_access_says_to_use_attributes():
    ctx = OnlineRLContext()
    with pytest.raises(TypeError, match=r"ctx\.obs"):
        ctx["obs"]
    with pytest.raises(TypeError, match=r"ctx\.obs"):
        ctx["obs"] = 1


def test_keep_of_an_unknown_field_is_an_error():
    with pytest.raises(AttributeError, match="did you mean 'env_step'"):
        OnlineRLContext().keep("env_steps")


def test_state_dict_holds_kept_fields_and_round_trips():
    ctx = OnlineRLContext()
    ctx.env_step, ctx.train_iter, ctx.obs = 100, 20, [1]
    state = ctx.state_dict()
    assert state["env_step"] == 100 and "obs" not in state
    restored = OnlineRLContext().load_state_dict(state)
    assert (restored.env_step, restored.train_iter) == (100, 20)


def test_load_state_dict_on_the_class_builds_a_new_context():
    restored = OnlineRLContext.load_state_dict({"env_step": 5})
    assert isinstance(restored, OnlineRLContext) and restored.env_step == 5


def test_load_state_dict_rejects_fields_that_are_not_kept():
    with pytest.raises(KeyError, match="'obs' is not a kept field"):
        OnlineRLContext().load_state_dict({"obs": 1})


def test_context_without_defaults_cannot_be_renewed_and_says_why():
    @dataclasses.dataclass(kw_only=True)
    class NoDefault(Context):
        x: int

    with pytest.raises(TypeError, match="needs a default"):
        NoDefault(x=1).renew()
