"""The run folder: an out_dir holds one run, and this module names every file a run writes there, holds the folder
for its live run (rank 0's lock, for all ranks) and decides how a start treats what it finds. Every run gets an id, in
run.json and in each checkpoint and metrics.jsonl, so another run's checkpoint is never resumed as this one's. A new
run never destroys an earlier one: a nanoGPT user reruns the same command and expects a fresh run, so the old run's
files are moved aside into out_dir/previous/<time>/, from where it still resumes."""
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
import time
import uuid
from collections.abc import Iterator

from nanogpt.errors import UserError, WriteError
from nanogpt.files import cause, kind_of, write_text

# Every file a run writes in out_dir
RUN_FILE, LOCK_FILE, PREVIOUS = "run.json", "run.lock", "previous"  # run.lock: held by the live run, never moved
CKPT, BEST = "ckpt.pt", "ckpt_best.pt"  # the latest save; the best val loss's weights (always_save_checkpoint=False)
SHARDED, SHARDED_BEST = "ckpt_sharded", "ckpt_sharded_best"  # FSDP's: links to save folders beside them
METRICS, REPORT, LOSS_PNG = "metrics.jsonl", "report.md", "loss.png"
KEPT = re.compile(r"ckpt_(\d{7,})\.pt")  # keep_last's saves (kept_name)
SHARDED_FOLDER = re.compile(r"ckpt_sharded_(\d{7,})_\d+")  # a sharded save's folder (sharded_folder)


def kept_name(iter_num: int) -> str:
    return f"ckpt_{iter_num:07d}.pt"


def sharded_folder(iter_num: int, n: int) -> str:
    return f"{SHARDED}_{iter_num:07d}_{n}"


_CHECKPOINTS = rf"{re.escape(CKPT)}|{re.escape(BEST)}|{KEPT.pattern}|{SHARDED}(_best)?|{SHARDED_FOLDER.pattern}"
# what a new run moves aside (nothing else in the folder is touched), with the temporary names of atomic writes
RUN_FILES = re.compile(rf"({_CHECKPOINTS}|metrics(\.\d+)?\.jsonl|{re.escape(REPORT)}|{re.escape(LOSS_PNG)}"
                       rf"|{re.escape(RUN_FILE)})(\.tmp\.\d+)?")
_TEMPORARY = re.compile(r"\.tmp\.\d+$")
# what only a run writes (report.md, metrics.jsonl and loss.png alone are any program's names)
_A_RUNS = re.compile(rf"{re.escape(RUN_FILE)}|{_CHECKPOINTS}")


@contextlib.contextmanager
def hold(out_dir: str, enabled: bool = True) -> Iterator[None]:
    """Hold out_dir for this process's run, from before its start is decided to its end: a second start there is
    refused (UserError naming the holder) before it reads or changes anything. An flock on run.lock, let go when the
    process ends (a SIGKILL too); a file system that cannot lock gets a warning. Folders it made go if left empty."""
    if not enabled:
        yield
        return
    made, fd = [], None
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
    """Make `folder` and its missing parents; returns those made, outermost first; a UserError where it cannot."""
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
    """out_dir/run.lock's descriptor, locked, this process recorded in it; a UserError if another holds it or it is
    not our lock file; None (with a warning) where the file system cannot lock; _GONE where out_dir was removed."""
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
            raise UserError(f"out_dir={out_dir!r} is in use by a live run ({holder}; it holds {path}): a second start "
                            f"there would move or overwrite its files. Wait for it to end (or stop it), or give "
                            f"another --out_dir") from None
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
    why = {errno.ELOOP: "a symbolic link: a lock never writes through one", errno.EISDIR: "a folder"}.get(e.errno)
    why = why or cause(e)
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


def read_run(out_dir: str) -> dict | None:
    """out_dir's run.json (id, start time, torchrun's job); None where there is none, a UserError where damaged."""
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
    return any(os.path.exists(os.path.join(out_dir, name)) for name in (CKPT, SHARDED))


def resolve_init_from(init_from: str, out_dir: str, restart: int = 0, job: str | None = None) -> tuple[str, str]:
    """(the init_from this start uses, a line saying why or ""). "auto": "resume" when out_dir holds a checkpoint,
    else "scratch". A torchrun restart (`restart` > 0) of the `job` that started the run in out_dir resumes it."""
    if init_from != "resume" and restart > 0 and job is not None and has_checkpoint(out_dir):
        if (read_run(out_dir) or {}).get("torchrun_job") == job:
            return "resume", (f"torchrun restart {restart} of the run in {out_dir}: resuming its newest checkpoint "
                              f"(init_from={init_from!r} applied at its first start)")
    if init_from == "auto":
        if has_checkpoint(out_dir):
            return "resume", f"init_from='auto': {out_dir} holds a run's checkpoint, resuming it"
        return "scratch", f"init_from='auto': no checkpoint in {out_dir}, starting from scratch"
    return init_from, ""


def move_previous_run(out_dir: str) -> tuple[str, list[str], list[str]] | None:
    """Move the run's files (RUN_FILES, nothing else) into out_dir/previous/<its start time>/; returns that folder, the
    names moved and the folders made (for move_back), or None. A failure moves back what it moved: a WriteError."""
    names = sorted(n for n in os.listdir(out_dir) if RUN_FILES.fullmatch(n)) if os.path.isdir(out_dir) else []
    if not names:
        return None
    started = (read_run(out_dir) or {}).get("started")
    if started is None:  # a folder from before run.json: its newest file's time
        started = max(os.lstat(os.path.join(out_dir, n)).st_mtime for n in names)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
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
    """Undo move_previous_run: the names back into out_dir, the folders it `made` removed again."""
    for name in names:
        with contextlib.suppress(OSError):
            os.replace(os.path.join(dest, name), os.path.join(out_dir, name))
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def disk_usage(folder: str) -> int:
    """The bytes under `folder`, each file once (keep_last's hard links share ckpt.pt's), links not followed."""
    seen, total = set(), 0
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _write_run(out_dir: str, run: dict) -> None:
    write_text(os.path.join(out_dir, RUN_FILE), json.dumps(run), "the run's id")


def begin_run(out_dir: str, job: str | None = None) -> str:
    """Write run.json for a new run started by torchrun's `job` (None: not under torchrun); returns its id."""
    run_id = uuid.uuid4().hex[:12]
    _write_run(out_dir, {"run_id": run_id, "started": time.time(), "torchrun_job": job})
    return run_id


def continue_run(out_dir: str, saved_run_id: str | None, job: str | None = None) -> str:
    """The checkpoint's run id; run.json rewritten where it differs, so this torchrun job's restarts know the run."""
    run = read_run(out_dir) or {}
    want = {"run_id": saved_run_id or run.get("run_id") or uuid.uuid4().hex[:12],
            "started": run.get("started", time.time()), "torchrun_job": job}
    if run != want:
        _write_run(out_dir, want)
    return want["run_id"]


def restore_run(out_dir: str, run: dict | None) -> None:
    """Undo continue_run: run.json back to `run` (None: removed); best effort, the failed write is what to report."""
    path = os.path.join(out_dir, RUN_FILE)
    with contextlib.suppress(OSError, UserError):
        if run is None:
            os.remove(path)
        elif read_run(out_dir) != run:
            _write_run(out_dir, run)


# What each name a run writes in out_dir must be where it exists: a file, a folder, or a link to a save of its own
ENTRIES = {LOCK_FILE: "file", RUN_FILE: "file", METRICS: "file", CKPT: "file", BEST: "file", REPORT: "file",
           LOSS_PNG: "file", PREVIOUS: "folder", SHARDED: "link", SHARDED_BEST: "link"}
KEPT_SAVES = {KEPT: "file", SHARDED_FOLDER: "folder"}  # one per kept iteration: ckpt_0000600.pt, ckpt_sharded_0000600_1


def check_entries(out_dir: str) -> None:
    """Before a start changes anything: every name the run writes in out_dir is absent or of its kind, and
    report.md or metrics.jsonl stand only beside a run (else they are not a run's to move aside); else a UserError."""
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
        it = "them" if len(names) > 1 else "it"
        raise UserError(f"out_dir={out_dir!r} holds {', '.join(names)} but no run (no {RUN_FILE}, no checkpoint): a "
                        f"new run would move {it} aside as a run's, or write over {it}; move {it} out of "
                        f"{out_dir} (nothing there was changed), or give another --out_dir")


def run_files_in(folder: str) -> list[str]:
    """The names in `folder` that only a run writes (run.json, checkpoints): a run's folder where there are any."""
    return sorted(n for n in os.listdir(folder) if _A_RUNS.fullmatch(n)) if os.path.isdir(folder) else []


def _is_kind(path: str, kind: str) -> bool:
    if not os.path.lexists(path):
        return True
    if kind == "link":  # the run's own: to one of its save folders beside it
        return os.path.islink(path) and os.path.isdir(path)
    if os.path.islink(path):
        return False
    return os.path.isdir(path) if kind == "folder" else stat.S_ISREG(os.lstat(path).st_mode)


def remove_saves(out_dir: str, names: list[str]) -> None:
    """Remove save folders the run no longer keeps. Best effort: what cannot be removed now, the next save removes."""
    for name in names:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


