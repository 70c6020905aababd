"""Atomic file writes: a unique temp file beside the target, fsync, then rename.

Correctness never rests on a lock: two writers of the same path each write their own temp
file and the last rename wins with complete content, which is fine for content-addressed
data (both wrote the same bytes) and for outputs the caller asked for.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from kvgraft.digest import Buffer


@contextlib.contextmanager
def atomic_writer(target: Path, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Yield a file to write; on success it replaces `target` atomically, else vanishes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(target.parent)


def create_exclusive(target: Path, parts: Iterable[Buffer], *, durable: bool = True) -> bool:
    """Write a new file at `target` unless one exists: the first complete writer wins.

    The bytes go to a unique temp file which is then hard-linked into place; link() fails if
    the name exists, so a racing writer can never replace a blob someone else committed (a
    rename would, with possibly differently encoded bytes). Returns False if it existed.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for p in parts:
                f.write(p)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                raise
            if target.exists():  # no hard links here: fall back to rename
                return False
            os.replace(tmp, target)
            tmp = ""
    finally:
        if tmp:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    if durable:
        fsync_dir(target.parent)
    return True


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)
