"""
The run folder: an out_dir holds one run. A start decides whether it continues the run there or begins a new one,
and a new run never destroys an earlier one: its files are moved aside (renamed) into out_dir/previous/<time>/.

- init_from="auto" continues the run in out_dir when it holds a checkpoint, else starts from scratch: the same
  command works for the first start, a rerun, and a scheduler's requeue.
- A torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) of the run that its own job started or continued (out_dir's
  run.json records the job's id, distributed.torchrun_job) continues from its checkpoint, whatever init_from says:
  torchrun restarts every worker with the same arguments, and init_from=scratch must not begin the run again. A
  restart of another job follows init_from (torchrun's TORCHELASTIC_RUN_ID is no job's own: "none" by default).
- Every run gets an id, written in out_dir/run.json at its first start and recorded in each checkpoint and in
  metrics.jsonl; finding a checkpoint to resume, sample or export skips one of another run (checkpoint_manager.py).

- A live run holds its out_dir (hold(): an OS lock on out_dir/run.lock, which ends with its process, a SIGKILL
  too): a second start there is refused in one line naming the holder (pid, host) before it reads or changes
  anything in the folder. Only rank 0 of a torchrun job holds it, for all its ranks; an evaluation-only start
  changes nothing there and holds nothing.

- Every write in out_dir goes through this module (the lock, run.json, metrics.jsonl's lines, checkpoints, the report,
  the move to previous/): each refuses a symbolic link or a foreign type where it would write (check_entries looks
  over the folder before a start changes anything), and turns an OSError, or a library's error caused by one (torch's
  writer on a full disk), into a WriteError: one line naming the path and the cause.

Moving aside instead of refusing: a nanoGPT user reruns the same command and expects a fresh run (nanoGPT would
overwrite); a team's long run continues through init_from=auto; and a mistaken new start loses nothing either
way: the previous run's folder still resumes (`--out_dir=out/previous/<time>`).

Imports errors.py only. Every module that writes in out_dir writes through it (start, checkpoint, sharded, metrics,
report, plot, distributed), and measure's figures too.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Callable

from nanogpt.errors import UserError, WriteError

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"  # held by the live run (hold); never moved aside
PREVIOUS = "previous"
# what a run writes in out_dir, and so what a new run moves aside (nothing else in the folder is touched)
_NAMES = (r"ckpt(_best)?\.pt|ckpt_\d{7,}\.pt|ckpt_sharded(_best)?|ckpt_sharded_\d{7,}_\d+|metrics(\.\d+)?\.jsonl"
          r"|report\.md|loss\.png|run\.json")
RUN_FILES = re.compile(rf"({_NAMES})(\.tmp\.\d+)?")  # and the temporary names their atomic writes use
_TEMPORARY = re.compile(r"\.tmp\.\d+$")
# what only a run writes: run.json (at its start) and checkpoints (nanoGPT's ckpt.pt too); report.md, metrics.jsonl and
# loss.png alone are any program's names
_A_RUNS = re.compile(r"run\.json|ckpt(_best)?\.pt|ckpt_\d{7,}\.pt|ckpt_sharded(_best)?|ckpt_sharded_\d{7,}_\d+")


# ----------------------------------------------------------------------------------------------- the live run's hold


@contextlib.contextmanager
def hold(out_dir: str, enabled: bool = True) -> Iterator[None]:
    """
    Hold out_dir for this process's run, from before its start is decided to its end: a second start there is
    refused (UserError naming the holder's pid and host) before it reads or changes anything in the folder. The hold
    is an OS lock (flock) on out_dir/run.lock, which the OS lets go when the process ends, however it ends: a
    SIGKILLed run leaves the folder free, with no stale lock to clear. It works wherever the file system locks files
    (node-local ones; NFS through its lock manager); one that does not gets a warning and no hold. Makes out_dir
    where missing, and removes what it made (out_dir and the parents it made) if still empty at the end: a refused
    start leaves no folder behind. A folder it cannot write in, or a run.lock it did not create (a link, a folder,
    another file), is a UserError, and nothing in out_dir changed.
    """
    if not enabled:
        yield
        return
    made = []
    fd = None
    try:
        with _signals_deferred():  # a SIGTERM here lands once the lock is whole: its cleanup then finds it
            for _ in range(5):  # another start may remove the folder it made between our making it and our opening
                made += make_folders(out_dir)
                fd = _lock(out_dir)
                if fd != _GONE:
                    break
            else:
                raise UserError(f"out_dir={out_dir!r} was removed each time this start made it (another start's "
                                f"cleanup?): start again, or give another --out_dir")
        yield
    finally:
        if fd not in (None, _GONE):
            _unlock(out_dir, fd)
        for folder in reversed(made):  # the deepest first: a parent empties once its child is gone
            with contextlib.suppress(OSError):
                os.rmdir(folder)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT held back inside the block and delivered at its end (where the OS can; else as they come)."""
    try:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    except (AttributeError, ValueError, OSError):  # no pthread_sigmask (not POSIX)
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def make_folders(folder: str) -> list[str]:
    """Make `folder` and its missing parents; returns those made, the outermost first. A path that exists and is no
    folder, or one that cannot be made, is a UserError."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.isdir(path):
        if os.path.lexists(path):
            raise UserError(f"out_dir={folder!r}: {path} is {kind_of(path)}, not a folder: give another --out_dir")
        missing.append(path)
        path = os.path.dirname(path)
    made = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            continue  # made by another start meanwhile: not ours to remove
        except OSError as e:
            raise UserError(f"cannot make out_dir={folder!r} ({cause(e)} at {path}): choose a folder you can write "
                            f"to") from None
        made.append(path)
    return made


_GONE = -1  # _lock's answer when out_dir vanished under it: make it again


def _lock(out_dir: str) -> int | None:
    """The descriptor of out_dir/run.lock, locked, with this process written in it; a UserError if another holds it,
    or run.lock is not a lock file of ours; None (with a warning) where the file system cannot lock; _GONE where
    out_dir itself was removed meanwhile."""
    path = os.path.join(out_dir, LOCK_FILE)
    while True:
        made = not os.path.lexists(path)  # so that a record it cannot write leaves no empty run.lock behind
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            return _GONE
        except OSError as e:
            raise _lock_refused(path, e) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UserError(f"{path} is {kind_of(path)}, not the lock file a run makes: remove it, or give another "
                                f"--out_dir")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise UserError(
                f"out_dir={out_dir!r} is in use by a live run ({holder}; it holds {path}): a second start there would "
                f"move or overwrite its files. Wait for it to end (or stop it), or give another --out_dir"
            ) from None
        except UserError:
            os.close(fd)
            raise
        except OSError as e:
            os.close(fd)
            print(f"warning: cannot lock {path} ({e.strerror}): this file system does not lock files, so a second "
                  f"start in {out_dir} would not be refused", file=sys.stderr, flush=True)
            return None
        if _same_file(path, fd):  # not a lock file that its holder removed as it let go, just after we opened it
            break
        os.close(fd)
    content = os.pread(fd, 4096, 0)
    if content and not _is_lock_record(content):  # a file of someone else's: never written over
        os.close(fd)
        raise UserError(f"{path} is not a lock file of this project's (it holds {content[:40]!r}...): move it out of "
                        f"{out_dir}, or give another --out_dir")
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
    try:
        os.ftruncate(fd, 0)
        written = 0
        while written < len(record):  # a disk that fills takes part of it (a short write): the rest, or the error
            written += os.write(fd, record[written:])
    except OSError as e:
        if made:
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)
        raise _lock_refused(path, e) from None
    return fd


def _lock_refused(path: str, e: OSError) -> UserError:
    if e.errno == errno.ELOOP:
        why = "a symbolic link: a lock never writes through one"
    elif e.errno == errno.EISDIR:
        why = "a folder"
    else:
        why = cause(e)
    return UserError(f"cannot hold the run folder: {path} ({why}); a run writes in its out_dir: make it writable, "
                     f"remove what is in the lock's place, or give another --out_dir")


def _is_lock_record(content: bytes) -> bool:
    """Whether `content` is what _lock writes (or the start of it: a kill between the truncate and the write)."""
    try:
        record = json.loads(content)
    except ValueError:
        return b'{"pid": '.startswith(content[:8])
    return isinstance(record, dict) and set(record) == {"pid", "host", "since"}


def _unlock(out_dir: str, fd: int) -> None:
    path = os.path.join(out_dir, LOCK_FILE)
    if _same_file(path, fd):  # removed before the lock is let go: a start that opened it meanwhile opens it anew
        with contextlib.suppress(OSError):
            os.remove(path)
    os.close(fd)


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


def _holder(text: bytes) -> str:
    """Who holds the lock, from what it wrote in run.lock (any content: a process that is starting wrote none yet)."""
    try:
        holder = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {str(holder['pid'])[:20]} on {str(holder['host'])[:100]}, since {since}"
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, OSError):
        return "a process that is starting"


# ----------------------------------------------------------------------------------------------- the run in out_dir


def read_run(out_dir: str) -> dict | None:
    """out_dir's run.json (id, start time, torchrun's job), or None for a folder without one. A damaged one (cut
    short, edited by hand) is a UserError that names it and what to do."""
    path = os.path.join(out_dir, RUN_FILE)
    try:
        with open(path) as f:
            run = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: '[' nested past Python's limit
        raise _damaged(path, f"{type(e).__name__}: {e}") from None
    started = run.get("started") if isinstance(run, dict) else None
    if not (isinstance(run, dict) and isinstance(run.get("run_id"), str) and 0 < len(run["run_id"]) <= 64
            and type(started) in (int, float) and 0 <= started < 1e11):  # a time.time(), before the year 5000
        raise _damaged(path, "not a JSON object with a run_id string and a started time")
    return run


def _damaged(path: str, why: str) -> UserError:
    return UserError(f"{path} is damaged ({why[:200]}): remove it (a resume writes it again from its checkpoint's run "
                     f"id; a new run moves the files beside it aside and writes its own), or restore it")


def run_id_of(out_dir: str) -> str | None:
    run = read_run(out_dir)
    return run.get("run_id") if run else None


def has_checkpoint(out_dir: str) -> bool:
    return any(os.path.exists(os.path.join(out_dir, name)) for name in ("ckpt.pt", "ckpt_sharded"))


def resolve_init_from(init_from: str, out_dir: str, restart: int = 0, job: str | None = None) -> tuple[str, str]:
    """
    (the init_from this start uses, one line saying why, or "" when it is the one given). "auto": "resume" when
    out_dir holds a checkpoint, else "scratch". Restart `restart` (> 0) of torchrun's job `job`
    (distributed.torchrun_job) where out_dir holds a run of that job: "resume" (or the given init_from when the run
    saved nothing yet).
    """
    if init_from != "resume" and restart > 0 and job is not None and has_checkpoint(out_dir):
        if (read_run(out_dir) or {}).get("torchrun_job") == job:
            return "resume", (f"torchrun restart {restart} of the run in {out_dir}: resuming its newest checkpoint "
                              f"(init_from={init_from!r} applied at its first start)")
    if init_from == "auto":
        if has_checkpoint(out_dir):
            return "resume", f"init_from='auto': {out_dir} holds a run's checkpoint, resuming it"
        return "scratch", f"init_from='auto': no checkpoint in {out_dir}, starting from scratch"
    return init_from, ""


def _stamp(out_dir: str, names: list[str]) -> str:
    run = read_run(out_dir)
    started = run.get("started") if run else None
    if started is None:  # a folder from before run.json: its newest file's time
        started = max(os.lstat(os.path.join(out_dir, n)).st_mtime for n in names)
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(started))


def move_previous_run(out_dir: str) -> tuple[str, list[str], list[str]] | None:
    """Move the files of the run in out_dir (RUN_FILES, nothing else) into out_dir/previous/<its start time>/;
    returns that folder, the names moved and the folders made (for move_back), or None when there was nothing to
    move. A failure (a read-only folder, a full disk) moves back what it moved and is a WriteError: the run stays where
    it was."""
    if not os.path.isdir(out_dir):
        return None
    names = sorted(n for n in os.listdir(out_dir) if RUN_FILES.fullmatch(n))
    if not names:
        return None
    stamp = _stamp(out_dir, names)
    dest = os.path.join(out_dir, PREVIOUS, stamp)
    n = 1
    while os.path.lexists(dest):
        n += 1
        dest = os.path.join(out_dir, PREVIOUS, f"{stamp}-{n}")
    moved, made = [], [p for p in (os.path.dirname(dest), dest) if not os.path.isdir(p)]
    try:
        os.makedirs(dest)
        for name in names:  # renames within one file system: links between them (ckpt_sharded) keep working
            os.replace(os.path.join(out_dir, name), os.path.join(dest, name))
            moved.append(name)
    except OSError as e:
        move_back(out_dir, dest, moved, made)
        raise WriteError(f"could not move the previous run's files aside into {dest} ({cause(e)}): they stay where "
                         f"they were; make {out_dir} writable, or give another --out_dir") from None
    return dest, names, made


def move_back(out_dir: str, dest: str, names: list[str], made: list[str]) -> None:
    """Undo move_previous_run: the names back into out_dir, and the folders it `made` (previous/ too, if it made it)
    removed again."""
    for name in names:
        with contextlib.suppress(OSError):
            os.replace(os.path.join(dest, name), os.path.join(out_dir, name))
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def disk_usage(folder: str) -> int:
    """The bytes the files under `folder` take, each file once (keep_last's hard links share ckpt.pt's), links not
    followed (ckpt_sharded names a folder counted itself)."""
    seen, total = set(), 0
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _write_run(out_dir: str, run: dict) -> None:
    atomic_write(os.path.join(out_dir, RUN_FILE), lambda tmp: _write_text(tmp, json.dumps(run)), "the run's id")


def begin_run(out_dir: str, job: str | None = None) -> str:
    """Write out_dir/run.json for a new run, started by torchrun's job `job` (None: not under torchrun); returns its
    id."""
    run_id = uuid.uuid4().hex[:12]
    _write_run(out_dir, {"run_id": run_id, "started": time.time(), "torchrun_job": job})
    return run_id


def continue_run(out_dir: str, saved_run_id: str | None, job: str | None = None) -> str:
    """The id of the run a resume continues: the checkpoint's, run.json written for it where missing (a folder
    from before run ids) or left by another torchrun job (this job's restarts must recognise the run as theirs)."""
    run = read_run(out_dir) or {}
    want = {"run_id": saved_run_id or run.get("run_id") or uuid.uuid4().hex[:12],
            "started": run.get("started", time.time()), "torchrun_job": job}
    if run != want:
        _write_run(out_dir, want)
    return want["run_id"]


def restore_run(out_dir: str, run: dict | None) -> None:
    """Undo continue_run: run.json back to `run` (what read_run read before), or removed where there was none. Best
    effort, on the way out of a failed start: the write that failed is the error to report."""
    path = os.path.join(out_dir, RUN_FILE)
    with contextlib.suppress(OSError, UserError):
        if run is None:
            os.remove(path)
        elif read_run(out_dir) != run:
            _write_run(out_dir, run)


# ----------------------------------------------------------------------------------------------- writing in out_dir

# What a run writes in out_dir and reads back, and what each must be where it exists: a regular file, a folder, or one
# of the run's own links (ckpt_sharded names a folder of its own saves).
ENTRIES = {"run.lock": "file", RUN_FILE: "file", "metrics.jsonl": "file", "ckpt.pt": "file", "ckpt_best.pt": "file",
           "report.md": "file", "loss.png": "file", PREVIOUS: "folder", "ckpt_sharded": "link",
           "ckpt_sharded_best": "link"}


# keep_last's saves, one per iteration: a file (ckpt_0000600.pt), or a folder of DCP's shards (ckpt_sharded_0000600_1)
KEPT_SAVES = {re.compile(r"ckpt_\d{7,}\.pt"): "file", re.compile(r"ckpt_sharded_\d{7,}_\d+"): "folder"}


def check_entries(out_dir: str) -> None:
    """Before a start changes anything: every name the run writes in out_dir is absent or of its kind (ENTRIES,
    KEPT_SAVES). A symbolic link where a file goes (a write would replace it, or write through it into a file the run
    did not make), a folder where a file goes, or a file where previous/ goes is a UserError naming each; so are a
    run's names (report.md, metrics.jsonl) in a folder that holds no run: they are not a run's to move aside."""
    kept = {name: kind for name in os.listdir(out_dir) for pattern, kind in KEPT_SAVES.items()
            if pattern.fullmatch(name)}
    wrong = [f"{name} is {kind_of(os.path.join(out_dir, name))}, where the run writes a {kind}"
             for name, kind in {**ENTRIES, **kept}.items() if not _is_kind(os.path.join(out_dir, name), kind)]
    if wrong:
        raise UserError(f"out_dir={out_dir!r} holds what a run cannot write over: {'; '.join(wrong)}: move "
                        f"{'them' if len(wrong) > 1 else 'it'} out of {out_dir} (nothing there was changed), or give "
                        f"another --out_dir")
    names = sorted(n for n in os.listdir(out_dir) if RUN_FILES.fullmatch(n) and not _TEMPORARY.search(n))
    if names and not any(_A_RUNS.fullmatch(n) for n in names):  # a run writes run.json first; nanoGPT's, ckpt.pt
        raise UserError(f"out_dir={out_dir!r} holds {', '.join(names)} but no run (no {RUN_FILE}, no checkpoint): a "
                        f"new run would move {'them' if len(names) > 1 else 'it'} aside as a run's, or write over "
                        f"{'them' if len(names) > 1 else 'it'}; move {'them' if len(names) > 1 else 'it'} out of "
                        f"{out_dir} (nothing there was changed), or give another --out_dir")


def _is_kind(path: str, kind: str) -> bool:
    if not os.path.lexists(path):
        return True
    if kind == "link":  # the run's own: to one of its save folders beside it
        return os.path.islink(path) and os.path.isdir(path)
    if os.path.islink(path):
        return False
    return os.path.isdir(path) if kind == "folder" else stat.S_ISREG(os.lstat(path).st_mode)


def kind_of(path: str) -> str:
    """What is at `path`, in words: 'a symbolic link to X', 'a folder', 'a file', 'a FIFO', ..."""
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


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError that raised `e` or that `e` was raised from; for an error of a library written in Rust
    (safetensors' SafetensorError on a full disk: '... No space left on device (os error 28)'), the OSError its text
    names, which Python never saw."""
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


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error ends its text
_SHORT_WRITE = re.compile(r"inline_container\.cc.*unexpected pos \d+ vs \d+")  # torch's writer's own check


def cause(e: BaseException) -> str:
    """An OSError's cause in words ("No space left on device"), or a library's error caused by one (torch's writer
    raises RuntimeError('unexpected pos ...') from the OSError of a full disk; safetensors names it in its text)."""
    first, e = e, _os_error(e)
    if e is None:  # a library's error that names its cause only in its text (DCP's CheckpointException)
        return (str(first).strip().splitlines() or [type(first).__name__])[0][:200]
    if isinstance(e, FileExistsError) and e.filename:  # os.makedirs where a file stands
        return f"{e.filename} is a file, not a folder"
    return e.strerror or str(e) or type(e).__name__


def caused_by_os_error(e: BaseException) -> bool:
    """Whether an OSError is what raised `e`, or what it was raised from (torch's writer, matplotlib's savefig), or
    what a Rust library's error names (safetensors')."""
    return _os_error(e) is not None


OUT_DIR_FIX = "free disk space, make the folder writable, or choose another out_dir"


def write_failed(path: str, e: BaseException, kept: str = "", what: str = "", fix: str = OUT_DIR_FIX) -> WriteError:
    """The one line of a failed write: what and where, the cause, what was kept, and what to do."""
    kept = f"; {kept}" if kept else ""
    what = f"{what} " if what else ""
    return WriteError(f"could not write {what}{path} ({cause(e)}){kept}: {fix}")


def check_target(path: str) -> None:
    """A file is written at `path` (replaced whole, or appended to): refused where a symbolic link or anything but a
    regular file stands there, since writing would go through the link into a file the run did not make, or
    replace what is not the run's."""
    if os.path.lexists(path) and (os.path.islink(path) or not stat.S_ISREG(os.lstat(path).st_mode)):
        raise WriteError(f"could not write {path}: it is {kind_of(path)}, not a file of the run's: move it away (a run "
                         f"never writes through a link or over a foreign file)")


def target_problem(path: str) -> str | None:
    """Why a file cannot be written at `path`, asked before slow work (a benchmark's minutes) rather than found after
    it: a folder or link stands there, or the nearest existing folder above it is a file or not writable."""
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
    """Why a command must not write over the file at `path`: one there that is not `what` (what the command itself
    writes, as `is_ours` tells from its first MiB), e.g. a run's checkpoint given as a picture's name. None where
    nothing stands there, or a file of its own kind (a rerun's)."""
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
    """
    Write `path` whole or not at all: `write(tmp)` makes a temporary file beside it (flushed and fsynced by the
    writer), which is renamed over `path`, and the rename made durable. A crash at any moment leaves either the old
    file or the new one, never a torn one. Any failure (a full disk, no permission, a library's error raised from
    one) is a WriteError naming `what` and `path` and saying what to do (`fix`), and the old file stays as it was.
    """
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
    """
    atomic_write for several files: `write(tmp)` writes them into a new temporary folder inside `folder` (made where
    missing, so on the same file system), and only once every one is written and fsynced is each renamed over the
    file of its name in `folder`. The files there of `stale`'s names (what an earlier write of this kind writes) that
    this one does not write go aside with the replaced ones and are removed with them at the end (returned): nothing
    of an earlier write outlives it, and other files are untouched. Any failure (a full disk, no permission, a
    library's error raised from or naming one) is a WriteError naming `what`, `folder` and the cause, and leaves
    `folder` as it was: the temporary folder removed, the files already renamed over put back (one that cannot be is
    left in the temporary folder, and the error names it), a `folder` this made removed again. A kill leaves a set
    half renamed only in the moment of the renames, and the temporary folder (its old/: the files renamed over).
    """
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
            _fsync_file(os.path.join(new, name))
        gone = sorted(n for n in os.listdir(folder) if stale and stale.fullmatch(n) and n not in names
                      and _is_kind(os.path.join(folder, n), "file"))
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


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_text(path: str, text: str, what: str, fix: str = OUT_DIR_FIX) -> None:
    """A text file written whole (atomic_write)."""
    atomic_write(path, lambda tmp: _write_text(tmp, text), what, fix)


def append_line(path: str, line: str) -> None:
    """Append one line to `path` (made where missing), never through a symbolic link: whole or not at all. A disk
    that fills mid-line takes part of it (a short write); the rest is written until it is whole, or the part cut off
    again, so that no later line is ever glued to a fragment (and a file this made removed again). A failure is a
    WriteError."""
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
    """Point the symbolic link `path` at `target` (relative to its folder, so the run folder can move) with one rename:
    a reader sees the old target or the new one. A failure is a WriteError; the old link stays."""
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


def remove_saves(out_dir: str, names: list[str]) -> None:
    """Remove save folders the run wrote and no longer keeps (an older sharded save, one a kill left half written).
    Best effort: what cannot be removed now is removed by the next save."""
    for name in names:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def remove_file(path: str, what: str) -> None:
    """Remove a file the run wrote (a checkpoint keep_last no longer keeps); a failure is a WriteError."""
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
