"""What children leave behind: named shared-memory blocks and private temporary directories, freed also when the
parent that made them is killed.

- A shared-memory block is made with :func:`create_shared_block`, which first starts multiprocessing's resource
  tracker (one helper process shared by the parent and every child forked after it, so a child's exit unlinks
  nothing). The maker frees the block with :func:`release_shared_block`; if it is killed first, the tracker
  unlinks every block it still holds when the parent's end of its pipe closes.
- A private directory (:func:`private_dir`) is ``$TMPDIR/<prefix><parent pid>-<random>``: whoever makes the next
  one removes this user's directories of that prefix whose parent is gone (one killed by SIGKILL cannot
  remove its own).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

__all__ = ["alive", "attach_shared_block", "create_shared_block", "private_dir", "release_shared_block",
           "remove_stale_dirs", "track_shared_memory", "unlink_quietly"]


def track_shared_memory() -> None:
    """Start the resource tracker now, before forking children, so that they share it (see the module docstring)."""
    resource_tracker.ensure_running()


def create_shared_block(size: int) -> SharedMemory:
    """A new named shared-memory block of ``size`` bytes (at least 1), freed by the tracker if this process dies."""
    track_shared_memory()
    return SharedMemory(create=True, size=max(size, 1))


def attach_shared_block(name: str) -> SharedMemory:
    """In a child: the block its parent made, by name."""
    return SharedMemory(name=name)


def release_shared_block(shm: SharedMemory, unlink: bool) -> None:
    """Unmap ``shm`` (a view still alive keeps the mapping until it goes) and, for its maker, free it."""
    try:
        shm.close()
    except BufferError:
        pass  # a view is still referenced; the mapping goes with it
    if unlink:
        shm.unlink()


def private_dir(prefix: str) -> str:
    """A new directory ``$TMPDIR/<prefix><this pid>-<random>``, after removing those of dead parents."""
    remove_stale_dirs(prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def remove_stale_dirs(prefix: str) -> None:
    """Remove this user's ``$TMPDIR/<prefix><pid>-*`` directories whose process ``pid`` is gone."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid, dash, _ = entry.name[len(prefix):].partition("-")  # no dash: an older name, no pid in it
            if entry.name.startswith(prefix) and dash and pid.isdigit() and not alive(int(pid)) \
                    and entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                shutil.rmtree(entry.path, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def unlink_quietly(path: str) -> None:
    """Remove the file ``path`` if it is there."""
    try:
        os.unlink(path)
    except OSError:
        pass
