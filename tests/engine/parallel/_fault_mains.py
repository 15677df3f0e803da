"""Worker mains for the fault tests: a learner and collectors joined by the exchangers, with faults on cue.

Batches are ``episodes`` lists of ``{"node", "version", "restarts"}`` (no trees: the workers stay light).
"""
import os
import signal
import sys
import time

import pynng
import torch

from conveyor.engine import PEER_LOST_EVENT, OnlineRLContext, task
from conveyor.engine.parallel import encode, generate_secret, seal
from conveyor.middleware import CkptSaver
from conveyor.middleware.exchanger import DATA_TOPIC, ContextExchanger, ModelExchanger

WAIT = 60  # seconds: the bound on every wait in a worker; a healthy run takes a second or two (idle machine)
MAX_STEP = 10 ** 6  # iterations: runs end on their conditions, or when a learner has run for 2 * WAIT seconds


class TinyPolicy:
    """A versioned policy as the exchangers and the CkptSaver see it: one weight equal to its version."""

    def __init__(self):
        self.model = torch.nn.Linear(1, 1, bias=False)
        self.version = 0
        self.train_step(0)

    def train_step(self, step=1):
        with torch.no_grad():
            self.model.weight.fill_(float(self.version + step))
        self.version += step

    def acting_state(self):
        return {"version": self.version, "tensors": [self.model.weight.detach().clone()], "extras": None}

    def load_acting_state(self, state):
        with torch.no_grad():
            self.model.weight.copy_(state["tensors"][0])
        self.version = state["version"]

    def state_dict(self):
        return {"version": self.version}

    def load_state_dict(self, state):
        self.version = state["version"]


def _kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def _collector(policy, kill_after, max_staleness):
    """A collector whose first process SIGKILLs itself after ``kill_after`` batches (None: never)."""
    me, restarts = task.router.node_id, task.router.restarts
    sent = []

    def collect(ctx):
        assert float(policy.model.weight.detach()) == policy.version
        if kill_after is not None and restarts == 0 and len(sent) == kill_after:
            _kill_self()
        sent.append(policy.version)
        ctx.episodes = [{"node": me, "version": policy.version, "restarts": restarts}]
        ctx.env_step += 1

    task.use(ModelExchanger(policy, max_staleness=max_staleness, timeout_s=WAIT))
    task.use(ContextExchanger(timeout_s=WAIT))
    task.use(collect)
    task.run(max_step=MAX_STEP)
    return {"sent": sent, "restarts": restarts}


def learn_through_faults(kills, until, grace_s=WAIT, save_dir=None):
    """Node 0 learns; collector ``n`` SIGKILLs itself after ``kills[n]`` batches. The learner stops when
    ``until`` is reached (see :func:`_done`), or when no collector is left for ``grace_s``; returns what it saw."""
    me = task.router.node_id
    policy = TinyPolicy()
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER if me == 0 else task.role.COLLECTOR)
        if me != 0:
            return _collector(policy, kills.get(me), max_staleness=0)
        record = {"batches": [], "lost": [], "train_iter_at_loss": [], "version_at_loss": [],
                  "deadline": time.monotonic() + 2 * WAIT}

        def lost(node):
            record["lost"].append(str(node))
            record["train_iter_at_loss"].append(task.ctx.train_iter)
            record["version_at_loss"].append(policy.version)

        def learn(ctx):
            record["batches"] += [dict(b, learner_version=policy.version) for b in ctx.episodes]
            policy.train_step()
            ctx.train_iter += 1
            record["train_iter"] = ctx.train_iter
            if _done(record, until):
                task.finish = True

        task.on(PEER_LOST_EVENT, lost)
        task.use(ModelExchanger(policy, timeout_s=WAIT))
        task.use(ContextExchanger(timeout_s=WAIT, grace_s=grace_s))
        task.use(learn)
        if save_dir is not None:
            task.use(CkptSaver(policy, save_dir))
        task.run(max_step=MAX_STEP)
        record["train_iter"] = task.ctx.train_iter
        record["stats"] = {k: v for k, v in task.router.stats().items()}
        return record


def _done(record, until):
    """Whether the learner may stop: ``("trained_after_loss", k)``: k train iterations after the first peer
    was lost; ``("restarted_sent", node, n)``: n batches from the restarted collector ``node``;
    ``("sent_by_each", nodes, n)``: n batches from each collector of ``nodes``; ``None``: never.
    Always after 2 * WAIT seconds (the test then fails on what the record shows)."""
    if time.monotonic() > record["deadline"]:
        return True
    if until is None:
        return False
    if until[0] == "sent_by_each":  # ("sent_by_each", nodes, n): n batches from each of those collectors
        return all(sum(b["node"] == node for b in record["batches"]) >= until[2] for node in until[1])
    if until[0] == "trained_after_loss":
        return bool(record["lost"]) and record["train_iter"] >= record["train_iter_at_loss"][0] + until[1]
    return sum(b["node"] == until[1] and b["restarts"] > 0 for b in record["batches"]) >= until[2]


def train_until_signalled(save_dir):
    """Node 0 learns with a CkptSaver and prints "training" once it has trained twice; node 1 collects."""
    me = task.router.node_id
    policy = TinyPolicy()
    with task.start(ctx=OnlineRLContext()):
        task.add_role(task.role.LEARNER if me == 0 else task.role.COLLECTOR)
        if me != 0:
            return _collector(policy, None, max_staleness=0)

        def learn(ctx):
            policy.train_step()
            ctx.train_iter += 1
            if ctx.train_iter == 2:
                os.write(sys.stdout.fileno(), b"training\n")
            if time.monotonic() > deadline:
                task.finish = True

        task.use(ModelExchanger(policy, timeout_s=WAIT))
        task.use(ContextExchanger(timeout_s=WAIT))
        task.use(learn)
        task.use(CkptSaver(policy, save_dir))
        deadline = time.monotonic() + 4 * WAIT  # the test signals it long before
        task.run(max_step=MAX_STEP)


def learn_under_attack(learner_address, more):
    """Node 0 learns from collector 1 while node 2 sends it a forged message, one sealed with another
    secret and an oversize one; the learner goes on for ``more`` iterations after refusing all three."""
    me = task.router.node_id
    policy = TinyPolicy()
    with task.start(ctx=OnlineRLContext()):
        if me == 2:
            return _attack(learner_address)
        task.add_role(task.role.LEARNER if me == 0 else task.role.COLLECTOR)
        if me == 1:
            return _collector(policy, None, max_staleness=None)
        record = {"senders": set()}

        def learn(ctx):
            record["senders"].update(b["node"] for b in ctx.episodes)
            policy.train_step()
            ctx.train_iter += 1
            stats = task.router.stats()
            if ctx.train_iter == 2:
                task.router.wait_for_subscribers("attack", 1, timeout=WAIT)
                task.emit("attack", only_remote=True)
            if "refused_at" not in record and stats["rejected_auth"] >= 2 and stats["rejected_size"] >= 1:
                record["refused_at"] = ctx.train_iter
            if ctx.train_iter >= record.get("refused_at", MAX_STEP) + more or time.monotonic() > deadline:
                task.finish = True

        task.use(ModelExchanger(policy, timeout_s=WAIT))
        task.use(ContextExchanger(timeout_s=WAIT))
        task.use(learn)
        deadline = time.monotonic() + 2 * WAIT
        task.run(max_step=MAX_STEP)
        return {"train_iter": task.ctx.train_iter, "refused_at": record.get("refused_at"),
                "senders": sorted(record["senders"]), "stats": task.router.stats()}


def _attack(address):
    """Wait for the learner's cue, then send it three bad messages on the data topic from a bare socket."""
    task.wait_for("attack", timeout=WAIT)
    secret, limit = task.router.secret, task.router.max_message_size
    batch = {"node": 1, "trajectories": None, "episodes": [{"node": 666, "version": 0, "restarts": 0}],
             "env_step": 1, "env_episode": 0}
    forged = bytearray(seal(secret, DATA_TOPIC, 10 ** 6, "1", encode(batch)))
    forged[-1] ^= 0xFF  # a tag that does not match: tampered, or made up
    with pynng.Push0(dial=address, send_timeout=WAIT * 1000) as raw:
        raw.send(bytes(forged))
        raw.send(seal(generate_secret(), DATA_TOPIC, 10 ** 6, "1", encode(batch)))  # another secret
        raw.send(seal(secret, DATA_TOPIC, 10 ** 6, "1", encode(b"\0" * limit)))  # over max_message_size
    return "sent"
