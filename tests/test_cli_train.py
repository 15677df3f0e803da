"""conveyor train: overrides typed and validated like the config, config files, a user's entry file, devices,
budgets and the line that says why training stopped."""
import json
import textwrap
from pathlib import Path

import pytest
import torch

from conveyor.cli import main
from tests.cli_helpers import TINY, assert_usage_error


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def train(*args):
    return main(["train", "cartpole/dqn", *args, "--no-progress"])


@pytest.mark.parametrize("override, fragment", [
    ("policy.learn.batch_sise=32", "key 'policy.learn.batch_sise': did you mean 'policy.learn.batch_size'"),
    ("policy.lern.batch_size=32", "did you mean 'policy.learn'"),
    ("policy.learn.batch_size=abc", "config key 'policy.learn.batch_size' must be int, got 'abc' (str)"),
    ("policy.learn.learning_rate=fast", "'policy.learn.learning_rate' must be float or int, got 'fast'"),
    ("policy.learn.batch_size", "is not KEY=VALUE"),
    ("seed.value=3", "config key 'seed' holds 0, not a section"),
])
def test_a_bad_override_is_one_line_naming_the_key_and_the_fix(override, fragment, workdir, capsys):
    assert_usage_error(train("--set", override), capsys, fragment)
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("override, conveyor_key", [
    ("policy.other.replay_buffer.replay_buffer_size=1000", "policy.other.replay_buffer.size"),
    ("policy.model.encoder_hidden_size_list=[64,64]", "policy.model.hidden_sizes"),
    ("policy.other.eps.type=linear", "policy.other.eps.kind"),
    ("policy.learn.target_update_theta=0.01", "policy.learn.target_theta"),
])
def test_a_di_engine_name_is_answered_with_conveyors_key(override, conveyor_key, workdir, capsys):
    assert_usage_error(train("--set", override), capsys, "DI-engine's name", f"Conveyor's is '{conveyor_key}'")


def test_overrides_and_a_config_file_reach_the_run_and_the_last_line_says_the_budget(workdir, capsys):
    (workdir / "over.yaml").write_text("policy:\n  learn:\n    batch_size: 16\n")
    code = train(*TINY, "--config", "over.yaml", "--set", "exp_name=123", "--set", "policy.learn.learning_rate=2e-3")
    assert code == 0, capsys.readouterr().err
    saved = json.loads((workdir / "runs" / "123" / "config.json").read_text())["config"]
    assert saved["exp_name"] == "123" and saved["policy"]["learn"]["batch_size"] == 16
    assert saved["policy"]["learn"]["learning_rate"] == 2e-3 and saved["policy"]["model"]["hidden_sizes"] == [8]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("budget reached: env step ") and "of --max-env-step 64" in last
    assert last.endswith("run directory runs/123") and "(stop value 475.0)" in last


def test_a_solved_run_says_so_with_the_eval_the_stop_value_and_the_env_step(workdir, capsys):
    assert train(*TINY, "--set", "env.stop_value=1.0") == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("solved: eval ") and ">= stop value 1.0 at env step 0" in last


def test_max_train_iter_stops_training(workdir, capsys):
    args = [a for a in TINY if a not in ("--max-env-step", "64")]
    assert train(*args, "--max-train-iter", "20") == 0
    assert "budget reached: train iter " in capsys.readouterr().out


@pytest.mark.parametrize("name, text, fragment", [
    ("missing.yaml", None, "cannot read config file missing.yaml: No such file or directory"),
    ("bad.json", "{not json", "cannot read config file bad.json: Expecting property name"),
    ("bad.yaml", "policy: [unclosed", "cannot read config file bad.yaml:"),
    ("list.yaml", "- 1\n- 2\n", "must hold a mapping of config sections"),
    ("config.toml", "", "must end in .yaml, .yml, .json, .py"),
    ("noconfig.py", "x = 1\n", "must hold a mapping of config sections (a main_config in a .py file), got NoneType"),
])
def test_an_unreadable_config_file_is_one_line_naming_it(name, text, fragment, workdir, capsys):
    if text is not None:
        (workdir / name).write_text(text)
    assert_usage_error(train("--config", name), capsys, fragment)


USER_ENTRY = '''
    """My own entry: the zoo's DQN with a tiny config."""
    from conveyor.config import apply_overrides
    from conveyor.zoo.cartpole.dqn import main as dqn_main, main_config as dqn_config

    main_config = apply_overrides(dqn_config, {overrides!r})
    main_config.exp_name = "mine"


    def main(cfg=None, **kwargs):
        return dqn_main(cfg if cfg is not None else main_config, **kwargs)
'''


def test_a_users_entry_file_trains_like_a_zoo_entry(workdir, capsys):
    overrides = [TINY[i + 1] for i in range(0, len(TINY), 2) if TINY[i] == "--set"]
    (workdir / "my_entry.py").write_text(textwrap.dedent(USER_ENTRY.format(overrides=overrides)))
    assert main(["train", "my_entry.py", "--max-env-step", "32", "--set", "policy.learn.batch_size=8",
                 "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().endswith("run directory runs/mine")
    saved = json.loads((workdir / "runs" / "mine" / "config.json").read_text())["config"]
    assert saved["policy"]["learn"]["batch_size"] == 8 and saved["env"]["collector_env_num"] == 2


@pytest.mark.parametrize("text, fragment", [
    (None, "no entry file nowhere.py"),
    ("main_config = {}\n", "entry file nowhere.py defines no main"),
    ("def main(:\n", "cannot load entry file nowhere.py: invalid syntax at line 1"),
    ("main_config = {}\ndef main(cfg=None, *, seed=None):\n    pass\n",
     "--max-env-step: nowhere.py has a main() without the keyword argument max_env_step="),
])
def test_a_bad_entry_file_is_one_line(text, fragment, workdir, capsys):
    if text is not None:
        (workdir / "nowhere.py").write_text(text)
    assert_usage_error(main(["train", "nowhere.py", "--max-env-step", "10"]), capsys, fragment)


def test_an_interrupted_run_ends_with_one_line_saying_so(workdir, capsys):
    (workdir / "stopped.py").write_text(textwrap.dedent('''
        import signal, types
        from pathlib import Path
        from conveyor.run import TrainingInterrupted

        main_config = {"exp_name": "stopped"}


        def main(cfg=None, **kwargs):
            ctx = types.SimpleNamespace(env_step=120, train_iter=7, last_eval_value=-882.0598574816479)
            raise TrainingInterrupted(signal.SIGINT, ctx, Path("runs/stopped/ckpt"))
    '''))
    assert main(["train", "stopped.py"]) == 130
    assert capsys.readouterr().err == ("conveyor: interrupted by SIGINT at env step 120 (last eval -882.1); final "
                                       "and latest checkpoints written, continue with --resume; run directory "
                                       "runs/stopped\n")
    quoted = " ".join((Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md").read_text().split())
    assert "`conveyor: interrupted by SIGINT at env step 120 (last eval -882.1); final and latest checkpoints " \
           "written, continue with --resume; run directory runs/stopped`" in quoted  # the docs quote this line


def test_an_interrupted_run_without_its_final_checkpoint_does_not_claim_one(workdir, capsys):
    (workdir / "unsaved.py").write_text(textwrap.dedent('''
        import signal
        from pathlib import Path
        from conveyor.run import DistributedRun, TrainingInterrupted

        main_config = {"exp_name": "unsaved"}


        def main(cfg=None, **kwargs):
            raise TrainingInterrupted(signal.SIGTERM, DistributedRun(), Path("runs/unsaved/ckpt"), final=False)
    '''))
    assert main(["train", "unsaved.py"]) == 143
    assert capsys.readouterr().err == ("conveyor: interrupted by SIGTERM; the learner ended without its final "
                                       "checkpoint (its log.txt says why); its last latest.pth.tar, if any, is kept, "
                                       "continue with --resume; run directory runs/unsaved\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(capsys):
    assert_usage_error(train("--device", "cuda"), capsys, "--device cuda: torch sees no CUDA device")


def test_the_progress_bar_shows_the_eval_return_against_the_stop_value_and_ends_full():
    import io

    from tqdm import tqdm

    from conveyor.engine import OnlineRLContext, task
    from conveyor.middleware import EVAL_EVENT, progress_bar

    bars, asked = [], []

    def make_bar(**kwargs):
        asked.append(kwargs.pop("disable"))
        bars.append(tqdm(file=io.StringIO(), disable=False, **kwargs))
        return bars[-1]

    def step(ctx):
        ctx.env_step += 64
        task.emit(EVAL_EVENT, {"mean": 9.87, "std": 0.0, "env_step": ctx.env_step})

    with task.start(ctx=OnlineRLContext()):
        task.use(step).use(progress_bar(100, stop_value=475.0, make_bar=make_bar))
        task.run(max_step=2)
        assert bars[0].postfix == "eval_return=9.9/475" and bars[0].n == bars[0].total == 128
    assert asked == [None]  # tqdm's "silent when not a terminal"


def test_an_entry_file_whose_main_takes_only_a_config_runs_when_no_flag_needs_more(workdir, capsys):
    (workdir / "plain.py").write_text(textwrap.dedent('''
        import types

        main_config = {"exp_name": "plain"}


        def main(cfg=None):
            return types.SimpleNamespace(env_step=5, train_iter=1, last_eval_value=None)
    '''))
    assert main(["train", "plain.py"]) == 0
    assert capsys.readouterr().out == "stopped at env step 5, train iter 1; last eval -; run directory runs/plain\n"
