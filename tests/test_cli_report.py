"""conveyor report on run directories whose evaluations the run's own logger wrote: final returns, IQM and its
bootstrap interval, probability of improvement, the figure, and every bad input one line with exit code 2."""
import re
import sys

import numpy as np
import pytest

from conveyor import OnlineRLContext, task
from conveyor.cli import main
from conveyor.cli.plot import seed_stem
from conveyor.cli.report import final_return, iqm, iqm_interval, probability_of_improvement
from conveyor.middleware import EVAL_EVENT, online_logger
from tests.cli_helpers import assert_usage_error

DQN = [40.0, 10.0, 1000.0, 30.0, 20.0]  # final returns; IQM of 5: cut the lowest and highest, mean(20, 30, 40)
PPO = [2000.0, 2100.0, 1900.0, 2050.0, 1950.0]  # every one above every DQN run; IQM mean(1950, 2000, 2050)


def write_run(run_dir, returns, agent_means=None):
    """A run directory holding one evaluation per return, every 100 env steps, written by the logger a run uses
    (``online_logger`` under ``<run>/tb``, fed the evaluator's ``EVAL_EVENT``)."""
    with task.start(ctx=OnlineRLContext()):
        def evaluate(ctx):
            ctx.env_step += 100
            ctx.train_iter += 1
            result = {"mean": returns[ctx.total_step], "std": 1.0, "env_step": ctx.env_step,
                      "train_iter": ctx.train_iter}
            if agent_means is not None:
                result["agent_mean"] = agent_means[ctx.total_step]
            task.emit(EVAL_EVENT, result)
        task.use(evaluate).use(online_logger(str(run_dir / "tb")))
        task.run(max_step=len(returns))
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Five DQN and five PPO seeds and five twins of the DQN seeds; each run's best evaluation is not its last."""
    root = tmp_path_factory.mktemp("runs")
    for name, finals in (("dqn", DQN), ("ppo", PPO), ("twin", DQN)):
        for seed, final in enumerate(finals):
            write_run(root / f"{name}_s{seed}", [final - 5.0, final + 500.0, final])
    return root


def report(capsys, *argv):
    """stdout of a successful ``conveyor report``: its table rows by group, and its P(X > Y) lines."""
    assert main(["report", *map(str, argv)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:] if re.match(r"\S+ +\d+ +-?\d", line)}
    pi = {m.group(1): float(m.group(2)) for m in re.finditer(r"^P\((.+)\) = ([\d.]+)$", out, re.MULTILINE)}
    return out, rows, pi


def test_a_runs_final_return_is_its_last_evaluation(runs):
    assert final_return(runs / "dqn_s2") == 1000.0  # evaluated 995, 1500, then 1000


def test_report_prints_each_groups_iqm_interval_and_the_probability_of_improvement(runs, tmp_path, capsys):
    out_png = tmp_path / "report.png"
    out, rows, pi = report(capsys, *(runs / f"ppo_s{i}" for i in range(5)), *(runs / f"dqn_s{i}" for i in range(5)),
                           "--out", out_png)
    assert out.splitlines()[1].split() == ["group", "runs", "IQM", "CI", "low", "CI", "high"]
    assert list(rows) == ["ppo", "dqn"]  # grouped by name without the seed tag, in the order given
    assert [rows["ppo"][:2], rows["dqn"][:2]] == [["5", "2000.0"], ["5", "30.0"]]
    for low, high in (rows["ppo"][2:], rows["dqn"][2:]):
        assert float(low) < float(high)
    assert pi == {"ppo > dqn": 1.0}  # two groups: the first against the second
    assert "note:" not in out and out.splitlines()[-1] == f"wrote {out_png}"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import imageio.v3 as iio
    assert iio.imread(out_png).ndim == 3  # decodes as an image


def test_iqm_is_the_mean_of_the_middle_half_as_rliable_computes_it():
    assert iqm([1, 2, 3, 4, 5, 6, 7, 100]) == 4.5  # 8 runs: cut 2 either side, mean(3, 4, 5, 6)
    assert iqm(DQN) == 30.0 and iqm([7.0]) == 7.0
    from rliable.metrics import aggregate_iqm
    rng = np.random.default_rng(0)
    for n in range(1, 13):
        scores = rng.normal(size=n)
        assert iqm(scores) == pytest.approx(aggregate_iqm(scores[:, None]))


def test_the_interval_holds_the_iqm_and_is_reproducible_with_the_seed(runs, tmp_path, capsys):
    low, high = iqm_interval(DQN, seed=3)
    assert low <= iqm(DQN) <= high and low < high
    assert iqm_interval(DQN, seed=3) == (low, high)
    spread = np.random.default_rng(0).normal(size=20)  # many distinct resampled IQMs: each seed draws its own
    assert iqm_interval(spread, seed=3) == iqm_interval(spread, seed=3) != iqm_interval(spread, seed=4)
    assert iqm_interval([5.0], seed=3) == (5.0, 5.0)
    argv = [*(runs / f"dqn_s{i}" for i in range(5)), "--out", tmp_path / "r.png", "--seed", "7"]
    assert report(capsys, *argv)[0] == report(capsys, *argv)[0]


def test_probability_of_improvement_is_one_for_a_dominating_group_and_a_half_for_identical_ones(runs, tmp_path,
                                                                                              capsys):
    assert probability_of_improvement(PPO, DQN) == 1.0 and probability_of_improvement(DQN, PPO) == 0.0
    assert probability_of_improvement(DQN, DQN) == 0.5
    assert probability_of_improvement([1.0, 3.0], [2.0]) == 0.5
    names = [runs / f"{name}_s{i}" for name in ("dqn", "twin", "ppo") for i in range(5)]
    _, rows, pi = report(capsys, *names, "--out", tmp_path / "r.png")
    assert rows["dqn"] == rows["twin"]  # the same returns, the same seed: the same interval
    assert pi == {"dqn > twin": 0.5, "dqn > ppo": 0.0, "twin > dqn": 0.5, "twin > ppo": 0.0, "ppo > dqn": 1.0,
                  "ppo > twin": 1.0}  # three groups: every ordered pair


def test_group_option_gathers_the_runs_its_glob_matches(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(runs)
    _, rows, pi = report(capsys, "dqn_s0", "dqn_s1", "twin_s2", "./ppo_s3", "ppo_s4", "--group", "low=*_s[0-2]",
                         "--group", "high=./ppo_*", "--out", tmp_path / "r.png")
    counts_and_iqms = {name: row[:2] for name, row in rows.items()}
    assert counts_and_iqms == {"low": ["3", "350.0"], "high": ["2", "2000.0"]}  # of 3 runs none is cut
    assert pi == {"low > high": 0.0}


@pytest.mark.parametrize("name, stem", [("dqn_s3", "dqn"), ("curve_seed0", "curve"), ("PPO-Seed_12", "PPO"),
                                        ("dqn_lr1e-3", "dqn_lr1e-3"), ("cartpole_dqn_2", "cartpole_dqn_2"),
                                        ("s0", "s0")])
def test_the_seed_tag_stripped_to_group_runs(name, stem):
    assert seed_stem(name) == stem


def test_a_teams_final_return_is_the_teams(tmp_path):
    run = write_run(tmp_path / "team_s0", [3.0, -7.5], agent_means=[[1.0, 2.0], [-3.0, -4.5]])
    assert final_return(run) == -7.5


def test_groups_of_one_or_two_runs_are_reported_with_a_note(runs, tmp_path, capsys):
    out, rows, pi = report(capsys, runs / "dqn_s0", runs / "ppo_s0", runs / "ppo_s1", "--out", tmp_path / "r.png")
    assert rows["dqn"][:4] == ["1", "40.0", "40.0", "40.0"] and rows["ppo"][:2] == ["2", "2050.0"]
    assert pi == {"dqn > ppo": 0.0}
    assert "note: dqn (1 run), ppo (2 runs): with fewer than 5 runs the interval (and P(X > Y)) says little" in out


def test_report_errors_are_one_line(runs, tmp_path, capsys, monkeypatch):
    dqn = [str(runs / f"dqn_s{i}") for i in range(2)]
    out = ["--out", str(tmp_path / "r.png")]
    assert_usage_error(main(["report", str(tmp_path / "nothing"), *out]), capsys, "no run directory at")
    (tmp_path / "empty").mkdir()
    assert_usage_error(main(["report", str(tmp_path / "empty"), *out]), capsys, "no TensorBoard event files in")
    with task.start(ctx=OnlineRLContext()):  # a run that logged training scalars but never evaluated
        task.use(lambda ctx: setattr(ctx, "train_output", {"losses/td": 1.0}))
        task.use(online_logger(str(tmp_path / "untested" / "tb"), train_show_freq=1))
        task.run(max_step=2)
    assert_usage_error(main(["report", str(tmp_path / "untested"), *out]), capsys,
                       f"{tmp_path / 'untested'} has no evaluation")
    for spec in ("dqn", "=runs/*", "dqn="):
        assert_usage_error(main(["report", *dqn, "--group", spec, *out]), capsys,
                           f"--group {spec!r}: expected NAME=GLOB")
    assert_usage_error(main(["report", *dqn, "--group", "a=*_s0", "--group", "a=*_s1", *out]), capsys,
                       "--group a is given twice")
    assert_usage_error(main(["report", *dqn, "--group", "a=*dqn*", "--group", "b=*ppo*", *out]), capsys,
                       "--group b=*ppo* matches none of the runs given", "at least one run")
    assert_usage_error(main(["report", *dqn, "--group", "a=*_s0", *out]), capsys,
                       f"{dqn[1]} matches no --group")
    assert_usage_error(main(["report", *dqn, "--group", "a=*dqn*", "--group", "b=*_s1", *out]), capsys,
                       f"{dqn[1]} matches --group a and --group b")
    assert_usage_error(main(["report", *dqn, "--out", "report.txt"]), capsys, "must end in .png")
    assert_usage_error(main(["report", *dqn, "--seed", "-1", *out]), capsys, "--seed -1")
    monkeypatch.setitem(sys.modules, "rliable", None)  # rliable not installed
    monkeypatch.setitem(sys.modules, "rliable.metrics", None)
    assert_usage_error(main(["report", *dqn, *out]), capsys, "needs the report extra",
                       "pip install 'conveyor[report]'")
    assert not (tmp_path / "r.png").exists()
