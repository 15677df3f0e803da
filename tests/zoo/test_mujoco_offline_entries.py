"""mujoco/bc, mujoco/cql and mujoco/iql train a few hundred gradient steps on a tiny dataset that
`conveyor collect mujoco/sac --d4rl` generated, and their default dataset, when missing, names that command."""
import copy

import pytest

from conveyor.cli import main as cli
from conveyor.cli.d4rl import d4rl_dataset
from conveyor.middleware import load_checkpoint
from conveyor.zoo import load_entry

from ..test_cli_d4rl import TINY

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ENTRIES = ("mujoco/bc", "mujoco/cql", "mujoco/iql")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """A tiny Hopper medium-replay dataset (400 env steps of a small SAC run) in its own dataset folder."""
    root = tmp_path_factory.mktemp("datasets")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        path, _ = d4rl_dataset("mujoco/sac", "medium-replay", "Hopper-v5", max_env_step=400, target_return=1e9,
                               transitions=200, overrides=TINY, dataset_dir=root)
    return path


@pytest.mark.parametrize("name", ENTRIES)
def test_each_mujoco_offline_entry_trains_a_few_hundred_steps_on_a_generated_dataset(tmp_path, monkeypatch, datasets,
                                                                                     name):
    monkeypatch.chdir(tmp_path)
    entry = load_entry(name)
    cfg = copy.deepcopy(entry.main_config)
    cfg.env.update(env_id="Hopper-v5", evaluator_env_num=1, n_evaluator_episode=1)
    cfg.policy.model.hidden_sizes = [32, 32]
    cfg.policy.learn.batch_size = 32
    cfg.policy.eval.evaluator.eval_freq = 100
    cfg.policy.other.dataset.id = str(datasets)
    ctx = entry.main(cfg, max_train_iter=200, progress=False)
    assert ctx.train_iter == 200 and ctx.last_eval_iter == 100 and ctx.last_eval_value is not None
    final = load_checkpoint(tmp_path / "runs" / cfg.exp_name / "ckpt" / "final.pth.tar")
    assert final["objects"]["policy"]["counters"]["train_iter"] == 200


@pytest.mark.parametrize("name", ENTRIES)
def test_a_missing_mujoco_dataset_names_the_d4rl_command(tmp_path, monkeypatch, capsys, name):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "datasets"))
    assert cli(["train", name, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "conveyor/halfcheetah/medium-replay-s0-v0" in err
    assert "conveyor collect mujoco/sac --d4rl medium-replay --env HalfCheetah-v5" in err
