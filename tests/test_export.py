"""export.py: a checkpoint -> a HF GPT-2 folder. GPT2LMHeadModel.from_pretrained on the export gives our logits (both
GELU forms, bias=False), importing it back gives the same weights bitwise, HF's greedy generate gives sample.py's
tokens, and what GPT-2 cannot express is refused in one line."""
from __future__ import annotations

import dataclasses
import errno
import os
import sys
from pathlib import Path

import pytest
import torch

import export
from nanogpt.errors import UserError
from nanogpt.checkpoint_file import save_checkpoint
from faulty_disk import FaultyDisk, small_file_system
from helpers import make_char_dataset, run_in_process, run_script
from model import GPT, GPTConfig
from sample import SampleConfig, load_model, sample
from test_nanogpt import nanogpt_adamw, nanogpt_checkpoint, nanogpt_model


def perturbed(model: GPT, seed: int) -> GPT:
    """Every parameter moved off its init (biases and LayerNorms are 0 and 1 there), so each one's mapping counts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def write_run(out_dir, model: GPT, run_config: dict, name: str = "ckpt.pt") -> None:
    """A checkpoint as train.py writes it (the fields export reads)."""
    state = {"model": model.state_dict(), "model_args": dataclasses.asdict(model.config), "config": run_config,
             "iter_num": 10, "best_val_loss": 2.0}
    save_checkpoint(os.path.join(out_dir, name), state)


@pytest.mark.parametrize("gelu,bias,hf_activation", [("tanh", True, "gelu_new"), ("erf", True, "gelu"),
                                                      ("tanh", False, "gelu_new")])
def test_round_trip_logits_and_bitwise_reimport_char_run(tmp_path, capsys, gelu, bias, hf_activation):
    from transformers import GPT2LMHeadModel

    meta = make_char_dataset(tmp_path / "chars", n_chars=2000)
    V = meta["vocab_size"]  # not a multiple of 64: the model has padded rows
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=V, n_layer=2, n_head=2, n_embd=32, block_size=32, bias=bias, gelu=gelu)
    ours = perturbed(GPT(config), 1)
    assert ours.lm_head.weight.shape[0] == 64 > V
    write_run(tmp_path / "run", ours, {"dataset": "chars", "data_dir": str(tmp_path / "chars")}, name="ckpt_best.pt")
    export.main([f"--out_dir={tmp_path / 'run'}", "--ckpt=ckpt_best.pt", f"--to={tmp_path / 'hf'}"])
    note = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"vocab_size {V}, activation {hf_activation}; tokenizer: the run's {V} characters in meta.json" in note
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json", "meta.json",
                                                   "model.safetensors"]

    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.vocab_size == V and hf.config.activation_function == hf_activation
    idx = torch.randint(0, V, (3, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, _ = ours(idx)  # (B, T, V): our logits over the real vocabulary
        got = hf(idx).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)

    back = GPT.from_pretrained(str(tmp_path / "hf"))
    assert back.config.gelu == gelu and back.config.vocab_size == V
    mine, theirs = ours.state_dict(), back.state_dict()
    for k, v in theirs.items():
        if k in ("transformer.wte.weight", "lm_head.weight"):
            assert torch.equal(v[:V], mine[k][:V]), k
        elif k in mine:
            assert torch.equal(v, mine[k]), k
        else:  # bias=False: GPT-2's layout has the bias, exported as zeros
            assert not bias and k.endswith(".bias") and not v.any(), k


@pytest.mark.slow
def test_nanogpt_gpt2_checkpoint_exports_with_tokenizer_and_generates_our_greedy_tokens(tmp_path, gpt2_bpe, capsys):
    """nanoGPT's 50304-row GPT-2 run (compiled-model prefixes): exported with 50257 rows and the GPT-2 tokenizer;
    HF's greedy generate from the folder alone gives the tokens of our sample.py."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    source = perturbed(nanogpt_model(50304, seed=3, n_layer=1, n_embd=16), 4)
    with torch.no_grad():
        source.lm_head.weight.mul_(20.0)  # peaked logits: greedy choices far from ties between implementations
    os.makedirs(tmp_path / "run")
    args = {k: getattr(source.config, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size",
                                                   "dropout")}
    torch.save(nanogpt_checkpoint(source.state_dict(), nanogpt_adamw(source).state_dict(), args,
                                  {"dataset": "no-such-dataset"}, iter_num=5000, best_val_loss=3.3),
               tmp_path / "run" / "ckpt.pt")
    export.main([f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}"])
    assert "vocab_size 50257, activation gelu; tokenizer: GPT-2 BPE" in capsys.readouterr().err.strip().splitlines()[-1]

    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    prompt = "First Citizen: Before we proceed any further, hear me speak."
    assert tok(prompt)["input_ids"] == gpt2_bpe.encode(prompt)
    assert torch.equal(hf.transformer.wte.weight, source.transformer.wte.weight[:50257])
    cfg = SampleConfig(out_dir=str(tmp_path / "run"), start=prompt, device="cpu", dtype="float32", temperature=0.0,
                       num_samples=1, max_new_tokens=12)
    model, tokenizer = load_model(cfg)
    ours = sample(model, tokenizer, prompt, cfg).ids[0]
    ids = torch.tensor([tok(prompt)["input_ids"]])
    theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         pad_token_id=tok.eos_token_id)[0].tolist()
    assert theirs == ours


@pytest.mark.slow
def test_what_gpt2_cannot_express_is_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, block_size=16))
    state = {"model": model.state_dict(), "model_args": {**dataclasses.asdict(model.config), "rope_theta": 10000.0},
             "config": {}}
    save_checkpoint(str(tmp_path / "run" / "ckpt.pt"), state)
    r = run_script(["export.py", f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}"])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: cannot export: rope_theta=10000.0 has no equivalent in HF's GPT-2 (GPT2LMHeadModel), so the exported "
        "model would compute something else; export.py must learn to map it first"]
    assert not (tmp_path / "hf").exists()
    with pytest.raises(UserError, match="name the folder to write"):
        export.main([f"--out_dir={tmp_path / 'run'}"])


def test_readme_export_commands_parse():
    import shlex

    from configurator import configure
    from helpers import doc_files

    lines = [ln.split("  #")[0] for path in doc_files() for ln in open(path) if ln.startswith("python export.py ")]
    assert len(lines) >= 2  # a run's ckpt.pt, another file of the run
    for line in lines:
        cfg = configure(export.ExportConfig(), shlex.split(line)[2:])
        assert cfg.to and cfg.out_dir != "out", line


def test_without_the_gpt2_bpe_files_the_folder_gets_no_tokenizer_and_a_note(tmp_path, monkeypatch):
    """No tiktoken cache and no network (the read fails as requests' errors do, with an OSError)."""
    import tiktoken.load

    from nanogpt import tokenizers

    def offline(url, expected_hash=None):
        raise OSError(f"no network for {url}")

    monkeypatch.setattr(tiktoken.load, "read_file_cached", offline)
    note = export.write_tokenizer(str(tmp_path), object.__new__(tokenizers.GPT2Tokenizer), block_size=32)
    assert note == (f"GPT-2 BPE files not available (OSError), so the folder has no tokenizer: add it with python -c "
                    f"\"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('gpt2')"
                    f".save_pretrained('{tmp_path}')\"")
    assert os.listdir(tmp_path) == []


def test_a_target_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """--to names a file (refused: exit status 2), a folder that cannot be made, or a disk that fills while the
    weights are written (the write failed: 1): one line each (a traceback before), the run's checkpoint untouched
    and no --to left behind."""
    import errno

    from transformers import GPT2LMHeadModel

    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, block_size=16))
    write_run(tmp_path, model, {})
    ckpt = (tmp_path / "ckpt.pt").read_bytes()
    (tmp_path / "afile").write_text("mine\n")
    with pytest.raises(UserError, match=f"^to='{tmp_path / 'afile'}' is a file, not a folder") as e:
        export.main([f"--out_dir={tmp_path}", f"--to={tmp_path / 'afile'}"])
    assert e.value.exit_code == 2
    with pytest.raises(UserError, match=f"^could not write the exported model into {tmp_path / 'afile' / 'hf'} "
                                        f"\\(Not a directory\\); nothing was written: ") as e:
        export.main([f"--out_dir={tmp_path}", f"--to={tmp_path / 'afile' / 'hf'}"])
    assert e.value.exit_code == 2

    def full(self, folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), folder)

    monkeypatch.setattr(GPT2LMHeadModel, "save_pretrained", full)
    with pytest.raises(UserError, match=f"^could not write the exported model into {tmp_path / 'hf'} \\(No space "
                                        f"left on device\\); nothing was written: free disk space") as e:
        export.main([f"--out_dir={tmp_path}", f"--to={tmp_path / 'hf'}"])
    assert e.value.exit_code == 2 and not (tmp_path / "hf").exists()
    with pytest.raises(UserError, match="^out_dir='' names no folder"):
        export.main(["--out_dir=", f"--to={tmp_path / 'hf'}"])
    # the run's own folder (or any run's): --init_from=FOLDER would then read the HF files beside the checkpoint
    with pytest.raises(UserError, match=f"^to='{tmp_path}' is a training run's folder \\(ckpt.pt\\): give the export "
                                        "a folder of its own") as e:
        export.main([f"--out_dir={tmp_path}", f"--to={tmp_path}"])
    assert e.value.exit_code == 2 and sorted(os.listdir(tmp_path)) == ["afile", "ckpt.pt"]
    assert (tmp_path / "afile").read_text() == "mine\n" and (tmp_path / "ckpt.pt").read_bytes() == ckpt


@pytest.mark.parametrize("earlier", ["a GPT-2 BPE export", "files of its names"])
def test_an_export_leaves_no_file_of_an_earlier_one_and_none_of_the_users_is_touched(tmp_path, capsys, request,
                                                                                    earlier):
    """Bug: a char-level export into a folder that held a GPT-2 BPE export left its vocab.json, merges.txt,
    tokenizer.json...: a 65-token model beside a 50,257-token tokenizer, while the export said the folder had no
    tokenizer files. The names an export writes that this one does not are removed (and said); a user's file stays."""
    from transformers import GPT2LMHeadModel

    hf = tmp_path / "hf"
    if earlier == "a GPT-2 BPE export":
        request.getfixturevalue("gpt2_bpe")  # skips where the BPE files are not cached
        torch.manual_seed(0)
        write_run(tmp_path / "bpe", GPT(GPTConfig(vocab_size=50257, n_layer=1, n_head=2, n_embd=16, block_size=16)),
                  {"dataset": "no-such-dataset"})
        export.main([f"--out_dir={tmp_path / 'bpe'}", f"--to={hf}"])
    else:
        hf.mkdir()
        for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (hf / name).write_text("{}")
    old = set(os.listdir(hf)) - {"config.json", "generation_config.json", "model.safetensors"}
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= old
    (hf / "notes.txt").write_text("mine\n")
    meta = make_char_dataset(tmp_path / "chars", n_chars=2000)
    torch.manual_seed(0)
    write_run(tmp_path / "char", GPT(GPTConfig(vocab_size=meta["vocab_size"], n_layer=1, n_head=2, n_embd=16,
                                               block_size=16)), {"data_dir": str(tmp_path / "chars")})
    capsys.readouterr()
    export.main([f"--out_dir={tmp_path / 'char'}", f"--to={hf}"])
    note = capsys.readouterr().err.strip().splitlines()[-1]
    assert not old & set(os.listdir(hf)) and (hf / "notes.txt").read_text() == "mine\n"
    assert all(name in note.split("removed the earlier export's ")[1] for name in old), note
    assert GPT2LMHeadModel.from_pretrained(str(hf)).config.vocab_size == meta["vocab_size"]


def two_runs(tmp_path) -> tuple[str, str]:
    """Two runs' folders: a 2-layer model's checkpoint, and a 3-layer one's (a bigger export)."""
    runs = []
    for n_layer in (2, 3):
        torch.manual_seed(n_layer)
        runs.append(str(tmp_path / f"run{n_layer}"))
        write_run(runs[-1], GPT(GPTConfig(vocab_size=65, n_layer=n_layer, n_head=2, n_embd=32, block_size=32)), {})
    return runs[0], runs[1]


def files_of(folder) -> dict[str, bytes]:
    """Every entry under `folder` (hidden ones too), a file with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<folder>"
            for p in sorted(Path(folder).rglob("*"))}


@pytest.mark.slow
def test_a_failed_write_at_each_step_leaves_the_earlier_export_as_it_was(tmp_path, monkeypatch, capsys):
    """The second export into a folder fails at each of its write operations in turn (tests/faulty_disk.py: a full
    disk, a read-only folder): one line, exit status 2, and the first export's files byte for byte (one it would remove
    too), the user's own file beside them, and no temporary folder left; without a fault it replaces them."""
    small, big = two_runs(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "notes.txt").write_text("mine\n")
    for err in (errno.ENOSPC, errno.EROFS):
        export.main([f"--out_dir={small}", f"--to={hf}"])
        (hf / "merges.txt").write_text("an earlier export's")  # which the second export removes, and puts back
        first = files_of(hf)
        fail_at = 0
        while True:
            with monkeypatch.context() as m:
                disk = FaultyDisk(str(hf), m, fail_at, err)
                code = run_in_process(["export.py", f"--out_dir={big}", f"--to={hf}"], capsys)
            if disk.failed is None:  # every write operation failed once
                break
            assert code.returncode == 2, (disk.failed, code.stderr[-2000:])
            errors = [ln for ln in code.stderr.splitlines() if ln.startswith("error: ")]
            assert errors == [f"error: could not write the exported model into {hf} ({os.strerror(err)}); the files "
                              f"there are as they were: free disk space, or give another --to"], (disk.failed, errors)
            assert "Traceback" not in code.stderr and files_of(hf) == first, disk.failed
            fail_at += 1
        assert fail_at > 8, disk.ops  # the folders, the files written, the renames
    assert code.returncode == 0 and '"n_layer": 3' in (hf / "config.json").read_text()
    assert sorted(files_of(hf)) == sorted(set(first) - {"merges.txt"}) and (hf / "notes.txt").read_text() == "mine\n"


EXPORT_TWICE = """
{python} export.py --out_dir={small} --to={mnt}/hf 2> {tmp}/first.err; echo "exit $?" >> {tmp}/first.err
cp -a {mnt}/hf {tmp}/first
{python} export.py --out_dir={big} --to={mnt}/hf 2> {tmp}/second.err; echo "exit $?" >> {tmp}/second.err
cp -a {mnt}/hf {tmp}/second
mkdir {mnt}/empty
{python} export.py --out_dir={big} --to={mnt}/empty 2> {tmp}/empty.err; echo "exit $?" >> {tmp}/empty.err
{python} export.py --out_dir={big} --to={mnt}/new/hf 2> {tmp}/new.err; echo "exit $?" >> {tmp}/new.err
ls -A {mnt} {mnt}/empty > {tmp}/listing
"""


@pytest.mark.slow
def test_a_full_small_file_system_keeps_the_earlier_export_and_leaves_nothing_partial(tmp_path):
    """Bug: on a real full disk safetensors' writer raises SafetensorError('... No space left on device (os error
    28)'), no OSError: the export ended in a traceback, and the second one into a folder left the new model's
    config.json beside the old model's weights (an empty target: a config.json without weights). On a 200 KB tmpfs
    the first export (~120 KB) fits and the 3-layer one (~170 KB) cannot be written beside it: one line, exit status
    2, the first export byte for byte; into an empty folder and a new one nothing is left."""
    small, big = two_runs(tmp_path)
    script = EXPORT_TWICE.format(python=sys.executable, small=small, big=big, mnt=tmp_path / "mnt", tmp=tmp_path)
    small_file_system(tmp_path, "200k", script)
    first_err = (tmp_path / "first.err").read_text().splitlines()
    assert first_err[-1] == "exit 0" and files_of(tmp_path / "first"), first_err
    assert files_of(tmp_path / "second") == files_of(tmp_path / "first")
    for name, target in [("second", "hf"), ("empty", "empty"), ("new", "new/hf")]:
        lines = (tmp_path / f"{name}.err").read_text().splitlines()
        errors = [ln for ln in lines if ln.startswith("error: ")]
        kept = "nothing was written" if name == "new" else "the files there are as they were"
        assert errors == [f"error: could not write the exported model into {tmp_path / 'mnt' / target} (No space left "
                          f"on device); {kept}: free disk space, or give another --to"], lines[-12:]
        assert lines[-1] == "exit 2" and "Traceback" not in "\n".join(lines), lines[-12:]
    assert (tmp_path / "listing").read_text().split() == [f"{tmp_path / 'mnt'}:", "empty", "hf",
                                                           f"{tmp_path / 'mnt' / 'empty'}:"]


def test_an_earlier_file_that_cannot_be_put_back_is_kept_and_named(tmp_path, monkeypatch):
    """A review's reproduction: the new files' renames failed (EIO) and so did putting the earlier file back: the
    temporary folder, holding the earlier file, was removed, and the line said 'the files there are as they were'.
    Now the earlier file stays in the temporary folder, and the line names where."""
    from nanogpt import files

    to = tmp_path / "to"
    to.mkdir()
    (to / "model.safetensors").write_bytes(b"OLDWEIGHTS")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) >= 2:  # the earlier file moved aside, then every rename fails
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst)

    def write(folder):
        (Path(folder) / "model.safetensors").write_bytes(b"NEWWEIGHTS")

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(UserError) as e:
        files.write_files(str(to), write, "the exported model into")
    monkeypatch.undo()
    (staging,) = [p for p in to.iterdir() if p.name.startswith(".tmp.")]
    assert (staging / "old" / "model.safetensors").read_bytes() == b"OLDWEIGHTS"
    assert f"the earlier model.safetensors could not be put back: kept in {staging / 'old'}" in str(e.value)


def test_a_rename_that_fails_at_any_point_leaves_exactly_the_earlier_files(tmp_path, monkeypatch):
    """write_files over a folder whose earlier set the new one partly replaces (a, c) and adds to (b, d): each of its
    renames fails in turn, and after each the folder holds the earlier names with the earlier bytes, nothing else."""
    from helpers import folder_state
    from nanogpt import files

    to = tmp_path / "to"
    to.mkdir()
    for name in ("a", "c", "other"):
        (to / name).write_bytes(f"old {name}".encode())
    before = folder_state(to)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst)

    def write(folder):
        for name in "abcd":
            (Path(folder) / name).write_bytes(f"new {name}".encode())

    monkeypatch.setattr(files.os, "replace", replace)
    for fail_at in range(1, 7):  # a and c moved aside, then each of a, b, c, d renamed into place
        calls.clear()
        with pytest.raises(UserError, match="the files there are as they were"):
            files.write_files(str(to), write, "the model into")
        assert folder_state(to) == before, fail_at
    calls.clear()
    fail_at = 0
    files.write_files(str(to), write, "the model into")  # no failure: 6 renames, the new set beside "other"
    assert len(calls) == 6 and folder_state(to) == {**before, **{n: f"new {n}".encode() for n in "abcd"}}


def test_the_folder_of_a_killed_export_is_named_and_kept(tmp_path, capsys):
    """A kill during an export's renames leaves its temporary folder (old/: the earlier files it had replaced).
    The next export names it in a warning and leaves it alone: the user's earlier files may be there."""
    from nanogpt import files

    to = tmp_path / "to"
    left = to / ".tmp.abc123"
    (left / "new").mkdir(parents=True)
    (left / "old").mkdir()
    (left / "old" / "config.json").write_text("{}")
    files.write_files(str(to), lambda folder: (Path(folder) / "config.json").write_text('{"n": 1}'), "the model into")
    assert (to / "config.json").read_text() == '{"n": 1}' and (left / "old" / "config.json").read_text() == "{}"
    assert capsys.readouterr().err == (f"warning: {left} was left by a write that was cut short: its old/ holds the "
                                       f"files it had replaced (config.json); move back what you need, then remove "
                                       f"it\n")
