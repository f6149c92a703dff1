"""Every write of a run under fault, SQLite's way: a short run is made to fail at each of its write operations in turn
(a full disk, a read-only file system, no permission: tests/faulty_disk.py fails the operation the way the OS does,
torch's and matplotlib's writers then raising their own errors), and a symbolic link, a folder or a foreign file is
put where a file goes, before the start and at the write itself. After each: one line, the exit status of what
happened (2: the start was refused and changed nothing; 1: the run stopped, saved where the disk allowed; 0: only the
report could not be written), and nothing saved before is lost: the folder as it was, or the previous run whole and
every checkpoint loadable. A real small file system (a tmpfs in a private mount namespace) fails the checkpoint the
way a full disk does, where this machine can make one."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import re
import shutil
import sys

import pytest

from faulty_disk import FaultyDisk, small_file_system
from helpers import ROOT, config_args, folder_state, tiny_config
from nanogpt.checkpoint_file import load_checkpoint
from nanogpt.checkpoints import find_checkpoint
from nanogpt.errors import UserError
from train import train

NEW_RUN = dict(max_iters=4, eval_interval=2, log_interval=1, keep_last=1, report=True)  # every kind of write


def first_run(data_dir, out) -> dict:
    """A finished run in `out` (a checkpoint at iter 2, its metrics and run.json): what the faulty start must keep."""
    with contextlib.redirect_stdout(io.StringIO()):
        train(tiny_config(data_dir, out, max_iters=2, eval_interval=2))
    return folder_state(out)


def faulty_start(cfg, out, monkeypatch, capsys, fail_at=None, err=errno.ENOSPC):
    """train(cfg) on a disk that fails operation `fail_at` under out: (the FaultyDisk, its error or None, stderr)."""
    capsys.readouterr()
    with monkeypatch.context() as m:
        disk = FaultyDisk(out, m, fail_at, err)
        try:
            train(cfg)
            error = None
        except UserError as e:
            error = e
    return disk, error, capsys.readouterr().err


def loads(path) -> int:
    return load_checkpoint(str(path))["iter_num"]


def check_kept(before: dict, out, moved_into: str | None) -> None:
    """Nothing of the first run is lost: each of its files is where it was or (a new run) in previous/<its time>/,
    byte for byte, but what a later save of the run may rewrite whole (a checkpoint that loads) or append to
    (metrics.jsonl: the old lines first)."""
    for name, data in before.items():
        if data is None or name == "run.lock":
            continue
        here = out / name
        moved = out / moved_into / name if moved_into else None
        if moved is not None and moved.exists():
            assert moved.read_bytes() == data, name
        elif name == "metrics.jsonl":
            assert here.read_bytes().startswith(data), name
        elif name.startswith("ckpt"):
            assert loads(here) >= 2, name
        else:
            assert here.read_bytes() == data, name


def check_outcome(disk, error, stderr, before, out, capsys_out="") -> None:
    op, name = disk.failed
    cause = {errno.ENOSPC: "No space left on device", errno.EROFS: "Read-only file system",
             errno.EACCES: "Permission denied"}[disk.err]
    previous = [p for p in (out / "previous").iterdir()] if (out / "previous").is_dir() else []
    if error is None:  # the run finished; only what follows the last save may fail, and says so
        assert name.startswith(("report.md", "loss.png", "run.lock")), (disk.failed, stderr)
        assert name.startswith("run.lock") or ("warning: no report" in stderr or "(no picture: could not write"
                                               in (out / "report.md").read_text()), (disk.failed, stderr)
        assert loads(out / "ckpt.pt") == 4
        return
    message = str(error)
    assert "\n" not in message and cause in message, (disk.failed, message)
    if error.exit_code == 2:  # refused before the start was accepted: the folder is as it was
        after = folder_state(out)
        after.pop("run.lock", None)
        assert after == {k: v for k, v in before.items() if k != "run.lock"}, (disk.failed, message)
        return
    assert error.exit_code == 1 and "The run stopped at iter" in message, (disk.failed, message)
    check_kept(before, out, os.path.relpath(previous[0], out) if previous else None)
    if (out / "metrics.jsonl").exists():  # a line the disk cut short is cut off whole: every line is a record
        lines = (out / "metrics.jsonl").read_bytes().split(b"\n")
        assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1]), (disk.failed, lines[-2:])
    said = re.search(r"a checkpoint at iter (\d+) was saved|(\S+) at iter (\d+) is intact|no checkpoint was saved",
                     message)
    assert said, message  # what a resume continues from, as it is on disk
    if said[1] or said[2]:
        found = find_checkpoint(str(out))
        assert (found.name if said[2] else "ckpt.pt", found.iter_num) == (said[2] or "ckpt.pt", int(said[1] or said[3]))
        assert f"(resume with python train.py --init_from=resume --out_dir={out})" in message, message
    else:  # a resume would find nothing: the line must not say to resume
        assert not (out / "ckpt.pt").exists() and "--init_from=resume" not in message, message
    if (out / "ckpt.pt").exists():
        assert loads(out / "ckpt.pt") <= 4


@pytest.mark.slow
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EACCES], ids=["ENOSPC", "EROFS", "EACCES"])
def test_a_new_run_fails_at_each_write_in_turn_and_loses_nothing(data_dir, tmp_path, monkeypatch, capsys, err):
    """A new run in a folder that holds a finished run: the lock, the move to previous/, run.json, metrics.jsonl's
    lines, each checkpoint and its keep_last link, the link's removal, loss.png and report.md, each failed in turn."""
    out = tmp_path / "out"
    first_run(data_dir, out)
    clean = tmp_path / "clean"
    shutil.copytree(out, clean, symlinks=True)
    disk, error, _ = faulty_start(tiny_config(data_dir, out, **NEW_RUN), out, monkeypatch, capsys)
    assert error is None
    points = len(disk.ops)
    kinds = {name.split(".tmp.")[0].split("/")[0] for _, name in disk.ops}
    assert {"run.lock", "previous", "run.json", "metrics.jsonl", "ckpt.pt", "ckpt_0000002.pt", "report.md",
            "loss.png"} <= kinds, kinds
    for i in range(points):
        shutil.rmtree(out)
        shutil.copytree(clean, out, symlinks=True)
        before = folder_state(out)
        disk, error, stderr = faulty_start(tiny_config(data_dir, out, **NEW_RUN), out, monkeypatch, capsys, i, err)
        assert disk.failed is not None, i
        check_outcome(disk, error, stderr, before, out)


@pytest.mark.slow
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS], ids=["ENOSPC", "EROFS"])
@pytest.mark.parametrize("run_json", [True, False], ids=["run.json", "no run.json"])
def test_a_resume_fails_at_each_write_in_turn_and_loses_nothing(data_dir, tmp_path, monkeypatch, capsys, run_json,
                                                               err):
    """A resume from iter 2 to 4: no move, its metrics appended, its checkpoints replaced whole; in a folder from
    before run ids too, where the resume writes run.json first."""
    out = tmp_path / "out"
    first_run(data_dir, out)
    if not run_json:
        (out / "run.json").unlink()
    clean = tmp_path / "clean"
    shutil.copytree(out, clean, symlinks=True)
    cfg = tiny_config(data_dir, out, **{**NEW_RUN, "init_from": "resume"})
    disk, error, _ = faulty_start(cfg, out, monkeypatch, capsys)
    assert error is None
    for i in range(len(disk.ops)):
        shutil.rmtree(out)
        shutil.copytree(clean, out, symlinks=True)
        before = folder_state(out)
        disk, error, stderr = faulty_start(cfg, out, monkeypatch, capsys, i, err)
        check_outcome(disk, error, stderr, before, out)


FILES = ["run.lock", "run.json", "metrics.jsonl", "ckpt.pt", "ckpt_best.pt", "report.md", "loss.png",
         "ckpt_0000004.pt"]  # keep_last's save at the iteration this run reaches
MISPLACED = ([(name, "link") for name in [*FILES, "previous"]] + [(name, "folder") for name in FILES]
             + [("previous", "file"), ("run.lock", "foreign lock"), ("ckpt_sharded_0000004_1", "file")])


@pytest.mark.parametrize("name, kind", MISPLACED, ids=[f"{n}-{k}" for n, k in MISPLACED])
def test_a_link_a_folder_or_a_foreign_file_where_the_run_writes_refuses_the_start(data_dir, tmp_path, capsys, name,
                                                                                     kind):
    """Bug: a run.lock that was a symbolic link emptied the file it pointed to (the lock followed it, truncated it and
    wrote its JSON); a file named previous ended the move in NotADirectoryError. Now each is one line before anything
    changes, and the file a link points to is untouched."""
    out = tmp_path / "out"
    first_run(data_dir, out)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    target = out / name
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if kind == "link":
        os.symlink(notes, target)
    elif kind == "folder":
        target.mkdir()
    else:  # a file where the run's folder goes; a lock file of someone else's
        target.write_text("not the run's\n")
    before = folder_state(out)
    r = run_in_process_quiet(["train.py", *config_args(tiny_config(data_dir, out, **NEW_RUN))], capsys)
    assert r[0] == 2, r
    (line,) = r[1].splitlines()
    assert line.startswith("error: ") and name in line, line
    assert folder_state(out) == before and notes.read_text() == "my notes\n"


def run_in_process_quiet(args, capsys):
    from helpers import run_in_process

    r = run_in_process(args, capsys)
    return r.returncode, r.stderr


@pytest.mark.parametrize("name", ["metrics.jsonl", "ckpt.pt"])
@pytest.mark.parametrize("kind", ["link", "folder"])
def test_a_link_or_folder_put_in_a_files_place_mid_run_stops_it_saving_what_it_can(data_dir, tmp_path, monkeypatch,
                                                                                   capsys, name, kind):
    """The file replaced by a link or a folder while the run goes on (after the start's checks): the next write there
    refuses it, the run stops with one line and exit status 1, and the link's target is untouched."""
    from nanogpt import files

    out = tmp_path / "out"
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    check_target, seen = files.check_target, []

    def planted(path):
        if os.path.basename(path) == name and os.path.exists(path) and not seen:
            seen.append(path)
            os.remove(path)
            os.symlink(notes, path) if kind == "link" else os.mkdir(path)
        check_target(path)

    monkeypatch.setattr(files, "check_target", planted)
    with pytest.raises(UserError) as e:
        with contextlib.redirect_stdout(io.StringIO()):
            train(tiny_config(data_dir, out, **NEW_RUN))
    assert seen and e.value.exit_code == 1 and "\n" not in str(e.value), str(e.value)
    assert f"could not write {out / name}: it is " in str(e.value) and "The run stopped at iter" in str(e.value)
    assert notes.read_text() == "my notes\n"
    if name == "metrics.jsonl":  # the stop saved a checkpoint: the disk had room
        assert loads(out / "ckpt.pt") == int(str(e.value).split("checkpoint at iter ")[1].split(" ")[0])


SMALL_DISK = """
{python} train.py {args} --out_dir={mnt}/out > {mnt}/stdout 2> {log}
echo "exit $?" >> {log}
{python} -c "
import sys; sys.path.insert(0, '{root}')
from nanogpt.checkpoint_file import load_checkpoint
from nanogpt.checkpoints import find_checkpoint
try:
    print('checkpoint', load_checkpoint('{mnt}/out/ckpt.pt')['iter_num'])
except Exception as e:
    print('checkpoint', type(e).__name__, e)
" >> {log}
"""


def small_disk_run(data_dir, tmp_path, size: str) -> list[str]:
    """train.py on a tmpfs of `size` (faulty_disk.small_file_system); its stderr, exit status and what its ckpt.pt
    loads as, read inside the namespace."""
    mnt, log = tmp_path / "mnt", tmp_path / "log"
    cfg = tiny_config(data_dir, "unused", max_iters=4, eval_interval=2, log_interval=1)
    args = " ".join(f"'{a}'" for a in config_args(cfg) if not a.startswith("--out_dir="))
    small_file_system(tmp_path, size, SMALL_DISK.format(mnt=mnt, python=sys.executable, args=args, log=log, root=ROOT))
    return log.read_text().splitlines()


@pytest.mark.slow
def test_a_checkpoint_on_a_full_small_file_system_is_one_line_and_the_last_one_stays(data_dir, tmp_path):
    """Bug: on a real full file system torch's writer raises RuntimeError('[enforce fail at inline_container.cc]
    unexpected pos ...'), not the OSError a patched disk raises, and the run ended in a traceback. On a 600 KB tmpfs
    the first checkpoint (iter 2, ~340 KB) fits and the second cannot be written beside it: one line, exit 1, and the
    checkpoint of iter 2 loads."""
    lines = small_disk_run(data_dir, tmp_path, "600k")
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), lines[-12:]
    assert "could not write checkpoint" in errors[0] and "No space left on device" in errors[0], errors
    assert "the previous checkpoint is intact" in errors[0] and "The run stopped at iter 4" in errors[0], errors
    assert lines[-2:] == ["exit 1", "checkpoint 2"], lines[-12:]


def test_a_first_run_that_can_save_no_checkpoint_does_not_say_to_resume(data_dir, tmp_path, monkeypatch):
    """Bug: a new run whose every checkpoint write failed (a disk full from its first save) ended with "no checkpoint
    was saved (resume with --init_from=resume)", and that resume then found no checkpoint. The line says there is
    nothing to resume."""
    from nanogpt import checkpoint_file, files

    write = files.atomic_write

    def full_for_checkpoints(path, *args, **kwargs):
        if os.path.basename(path).startswith("ckpt"):
            raise files.write_failed(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return write(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_file.files, "atomic_write", full_for_checkpoints)
    out = tmp_path / "out"
    with pytest.raises(UserError) as e:
        train(tiny_config(data_dir, out, max_iters=4, eval_interval=2))
    assert e.value.exit_code == 1 and str(e.value).endswith(
        "The run stopped at iter 2: no checkpoint was saved, so there is nothing to resume: start again once the disk "
        "has room"), str(e.value)
    assert not (out / "ckpt.pt").exists()


SMALL_DISK_SHARDED = """
{python} train.py {args} --parallelism=fsdp --out_dir={mnt}/out > {mnt}/stdout 2> {log}
echo "exit $?" >> {log}
ls {mnt}/out >> {log}
{python} -c "
import sys; sys.path.insert(0, '{root}')
from nanogpt.checkpoints import find_checkpoint
found = find_checkpoint('{mnt}/out')
print('checkpoint', found.name, found.iter_num)
" >> {log} 2>&1
"""


@pytest.mark.slow
def test_a_sharded_checkpoint_on_a_full_small_file_system_is_one_line_and_the_last_one_stays(data_dir, tmp_path):
    """Bug: on a real full file system DCP raised its CheckpointException (a BaseException, which the save's
    `except Exception` let through) over torch's writer's RuntimeError('unexpected pos ...'), whose OSError it does
    not keep: a traceback. Now one line, exit 1, the link still names the first save, and the part-written folders of
    the failed save and of the stop's attempt are removed."""
    mnt, log = tmp_path / "mnt", tmp_path / "log"
    cfg = tiny_config(data_dir, "unused", max_iters=4, eval_interval=2, log_interval=1)
    args = " ".join(f"'{a}'" for a in config_args(cfg) if not a.startswith("--out_dir="))
    small_file_system(tmp_path, "700k", SMALL_DISK_SHARDED.format(mnt=mnt, python=sys.executable, args=args, log=log,
                                                                  root=ROOT))
    lines = log.read_text().splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), lines[-12:]
    assert errors[0].startswith(f"error: could not write sharded checkpoint {mnt / 'out' / 'ckpt_sharded_0000004_0'} ("
                                ), errors
    assert errors[0].endswith("The run stopped at iter 4: ckpt_sharded at iter 2 is intact (resume with python train.py "
                              f"--init_from=resume --out_dir={mnt / 'out'})"), errors
    exit_at = lines.index("exit 1")
    assert lines[exit_at + 1:] == ["ckpt_sharded", "ckpt_sharded_0000002_0", "metrics.jsonl", "run.json",
                                   "checkpoint ckpt_sharded 2"], lines[exit_at:]


def test_torchs_writer_finding_its_file_short_is_a_failed_write():
    """DCP's writer on a full tmpfs: torch's zip writer raises RuntimeError('[enforce fail at inline_container.cc:672]
    . unexpected pos 704 vs 598') with no OSError behind it (seen on a 800 KB tmpfs, FSDP, the second save): a
    failed write, one line, not a traceback. Any other RuntimeError stays a bug's."""
    from nanogpt import files

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert files.caused_by_os_error(short) and files.cause(short) == "a write was cut short (a full disk?)"
    assert not files.caused_by_os_error(RuntimeError("shape mismatch: unexpected pos"))


@pytest.mark.slow
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS], ids=["ENOSPC", "EROFS"])
def test_a_first_start_in_a_new_folder_fails_at_each_write_and_the_same_command_then_runs(data_dir, tmp_path,
                                                                                         monkeypatch, capsys, err):
    """A review's reproduction: the first start in an empty folder whose first metrics.jsonl line could not be
    written left an empty metrics.jsonl (run.json removed again), which the next start refused as a file of no run.
    Each write of such a start failed in turn: the folder holds nothing of it afterwards (or a whole checkpoint,
    once one was saved), and the same command then runs."""
    out = tmp_path / "out"
    cfg = tiny_config(data_dir, out, max_iters=2, eval_interval=2)
    disk, error, _ = faulty_start(cfg, out, monkeypatch, capsys)
    assert error is None
    points = len(disk.ops)
    for i in range(points):
        shutil.rmtree(out)
        disk, error, stderr = faulty_start(cfg, out, monkeypatch, capsys, i, err)
        assert disk.failed is not None, i
        if error is not None and error.exit_code == 2:  # refused before the start was accepted: nothing of it stays
            assert not out.exists() or os.listdir(out) == [], (disk.failed, os.listdir(out))
        with contextlib.redirect_stdout(io.StringIO()):
            train(dataclasses.replace(cfg, init_from="auto"))  # the same command again (auto: resumes a saved one)
        assert (out / "ckpt.pt").exists(), disk.failed
