"""conveyor eval and conveyor plot on real tiny runs: statistics of a checkpoint, a recorded episode, curves
of seeds aggregated and experiments overlaid; every bad input one line with exit code 2."""
import pytest

from conveyor.cli import main
from tests.cli_helpers import TINY, assert_usage_error, run_conveyor


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three tiny DQN runs: seeds 0 and 1 of one config, and seed 0 with another learning rate."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for name, extra in (("dqn_s0", ["--seed", "0"]), ("dqn_s1", ["--seed", "1"]),
                            ("fast_s0", ["--seed", "0", "--set", "policy.learn.learning_rate=1e-2"])):
            assert main(["train", "cartpole/dqn", *TINY, "--exp-name", name, *extra]) == 0
    return root / "runs"


def test_eval_prints_rounded_statistics_of_the_best_checkpoint(runs, capsys):
    assert main(["eval", str(runs / "dqn_s0"), "--episodes", "3", "--seed", "5"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{runs / 'dqn_s0' / 'ckpt' / 'eval_best.pth.tar'} on CartPole-v1, 3 episodes (seed 5): ")
    numbers = [part.split()[-1] for part in out.split(": return ")[1].split(", ")]
    assert len(numbers) == 4 and all(len(n.partition(".")[2]) <= 3 for n in numbers)  # mean, std, min, max


def test_eval_writes_progress_lines_when_stderr_is_not_a_terminal(runs, capsys, monkeypatch):
    from types import SimpleNamespace

    from conveyor.middleware import logger
    seconds = iter(range(0, 10**6))
    monkeypatch.setattr(logger, "time", SimpleNamespace(monotonic=lambda: float(next(seconds))))  # a slow clock
    assert main(["eval", str(runs / "dqn_s0"), "--episodes", "3"]) == 0
    lines = capsys.readouterr().err.splitlines()  # capsys: stderr is not a terminal
    assert len(lines) > 2 and all(line.startswith("eval: ") and "/3 episode (" in line for line in lines), lines
    assert lines[-1].startswith("eval: 3/3 episode (100%), mean_return=")


@pytest.mark.parametrize("video", ["episode.gif", "episode.mp4"])
def test_eval_of_a_checkpoint_file_records_an_episode(video, runs, tmp_path, capsys):
    out = tmp_path / video
    assert main(["eval", str(runs / "dqn_s1" / "ckpt" / "final.pth.tar"), "--episodes", "1", "--record",
                 str(out)]) == 0
    assert f"to {out}" in capsys.readouterr().out
    import imageio.v3 as iio
    frames = iio.imread(out, index=None, **({"plugin": "FFMPEG"} if video.endswith(".mp4") else {}))
    assert frames.ndim == 4 and frames.shape[0] > 5  # the reset frame and one per step


@pytest.fixture(scope="module")
def mujoco_run(tmp_path_factory):
    """A tiny SAC run on InvertedPendulum-v5 (a MuJoCo env) with a checkpoint."""
    root = tmp_path_factory.mktemp("mujoco")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        assert main(["train", "mujoco/sac", "--set", "env.env_id=InvertedPendulum-v5", "--set",
                     "env.evaluator_env_num=1", "--set", "env.n_evaluator_episode=1", "--set",
                     "policy.model.hidden_sizes=[8]", "--set", "policy.learn.learning_starts=16", "--set",
                     "policy.collect.random_collect_size=16", "--set", "policy.learn.batch_size=8", "--set",
                     "policy.eval.evaluator.eval_freq=32", "--set", "policy.other.replay_buffer.size=100",
                     "--max-env-step", "64", "--no-progress", "--exp-name", "sac"]) == 0
    return root / "runs" / "sac"


def test_eval_records_a_mujoco_episode_without_a_display(mujoco_run, tmp_path):
    out = tmp_path / "sac.mp4"
    done = run_conveyor(["conveyor", "eval", str(mujoco_run), "--episodes", "1", "--record", str(out)], tmp_path,
                        timeout=300, unset=("DISPLAY", "WAYLAND_DISPLAY", "MUJOCO_GL", "PYOPENGL_PLATFORM"))
    assert done.returncode == 0, done.stderr
    assert f"to {out}" in done.stdout
    import imageio.v3 as iio
    assert iio.imread(out, index=None, plugin="FFMPEG").shape[0] > 1


def test_eval_refuses_to_record_mujoco_without_a_display_or_offscreen_renderer(mujoco_run, tmp_path):
    out = tmp_path / "sac.mp4"
    done = run_conveyor(["conveyor", "eval", str(mujoco_run), "--episodes", "1", "--record", str(out)], tmp_path,
                        timeout=300, env={"MUJOCO_GL": "glfw"}, unset=("DISPLAY", "WAYLAND_DISPLAY"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("conveyor: error: --record: rendering InvertedPendulum-v5 without a display needs "
                                  "MuJoCo's EGL or OSMesa renderer") and done.stderr.count("\n") == 1, done.stderr
    assert not out.exists()


def test_eval_errors_are_one_line(runs, tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "ckpt").mkdir(parents=True)
    assert_usage_error(main(["eval", str(empty)]), capsys, "no checkpoint in", "eval_best.pth.tar")
    assert_usage_error(main(["eval", str(tmp_path / "nothing")]), capsys, "no run directory or checkpoint file at")
    config = runs / "dqn_s0" / "config.json"
    assert_usage_error(main(["eval", str(config)]), capsys, f"{config} is a run's config, not a checkpoint: pass the "
                       f"run directory ({runs / 'dqn_s0'}) or a .pth.tar checkpoint")
    broken = tmp_path / "broken"
    (broken / "ckpt").mkdir(parents=True)
    (broken / "ckpt" / "final.pth.tar").write_bytes((runs / "dqn_s0" / "ckpt" / "final.pth.tar").read_bytes())
    (broken / "config.json").write_text("{not json")
    assert_usage_error(main(["eval", str(broken)]), capsys, f"{broken / 'config.json'} is unreadable")
    (broken / "config.json").write_text((runs / "dqn_s0" / "config.json").read_text())
    (broken / "ckpt" / "final.pth.tar").write_bytes(b"not a checkpoint")
    assert_usage_error(main(["eval", str(broken)]), capsys, "cannot load", "into a DQNPolicy")
    assert_usage_error(main(["eval", str(runs / "dqn_s0"), "--record", "x.avi"]), capsys, "must end in .gif or .mp4")
    assert_usage_error(main(["eval", str(runs / "dqn_s0"), "--episodes", "0"]), capsys, "--episodes must be > 0")


def test_plot_aggregates_seeds_and_overlays_experiments(runs, tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert main(["plot", *(str(runs / name) for name in ("dqn_s0", "dqn_s1", "fast_s0")), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}: 2 experiments from 3 runs (eval/return against env_step)"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from conveyor.cli.plot import experiments, read_curve
    groups = experiments([read_curve(runs / name, "eval/return", "wall") for name in ("dqn_s0", "dqn_s1", "fast_s0")])
    assert {label: len(curves) for label, curves in groups.items()} == {"dqn_s0, dqn_s1: learning_rate=0.003": 2,
                                                                        "fast_s0: learning_rate=0.01": 1}


def test_plot_labels_curves_with_run_names_and_draws_the_stop_value_of_a_return(runs, tmp_path):
    from conveyor.cli.plot import draw, experiments, read_curve

    def legend(metric):
        curves = [read_curve(runs / name, metric, "env_step") for name in ("dqn_s0", "fast_s0")]
        axes = draw(experiments(curves), str(tmp_path / "c.png"), metric=metric).axes[0]
        dashed = [line.get_ydata()[0] for line in axes.get_lines() if line.get_linestyle() == "--"]
        return [text.get_text() for text in axes.get_legend().get_texts()], dashed

    assert legend("eval/return") == (["dqn_s0: learning_rate=0.003", "fast_s0: learning_rate=0.01",
                                      "stop value 475"], [475.0])
    labels, dashed = legend("eval/return_std")  # not a return: no stop value
    assert labels == ["dqn_s0: learning_rate=0.003", "fast_s0: learning_rate=0.01"] and dashed == []


def test_plot_errors_are_one_line(runs, tmp_path, capsys):
    assert_usage_error(main(["plot", str(runs / "dqn_s0"), "--metric", "eval/retrun"]), capsys,
                       "logged no 'eval/retrun': did you mean 'eval/return'?")
    assert_usage_error(main(["plot", str(tmp_path)]), capsys, "no TensorBoard event files in")
    assert_usage_error(main(["plot", str(tmp_path / "nothing")]), capsys, "no run directory at")
    assert_usage_error(main(["plot", str(runs / "dqn_s0"), "--out", "curves.txt"]), capsys, "must end in .png")
