"""Checkpoints: atomic writes, consistent cuts of the pipeline, the best evaluation, disk errors."""
import errno
import os
import threading

import pytest
import torch

from conveyor import OnlineRLContext, task
from conveyor.data import DequeBuffer
from conveyor.middleware import CheckpointError, CkptSaver, load_checkpoint, restore, save_checkpoint
from conveyor.middleware import ckpt as ckpt_module


def test_save_checkpoint_round_trips_and_leaves_no_temporary_file(tmp_path):
    path = save_checkpoint(tmp_path / "a" / "ckpt.pth.tar", {"x": torch.arange(3), "n": 5})
    state = load_checkpoint(path)
    assert torch.equal(state["x"], torch.arange(3)) and state["n"] == 5
    assert os.listdir(path.parent) == ["ckpt.pth.tar"]


def test_a_full_disk_is_one_error_naming_the_path_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "ckpt.pth.tar", {"version": 1})
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd, mode):
            self.f = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(bytes(data)[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt_module.os, "fdopen", Full)
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(path, {"version": 2})
    monkeypatch.undo()
    assert str(caught.value) == f"cannot write checkpoint {path}: No space left on device"
    assert load_checkpoint(path) == {"version": 1}
    assert os.listdir(tmp_path) == ["ckpt.pth.tar"]


def _out_of_descriptors(monkeypatch, times):
    """Make the next ``times`` temporary files of a checkpoint write fail as a process out of descriptors does."""
    real_mkstemp, left = ckpt_module.tempfile.mkstemp, [times]

    def mkstemp(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_mkstemp(*args, **kwargs)
    monkeypatch.setattr(ckpt_module.tempfile, "mkstemp", mkstemp)


def test_a_write_that_finds_no_free_file_descriptor_is_retried_until_one_is_free(tmp_path, monkeypatch):
    _out_of_descriptors(monkeypatch, times=3)
    path = save_checkpoint(tmp_path / "ckpt.pth.tar", {"version": 1})
    assert load_checkpoint(path) == {"version": 1}
    assert os.listdir(tmp_path) == ["ckpt.pth.tar"]


def test_a_write_that_never_finds_a_file_descriptor_is_one_error_naming_the_path(tmp_path, monkeypatch):
    _out_of_descriptors(monkeypatch, times=1 << 30)
    monkeypatch.setattr(ckpt_module, "FD_RETRY_S", 0.1)
    path = tmp_path / "ckpt.pth.tar"
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(path, {"version": 1})
    assert str(caught.value) == f"cannot write checkpoint {path}: Too many open files"


def test_a_file_where_the_folder_should_be_is_one_error_naming_the_path(tmp_path):
    (tmp_path / "runs").write_text("not a folder")
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*runs/x/ckpt.pth.tar: (File exists|Not a d)"):
        save_checkpoint(tmp_path / "runs" / "x" / "ckpt.pth.tar", {})


def test_loading_a_missing_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="run training first"):
        load_checkpoint(tmp_path / "nope.pth.tar")


def test_a_new_saver_removes_the_temporary_files_of_a_killed_write(tmp_path, policy):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".latest.pth.tar.k2j3.tmp").write_bytes(b"half")
    (tmp_path / "ckpt" / "latest.pth.tar").write_bytes(b"kept")
    CkptSaver(policy, tmp_path)
    assert os.listdir(tmp_path / "ckpt") == ["latest.pth.tar"]


class Counter:
    """A stateful middleware: counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, ctx):
        self.calls += 1

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_ckpt_saver_writes_the_whole_pipeline_every_train_freq_iterations_and_at_the_end(tmp_path, policy):
    written = []
    with task.start(ctx=OnlineRLContext()):
        task.register_state("policy", policy)

        def learner(ctx):
            ctx.train_iter += 4
            if ctx.train_iter >= 40:
                task.finish = True

        counter = Counter()
        saver = CkptSaver(policy, tmp_path, train_freq=10, meta={"policy": "DQNPolicy"})
        original = saver.save
        saver.save = lambda *names, state=None: written.append((names, task.ctx.train_iter)) or \
            original(*names, state=state)
        task.use(counter).use(learner).use(saver)
        task.run()
    assert written == [(("latest.pth.tar",), 12), (("latest.pth.tar",), 24), (("latest.pth.tar",), 36),
                       (("final.pth.tar", "latest.pth.tar"), 40)]
    final = load_checkpoint(tmp_path / "ckpt" / "final.pth.tar")
    assert final["ctx"]["train_iter"] == 40 and final["ctx"]["total_step"] == 10
    assert list(final["middleware"].values()) == [{"calls": 10}, {"best": None, "last_save_iter": 36}]
    assert set(final["objects"]) == {"policy"} and final["meta"]["policy"] == "DQNPolicy"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["final.pth.tar", "latest.pth.tar"]


class Tally:
    """A registered object counting what middleware did (a policy's train_iter, a buffer's pushes)."""

    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()

    def add(self, n):
        with self.lock:
            self.count += n

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_async_checkpoints_are_consistent_cuts(tmp_path, policy, monkeypatch):
    saved = []
    monkeypatch.setattr(ckpt_module, "save_checkpoint", lambda path, state: saved.append(state) or path)
    pushed, trained = Tally(), Tally()

    def collect(ctx):
        ctx.env_step += 8
        pushed.add(8)

    def learn(ctx):
        yield
        ctx.train_iter += 2
        trained.add(2)

    with task.start(async_mode=True, ctx=OnlineRLContext(), max_inflight=3):
        task.register_state("buffer", pushed)
        task.register_state("policy", trained)
        task.use(collect).use(learn).use(CkptSaver(policy, tmp_path, train_freq=2))
        task.run(max_step=40)
    assert len({state["ctx"]["total_step"] for state in saved}) >= 10  # taken all along the run
    for state in saved:
        assert state["ctx"]["env_step"] == state["objects"]["buffer"]["count"] == 8 * state["ctx"]["total_step"]
        assert state["ctx"]["train_iter"] == state["objects"]["policy"]["count"] == 2 * state["ctx"]["total_step"]


def test_ckpt_saver_writes_latest_on_a_wall_clock_interval(tmp_path, policy, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(ckpt_module.time, "monotonic", lambda: clock[0])
    with task.start(ctx=OnlineRLContext()):
        saver = CkptSaver(policy, tmp_path, interval_s=60, save_finish=False)

        def tick(ctx):
            clock[0] += 25.0

        task.use(tick).use(saver)
        task.run(max_step=2)
        assert not (tmp_path / "ckpt" / "latest.pth.tar").exists()
        task.run(max_step=1)  # 75 s since the saver started
        assert load_checkpoint(tmp_path / "ckpt" / "latest.pth.tar")["ctx"]["total_step"] == 3


class Snapshot:
    def __init__(self, weight, version):
        self.weight, self.version = weight, version

    def state_dict(self):
        return {"weight": torch.tensor(self.weight)}


def evaluation(mean, snapshot, **extra):
    return {"returns": [mean], "lengths": [1], "mean": mean, "std": 0.0, "env_step": 0, "train_iter": 0,
            "weight_version": snapshot.version, "crashes": 0, "dropped": 0, "snapshot": snapshot, **extra}


def test_eval_best_holds_the_evaluated_snapshot_and_only_improves(tmp_path, policy):
    saver = CkptSaver(policy, tmp_path)
    with task.start(ctx=OnlineRLContext()):
        for mean, weight in ((1.0, 10.0), (3.0, 30.0), (2.0, 20.0)):
            ctx = OnlineRLContext()
            ctx.eval_output = evaluation(mean, Snapshot(weight, int(weight)))
            saver(ctx)
    best = load_checkpoint(tmp_path / "ckpt" / "eval_best.pth.tar")
    assert best["policy"]["weight"].item() == 30.0 and best["eval"]["mean"] == 3.0
    assert best["eval"]["weight_version"] == 30 and "snapshot" not in best["eval"]


def test_a_restored_saver_does_not_overwrite_a_better_eval_best(tmp_path, policy):
    saver = CkptSaver(policy, tmp_path)
    saver.load_state_dict({"best": 500.0, "last_save_iter": 0})
    with task.start(ctx=OnlineRLContext()):
        ctx = OnlineRLContext()
        ctx.eval_output = evaluation(9.9, Snapshot(1.0, 1))
        saver(ctx)
    assert not (tmp_path / "ckpt" / "eval_best.pth.tar").exists()


def test_restore_brings_back_policy_counters_and_buffer(tmp_path, policy, cfg):
    from conveyor.policy import DQNPolicy
    buffer = DequeBuffer(10)
    buffer.push({"obs": torch.ones(4), "reward": 1.0})
    with task.start(ctx=OnlineRLContext()):
        task.register_state("policy", policy)
        task.register_state("buffer", buffer)
        task.ctx.env_step, task.ctx.train_iter = 1234, 56
        CkptSaver(policy, tmp_path).save("latest.pth.tar")

    fresh_policy, fresh_ctx, fresh_buffer = DQNPolicy(cfg.policy), OnlineRLContext(), DequeBuffer(10)
    restore(tmp_path / "ckpt" / "latest.pth.tar", fresh_policy, fresh_ctx, fresh_buffer)
    assert (fresh_ctx.env_step, fresh_ctx.train_iter) == (1234, 56)
    assert len(fresh_buffer) == 1
    for a, b in zip(policy.state_dict()["model"].values(), fresh_policy.state_dict()["model"].values()):
        assert torch.equal(a, b)


def test_train_freq_must_be_positive(policy, tmp_path):
    with pytest.raises(ValueError, match="train_freq"):
        CkptSaver(policy, tmp_path, train_freq=0)
