"""Checkpoints: atomic writes, what CkptSaver saves and when, and restoring."""
import os

import pytest
import torch

from conveyor import OnlineRLContext, task
from conveyor.data import DequeBuffer
from conveyor.middleware import CkptSaver, load_checkpoint, restore, save_checkpoint


def test_save_checkpoint_round_trips_and_leaves_no_temporary_file(tmp_path):
    path = save_checkpoint(tmp_path / "a" / "ckpt.pth.tar", {"x": torch.arange(3), "n": 5})
    state = load_checkpoint(path)
    assert torch.equal(state["x"], torch.arange(3)) and state["n"] == 5
    assert os.listdir(path.parent) == ["ckpt.pth.tar"]


def test_a_failed_save_keeps_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "ckpt.pth.tar", {"version": 1})

    def crash(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"version": 2})
    monkeypatch.undo()
    assert load_checkpoint(path) == {"version": 1}
    assert os.listdir(tmp_path) == ["ckpt.pth.tar"]


def test_loading_a_missing_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="run training first"):
        load_checkpoint(tmp_path / "nope.pth.tar")


def test_ckpt_saver_saves_latest_every_train_freq_iterations_and_final_at_finish(tmp_path, policy):
    saves = []
    with task.start(ctx=OnlineRLContext()):
        def learner(ctx):
            ctx.train_iter += 4
            if ctx.train_iter >= 40:
                task.finish = True

        saver = CkptSaver(policy, tmp_path, train_freq=10)
        original = saver.save
        saver.save = lambda ctx, name, **kw: saves.append((name, ctx.train_iter)) or original(ctx, name, **kw)
        task.use(learner).use(saver)
        task.run()
    latest = [it for name, it in saves if name == "latest.pth.tar"]
    assert latest == [12, 24, 36, 40]
    assert ("final.pth.tar", 40) in saves
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["final.pth.tar", "latest.pth.tar"]


def test_ckpt_saver_keeps_the_best_evaluation(tmp_path, policy):
    saver = CkptSaver(policy, tmp_path)
    for value in (1.0, 3.0, 2.0):
        ctx = OnlineRLContext()
        ctx.eval_value = value
        ctx.train_iter = int(value)
        gen = saver(ctx)
        next(gen)
    assert load_checkpoint(tmp_path / "ckpt" / "eval_best.pth.tar")["ctx"]["train_iter"] == 3


def test_restore_brings_back_policy_counters_and_buffer(tmp_path, policy, cfg):
    from conveyor.policy import DQNPolicy
    buffer = DequeBuffer(10)
    buffer.push({"obs": torch.ones(4), "reward": 1.0})
    ctx = OnlineRLContext()
    ctx.env_step, ctx.train_iter = 1234, 56
    CkptSaver(policy, tmp_path, buffer=buffer).save(ctx, "latest.pth.tar")

    fresh_policy, fresh_ctx, fresh_buffer = DQNPolicy(cfg.policy), OnlineRLContext(), DequeBuffer(10)
    restore(tmp_path / "ckpt" / "latest.pth.tar", fresh_policy, fresh_ctx, fresh_buffer)
    assert (fresh_ctx.env_step, fresh_ctx.train_iter) == (1234, 56)
    assert len(fresh_buffer) == 1
    for a, b in zip(policy.state_dict()["model"].values(), fresh_policy.state_dict()["model"].values()):
        assert torch.equal(a, b)


def test_train_freq_must_be_positive(policy, tmp_path):
    with pytest.raises(ValueError, match="train_freq"):
        CkptSaver(policy, tmp_path, train_freq=0)
