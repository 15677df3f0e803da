"""What the CLI tests share: tiny training budgets and the shape of an error (one line, exit code 2)."""

TINY = ["--set", "env.collector_env_num=2", "--set", "env.evaluator_env_num=2", "--set", "env.n_evaluator_episode=2",
        "--set", "policy.model.hidden_sizes=[8]", "--set", "policy.eval.evaluator.eval_freq=8",
        "--set", "policy.other.replay_buffer.size=500", "--max-env-step", "64", "--no-progress"]
"""``conveyor train cartpole/dqn`` options for a run of a fraction of a second."""


def assert_usage_error(code, capsys, *fragments):
    """Exit code 2, and one line on stderr saying ``conveyor: error: ...`` with each fragment, no traceback."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("conveyor: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err
