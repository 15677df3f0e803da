"""Worker mains for the runner tests (module-level, so they reach the workers by reference)."""
import json
import os
import sys
import threading
from pathlib import Path

from conveyor.engine import task

WAIT = 20  # seconds: the bound on every wait in a worker; a healthy run takes well under one


def exchange(out_dir, topology):
    """Say hello on "hello" to the workers that listen, write what arrived in ``out_dir/<node>.json``.

    Star: the hub hears every leaf, a leaf hears the hub. Mesh: everyone hears everyone."""
    router = task.router
    me, n = router.node_id, router.n_workers
    senders = [i for i in range(n) if i != me] if me == 0 or topology == "mesh" else [0]
    got, lock, all_in = [], threading.Lock(), threading.Event()

    def heard(sender, text):
        with lock:
            got.append([sender, text])
            if len(got) == len(senders):
                all_in.set()

    task.on("hello", heard)
    router.wait_for_subscribers("hello", len(senders), timeout=WAIT)
    task.emit("hello", me, f"hello from {me}", only_remote=True)
    assert all_in.wait(WAIT), f"node {me} heard {got} of {senders} within {WAIT}s"
    Path(out_dir, f"{me}.json").write_text(json.dumps(sorted(got)))
    return me


def fail_on(out_dir, node_id, message):
    """Every worker writes ``pid-<node>``; ``node_id`` raises once the others have (they said "up")."""
    router = task.router
    Path(out_dir, f"pid-{router.node_id}").write_text(str(os.getpid()))
    if router.node_id == node_id:
        for _ in range(router.n_workers - 1):
            task.wait_for("up", timeout=WAIT)
        raise ValueError(message)
    router.wait_for_subscribers("up", 1, timeout=WAIT)
    task.emit("up", only_remote=True)
    threading.Event().wait(60)  # the runner stops this worker when the other one fails


def ready_then_wait(out_dir):
    """Write a ready file, say so on stdout, then wait to be stopped."""
    Path(out_dir, f"ready-{task.router.node_id}").write_text(str(os.getpid()))
    os.write(sys.stdout.fileno(), f"ready {task.router.node_id} {os.getpid()}\n".encode())  # one write: lines stay whole
    threading.Event().wait(60)


def whoami(x):
    return {"node_id": task.router.node_id, "n_workers": task.router.n_workers, "is_active": task.router.is_active,
            "restarts": task.router.restarts, "x": x, "pid": os.getpid(),
            "cmdline": Path("/proc/self/cmdline").read_bytes(), "environ": Path("/proc/self/environ").read_bytes()}


def note_at_exit(out_dir):
    """Register an exit handler that writes ``out_dir/exit-<node>``; return this worker's parent pid."""
    import atexit
    path = Path(out_dir, f"exit-{task.router.node_id}")
    atexit.register(path.write_text, "ran")
    return os.getppid()


def parent_signals():
    """The parent's (the zygote's) blocked and ignored signal masks, from /proc."""
    fields = dict(line.split(":\t") for line in Path(f"/proc/{os.getppid()}/status").read_text().splitlines()
                  if ":\t" in line)
    return {"blocked": int(fields["SigBlk"], 16), "ignored": int(fields["SigIgn"], 16)}


def fail_while_the_other_is_exiting(fifo):
    """Node 1 returns and then waits in an exit handler (having said so on the FIFO ``fifo``); node 0 raises
    once it has heard that, so the launcher's SIGTERM reaches node 1 inside its exit handler."""
    import atexit
    import select
    if task.router.node_id == 1:
        def exiting():
            with open(fifo, "wb") as out:
                out.write(b"x")
            threading.Event().wait(WAIT)
        atexit.register(exiting)
        return 1
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert select.select([fd], [], [], WAIT)[0] and os.read(fd, 1) == b"x", "node 1 never reached its exit handler"
    finally:
        os.close(fd)
    raise ValueError("node 0 fails while node 1 runs its exit handlers")


def end_or_wait_for_a_rejoin(ignore_sigterm=False):
    """Node 0, the run's owner, returns at once. The others run as a collector that lost its learner and missed its
    end (a cut link, a SIGSTOP): their iteration waits up to 3 * WAIT for a learner to rejoin, or for the stop
    (``STOP_EVENT``, as every exchanger's wait); they return what ended the wait. ``ignore_sigterm``: they hold
    SIGTERM (a node that cannot stop gracefully)."""
    import signal

    from conveyor.engine import STOP_EVENT, OnlineRLContext
    if task.router.node_id == 0:
        return "owner"
    stopped = threading.Event()
    with task.start(ctx=OnlineRLContext()):
        task.on(STOP_EVENT, stopped.set)
        if ignore_sigterm:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        task.use(lambda ctx: stopped.wait(3 * WAIT))
        task.run(max_step=1)
    return "stopped" if stopped.is_set() else "waited"
