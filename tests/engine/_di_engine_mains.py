"""Worker mains for DI-engine's framework tests ported to Conveyor (module-level: they reach workers by reference)."""
import threading

import numpy as np

from conveyor.engine import OnlineRLContext, task
from conveyor.engine.task_events import FINISH_TOPIC
from conveyor.middleware import Barrier, ContextExchanger

WAIT = 20


def broadcast_finish(max_step):
    """DI-engine's ``broadcast_finish_main``: node 1 sets ``task.finish`` in its second iteration; every node ends.

    Node 1 first waits until the others listen for it, so a node still starting cannot miss it."""
    tick = threading.Event()
    with task.start():
        def step(ctx):
            if task.router.node_id == 1 and ctx.total_step == 1:
                task.router.wait_for_subscribers(FINISH_TOPIC, len(task.router.peers()), timeout=WAIT)
                task.finish = True
            tick.wait(0.02)  # pace the loop: the others must not run out of iterations first

        task.use(step)
        task.run(max_step=max_step)
        return task.ctx.total_step


def star_barrier(n_nodes, steps):
    """DI-engine's ``star_barrier``: one Barrier used before and after a step that takes each node its own time.

    Before each pass a node tells the others it got there (an event sent ahead of its arrival at the barrier);
    returns, for each pass, how many other nodes it had heard from when it went through."""
    me = task.router.node_id
    heard, met, lock = {}, [], threading.Lock()
    with task.start(ctx=OnlineRLContext()):
        barrier = Barrier(*range(n_nodes), timeout_s=WAIT)
        done = threading.Event()

        def there(node, k):
            with lock:
                heard.setdefault(k, set()).add(node)

        def arrive(half):
            def mw(ctx):
                k = 2 * ctx.total_step + half
                if half:
                    done.wait(0.01 * (me + 1) * (ctx.total_step + 1))  # nodes arrive at different times
                task.emit("there", me, k, only_remote=True)
            return mw

        def count(half):
            def mw(ctx):
                with lock:
                    met.append(len(heard.get(2 * ctx.total_step + half, ())))
            return mw

        task.on("there", there)
        task.router.wait_for_subscribers("there", n_nodes - 1, timeout=WAIT)
        for half in (0, 1):
            task.use(arrive(half)).use(barrier).use(count(half))
        task.run(max_step=steps)
        return met


def context_exchanger():
    """DI-engine's ``context_exchanger_main``: node 0 learns, node 1 collects, both with
    ``ContextExchanger(skip_n_iter=1)`` first in the chain, 3 iterations; the collector sends lists of arrays
    (trajectories, episodes) and a list of end indices, the learner sends ``train_iter`` back.

    Returns, for each iteration, what the node's middleware saw (the asserts are DI-engine's own)."""
    seen = []
    with task.start(ctx=OnlineRLContext()):
        if task.router.node_id == 0:
            task.add_role(task.role.LEARNER)
        elif task.router.node_id == 1:
            task.add_role(task.role.COLLECTOR)

        task.use(ContextExchanger(skip_n_iter=1))

        if task.has_role(task.role.LEARNER):

            def learner_context(ctx: OnlineRLContext):
                assert len(ctx.trajectories) == 2
                assert len(ctx.trajectory_end_idx) == 4
                assert len(ctx.episodes) == 8
                assert ctx.env_step > 0
                assert ctx.env_episode > 0
                seen.append((len(ctx.trajectories), ctx.trajectory_end_idx, len(ctx.episodes), ctx.env_step,
                             ctx.env_episode))
                yield
                ctx.train_iter += 1

            task.use(learner_context)
        elif task.has_role(task.role.COLLECTOR):

            def collector_context(ctx: OnlineRLContext):
                if ctx.total_step > 0:
                    assert ctx.train_iter > 0
                seen.append(ctx.train_iter)
                yield
                ctx.trajectories = [np.random.rand(10, 10) for _ in range(2)]
                ctx.trajectory_end_idx = [1 for _ in range(4)]
                ctx.episodes = [np.random.rand(10, 10) for _ in range(8)]
                ctx.env_step += 1
                ctx.env_episode += 1

            task.use(collector_context)

        task.run(max_step=3)
    return seen
