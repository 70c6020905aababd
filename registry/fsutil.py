"""Atomic file writes: a unique temp file beside the target, fsync, then rename.

Correctness never rests on a lock: two writers of the same path each write their own temp
file and the last rename wins with complete content, which is fine for content-addressed
data (both wrote the same bytes) and for outputs the caller asked for.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from kvgraft.digest import Buffer
from kvgraft.errors import RegistryError, UsageError

KiB = 1 << 10
MiB = 1 << 20


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path | str, what: str,
                 error: type[RegistryError] = UsageError) -> tuple[int, os.stat_result]:
    """Open a regular file for reading; `error` for anything else (a FIFO would block
    forever, a device would never end). Symlinks are followed to a regular file.
    FileNotFoundError propagates for the caller to word."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} {path} is {_kind(st.st_mode)}, not a regular file")
    # O_NONBLOCK: had it become a FIFO since the stat, open() still returns at once.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is {_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_bounded(path: Path | str, limit: int, what: str,
                 error: type[RegistryError] = UsageError) -> bytes:
    """The whole regular file at `path`, refused (as `error`) if it holds more than
    `limit` bytes: never more than limit + 1 bytes are read."""
    fd, st = open_regular(path, what, error)
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise error(f"{what} {path} is {st.st_size} bytes, more than the {limit} "
                        "it may hold")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what} {path} holds more than the {limit} bytes it may hold")
    return data


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


STALE_TEMP = 3600.0  # a temp file untouched this long belongs to a writer that died


def temp_pattern(name: str) -> str:
    """The glob of the temp files written beside `name` (mkstemp's `.NAME.XXXXXXXX.tmp`)."""
    return f".{glob.escape(name)}.*.tmp"


def sweep_temp(directory: Path, pattern: str = ".*.tmp", *, recursive: bool = False,
               older_than: float = STALE_TEMP) -> int:
    """Remove regular files matching `pattern` not modified for `older_than` seconds (a
    live writer keeps its temp file's mtime fresh); returns how many were removed."""
    now, removed = time.time(), 0
    try:
        paths = list(directory.rglob(pattern) if recursive else directory.glob(pattern))
    except OSError:
        return 0
    for path in paths:
        with contextlib.suppress(OSError):
            st = path.lstat()
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than:
                path.unlink()
                removed += 1
    return removed


def output_target(path: Path) -> tuple[Path, int | None]:
    """Where writing the output file `path` really goes, and the mode to keep (None: a
    new file).

    A symlink is followed (as cp does): the file it points at is replaced and the link
    stays. Anything but a regular file or a missing name is refused: renaming over a
    device, FIFO or socket would replace it (as root, `-o /dev/null` would replace the
    system's /dev/null)."""
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        st = target.stat()
    except FileNotFoundError:
        return target, None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"refusing to write over {path}: it is {_kind(st.st_mode)}",
                         hint="give the path of a regular file")
    return target, stat.S_IMODE(st.st_mode)


def new_file_mode() -> int:
    """0666 less the process umask: what open() would give a new file. The umask is read
    from /proc where it can be: setting it to read it back is not thread-safe."""
    with contextlib.suppress(OSError, ValueError), \
            open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask
