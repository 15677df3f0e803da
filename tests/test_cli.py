"""The conveyor command: listing entries and failing cleanly (exit 2, one line) on bad input."""
import subprocess
import sys

from conveyor.cli import main


def test_list_shows_the_zoo_entries(capsys):
    assert main(["list"]) == 0
    assert "cartpole/dqn" in capsys.readouterr().out.split()


def test_unknown_entry_exits_2_with_the_closest_name(capsys):
    assert main(["train", "cartpole/dqm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conveyor: error:") and "did you mean 'cartpole/dqn'" in err


def test_resume_without_a_checkpoint_exits_2_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "cartpole/dqn", "--resume", "--exp-name", "nothing_here", "--no-progress"]) == 2
    assert "no checkpoint at runs/nothing_here/ckpt/latest.pth.tar" in capsys.readouterr().err


def test_non_positive_max_env_step_exits_2(capsys):
    assert main(["train", "cartpole/dqn", "--max-env-step", "0"]) == 2
    assert "--max-env-step must be > 0" in capsys.readouterr().err


def test_bad_usage_exits_2_from_the_console_script():
    result = subprocess.run([sys.executable, "-m", "conveyor", "train"], capture_output=True, text=True)
    assert result.returncode == 2 and "entry" in result.stderr


def test_a_negative_seed_exits_2_with_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "cartpole/dqn", "--seed", "-1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config key 'seed' must be in [0, 2**32), got -1" in err
    assert not (tmp_path / "runs").exists()
