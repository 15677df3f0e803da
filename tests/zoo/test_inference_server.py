"""``--inference server``: an inference server node acting for the collectors of a distributed run; its layout, its
default, its end and the CLI's refusals."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._cluster import wait_until

from conveyor.cli import main as cli_main
from conveyor.engine import Role
from conveyor.run import Layout, train_distributed
from conveyor.run.acting import default_inference
from conveyor.schema import ConfigError
from conveyor.zoo import load_entry
from tests.cli_helpers import assert_usage_error
from tests.launcher_helpers import group_gone

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_inference_server_is_the_last_node_and_acts_as_a_receiver_of_weights():
    layout = Layout(2, evaluators=1, inference="server")
    assert (layout.n_nodes, layout.server) == (5, 4)
    assert [layout.role(i) for i in range(5)] == [Role.LEARNER, Role.COLLECTOR, Role.COLLECTOR, Role.EVALUATOR,
                                                  Role.COLLECTOR]
    assert Layout(2).server is None and Layout(2).n_nodes == 3


def test_an_unknown_inference_value_is_refused_with_the_closest_name():
    with pytest.raises(ConfigError, match=r"^--inference 'serve': must be one of local, server; did you mean server\?$"):
        Layout(2, inference="serve")


def test_the_default_is_the_server_where_cuda_is_or_the_policy_acts_on_images_for_collectors_of_this_host():
    cartpole, atari = load_entry("cartpole/impala").main_config, load_entry("atari/impala").main_config
    assert default_inference(cartpole, cuda=True) == "server"
    assert default_inference(cartpole, cuda=False) == "local"
    assert default_inference(atari, cuda=False) == "server"
    assert default_inference(atari, cuda=True, one_host=False) == "local"
    assert default_inference(atari, cuda=True, collectors=1) == "local"  # one collector: nothing to batch
    assert default_inference({"policy": {"model": {"obs_shape": [4, 84, 84]}}}, cuda=False) == "server"
    assert default_inference({"policy": {"model": {"obs_shape": [4, 84, 84], "encoder": "mlp"}}}, cuda=False) == "local"


@pytest.mark.parametrize("entry", ["cartpole_masked/ppo_gru", "mpe/qmix", "mpe/mappo"])
def test_the_default_never_gives_the_server_a_policy_that_keeps_a_state_per_env(entry):
    assert default_inference(load_entry(entry).main_config, cuda=True) == "local"


def test_a_run_spread_over_hosts_refuses_the_server(in_tmp):
    with pytest.raises(ConfigError, match="--inference server: .* with --node-ids or --attach-to use --inference local"):
        train_distributed(load_entry("cartpole/ppo"), collectors=2, node_ids=[0, 1], inference="server")


@pytest.mark.parametrize("entry, steps", [("cartpole/ppo", 1024), ("cartpole/dqn", 1500)])
def test_an_entry_trains_with_its_collectors_acting_through_the_server(in_tmp, entry, steps):
    """PPO: on-policy, each batch on the newest weights (the server answers on the version the collector acts on);
    DQN: random warm-up actions, then an exploration rate sent with each request."""
    run = train_distributed(load_entry(entry), collectors=2, exp_name="served", max_env_step=steps, progress=False,
                            inference="server")
    roles = {node["node_id"]: node["role"] for node in run.nodes}
    assert roles == {0: "learner", 1: "collector", 2: "collector", 3: "inference"}
    learner, = [node for node in run.nodes if node["role"] == "learner"]
    assert run.env_step >= steps and run.train_iter > 0
    assert sorted(learner["received_from"]) == ["1", "2"] and all(learner["received_from"].values())
    assert run.transitions["unaccounted"] == 0


@pytest.mark.parametrize("argv, fragments", [
    (["--inference", "server"], ["--inference server needs --collectors N"]),
    (["--collectors", "2", "--inference", "gpu"], ["--inference 'gpu': must be one of local, server"]),
    (["--collectors", "2", "--inference", "server", "--launcher", "slurm"], ["with --launcher slurm use --inference "
                                                                           "local"]),
], ids=["no-collectors", "unknown", "slurm"])
def test_bad_inference_flags_are_one_line_usage_errors(in_tmp, capsys, argv, fragments):
    assert_usage_error(cli_main(["train", "cartpole/ppo", *argv]), capsys, *fragments)


def test_a_recurrent_policy_is_refused_by_the_server_in_one_line(in_tmp):
    with pytest.raises(ConfigError, match="keeps a state per env .* use --inference local"):
        train_distributed(load_entry("cartpole_masked/ppo_gru"), collectors=1, exp_name="gru", max_env_step=512,
                          progress=False, inference="server")


@pytest.mark.slow
def test_a_killed_server_ends_the_run_with_one_line_naming_it_and_leaves_no_process(in_tmp):
    argv = ["cartpole/impala", "--collectors", "2", "--inference", "server", "--exp-name", "lost", "--no-progress",
            "--no-stop", "--ckpt-interval", "0.2"]
    proc = subprocess.Popen([sys.executable, "-m", "conveyor", "train", *argv], cwd=in_tmp, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    nodes, ckpt = in_tmp / "runs" / "lost" / "nodes.json", in_tmp / "runs" / "lost" / "ckpt"
    try:
        wait_until(lambda: nodes.is_file() and len(json.loads(nodes.read_text())) == 4 or proc.poll() is not None,
                   240, "4 nodes in nodes.json")
        wait_until(lambda: (ckpt / "latest.pth.tar").is_file() or proc.poll() is not None, 240, "a first checkpoint")
        server, = [row["pid"] for row in json.loads(nodes.read_text()) if row["node_id"] == 3]
        os.kill(server, signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("conveyor: error: ") and "the inference server (node 3)" in last, err[-2000:]
    wait_until(lambda: group_gone(proc.pid), 30, "every process of the run to end")
