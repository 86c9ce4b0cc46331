"""Host memory the daemon can map: regular files under /dev/shm.

In the host build the daemon copies blocks to and from files a client
creates under /dev/shm and registers by path (the daemon checks with
SO_PEERCRED that the connecting process may read and write the file).
:class:`ShmRegion` creates and maps such a file; :func:`shm_location` finds,
for any address of this process, the /dev/shm file mapped there, so memory
that came from such a file (a tensor built over it, say) can be registered
without knowing how it was allocated.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from dataclasses import dataclass

__all__ = ["SHM_DIR", "ShmRegion", "ShmLocation", "shm_location"]

SHM_DIR = "/dev/shm"


class ShmRegion:
    """A new file under /dev/shm, sized and mapped shared into this process.

    ``path`` is what a Region names; ``buf`` is a writable memoryview of the
    mapping; ``address`` its base address (for building tensors over it).
    The file is created with O_EXCL and mode 0600, and unlinked by
    :meth:`close` unless ``keep_file`` was set.
    """

    def __init__(self, size: int, *, name: str | None = None, directory: str = SHM_DIR, keep_file: bool = False):
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        if name is None:
            name = f"kvoffload-{os.getpid()}-{secrets.token_hex(6)}"
        if "/" in name:
            raise ValueError(f"name {name!r} must not contain '/'")
        self.path = os.path.join(directory, name)
        self.size = size
        self.keep_file = keep_file
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.buf = memoryview(self._mmap)
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(self._anchor)
        self._closed = False

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self.buf[offset : offset + n])

    def write(self, offset: int, data: bytes) -> None:
        self.buf[offset : offset + len(data)] = data

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.buf.release()
        del self._anchor
        try:
            self._mmap.close()
        finally:
            if not self.keep_file:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass

    def __enter__(self) -> "ShmRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShmRegion({self.path!r}, size={self.size})"


@dataclass(frozen=True)
class ShmLocation:
    """Where an address of this process lies in a /dev/shm file."""

    path: str
    offset: int  # byte offset of the address in the file
    file_bytes_after: int  # bytes of the mapping from the address to its end


def shm_location(address: int, *, directory: str = SHM_DIR, maps_path: str = "/proc/self/maps") -> ShmLocation | None:
    """The /dev/shm file mapped shared at ``address`` in this process, or None
    (anonymous memory, a private mapping, or a deleted file: nothing the
    daemon could open by path)."""
    prefix = directory.rstrip("/") + "/"
    with open(maps_path) as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            lo_s, hi_s = parts[0].split("-")
            lo, hi = int(lo_s, 16), int(hi_s, 16)
            if not lo <= address < hi:
                continue
            perms, off_s, path = parts[1], parts[2], parts[5].rstrip("\n")
            if len(perms) < 4 or perms[3] != "s" or not path.startswith(prefix) or path.endswith(" (deleted)"):
                return None
            return ShmLocation(path=path, offset=int(off_s, 16) + (address - lo), file_bytes_after=hi - address)
    return None
