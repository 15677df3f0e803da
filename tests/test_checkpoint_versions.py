"""Checkpoints across versions: every fixture under tests/fixtures/checkpoints/<release>/<entry>/ (written by
``python -m tests.fixtures.make_checkpoints`` at each release) still evaluates and resumes with today's code, and a
checkpoint this code cannot read is refused in one line that names its version and the fix."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

from conveyor.cli import main as cli
from conveyor.middleware import FORMAT_VERSION, load_checkpoint
from tests.cli_helpers import assert_usage_error
from tests.fixtures.make_checkpoints import HERE, LEFT_OUT, online_entries

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EXTRAS = {"atari": "ale_py", "mujoco": "mujoco", "mpe": "pettingzoo", "vmas": "vmas"}
"""The module each env family's extra installs; an entry whose extra is missing is skipped (failed under CI)."""
FIXTURES = sorted(str(path.parent.relative_to(HERE)) for path in HERE.glob("*/*/*/config.json"))
FIXTURES_MARKED = [pytest.param(name, marks=pytest.mark.slow) if "/atari/" in name else name for name in FIXTURES]
"""An Atari fixture takes about 9 s to evaluate and resume: slow, as the other Atari tests."""
MORE_STEPS = 32


def _fixture(fixture: str):
    """``(release, entry, folder)`` of a fixture, skipped when its entry's extra is not installed (unless CI is set)."""
    release, entry = fixture.split("/", 1)
    module = EXTRAS.get(entry.split("/")[0])
    if module is not None and importlib.util.find_spec(module) is None and not os.environ.get("CI"):
        pytest.skip(f"{entry} needs {module}, not installed here")
    return release, entry, HERE / fixture


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("fixture", FIXTURES_MARKED)
def test_an_old_fixture_evaluates_with_todays_code(fixture, in_tmp, capsys):
    _, entry, folder = _fixture(fixture)
    assert cli(["eval", str(folder / "ckpt" / "final.pth.tar"), "--episodes", "1", "--no-progress"]) == 0, \
        capsys.readouterr().err
    assert "1 episode (seed 0): return mean" in capsys.readouterr().out


@pytest.mark.parametrize("fixture", FIXTURES_MARKED)
def test_an_old_fixture_resumes_with_todays_code_and_saves_todays_format(fixture, in_tmp, capsys):
    _, entry, folder = _fixture(fixture)
    saved = load_checkpoint(folder / "ckpt" / "final.pth.tar")
    name = json.loads((folder / "config.json").read_text())["config"]["exp_name"]
    run = in_tmp / "runs" / name
    (run / "ckpt").mkdir(parents=True)
    shutil.copy(folder / "config.json", run / "config.json")
    shutil.copy(folder / "ckpt" / "final.pth.tar", run / "ckpt" / "latest.pth.tar")  # a final cut is a latest one
    budget = saved["ctx"]["env_step"] + MORE_STEPS
    code = cli(["train", entry, "--resume", "--exp-name", name, "--max-env-step", str(budget), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    resumed = torch.load(run / "ckpt" / "final.pth.tar", weights_only=False)
    assert resumed["format_version"] == FORMAT_VERSION
    assert resumed["ctx"]["env_step"] >= budget and resumed["ctx"]["train_iter"] >= saved["ctx"]["train_iter"]


def test_every_online_entry_has_a_fixture_of_this_release():
    import conveyor
    covered = {fixture.split("/", 1)[1] for fixture in FIXTURES if fixture.startswith(f"{conveyor.__version__}/")}
    assert sorted(set(online_entries()) - covered - set(LEFT_OUT)) == []


def test_a_checkpoint_without_a_version_is_version_0_and_loads_in_todays_layout():
    old = HERE / "e3c69fd" / "cartpole" / "dqn" / "ckpt" / "final.pth.tar"
    assert "format_version" not in torch.load(old, weights_only=False)
    assert set(load_checkpoint(old)) == {"ctx", "middleware", "objects", "meta"}


def _run_with_checkpoint_version(root, version) -> str:
    """A run directory (a fixture's config) whose checkpoint says ``format_version``: ``version``."""
    folder = HERE / "0.1.0" / "cartpole" / "dqn"
    run = root / "runs" / "cartpole_dqn"  # the config's exp_name
    (run / "ckpt").mkdir(parents=True)
    shutil.copy(folder / "config.json", run / "config.json")
    state = torch.load(folder / "ckpt" / "final.pth.tar", weights_only=False)
    torch.save({**state, "format_version": version}, run / "ckpt" / "final.pth.tar")
    return str(run / "ckpt" / "final.pth.tar")


def test_a_checkpoint_newer_than_the_code_is_refused_in_one_line(in_tmp, capsys):
    path = _run_with_checkpoint_version(in_tmp, FORMAT_VERSION + 1)
    assert_usage_error(cli(["eval", path, "--episodes", "1", "--no-progress"]), capsys,
                       f"format version {FORMAT_VERSION + 1}", "upgrade Conveyor")


def test_resuming_from_a_checkpoint_newer_than_the_code_is_refused_in_one_line(in_tmp, capsys):
    path = _run_with_checkpoint_version(in_tmp, FORMAT_VERSION + 1)
    os.replace(path, path.replace("final", "latest"))
    code = cli(["train", "cartpole/dqn", "--resume", "--exp-name", "cartpole_dqn", "--no-progress"])
    assert_usage_error(code, capsys, f"format version {FORMAT_VERSION + 1}", "upgrade Conveyor")


def test_a_version_with_no_converter_is_refused_naming_the_release_that_reads_it(in_tmp, capsys, monkeypatch):
    from conveyor.middleware import CONVERTERS
    monkeypatch.delitem(CONVERTERS, 0)  # as when version 0's layout is no longer converted implicitly
    path = _run_with_checkpoint_version(in_tmp, 0)
    assert_usage_error(cli(["eval", path, "--episodes", "1", "--no-progress"]), capsys,
                       "format version 0", "cannot convert", "release that wrote it")


def test_every_converter_is_applied_in_order(tmp_path, monkeypatch):
    from conveyor.middleware import CONVERTERS
    seen = []
    for version in range(FORMAT_VERSION):
        monkeypatch.setitem(CONVERTERS, version, lambda state, v=version: (seen.append(v), state)[1])
    assert load_checkpoint(HERE / "e3c69fd" / "cartpole" / "ppo" / "ckpt" / "final.pth.tar")
    assert seen == list(range(FORMAT_VERSION))
