"""Worker mains for the shared-memory batch tests (module-level, so they reach the workers by reference)."""
import hashlib
import os
import signal

import numpy as np
import torch
import treetensor.torch as ttorch

from conveyor.engine import OnlineRLContext, task
from conveyor.middleware.exchanger import ContextExchanger

WAIT = 20  # seconds: the bound on every wait in a worker
ROWS = 8


def batch(node, index):
    """Collector ``node``'s batch ``index``: arrays large enough for shared memory (uint8 frames, float64, bool,
    bfloat16) and small ones, all drawn from a generator seeded by both."""
    g = torch.Generator().manual_seed(1000 * node + index)
    return ttorch.Tensor({
        "obs": torch.randint(0, 256, (ROWS, 4, 64, 64), generator=g, dtype=torch.uint8),
        "value": torch.randn(ROWS, 1200, generator=g, dtype=torch.float64),
        "mask": torch.rand(ROWS, 9000, generator=g) > 0.5,
        "logit": {"half": torch.randn(ROWS, 5000, generator=g).bfloat16()},
        "node": torch.full((ROWS,), node), "index": torch.full((ROWS,), index)})


def digest(tree, row):
    """A hash of every array's dtype, shape and bytes in one batch's rows of ``tree``."""
    h = hashlib.sha256()
    for key in ("obs", "value", "mask", "logit.half"):
        t = tree[key] if "." not in key else tree.logit.half
        part = t[row:row + ROWS].contiguous()
        h.update(f"{key}{part.dtype}{tuple(part.shape)}".encode())
        h.update(part.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def exchange(batches, shared_memory, die_at=None):
    """Node 0 learns, the others each send ``batches`` batches (in step with the learner: ``skip_n_iter=1``, so each
    but the first goes after a ``train_iter`` and its offer); collector 1 kills itself at batch ``die_at``. Returns
    the learner's digests by ``node/index`` and its shared count, or the collector's digests of what it sent, and
    the node's pid (a learner's names the run's blocks)."""
    me, collectors = task.router.node_id, task.router.n_workers - 1
    digests = {}
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER if me == 0 else task.role.COLLECTOR)
        exchanger = ContextExchanger(timeout_s=WAIT, grace_s=1.0, skip_n_iter=None if me == 0 else 1,
                                     shared_memory=shared_memory)
        task.use(exchanger)

        def collect(ctx):
            index = len(digests)
            if index == die_at and me == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            ctx.trajectories = batch(me, index)
            digests[f"{me}/{index}"] = digest(ctx.trajectories, 0)
            ctx.env_step += ROWS

        def learn(ctx):
            tree = ctx.trajectories
            for row in range(0, len(tree.obs), ROWS):
                digests[f"{int(tree.node[row])}/{int(tree.index[row])}"] = digest(tree, row)
            ctx.train_iter += 1
            if len(digests) == batches * collectors:
                task.finish = True

        task.use(collect, role=task.role.COLLECTOR)
        task.use(learn, role=task.role.LEARNER)
        task.run(max_step=batches if me else 10 * batches * collectors)
        return {"digests": digests, "shared": exchanger.shared.taken if me == 0 else None, "pid": os.getpid()}
