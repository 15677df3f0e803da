"""Every test starts from the same global random state, so its outcome does not depend on which tests ran before.
Fixtures shared by several folders."""
import random

import numpy as np
import pytest
import torch

from conveyor.engine import task


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run wherever torch sees a CUDA device and are skipped elsewhere, saying why."""
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
