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

Moving aside instead of refusing: a nanoGPT user reruns the same command and expects a fresh run (nanoGPT would
overwrite); a team's long run continues through init_from=auto; and a mistaken new start loses nothing either
way: the previous run's folder still resumes (`--out_dir=out/previous/<time>`).

Imports errors.py only; start.py and checkpoint_manager.py import it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import stat
import sys
import time
import uuid
from collections.abc import Iterator

from nanogpt.errors import UserError

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"  # held by the live run (hold); never moved aside
PREVIOUS = "previous"
# what a run writes in out_dir, and so what a new run moves aside (nothing else in the folder is touched)
_NAMES = (r"ckpt(_best)?\.pt|ckpt_\d{7,}\.pt|ckpt_sharded(_best)?|ckpt_sharded_\d{7,}_\d+|metrics(\.\d+)?\.jsonl"
          r"|report\.md|loss\.png|run\.json")
RUN_FILES = re.compile(rf"({_NAMES})(\.tmp\.\d+)?")  # and the temporary names their atomic writes use


# ----------------------------------------------------------------------------------------------- the live run's hold


@contextlib.contextmanager
def hold(out_dir: str, enabled: bool = True) -> Iterator[None]:
    """
    Hold out_dir for this process's run, from before its start is decided to its end: a second start there is
    refused (UserError naming the holder's pid and host) before it reads or changes anything in the folder. The hold
    is an OS lock (flock) on out_dir/run.lock, which the OS lets go when the process ends, however it ends: a
    SIGKILLed run leaves the folder free, with no stale lock to clear. It works wherever the file system locks files
    (node-local ones; NFS through its lock manager); one that does not gets a warning and no hold. Makes out_dir
    where missing, and removes it again if it is still empty at the end (a refused start leaves no folder behind).
    """
    if not enabled:
        yield
        return
    made = not os.path.isdir(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make out_dir={out_dir!r} ({e.strerror}): choose a folder you can write to") from None
    fd = None
    try:
        fd = _lock(out_dir)
        yield
    finally:
        if fd is not None:
            _unlock(out_dir, fd)
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)


def _lock(out_dir: str) -> int | None:
    """The descriptor of out_dir/run.lock, locked, with this process written in it; a UserError if another holds it;
    None (with a warning) where the file system cannot lock."""
    path = os.path.join(out_dir, LOCK_FILE)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise UserError(
                f"out_dir={out_dir!r} is in use by a live run ({holder}; it holds {path}): a second start there would "
                f"move or overwrite its files. Wait for it to end (or stop it), or give another --out_dir"
            ) from None
        except OSError as e:
            os.close(fd)
            print(f"warning: cannot lock {path} ({e.strerror}): this file system does not lock files, so a second "
                  f"start in {out_dir} would not be refused", file=sys.stderr, flush=True)
            return None
        if _same_file(path, fd):  # not a lock file that its holder removed as it let go, just after we opened it
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
    return fd


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
    """Who holds the lock, from what it wrote in run.lock."""
    try:
        holder = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
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
    except (OSError, ValueError) as e:
        raise _damaged(path, f"{type(e).__name__}: {e}") from None
    if not (isinstance(run, dict) and isinstance(run.get("run_id"), str) and isinstance(run.get("started"), (int, float))):
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
        started = max(os.path.getmtime(os.path.join(out_dir, n)) for n in names)
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(started))


def move_previous_run(out_dir: str) -> str | None:
    """Move the files of the run in out_dir (RUN_FILES, nothing else) into out_dir/previous/<its start time>/;
    returns that folder, or None when there was nothing to move."""
    if not os.path.isdir(out_dir):
        return None
    names = sorted(n for n in os.listdir(out_dir) if RUN_FILES.fullmatch(n))
    if not names:
        return None
    stamp = _stamp(out_dir, names)
    dest = os.path.join(out_dir, PREVIOUS, stamp)
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(out_dir, PREVIOUS, f"{stamp}-{n}")
    os.makedirs(dest)
    for name in names:  # renames within one file system: links between them (ckpt_sharded) keep working
        os.replace(os.path.join(out_dir, name), os.path.join(dest, name))
    return dest


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
    tmp = os.path.join(out_dir, f".{RUN_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(run, f)
    os.replace(tmp, os.path.join(out_dir, RUN_FILE))


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
