"""Data-parallel learners in the zoo's distributed layout (``--learners L``): one group, rank 0 owns the run."""
import copy
import json
import time
from pathlib import Path

import pytest
import torch
import treetensor.torch as ttorch

from conveyor.cli import main as cli_main
from conveyor.engine import Role
from conveyor.middleware import load_checkpoint
from conveyor.schema import ConfigError
from conveyor.zoo import load_entry
from conveyor.run import Layout, train_distributed
from conveyor.middleware.distributed import COLLECTOR_LEAD
from conveyor.run.learners import check_learner_gpus, learner_device, learner_local_rank, newest_rows
from tests.zoo.test_distributed import sigterm_after_a_first_evaluation

RANK1_DIES = str(Path(__file__).with_name("_rank1_dies_entry.py"))
DIED_AT = "rank1_died_at"  # the file _rank1_dies_entry.py writes (its DIED_AT)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_learners_come_first_and_each_collector_sends_to_one_learner():
    layout = Layout(collectors=3, evaluators=1, learners=2)
    assert [layout.role(i) for i in range(layout.n_nodes)] == [Role.LEARNER, Role.LEARNER, Role.COLLECTOR,
                                                               Role.COLLECTOR, Role.COLLECTOR, Role.EVALUATOR]
    assert [layout.learner_of(i) for i in range(5)] == [0, 1, 0, 1, 0]
    assert layout.roles(0) == [Role.LEARNER] and Layout(2, 0, 2).roles(0) == [Role.LEARNER, Role.EVALUATOR]
    assert Layout(2, 0, 2).roles(1) == [Role.LEARNER]  # only rank 0 evaluates
    # collectors and evaluators seed as with one learner
    assert [Layout(2, 2, 2).seed_offset(i) for i in range(6)] == [0, 0, 1, 2, 0, 1]
    with pytest.raises(ConfigError, match="nodes 0..5"):
        layout.role(6)


@pytest.mark.parametrize("learners", [0, -1, True, 1.5])
def test_a_bad_learner_count_is_a_config_error(learners):
    with pytest.raises(ConfigError, match=f"--learners {learners!r}: must be an int >= 1"):
        Layout(collectors=2, learners=learners)


def test_a_learner_without_a_collector_of_its_own_is_a_config_error():
    with pytest.raises(ConfigError, match="--learners 3 with --collectors 2: .* at least as many collectors"):
        Layout(collectors=2, learners=3)


@pytest.mark.parametrize("argv, fragment", [
    (["cartpole/dqn", "--collectors", "2", "--learners", "0"], "--learners 0: must be an int >= 1"),
    (["cartpole/ppo", "--collectors", "3", "--learners", "3"], "batch_size (256) must be a multiple of the learners"),
    (["cartpole/dqn", "--collectors", "2", "--learners", "2", "--auto-recover"], "cannot rejoin"),
    (["cartpole/dqn", "--learners", "2"], "needs --collectors"),
])
def test_bad_learner_flags_are_one_line_errors_before_any_process_starts(in_tmp, capsys, argv, fragment):
    assert cli_main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
    assert not (in_tmp / "runs").exists()


def test_job_writers_place_the_learners_first_and_pass_them_to_every_node(capsys):
    assert cli_main(["slurm-script", "cartpole/dqn", "--learners", "2", "--collectors", "3", "--evaluators", "1",
                     "--nodes", "2"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --ntasks=6" in script and "conveyor train cartpole/dqn --collectors 3 --learners 2" in script
    assert cli_main(["k8s-manifest", "cartpole/dqn", "--learners", "2", "--collectors", "2", "--image", "c:1"]) == 0
    manifest = capsys.readouterr().out
    assert "completions: 4" in manifest and "--learners" in manifest
    assert cli_main(["slurm-script", "cartpole/ppo", "--learners", "2", "--collectors", "2", "--nodes", "1"]) == 0
    assert "conveyor train cartpole/ppo --collectors 2 --learners 2" in capsys.readouterr().out


def test_resuming_several_learners_is_refused_in_one_line(in_tmp, capsys):
    assert cli_main(["train", "cartpole/dqn", "--collectors", "2", "--learners", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "cannot be resumed yet" in err and err.count("\n") == 1


def test_a_run_that_two_learners_trained_is_not_resumed_by_one(in_tmp, capsys):
    run_dir = in_tmp / "runs" / "cartpole_dqn"
    run_dir.mkdir(parents=True)
    (run_dir / "nodes.json").write_text(json.dumps([{"node_id": i, "roles": roles} for i, roles in enumerate(
        [["evaluator", "learner"], ["learner"], ["collector"], ["collector"]])]))
    assert cli_main(["train", "cartpole/dqn", "--collectors", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "2 data-parallel learners trained it" in err and err.count("\n") == 1


@pytest.mark.slow
def test_two_learners_train_one_policy_on_disjoint_shares_and_rank0_alone_writes(in_tmp):
    run = train_distributed(load_entry("cartpole/dqn"), learners=2, collectors=2, evaluators=1, exp_name="dp",
                            max_env_step=600, progress=False)
    learners = sorted((n for n in run.nodes if n["role"] == "learner"), key=lambda n: n["rank"])
    collectors = {str(n["node_id"]): n for n in run.nodes if n["role"] == "collector"}
    assert [n["rank"] for n in learners] == [0, 1] and sorted(collectors) == ["2", "3"]
    # one group: the same weights and optimizer state, the same gradient steps, the run's env steps on both
    assert learners[0]["params_sha256"] == learners[1]["params_sha256"]
    assert learners[0]["train_iter"] == learners[1]["train_iter"] == run.train_iter > 0
    assert learners[0]["env_step"] == learners[1]["env_step"] == run.env_step >= 600
    # collector 2 (the first) sends to rank 0 only, collector 3 to rank 1 only: nothing received twice
    assert list(learners[0]["received_from"]) == ["2"] and list(learners[1]["received_from"]) == ["3"]
    # the run trained on what the learners received, but for the batch a learner took as the run ended (at most
    # COLLECTOR_LEAD + 1 = 3 batches of 16, a collector's n_sample), and they received what their collector
    # collected, but for what was in flight then: the batches a collector may run ahead of its learner
    # (COLLECTOR_LEAD; the learner's last counters say stop, so they give no more), the one it was collecting as
    # the learner took its last batches, and the rows its n-step enhancer still held (nstep of each of its 4 envs)
    assert run.env_step <= sum(n["received"] for n in learners) <= run.env_step + 2 * 3 * 16
    for learner in learners:
        collected = collectors[str(learner["rank"] + 2)]["collected"]
        assert 0 < learner["received"] <= collected <= learner["received"] + (COLLECTOR_LEAD + 2) * 16
    rows = json.loads((in_tmp / "runs" / "dp" / "nodes.json").read_text())
    assert [(r["node_id"], r["roles"]) for r in rows] == [(0, ["learner"]), (1, ["learner"]), (2, ["collector"]),
                                                          (3, ["collector"]), (4, ["evaluator"])]
    assert run.last_eval_value is not None  # the evaluator node's results reach rank 0
    assert sorted(p.name for p in (in_tmp / "runs").iterdir()) == ["dp"]  # rank 1 made no run directory
    final = load_checkpoint(in_tmp / "runs" / "dp" / "ckpt" / "final.pth.tar")
    assert final["ctx"]["env_step"] == run.env_step
    log = (in_tmp / "runs" / "dp" / "log.txt").read_text()
    assert log.count("run 'dp' started") == 1  # rank 1 shares the working directory, and wrote no log
    assert len(list((in_tmp / "runs" / "dp" / "tb").iterdir())) == 1  # nor TensorBoard events (its tail: no saver)


@pytest.mark.slow
def test_without_evaluator_nodes_rank0_evaluates_and_the_stop_value_ends_every_learner_at_once(in_tmp):
    cfg = copy.deepcopy(load_entry("cartpole/dqn").main_config)
    cfg.env.stop_value = 0.0  # the first evaluation reaches it
    run = train_distributed(load_entry("cartpole/dqn"), learners=2, collectors=2, cfg=cfg, exp_name="dpstop",
                            max_env_step=10**6, progress=False)
    learners = [n for n in run.nodes if n["role"] == "learner"]
    assert run.last_eval_value is not None and run.env_step < 10**6
    assert learners[0]["params_sha256"] == learners[1]["params_sha256"]
    assert learners[0]["train_iter"] == learners[1]["train_iter"]
    final = load_checkpoint(in_tmp / "runs" / "dpstop" / "ckpt" / "final.pth.tar")
    assert final["ctx"]["last_eval_value"] == run.last_eval_value


@pytest.mark.slow
def test_a_killed_learner_ends_the_run_with_a_clear_error_and_rank0s_final_checkpoint(in_tmp):
    from conveyor.policy import DataParallelError
    with pytest.raises(DataParallelError, match=r"node 0 \(learner rank 0\): the learners' group failed, so this "
                                                r"learner ended its run and wrote its final checkpoint: .*all-reduce"):
        train_distributed(load_entry(RANK1_DIES), learners=2, collectors=2, exp_name="dpdies", max_env_step=10**6,
                          progress=False)
    # not ended by a wait running out (the group's timeout is 120 s): counted from the death, not from the launch,
    # whose start alone took 30-60 s at load 15-30
    assert time.monotonic() - float((in_tmp / DIED_AT).read_text()) < 60
    final = load_checkpoint(in_tmp / "runs" / "dpdies" / "ckpt" / "final.pth.tar")
    assert 400 <= final["ctx"]["env_step"] < 10**6


@pytest.mark.slow
def test_sigterm_to_conveyor_train_with_two_learners_writes_rank0s_final_checkpoint_and_leaves_no_process(in_tmp):
    assert sigterm_after_a_first_evaluation(in_tmp, "dpsig", "--learners", "2")["ctx"]["env_step"] > 0


def test_a_learner_of_several_takes_the_gpu_of_its_local_rank_for_a_plain_cuda():
    def two_gpus() -> int:
        return 2
    assert [learner_device("cuda", r, two_gpus) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert learner_device("cuda", 1, lambda: 0) == "cuda"  # no GPU seen: the policy refuses 'cuda' itself


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_a_cpu_or_an_indexed_device_stays_as_configured_and_cuda_is_not_asked(device):
    def no_cuda_here() -> int:
        raise AssertionError("torch.cuda asked for a device that is not a plain 'cuda'")
    assert learner_device(device, 3, no_cuda_here) == device


def test_more_cuda_learners_on_a_host_than_its_gpus_are_refused_before_any_start(in_tmp):
    check_learner_gpus("cuda", 2, lambda: 2)  # one GPU each
    check_learner_gpus("cuda:0", 1, lambda: 1)
    with pytest.raises(ConfigError, match="torch sees 1 GPU.*start at most 1 learner"):
        check_learner_gpus("cuda", 2, lambda: 1)
    with pytest.raises(ConfigError, match="all on policy.device='cuda:0'.*set policy.device=cuda"):
        check_learner_gpus("cuda:0", 2, lambda: 8)
    if torch.cuda.device_count() < 2:  # what a launch on this machine says, before any process starts
        cfg = copy.deepcopy(load_entry("cartpole/dqn").main_config)
        cfg.policy.device = "cuda"
        with pytest.raises(ConfigError, match="NCCL needs one GPU per learner"):
            train_distributed(load_entry("cartpole/dqn"), collectors=2, learners=2, cfg=cfg, exp_name="gpus", progress=False)
        assert not (in_tmp / "runs" / "gpus").exists()


def test_the_local_rank_is_the_launchers_index_of_the_learners_it_started_else_slurms():
    slurm = {"SLURM_LOCALID": "1"}
    assert [learner_local_rank(i, [0, 1, 2, 3], 2, {}) for i in (0, 1)] == [0, 1]  # the local launcher: every node
    assert learner_local_rank(3, [3, 4, 5], 4, slurm) == 0  # one host's --node-ids: Slurm's id is the launch's
    assert learner_local_rank(5, [5], 8, slurm) == 1  # one Slurm task per node
    assert learner_local_rank(5, [5], 8, {}) == 0 and learner_local_rank(5, [5], 8, {"SLURM_LOCALID": "x"}) == 0


def test_learners_keep_the_newest_rows_and_count_the_env_steps_of_the_older_ones_they_drop():
    unrolls = ttorch.Tensor({"reward": torch.arange(12.0).reshape(4, 3), "obs": torch.zeros(4, 3, 2)})  # [n, T]
    kept, dropped = newest_rows(unrolls, 1)
    assert torch.equal(kept.reward, unrolls.reward[3:]) and kept.obs.shape == (1, 3, 2) and dropped == 3 * 3
    assert newest_rows(unrolls, 4) == (unrolls, 0) and newest_rows(None, 0) == (None, 0)
    assert newest_rows(unrolls, 0) == (None, 12)
    mask = torch.tensor([[True, True, True], [True, False, True]])  # a recurrent policy's sequences [L = 2, B = 3]
    sequences = ttorch.Tensor({"reward": torch.arange(6.0).reshape(2, 3), "mask": mask, "episode_start": ~mask})
    kept, dropped = newest_rows(sequences, 2)  # the last two sequences, side by side; the padding step not counted
    assert torch.equal(kept.reward, sequences.reward[:, 1:]) and dropped == 2


def _learners(run):
    return sorted((n for n in run.nodes if n["role"] == "learner"), key=lambda n: n["rank"])


@pytest.mark.slow
@pytest.mark.parametrize("entry, collectors", [("cartpole/impala", 2), ("cartpole/ppo", 3),
                                               ("cartpole_masked/ppo_gru", 2)])
def test_two_learners_train_an_on_policy_entry_in_step_and_rank0_alone_writes(in_tmp, entry, collectors):
    """cartpole/ppo runs with 3 collectors only: every assertion of a 2-collector run holds there too, and rank 0,
    fed by two collectors, must also drop what rank 1 lacks."""
    exp = entry.replace("/", "_")
    run = train_distributed(load_entry(entry), learners=2, collectors=collectors, exp_name=exp, max_env_step=2048,
                            progress=False)
    learners = _learners(run)
    assert learners[0]["params_sha256"] == learners[1]["params_sha256"]  # weights, optimizer, normalisers
    assert learners[0]["train_iter"] == learners[1]["train_iter"] == run.train_iter > 0
    assert learners[0]["env_step"] == learners[1]["env_step"] == run.env_step >= 2048
    assert [sorted(n["received_from"]) for n in learners] == [["2", "4"][:collectors - 1], ["3"]]
    # each trained on as many env steps (the newest rows of each iteration); the older rows a learner received
    # beyond what the other did were dropped and counted, never kept for later; the run's counter holds them all
    assert learners[0]["kept"] == learners[1]["kept"] > 0
    assert all(n["kept"] + n["dropped"] <= n["received"] for n in learners)  # but for the last iteration's
    assert run.env_step <= sum(n["received"] for n in learners)
    if collectors == 3:  # rank 0 is fed by two collectors, rank 1 by one: rank 0 drops what rank 1 lacks
        assert learners[0]["dropped"] > 0 and learners[0]["received"] > learners[1]["received"]
    assert sorted(p.name for p in (in_tmp / "runs").iterdir()) == [exp]  # rank 1 made no run directory
    final = load_checkpoint(in_tmp / "runs" / exp / "ckpt" / "final.pth.tar")
    assert final["ctx"]["env_step"] == run.env_step and final["ctx"]["train_iter"] == run.train_iter
