"""Team entries (mpe/mappo, mpe/ippo, vmas/mappo): smoke runs in one process, async and distributed, the team and
per-agent returns in evaluations and logs, exact resume, `describe`, bad input, and a run that learns."""
import copy
import pickle

import numpy as np
import pytest

from conveyor.cli import main as cli_main
from conveyor.config import compile_config
from conveyor.envs import make_env_manager
from conveyor.middleware import evaluate, load_checkpoint, restore
from conveyor.policy import MAPPOPolicy
from conveyor.run import train_distributed
from conveyor.zoo import load_entry
from tests.cli_helpers import assert_usage_error
from tests.zoo.resume_bar import differences, straight_and_split

ENTRIES = ["mpe/mappo", "mpe/ippo", "vmas/mappo"]
EPISODE = {"mpe": ("max_cycles", 5), "vmas": ("max_steps", 5)}  # tiny episodes: each run ends several
TINY = {"env.collector_env_num": 2, "env.evaluator_env_num": 1, "env.n_evaluator_episode": 1,
        "policy.collect.n_sample": 20, "policy.learn.batch_size": 20, "policy.learn.epoch_per_collect": 1,
        "policy.model.hidden_sizes": [8], "policy.eval.evaluator.eval_freq": 1}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def tiny_settings(name):
    """``{dotted key: value}`` that make runs of ``name`` take a second: 2 envs, 5-step episodes, 20-step rounds."""
    key, steps = EPISODE[name.split("/")[0]]
    return {**TINY, f"env.env_kwargs.{key}": steps}


def tiny(name):
    """The entry's config with :func:`tiny_settings` applied."""
    cfg = copy.deepcopy(load_entry(name).main_config)
    for dotted, value in tiny_settings(name).items():
        *path, last = dotted.split(".")
        node = cfg
        for part in path:
            node = node[part]
        node[last] = value
    return cfg


def tiny_options(name):
    """:func:`tiny_settings` as ``--set`` options of ``conveyor train``."""
    return [arg for dotted, value in tiny_settings(name).items()
            for arg in ("--set", f"{dotted}={value}".replace(" ", ""))]


def logged_tags(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    found = set()
    for events in (run_dir / "tb").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        found |= set(acc.Tags()["scalars"])
    return found


@pytest.mark.parametrize("name", ENTRIES)
def test_each_entry_trains_in_one_process_and_logs_team_and_agent_returns(in_tmp, name):
    ctx = load_entry(name).main(tiny(name), exp_name="one", max_env_step=40, progress=False)
    assert ctx.env_step >= 40 and ctx.train_iter > 0
    best = load_checkpoint(in_tmp / "runs" / "one" / "ckpt" / "eval_best.pth.tar")["eval"]
    assert len(best["agent_mean"]) == 3 and best["mean"] == pytest.approx(sum(best["agent_mean"]), abs=1e-4)
    tags = logged_tags(in_tmp / "runs" / "one")
    assert {"eval/return", "eval/agent_return/0", "eval/agent_return/2", "charts/episode_return",
            "charts/agent_episode_return/1"} <= tags
    assert (in_tmp / "runs" / "one" / "ckpt" / "final.pth.tar").is_file()


@pytest.mark.parametrize("name", ENTRIES)
def test_each_entry_trains_in_async_mode(in_tmp, name):
    ctx = load_entry(name).main(tiny(name), exp_name="async", max_env_step=60, async_mode=True, progress=False)
    assert ctx.env_step >= 60 and ctx.train_iter > 0


@pytest.mark.parametrize("name, evaluators", [("mpe/mappo", 1), ("mpe/ippo", 0), ("vmas/mappo", 0)])  # 1: results cross
def test_each_entry_trains_with_collector_processes_and_logs_agent_returns(in_tmp, name, evaluators):
    run = train_distributed(load_entry(name), collectors=1, evaluators=evaluators, cfg=tiny(name), exp_name="dist",
                            max_env_step=60, progress=False)
    assert run.env_step >= 60 and run.train_iter > 0 and run.last_eval_value is not None
    assert all(node["collected"] > 0 for node in run.nodes if node["role"] == "collector")
    assert {"eval/agent_return/0", "eval/agent_return/2"} <= logged_tags(in_tmp / "runs" / "dist")


def plain(value, seen=None):
    """A pickled MPE env's state as nested plain values: its objects by their attributes, random generators by their
    state, arrays by dtype, shape and bytes; pygame's surface and font (rebuilt on load) left out. Two pickles of one
    state may differ in bytes (numpy shares dtype objects differently in a restored env), never in this."""
    seen = {} if seen is None else seen  # id -> object: kept alive, so that no id is reused while walking
    if isinstance(value, bytes):
        return plain(pickle.loads(value), seen)
    if isinstance(value, np.random.Generator):
        return value.bit_generator.state
    if isinstance(value, np.ndarray):
        return str(value.dtype), value.shape, value.tobytes()
    if isinstance(value, (list, tuple)):
        return [plain(v, seen) for v in value]
    if isinstance(value, dict):
        return {k: plain(v, seen) for k, v in value.items()}
    if type(value).__module__.startswith("pygame"):
        return type(value).__name__
    if hasattr(value, "__dict__") and not isinstance(value, type):
        if id(value) in seen:
            return "<seen>"
        seen[id(value)] = value
        return type(value).__name__, plain(vars(value), seen)
    return value


def test_a_stopped_and_resumed_mpe_mappo_run_ends_as_a_straight_run_does(in_tmp):
    straight, split = straight_and_split(in_tmp, "mpe/mappo", tiny_options("mpe/mappo"), 40)
    assert straight["ctx"]["env_step"] == split["ctx"]["env_step"] and straight["ctx"]["train_iter"] > 0
    envs = [run["middleware"]["1:StepCollector"]["env"]["per_env"].pop("envs") for run in (straight, split)]
    assert differences(straight, split) == []  # policy, optimizer, value normaliser, RNGs, counters: bit for bit
    assert differences(plain(envs[0]), plain(envs[1])) == []


def test_describe_shows_the_agent_axis_of_the_collected_data(capsys):
    assert cli_main(["describe", "mpe/mappo"]) == 0
    out = capsys.readouterr().out
    assert "#2 trajectories: obs.obs [T=100, N_env=8, N_agent=3, 18]; obs.state [T=100, N_env=8, 54]" in out
    assert "reward and the policy's outputs [T=100, N_env=8, N_agent=3]" in out


def test_a_single_agent_entry_on_a_team_env_is_refused_in_one_line(in_tmp, capsys):
    code = cli_main(["train", "cartpole/ppo", "--set", "env.env_id=mpe/simple_spread_v3", "--no-progress"])
    assert_usage_error(code, capsys, "trains one agent", "mpe/simple_spread_v3", "multi-agent entry")


def test_a_team_entry_on_a_single_agent_env_is_refused_in_one_line(in_tmp, capsys):
    code = cli_main(["train", "mpe/mappo", "--set", "env.env_id=CartPole-v1", "--no-progress"])
    assert_usage_error(code, capsys, "trains a team of agents", "CartPole-v1", "multi-agent id")


def test_a_resume_with_another_number_of_agents_is_refused_in_one_line(in_tmp, capsys):
    options = ["--exp-name", "three", "--no-progress", *tiny_options("mpe/mappo")]
    assert cli_main(["train", "mpe/mappo", "--max-env-step", "20", *options]) == 0
    capsys.readouterr()
    code = cli_main(["train", "mpe/mappo", "--resume", "--max-env-step", "40", *options,
                     "--set", "env.env_kwargs.N=4"])
    assert_usage_error(code, capsys, "env.env_kwargs.N: saved 3, given 4", "policy.model.n_agents: saved 3, given 4",
                       "resume without a config, or start a new run")


@pytest.mark.slow
def test_mpe_mappo_improves_the_team_return_of_its_untrained_policy_on_simple_spread(in_tmp):
    entry = load_entry("mpe/mappo")
    cfg = copy.deepcopy(entry.main_config)
    cfg.policy.collect.n_sample = 400
    cfg.policy.learn.update(batch_size=200, epoch_per_collect=10, learning_rate=1e-3)
    cfg.policy.eval.evaluator.eval_freq = 10 ** 6  # only the first evaluation: the test evaluates at the end
    entry.main(cfg, exp_name="learn", max_env_step=10_000, progress=False)
    compiled = compile_config(cfg, MAPPOPolicy)
    untrained, trained = MAPPOPolicy(compiled.policy, seed=0), MAPPOPolicy(compiled.policy, seed=0)
    restore(in_tmp / "runs" / "learn" / "ckpt" / "final.pth.tar", trained)
    with make_env_manager(cfg.env, "evaluator", seed=7) as env:
        before, after = (evaluate(policy.eval_mode, env, 32, seed=7)["mean"] for policy in (untrained, trained))
    assert after > before + 40, (before, after)  # about -186 before, -100 to -125 after 10k env steps


def test_eval_records_the_team_as_a_gif(in_tmp, capsys):
    from PIL import Image, ImageSequence

    load_entry("mpe/mappo").main(tiny("mpe/mappo"), exp_name="team", max_env_step=40, progress=False)
    assert cli_main(["eval", "runs/team", "--episodes", "1", "--record", "team.gif"]) == 0, capsys.readouterr().err
    with Image.open(in_tmp / "team.gif") as gif:
        frames = [(np.asarray(frame.convert("RGB")), frame.info["duration"]) for frame in ImageSequence.Iterator(gif)]
    # the 5-step episode from its first observation at MPE's 10 frames/s (the GIF merges equal frames, adding up
    # their durations)
    assert sum(duration for _, duration in frames) == (5 + 1) * 100
    assert frames[0][0].shape == (700, 700, 3) and len(frames) > 1  # the agents move
