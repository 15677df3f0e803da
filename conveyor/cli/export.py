"""``conveyor export``: a run's greedy policy as an ONNX or TorchScript file, checked against the torch policy.

    conveyor export runs/cartpole_dqn --format onnx --out cartpole_dqn.onnx
    conveyor export runs/cartpole_masked_ppo_gru --format torchscript --out gru.pt

The file maps an observation batch, as the env gives it (uint8 Atari frames, float32 vectors), to the batch of
greedy / deterministic actions the evaluator takes (:class:`conveyor.policy.export.GreedyModule`); a recurrent
policy's state is a further input and output (``hidden`` in, ``next_hidden`` out; zeros at an episode's start).
The batch axis is dynamic. ONNX goes through torch's TorchScript-based exporter (``dynamo=False``, with
``dynamic_axes``): the torch.export-based one needs ``onnxscript``, which the ``export`` extra does not bring
(see :meth:`~conveyor.policy.export.GreedyModule.save_onnx`).

Before the file is written, it is loaded as a user would load it (onnxruntime, ``torch.jit.load``) and run on
observations drawn from the env's observation space (``--seed``), twice in a row for a recurrent policy, beside the
torch policy: the largest absolute difference is printed, and the export fails (exit 1, nothing written) where it
is over :data:`TOLERANCE` or a discrete action differs.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, List, Sequence, Tuple

from conveyor.cli._checkpoint import load_policy, locate
from conveyor.cli._common import message, os_message, usage_error

__all__ = ["register", "run", "FORMATS", "TOLERANCE", "SAMPLES"]

FORMATS = ("onnx", "torchscript")
"""What ``--format`` takes."""

TOLERANCE = 1e-4
"""The largest absolute difference allowed between the exported model's float outputs (continuous actions,
recurrent state) and the torch policy's; discrete actions must be equal."""

SAMPLES = 16
"""Observations the export is checked on (traced on the first two, so the check also runs another batch size)."""

_EXTRA = 'pip install "conveyor[export]"'


def register(commands: "argparse._SubParsersAction") -> None:
    """Add the ``export`` subcommand."""
    parser = commands.add_parser("export", help="write a run's greedy policy as an ONNX or TorchScript file",
                                 description="Export the greedy policy of a run's best checkpoint (or a checkpoint "
                                             "file): an observation batch in, an action batch out, a recurrent "
                                             "policy's state as a further input and output. The file is checked "
                                             "against the torch policy on sample observations before it is written.")
    parser.add_argument("target", metavar="RUN_DIR|CKPT", help="a run directory (runs/<exp-name>) or a .pth.tar file")
    parser.add_argument("--format", required=True, metavar="|".join(FORMATS),
                        help=f"onnx (needs the export extra: {_EXTRA}) or torchscript")
    parser.add_argument("--out", required=True, metavar="FILE", help="the file to write (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=0,
                        help=f"seed of the {SAMPLES} sample observations the export is checked on (default 0)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Export, check and write; returns the exit code."""
    if args.format not in FORMATS:
        close = difflib.get_close_matches(args.format, FORMATS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return usage_error(f"--format {args.format}: unknown format, {hint}choose {' or '.join(FORMATS)}")
    if not 0 <= args.seed < 2**32:
        return usage_error(f"--seed must be in [0, 2**32), got {args.seed}")
    out = Path(args.out)
    problem = _unwritable(out)
    if problem:
        return usage_error(f"--out {out}: {problem}")
    if args.format == "onnx":
        try:
            import onnx  # noqa: F401  (checks the written model)
            import onnxruntime  # noqa: F401  (runs it)
        except ImportError as exc:
            return usage_error(f"--format onnx needs the onnx and onnxruntime packages ({message(exc)}): {_EXTRA}")
    from conveyor.schema import ConfigError
    from conveyor.run import RunDirError

    try:
        ckpt, run_dir = locate(Path(args.target))
        cfg, policy = load_policy(ckpt, run_dir, device="cpu")
        obs = _sample_observations(cfg.env, args.seed)
        from conveyor.policy.export import GreedyModule
        module = GreedyModule(policy, obs)
    except (ConfigError, RunDirError, FileNotFoundError, ImportError, ValueError) as exc:
        return usage_error(message(exc))
    except OSError as exc:
        return usage_error(os_message(exc))
    where = f"{SAMPLES} sample observations of {cfg.env.env_id} (seed {args.seed})"
    try:
        with _staged(out) as staged:
            try:
                (module.save_onnx if args.format == "onnx" else module.save_torchscript)(staged, obs[:2])
            except RuntimeError as exc:  # an operation the format has no counterpart for
                raise _CheckFailed(f"tracing {type(policy).__name__} into {args.format} failed: "
                                   f"{' '.join(str(exc).split())[:300]}") from None
            exported = _LOADERS[args.format](staged)
            difference, discrete, mismatched = _compare(module, exported, obs)
            if mismatched:
                raise _CheckFailed(f"the exported model's outputs differ from the torch policy's on {where} "
                                   f"({mismatched}); nothing written")
            if not difference <= TOLERANCE:  # also where it is NaN
                raise _CheckFailed(f"the exported model differs from the torch policy by {difference:.3g} on {where} "
                                   f"(tolerance {TOLERANCE:g}); nothing written")
    except _CheckFailed as exc:
        print(f"conveyor: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        return usage_error(f"--out {out}: {os_message(exc)}")
    print(f"checked against the torch policy on {where}: max abs difference {difference:.3g} (tolerance "
          f"{TOLERANCE:g}){'; discrete actions equal' if discrete else ''}")
    print(f"wrote {out} ({args.format}, {type(policy).__name__} from {ckpt}): {_signature(module, obs)}")
    return 0


class _CheckFailed(Exception):
    """The exported model does not act as the torch policy does."""


def _unwritable(out: Path) -> str:
    """Why ``out`` cannot be written (empty when it can)."""
    if out.is_dir():
        return "is a directory: give a file name"
    if not out.parent.is_dir():
        return f"the folder {out.parent} does not exist: create it first"
    if not os.access(out.parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        return "is not writable: choose another path"
    return ""


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A temporary path beside ``out``, moved onto it when the block succeeds and removed otherwise, so a failed
    export never leaves a file behind."""
    staged = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        yield staged
        os.replace(staged, out)
    finally:
        staged.unlink(missing_ok=True)


def _sample_observations(env_cfg: Any, seed: int) -> Any:
    """``SAMPLES`` observations drawn from the env's observation space, seeded, stacked as the env manager does."""
    import numpy as np

    from conveyor.envs import env_spaces

    space, _ = env_spaces(env_cfg)
    space.seed(seed)
    samples = [space.sample() for _ in range(SAMPLES)]
    if isinstance(samples[0], dict):
        return {key: np.stack([s[key] for s in samples]) for key in samples[0]}
    return np.stack(samples)


def _load_onnx(path: Path) -> Callable[..., List[Any]]:
    """The ONNX file, checked by onnx's checker, as an onnxruntime session: arrays in, arrays out."""
    import onnx
    import onnxruntime

    onnx.checker.check_model(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return lambda *arrays: session.run(None, dict(zip(names, arrays)))


def _load_torchscript(path: Path) -> Callable[..., List[Any]]:
    """The TorchScript file as ``torch.jit.load`` gives it: arrays in, arrays out."""
    import torch

    from conveyor.policy.export import quiet_tracing

    with quiet_tracing():
        loaded = torch.jit.load(str(path))

    def call(*arrays: Any) -> List[Any]:
        with torch.no_grad():
            out = loaded(*(torch.from_numpy(a) for a in arrays))
        return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]
    return call


_LOADERS = {"onnx": _load_onnx, "torchscript": _load_torchscript}


def _compare(module: Any, exported: Callable[..., List[Any]], obs: Any) -> Tuple[float, bool, str]:
    """The largest absolute difference between the float outputs of ``exported`` and of the torch ``module`` on
    ``obs`` (two steps in a row, each fed its own state, for a recurrent policy), whether there are discrete outputs,
    and a note on the discrete actions or the shapes that differ (empty when none does)."""
    import numpy as np
    import torch

    steps = 2 if module.state_shapes else 1
    half = len(obs) // steps
    ours = [s.numpy() for s in module.initial_state(half)]
    theirs = list(ours)
    difference, discrete, mismatched = 0.0, False, 0
    for step in range(steps):
        batch = obs[step * half:(step + 1) * half]
        with torch.no_grad():
            out = module(torch.from_numpy(batch), *(torch.from_numpy(s) for s in ours))
        expected = [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]
        got = [np.asarray(have) for have in exported(batch, *theirs)]
        for name, want, have in zip(module.output_names, expected, got):
            if have.shape != want.shape:
                return difference, discrete, f"{name} has shape {have.shape}, the torch policy's {want.shape}"
            if np.issubdtype(want.dtype, np.floating):
                gap = float(np.max(np.abs(want - have.astype(want.dtype)), initial=0.0))
                difference = gap if np.isnan(gap) or gap > difference else difference  # a NaN stays, and fails
            else:
                discrete = True
                mismatched += int(np.sum(have != want))
        ours, theirs = expected[1:], got[1:]
    return difference, discrete, f"{mismatched} discrete actions of {len(obs)} observations" if mismatched else ""


def _signature(module: Any, obs: Any) -> str:
    """The file's inputs and outputs as a user feeds and reads them: names, shapes (``batch`` first) and dtypes."""
    import torch

    with torch.no_grad():
        out = module(*module.inputs(obs[:2]))
    outputs = out if isinstance(out, tuple) else (out,)

    def shapes(names: Sequence[str], tensors: Sequence[Any]) -> str:
        return ", ".join(f"{n} [{', '.join(['batch', *map(str, t.shape[1:])])}] {str(t.dtype).replace('torch.', '')}"
                         for n, t in zip(names, tensors))
    return (f"inputs {shapes(module.input_names, module.inputs(obs[:2]))}; outputs "
            f"{shapes(module.output_names, outputs)}" + ("; recurrent state: zeros at an episode's start"
                                                          if module.state_shapes else ""))
