"""A disk that fails where a test says, for the write-fault tests (tests/test_write_faults.py): SQLite's way of testing
its I/O, which fails each write operation in turn and checks the database after each; and a real small file system
(small_file_system), where a library's own writer fails as it does on a full disk."""
from __future__ import annotations

import builtins
import errno
import os
import shutil
import subprocess

import pytest

from helpers import HANG_S, ROOT


class FullFile:
    """A file opened for writing on a full disk: it opens, and its first write raises ENOSPC, as the OS does; a
    library writing through it raises what it raises then (torch's writer: RuntimeError('unexpected pos ...'), the
    OSError as its context)."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class FaultyDisk:
    """
    Every write operation under `root` (a file opened for writing, an os.open for writing and its os.write, a rename,
    a hard or symbolic link, a folder made, a file removed) is listed in `ops` as (operation, path relative to root),
    and the one numbered `fail_at` fails the way the OS fails it: `err` ENOSPC lets a file open and fails its first
    write (an os.write takes half its data first, a short write, and fails the next), and fails the other operations
    at once; EROFS and EACCES fail the operation itself.
    """

    def __init__(self, root: str, monkeypatch, fail_at: int | None = None, err: int = errno.ENOSPC):
        self.root, self.fail_at, self.err = os.path.abspath(root), fail_at, err
        self.ops: list[tuple[str, str]] = []
        self.failed: tuple[str, str] | None = None
        self._full_fds: set[int] = set()
        real = {name: getattr(os, name) for name in ("open", "write", "replace", "rename", "link", "symlink",
                                                     "mkdir", "remove", "unlink")}
        real_open = builtins.open

        def under(path) -> str | None:
            try:
                path = os.path.abspath(os.fspath(path))
            except TypeError:  # a file descriptor
                return None
            return os.path.relpath(path, self.root) if path.startswith(self.root) else None

        def fault(op: str, path) -> int | None:
            """The errno this operation fails with, or None; counts it if it would change something (a folder made
            where there is none, a file removed that is there)."""
            rel = under(path)
            made = op == "mkdir" and os.path.isdir(path)
            gone = op in ("remove", "unlink") and not os.path.lexists(path)
            if rel is None or made or gone:
                return None
            self.ops.append((op, rel))
            if len(self.ops) - 1 == self.fail_at:
                self.failed = (op, rel)
                return self.err
            return None

        def fail(e: int, path):
            raise OSError(e, os.strerror(e), os.fspath(path))

        def open_(file, mode="r", *args, **kwargs):
            if isinstance(file, int) or not any(c in mode for c in "wax+"):
                return real_open(file, mode, *args, **kwargs)
            e = fault("open", file)
            if e == errno.ENOSPC:
                return FullFile(real_open(file, mode, *args, **kwargs))
            if e is not None:
                fail(e, file)
            return real_open(file, mode, *args, **kwargs)

        def os_open(path, flags, *args, **kwargs):
            writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC)
            e = fault("os.open", path) if writes else None
            if e is not None and e != errno.ENOSPC:
                fail(e, path)
            fd = real["open"](path, flags, *args, **kwargs)
            if e == errno.ENOSPC:
                self._full_fds.add(fd)
            return fd

        def os_write(fd, data):
            if fd in self._full_fds:  # the disk takes what fits, then fails: half the data, then ENOSPC
                if len(data) > 1:
                    return real["write"](fd, bytes(data)[:len(data) // 2])
                self._full_fds.discard(fd)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real["write"](fd, data)

        def two_paths(op):
            def call(src, dst, *args, **kwargs):
                e = fault(op, dst)
                if e is not None:
                    fail(e, dst)
                return real[op](src, dst, *args, **kwargs)
            return call

        def one_path(op):
            def call(path, *args, **kwargs):
                e = fault(op, path)
                if e is not None:
                    fail(e, path)
                return real[op](path, *args, **kwargs)
            return call

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(os, "write", os_write)
        for op in ("replace", "rename", "link", "symlink"):
            monkeypatch.setattr(os, op, two_paths(op))
        for op in ("mkdir", "remove", "unlink"):
            monkeypatch.setattr(os, op, one_path(op))


def small_file_system(tmp_path, size: str, script: str) -> subprocess.CompletedProcess:
    """Run the sh `script` from the repo root with a tmpfs of `size` mounted at tmp_path/mnt, in a private mount
    namespace (unshare -rm: no root needed on the host). The tmpfs goes with the namespace: the script copies out
    what the test reads. Skips where this machine cannot mount one."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare on this machine: no private mount namespace for a small file system")
    mnt, mounted = tmp_path / "mnt", tmp_path / "mounted"
    mnt.mkdir()
    full = f"set -e\nmount -t tmpfs -o size={size} tmpfs {mnt}\ntouch {mounted}\nset +e\n{script}"
    r = subprocess.run(["unshare", "-rm", "sh", "-c", full], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    if not mounted.exists():
        pytest.skip(f"this machine cannot mount a tmpfs in a private namespace: {r.stderr.strip()[:200]}")
    return r
