"""``conveyor slurm-script``: print an sbatch script that trains a zoo entry with one Slurm task per node.

    conveyor slurm-script cartpole/dqn --collectors 4 --nodes 2 --time 02:00:00 > job.sh && sbatch job.sh

The script asks for 1 + C + M tasks on N nodes, makes a secret (mode 0600, in ``.conveyor/job-<job id>/`` of
the submit directory, which every node must see) unless ``--secret-file`` names one, and ``srun``s one
``conveyor train ... --launcher slurm`` per task: task r is node r of the layout. ``--requeue``: a job Slurm
starts again (preemption, a failed node, ``scontrol requeue``) resumes the run from its latest checkpoint
(``--resume-if-exists``; the run is ``runs/<exp-name>-<job id>``, the same for every start of the job). A job of
several data-parallel learners (``--learners L``) is not requeued (``--no-requeue``): such a run cannot resume yet.
``scancel --signal=TERM JOBID`` stops the run cleanly: every task ends its iteration and the learner writes its
final checkpoint. A plain ``scancel`` ends the job at once: Slurm sends SIGTERM to every process of the job, srun
among them, and srun answers it by killing the tasks (SIGKILL), so the run keeps its latest checkpoint
(``--ckpt-interval`` bounds what is lost). Either way a requeued job, or a new one given the same ``--exp-name``,
resumes it (tests/test_slurm_cluster.py checks both on a real cluster).
"""
from __future__ import annotations

import argparse
import re
import shlex

from conveyor.cli._jobs import add_job_parser, checked_layout, default_exp_name, train_command

__all__ = ["register", "script"]

_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_OUTPUT = re.compile(r"^[A-Za-z0-9._%/-]+$")


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``slurm-script`` subcommand."""
    parser = add_job_parser(commands, "slurm-script", script,
                            help="print an sbatch script training an entry on a Slurm cluster",
                            description="Print an sbatch script that trains ENTRY with one Slurm task per node (1 "
                                        "learner + C collectors + M evaluators); submit it with `sbatch script.sh` "
                                        "from a directory every node sees.",
                            exp_name_help="the run's name: the same name in a new job continues that run (default: "
                                          "the entry's run name and the job id)")
    parser.add_argument("--nodes", type=int, required=True, metavar="N", help="hosts the tasks are spread over")
    parser.add_argument("--gpus-per-learner", type=int, default=0, metavar="G",
                        help="GPUs for the learner (--gres=gpu:G on every host; the nodes train with --device cuda)")
    parser.add_argument("--time", default=None, metavar="HH:MM:SS", help="the job's time limit ([D-]HH:MM:SS)")
    parser.add_argument("--partition", default=None, metavar="P", help="the Slurm partition")
    parser.add_argument("--account", default=None, metavar="A", help="the Slurm account the job is charged to")
    parser.add_argument("--cpus-per-task", type=int, default=None, metavar="C",
                        help="CPUs of every task (one task per node of the layout)")
    parser.add_argument("--mem", default=None, metavar="SIZE",
                        help="memory per host, as Slurm writes it (e.g. 16G, 4000M; a number alone is MB)")
    parser.add_argument("--output", default=None, metavar="FILE",
                        help="the job's output file, Slurm's patterns allowed (e.g. logs/%%x-%%j.out, whose folder "
                             "must exist; default slurm-<job id>.out)")
    parser.add_argument("--secret-file", default=None, metavar="F",
                        help="a secret file every node reads (mode 0600; default: one made for the job)")


def script(args: argparse.Namespace) -> str:
    """The sbatch script of ``args``; ValueError with one line for bad input."""
    from conveyor.schema import ConfigError
    from conveyor.run.directory import check_exp_name

    layout = checked_layout(args)
    tasks = layout.n_nodes
    if not 1 <= args.nodes <= tasks:
        raise ConfigError(f"--nodes {args.nodes}: the job has {tasks} tasks ({args.learners} learner"
                          f"{'s' * (args.learners > 1)}, {args.collectors} collectors, {args.evaluators} evaluators), "
                          f"so 1..{tasks} nodes")
    if args.gpus_per_learner < 0:
        raise ConfigError(f"--gpus-per-learner must be >= 0, got {args.gpus_per_learner}")
    if args.time is not None and not _TIME.match(args.time):
        raise ConfigError(f"--time {args.time!r}: expected HH:MM:SS or D-HH:MM:SS, e.g. 02:00:00")
    for flag, value, pattern, expected in (
            ("--partition", args.partition, _NAME, "a partition name (letters, digits, . _ -)"),
            ("--account", args.account, _NAME, "an account name (letters, digits, . _ -)"),
            ("--mem", args.mem, _MEM, "a size such as 16G, 4000M or 4000 (MB)"),
            ("--output", args.output, _OUTPUT, "a file name without spaces or quotes, e.g. logs/%x-%j.out")):
        if value is not None and not pattern.match(value):
            raise ConfigError(f"{flag} {value!r}: expected {expected}")
    if args.cpus_per_task is not None and args.cpus_per_task < 1:
        raise ConfigError(f"--cpus-per-task must be >= 1, got {args.cpus_per_task}")
    if args.exp_name is not None:
        check_exp_name(args.exp_name)
        if not _NAME.match(args.exp_name):
            raise ConfigError(f"--exp-name {args.exp_name!r}: use letters, digits, '.', '_' and '-' in a job's run")
    base = default_exp_name(args.entry)
    several = args.learners > 1
    lines = ["#!/bin/bash", f"#SBATCH --job-name={_job_name(base)}", f"#SBATCH --nodes={args.nodes}",
             f"#SBATCH --ntasks={tasks}", "#SBATCH --no-requeue" if several else "#SBATCH --requeue"]
    for option, value in (("time", args.time), ("partition", args.partition), ("account", args.account),
                          ("cpus-per-task", args.cpus_per_task), ("mem", args.mem), ("output", args.output)):
        lines += [f"#SBATCH --{option}={value}"] * (value is not None)
    lines += [f"#SBATCH --gres=gpu:{args.gpus_per_learner}"] * (args.gpus_per_learner > 0)
    learners = f"nodes 0..{args.learners - 1} the data-parallel learners" if several else "node 0 the learner"
    first = args.learners + args.collectors
    lines += [f"# conveyor train {args.entry}: {learners}, {args.learners}..{first - 1} collectors"
              + (f", {first}..{tasks - 1} evaluators" if args.evaluators else "") + ", one task each.",
              "# Submit from a directory every node sees (runs/ goes there): sbatch THIS_FILE. scancel kills the tasks",
              "# (srun answers Slurm's SIGTERM with SIGKILL): the run keeps its latest checkpoint; scancel",
              "# --signal=TERM JOBID stops it cleanly with a final checkpoint."]
    lines += (["# A run of several learners cannot resume yet: the job is not requeued."] if several else
              ["# A requeued job (or a new one with the same --exp-name) resumes it from",
               "# runs/$EXP_NAME/ckpt/latest.pth.tar."])
    lines += ["set -euo pipefail", 'cd "$SLURM_SUBMIT_DIR"',
              f"EXP_NAME={shlex.quote(args.exp_name) if args.exp_name else _quoted(base) + '-$SLURM_JOB_ID'}"]
    if args.secret_file is None:
        lines += ['SECRET_FILE="$SLURM_SUBMIT_DIR/.conveyor/job-$SLURM_JOB_ID/secret"',
                  'if [ ! -s "$SECRET_FILE" ]; then  # made once per job, kept when it is requeued',
                  '  (umask 077 && mkdir -p "$(dirname "$SECRET_FILE")" && '
                  'head -c 32 /dev/urandom | od -An -tx1 | tr -d " \\n" > "$SECRET_FILE")',
                  'fi']
    else:
        lines += [f"SECRET_FILE={shlex.quote(args.secret_file)}"]
    command = train_command(args, "slurm", "$EXP_NAME", "$SECRET_FILE")
    if args.gpus_per_learner > 0:
        command += ["--device", "cuda"]
    lines += ["exec srun " + " ".join(_word(word) for word in command)]
    return "\n".join(lines) + "\n"


def _job_name(base: str) -> str:
    return "conveyor-" + re.sub(r"[^A-Za-z0-9._-]", "_", base)


def _quoted(text: str) -> str:
    return text if _NAME.match(text) else shlex.quote(text)


def _word(word: str) -> str:
    """A word of the srun line: the script's variables expanded (double quotes), anything else quoted."""
    return f'"{word}"' if word in ("$EXP_NAME", "$SECRET_FILE") else shlex.quote(word)
