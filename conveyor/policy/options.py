"""Config options the policies share: the checks of their values (one rule each, for every policy), option groups
(n-step, replay buffer, offline data) and a way to change the default of an inherited option without declaring it
again."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from conveyor import schema
from conveyor.schema import Option

__all__ = ["nstep_option", "replay_buffer_schema", "offline_schema", "lr_option", "with_defaults", "encoder_option",
           "cuda_graph_option", "action_bound_check", "hidden_sizes_check", "optional_positive"]

ENCODER_KINDS = ("auto", "mlp", "nature", "impala")
"""The values of ``policy.model.encoder`` (conveyor.policy.model.build_encoder builds each)."""


def _number(value: Any) -> bool:
    """An int or a float; a bool is not a number here, as nowhere in config validation."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def hidden_sizes_check(value: Sequence[int]) -> str | None:
    """A ``check`` for the widths of hidden layers: a non-empty list of positive ints."""
    ok = len(value) > 0 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    return None if ok else "must be a non-empty list of positive ints"


def optional_positive(value: Any) -> str | None:
    """A ``check`` for a number > 0, or None where None turns the feature off."""
    return None if value is None or value > 0 else "must be > 0 (or None to disable)"


def action_bound_check(value: Any) -> str | None:
    """A ``check`` for ``model.action_low`` / ``action_high``: a number, a non-empty list of numbers (one per action
    dim) or None (bools are not numbers)."""
    ok = value is None or _number(value) or \
        (isinstance(value, (list, tuple)) and len(value) > 0 and all(_number(v) for v in value))
    return None if ok else "must be a float, a non-empty list of floats (one per action dim), or None"


def _optional_lr(value: Any) -> str | None:
    return None if value is None or value > 0 else "must be > 0 (or None to use learn.learning_rate)"


def lr_option(network: str) -> Option:
    """The ``learn.<network>_learning_rate`` option of a policy with one optimizer per network."""
    return Option(None, f"{network.capitalize()} learning rate (None: learning_rate).", type=float, check=_optional_lr)


def encoder_option() -> Option:
    """``policy.model.encoder``: the observation encoder of every network of a policy (one definition for all)."""
    return Option("auto", "Observation encoder: 'auto' (picked from the obs shape: an MLP for vectors, a small CNN "
                          "for images), 'mlp' (any array obs flattened), 'nature' (the Nature-DQN CNN, 512 features) "
                          "or 'impala' (the IMPALA ResNet, 256 features); the image encoders ignore hidden_sizes and "
                          "divide uint8 pixels by 255 inside.", choices=ENCODER_KINDS)


def cuda_graph_option() -> Option:
    """``policy.learn.cuda_graph``: of the policies whose update is graph-safe (SAC, CQL, TD3)."""
    return Option(True, "On CUDA, replay each update from a CUDA graph captured after a few eager ones (an update of "
                        "small networks is bound by kernel launches there); no effect on CPU or among data-parallel "
                        "learners. Turn it off to debug an update step by step.", type=bool)


def with_defaults(base: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict:
    """The options of ``base`` named in ``defaults`` (nested by section), with those defaults: a subclass's
    schema changes an inherited default without declaring the option again."""
    out: dict = {}
    for key, value in defaults.items():
        spec = base[key]
        out[key] = with_defaults(spec, value) if isinstance(spec, Mapping) else dataclasses.replace(spec, default=value)
    return out


def nstep_option() -> Option:
    """The ``nstep`` option of policies whose targets go through :meth:`Policy._bootstrap_discount`."""
    return Option(1, "N-step return length; the pipeline's n-step enhancer reads it and writes 'discount' into "
                     "batches.", check=schema.positive)


def replay_buffer_schema(size: int) -> dict:
    """The ``other.replay_buffer`` options of off-policy policies, read by the pipeline to build a DequeBuffer."""
    return {
        "size": Option(size, "Replay buffer capacity in transitions.", check=schema.positive),
        "prioritized": Option(False, "Prioritized experience replay."),
        "alpha": Option(0.6, "Priority exponent of prioritized replay.", type=float, check=schema.unit_interval),
        "beta": Option(0.4, "Importance-weight exponent of prioritized replay at the start.", type=float,
                       check=schema.unit_interval),
        "beta_end": Option(1.0, "The importance-weight exponent reached after beta_anneal_steps (1 corrects the whole "
                                "sampling bias, as the PER paper anneals to).", type=float, check=schema.unit_interval),
        "beta_anneal_steps": Option(100_000, "Transitions added to the buffer (env steps) over which beta rises "
                                             "linearly to beta_end; the schedule is saved with the buffer (None: beta "
                                             "stays fixed).", type=int, check=optional_positive),
        "frame_stack": Option("auto", "Store each image frame once and stack at sampling (same samples, ~1/8 of the "
                                      "memory for 4-frame Atari stacks): 'auto' does it for uint8 observations "
                                      "[k, H, W] with k > 1, an int k forces it for [k, H, W] observations, None "
                                      "stores every array as given.", type=(str, int, type(None)),
                              check=_frame_stack_check),
    }


def _frame_stack_check(value: Any) -> str | None:
    ok = value is None or value == "auto" or (isinstance(value, int) and value >= 1)
    return None if ok else "must be 'auto', an int >= 1 (frames per observation) or None"


def offline_schema(max_train_iter: int) -> dict:
    """The options every offline policy adds: its dataset, its gradient-step budget, one step per minibatch."""
    return {
        "learn": {
            "max_train_iter": Option(max_train_iter, "Gradient steps of an offline run (the zoo entry stops there).",
                                     check=schema.positive),
            "update_per_collect": Option(1, "Gradient steps per minibatch the offline data fetcher hands over.",
                                         check=schema.positive),
        },
        "other": {
            "dataset": {
                "id": Option(None, "Dataset to train on: a Minari dataset id (in the local Minari root), or the path "
                                   "of a Minari dataset directory, .npz or HDF5 transition file.", type=str),
                "dir": Option(None, "Folder where the Minari dataset id is looked up (what `conveyor collect "
                                    "--dataset-dir` wrote to; `conveyor train --dataset-dir` sets it); None: "
                                    "$MINARI_DATASETS_PATH, else ~/.minari/datasets.", type=str),
                "reward_scale": Option("none", "How training rewards are scaled: 'none', or 'returns_range' "
                                               "(times 1000 / (the best minus the worst episode return of the "
                                               "dataset): the IQL paper's scaling for locomotion datasets).",
                                       choices=("none", "returns_range")),
            },
        },
    }
