"""
nanogpt/start.py's rules, unit by unit: which settings a resume takes from its run (settings_of_the_run), which
changes it lists and which it refuses (resume_changes), what decide() makes of out_dir as it is (init_from="auto",
a torchrun restart, the run's settings), and check_data()'s refusals before anything is built. The whole start,
end to end, is in test_train.py, test_outdir.py and test_faults.py.
"""
import json
import os
import re
import shutil
from dataclasses import replace

import pytest

from helpers import make_char_dataset, tiny_config
from nanogpt import start
from nanogpt.config import TrainConfig
from nanogpt.errors import UserError


# ----------------------------------------------------------------------------------------------- settings_of_the_run


def test_a_resume_takes_every_setting_not_given_and_only_those():
    cfg = TrainConfig(out_dir="here", learning_rate=1e-3)
    saved = {"learning_rate": 5e-4, "n_layer": 7, "batch_size": 3, "weight_decay": 0.0}
    resumed, taken = start.settings_of_the_run(cfg, given={"learning_rate"}, saved=saved)
    assert (resumed.learning_rate, resumed.n_layer, resumed.batch_size, resumed.weight_decay) == (1e-3, 7, 3, 0.0)
    assert sorted(taken) == ["batch_size=3", "n_layer=7", "weight_decay=0.0"]


def test_a_resume_never_takes_where_it_runs_or_what_says_to_resume():
    cfg = TrainConfig(out_dir="here", init_from="resume")
    saved = {"out_dir": "elsewhere", "init_from": "scratch", "device": "cuda", "backend": "gloo", "eval_only": True}
    resumed, taken = start.settings_of_the_run(cfg, given=set(), saved=saved)
    assert taken == [] and resumed == cfg


def test_a_recorded_setting_of_the_wrong_type_or_range_is_refused_with_its_name():
    cfg = TrainConfig(out_dir="here")
    with pytest.raises(UserError, match=r"not a run's: batch_size='many' \(not int\)"):
        start.settings_of_the_run(cfg, given=set(), saved={"batch_size": "many"})
    with pytest.raises(UserError, match=r"not a run's: dropout=1.5"):
        start.settings_of_the_run(cfg, given=set(), saved={"dropout": 1.5})
    resumed, _ = start.settings_of_the_run(cfg, given={"dropout"}, saved={"dropout": 1.5})  # given: not read
    assert resumed.dropout == cfg.dropout


def test_a_recorded_dtype_this_machine_cannot_run_becomes_auto_and_says_so():
    cfg = TrainConfig(out_dir="here", device="cpu")
    resumed, taken = start.settings_of_the_run(cfg, given=set(), saved={"dtype": "float16", "batch_size": 3})
    assert resumed.dtype == "auto" and resumed.batch_size == 3
    assert taken[0] == "batch_size=3" and taken[1].startswith("dtype: the run's 'float16' cannot run here, so 'auto'")


# ----------------------------------------------------------------------------------------------- resume_changes


def test_resume_changes_lists_what_applies_from_here_on():
    cfg = TrainConfig(out_dir="here", learning_rate=1e-3, dtype="auto", device="cpu")
    saved = {"learning_rate": 6e-4, "dtype": "bfloat16", "device": "cuda", "out_dir": "there"}
    changes = start.resume_changes(saved, "tanh", replace(cfg, gelu=None), world_size=2, saved_world_size=1)
    assert changes == ["learning_rate: 0.0006 -> 0.001", "world_size: 1 -> 2"]  # "auto" is resolved anew: unlisted


@pytest.mark.parametrize("saved, gelu, message", [
    ({"n_embd": 32}, "tanh", r"model differs \(n_embd: 32 -> 768\)"),
    ({}, "erf", r"model differs \(gelu: 'erf' -> 'tanh'\)"),
    ({"optimizer": "muon"}, "tanh", r"written by optimizer='muon', not 'adamw': use --optimizer=muon"),
])
def test_resume_changes_refuses_another_model_or_optimizer(saved, gelu, message):
    cfg = TrainConfig(out_dir="here", gelu="tanh")
    with pytest.raises(UserError, match=message):
        start.resume_changes(saved, gelu, cfg, world_size=1, saved_world_size=1)


def test_a_checkpoint_without_optimizer_key_is_adamws():  # nanoGPT's, and ours from before the key
    assert start.resume_changes({}, "tanh", TrainConfig(out_dir="here", optimizer="adamw", gelu=None), 1, 1) == []
    with pytest.raises(UserError, match="written by optimizer='adamw'"):
        start.resume_changes({}, "tanh", TrainConfig(out_dir="here", optimizer="muon", gelu=None), 1, 1)


# ----------------------------------------------------------------------------------------------- decide


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run of 2 steps in out_dir, with its checkpoint."""
    from train import train
    base = tmp_path_factory.mktemp("start")
    data_dir, out = base / "data", base / "out"
    make_char_dataset(data_dir)
    train(tiny_config(data_dir, out, max_iters=2, eval_interval=2, batch_size=3))
    return data_dir, out


def test_decide_auto_starts_from_scratch_in_an_empty_folder(tmp_path, finished_run):
    data_dir, _ = finished_run
    plan = start.decide(tiny_config(data_dir, tmp_path / "new", init_from="auto"), given=set())
    assert plan.cfg.init_from == "scratch" and plan.found is None
    assert plan.notes == [f"init_from='auto': no checkpoint in {tmp_path / 'new'}, starting from scratch"]


def test_decide_auto_resumes_a_run_with_its_settings(finished_run):
    data_dir, out = finished_run
    cfg = tiny_config(data_dir, out, init_from="auto", max_iters=4)
    plan = start.decide(cfg, given={"max_iters"})
    assert plan.cfg.init_from == "resume" and plan.found.path == os.path.join(str(out), "ckpt.pt")
    assert plan.cfg.batch_size == 3 and plan.cfg.max_iters == 4  # the run's, and the one given
    assert plan.notes[0].startswith("init_from='auto': ") and "batch_size=3" in plan.notes[1]
    assert start.decide(cfg, given=None).cfg.batch_size == cfg.batch_size  # None: every key given, none taken


def test_decide_resumes_a_torchrun_restart_of_the_same_job_only(finished_run, tmp_path, monkeypatch):
    data_dir, out = finished_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    run = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps({**run, "torchrun_job": "job-a"}))
    cfg = tiny_config(data_dir, copy, init_from="scratch")
    assert start.decide(cfg, given=set()).cfg.init_from == "scratch"  # a first start: init_from as given
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(start, "torchrun_job", lambda: "job-b")
    assert start.decide(cfg, given=set()).cfg.init_from == "scratch"  # another job's run: not this job's to resume
    monkeypatch.setattr(start, "torchrun_job", lambda: "job-a")
    plan = start.decide(cfg, given=set())
    assert plan.cfg.init_from == "resume" and plan.notes[0].startswith(f"torchrun restart 1 of the run in {copy}")
    assert plan.job == "job-a"


def test_a_resume_is_checked_with_its_runs_settings_not_the_defaults(finished_run, tmp_path, monkeypatch):
    """Bug: `--init_from=resume --out_dir=DIR` checked the settings before taking the run's, so the defaults refused
    what the run's own settings allow: async_save=True on an FSDP run ("parallelism='ddp' saves one file"),
    hellaswag_interval=4 on a run with eval_interval=2 ("a multiple of eval_interval=2000"), and 3 ranks for a run
    of gradient_accumulation_steps=6 ("40 is not divisible by the 3 DDP processes")."""
    import torch

    _, out = finished_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    ckpt = torch.load(copy / "ckpt.pt", weights_only=True)
    ckpt["config"].update(gradient_accumulation_steps=6, parallelism="fsdp")
    torch.save(ckpt, copy / "ckpt.pt")
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = TrainConfig(out_dir=str(copy), init_from="resume", async_save=True, hellaswag_interval=4)
    with start.begin(cfg, given={"out_dir", "init_from", "async_save", "hellaswag_interval"}) as plan:
        c = plan.cfg
        assert (c.parallelism, c.gradient_accumulation_steps, c.eval_interval) == ("fsdp", 6, 2)  # the run's
        assert c.async_save and c.hellaswag_interval == 4  # given
    with pytest.raises(UserError, match=r"hellaswag_interval=3 must be 0 or a multiple of eval_interval=2"):
        start.begin(TrainConfig(out_dir=str(copy), init_from="resume", hellaswag_interval=3),
                    given={"out_dir", "init_from", "hellaswag_interval"}).__enter__()


def test_decide_refuses_a_resume_with_nothing_to_resume(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no checkpoint"):
        start.decide(TrainConfig(out_dir=str(empty), init_from="resume"), given=set())


# ----------------------------------------------------------------------------------------------- check_data


def test_check_data_refuses_a_window_longer_than_the_split(finished_run):
    data_dir, out = finished_run
    cfg = tiny_config(data_dir, out, block_size=10_000_000)
    with pytest.raises(UserError, match="block_size|window|tokens"):
        start.check_data(cfg)
    data, meta, vocab = start.check_data(tiny_config(data_dir, out))
    assert data == str(data_dir) and vocab == meta["vocab_size"]


def test_a_setting_of_the_run_this_machine_cannot_run_is_named_as_the_runs():
    """A run of a GPU resumed on a CPU: its flash_impl='fa4' and compile_mode='reduce-overhead' are named as taken
    from its checkpoint, with what to give instead (they were refused as if the user had given them)."""
    cfg = TrainConfig(out_dir="here", device="cpu")
    with pytest.raises(UserError, match=r"^the run's own settings \(from its checkpoint: not given here\) cannot run "
                                        r"here: compile_mode='reduce-overhead' records CUDA graphs.*flash_impl='fa4'"):
        start.settings_of_the_run(cfg, given=set(), saved={"compile_mode": "reduce-overhead", "flash_impl": "fa4"})
    resumed, _ = start.settings_of_the_run(cfg, given={"compile_mode", "flash_impl"},
                                           saved={"compile_mode": "reduce-overhead", "flash_impl": "fa4"})
    assert (resumed.compile_mode, resumed.flash_impl) == ("default", "default")  # given: the user's, not the run's


def test_a_given_setting_that_the_runs_own_settings_rule_out_is_refused():
    """Bug: `--init_from=resume --keep_last=2` on an FSDP run (parallelism='fsdp' taken from its checkpoint) trained on
    and silently kept no saves: only problems naming a taken key were checked once the run's settings were taken."""
    cfg = TrainConfig(out_dir="here", device="cpu", keep_last=2)
    with pytest.raises(UserError, match=r"keep_last=2 is not supported with sharded checkpoints"):
        start.settings_of_the_run(cfg, given={"keep_last"}, saved={"parallelism": "fsdp"})


def test_a_resume_on_n_ranks_checks_the_runs_gradient_accumulation_not_the_default(finished_run, tmp_path,
                                                                                    monkeypatch):
    """Bug: `torchrun --nproc_per_node=3 train.py --init_from=resume --out_dir=DIR` of a run with
    gradient_accumulation_steps=3 was refused: 'gradient_accumulation_steps=40 is not divisible by the 3 DDP
    processes', the default that the resume replaces with its run's, checked before it was taken."""
    import torch

    data_dir, out = finished_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    ckpt = torch.load(copy / "ckpt.pt", weights_only=False)
    ckpt["config"]["gradient_accumulation_steps"] = 3  # a run of 3 ranks
    torch.save(ckpt, copy / "ckpt.pt")
    monkeypatch.setenv("WORLD_SIZE", "3")
    for init_from in ("resume", "auto"):
        with start.begin(TrainConfig(out_dir=str(copy), init_from=init_from), given={"init_from", "out_dir"}) as plan:
            assert plan.cfg.gradient_accumulation_steps == 3
    given = TrainConfig(out_dir=str(copy), init_from="resume", gradient_accumulation_steps=4)
    with pytest.raises(UserError, match="gradient_accumulation_steps=4 is not divisible by the 3 DDP processes"):
        with start.begin(given, given={"init_from", "out_dir", "gradient_accumulation_steps"}):
            pass
    with pytest.raises(UserError, match="gradient_accumulation_steps=40 is not divisible by the 3 DDP processes"):
        with start.begin(TrainConfig(out_dir=str(tmp_path / "new"), init_from="auto"), given={"init_from"}):
            pass  # auto with no checkpoint: a new run of the settings given


def test_init_from_a_folder_without_weights_says_what_it_lacks(finished_run, tmp_path):
    """Bug: a folder holding only ckpt_best.pt (or nothing) as init_from said its weights 'were trained with another
    tokenizer (gpt2, 50257 tokens)'. Now the line says what the folder lacks, and names a checkpoint file it holds."""
    from nanogpt import checkpoints

    data_dir, out = finished_run
    (tmp_path / "best").mkdir()
    shutil.copy(out / "ckpt.pt", tmp_path / "best" / "ckpt_best.pt")
    with pytest.raises(UserError, match=r"is a folder without a run's checkpoint \(ckpt.pt, ckpt_sharded\) or a HF "
                                        rf"GPT-2 model \(config.json\): give one of its checkpoint files, e\.g\. "
                                        rf"--init_from={re.escape(str(tmp_path / 'best' / 'ckpt_best.pt'))}$"):
        checkpoints.weights_tokenizer(str(tmp_path / "best"))
    with pytest.raises(UserError, match=r"a HF GPT-2 model \(config.json\)$"):
        checkpoints.weights_tokenizer(str(tmp_path))  # nothing of a checkpoint in it at all
    vocab, meta = checkpoints.weights_tokenizer(str(tmp_path / "best" / "ckpt_best.pt"))  # the file: read
    assert meta is not None and vocab == meta["vocab_size"]


def test_a_resume_in_a_file_says_it_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("mine\n")
    with pytest.raises(UserError, match="it is a file, not a folder; give the run's folder"):
        start.check_out_dir(TrainConfig(out_dir=str(tmp_path / "afile"), init_from="resume"))
    with pytest.raises(UserError, match="the folder does not exist"):
        start.check_out_dir(TrainConfig(out_dir=str(tmp_path / "nowhere"), init_from="resume"))


@pytest.mark.slow
def test_a_model_past_the_machines_memory_is_one_line_before_anything_changes(data_dir, tmp_path, capsys):
    """Bug: n_embd=4194304 (within its declared range) ended in the allocator's RuntimeError traceback when the model
    was built. Now one line that names the model and the size asked for, exit 2, and no out_dir made."""
    from helpers import config_args, run_in_process, tiny_config

    out = tmp_path / "out"
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, out, n_head=1, n_embd=4194304))], capsys)
    assert r.returncode == 2 and re.fullmatch(
        r"error: the model \(n_layer=2, n_embd=4194304\) does not fit in this machine's memory \(a tensor of [\d.]+ "
        r"[KMGT]iB could not be allocated\): give a smaller n_layer or n_embd", r.stderr.strip()), r.stderr
    assert not out.exists()
