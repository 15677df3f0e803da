"""The one process layer: starting, supervising, signalling and cleaning up child processes and their shared memory.

A leaf: imports nothing else of Conveyor (nor numpy, torch or pynng), so the engine's runner, the env managers
and the collector processes all build on it.

- Start: :class:`Child` (a :mod:`multiprocessing` child with a duplex pipe, forked with the parent's objects
  frozen out of the garbage collector: :func:`start_frozen`, :func:`child_started`; start method from
  :func:`default_start_method`), or :class:`Zygote`, a preloading process that forks children on request
  (the runner's workers: torch imported once, not once per worker; benchmarks/process_start.py compares it
  with multiprocessing's forkserver).
- Supervise: :meth:`Child.recv_bytes` watches the child's process sentinel as well as its pipe and raises
  :class:`ChildLost` saying how it ended (:func:`describe_exit`) or that it did not answer in time; a child's
  exception travels back with :func:`pack_exception` / :func:`unpack_exception` (its traceback text as a
  :class:`RemoteTraceback` cause).
- Signal: :func:`stop` asks children to stop (a goodbye on their pipe, or SIGTERM), SIGKILLs those still there
  after a grace period and reaps them; :func:`ignore_stop_signals`, :func:`signals_held`, :class:`sigterm_raises`,
  :class:`signals_ignored` and :class:`Terminated` say who decides on SIGINT and SIGTERM.
- Clean up: :func:`create_shared_block` / :func:`release_shared_block` (named shared memory, unlinked by
  multiprocessing's resource tracker if the parent is killed), :func:`remove_stale_blocks` (those of a named
  family whose maker is gone) and :func:`private_dir` (a temporary directory
  named after its parent's pid; the next one removes those whose parent is gone).
"""
from conveyor.processes._children import (GOODBYE, Child, ChildLost, RemoteTraceback, child_started,
                                          default_start_method, pack_exception, send_quietly, start_frozen, stop,
                                          unpack_exception)
from conveyor.processes._cleanup import (alive, attach_shared_block, create_shared_block, private_dir,
                                         release_shared_block, remove_stale_blocks, remove_stale_dirs, track_shared_memory,
                                         unlink_quietly)
from conveyor.processes._signals import (Terminated, describe_exit, ignore_stop_signals, raise_terminated,
                                         sigterm_raises, signal_name, signals_held, signals_ignored)
from conveyor.processes._zygote import Forked, UnguardedStart, Zygote, importing_main, preparation

__all__ = ["GOODBYE", "Child", "ChildLost", "Forked", "RemoteTraceback", "Terminated", "UnguardedStart", "Zygote",
           "alive", "attach_shared_block", "child_started", "create_shared_block", "default_start_method",
           "describe_exit", "ignore_stop_signals", "importing_main", "pack_exception", "preparation", "private_dir",
           "raise_terminated", "release_shared_block", "remove_stale_blocks", "remove_stale_dirs", "send_quietly", "sigterm_raises",
           "signal_name", "signals_held", "signals_ignored", "start_frozen", "stop", "track_shared_memory",
           "unlink_quietly", "unpack_exception"]
