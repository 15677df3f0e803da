"""The local Ray cluster that ``--launcher ray`` starts for itself when no ``--ray-address`` is given: private, and
with Ray's token authentication on, so that no other local user can submit code to it.

Ray 2.5x turns token authentication on for a new local cluster only while ``RAY_AUTH_MODE`` is unset, and keeps the
token it generates in ``~/.ray/auth_token`` (written with the process's umask: 0644 under the usual 022). The
launcher does not rely on either: it sets ``RAY_AUTH_MODE=token`` itself (a user's ``RAY_AUTH_MODE=disabled`` is
overridden for this private cluster), generates a token of its own in a file of mode 0600 in a private directory
(mode 0700; Ray's session folder, which Ray makes 0777, lies inside it too, so no other user reaches its logs or
sockets either), and points Ray at that file with ``RAY_AUTH_TOKEN_PATH``: Ray's processes (GCS,
raylet, the actors' workers) inherit the variable, a path, and read the token from the file; the token itself is
on no command line and in no environment. The variables are restored and the directory removed at the end.

Ray starts its workers at niceness 15 by default (``worker_niceness``), as background work for a driver that does
the real work. Here the actors are the run: at niceness 15 its nodes got a few percent of a core wherever any
other process was busy (a run on a shared machine crawled, a test's waits ran out). The cluster starts them at the
launcher's own priority.
"""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

__all__ = ["ClusterStartError", "LocalCluster", "TOKEN_FILE"]

TOKEN_FILE = "auth_token"
"""The token's file in the cluster's temporary directory."""

_WORKER_NICENESS = 0
"""Ray's ``worker_niceness`` for the cluster's workers: none added to the launcher's (Ray's default, 15, starves the
run's nodes on a busy machine)."""

_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
"""What tells Ray whether to authenticate and where its token is (``RAY_AUTH_TOKEN``, the token itself, would take
precedence over the file: it is unset while the cluster runs)."""


class ClusterStartError(RuntimeError):
    """The local Ray cluster did not start; the message says why in Ray's words and what to do."""


class LocalCluster:
    """A local Ray cluster of ``num_cpus`` CPUs, started by :meth:`start` with token authentication on and ended by
    :meth:`stop` (``ray.shutdown``, Ray's variables restored, its temporary directory and token removed).

    ``private``: the directory of mode 0700 that holds the token's file ``token_path`` (mode 0600) and the cluster's
    session folder (its logs and sockets); ``address``: the cluster's GCS address (a client needs the token to use
    it)."""

    def __init__(self, ray: Any, num_cpus: int) -> None:
        self.ray, self.num_cpus = ray, num_cpus
        self.private: Optional[Path] = None
        self.token_path: Optional[Path] = None
        self.address: Optional[str] = None
        self._saved: Dict[str, Optional[str]] = {}

    def start(self) -> "LocalCluster":
        """Generate the token, point Ray at it and start the cluster; on failure, undo all of it."""
        self.private = Path(tempfile.mkdtemp(prefix="conveyor-ray-"))  # 0700; short: Ray's socket paths fit 107 bytes
        try:
            self.token_path = self.private / TOKEN_FILE
            descriptor = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as token_file:
                token_file.write(secrets.token_hex(32))  # 256 bits, as Ray's own generator
            self._saved = {name: os.environ.get(name) for name in _AUTH_VARIABLES}
            os.environ.pop("RAY_AUTH_TOKEN", None)
            os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
            _reload_auth()
            context = self.ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False,
                                    _temp_dir=str(self.private / "ray"),
                                    _system_config={"worker_niceness": _WORKER_NICENESS})
            self.address = context.address_info["gcs_address"]
        except Exception as exc:  # Ray's own, a bare Exception among them: one line that says what to do
            self.stop()
            said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ClusterStartError(
                f"the local Ray cluster did not start ({said}); Ray waits a fixed 30 s for its own helper processes, "
                f"which a busy machine can miss (ray-project/ray#65983): retry on a less loaded machine, or start a "
                f"cluster with `ray start --head` and pass its address with --ray-address") from exc
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """End the cluster, restore Ray's variables as they were and remove the private directory."""
        self.ray.shutdown()
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved = {}
        _reload_auth()  # before the token file goes: Ray reloads the token only while its config says token mode
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)
            self.private = None


def _reload_auth() -> None:
    """Make this process's Ray read the authentication variables again: its config (the mode), then its token cache
    (in that order, as Ray's own test helpers do)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
