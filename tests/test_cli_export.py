"""conveyor export on real tiny runs: each exported file, loaded on its own (onnxruntime, torch.jit.load), acts as
the run's policy does, recurrent state included; a file that fails the check is not written; bad input is one line
with exit code 2."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.cli import export, main
from conveyor.cli._checkpoint import load_policy, locate
from conveyor.envs import env_spaces
from tests.cli_helpers import TINY, assert_usage_error

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")

SMALL = ["--set", "env.collector_env_num=2", "--set", "env.evaluator_env_num=2", "--set", "env.n_evaluator_episode=1",
         "--set", "policy.model.hidden_sizes=[8]", "--max-env-step", "64", "--no-progress"]

RUNS = {
    "cartpole/dqn": TINY,
    "pendulum/sac": [*SMALL, "--set", "policy.learn.learning_starts=16", "--set", "policy.collect.random_collect_size=16",
                     "--set", "policy.learn.batch_size=8", "--set", "policy.eval.evaluator.eval_freq=1000",
                     "--set", "policy.other.replay_buffer.size=100"],
    "cartpole_masked/ppo_gru": [*SMALL, "--set", "policy.collect.n_sample=32", "--set", "policy.learn.sequence_length=8",
                                "--set", "policy.learn.batch_size=16", "--set", "policy.learn.epoch_per_collect=1",
                                "--set", "policy.eval.evaluator.eval_freq=1000"],  # the entry's GRU: 64 wide
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One tiny trained run per entry: a discrete, a continuous and a recurrent policy."""
    root = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for entry, flags in RUNS.items():
            assert main(["train", entry, *flags, "--exp-name", entry.replace("/", "_")]) == 0
    return {entry: root / "runs" / entry.replace("/", "_") for entry in RUNS}


def _load(path, fmt):
    """The exported file as a user loads it: numpy arrays in, a list of numpy arrays out."""
    if fmt == "onnx":
        import onnxruntime
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        assert names[0] == "obs" and [o.name for o in session.get_outputs()][0] == "action"
        return lambda *arrays: session.run(None, dict(zip(names, arrays)))
    module = torch.jit.load(str(path))

    def call(*arrays):
        out = module(*map(torch.from_numpy, arrays))
        return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]
    return call


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
@pytest.mark.parametrize("entry", list(RUNS))
def test_exported_file_acts_as_the_runs_policy_for_any_batch_size(entry, fmt, runs, tmp_path, capsys):
    out = tmp_path / f"policy.{fmt}"
    assert main(["export", str(runs[entry]), "--format", fmt, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "max abs difference" in printed and f"wrote {out} ({fmt}" in printed, printed
    exported = _load(out, fmt)
    cfg, policy = load_policy(*locate(runs[entry]), device="cpu")
    space, _ = env_spaces(cfg.env)
    space.seed(123)
    recurrent = entry.endswith("gru")
    state = [np.zeros((5, 64), np.float32)] if recurrent else []
    policy.eval_mode.reset()
    for _ in range(3 if recurrent else 1):  # the state carried by the file as the eval view carries its own
        obs = np.stack([space.sample() for _ in range(5)])
        action, *state = exported(obs, *state)
        want = policy.eval_mode.forward(obs)["action"]
        assert action.shape == want.shape and action.dtype == want.dtype
        if np.issubdtype(want.dtype, np.floating):
            np.testing.assert_allclose(action, want, atol=1e-4)
        else:
            np.testing.assert_array_equal(action, want)
    if recurrent:  # the state is an input that matters, and an output
        assert len(state) == 1 and state[0].shape == (5, 64)
        assert not np.allclose(exported(obs, np.zeros((5, 64), np.float32))[1], state[0])


def test_an_export_over_the_tolerance_fails_with_exit_1_and_writes_nothing(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(export, "TOLERANCE", -1.0)  # no difference, not even 0, is within it
    out = tmp_path / "sac.onnx"
    assert main(["export", str(runs["pendulum/sac"]), "--format", "onnx", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("conveyor: error: the exported model differs from the torch policy by ") and \
        err.count("\n") == 1 and "nothing written" in err, err
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_path_that_is_not_a_run(tmp_path, capsys):
    code = main(["export", str(tmp_path / "missing"), "--format", "onnx", "--out", str(tmp_path / "p.onnx")])
    assert_usage_error(code, capsys, "no run directory or checkpoint file at")


def test_export_refuses_a_run_directory_without_a_checkpoint(tmp_path, capsys):
    code = main(["export", str(tmp_path), "--format", "torchscript", "--out", str(tmp_path / "p.pt")])
    assert_usage_error(code, capsys, "no checkpoint in", "train this run first")


def test_export_refuses_an_unknown_format_suggesting_the_closest(runs, tmp_path, capsys):
    code = main(["export", str(runs["cartpole/dqn"]), "--format", "onxx", "--out", str(tmp_path / "p.onnx")])
    assert_usage_error(code, capsys, "--format onxx", "did you mean onnx?")


@pytest.mark.parametrize("where, fragment", [("missing/p.onnx", "does not exist"), (".", "is a directory")])
def test_export_refuses_an_unwritable_out(where, fragment, runs, tmp_path, capsys):
    code = main(["export", str(runs["cartpole/dqn"]), "--format", "onnx", "--out", str(tmp_path / where)])
    assert_usage_error(code, capsys, "--out", fragment)


def test_onnx_without_the_export_extra_says_what_to_install(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)  # as if it were not installed
    code = main(["export", str(runs["cartpole/dqn"]), "--format", "onnx", "--out", str(tmp_path / "p.onnx")])
    assert_usage_error(code, capsys, 'pip install "conveyor[export]"')
    assert list(tmp_path.iterdir()) == []


def test_the_python_examples_of_docs_export_md_run_on_the_files_its_commands_write(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for entry, fmt, out in (("cartpole/dqn", "onnx", "cartpole_dqn.onnx"), ("cartpole_masked/ppo_gru", "onnx",
                            "ppo_gru.onnx"), ("cartpole_masked/ppo_gru", "torchscript", "ppo_gru.pt")):
        assert main(["export", str(runs[entry]), "--format", fmt, "--out", out]) == 0
    page = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    examples = re.findall(r"^```python\n(.*?)^```", page, re.MULTILINE | re.DOTALL)
    assert len(examples) == 4
    for code in examples:
        exec(compile(code, "docs/export.md", "exec"), {})
    assert Path("policy.onnx").is_file()
