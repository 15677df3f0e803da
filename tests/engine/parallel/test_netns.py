"""Two hosts for real: a learner and two collectors in separate network namespaces joined by a veth pair,
talking tcp with a shared secret over a private /30 that exists only inside those namespaces."""
import json
import os
import select
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.engine.parallel._fault_mains import WAIT
from tests.engine.parallel._groups import script_groups

LAUNCHER = Path(__file__).with_name("_netns_launcher.py")
LEARNER_IP, COLLECTOR_IP, PORT = "10.213.7.1", "10.213.7.2", 47311  # test-only, inside the namespaces only


def ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=WAIT)


def skip(why):
    reason = f"network namespaces are unavailable here, so the two-host test cannot run: {why}"
    print(reason)  # shown in the log too, not only in the skip summary
    pytest.skip(reason)


@pytest.fixture
def hosts():
    """Two namespaces, ``(learner_ns, collector_ns)``, joined by a veth pair, each end with its /30 address;
    removed at the end (deleting a namespace deletes its end of the pair, and with it the other)."""
    tag = f"cv{os.getpid() % 100000}"
    names = (f"{tag}l", f"{tag}c")
    made = []
    if shutil.which("ip") is None:
        skip("there is no `ip` command (iproute2) here")
    try:
        for ns in names:
            done = ip("netns", "add", ns)
            if done.returncode != 0:
                skip(f"`ip netns add` said: {done.stderr.strip()}")
            made.append(ns)
        steps = [("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b"),
                 ("link", "set", f"{tag}a", "netns", names[0]), ("link", "set", f"{tag}b", "netns", names[1])]
        for ns, dev, addr in ((names[0], f"{tag}a", LEARNER_IP), (names[1], f"{tag}b", COLLECTOR_IP)):
            steps += [("-n", ns, "addr", "add", f"{addr}/30", "dev", dev), ("-n", ns, "link", "set", dev, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr.strip()}"
        yield names
    finally:
        for ns in made:
            ip("netns", "del", ns)


def json_line(proc):
    ready, _, _ = select.select([proc.stdout], [], [], 4 * WAIT)
    assert ready, f"no result within {4 * WAIT}s"
    line = proc.stdout.readline()
    assert proc.wait(timeout=WAIT) == 0 and line, f"exit code {proc.returncode}"
    return json.loads(line)


@pytest.mark.slow  # two launches, three workers: a few seconds on an idle machine
def test_a_learner_trains_on_two_collectors_on_another_host(hosts, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(os.urandom(32).hex())
    secret_file.chmod(0o600)
    learner_url = f"tcp://{LEARNER_IP}:{PORT}"
    with script_groups(WAIT) as start:
        learner = start(LAUNCHER, "learner", secret_file, LEARNER_IP, PORT, prefix=("ip", "netns", "exec", hosts[0]))
        collectors = start(LAUNCHER, "collectors", secret_file, COLLECTOR_IP, PORT, learner_url,
                           prefix=("ip", "netns", "exec", hosts[1]))
        [record] = json_line(learner)
        first, second = json_line(collectors)
    senders = [b["node"] for b in record["batches"]]
    assert senders.count(1) >= 3 and senders.count(2) >= 3, f"batches from {senders}"
    assert record["stats"]["rejected_auth"] == 0 and record["stats"]["malformed"] == 0
    assert len(first["sent"]) >= 3 and len(second["sent"]) >= 3
    assert all(b["version"] <= b["learner_version"] for b in record["batches"])  # each batch on weights it was sent
