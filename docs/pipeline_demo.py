"""A minimal Conveyor pipeline: a fake collector and learner, run in sync then async mode.

    python docs/pipeline_demo.py
"""
import time

from conveyor import OnlineRLContext, task


def collector(ctx: OnlineRLContext) -> None:
    """Pretends to step envs: 5 ms of GIL-free work, 64 env steps."""
    time.sleep(0.005)
    ctx.trajectories = list(range(64))
    ctx.env_step += len(ctx.trajectories)


def learner(ctx: OnlineRLContext):
    """Pretends to train on what was collected, and reports on the way back up the onion."""
    time.sleep(0.005)
    ctx.train_iter += 1
    yield
    if ctx.train_iter % 50 == 0:
        print(f"  iteration {ctx.total_step:3d}: env_step={ctx.env_step} train_iter={ctx.train_iter}")


for async_mode in (False, True):
    print(f"async_mode={async_mode}")
    with task.start(async_mode=async_mode, ctx=OnlineRLContext()):
        task.use(collector).use(learner)
        start = time.perf_counter()
        task.run(max_step=100)
        print(f"  100 iterations in {time.perf_counter() - start:.2f} s")
        for name, s in task.stats().items():
            print(f"  {name:<10} calls={s['calls']} mean={s['mean_s'] * 1000:.2f} ms p95={s['p95_s'] * 1000:.2f} ms")
