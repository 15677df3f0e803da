"""``conveyor describe``: an entry's pipeline as a table, without training."""
import textwrap

import pytest

from conveyor.cli import main


def test_describe_prints_a_zoo_entrys_pipeline_without_training(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["describe", "cartpole/ppo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["#", "middleware", "reads", "writes", "role"]
    assert [line.split()[1] for line in lines[1:]] == ["InteractionEvaluator", "StepCollector", "gae_estimator",
                                                       "MultistepTrainer", "CkptSaver", "online_logger"]
    assert "train_data, train_iter, env_step" in lines[4]
    assert list(tmp_path.iterdir()) == []  # no run directory, no logs


def test_a_users_file_with_a_misplaced_learner_is_listed_with_the_problem(capsys, tmp_path):
    entry = tmp_path / "mine.py"
    entry.write_text(textwrap.dedent("""
        from conveyor.engine import OnlineRLContext, task
        from tests.test_testing import collect, learn

        def main(seed=None):
            with task.start(ctx=OnlineRLContext()):
                task.use(learn)
                task.use(collect)
                task.run()
    """))
    assert main(["describe", str(entry)]) == 2
    out, err = capsys.readouterr()
    assert "problem: 'learn' (#1) reads ctx.trajectories, which only the later 'collect' (#2)" in out
    assert err == f"conveyor: error: {entry}: 1 problem(s) in the order of the pipeline (above)\n"


@pytest.mark.parametrize("target, says", [
    ("cartpole/dqm", "no zoo entry 'cartpole/dqm': did you mean 'cartpole/dqn'?"),
    ("missing.py", "no entry file"),
    ("nomain.py", "defines no main"),
])
def test_bad_targets_are_one_line_errors(capsys, tmp_path, monkeypatch, target, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nomain.py").write_text("x = 1\n")
    assert main(["describe", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conveyor: error: ") and says in err and err.count("\n") == 1
