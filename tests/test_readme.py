"""The README's commands as a newcomer meets them: each parses, no two runs share a name, and, run one after
another in a fresh folder exactly as written, every one succeeds (in two lanes side by side: commands on one run
share a lane, in README order).

Commands are the lines of the README's ```bash blocks (``\\`` continues a line, ``&&`` chains commands); a
```python block whose first line is ``# NAME.py`` is a file the reader saves before going on. Only ``conveyor``
commands for this machine run: installing, the test suite, TensorBoard's server, Slurm's ``srun`` and the
commands meant for other hosts are the reader's environment, not Conveyor's.
"""
from __future__ import annotations

import concurrent.futures
import ipaddress
import re
import shlex
import subprocess
from typing import Iterator, List, Optional, Tuple
from urllib.parse import urlsplit

import pytest

from conveyor.cli import parser
from tests.cli_helpers import ROOT, run_conveyor

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
COMMAND_TIMEOUT = 600  # seconds: a bound on each command; each takes well under a minute here


def readme_steps(text: str) -> Iterator[Tuple[str, object]]:
    """In the README's order: ("file", (name, text)) for a file to save, ("command", argv) for a command."""
    for match in FENCE.finditer(text):
        language, body = match.group(1), match.group(2)
        first = body.partition("\n")[0]
        if language == "python" and re.fullmatch(r"# [\w.-]+\.py\b.*", first):
            yield "file", (first[2:].split()[0].rstrip(":"), body)
        elif language == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                while words:
                    end = words.index("&&") if "&&" in words else len(words)
                    yield "command", words[:end]
                    words = words[end + 1:]


def _other_host(argv: List[str]) -> bool:
    """Whether the command names an address that is not this machine's loopback (it runs on another host)."""
    hosts = []
    for option, value in zip(argv, argv[1:]):
        if option == "--address":
            hosts.append(value)
        elif option == "--attach-to":
            hosts += [urlsplit(url).hostname or "" for url in value.split(",")]
    for host in hosts:
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return True
        except ValueError:  # an ipc folder or a host name
            if host not in ("localhost",) and not host.startswith(("/", ".")):
                return True
    return False


def why_not_run(argv: List[str]) -> Optional[str]:
    """Why the test leaves this command to the reader, or None to run it."""
    if argv[0] != "conveyor":
        return f"{argv[0]}: the reader's environment (install, test suite, TensorBoard's server, Slurm)"
    if _other_host(argv):
        return "meant for another host"
    return None


def conveyor_commands() -> List[List[str]]:
    return [argv for kind, argv in readme_steps((ROOT / "README.md").read_text())
            if kind == "command" and why_not_run(argv) is None]


def test_only_the_readers_environment_is_left_out_of_the_readme_run():
    steps = list(readme_steps((ROOT / "README.md").read_text()))
    run = conveyor_commands()
    assert {argv[1] for argv in run} >= {"list", "train", "plot", "eval", "task"}
    skipped = {argv[0] for kind, argv in steps if kind == "command" and why_not_run(argv)}
    assert skipped <= {"python3", ".", "pip", "python", "tensorboard", "srun", "conveyor"}


@pytest.mark.parametrize("argv", conveyor_commands(), ids=shlex.join)
def test_every_conveyor_command_of_the_readme_parses(argv):
    try:
        parser().parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"README: `{shlex.join(argv)}` is refused by the parser (exit code {exc.code})")


def test_no_two_readme_runs_share_a_run_name():
    from conveyor.zoo import load_entry

    trained = set()
    for argv in conveyor_commands():
        args = parser().parse_args(argv[1:])
        if args.command != "train":
            continue
        name = args.exp_name or load_entry(args.entry).main_config["exp_name"]
        if args.resume:
            assert name in trained, f"README: `{shlex.join(argv)}` resumes runs/{name}, which no command before trains"
        else:
            assert name not in trained, (f"README: `{shlex.join(argv)}` would train into runs/{name}, which a "
                                         f"command before already holds: give it its own --exp-name")
        trained.add(name)


def _runs_named(argv: List[str]) -> List[str]:
    """The run names a command trains into or reads (``--exp-name``, the entry's default, ``runs/NAME``)."""
    from conveyor.zoo import load_entry

    names = [m.group(1) for word in argv for m in [re.match(r"runs/([\w.-]+)", word)] if m]
    args = parser().parse_args(argv[1:])
    if args.command == "train":
        names.append(args.exp_name or load_entry(args.entry).main_config["exp_name"])
    return names


def lanes(commands: List[List[str]]) -> Tuple[List[List[str]], List[List[str]]]:
    """The commands in two lanes that can run side by side, each in README order: commands touching the same run
    stay in one lane; those whose runs spread over processes (``--collectors``, ``--async``, ``task``) go to the
    second."""
    groups: List[Tuple[set, List[List[str]]]] = []
    for argv in commands:
        names = set(_runs_named(argv))
        joined = [g for g in groups if g[0] & names]
        merged = (set(names).union(*(g[0] for g in joined)), [c for g in joined for c in g[1]] + [argv])
        groups = [g for g in groups if g not in joined] + [merged]
    order = {id(argv): i for i, argv in enumerate(commands)}
    one, spread = [], []
    for _, group in groups:
        (spread if any(a[1] == "task" or {"--collectors", "--async"} & set(a) for a in group) else one).extend(group)
    return sorted(one, key=lambda a: order[id(a)]), sorted(spread, key=lambda a: order[id(a)])


def test_commands_on_one_run_share_a_lane_in_readme_order():
    commands = conveyor_commands()
    one, spread = lanes(commands)
    assert sorted(map(shlex.join, one + spread)) == sorted(map(shlex.join, commands))
    for lane in (one, spread):
        assert [commands.index(a) for a in lane] == sorted(commands.index(a) for a in lane)
    for a in one:
        assert not set(_runs_named(a)) & {n for b in spread for n in _runs_named(b)}, shlex.join(a)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 93 s idle, ~200 s on a busy 2-core machine: a dozen trainings, most until solved
def test_the_readme_s_commands_run_one_after_another_in_a_fresh_folder(tmp_path):
    """In two lanes side by side (these machines have two cores); each lane runs its commands one after another."""
    for kind, step in readme_steps((ROOT / "README.md").read_text()):
        if kind == "file":
            name, text = step
            (tmp_path / name).write_text(text)

    def run_lane(lane: List[List[str]]) -> List[subprocess.CompletedProcess]:
        done = []
        for argv in lane:
            done.append(run_conveyor(argv, tmp_path, timeout=COMMAND_TIMEOUT))
            if done[-1].returncode != 0:
                break
        return done

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = [r for lane in pool.map(run_lane, lanes(conveyor_commands())) for r in lane]
    for done in results:
        assert done.returncode == 0, (f"README: `{shlex.join(done.args)}` exited with {done.returncode}:\n"
                                      f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    assert len(results) == len(conveyor_commands())
    first = next(done for done in results if done.args == ["conveyor", "train", "cartpole/dqn"])
    assert first.stdout.strip().splitlines()[-1].startswith("solved: eval "), first.stdout[-2000:]  # README's promise
    assert (tmp_path / "curves.png").is_file() and (tmp_path / "ep.gif").is_file()
