"""Free space on a volume: checked before a step writes, and named when a step runs out anyway.

A dataset step that fills the volume half-way wastes the time it took and says only "[Errno 28] No
space left on device". Downloads know their size from the response headers and zip archives their
uncompressed size from the central directory, so those steps check first and refuse with the numbers;
whatever still runs out (a size nobody announced, another writer on the volume) fails naming the step
and the path it was writing.
"""

from __future__ import annotations

import errno
import os
import tarfile
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: errno values that mean "the volume is full" (a quota counts: it is the space this writer has).
_FULL = (errno.ENOSPC, errno.EDQUOT)


def format_bytes(count: int) -> str:
    """``10,737,418,240 bytes (10.0 GiB)``: exact for scripts, readable for people."""
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(size) < 1024 or unit == "PiB":
            break
        size /= 1024
    return f"{count:,} bytes ({size:.1f} {unit})"


class InsufficientSpace(OSError):
    """Not enough space on the volume for a step; says how much is needed, how much is free, what to do."""

    def __init__(self, step: str, volume: Path, free: int, *, needed: int | None = None, path: Path | None = None,
                 kept: bool = True):
        self.step, self.volume, self.free, self.needed, self.path, self.kept = step, volume, free, needed, path, kept
        if needed is not None:
            message = (f"not enough space on volume {volume} to {step}: it needs {format_bytes(needed)}, "
                       f"{format_bytes(free)} are free. Free or grow the volume by at least "
                       f"{format_bytes(needed - free)}, then run again (verified downloads are reused)")
        else:
            then = ("a partial download resumes, verified ones are reused" if kept else
                    f"{path} was removed: the server did not say how large it is, so no size can be checked first; "
                    "verified downloads are reused")
            message = (f"volume {volume} ran out of space while it was being used to {step} (writing {path}); "
                       f"{format_bytes(free)} are free now. Free or grow the volume, then run again ({then})")
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self) -> tuple:  # raised in a worker process, re-raised in the parent
        return _rebuild, (self.step, str(self.volume), self.free, self.needed, str(self.path) if self.path else None,
                          self.kept)


def _rebuild(step: str, volume: str, free: int, needed: int | None, path: str | None,
             kept: bool = True) -> InsufficientSpace:
    return InsufficientSpace(step, Path(volume), free, needed=needed, path=Path(path) if path else None, kept=kept)


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent: what statvfs can be asked about."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding ``path``."""
    stats = os.statvfs(_existing(path))
    return stats.f_bavail * stats.f_frsize


def block_bytes(path: Path) -> int:
    """The allocation unit of the file system holding ``path``: every file takes whole blocks."""
    return os.statvfs(_existing(path)).f_frsize or 4096


def allocated(size: int, block: int) -> int:
    """Bytes a file of ``size`` bytes takes on disk: whole blocks (an empty file takes none)."""
    return -(-size // block) * block


def files_need(sizes: Iterable[int], folders: int, block: int) -> int:
    """Bytes that files of ``sizes`` and ``folders`` folders take on disk (a folder takes one block)."""
    return sum(allocated(size, block) for size in sizes) + folders * block


def archive_needs(archive: Path, block: int) -> int | None:
    """Bytes extracting ``archive`` takes, from its own index, without extracting anything; None for a
    compressed tar, whose sizes are known only by decompressing it all."""
    with archive.open("rb") as handle:
        head = handle.read(4)
    if head in (b"PK\x03\x04", b"PK\x05\x06"):
        with zipfile.ZipFile(archive) as zf:
            infos = zf.infolist()
        return files_need((i.file_size for i in infos if not i.is_dir()), sum(i.is_dir() for i in infos), block)
    try:
        with tarfile.open(archive, mode="r:") as tf:  # uncompressed: headers are read, contents skipped
            members = tf.getmembers()
    except tarfile.ReadError:
        return None
    return files_need((m.size for m in members if m.isfile()), sum(m.isdir() for m in members), block)


def ensure_free(step: str, volume: Path, where: Path, needed: int) -> None:
    """Refuse ``step`` before it writes when the file system holding ``where`` has less than ``needed`` free."""
    free = free_bytes(where)
    if needed > free:
        raise InsufficientSpace(step, volume, free, needed=needed)


@contextmanager
def names_a_full_volume(step: str, volume: Path, path: Path, keep: bool = True) -> Iterator[None]:
    """A "no space left" error inside the block becomes one naming ``step``, the volume and ``path``; without
    ``keep``, ``path`` is removed first (a download whose size nobody announced: resuming it would fill the
    volume again, and its other users need the space)."""
    try:
        yield
    except InsufficientSpace:
        raise
    except OSError as exc:
        if exc.errno not in _FULL:
            raise
        written = Path(exc.filename) if exc.filename else path
        if not keep:
            path.unlink(missing_ok=True)
        raise InsufficientSpace(step, volume, free_bytes(path.parent), path=written,
                                kept=keep) from exc
