"""Every file the project writes goes through here, whole or not at all: written beside its place, fsynced and renamed
over it; a line appended whole; a link replaced in one rename. A symbolic link or anything but a regular file where a
file goes is refused, and an OSError (or a library's error caused by one: torch's writer on a full disk, safetensors'
Rust error) becomes a WriteError naming the path, the cause and what was kept."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import sys
import tempfile
from typing import Callable

from nanogpt.errors import WriteError


def kind_of(path: str) -> str:
    """What is at `path`, in words ('a folder', 'a symbolic link (to X)', ...)."""
    try:
        st = os.lstat(path)
    except OSError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(path)})"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if stat.S_ISREG(st.st_mode):
        return "a file"
    return "a special file (a FIFO, socket or device)"


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error ends its text
_SHORT_WRITE = re.compile(r"inline_container\.cc.*unexpected pos \d+ vs \d+")  # torch's writer's own check


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError that raised `e` or that `e` was raised from; for a Rust library's error (safetensors' on a full
    disk: '... (os error 28)'), the OSError its text names, which Python never saw."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        if code := _RUST_OS_ERROR.search(str(e)):
            return OSError(int(code[1]), os.strerror(int(code[1])))
        if isinstance(e, RuntimeError) and _SHORT_WRITE.search(str(e)) and e.__cause__ is e.__context__ is None:
            # torch's zip writer found its file shorter than what it wrote, the OSError not kept (DCP's writer)
            return OSError(errno.EIO, "a write was cut short (a full disk?)")
        e = e.__cause__ or e.__context__
    return None


def cause(e: BaseException) -> str:
    """The cause of `e` in words ("No space left on device"): its OSError's (_os_error), else its text's first line."""
    first, e = e, _os_error(e)
    if e is None:  # a library's error that names its cause only in its text (DCP's CheckpointException)
        return (str(first).strip().splitlines() or [type(first).__name__])[0][:200]
    if isinstance(e, FileExistsError) and e.filename:  # os.makedirs where a file stands
        return f"{e.filename} is a file, not a folder"
    return e.strerror or str(e) or type(e).__name__


def caused_by_os_error(e: BaseException) -> bool:
    """Whether an OSError is behind `e` (_os_error): a failed write rather than a bug."""
    return _os_error(e) is not None


OUT_DIR_FIX = "free disk space, make the folder writable, or choose another out_dir"


def write_failed(path: str, e: BaseException, kept: str = "", what: str = "", fix: str = OUT_DIR_FIX) -> WriteError:
    """The one line of a failed write: what and where, the cause, what was kept, and what to do."""
    kept = f"; {kept}" if kept else ""
    what = f"{what} " if what else ""
    return WriteError(f"could not write {what}{path} ({cause(e)}){kept}: {fix}")


def check_target(path: str) -> None:
    """Refuse to write at `path` where a symbolic link or anything but a regular file stands: the write would go
    through the link into a file the run did not make, or replace what is not the run's."""
    if os.path.lexists(path) and (os.path.islink(path) or not stat.S_ISREG(os.lstat(path).st_mode)):
        raise WriteError(f"could not write {path}: it is {kind_of(path)}, not a file of the run's: move it away (a run "
                         f"never writes through a link or over a foreign file)")


def target_problem(path: str) -> str | None:
    """Why a file cannot be written at `path` (None: it can), asked before slow work rather than found after it."""
    if os.path.isdir(path) or os.path.islink(path):
        return f"{path} is {kind_of(path)}, not a file"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable"
    return None


def replaced_problem(path: str, is_ours: Callable[[bytes], bool], what: str) -> str | None:
    """Why a command must not write over `path`: a file there that is not `what` (as `is_ours` tells from its first
    MiB), e.g. a run's checkpoint given as a picture's name. None where nothing is there, or a file of its kind."""
    if not os.path.isfile(path) or os.path.islink(path):
        return None  # nothing there; a link or folder: target_problem's
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
    except OSError:
        return None  # the write then says why
    if is_ours(head):
        return None
    return f"{path} exists and is not {what}: it is not written over; give another file name, or move it away first"


def atomic_write(path: str, write: Callable[[str], None], what: str, fix: str = OUT_DIR_FIX) -> None:
    """Write `path` whole or not at all: `write(tmp)` writes and fsyncs a temporary file beside it, renamed over
    `path`. A failure caused by an OSError is a WriteError naming `what` and the `fix`; the old file stays as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp.{os.getpid()}"
    check_target(path)
    try:
        os.makedirs(folder, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        write(tmp)
        os.replace(tmp, path)
    except Exception as e:
        if isinstance(e.__context__, KeyboardInterrupt):  # a writer's cleanup failing as a Ctrl-C unwinds it (torch's
            raise e.__context__ from None  # zip writer: "unexpected pos"): the Ctrl-C is what happened
        if not caused_by_os_error(e):
            raise
        kept = f"the previous {what} is intact" if os.path.exists(path) else f"{what} was not written"
        raise write_failed(path, e, kept, what, fix) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    fsync_folder(folder)


def write_files(folder: str, write: Callable[[str], None], what: str, fix: str = OUT_DIR_FIX,
                stale: re.Pattern | None = None) -> list[str]:
    """atomic_write for a set: `write(tmp)` writes the files into a temporary folder inside `folder`, and only once all
    are fsynced is each renamed over its name in `folder`. Files of `stale`'s names (an earlier write's) that this one
    does not write are removed with the replaced ones (returned). A failure is a WriteError and leaves `folder` as it
    was; a kill mid-renames leaves the temporary folder, its old/ holding the files renamed over (_warn_cut_short)."""
    _warn_cut_short(folder)
    made, parent = [], os.path.abspath(folder)
    while not os.path.lexists(parent):  # the folders makedirs makes, innermost first
        made.append(parent)
        parent = os.path.dirname(parent)
    staging, aside, placed = None, [], []  # the old files moved aside, the new ones renamed into folder
    try:
        os.makedirs(folder, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".tmp.", dir=folder)
        new, old = os.path.join(staging, "new"), os.path.join(staging, "old")
        os.mkdir(new)
        os.mkdir(old)
        write(new)
        names = sorted(os.listdir(new))
        for name in names:  # a link or folder of another's where a file goes is refused before anything moves
            check_target(os.path.join(folder, name))
            with open(os.path.join(new, name), "rb") as f:
                os.fsync(f.fileno())
        gone = sorted(n for n in os.listdir(folder) if stale and stale.fullmatch(n) and n not in names
                      and os.path.isfile(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n)))
        for name in gone:  # aside like a replaced file: put back on a failure
            os.replace(os.path.join(folder, name), os.path.join(old, name))
            aside.append(name)
        for name in names:
            if os.path.lexists(os.path.join(folder, name)):
                os.replace(os.path.join(folder, name), os.path.join(old, name))
                aside.append(name)
            os.replace(os.path.join(new, name), os.path.join(folder, name))
            placed.append(name)
    except BaseException as e:
        for name in placed:
            if name not in aside:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, name))
        stranded = []  # earlier files that could not be put back: their copies in `old` are kept
        for name in aside:
            try:
                os.replace(os.path.join(old, name), os.path.join(folder, name))
            except OSError:
                stranded.append(name)
        if staging is not None and not stranded:
            shutil.rmtree(staging, ignore_errors=True)
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        if not isinstance(e, Exception) or not caused_by_os_error(e):
            raise
        kept = ("nothing was written" if made else "the files there are as they were" if not stranded else
                f"the earlier {', '.join(stranded)} could not be put back: kept in {old}")
        raise write_failed(folder, e, kept, what, fix) from None
    shutil.rmtree(staging, ignore_errors=True)  # the old files
    fsync_folder(folder)
    return gone


def _warn_cut_short(folder: str) -> None:
    """Name, never remove, the temporary folders of a write_files that a kill cut short (its new/ and old/)."""
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir(folder)):
            path = os.path.join(folder, entry)
            if entry.startswith(".tmp.") and os.path.isdir(os.path.join(path, "old")) and \
                    os.path.isdir(os.path.join(path, "new")):
                print(f"warning: {path} was left by a write that was cut short: its old/ holds the files it had "
                      f"replaced ({', '.join(sorted(os.listdir(os.path.join(path, 'old')))) or 'none'}); move back "
                      f"what you need, then remove it", file=sys.stderr, flush=True)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_text(path: str, text: str, what: str, fix: str = OUT_DIR_FIX) -> None:
    """A text file written whole (atomic_write)."""
    atomic_write(path, lambda tmp: _write_text(tmp, text), what, fix)


def append_line(path: str, line: str) -> None:
    """Append one line to `path`, never through a link, whole or not at all: a disk that fills mid-line takes part of
    it, which is cut off again so no later line is glued to a fragment. A failure is a WriteError."""
    check_target(path)
    data = line.encode("utf-8")
    made = not os.path.lexists(path)
    kept = "nothing was written" if made else "the lines before it are intact"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise write_failed(path, e, kept) from None
    try:
        end = os.fstat(fd).st_size  # one run writes here (the lock): nobody else appends meanwhile
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, end)
            if made:  # an empty file of the run's left behind would read as someone else's (check_entries)
                os.unlink(path)
        raise write_failed(path, e, kept) from None
    finally:
        os.close(fd)


def replace_link(path: str, target: str) -> None:
    """Point the symbolic link `path` at `target` (relative, so the run folder can move) with one rename. A failure
    is a WriteError; the old link stays."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise write_failed(path, e, "the previous link is intact", "the link") from None


def remove_file(path: str, what: str) -> None:
    """Remove a file the run wrote and no longer keeps; a failure is a WriteError."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise WriteError(f"could not remove {what} {path} ({cause(e)}): make the folder writable") from None


def fsync_folder(folder: str) -> None:
    with contextlib.suppress(OSError):  # make a rename durable (not possible on every OS)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
