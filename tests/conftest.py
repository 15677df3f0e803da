"""Every test starts from the same global random state, so its outcome does not depend on which tests ran before.
Fixtures shared by several folders."""
import random

import numpy as np
import pytest
import torch

from conveyor.engine import task


LONGEST_FILES = ("test_benchmarks.py", "zoo/test_distributed.py", "test_launcher_ray.py", "zoo/test_data_parallel_layout.py",
                 "zoo/test_ppo_entries.py", "zoo/test_atari_mujoco_entries.py", "test_readme.py", "zoo/test_marl_entries.py",
                 "policy/test_data_parallel.py", "policy/test_td3.py", "policy/test_policy_base.py",
                 "test_slurm_cluster.py", "zoo/test_sac_entries.py", "zoo/test_impala_entries.py", "test_cli_tune.py",
                 "test_launchers_run.py", "zoo/test_resume.py", "zoo/test_marl_qmix.py", "engine/parallel/test_fault.py",
                 "test_device_path.py")
"""The files that ran longest (a profiled -n 4 run, 2026-11-29: 363 s down to 33 s; the others under 26 s), run
first in this order: with ``--dist loadfile`` (setup.cfg) each file runs whole on one worker, and a long one
started last holds the suite up alone (in a loaded -n 4 run test_launcher_ray.py, 488 s, came last on its worker,
whose tests took 1540 s against 1353-1417 s on the other three). xdist's own order, by number of tests
(``--no-loadscope-reorder`` turns it off), puts these late."""


def pytest_collection_modifyitems(config, items):
    """The :data:`LONGEST_FILES` first (each file's tests in their order), then the others as collected. Tests
    marked ``cuda`` run wherever torch sees a CUDA device and are skipped elsewhere, saying why."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_global_generators():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def peer_with_the_secret():
    """This node's router (node "0", attached to the task) and another node's ("9") with the same secret, both
    ready: what a peer holding the secret can send, through the public API."""
    from conveyor.engine.parallel import generate_secret
    from conveyor.engine.parallel.router import Router

    secret, fast = generate_secret(), dict(heartbeat_s=0.05, peer_timeout_s=2.0, send_timeout_s=5.0)
    with Router("0", secret, **fast) as mine, Router("9", secret, peers=[mine.address], **fast) as peer:
        task.attach_router(mine)
        try:
            peer.wait_for_peers(1, 20)
            yield mine, peer
        finally:
            task.detach_router()
