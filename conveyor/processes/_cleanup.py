"""What children leave behind: named shared-memory blocks and private temporary directories, freed also when the
parent that made them is killed.

- A shared-memory block is made with :func:`create_shared_block`, which first starts multiprocessing's resource
  tracker (one helper process shared by the parent and every child forked after it, so a child's exit unlinks
  nothing). The maker frees the block with :func:`release_shared_block`; if it is killed first, the tracker
  unlinks every block it still holds when the parent's end of its pipe closes.
- A block made without the tracker (``create_shared_block(size, name, track=False)``: a distributed run's worker,
  which would leave the tracker it started behind as an orphan) and named ``<prefix><maker pid>-<rest>`` is removed by
  whoever calls :func:`remove_stale_blocks` with that prefix once its maker is gone (Linux lists blocks in /dev/shm).
- A private directory (:func:`private_dir`) is ``$TMPDIR/<prefix><parent pid>-<random>``: whoever makes the next
  one removes this user's directories of that prefix whose parent is gone (one killed by SIGKILL cannot
  remove its own).
"""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import tempfile
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Optional

__all__ = ["alive", "attach_shared_block", "create_shared_block", "private_dir", "release_shared_block",
           "remove_stale_blocks", "remove_stale_dirs", "track_shared_memory", "unlink_quietly"]


def track_shared_memory() -> None:
    """Start the resource tracker now, before forking children, so that they share it (see the module docstring)."""
    resource_tracker.ensure_running()


SHARED_BLOCK_DIR = "/dev/shm"  # where Linux lists named shared-memory blocks
_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)


def create_shared_block(size: int, name: Optional[str] = None, track: bool = True) -> Any:
    """A new shared-memory block of ``size`` bytes (at least 1) named ``name`` (None: a random name), freed by the
    tracker if this process dies; ``FileExistsError`` if the name is taken. Its memory is taken now, so that a full
    /dev/shm (a container's is often 64 MB) is an ``OSError`` here rather than a SIGBUS at a later write.

    ``track=False`` (``name`` needed): no resource tracker, which a process started it would leave behind as an
    orphan when it ends first (a worker of a distributed run); the block is its maker's to free, and
    :func:`remove_stale_blocks` frees it once its maker is gone (name it ``<prefix><pid>-...``)."""
    if not track:
        return _UntrackedBlock(name, create=max(size, 1))
    track_shared_memory()
    shm = SharedMemory(name=name, create=True, size=max(size, 1))
    try:
        _take_memory(shm._fd, shm.size)  # type: ignore[attr-defined]
    except OSError:
        release_shared_block(shm, unlink=True)
        raise
    return shm


def _take_memory(fd: int, size: int) -> None:
    """Allocate the ``size`` bytes of the block open as ``fd``; a one-line ``OSError`` where /dev/shm has no room."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in _NO_ROOM:
            raise OSError(e.errno, f"no room for a shared-memory block of {size} bytes in /dev/shm ({e.strerror}): "
                                   f"free some, or give the container a larger /dev/shm") from None
    except AttributeError:  # no posix_fallocate (macOS): the block is taken as it is written
        pass


def attach_shared_block(name: str, track: bool = True) -> Any:
    """The block another process made (in a child: its parent), by name. ``track=False``: for a process that does
    not share its maker's resource tracker (a peer, not a child), mapped without telling its own, which would
    otherwise free the block when this process ends (Python before 3.13 registers every block it maps)."""
    return SharedMemory(name=name) if track else _UntrackedBlock(name)


class _UntrackedBlock:
    """A block made or mapped without the resource tracker: ``name``, ``size``, ``buf``, ``close()`` and ``unlink()``,
    as a SharedMemory. ``create``: make it, of that many bytes."""

    def __init__(self, name: str, create: int = 0) -> None:
        import _posixshmem  # POSIX only, as the blocks' names in /dev/shm

        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        self.name = name
        try:
            if create:
                os.ftruncate(fd, create)
                _take_memory(fd, create)
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)  # ValueError for an empty block
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap it; ``BufferError`` while a view of it is alive (the mapping then goes with that view)."""
        self.buf.release()
        self._mmap.close()

    def unlink(self) -> None:
        """Free it (its name goes at once, its memory with the last mapping); one removed already is left."""
        import _posixshmem

        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink("/" + self.name)


def release_shared_block(shm: Any, unlink: bool) -> None:
    """Unmap ``shm`` (a view still alive keeps the mapping until it goes) and, for its maker, free it (a tracked one
    removed already, by :func:`remove_stale_blocks`, is only forgotten by the tracker)."""
    try:
        shm.close()
    except BufferError:
        pass  # a view is still referenced; the mapping goes with it
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def remove_stale_blocks(prefix: str) -> int:
    """Free this user's shared-memory blocks named ``<prefix><pid>-*`` whose process ``pid`` is gone (untracked ones:
    a tracked one's tracker frees it); how many. Where blocks are not listed (not Linux), none."""
    import _posixshmem

    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHARED_BLOCK_DIR):
            pid, dash, _ = entry.name[len(prefix):].partition("-")
            if entry.name.startswith(prefix) and dash and pid.isdigit() and not alive(int(pid)) \
                    and entry.stat(follow_symlinks=False).st_uid == os.getuid():
                with contextlib.suppress(FileNotFoundError):
                    _posixshmem.shm_unlink("/" + entry.name)
                    removed += 1
    return removed


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
    """Whether process ``pid`` exists (another user's counts) and has not ended (a zombie, ended but not yet
    reaped by its parent, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (not Linux), or it ended meanwhile
        return True


def unlink_quietly(path: str) -> None:
    """Remove the file ``path`` if it is there."""
    try:
        os.unlink(path)
    except OSError:
        pass
