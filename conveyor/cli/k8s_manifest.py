"""``conveyor k8s-manifest``: print a Kubernetes manifest that trains a zoo entry with one pod per node.

    conveyor k8s-manifest cartpole/dqn --collectors 2 --image registry.example/conveyor:1 > job.yaml
    kubectl create secret generic cartpole-dqn-secret \\
        --from-literal=secret=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')
    kubectl apply -f job.yaml

Two objects: a headless Service (its DNS gives pod ``<name>-<i>`` the name ``<name>-<i>.<name>``, ready or not)
and an indexed Job of 1 + C + M completions, all running at once. Every pod runs ``conveyor train ...
--launcher kubernetes``: its ``JOB_COMPLETION_INDEX`` is its node id, ``CONVEYOR_NODES`` and
``CONVEYOR_NODE_HOST`` (set here) say how many nodes there are and where (``conveyor.engine.parallel.cluster``).
The secret is the key ``secret`` of a Kubernetes Secret, mounted read-only with mode 0400 (the container's
user must own it: no ``fsGroup``, which would make it group-readable, and the run refuses such a secret).
A Job has one pod template, so every pod asks for the same ``--cpu`` and ``--memory``: size them for the
learner. The run directory is ``--runs-claim`` (a PersistentVolumeClaim), else an ``emptyDir`` lost with
the pod, checkpoints included. A failed pod is retried up to ``--backoff-limit`` times (default 3; 0 with several
learners, whose run cannot resume): its ``--resume-if-exists`` goes on from the latest checkpoint when the run
directory is a claim, and so does applying the Job again after deleting it.
"""
from __future__ import annotations

import argparse
import re
from typing import Any, Dict, List, Tuple

from conveyor.cli._jobs import add_job_parser, checked_layout, default_exp_name, train_command

__all__ = ["register", "manifest", "objects"]

SECRET_DIR = "/etc/conveyor"
"""Where the pods mount the Secret (its key ``secret`` is the file ``--secret-file`` reads)."""

WORKDIR = "/work"
"""The pods' working directory: the run goes in ``/work/runs/<exp-name>``."""

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9.]+[a-zA-Z]{0,2}$")


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``k8s-manifest`` subcommand."""
    parser = add_job_parser(commands, "k8s-manifest", manifest, help="print a Kubernetes indexed Job training an entry",
                            description="Print a Kubernetes manifest (a headless Service and an indexed Job, one pod "
                                        "per node: 1 learner + C collectors + M evaluators) that trains ENTRY; apply "
                                        "it with `kubectl apply -f FILE`.",
                            exp_name_help="the run's name (default: the entry's); the Service and the Job are named "
                                          "after it")
    parser.add_argument("--image", required=True, help="a container image with conveyor installed")
    parser.add_argument("--secret-name", default=None, metavar="S",
                        help="the Kubernetes Secret whose key 'secret' is the run's secret (default <name>-secret)")
    parser.add_argument("--runs-claim", default=None, metavar="PVC",
                        help="a PersistentVolumeClaim for the run directory (default: an emptyDir, lost with the pod)")
    parser.add_argument("--backoff-limit", type=int, default=None, metavar="N",
                        help="retries of failed pods before the Job fails (default 3; 0 with --learners above 1, "
                             "whose run cannot resume); a retried pod resumes the run from a --runs-claim")
    parser.add_argument("--cpu", default="1", help="CPU request of every pod (default 1)")
    parser.add_argument("--memory", default="2Gi", help="memory request of every pod (default 2Gi)")


def manifest(args: argparse.Namespace) -> str:
    """The manifest of ``args`` as YAML documents; ValueError with one line for bad input."""
    import yaml

    service, job = objects(args)
    retries = job["spec"]["backoffLimit"]
    if args.runs_claim:
        runs = [f"# Runs go to the PersistentVolumeClaim {args.runs_claim}: checkpoints outlive the pods, and a",
                f"# retried pod (backoffLimit {retries}) resumes the run from its latest checkpoint."]
    else:
        runs = [f"# Runs go to an emptyDir: its checkpoints are LOST with the pod, and a retried pod (backoffLimit",
                f"# {retries}) starts the run over; give --runs-claim PVC to keep them."]
    header = [f"# conveyor train {args.entry} on Kubernetes: `kubectl apply -f` this file. The Secret first:",
              f"# kubectl create secret generic {_names(args)[1]} --from-literal=secret=$(head -c 32 /dev/urandom "
              f"| od -An -tx1 | tr -d ' \\n')", *runs]
    body = yaml.safe_dump_all([service, job], sort_keys=False, default_flow_style=False)
    return "\n".join(header) + "\n" + body


def objects(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """The Service and the Job of ``args``; ValueError with one line for bad input."""
    from conveyor.schema import ConfigError
    from conveyor.run.directory import check_exp_name

    layout = checked_layout(args)
    for flag, value in (("--cpu", args.cpu), ("--memory", args.memory)):
        if not _QUANTITY.match(value):
            raise ConfigError(f"{flag} {value!r}: expected a Kubernetes quantity such as 500m, 2 or 4Gi")
    retries = (3 if args.learners == 1 else 0) if args.backoff_limit is None else args.backoff_limit
    if retries < 0:
        raise ConfigError(f"--backoff-limit must be >= 0, got {retries}")
    if retries > 0 and args.learners > 1:
        raise ConfigError(f"--backoff-limit {retries} with --learners {args.learners}: a retried pod would resume the "
                          f"run, which several learners cannot yet; leave --backoff-limit out (0)")
    exp_name = args.exp_name if args.exp_name is not None else default_exp_name(args.entry)
    check_exp_name(exp_name)
    name, secret_name = _names(args)
    n = layout.n_nodes
    labels = {"app.kubernetes.io/name": "conveyor", "app.kubernetes.io/instance": name}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"job-name": name}}}
    command = train_command(args, "kubernetes", exp_name, f"{SECRET_DIR}/secret")
    runs = {"persistentVolumeClaim": {"claimName": args.runs_claim}} if args.runs_claim else {"emptyDir": {}}
    container = {"name": "node", "image": args.image, "workingDir": WORKDIR, "command": command,
                 "env": [{"name": "CONVEYOR_NODES", "value": str(n)},
                         {"name": "CONVEYOR_NODE_HOST", "value": f"{name}-{{index}}.{name}"},
                         {"name": "OMP_NUM_THREADS", "value": "1"}],
                 "resources": {"requests": {"cpu": args.cpu, "memory": args.memory}},
                 "volumeMounts": [{"name": "secret", "mountPath": SECRET_DIR, "readOnly": True},
                                  {"name": "runs", "mountPath": f"{WORKDIR}/runs"}]}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": dict(labels)},
           "spec": {"completionMode": "Indexed", "completions": n, "parallelism": n, "backoffLimit": retries,
                    "template": {"metadata": {"labels": dict(labels)},
                                 "spec": {"subdomain": name, "restartPolicy": "Never", "containers": [container],
                                          "volumes": [{"name": "secret",
                                                       "secret": {"secretName": secret_name, "defaultMode": 0o400}},
                                                      {"name": "runs", **runs}]}}}}
    return [service, job]


def _names(args: argparse.Namespace) -> Tuple[str, str]:
    """The Service and Job name (the run name as a DNS label) and the Secret's name; ValueError for one that
    Kubernetes would refuse."""
    from conveyor.schema import ConfigError

    exp_name = args.exp_name if args.exp_name is not None else default_exp_name(args.entry)
    name = re.sub(r"[^a-z0-9-]", "-", exp_name.lower()).strip("-")
    longest = 63 - len(f"-{args.collectors + args.evaluators}")  # pod hostnames are <name>-<index>
    if not _LABEL.match(name) or len(name) > longest:
        raise ConfigError(f"--exp-name {exp_name!r}: the Service and Job are named after it ({name!r}), which must "
                          f"be a DNS label of at most {longest} characters (a-z, 0-9, '-')")
    secret_name = args.secret_name if args.secret_name is not None else f"{name}-secret"
    if not re.match(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$", secret_name) or len(secret_name) > 253:
        raise ConfigError(f"--secret-name {secret_name!r}: a Secret's name is lowercase a-z, 0-9, '-' and '.'")
    return name, secret_name
