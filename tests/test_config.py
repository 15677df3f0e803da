"""Config compilation: unknown keys, wrong types and values, and unknown env ids fail before anything starts."""
import pytest
from easydict import EasyDict

from conveyor.config import compile_config
from conveyor.policy import DQNPolicy
from conveyor.schema import ConfigError, Option, defaults, validate


def base(**policy):
    return EasyDict(dict(exp_name="t", env=dict(env_id="CartPole-v1"), policy=policy))


def test_compiled_config_has_every_default_and_the_users_values():
    cfg = compile_config(base(learn=dict(batch_size=32)), policy=DQNPolicy)
    assert cfg.policy.learn.batch_size == 32
    assert cfg.policy.learn.learning_rate == DQNPolicy.default_config().learn.learning_rate
    assert cfg.env.collector_env_num == 8 and cfg.seed == 0


def test_model_shapes_are_read_from_the_env():
    cfg = compile_config(base(), policy=DQNPolicy)
    assert cfg.policy.model.obs_shape == 4 and cfg.policy.model.action_shape == 2


def test_compiling_does_not_modify_the_input():
    raw = base()
    compile_config(raw, policy=DQNPolicy)
    assert "learn" not in raw.policy


def test_a_misspelt_key_names_its_full_path_and_the_closest_key():
    with pytest.raises(ConfigError, match=r"'policy\.learn\.batch_sise'.*did you mean 'policy\.learn\.batch_size'"):
        compile_config(base(learn=dict(batch_sise=32)), policy=DQNPolicy)


def test_a_misspelt_section_is_caught_too():
    with pytest.raises(ConfigError, match="did you mean 'policy.learn'"):
        compile_config(base(lern=dict(batch_size=32)), policy=DQNPolicy)


def test_a_wrong_type_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"'policy\.learn\.batch_size' must be int, got '64'"):
        compile_config(base(learn=dict(batch_size="64")), policy=DQNPolicy)


def test_a_negative_buffer_size_is_an_error():
    with pytest.raises(ConfigError, match=r"replay_buffer\.size' must be > 0"):
        compile_config(base(other=dict(replay_buffer=dict(size=-5))), policy=DQNPolicy)


def test_an_unknown_env_id_suggests_the_closest_registered_one():
    cfg = base()
    cfg.env.env_id = "CartPole-v2"
    with pytest.raises(ConfigError, match="did you mean 'CartPole-v1'"):
        compile_config(cfg, policy=DQNPolicy)


def test_an_unknown_choice_suggests_the_closest():
    cfg = base()
    cfg.env.manager = "subproces"
    with pytest.raises(ConfigError, match="did you mean 'subprocess'"):
        compile_config(cfg, policy=DQNPolicy)


def test_a_policy_section_without_a_policy_class_is_explained():
    with pytest.raises(ConfigError, match="policy=<the policy class>"):
        compile_config(base())


def test_bool_is_not_accepted_where_an_int_is_expected():
    with pytest.raises(ConfigError, match="must be int"):
        validate({"n": True}, {"n": Option(1, "a count")})


def test_open_options_accept_any_dict_and_defaults_are_fresh_copies():
    schema = {"kwargs": Option({}, "free-form", type=dict, open=True)}
    assert validate({"kwargs": {"anything": 1}}, schema).kwargs == {"anything": 1}
    a, b = defaults(schema), defaults(schema)
    a.kwargs["x"] = 1
    assert b.kwargs == {}


def compile_for(policy, env_id, **section):
    return compile_config(EasyDict(dict(exp_name="t", env=dict(env_id=env_id), policy=section)), policy=policy)


@pytest.mark.parametrize("policy, env_id, section, message", [
    ("DQNPolicy", "Pendulum-v1", {}, r"DQNPolicy needs a Discrete action space, but env.env_id='Pendulum-v1'.*SAC"),
    ("PPOPolicy", "Pendulum-v1", {}, r"PPOPolicy needs a Discrete.*policy.model.action_space='gaussian'"),
    ("PPOPolicy", "CartPole-v1", {"model": {"action_space": "gaussian"}}, r"needs a Box.*set it to 'discrete'"),
    ("SACPolicy", "CartPole-v1", {}, r"SACPolicy needs a Box action space.*Discrete\(2\)"),
])
def test_an_algorithm_on_an_env_whose_actions_it_cannot_take_is_refused_at_compile_time(policy, env_id, section,
                                                                                       message):
    import conveyor.policy as policies
    with pytest.raises(ConfigError, match=message):
        compile_for(getattr(policies, policy), env_id, **section)


def test_exploration_that_would_grow_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"'policy.other.eps.start' \(0.01\) is below 'policy.other.eps.end' \(0.5\)"):
        compile_for(DQNPolicy, "CartPole-v1", other=dict(eps=dict(start=0.01, end=0.5)))


def test_an_on_policy_minibatch_larger_than_a_rollout_is_refused():
    from conveyor.policy import PPOPolicy
    with pytest.raises(ConfigError, match=r"'policy.learn.batch_size' \(4096\) is larger than the 1024 transitions"):
        compile_for(PPOPolicy, "CartPole-v1", learn=dict(batch_size=4096))


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_is_refused(seed):
    with pytest.raises(ConfigError, match=r"config key 'seed' must be in \[0, 2\*\*32\)"):
        compile_config(EasyDict(dict(exp_name="t", seed=seed, env=dict(env_id="CartPole-v1"), policy={})),
                       policy=DQNPolicy)



def test_overrides_are_typed_against_the_config():
    from conveyor.config import apply_overrides
    cfg = EasyDict(exp_name="run", seed=0, env=dict(stop_value=None), policy=dict(learn=dict(batch_size=64)))
    out = apply_overrides(cfg, ["exp_name=123", "seed=1e3", "env.stop_value=null", "policy.learn.batch_size=32",
                                "policy.model.hidden_sizes=[32, 32]", "policy.cuda=true", "env.env_id=CartPole-v1",
                                "policy.learn.learning_rate=3e-4"])
    assert out.exp_name == "123" and out.seed == 1000 and isinstance(out.seed, int) and out.env.stop_value is None
    assert out.policy.learn.batch_size == 32 and out.policy.model.hidden_sizes == [32, 32]
    assert out.policy.cuda is True and out.env.env_id == "CartPole-v1" and out.policy.learn.learning_rate == 3e-4
    assert cfg.exp_name == "run" and "model" not in cfg.policy  # the input is not modified


def test_an_override_of_a_misspelt_key_is_caught_when_the_config_compiles():
    from conveyor.config import apply_overrides
    with pytest.raises(ConfigError, match="did you mean 'policy.learn.batch_size'"):
        compile_config(apply_overrides(base(), ["policy.learn.batch_sise=3"]), policy=DQNPolicy)


@pytest.mark.parametrize("key, conveyor_key", [
    ("policy.other.replay_buffer.replay_buffer_size", "policy.other.replay_buffer.size"),
    ("policy.model.encoder_hidden_size_list", "policy.model.hidden_sizes"),
    ("policy.learn.value_weight", "policy.learn.value_coef"),
    ("policy.other.eps.type", "policy.other.eps.kind"),
    ("policy.learn.learning_rate_q", "policy.learn.critic_learning_rate"),
    ("policy.learn.learning_rate_policy", "policy.learn.actor_learning_rate"),
    ("policy.collect.discount_factor", "policy.discount_factor"),
    ("policy.eval.evaluator.n_episode", "env.n_evaluator_episode"),
])
def test_di_engine_names_are_answered_with_conveyors_key(key, conveyor_key):
    from conveyor.config import apply_overrides
    from conveyor.policy import PPOPolicy, SACPolicy
    policy = {"value_weight": PPOPolicy, "discount_factor": PPOPolicy}.get(key.rpartition(".")[2], DQNPolicy)
    if "learning_rate_" in key:
        policy = SACPolicy
    cfg = apply_overrides(base(), [f"{key}=1"])
    cfg.env.env_id = "Pendulum-v1" if policy is SACPolicy else "CartPole-v1"
    with pytest.raises(ConfigError, match=f"is DI-engine's name: Conveyor's is '{conveyor_key}'"):
        compile_config(cfg, policy=policy)


def test_config_files_of_every_kind_load(tmp_path):
    from conveyor.config import load_config_file
    (tmp_path / "a.yaml").write_text("policy:\n  learn:\n    batch_size: 8\n")
    (tmp_path / "b.json").write_text('{"policy": "DQNPolicy", "config": {"seed": 3}}')  # a run's config.json
    (tmp_path / "c.py").write_text("main_config = dict(env=dict(env_id='Pendulum-v1'))\n")
    assert load_config_file(tmp_path / "a.yaml") == {"policy": {"learn": {"batch_size": 8}}}
    assert load_config_file(tmp_path / "b.json") == {"seed": 3}
    assert load_config_file(tmp_path / "c.py").env.env_id == "Pendulum-v1"


def test_merging_a_config_goes_section_by_section():
    from conveyor.config import merge_config
    merged = merge_config({"env": {"env_id": "CartPole-v1", "collector_env_num": 8}}, {"env": {"collector_env_num": 2}})
    assert merged == {"env": {"env_id": "CartPole-v1", "collector_env_num": 2}}
