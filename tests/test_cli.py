"""The conveyor command: version, help, listing entries and failing cleanly (exit 2, one line) on bad input."""
import subprocess
import sys

import pytest

from conveyor.cli import main
from tests.cli_helpers import assert_usage_error


def test_version_comes_from_the_package_metadata(capsys):
    from importlib.metadata import version
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"conveyor {version('conveyor')}"


@pytest.mark.parametrize("command", [[], ["train"], ["list"], ["eval"], ["plot"]])
def test_every_command_has_help(command, capsys):
    assert main([*command, "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: conveyor")


def test_list_is_a_table_of_entries_with_env_algorithm_and_stop_value(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ENTRY", "ENV", "ALGORITHM", "STOP", "VALUE"]
    assert ["cartpole/dqn", "CartPole-v1", "DQN", "475.0"] in [line.split() for line in lines]
    assert any(line.split()[:2] == ["pendulum/sac", "Pendulum-v1"] and line.endswith("-200.0") for line in lines)


def test_unknown_entry_exits_2_with_the_closest_name(capsys):
    assert_usage_error(main(["train", "cartpole/dqm"]), capsys, "did you mean 'cartpole/dqn'")


def test_entry_names_are_matched_whatever_their_case(capsys):
    assert_usage_error(main(["train", "CartPole/DQN", "--max-env-step", "0"]), capsys, "--max-env-step must be > 0")
    from conveyor.zoo import load_entry
    assert load_entry("CartPole/DQN") is load_entry("cartpole/dqn")


def test_resume_without_a_checkpoint_exits_2_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "cartpole/dqn", "--resume", "--exp-name", "nothing_here", "--no-progress"])
    assert_usage_error(code, capsys, "no checkpoint at runs/nothing_here/ckpt/latest.pth.tar")


@pytest.mark.parametrize("flag", ["--max-env-step", "--max-train-iter"])
def test_non_positive_budgets_exit_2(flag, capsys):
    assert_usage_error(main(["train", "cartpole/dqn", flag, "0"]), capsys, f"{flag} must be > 0")


def test_bad_usage_exits_2_from_the_console_script():
    result = subprocess.run([sys.executable, "-m", "conveyor", "train"], capture_output=True, text=True)
    assert result.returncode == 2 and "entry" in result.stderr


@pytest.mark.parametrize("argv, fragment", [
    (["train"], "error: train: the following arguments are required: entry (see conveyor train --help)"),
    (["trian"], "error: argument COMMAND: invalid choice: 'trian'"),
    (["train", "cartpole/dqn", "--seed", "one"], "argument --seed: invalid int value: 'one'"),
    (["train", "cartpole/dqn", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["plot", "runs/x", "--x", "time"], "argument --x: invalid choice: 'time'"),
])
def test_bad_usage_is_one_line_and_returns_2(argv, fragment, capsys):
    assert_usage_error(main(argv), capsys, fragment)


def test_a_negative_seed_exits_2_with_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "cartpole/dqn", "--seed", "-1", "--no-progress"])
    assert_usage_error(code, capsys, "config key 'seed' must be in [0, 2**32), got -1")
    assert not (tmp_path / "runs").exists()
