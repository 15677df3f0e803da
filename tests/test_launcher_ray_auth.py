"""The local Ray cluster ``--launcher ray`` starts for itself (:class:`conveyor.cli._ray_local.LocalCluster`): token
authentication on even where the user's environment says ``RAY_AUTH_MODE=disabled``, the token in a private file,
on no command line. One cluster of 1 CPU for the module; no training run (``tests/test_launcher_ray.py`` trains on
the launcher's cluster)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli._ray_local import LocalCluster

CLIENT_S = 120  # seconds: bound on a client's connection (a refused one gives up after about 25 s here)
CLIENT = """import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except ConnectionError as exc:
    print("refused:", " ".join(str(exc.__cause__).split()))
else:
    print("connected:", ray.get(ray.remote(lambda: 42).remote()))
"""
REFUSAL = "AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing or incorrect"
"""What Ray 2.60 says when the GCS refuses a missing or wrong token (its last connection error, in its message)."""
USER = {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "the user's own token"}
"""What the user's environment says (and the cluster must not heed)."""


@pytest.fixture(scope="module")
def cluster():
    """The module's cluster, started as the launcher does under :data:`USER`'s variables, stopped at the end."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    assert not ray.is_initialized(), "another test left this process connected to a Ray cluster"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in USER.items():
            patch.setenv(name, value)
        local = LocalCluster(ray, 1)
        try:
            yield local.start()
        finally:
            local.stop()


def clients(cluster, tmp_path, **envs):
    """What :data:`CLIENT` printed, connecting to ``cluster`` with each of ``envs``' Ray variables (none of the
    user's or the cluster's, and a home without Ray's default token file), the clients run side by side."""
    base = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    started = {name: subprocess.Popen([sys.executable, "-c", CLIENT, cluster.address], text=True,
                                      env={**base, "HOME": str(tmp_path), **env}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
               for name, env in envs.items()}
    try:
        return {name: client.communicate(timeout=CLIENT_S)[0].strip().splitlines()[-1:]
                for name, client in started.items()}
    finally:
        for client in started.values():
            if client.poll() is None:
                client.kill()
                client.wait()


def test_the_token_file_is_mode_600_in_a_directory_of_mode_700(cluster):
    assert cluster.token_path.parent == cluster.private
    assert cluster.private.stat().st_mode & 0o777 == 0o700
    assert cluster.token_path.stat().st_mode & 0o777 == 0o600
    assert len(cluster.token_path.read_text()) == 64


def test_a_client_without_the_token_or_with_another_is_refused(cluster, tmp_path):
    printed = clients(cluster, tmp_path, none={}, wrong={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
                      users={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": USER["RAY_AUTH_TOKEN"]})
    assert {name: lines[0].startswith("refused:") and REFUSAL in lines[0] for name, lines in printed.items()} == {
        "none": True, "wrong": True, "users": True}, printed


def test_a_client_given_the_token_file_connects_and_runs_a_task(cluster, tmp_path):
    assert clients(cluster, tmp_path, token={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(cluster.token_path)}
                   ) == {"token": ["connected: 42"]}


def test_the_token_is_on_no_command_line_and_in_no_environment(cluster):
    ray = cluster.ray
    assert ray.get(ray.remote(lambda: os.environ.get("RAY_AUTH_TOKEN_PATH")).remote()) == str(cluster.token_path)
    token = cluster.token_path.read_bytes()
    ray_processes, found = 0, []
    for proc in Path("/proc").iterdir():
        try:
            cmdline, environ = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
        except OSError:  # ended, or not ours
            continue
        ray_processes += str(cluster.private).encode() in cmdline + environ
        found += [f"{proc.name} {part}" for part, text in (("cmdline", cmdline), ("environ", environ)) if token in text]
    assert ray_processes >= 3, "the GCS, the raylet and a worker should name the cluster's private directory"
    assert found == []


def test_stopping_restores_the_users_variables_and_removes_the_token(cluster):
    assert os.environ["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in os.environ
    private = cluster.private
    cluster.stop()
    assert not cluster.ray.is_initialized()
    assert {name: os.environ.get(name) for name in (*USER, "RAY_AUTH_TOKEN_PATH")} == {**USER,
                                                                                      "RAY_AUTH_TOKEN_PATH": None}
    assert not private.exists()
