"""Chaos (issue 34): does a distributed run with ``--auto-recover`` survive its nodes dying, and does every
transition stay accounted for? One run, as a user starts it:

    conveyor train cartpole/dqn --collectors C --evaluators 1 --auto-recover --ckpt-interval 1

(1 learner, C >= 2 collectors, 1 evaluator), to its stop value (475; ``--quick``: 200) or ``--max-env-step``. Once the
collectors have sent their first batches, a schedule drawn from ``--seed`` acts on the nodes named in
``runs/<exp>/nodes.json``: collectors and the evaluator are SIGKILLed (``--kills`` in all, the learner once among
them), one collector is SIGSTOPped for the routers' peer timeout plus 3 s and then SIGCONTed. A killed node that
comes back (a new pid for its node id in ``nodes.json``) is a recovery. The run must end by itself within
``--budget`` seconds plus ``GRACE_S``; past that it is stopped (SIGTERM, then SIGKILL) and reported as hung.

The transition account is the run's own (:func:`conveyor.middleware.ledger.transition_account`, which the launcher
also logs): every transition the collectors offered is in the replay buffer, was replaced there, or was dropped
with its reason; ``unaccounted_transitions`` is what none of these explains.

Network faults, where network namespaces can be made (``unshare -rn true`` works and this is root): the last
collector runs in a launch of its own in a second namespace, joined to the first (the other nodes) by a veth pair
over a private /30 and tcp with a shared secret; the schedule then also delays its link (netem: 100 ms +- 20 ms, 5 %
loss, 5 s; skipped, saying why, where the kernel has no netem) and cuts it (down for the peer timeout plus 3 s).
Elsewhere (or with ``--no-netns``) they are skipped, and ``netns`` says why.

    python -m benchmarks.chaos                 # the issue's run: 3 collectors, 6 kills in 30 s, budget 600 s
    python -m benchmarks.chaos --quick         # 2 collectors, 3 kills in 8 s, stop value 200, budget 45 s

The last line is JSON: ``kills``, ``kills_by_role``, ``stops``, ``recoveries``, ``unaccounted_transitions``,
``transitions`` (the account: ``collected``, ``in_replay``, ``replaced``, ``dropped`` by reason...), ``solved``,
``last_eval_value``, ``stop_value``, ``env_step``, ``wall_s``, ``budget_s``, ``hung``, ``exit_codes`` (of the
launches), ``seed``,
``schedule`` (seconds after every collector's first batch, action, role, node), ``netns``, ``stragglers`` (launches
still running ``STRAGGLER_S`` after the run's owner ended, then stopped).
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from benchmarks._cluster import processes_with
from benchmarks._harness import ROOT, print_json_line, scratch_dir

GRACE_S = 60.0
"""How long past its budget the run may take to end (its final checkpoint, a restarted node's start) before it
counts as hung."""
EXP = "chaos"
HOST_IPS = ("10.213.9.1", "10.213.9.2")
"""The two namespaces' ends of their veth pair: a private /30 that exists only inside them."""
LINK = "chaoslink"
"""The collector's end of the veth pair, in its namespace: where the link faults act."""
STRAGGLER_S = 10.0
"""How long the collector's own launch may go on after the run's owner ended before it is stopped (SIGTERM) and
counted in ``stragglers``."""
PORT = 47411
"""The first port the nodes listen on, inside the namespaces (node i: PORT + i)."""


def peer_timeout_s() -> float:
    """The routers' default peer timeout: a node silent for longer is lost to its peers."""
    from conveyor.engine.parallel.router import Router

    return float(inspect.signature(Router).parameters["peer_timeout_s"].default)


def sh(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def netns_unavailable() -> Optional[str]:
    """Why the run cannot be spread over two network namespaces here, or None."""
    try:
        done = sh("unshare", "-rn", "true")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"network namespaces are unavailable (unshare: {e})"
    if done.returncode != 0:
        return f"network namespaces are unavailable (`unshare -rn true`: {done.stderr.strip()})"
    if os.geteuid() != 0:
        return "`ip netns add` (two namespaces joined by a veth pair) needs root"
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[Optional[Tuple[str, str]]]:
    """Two network namespaces ``(learner's, one collector's)`` joined by a veth pair over a private /30
    (:data:`HOST_IPS`, inside them only), removed at the end; None (said why) where they cannot be made."""
    tag = f"chaos{os.getpid() % 100000}"
    names, made = (f"{tag}a", f"{tag}b"), []
    try:
        for ns in names:
            done = sh("ip", "netns", "add", ns)
            if done.returncode != 0:
                print(f"network faults skipped: `ip netns add` said: {done.stderr.strip()}")
                yield None
                return
            made.append(ns)
        steps = [("link", "add", f"{tag}x", "type", "veth", "peer", "name", LINK), ("link", "set", f"{tag}x",
                 "netns", names[0]), ("link", "set", LINK, "netns", names[1])]
        for ns, dev, addr in ((names[0], f"{tag}x", HOST_IPS[0]), (names[1], LINK, HOST_IPS[1])):
            steps += [("-n", ns, "addr", "add", f"{addr}/30", "dev", dev), ("-n", ns, "link", "set", dev, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = sh("ip", *step)
            if done.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")
        yield names
    finally:
        for ns in made:
            sh("ip", "netns", "del", ns)


def link_fault(ns: str, action: str, on: bool) -> str:
    """Start (``on``) or end a fault of the collector's end of the link: ``delay`` (netem: 100 ms +- 20 ms, 5 %
    loss) or ``cut`` (the link down); what happened, in words."""
    if action == "delay":
        argv = ("tc", "qdisc", "add", "dev", LINK, "root", "netem", "delay", "100ms", "20ms", "loss", "5%") if on \
            else ("tc", "qdisc", "del", "dev", LINK, "root")
    else:
        argv = ("ip", "link", "set", LINK, "down" if on else "up")
    done = sh("ip", "netns", "exec", ns, *argv)
    return "done" if done.returncode == 0 else f"skipped: `{' '.join(argv)}` said: {done.stderr.strip()}"


def schedule(seed: int, kills: int, window_s: float, collectors: int, link: bool) -> List[Dict[str, Any]]:
    """The faults, drawn from ``seed``: ``kills`` SIGKILLs (the learner once, the others on a collector or the
    evaluator; the learner's second), one SIGSTOP of a collector and, with ``link``, a delayed and lossy link and a
    cut one, at times spread over ``window_s`` seconds."""
    rng = random.Random(seed)
    roles = ["learner"] + [rng.choice(["collector", "collector", "evaluator"]) for _ in range(kills - 1)]
    actions = [("kill", role) for role in roles] + [("stop", "collector")] + ([("delay", "link"), ("cut", "link")]
                                                                             if link else [])
    rng.shuffle(actions)
    actions.remove(("kill", "learner"))  # second: its checkpoint has training to lose, and the run time to recover
    actions.insert(1, ("kill", "learner"))
    slot = window_s / len(actions)
    events = []
    for i, (action, role) in enumerate(actions):
        node = 0 if role == "learner" else 1 + collectors if role == "evaluator" else \
            collectors if role == "link" else 1 + rng.randrange(collectors)  # a link: the last collector's
        events.append({"at_s": round(i * slot + rng.uniform(0, max(slot - 2.0, 0.0)), 2), "action": action,
                       "role": role, "node": node})
    return events


def node_pids(run_dir: Path) -> Dict[int, int]:
    """Node id -> pid, from ``nodes.json`` (empty while it is being written or before)."""
    try:
        return {int(row["node_id"]): int(row["pid"]) for row in json.loads((run_dir / "nodes.json").read_text())}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def collecting(run_dir: Path, collectors: int) -> bool:
    """Whether every collector has sent a batch (its ledger counts some): the run is under way."""
    try:
        return all(json.loads((run_dir / "ledger" / f"collector-{node}.json").read_text())["offered"] > 0
                   for node in range(1, 1 + collectors))
    except (OSError, ValueError, KeyError):
        return False


def signal_node(pid: int, signum: int) -> None:
    """Send ``signum`` to node process ``pid`` unless it has ended meanwhile."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def start(argv: List[str], mark: str, out: str, prefix: Tuple[str, ...] = ()) -> subprocess.Popen:
    """``conveyor train ARGV`` in its own session (under ``prefix``: ``ip netns exec NS``), its output to ``out``."""
    env = {**os.environ, "LAUNCHER_TEST": mark,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(out, "w") as f:
        return subprocess.Popen([*prefix, sys.executable, "-m", "conveyor", "train", *argv], env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def launch(args: argparse.Namespace, mark: str, hosts: Optional[Tuple[str, str]]) -> List[subprocess.Popen]:
    """The run: one launch here, or (``hosts``) the last collector in a launch of its own in the second namespace,
    the other nodes in the first, over tcp with a shared secret."""
    argv = ["cartpole/dqn", "--collectors", str(args.collectors), "--evaluators", "1", "--auto-recover",
            "--max-retries", str(4 * args.kills), "--ckpt-interval", "1", "--no-progress", "--exp-name", EXP,
            "--seed", str(args.seed), "--max-env-step", str(args.max_env_step),
            "--set", f"env.stop_value={args.stop_value}"]
    if hosts is None:
        return [start(argv, mark, "run.out")]
    secret = Path("secret")
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    argv += ["--protocol", "tcp", "--secret-file", str(secret)]
    apart = args.collectors  # the last collector's node id
    here = [i for i in range(args.collectors + 2) if i != apart]
    return [start([*argv, "--address", HOST_IPS[0], "--node-ids", ",".join(map(str, here)), "--ports",
                   ",".join(str(PORT + i) for i in here)], mark, "run.out", ("ip", "netns", "exec", hosts[0])),
            start([*argv, "--address", HOST_IPS[1], "--node-ids", str(apart), "--ports", str(PORT + apart),
                   "--attach-to", f"tcp://{HOST_IPS[0]}:{PORT}"], mark, "apart.out",
                  ("ip", "netns", "exec", hosts[1]))]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group, SIGKILL after 60 s (SIGCONT first: a stopped node would not hear)."""
    for signum in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            return
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def chaos(args: argparse.Namespace) -> Dict[str, Any]:
    why = netns_unavailable() if args.netns else "--no-netns"
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(two_hosts()) if why is None else None
        if hosts is None and why is None:
            why = "the namespaces could not be made (said above)"
        return faults(args, hosts, "ran" if hosts else f"skipped: {why}")


def faults(args: argparse.Namespace, hosts: Optional[Tuple[str, str]], netns: str) -> Dict[str, Any]:
    """Start the run, act on its schedule until it ends (or hangs), and report."""
    run_dir = Path("runs", EXP)
    events = schedule(args.seed, args.kills, args.window, args.collectors, hosts is not None)
    mark = uuid.uuid4().hex
    held_s = {"stop": peer_timeout_s() + 3.0, "cut": peer_timeout_s() + 3.0, "delay": 5.0}
    began = time.monotonic()
    procs = launch(args, mark, hosts)
    armed: Optional[float] = None  # when every node ran and every collector had sent: the schedule's zero
    pending, waiting = list(events), {}  # waiting: node -> pid killed, until it comes back
    held: List[tuple] = []  # (event, pid or None, until): SIGSTOPs and link faults to end
    kills: Dict[str, int] = {}
    recoveries, hung, stragglers = 0, False, 0
    try:
        while procs[0].poll() is None:
            now = time.monotonic()
            if now - began > args.budget + GRACE_S:
                hung = True
                break
            pids, live = node_pids(run_dir), set(processes_with(mark))
            if armed is None and len(pids) == args.collectors + 2 and collecting(run_dir, args.collectors):
                armed = now
            for event in events:
                if event.get("pid") in live:
                    event["alive_s"] = round(now - armed, 1)
            for node, dead in list(waiting.items()):
                if pids.get(node, dead) != dead and pids[node] in live:
                    recoveries += 1
                    del waiting[node]
            for entry in [h for h in held if now >= h[2]]:
                end_fault(entry, hosts)
                held.remove(entry)
            if (run_dir / "ledger" / "learner.json").is_file():  # the learner has ended: the run is ending
                for event in pending:
                    event["done"] = "not reached: the run was ending"
                pending = []
            while armed is not None and pending and now - armed >= pending[0]["at_s"]:
                event = pending.pop(0)
                if event["role"] == "link":
                    event["done"] = link_fault(hosts[1], event["action"], True)
                    if event["done"] == "done":
                        held.append((event, None, now + held_s[event["action"]]))
                    continue
                stopped = {pid for _, pid, _ in held}
                if event["role"] == "collector" and pids.get(event["node"]) in stopped:  # not the stopped one
                    event["node"] = next((n for n in range(1, 1 + args.collectors) if pids.get(n) not in stopped
                                          and n not in waiting), event["node"])
                pid = pids.get(event["node"])
                if pid is None or pid not in live or event["node"] in waiting:
                    event["done"] = "skipped: the node is not running (ended, or restarting)"
                    continue
                if event["action"] == "kill":
                    os.kill(pid, signal.SIGKILL)
                    kills[event["role"]] = kills.get(event["role"], 0) + 1
                    waiting[event["node"]] = pid
                else:
                    os.kill(pid, signal.SIGSTOP)
                    held.append((event, pid, now + held_s["stop"]))
                    event["pid"] = pid
                event["done"] = f"pid {pid}"
            time.sleep(0.2)
    finally:
        for entry in held:
            end_fault(entry, hosts)
        for proc in procs:  # the run's owner first; the other launch should end once its learner has
            if not hung:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=STRAGGLER_S if proc is not procs[0] else 60)
            if proc.poll() is None:
                hung = hung or proc is procs[0]
                stragglers += proc is not procs[0]
                stop_group(proc)
    wall = time.monotonic() - began
    last = node_pids(run_dir)
    for event in events:  # what became of a stopped node once continued
        if "pid" in event:
            event["then"] = f"that process was last seen at {event.get('alive_s')} s" + (
                "" if last.get(event["node"]) == event["pid"] else
                f"; the node was started again (pid {last.get(event['node'])})")
    codes = [proc.returncode for proc in procs]
    return {**report(run_dir, events, kills, recoveries, hung, codes, wall, args, netns), "stragglers": stragglers}


def end_fault(entry: tuple, hosts: Optional[Tuple[str, str]]) -> None:
    """End a SIGSTOP (SIGCONT) or a link fault."""
    event, pid, _ = entry
    if pid is not None:
        signal_node(pid, signal.SIGCONT)
    else:
        event["done"] += f", ended: {link_fault(hosts[1], event['action'], False)}"


def report(run_dir: Path, events: List[Dict[str, Any]], kills: Dict[str, int], recoveries: int, hung: bool,
           codes: List[Optional[int]], wall: float, args: argparse.Namespace, netns: str) -> Dict[str, Any]:
    from conveyor.middleware import load_checkpoint
    from conveyor.middleware.ledger import transition_account

    account: Dict[str, Any] = {}
    try:
        account = transition_account(run_dir)
    except (OSError, ValueError) as e:
        print(f"no transition account: {e}")
    final = run_dir / "ckpt" / "final.pth.tar"
    ctx = load_checkpoint(final)["ctx"] if final.is_file() else {}
    last_eval = ctx.get("last_eval_value")
    solved = last_eval is not None and last_eval >= args.stop_value
    stops = sum(e["action"] == "stop" and "pid" in e for e in events)
    print(f"chaos: cartpole/dqn, {args.collectors} collectors, 1 evaluator, seed {args.seed}, budget {args.budget:g} s")
    print(f"{'at s':>7}  {'action':<6} {'role':<10} {'node':>4}  result")
    for e in events:
        print(f"{e['at_s']:>7.1f}  {e['action']:<6} {e['role']:<10} {e['node']:>4}  {e.get('done', 'not reached')}"
              + (f"; {e['then']}" if "then" in e else ""))
    print(f"kills {sum(kills.values())} {kills}, recoveries {recoveries}, stops {stops}; exit codes {codes}, "
          f"{'HUNG, ' if hung else ''}wall {wall:.1f} s; last evaluation {last_eval} (stop value {args.stop_value})")
    if account:
        print(f"transitions: collected {account['collected']} = in replay {account['in_replay']} + replaced "
              f"{account['replaced']} + dropped {sum(account['dropped'].values())} {account['dropped']} + "
              f"unaccounted {account['unaccounted']}")
    if account.get("unaccounted"):  # where the rest lies: what each collector sent that the learner never saw
        for node, row in account["by_node"].items():
            print(f"  collector {node}: offered {row['offered']} (incarnation {row['incarnation']}), counted by the "
                  f"learner {row['counted']} (last from incarnation {row['last_seen_incarnation']}), no learner "
                  f"{row['no_learner']}, not counted {row['not_counted']}")
    print(f"network faults: {netns}")
    for out, code in zip(("run.out", "apart.out"), codes):
        if code != 0 or not account:
            print(f"{out}'s last lines:\n" + "\n".join(Path(out).read_text().splitlines()[-15:]))
    return {"kills": sum(kills.values()), "kills_by_role": kills, "stops": stops, "recoveries": recoveries,
            "unaccounted_transitions": account.get("unaccounted"), "transitions": account, "solved": solved,
            "last_eval_value": last_eval, "stop_value": args.stop_value, "env_step": ctx.get("env_step"),
            "wall_s": round(wall, 1), "budget_s": args.budget, "hung": hung, "exit_codes": codes,
            "seed": args.seed, "schedule": events, "netns": netns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 collectors, 3 kills in 8 s, stop value 200")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed and the schedule's (default 0)")
    parser.add_argument("--collectors", type=int, default=None, help="collector nodes, >= 2 (default 3)")
    parser.add_argument("--kills", type=int, default=None, help="SIGKILLs, the learner's one among them (default 6)")
    parser.add_argument("--window", type=float, default=None,
                        help="seconds the faults are spread over (default 30: the run solves in about a minute here)")
    parser.add_argument("--budget", type=float, default=None, help="seconds the run may take (default 600)")
    parser.add_argument("--max-env-step", type=int, default=None, help="the run's env-step budget (default 60000)")
    parser.add_argument("--stop-value", type=float, default=None, help="the evaluation that ends the run (475)")
    parser.add_argument("--no-netns", dest="netns", action="store_false",
                        help="no network faults (by default they run where network namespaces can be made)")
    parser.add_argument("--workdir", default=None, help="run here and keep runs/chaos and run.out (default: a "
                                                        "temporary folder, removed)")
    args = parser.parse_args()
    quick = dict(collectors=2, kills=3, window=8.0, budget=45.0, max_env_step=20000, stop_value=200.0)
    full = dict(collectors=3, kills=6, window=30.0, budget=600.0, max_env_step=60000, stop_value=475.0)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.collectors < 2 or args.kills < 1 or args.window <= 0 or args.budget <= 0:
        parser.error("--collectors must be >= 2, --kills >= 1, --window and --budget > 0")
    if args.workdir is None:
        with scratch_dir():
            figures = chaos(args)
    else:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        os.chdir(args.workdir)
        figures = chaos(args)
    print_json_line(figures)


if __name__ == "__main__":
    main()
