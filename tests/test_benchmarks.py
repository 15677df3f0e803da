"""Every benchmark script runs in its quick form (``python -m benchmarks.NAME``, as the docs run it) and ends with
the JSON line its issue names.

Figures are not checked here (machines are noisy); only that the scripts work and report what they promise.
"""
import ast
import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "async_pipeline": (["--quick", "--entries", "cartpole/dqn"], {"entries", "min_speedup", "min_of_ideal"}),
    "collector_throughput": (["--quick"], {"steps_per_s", "baseline_steps_per_s", "ratio"}),
    "solve": (["cartpole/dqn", "--seeds", "1", "--max-env-step", "2000", "--set", "policy.learn.learning_rate=2e-3"],
              {"entry", "seeds", "solved_seeds", "env_steps", "wall_s", "median_env_steps", "median_wall_s"}),
    "env_managers": (["--quick"], {"benchmark"}),
    "replay_buffer": (["--quick"], {"capacity"}),
    "sac_learn_step": (["--quick"], {"rows", "geomean_speedup"}),
    "learning_curve": (["cartpole/dqn", "--quick", "--set", "policy.learn.learning_rate=2e-3"],
                       {"entry", "final_returns", "mean_final_return", "final_train_returns"}),
    "mujoco_throughput": (["--quick"], {"sac_vs_sb3", "ours_steps_per_s"}),
    "atari_throughput": (["--quick"], {"ppo_vs_sb3", "collector_vs_envpool", "collector_vs_gym_vector"}),
    "atari_learning": (["--quick"], {"ours_final_train_returns", "sb3_final_train_returns", "ratio",
                                     "seeds_at_or_above"}),
    "transport": (["--quick"], {"ratio_1k", "ratio_64k", "ratio_1m"}),
    "process_start": (["--pairs", "1", "--workers", "2"], {"zygote_ready_s", "forkserver_ready_s", "ready_ratio",
                                                            "total_ratio"}),
    "learner_scaling": (["--quick"], {"updates_per_s_1", "updates_per_s_2", "ratio", "independent_ratio",
                                             "allreduce_ms", "cpu", "physical_cores"}),
    "distributed_throughput": (["--quick"], {"one_collector_steps_per_s", "two_collectors_steps_per_s", "ratio"}),
    "offline": (["--quick"], {"bc_expert", "cql_expert", "bc_mixed", "cql_mixed", "behaviour_pendulum", "cql_pendulum",
                              "iql_pendulum", "fetch_ratio",
                              *(f"{algo}_{env}_{kind}" for algo in ("bc", "cql", "iql", "behaviour")
                                for env in ("halfcheetah", "hopper") for kind in ("m", "mr"))}),
    "impala_throughput": (["--quick"], {"steps_per_s_1", "steps_per_s_2", "ratio", "mean_policy_lag"}),
    "trajectory_transport": (["--quick"], {"batches_per_s_ratio", "cpu_per_batch_ratio", "learner_steps_ratio"}),
    "inference_server": (["--quick"], {"server_steps_per_s", "local_steps_per_s", "ratio", "server_acts_on"}),
    "impala_learning": (["--quick"], {"impala_final_train_returns", "ppo_final_train_returns", "impala_wall_s",
                                      "ppo_wall_s", "seeds_at_or_above", "seeds_faster"}),
    "marl_learning": (["--quick"], {"mappo_return", "benchmarl_mappo_return", "return_ratio", "qmix_return_ratio",
                                    "steps_per_s", "benchmarl_steps_per_s", "speed_ratio"}),
    "vs_sample_factory": (["--quick"], {"ppo_fps_ratio", "appo_fps_ratio", "ours_ppo_fps", "sf_ppo_fps",
                                        "ours_appo_fps", "sf_appo_fps"}),
    # Local only: Ray's launch (about 40 s here) is left to tests/test_launcher_ray.py, which starts the same
    # launcher, and Slurm's (a cluster started, the job, the cluster stopped: 45 s of the 80 this case took under
    # load) to tests/test_slurm_cluster.py, which submits the job of the same `conveyor slurm-script` to the same
    # Cluster; the benchmark's own Slurm command is checked below
    "launch_overhead": (["--quick", "--launchers", "local"],
                        {"local_s", "slurm_s", "ray_s", "slurm_vs_local", "ray_vs_local", "slurm_mode"}),
    "soak": (["--quick"], {"rss_growth_mb_per_h", "fd_growth", "thread_growth", "shm_growth", "ended_cleanly"}),
    "chaos": (["--quick"], {"kills", "recoveries", "unaccounted_transitions", "solved", "wall_s", "transitions"}),
    "solve --distributed": (["cartpole/dqn", "--seeds", "1", "--max-env-step", "500", "--distributed", "1,2,1"],
                            {"solved_seeds", "median_wall_s", "single_median_wall_s", "wall_ratio", "startup_s",
                             "wall_ratio_after_startup"}),
}

LONGEST_FIRST = ("launch_overhead", "chaos", "vs_sample_factory", "impala_throughput", "trajectory_transport", "soak",
                 "offline",
                 "atari_throughput", "learner_scaling", "impala_learning", "marl_learning", "distributed_throughput", "atari_learning",
                 "solve --distributed", "inference_server", "env_managers", "mujoco_throughput", "learning_curve")
"""The cases started first, in this order (their quick runs took about 40-60 s down to 6 s alone on 2 cores, the
others 2 to 6 s): the long ones overlap, and the short ones fill the second slot at the end instead of one long run
holding the module up alone. launch_overhead mostly waits for Slurm and Ray to start."""


def _start_order(name: str) -> tuple:
    return (LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST), name)


def benchmark(name: str, *args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -m benchmarks.NAME ARGS`` in ``cwd``, this checkout's ``benchmarks`` and ``conveyor`` imported."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": path})


def _run(name: str, cwd: Path) -> subprocess.CompletedProcess:
    return benchmark(name.split()[0], *CASES[name][0], cwd=cwd, timeout=240)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The selected quick runs, two at a time (these machines have two cores), the longest first, started at the
    first test that asks."""
    selected = sorted({item.callspec.params["name"] for item in request.session.items
                       if getattr(item, "originalname", None) == "test_benchmark_runs_and_ends_with_its_json_line"},
                      key=_start_order)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield {name: pool.submit(_run, name, tmp_path_factory.mktemp(name.replace(" ", "_"))) for name in selected}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES, key=_start_order))
def test_benchmark_runs_and_ends_with_its_json_line(name, runs):
    """The cases run as their runs start, so a test waits for its own run (bounded by ``_run``'s timeout, under
    the test's), not for the ones started before it."""
    out = runs[name].result()
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert CASES[name][1] <= set(summary), sorted(summary)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: the next test runs it")
def test_the_device_path_benchmark_without_a_gpu_is_one_line(tmp_path):
    out = benchmark("device_path", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "torch sees no CUDA device" in out.stderr.strip().splitlines()[-1], out.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_the_offline_benchmark_on_cuda_without_a_gpu_is_one_line_before_any_run(tmp_path):
    out = benchmark("offline", "--quick", "--device", "cuda", "--workdir", str(tmp_path / "work"), cwd=tmp_path,
                    timeout=120)
    assert out.returncode == 2 and "torch sees no CUDA device" in out.stderr.strip().splitlines()[-1], out.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_the_sample_factory_benchmark_on_cuda_without_a_gpu_is_one_line(tmp_path):
    out = benchmark("vs_sample_factory", "--device", "cuda", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "torch sees no CUDA device" in out.stderr.strip().splitlines()[-1], out.stderr


@pytest.mark.cuda
@pytest.mark.slow
def test_the_device_path_benchmark_reports_cuda_against_cpu(tmp_path):
    out = benchmark("device_path", "--quick", "--parts", "updates", cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"device", "updates_per_s", "cuda_vs_cpu"} <= set(summary) and "CUDA" in summary["device"]


def test_the_launch_overhead_benchmarks_slurm_job_is_its_run_of_one_learner_and_two_collectors(tmp_path):
    """The job script the Slurm leg submits (its run is left out of the quick case above) is the one-node job of 3
    tasks, with the tiny config and budget the other launchers' runs have."""
    from benchmarks.launch_overhead import BUDGET, SETS, slurm_script_command

    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(slurm_script_command("slurm-1", 25000), cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=3\n" in out.stdout
    srun = next(line for line in out.stdout.splitlines() if line.startswith("exec srun conveyor train cartpole/dqn"))
    assert all(value.strip("'") in srun for value in [*SETS, *BUDGET]), srun


def test_benchmarl_mappo_takes_as_many_gradient_steps_per_rollout_as_mpe_mappo():
    """BenchMARL 1.5.2's on-policy loop (``Experiment._collection_loop``) makes ``on_policy_n_minibatch_iters`` passes
    over a rollout, each of ceil(frames / minibatch size) minibatch steps: the setting counts epochs, not steps."""
    from benchmarks.marl_learning import benchmarl_settings
    from conveyor.zoo import load_entry

    learn, n_sample = (cfg := load_entry("mpe/mappo").main_config).policy.learn, cfg.policy.collect.n_sample
    theirs = benchmarl_settings("mappo")["experiment"]
    their_steps = theirs["on_policy_n_minibatch_iters"] * -(-theirs["on_policy_collected_frames_per_batch"]
                                                            // theirs["on_policy_minibatch_size"])
    assert their_steps == learn.epoch_per_collect * -(-n_sample // learn.batch_size)


def test_a_benchmark_imports_only_the_helper_modules_of_its_package_never_the_tests_and_patches_no_sys_path():
    scripts = {path.stem for path in (ROOT / "benchmarks").glob("*.py")}
    wrong = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = ["." * node.level + (node.module or "")]
            else:
                if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                        and node.value.id == "sys"):
                    wrong.append(f"{path.name}:{node.lineno}: sys.path")
                continue
            for module in modules:
                top, _, rest = module.partition(".")
                if (top in ("tests", "") or top in scripts
                        or (top == "benchmarks" and not rest.startswith("_"))):
                    wrong.append(f"{path.name}:{node.lineno}: imports {module}")
    assert wrong == []
