"""ProcessCollector: the same collector in a child process, following the learner's weight versions."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conveyor.data import to_tensor
from conveyor.engine import OnlineRLContext, task
from conveyor.envs import make_env_manager
from conveyor.middleware import EPISODE_EVENT, StepCollector, gae_estimator, nstep_reward_enhancer
from conveyor.middleware.collector_process import ProcessCollector, collection_builder
from conveyor.policy import DQNPolicy


@pytest.fixture
def process_collector(request, cfg, policy):
    def make(build=None):
        collector = ProcessCollector(build or collection_builder(cfg, DQNPolicy, one_collector), policy)
        request.addfinalizer(collector.close)
        return collector
    return make


def one_collector(cfg, policy, env):
    return [StepCollector(cfg, policy.collect_mode, env)]


def greedy_ctx():
    ctx = OnlineRLContext()
    ctx.collect_kwargs = {"eps": 0.0}
    return ctx


def test_it_collects_what_the_collector_collects_in_process(cfg, policy, process_collector):
    remote = process_collector()
    with make_env_manager(cfg.env, "collector", seed=cfg.seed) as env:
        local = StepCollector(cfg, policy.collect_mode, env)
        for _ in range(3):
            here, there = greedy_ctx(), greedy_ctx()
            local(here)
            remote(there)
            for key in ("obs", "action", "reward", "next_obs", "terminated", "truncated", "valid", "weight_version"):
                assert torch.equal(here.trajectories[key], there.trajectories[key]), key
            assert (here.env_step, here.env_episode) == (there.env_step, there.env_episode)
            assert here.trajectory_end_idx.tolist() == there.trajectory_end_idx.tolist()


def test_the_child_acts_on_the_newest_published_version(policy, process_collector):
    remote = process_collector()
    ctx = greedy_ctx()
    remote(ctx)
    assert set(ctx.trajectories.weight_version.flatten().tolist()) == {policy.version}
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(1.0)
    newest = policy.publish()
    ctx = greedy_ctx()
    remote(ctx)
    assert set(ctx.trajectories.weight_version.flatten().tolist()) == {newest}


def test_counters_add_to_the_parents_and_episode_events_are_emitted_here(process_collector):
    remote = process_collector()
    lengths = []
    with task.start(ctx=OnlineRLContext()):
        task.on(EPISODE_EVENT, lambda env_index, ret, length: lengths.append(length))
        ctx = greedy_ctx()
        ctx.env_step = 1000
        for _ in range(20):  # CartPole under an untrained greedy policy ends within a few dozen steps
            remote(ctx)
    assert ctx.env_step == 1000 + 20 * 16
    assert ctx.env_episode == len(lengths) > 0


def test_a_killed_child_is_a_clear_error_not_a_hang(process_collector):
    remote = process_collector()
    os.kill(remote.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"collector process \(pid {remote.pid}\) was killed by SIGKILL"):
        remote(greedy_ctx())


def test_an_error_in_the_child_reaches_the_parent_with_its_traceback(cfg, process_collector):
    def build():
        policy = DQNPolicy(cfg.policy)

        def broken(ctx):
            raise ValueError("env exploded")
        return [broken], policy, lambda: None
    remote = process_collector(build)
    with pytest.raises(ValueError, match="env exploded") as info:
        remote(greedy_ctx())
    assert "broken" in str(info.value.__cause__)


def test_close_stops_and_reaps_the_child(process_collector):
    remote = process_collector()
    pid = remote.pid
    remote.close()
    assert not os.path.exists(f"/proc/{pid}")
    with pytest.raises(RuntimeError, match="closed"):
        remote(greedy_ctx())


def test_it_is_refused_a_policy_view():
    with pytest.raises(TypeError, match="pass the Policy object"):
        ProcessCollector(lambda: None, object())


def collect_then_nstep(cfg, policy, env):
    return [StepCollector(cfg, policy.collect_mode, env), nstep_reward_enhancer(cfg)]


def test_a_chain_runs_in_the_child_as_it_runs_here(cfg, policy, process_collector):
    cfg.policy.nstep = 3
    remote = process_collector(collection_builder(cfg, DQNPolicy, collect_then_nstep))
    with make_env_manager(cfg.env, "collector", seed=cfg.seed) as env:
        local = collect_then_nstep(cfg, policy, env)
        for _ in range(4):
            here, there = greedy_ctx(), greedy_ctx()
            for mw in local:
                mw(here)
            remote(there)
            for key in ("obs", "reward", "discount", "next_obs", "terminated"):
                assert torch.equal(here.trajectories[key], there.trajectories[key]), key


def test_its_state_resumes_the_child_chain_where_it_stopped(cfg, policy, process_collector):
    cfg.policy.nstep = 3
    build = collection_builder(cfg, DQNPolicy, collect_then_nstep)
    first = process_collector(build)
    for _ in range(3):
        first(greedy_ctx())
    state = first.state_dict()
    second = process_collector(build)
    second.load_state_dict(state)
    a, b = greedy_ctx(), greedy_ctx()
    first(a)
    second(b)
    for key in ("obs", "reward", "discount", "next_obs"):
        assert torch.equal(a.trajectories[key], b.trajectories[key]), key


def ppo(cfg, **model):
    """A PPO config (with ``model`` options) and learner policy on the fixture's CartPole envs."""
    from easydict import EasyDict

    from conveyor.config import compile_config
    from conveyor.policy import PPOPolicy
    learn = dict(batch_size=8, sequence_length=4) if model.get("rnn") else dict(batch_size=8)
    ppo_cfg = compile_config(EasyDict(dict(
        exp_name="test", seed=0, env=dict(cfg.env),
        policy=dict(model=dict(hidden_sizes=[8], **model), collect=dict(n_sample=8), learn=learn))), policy=PPOPolicy)
    return ppo_cfg, PPOPolicy, PPOPolicy(ppo_cfg.policy, seed=0)


def collect_then_gae(cfg, policy, env):
    return [StepCollector(cfg, policy.collect_mode, env), gae_estimator(cfg, policy.collect_mode)]


CARRIED = {  # what a replica carries between calls: its exploration rng, a GRU's hidden state, PPO's running returns
    "dqn_exploring": lambda cfg, policy: (cfg, DQNPolicy, policy, one_collector),
    "recurrent_ppo": lambda cfg, policy: (*ppo(cfg, rnn="gru", rnn_hidden_size=8), one_collector),
    "reward_norm_ppo": lambda cfg, policy: (*ppo(cfg, reward_norm=True), collect_then_gae),
}


@pytest.fixture
def one_torch_thread():
    """As the zoo runs (seed_everything): a child forked from a parent with a multi-threaded OpenMP pool hangs
    in LAPACK (PPO's orthogonal init) when it uses more than one thread itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", sorted(CARRIED))
def test_its_state_carries_what_the_replica_carries_between_calls(request, cfg, policy, make, one_torch_thread):
    collect_cfg, policy_cls, learner, chain = CARRIED[make](cfg, policy)
    build = collection_builder(collect_cfg, policy_cls, chain)

    def collector():
        made = ProcessCollector(build, learner)
        request.addfinalizer(made.close)
        return made

    def exploring():
        ctx = OnlineRLContext()
        ctx.collect_kwargs = {"eps": 0.5} if make == "dqn_exploring" else {}  # PPO samples from its rng
        return ctx

    first = collector()
    for _ in range(3):  # mid-episode: a recurrent policy's hidden state is not the initial one
        first(exploring())
    second = collector()
    second.load_state_dict(first.state_dict())
    a, b = exploring(), exploring()
    first(a)
    second(b)
    for key in a.trajectories.keys():
        assert torch.equal(a.trajectories[key], b.trajectories[key]), key
    if make == "reward_norm_ppo":  # the running returns went on from the first's, not from zero as a fresh one's
        assert torch.equal(a.train_data.discounted_return, b.train_data.discounted_return)
        fresh, c = collector(), exploring()
        fresh(c)
        assert not torch.equal(a.train_data.discounted_return, c.train_data.discounted_return)


def test_the_child_never_finalizes_garbage_it_inherited(cfg, policy, process_collector, tmp_path):
    pynng = pytest.importorskip("pynng")
    import gc

    class Cycle:
        pass

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        garbage = Cycle()
        garbage.self, garbage.socket = garbage, pynng.Pair0(listen=f"ipc://{tmp_path}/inherited.ipc")
        del garbage  # unreachable, not yet collected: closing this nng socket in a forked child aborts it

        def build():
            gc.collect()  # what any allocation in the child may trigger
            replica, env = DQNPolicy(cfg.policy), make_env_manager(cfg.env, "collector", seed=0)
            return one_collector(cfg, replica, env), replica, env.close
        remote = process_collector(build)
    finally:
        if was_enabled:
            gc.enable()
        gc.collect()  # the parent closes the socket, as it should
    remote(greedy_ctx())



@pytest.mark.slow  # a spawned child imports torch afresh: seconds
def test_a_spawned_child_uses_the_parents_torch_thread_count(cfg):
    import ctypes
    gomp = next((line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line), None)
    if gomp is None:
        pytest.skip("torch is not built with GNU OpenMP here")

    def build():
        def probe(ctx):  # what OpenMP uses in the child's thread; torch's default there is every core
            ctx.episodes = [ctypes.CDLL(gomp).omp_get_max_threads()]
        return [probe], DQNPolicy(cfg.policy), lambda: None
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ProcessCollector(build, DQNPolicy(cfg.policy), start_method="spawn") as remote:
            ctx = greedy_ctx()
            remote(ctx)
    finally:
        torch.set_num_threads(before)
    assert ctx.episodes == [1]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least two CPUs")
def test_split_cpus_gives_this_thread_one_cpu_and_the_child_the_others_until_closed(cfg):
    def build():
        def probe(ctx):
            ctx.episodes = [sorted(os.sched_getaffinity(0))]
        return [probe], DQNPolicy(cfg.policy), lambda: None
    allowed = os.sched_getaffinity(0)
    with ProcessCollector(build, DQNPolicy(cfg.policy), split_cpus=True) as remote:
        here = os.sched_getaffinity(0)
        ctx = greedy_ctx()
        remote(ctx)
    assert len(here) == 1 and here < allowed
    assert ctx.episodes == [sorted(allowed - here)]
    assert os.sched_getaffinity(0) == allowed  # given back on close
    with ProcessCollector(build, DQNPolicy(cfg.policy), split_cpus=False) as remote:
        remote(ctx)
        assert os.sched_getaffinity(0) == allowed
    assert ctx.episodes == [sorted(allowed)]
    first = ProcessCollector(build, DQNPolicy(cfg.policy), split_cpus=True)
    pinned = os.sched_getaffinity(0)
    with ProcessCollector(build, DQNPolicy(cfg.policy), split_cpus=True) as second:  # shares the first's split
        first.close()
        assert os.sched_getaffinity(0) == pinned  # still split: the second is open
        second(ctx)
    assert ctx.episodes == [sorted(allowed - pinned)] and os.sched_getaffinity(0) == allowed


@pytest.fixture
def busy_process():
    """Another process that keeps a CPU busy (a spinning loop), running once the fixture returns; killed after."""
    proc = subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "spinning\n"
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) != 2 or os.cpu_count() != 2,
                    reason="the default split is for a process on a two-CPU machine")
def test_by_default_the_cpus_are_not_split_while_another_process_keeps_one_busy(cfg, busy_process):
    allowed = os.sched_getaffinity(0)
    with ProcessCollector(lambda: ([], DQNPolicy(cfg.policy), lambda: None), DQNPolicy(cfg.policy)):
        assert os.sched_getaffinity(0) == allowed  # a pinned thread could not move off the busy CPU
    assert os.sched_getaffinity(0) == allowed


IMAGE_STEPS, IMAGE_ENVS = 8, 4  # obs of 8 x 4 x 4x84x84 uint8 = 903 KB a call: past the shared-memory threshold


def image_batch(seed, steps):
    rng = np.random.default_rng(seed)
    return {"obs": rng.integers(0, 256, (steps, IMAGE_ENVS, 4, 84, 84), dtype=np.uint8),
            "reward": rng.standard_normal((steps, IMAGE_ENVS)).astype(np.float32),
            "terminated": rng.random((steps, IMAGE_ENVS)) < 0.1}


def image_rollouts(cfg, double_from=None):
    """A child chain writing a different image batch (and an image episode) each call; from call ``double_from``
    on, batches twice as long."""
    def build():
        calls = []

        def rollout(ctx):
            calls.append(None)
            steps = IMAGE_STEPS * (2 if double_from is not None and len(calls) >= double_from else 1)
            ctx.trajectories = to_tensor(image_batch(len(calls), steps))
            ctx.episodes = [to_tensor(image_batch(1000 + len(calls), 3))]
            ctx.env_step += steps * IMAGE_ENVS
        return [rollout], DQNPolicy(cfg.policy), lambda: None
    return build


def shm_mapped(pid="self"):
    """The shared-memory files process ``pid`` maps (and has not seen unlinked)."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")}


def assert_equal_batch(tree, expected):
    for key, value in expected.items():
        assert np.array_equal(tree[key].numpy(), value), key


def test_image_batches_come_back_exactly_through_one_shared_block_reused_by_every_call(cfg, process_collector):
    remote = process_collector(image_rollouts(cfg))
    before = shm_mapped()
    got, mapped = [], []
    for _ in range(4):
        ctx = greedy_ctx()
        remote(ctx)
        got.append(ctx)
        mapped.append(shm_mapped())
    for call, ctx in enumerate(got, 1):  # copied out: later calls, writing the same block, changed nothing here
        assert_equal_batch(ctx.trajectories, image_batch(call, IMAGE_STEPS))
        assert_equal_batch(ctx.episodes[0], image_batch(1000 + call, 3))
        assert ctx.trajectories.obs.dtype == torch.uint8
    assert len(mapped[0] - before) == 1 and mapped[0] == mapped[1] == mapped[2] == mapped[3]
    assert (mapped[0] - before) <= shm_mapped(remote.pid)  # the child writes into the same block


def test_a_batch_outgrowing_the_block_comes_back_exactly_and_the_old_block_is_freed(cfg, process_collector):
    remote = process_collector(image_rollouts(cfg, double_from=3))
    before = shm_mapped()
    blocks = []
    for call in range(1, 6):
        ctx = greedy_ctx()
        remote(ctx)
        assert_equal_batch(ctx.trajectories, image_batch(call, IMAGE_STEPS * (2 if call >= 3 else 1)))
        blocks.append(shm_mapped() - before)
    assert all(len(b) == 1 for b in blocks) and blocks[1] != blocks[2] and blocks[2] == blocks[4]
    assert not os.path.exists(f"/dev/shm/{next(iter(blocks[1])).rsplit('/', 1)[-1]}")


def test_small_batches_make_no_shared_block(process_collector):
    remote = process_collector()
    before = shm_mapped()
    remote(greedy_ctx())
    assert shm_mapped() == before


@pytest.mark.parametrize("kill", [False, True], ids=["closed", "child-killed"])
def test_no_shared_memory_is_left_after_close(cfg, kill):
    before = shm_mapped()
    remote = ProcessCollector(image_rollouts(cfg), DQNPolicy(cfg.policy))
    try:
        for _ in range(2):
            remote(greedy_ctx())
        made = shm_mapped() - before
        if kill:
            os.kill(remote.pid, signal.SIGKILL)
    finally:
        remote.close()
    assert len(made) == 2  # the weights and the output block
    assert not any(os.path.exists(path) for path in made)
