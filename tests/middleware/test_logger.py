"""Loggers: TensorBoard scalars, wandb, and the progress bar."""
import struct
import sys
import types

from tensorboardX.proto import event_pb2

from conveyor import OnlineRLContext, task
from conveyor.middleware import EPISODE_EVENT, EVAL_EVENT, online_logger, progress_bar, wandb_online_logger


def read_scalars(logdir):
    """Every (tag, step, value) in the TensorBoard event files under logdir."""
    out = []
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.append((value.tag, event.step, value.simple_value))
    return out


def evaluation(mean, ctx, crashes=0, dropped=0):
    """An evaluator's EVAL_EVENT result."""
    return {"mean": mean, "std": 1.0, "crashes": crashes, "dropped": dropped, "env_step": ctx.env_step,
            "train_iter": ctx.train_iter}


def pipeline(logger_mw, iterations=3):
    with task.start(ctx=OnlineRLContext()):
        def fake_iteration(ctx):
            ctx.env_step += 100
            ctx.train_iter += 1
            ctx.train_output = [{"losses/td": 0.5, "charts/q_mean": 2.0}]
            if ctx.total_step == 0:
                task.emit(EVAL_EVENT, evaluation(42.0, ctx, crashes=2, dropped=1))
                task.emit(EPISODE_EVENT, 0, 10.0, 10)
        task.use(fake_iteration).use(logger_mw)
        task.run(max_step=iterations)


def test_online_logger_writes_eval_return_losses_throughput_and_middleware_time(tmp_path):
    pipeline(online_logger(str(tmp_path), train_show_freq=1))
    scalars = read_scalars(tmp_path)
    tags = {tag for tag, _, _ in scalars}
    assert {("eval/return", 100, 42.0), ("eval/return_std", 100, 1.0), ("eval/crashes", 100, 2.0),
            ("eval/dropped", 100, 1.0)} <= set(scalars)
    assert {"losses/td", "charts/q_mean", "charts/env_steps_per_s", "charts/episode_return",
            "time/fake_iteration_ms"} <= tags
    assert [v for tag, _, v in scalars if tag == "losses/td"] == [0.5, 0.5, 0.5]


def test_online_logger_steps_eval_return_at_the_env_step_the_evaluation_was_taken_at(tmp_path):
    with task.start(ctx=OnlineRLContext()):
        def evaluate_then_collect(ctx):
            if ctx.total_step == 1:
                task.emit(EVAL_EVENT, evaluation(7.0, ctx))
            ctx.env_step += 100
            ctx.train_iter += 1
        task.use(evaluate_then_collect).use(online_logger(str(tmp_path), record_train_iter=True))
        task.run(max_step=3)
    scalars = read_scalars(tmp_path)
    assert ("eval/return", 100, 7.0) in scalars and ("eval/return_iter", 1, 7.0) in scalars


def test_an_evaluation_that_ends_its_iteration_at_the_stop_value_is_logged(tmp_path):
    with task.start(ctx=OnlineRLContext()):
        def evaluator(ctx):
            ctx.env_step += 100
            if ctx.total_step == 1:
                task.emit(EVAL_EVENT, evaluation(500.0, ctx))
                task.finish = True
                task.end_iteration()  # the logger is not entered in this iteration
        task.use(evaluator).use(online_logger(str(tmp_path)))
        task.run(max_step=5)
    assert ("eval/return", 200, 500.0) in read_scalars(tmp_path)


def test_two_runs_in_one_start_block_both_reach_the_event_file(tmp_path):
    with task.start(ctx=OnlineRLContext()):
        def step(ctx):
            ctx.env_step += 100
            ctx.train_iter += 1
            ctx.train_output = {"losses/td": float(ctx.total_step)}
        task.use(step).use(online_logger(str(tmp_path), train_show_freq=1))
        task.run(max_step=2)
        task.run(max_step=2)
    assert [(s, v) for tag, s, v in read_scalars(tmp_path) if tag == "losses/td"] == \
        [(100, 0.0), (200, 1.0), (300, 2.0), (400, 3.0)]
    assert len(list(tmp_path.rglob("events.out.tfevents.*"))) == 1


def test_online_logger_averages_between_shows(tmp_path):
    pipeline(online_logger(str(tmp_path), train_show_freq=100), iterations=4)
    steps = [step for tag, step, _ in read_scalars(tmp_path) if tag == "losses/td"]
    assert steps == [100]  # shown at the first iteration, then not again within 100 train iterations


def test_wandb_logger_logs_the_same_scalars(monkeypatch):
    logged = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: types.SimpleNamespace(log=lambda d, step: logged.append((step, d)),
                                                       finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    pipeline(wandb_online_logger(project="test", train_show_freq=1))
    assert (100, {"eval/return": 42.0, "eval/return_std": 1.0, "eval/crashes": 2.0, "eval/dropped": 1.0,
                  "train_iter": 1}) in logged
    assert any(step == 100 and "losses/td" in scalars for step, scalars in logged)


def test_wandb_logger_without_wandb_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    try:
        wandb_online_logger(project="x")
    except ImportError as exc:
        assert "pip install wandb" in str(exc)
    else:
        raise AssertionError("expected ImportError")


def test_progress_bar_follows_env_steps_eval_return_and_eval_crashes():
    class FakeBar:
        def __init__(self, **kwargs):
            self.n, self.postfix, self.closed = 0, {}, False

        def update(self, k):
            self.n += k

        def set_postfix(self, refresh=True, **kw):
            self.postfix = kw

        def refresh(self):
            pass

        def close(self):
            self.closed = True

    bars = []
    with task.start(ctx=OnlineRLContext()):
        def step(ctx):
            ctx.env_step += 10
            task.emit(EVAL_EVENT, evaluation(7.0, ctx))
        task.use(step).use(progress_bar(100, make_bar=lambda **kw: bars.append(FakeBar(**kw)) or bars[-1]))
        task.run(max_step=2)
        assert bars[0].postfix == {"eval_return": "7.0"}
        task.emit(EVAL_EVENT, evaluation(8.0, task.ctx, crashes=3, dropped=2))
        assert bars[0].postfix == {"eval_return": "8.0", "eval_crashes": 3, "eval_dropped": 2}
        task.run(max_step=1)
        assert not bars[0].closed  # lives as long as the pipeline
    assert bars[0].n == 30 and bars[0].closed


def test_a_teams_evaluation_logs_each_agents_return_and_a_malformed_list_from_a_peer_logs_none():
    from conveyor.middleware.logger import MAX_AGENTS_LOGGED, eval_scalars
    result = {"mean": -30.0, "std": 1.0, "agent_mean": [-10.0, -11.0, -9.0]}
    assert {k: v for k, v in eval_scalars(result).items() if k.startswith("eval/agent")} == {
        "eval/agent_return/0": -10.0, "eval/agent_return/1": -11.0, "eval/agent_return/2": -9.0}
    for hostile in ("-1", [float("nan")], [True], [{"a": 1}], [0.0] * (MAX_AGENTS_LOGGED + 1)):
        scalars = eval_scalars({**result, "agent_mean": hostile})
        assert scalars["eval/return"] == -30.0 and not any(k.startswith("eval/agent") for k in scalars)
