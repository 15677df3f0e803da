"""Learning steps replayed from CUDA graphs (``learn.cuda_graph``): the same updates as eager ones, exact resumes,
a new graph for a new learning rate or a new path through the step. The ``cuda`` cases run where torch sees a GPU
(skipped elsewhere, saying why); the CPU case runs everywhere."""
from __future__ import annotations

import pytest
import torch
import treetensor.torch as ttorch

from conveyor.cli import main as cli_main
from conveyor.middleware import load_checkpoint
from conveyor.policy import CQLPolicy, SACPolicy, TD3Policy
from conveyor.policy.cuda_graph import CudaGraphStep, scalars
from conveyor.policy.q_actor_critic import TorchGeneratorState
from policy_testing import through_bytes

POLICIES = {"sac": SACPolicy, "td3": TD3Policy, "cql": CQLPolicy}


def make(kind: str, device: str, graphed: bool, seed: int = 0, **learn):
    cfg = {"model": {"obs_shape": 5, "action_shape": 2, "hidden_sizes": [64, 64]},
           "learn": {"cuda_graph": graphed, **learn}}
    torch.manual_seed(seed)  # the networks' initial weights
    return POLICIES[kind](cfg, device=device, seed=seed)


def batches(n: int, size: int = 32, *, weight: bool = False, discount: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        fields = {"obs": torch.randn(size, 5, generator=g), "next_obs": torch.randn(size, 5, generator=g),
                  "action": 2 * torch.rand(size, 2, generator=g) - 1, "reward": torch.randn(size, generator=g),
                  "terminated": torch.rand(size, generator=g) < 0.1, "truncated": torch.zeros(size, dtype=torch.bool)}
        if weight:
            fields["weight"] = torch.rand(size, generator=g) + 0.5
        if discount:
            fields["discount"] = torch.full((size,), 0.97)
        out.append(ttorch.Tensor(fields))
    return out


def weights(policy) -> list[torch.Tensor]:
    state = policy.state_dict()
    return [t.float().cpu() for name in ("model", "target_critic") for t in state[name].values()]


def assert_same_training(graphed, eager, data):
    for batch in data:
        got, want = graphed.learn_mode.forward(batch), eager.learn_mode.forward(batch)
        assert got.metrics.keys() == want.metrics.keys()
        for name in want.metrics:
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-5), name
        if want.priorities is not None:
            torch.testing.assert_close(torch.as_tensor(got.priorities), torch.as_tensor(want.priorities))
    for mine, theirs in zip(weights(graphed), weights(eager)):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("kind, learn, fields", [
    ("sac", {}, {}),
    ("sac", {"auto_alpha": False, "grad_clip": 1.0}, {"weight": True, "discount": True}),
    ("td3", {"policy_delay": 2}, {}),
    ("cql", {"bc_warmup_steps": 5, "cql_n_actions": 4}, {}),
])
def test_graphed_updates_are_the_eager_updates(kind, learn, fields):
    graphed, eager = make(kind, "cuda", True, **learn), make(kind, "cuda", False, **learn)
    assert_same_training(graphed, eager, batches(12, **fields))
    # TD3's actor steps every other time and CQL's warm-up ends at step 5: two paths, two graphs.
    assert graphed._graph_step.captured == (2 if kind in ("td3", "cql") else 1)


@pytest.mark.cuda
def test_a_graphed_run_resumes_exactly_from_its_checkpoint():
    data = batches(16, seed=1)
    first = make("sac", "cuda", True, seed=3)
    for batch in data[:8]:
        first.learn_mode.forward(batch)
    checkpoint = through_bytes(first.state_dict())
    for batch in data[8:]:
        first.learn_mode.forward(batch)
    resumed = make("sac", "cuda", True, seed=99)
    for batch in data[:5]:  # captured before the load: the load must drop these graphs
        resumed.learn_mode.forward(batch)
    resumed.load_state_dict(checkpoint)
    for batch in data[8:]:
        resumed.learn_mode.forward(batch)
    for mine, theirs in zip(weights(resumed), weights(first)):
        torch.testing.assert_close(mine, theirs)
    assert resumed.state_dict()["counters"] == first.state_dict()["counters"]


@pytest.mark.cuda
def test_a_new_learning_rate_gets_a_new_graph():
    graphed, eager = make("sac", "cuda", True), make("sac", "cuda", False)
    data = batches(12, seed=2)
    assert_same_training(graphed, eager, data[:6])
    for policy in (graphed, eager):
        policy.learn_mode.set_lr_factor(0.25)
    assert_same_training(graphed, eager, data[6:])
    assert graphed._graph_step.captured == 2


@pytest.mark.cuda
def test_a_graph_step_replays_on_new_inputs_and_starts_over_after_reset():
    calls = []

    def step(batch, variant):
        calls.append(variant)
        return {"sum": (batch.x * 2).sum()}

    graphed = CudaGraphStep(step, warmup=2)
    for i in range(5):
        out = graphed(ttorch.Tensor({"x": torch.full((4,), float(i), device="cuda")}), "a")
        assert scalars(out) == {"sum": 8.0 * i}
    assert calls == ["a", "a", "a"] and graphed.captured == 1  # 2 eager calls, then 1 capture, then replays
    graphed(ttorch.Tensor({"x": torch.ones(3, device="cuda")}), "a")  # another shape: another signature
    graphed.reset()
    assert graphed.captured == 0


@pytest.mark.parametrize("saved_on, loaded_on", [
    ("cpu", "cpu"), pytest.param("cpu", "cuda", marks=pytest.mark.cuda), pytest.param("cuda", "cpu", marks=pytest.mark.cuda)])
def test_a_checkpoint_moves_between_graphed_and_plain_optimizers(saved_on, loaded_on):
    saver = make("sac", saved_on, True)
    for batch in batches(5):
        saver.learn_mode.forward(batch)
    state = through_bytes(saver.state_dict())
    if saved_on == loaded_on:  # as a CUDA-graph run saves it: the optimizers' groups say capturable
        for name in ("actor_optimizer", "critic_optimizer", "alpha_optimizer"):
            for group in state[name]["param_groups"]:
                group["capturable"] = True
    loader = make("sac", loaded_on, True, seed=1)
    loader.load_state_dict(state)
    for batch in batches(5, seed=1):  # steps on the loading device, from a graph on CUDA
        loader.learn_mode.forward(batch)
    assert loader.learn_mode.train_iter == 10
    if loaded_on == "cuda":
        assert loader._graph_step.captured == 1


def test_a_generator_state_saved_on_the_other_device_seeds_this_one_deterministically():
    cuda_state = {"state": torch.arange(16, dtype=torch.uint8), "device": "cuda"}  # a CUDA generator's 16 bytes
    draws = []
    for _ in range(2):
        loaded = TorchGeneratorState(torch.Generator())
        loaded.load_state_dict(cuda_state)
        draws.append(torch.rand(4, generator=loaded.generator))
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)


def test_the_option_changes_nothing_on_cpu():
    on, off = make("sac", "cpu", True), make("sac", "cpu", False)
    data = batches(4)
    for batch in data:
        assert on.learn_mode.forward(batch) == off.learn_mode.forward(batch)
    for mine, theirs in zip(weights(on), weights(off)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [[], ["--async"]])
def test_the_sac_entry_trains_on_cuda_from_graphs_in_sync_and_async_mode(tmp_path, monkeypatch, mode, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["train", "pendulum/sac", "--device", "cuda", "--max-env-step", "600", "--no-progress", "--exp-name", "g",
            "--set", "policy.learn.learning_starts=200", "--set", "policy.collect.random_collect_size=200",
            "--set", "policy.eval.evaluator.eval_freq=100", "--set", "env.n_evaluator_episode=1", *mode]
    assert cli_main(args) == 0, capsys.readouterr().err
    state = load_checkpoint(tmp_path / "runs" / "g" / "ckpt" / "final.pth.tar")["objects"]["policy"]
    assert state["counters"]["train_iter"] >= 300
    assert all(group["capturable"] for group in state["critic_optimizer"]["param_groups"])
