"""Worker mains for the exchanger tests (module-level, so they reach the workers by reference)."""
import threading

import torch
import treetensor.torch as ttorch

from conveyor.engine import OnlineRLContext, task
from conveyor.middleware.exchanger import ContextExchanger, ModelExchanger

WAIT = 20  # seconds: the bound on every wait in a worker; a healthy run takes well under one
ROWS = 2  # env steps per collected batch


class FakePolicy:
    """A versioned policy as the exchangers see it: a tiny model whose weights all equal its version."""

    def __init__(self):
        self.model = torch.nn.Linear(2, 1)
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(0.0)
        self.version, self.extras = 0, {"eps": 0.0}

    def train_step(self):
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)
        self.version += 1
        self.extras = {"eps": float(self.version)}

    def acting_state(self):
        return {"version": self.version, "tensors": [p.detach().clone() for p in self.model.parameters()],
                "extras": self.extras}

    def load_acting_state(self, state):
        with torch.no_grad():
            for p, t in zip(self.model.parameters(), state["tensors"]):
                p.copy_(t)
        self.version, self.extras = state["version"], state["extras"]

    def weight(self):
        return float(self.model.weight.detach()[0, 0])


def learn_and_collect(batches_per_collector, max_staleness):
    """Node 0 learns, the others collect ``batches_per_collector`` batches each; returns what each saw."""
    router = task.router
    me, n_collectors = router.node_id, router.n_workers - 1
    policy, seen = FakePolicy(), []
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER if me == 0 else task.role.COLLECTOR)
        task.use(ModelExchanger(policy, max_staleness=max_staleness, timeout_s=WAIT))
        task.use(ContextExchanger(timeout_s=WAIT))

        def collect(ctx):
            assert policy.weight() == policy.version and policy.extras == {"eps": float(policy.version)}
            ctx.trajectories = ttorch.Tensor({"obs": torch.full((ROWS, 3), float(me)),
                                              "weight_version": torch.full((ROWS,), policy.version)})
            ctx.env_step += ROWS
            ctx.env_episode += 1
            seen.append({"version": policy.version, "train_iter": ctx.train_iter})

        def learn(ctx):
            obs, versions = ctx.trajectories.obs, ctx.trajectories.weight_version
            batches = [[int(obs[i, 0]), int(versions[i])] for i in range(0, len(obs), ROWS)]  # (sender, version)
            seen.append({"batches": batches, "rows": len(obs), "env_step": ctx.env_step, "version": policy.version})
            policy.train_step()
            ctx.train_iter += 1
            if ctx.env_step == ROWS * batches_per_collector * n_collectors:
                task.finish = True

        task.use(collect, role=task.role.COLLECTOR)
        task.use(learn, role=task.role.LEARNER)
        task.run(max_step=batches_per_collector if me else 10 * batches_per_collector * n_collectors)
        return {"seen": seen, "env_step": task.ctx.env_step, "env_episode": task.ctx.env_episode}


def late_joiner(versions):
    """Node 0 (learner) reaches ``versions`` before the others (a collector, then evaluators) make their
    exchangers; each must get the newest."""
    router = task.router
    policy, others = FakePolicy(), router.n_workers - 1
    with task.start(ctx=OnlineRLContext()):
        if router.node_id == 0:
            task.add_role(task.role.LEARNER)
            task.use(ModelExchanger(policy, timeout_s=WAIT))
            task.use(lambda ctx: policy.train_step())
            task.run(max_step=versions)  # sent to nobody: no one listens yet
            loaded = threading.Semaphore(0)
            task.on("loaded", loaded.release)  # before "at_newest": no "loaded" can be missed
            router.wait_for_subscribers("at_newest", others, timeout=WAIT)
            task.emit("at_newest", only_remote=True)
            for _ in range(others):
                assert loaded.acquire(timeout=WAIT), f"not every late joiner loaded a version within {WAIT}s"
            return policy.version
        task.add_role(task.role.COLLECTOR if router.node_id == 1 else task.role.EVALUATOR)
        task.wait_for("at_newest", timeout=WAIT)  # subscribes; the learner waits for that before emitting
        exchanger = ModelExchanger(policy, max_staleness=0, timeout_s=WAIT)
        task.use(exchanger)
        task.run(max_step=1)
        router.wait_for_subscribers("loaded", 1, timeout=WAIT)
        task.emit("loaded", only_remote=True)
        return [exchanger.loaded_version, policy.version, policy.weight()]
