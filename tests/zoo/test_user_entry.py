"""A user's own entry file, outside the package and importing only public names, trains, resumes, runs in
async mode and distributed, as a zoo entry does."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conveyor import task
from conveyor.middleware import load_checkpoint
from conveyor.policy import DQNPolicy
from conveyor.run import Run, train_distributed
from conveyor.zoo import load_entry

ROOT = Path(__file__).resolve().parents[2]

ENTRY = '''
"""DQN on CartPole, written by a user: the pipeline in full, each middleware with its role."""
from easydict import EasyDict

from conveyor import OnlineRLContext, task
from conveyor.middleware import OffPolicyLearner, StepCollector, data_pusher, eps_greedy_handler, interaction_evaluator
from conveyor.policy import DQNPolicy
from conveyor.run import Run

main_config = EasyDict(dict(
    exp_name="mine",
    env=dict(env_id="CartPole-v1", collector_env_num=2, evaluator_env_num=2, n_evaluator_episode=2),
    policy=dict(model=dict(hidden_sizes=[8]), learn=dict(batch_size=16, update_per_collect=2),
                collect=dict(n_sample=16), eval=dict(evaluator=dict(eval_freq=50)),
                other=dict(replay_buffer=dict(size=500))),
))


def pipeline(run: Run) -> None:
    cfg, policy = run.cfg, run.policy
    buffer = run.buffer()
    print("collector envs:", repr(run.env("collector")))
    task.use(interaction_evaluator(cfg, policy.eval_mode, run.env("evaluator")), role=task.role.EVALUATOR)
    task.use(eps_greedy_handler(cfg), role=task.role.COLLECTOR)
    task.use(StepCollector(cfg, policy.collect_mode, run.env("collector")), role=task.role.COLLECTOR)
    task.use(data_pusher(cfg, buffer), role=task.role.LEARNER)
    task.use(OffPolicyLearner(cfg, policy.learn_mode, buffer), role=task.role.LEARNER)


def main(cfg=None, **options) -> OnlineRLContext:
    return Run(pipeline, main_config, DQNPolicy, cfg, **options).train()
'''


@pytest.fixture
def entry_file(tmp_path, monkeypatch):
    """The entry file in its own folder; the runs go to another (the working directory)."""
    (tmp_path / "user").mkdir()
    path = tmp_path / "user" / "my_dqn.py"
    path.write_text(textwrap.dedent(ENTRY))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return path


def private_imports(source: str):
    return [line for line in source.splitlines() if line.startswith(("from", "import")) and "._" in line]


def test_the_entry_imports_no_private_module(entry_file):
    assert private_imports(entry_file.read_text()) == []


def test_a_users_entry_trains_and_resumes(entry_file, capsys):
    entry = load_entry(str(entry_file))
    first = entry.main(max_env_step=64, progress=False)
    assert capsys.readouterr().out == "collector envs: <SyncEnvManager CartPole-v1 x2>\n"  # started here
    second = entry.main(max_env_step=128, resume=True, progress=False)
    assert first.env_step >= 64 and second.env_step >= 128 and second.train_iter > first.train_iter
    run = Path("runs") / "mine"
    assert load_checkpoint(run / "ckpt" / "final.pth.tar")["ctx"]["env_step"] == second.env_step
    assert "run 'mine' resumed" in (run / "log.txt").read_text()


def test_a_users_entry_trains_in_async_mode_with_its_collector_envs_only_in_the_collector_process(entry_file, capsys):
    ctx = load_entry(str(entry_file)).main(max_env_step=64, async_mode=True, progress=False)
    assert ctx.env_step >= 64 and ctx.train_iter > 0
    assert capsys.readouterr().out == "collector envs: <collector envs of another process (2)>\n"


def test_an_async_runs_collector_process_builds_its_chain_from_the_pipeline_without_calling_main(entry_file, capsys):
    entry_file.write_text(entry_file.read_text() + textwrap.dedent('''
        def main(cfg=None, **options):
            with open("main_calls.txt", "a") as calls:
                calls.write("main\\n")
            return Run(pipeline, main_config, DQNPolicy, cfg, **options).train()
        '''))
    ctx = load_entry(str(entry_file)).main(max_env_step=64, async_mode=True, progress=False)
    assert ctx.env_step >= 64 and Path("main_calls.txt").read_text() == "main\n"
    assert capsys.readouterr().out == "collector envs: <collector envs of another process (2)>\n"


class Tally:
    """A count that must survive a resume (``state_dict`` / ``load_state_dict``), kept by :func:`counting`."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state) -> None:
        self.n = state["n"]


def counted(entry, tally: Tally, saved: bool):
    """The entry's pipeline and a middleware counting iterations in ``tally``, saved in checkpoints if ``saved``."""
    def pipeline(run: Run) -> None:
        entry.pipeline(run)
        task.use(lambda ctx: setattr(tally, "n", tally.n + 1))
        if saved:
            run.save_state("count", tally, optional=True)
    return pipeline


def test_a_state_saved_as_optional_starts_afresh_when_the_checkpoint_resumed_was_written_before_it(entry_file,
                                                                                                   caplog):
    entry, first, second, third = load_entry(str(entry_file)), Tally(), Tally(), Tally()
    final = Path("runs") / "mine" / "ckpt" / "final.pth.tar"
    Run(counted(entry, first, saved=False), entry.main_config, DQNPolicy, max_env_step=64, progress=False).train()
    steps = [load_checkpoint(final)["ctx"]["total_step"]]
    Run(counted(entry, second, saved=True), entry.main_config, DQNPolicy, max_env_step=128, resume=True,
        progress=False).train()
    assert "holds no 'count' (written before it was saved): it starts afresh" in caplog.text
    steps.append(load_checkpoint(final)["ctx"]["total_step"])
    assert first.n == steps[0] > 0 and second.n == steps[1] - steps[0] > 0  # from 0: this run's iterations
    assert load_checkpoint(final)["objects"]["count"] == {"n": second.n}
    caplog.clear()
    Run(counted(entry, third, saved=True), entry.main_config, DQNPolicy, max_env_step=192, resume=True,
        progress=False).train()
    went_on = load_checkpoint(final)["ctx"]["total_step"] - steps[0]  # from the checkpoint that held it
    assert third.n == went_on and "holds no" not in caplog.text


def test_the_old_form_of_an_entry_is_refused_in_one_line_that_says_how_to_write_it_now():
    with pytest.raises(TypeError) as refused:
        with Run(lambda: None, {}, DQNPolicy):
            pass
    message = str(refused.value)
    assert "\n" not in message and "def pipeline(run)" in message and ".train()" in message


@pytest.mark.slow
def test_a_users_entry_runs_distributed_and_resumes(entry_file):
    run = train_distributed(load_entry(str(entry_file)), collectors=2, evaluators=1, max_env_step=96, progress=False)
    assert run.env_step >= 96 and run.train_iter > 0 and run.last_eval_value is not None
    assert all(node["collected"] > 0 for node in run.nodes if node["role"] == "collector")
    rows = json.loads((Path("runs") / "mine" / "nodes.json").read_text())
    assert [row["roles"] for row in rows] == [["learner"], ["collector"], ["collector"], ["evaluator"]]
    again = train_distributed(load_entry(str(entry_file)), collectors=2, evaluators=1, max_env_step=160, resume=True,
                              progress=False)
    assert again.env_step >= 160 and again.train_iter > run.train_iter


@pytest.mark.slow
def test_the_cli_trains_a_users_entry_file(entry_file):
    done = subprocess.run([sys.executable, "-m", "conveyor", "train", str(entry_file), "--max-env-step", "64",
                           "--no-progress"], capture_output=True, text=True, timeout=300, start_new_session=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "\nbudget reached: env step 64" in done.stdout, done.stderr[-2000:]
