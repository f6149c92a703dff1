"""sample.py: seeded samples from a char checkpoint and from a local HF GPT-2 folder, greedy parity with HF's
generate, the tokens/s line, and one-line errors for bad input."""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import TYPE_CHECKING

import pytest
import torch

from nanogpt import engine, tokenizers
from nanogpt.errors import UserError
from nanogpt.checkpoint_file import load_checkpoint, save_checkpoint
from helpers import make_char_dataset, run_in_process, run_script, tiny_config
from sample import SEPARATOR, SampleConfig, check_config, load_model, sample
from train import train

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

CPU = ["--device=cpu", "--dtype=float32"]
TOKENS_PER_S = re.compile(r"^tokens/s: (\d+(?:\.\d+)?) \(", re.M)


@pytest.fixture(scope="module")
def char_run(tmp_path_factory) -> tuple[str, dict]:
    """A tiny char-level run trained in this process: (out_dir, the dataset's meta). Trained once for the module
    (the tests only read it); each test writes in its own tmp_path."""
    root = tmp_path_factory.mktemp("char_run")
    data_dir, out_dir = root / "tinychar", root / "out"
    meta = make_char_dataset(data_dir)
    train(tiny_config(data_dir, out_dir, max_iters=20, eval_interval=20))
    return str(out_dir), meta




def run_sample(*args: str, env: dict | None = None):
    return run_script(["sample.py", *args], timeout=180, env=env)


def samples_of(stdout: str) -> list[str]:
    """The samples printed by sample.py: each is followed by a newline and a line of dashes."""
    chunks = stdout.split(SEPARATOR + "\n")
    assert chunks[-1] == "", stdout[-200:]
    assert all(c.endswith("\n") for c in chunks[:-1])
    return [c[:-1] for c in chunks[:-1]]


def tokens_per_s(stderr: str) -> float:
    found = TOKENS_PER_S.findall(stderr)
    assert len(found) == 1 and stderr.strip().splitlines()[-1].startswith("tokens/s: "), stderr[-500:]
    return float(found[0])


def one_line_error(result) -> str:
    """The error line of a failed run, after checking it failed the way every user error should."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stdout == ""
    return result.stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------- a char-level checkpoint


@pytest.mark.slow
def test_char_checkpoint_same_seed_same_text_and_right_shape(char_run):
    out_dir, meta = char_run
    args = [f"--out_dir={out_dir}", "--start=The ", "--num_samples=3", "--max_new_tokens=40", *CPU]
    first = run_sample(*args, "--seed=7")
    again = run_sample(*args, "--seed=7")
    other = run_sample(*args, "--seed=8")
    for r in (first, again, other):
        assert r.returncode == 0, r.stderr[-2000:]
    assert first.stdout == again.stdout
    assert first.stdout != other.stdout

    texts = samples_of(first.stdout)
    assert len(texts) == 3 and len(samples_of(other.stdout)) == 3
    # 40 new tokens > block_size 32: the context window slides and the cache is re-filled
    assert all(t.startswith("The ") and len(t) == len("The ") + 40 for t in texts), texts
    assert set("".join(texts)) <= set(meta["itos"])
    assert len(set(texts)) == 3  # one generator for all samples: each continues the random stream
    assert f"tokenizer: char ({meta['vocab_size']} tokens" in first.stderr
    assert tokens_per_s(first.stderr) > 0 and tokens_per_s(other.stderr) > 0

    # in-process, the functions give the same text as the script: seeding does not depend on the process
    cfg = SampleConfig(out_dir=out_dir, start="The ", num_samples=3, max_new_tokens=40, seed=7, device="cpu",
                       dtype="float32")
    model, tokenizer = load_model(cfg)
    result = sample(model, tokenizer, cfg.start, cfg)
    assert result.texts == texts
    assert result.new_tokens == 120 and result.tokens_per_s > 0
    assert [len(ids) for ids in result.ids] == [44, 44, 44]


@pytest.mark.slow
def test_prompt_from_file(char_run, tmp_path):
    out_dir, _ = char_run
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The king\nspeaks ", encoding="utf-8")
    r = run_sample(f"--out_dir={out_dir}", f"--start=FILE:{prompt}", "--num_samples=2", "--max_new_tokens=10", *CPU)
    assert r.returncode == 0, r.stderr[-2000:]
    texts = samples_of(r.stdout)
    assert len(texts) == 2
    assert all(t.startswith("The king\nspeaks ") and len(t) == 16 + 10 for t in texts), texts


def test_the_speed_line_counts_in_words_one_sample_and_one_token_too(char_run, capsys):
    out_dir, _ = char_run
    for n, counts in ((1, "1 new token in {} s, 1 sample, cpu, float32)"),
                      (2, "4 new tokens in {} s, 2 samples, cpu, float32)")):
        r = run_in_process(["sample.py", f"--out_dir={out_dir}", "--start=The ", f"--num_samples={n}",
                            f"--max_new_tokens={n}", *CPU], capsys)
        assert r.returncode == 0, r.stderr[-2000:]
        line = r.stderr.strip().splitlines()[-1]
        assert re.fullmatch(r"tokens/s: [\d.]+ \(" + re.escape(counts).replace(r"\{\}", r"[\d.]+"), line), line


# ----------------------------------------------------------------------------------- a local HF GPT-2 folder


def save_tiny_hf_gpt2(path) -> GPT2LMHeadModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257))
    with torch.no_grad():  # non-zero biases and LayerNorm shifts, so a mis-copied one changes the tokens
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf.eval()


@pytest.mark.slow
def test_hf_folder_greedy_tokens_match_hf_generate_and_seeded_text_repeats(tmp_path, gpt2_bpe):
    folder = tmp_path / "tiny-gpt2"
    hf = save_tiny_hf_gpt2(folder)
    prompt = "The answer to life, the universe and everything is"
    ids = gpt2_bpe.encode(prompt)

    greedy = SampleConfig(init_from=str(folder), num_samples=1, max_new_tokens=24, temperature=0.0, device="cpu",
                          dtype="float32")
    model, tokenizer = load_model(greedy)
    ours = sample(model, tokenizer, prompt, greedy).ids[0]
    x = torch.tensor([ids])
    theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                         pad_token_id=gpt2_bpe.eot)[0].tolist()
    assert ours[: len(ids)] == ids
    assert ours == theirs, (ours[len(ids):], theirs[len(ids):])
    assert len(set(ours[len(ids):])) > 1  # not a degenerate single repeated token

    args = [f"--init_from={folder}", f"--start={prompt}", "--num_samples=2", "--max_new_tokens=16",
            "--temperature=1.0", "--top_k=50", "--seed=3", *CPU]
    r = run_sample(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"tokenizer: GPT-2 BPE (init_from={folder})" in r.stderr
    assert tokens_per_s(r.stderr) > 0
    texts = samples_of(r.stdout)
    seeded = SampleConfig(init_from=str(folder), num_samples=2, max_new_tokens=16, temperature=1.0, top_k=50, seed=3,
                          device="cpu", dtype="float32")
    assert sample(model, tokenizer, prompt, seeded).texts == texts  # same seed, same text, in another process
    assert all(t.startswith(prompt) for t in texts) and texts[0] != texts[1]


def test_a_char_level_export_samples_with_the_runs_characters(char_run, tmp_path, capsys):
    """Bug: sample.py and hellaswag.py took every HF folder for GPT-2 BPE and refused a char-level export, with a fix
    naming a setting sample.py does not have. The export holds the run's meta.json, which they read; a folder whose
    tokenizer is unknown (an export from before) is one line naming it and a fix sample.py has."""
    import export
    from transformers import GPT2LMHeadModel

    out_dir, meta = char_run
    hf = tmp_path / "hf"
    export.main([f"--out_dir={out_dir}", f"--to={hf}"])
    args = ["sample.py", f"--init_from={hf}", "--max_new_tokens=20", "--num_samples=1", *CPU]
    r = run_in_process(args, capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    (text,) = samples_of(r.stdout)
    assert len(text) == 21 and set(text) <= set(meta["itos"])  # the prompt "\n", then 20 of the run's characters
    assert GPT2LMHeadModel.from_pretrained(str(hf)).config.vocab_size == meta["vocab_size"]
    (hf / "meta.json").unlink()  # as an export from before left it
    r = run_in_process(args, capsys)
    (line,) = r.stderr.strip().splitlines()
    options = set(re.findall(r"--(\w+)=", line))  # the fix: settings that sample.py has
    assert r.returncode == 2 and line.startswith(f"error: init_from={str(hf)!r} ") and options, line
    assert options <= {f.name for f in dataclasses.fields(SampleConfig)}, line


# ----------------------------------------------------------------------------------- one-line errors


def test_a_char_checkpoint_samples_with_the_tokenizer_it_records_after_its_data_moved(char_run, tmp_path):
    out_dir, meta = char_run
    ckpt = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    ckpt["config"]["data_dir"] = str(tmp_path / "moved-away")  # no meta.json there any more
    save_checkpoint(str(tmp_path / "out" / "ckpt.pt"), ckpt)
    _, tokenizer = load_model(SampleConfig(out_dir=str(tmp_path / "out"), device="cpu", dtype="float32"))
    text = "".join(meta["itos"][1:4])
    assert tokenizer.vocab_size == meta["vocab_size"] and tokenizer.decode(tokenizer.encode(text)) == text


def test_a_checkpoint_recording_no_tokenizer_whose_data_moved_is_refused(char_run, tmp_path, gpt2_bpe):
    out_dir, meta = char_run
    ckpt = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    ckpt["config"]["data_dir"] = str(tmp_path / "moved-away")  # no meta.json there: GPT-2 BPE is the fallback
    del ckpt["meta"]  # as in checkpoints written before the tokenizer was recorded
    path = tmp_path / "out" / "ckpt.pt"
    save_checkpoint(str(path), ckpt)
    with pytest.raises(UserError) as e:
        load_model(SampleConfig(out_dir=str(tmp_path / "out"), device="cpu", dtype="float32"))
    assert str(e.value) == (
        f"the tokenizer of {path} (50257 tokens, logged above) does not fit the model's vocab_size "
        f"{meta['vocab_size']}: the model was trained on other data: put that data's meta.json in the folder its "
        f"run config names"
    )


@pytest.mark.slow
def test_unknown_init_from():
    assert one_line_error(run_sample("--init_from=gpt5", *CPU)) == (
        "error: init_from='gpt5' is not one of resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl, a folder with a HF "
        "GPT-2 model, or a checkpoint file or sharded folder"
    )


@pytest.mark.slow
def test_missing_checkpoint(tmp_path):
    out_dir = tmp_path / "never-trained"
    out_dir.mkdir()
    assert one_line_error(run_sample(f"--out_dir={out_dir}", *CPU)) == (
        f"error: no checkpoint in {out_dir} (neither ckpt.pt nor ckpt_sharded; {out_dir} is empty): train first, "
        f"or set --out_dir to the run's folder"
    )


@pytest.mark.slow
def test_characters_outside_the_vocabulary_are_named(char_run):
    out_dir, meta = char_run
    assert one_line_error(run_sample(f"--out_dir={out_dir}", "--start=Zé king@", *CPU)) == (
        f"error: character(s) '@', 'Z', 'é' not in the vocabulary: a char-level model knows only its dataset's "
        f"{meta['vocab_size']} characters; remove them from the text"
    )


@pytest.mark.slow
def test_missing_prompt_file(tmp_path):
    path = tmp_path / "no-such-prompt.txt"
    assert one_line_error(run_sample(f"--start=FILE:{path}", *CPU)) == (
        f"error: start='FILE:{path}': no prompt file '{path}'"
    )


@pytest.mark.slow
def test_gpt2_name_offline_without_cache(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    line = one_line_error(run_sample("--init_from=gpt2-xl", *CPU, env=env))
    assert line == (f"error: could not load GPT-2 weights 'gpt2-xl' (they are not in the HF cache "
                    f"{tmp_path / 'hf-home' / 'hub'}, and HF_HUB_OFFLINE is set): download them once online, or pass "
                    f"a local folder written by save_pretrained")


def test_bad_numbers_are_listed_in_one_error():
    cfg = SampleConfig(num_samples=0, max_new_tokens=-1, temperature=-1.0, top_k=0, top_p=1.5, device="cpu")
    with pytest.raises(UserError) as e:
        check_config(cfg)
    assert str(e.value) == (
        "num_samples=0 must be at least 1; max_new_tokens=-1 must be at least 1; "
        "temperature=-1.0 must be at least 0 (0 means greedy); top_k=0 must be at least 1 (or None); "
        "top_p=1.5 must be in (0, 1] (or None)"
    )


def test_a_missing_ckpt_best_says_when_it_exists(tmp_path):
    with pytest.raises(UserError, match=r"ckpt_best.pt exists only after a run with always_save_checkpoint=False "
                       r"was stopped between evals; otherwise ckpt.pt holds the best weights: drop --ckpt"):
        load_model(SampleConfig(out_dir=str(tmp_path), ckpt="ckpt_best.pt", device="cpu"))


def test_an_unpadded_keep_last_name_names_the_file_that_exists(tmp_path):
    """Bug: README and --help named keep_last's files ckpt_<iter>.pt, but they are ckpt_0000300.pt: --ckpt=ckpt_300.pt
    said only 'no checkpoint'."""
    (tmp_path / "ckpt_0000300.pt").write_bytes(b"a run's")
    with pytest.raises(UserError, match=r"no checkpoint .*ckpt_300.pt .*: .*give --ckpt=ckpt_0000300.pt$"):
        load_model(SampleConfig(out_dir=str(tmp_path), ckpt="ckpt_300.pt", device="cpu"))


def test_checkpoint_loads_on_the_cpu_and_only_the_weights_move(char_run, monkeypatch):
    """Bug: the whole checkpoint (optimizer state: twice the weights) was loaded onto the sampling device. The
    meta device stands in for an accelerator: a tensor put there keeps no data, so a checkpoint loaded there could
    not fill the model, while a model moved there after loading is fine. (tests/cuda/test_cuda_sample.py measures the memory.)"""
    out_dir, _ = char_run
    placed = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: placed.append(kw.get("map_location")) or real_load(*a, **kw))
    model, _ = load_model(SampleConfig(out_dir=out_dir, device="meta", dtype="float32"))  # as check_config resolved
    assert placed == ["cpu"]
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_the_device_is_resolved_once(char_run, monkeypatch, capsys):
    import sample as sample_module

    out_dir, meta = char_run
    calls = []
    real = sample_module.resolve_device
    monkeypatch.setattr(sample_module, "resolve_device", lambda device: calls.append(device) or real(device))
    sample_module.main([f"--out_dir={out_dir}", "--num_samples=1", "--max_new_tokens=5", "--device=auto"])
    assert calls == ["auto"]  # once, in check_config; everything after takes the resolved device
    err = capsys.readouterr().err
    assert f"tokenizer: char ({meta['vocab_size']} tokens" in err and ", cpu, float32" in err  # the resolved ones


@pytest.mark.parametrize("native, dtype, window, expected", [
    (True, "auto", None, "bfloat16"),  # the window's matrix work in bf16 where the CPU multiplies it in hardware
    (False, "auto", None, None),  # emulated bf16 is slower than float32: the window stays float32
    (True, "float32", None, None),  # an explicit dtype is the window's too
    (True, "auto", "float32", "float32"),  # and an explicit window_dtype wins
])
def test_dtype_auto_chooses_the_window_dtype_by_the_cpu(monkeypatch, native, dtype, window, expected):
    import sample as sample_module

    monkeypatch.setattr(sample_module, "cpu_has_native_bf16", lambda: native)
    cfg = sample_module.check_config(SampleConfig(device="cpu", dtype=dtype, window_dtype=window))
    assert (cfg.dtype, cfg.window_dtype) == ("float32", expected)



@pytest.mark.parametrize("native, dtype, attention, sdpa_backend, expected", [
    (True, "auto", "auto", None, "math"),  # the window in bf16 on a CPU: math attention's plain bf16 matmuls
    (False, "auto", "auto", None, "sdpa"),  # float32 throughout: SDPA's kernel
    (False, "bfloat16", "auto", None, "math"),  # bf16 autocast throughout
    (True, "auto", "auto", "auto", "sdpa"),  # an sdpa_backend asked for is SDPA's
    (True, "auto", "sdpa", None, "sdpa"),  # an explicit choice is kept
    (False, "auto", "math", None, "math"),
])
def test_attention_auto_follows_the_dtype_of_the_heavy_work(char_run, monkeypatch, native, dtype, attention,
                                                             sdpa_backend, expected):
    import sample as sample_module

    monkeypatch.setattr(sample_module, "cpu_has_native_bf16", lambda: native)
    cfg = sample_module.check_config(SampleConfig(out_dir=char_run[0], device="cpu", dtype=dtype,
                                                  attention=attention, sdpa_backend=sdpa_backend))
    model, _ = sample_module.load_model(cfg)
    assert model.config.attention == expected and {b.attn.attention for b in model.transformer.h} == {expected}


def test_attention_auto_takes_sdpa_for_a_block_longer_than_math_wins_at(char_run, monkeypatch):
    """Math attention wins on a CPU under bf16 for windows up to 256 positions; past that SDPA's kernel does (and
    far more on a long float32 prefill), so auto looks at the model's block_size, known once it is read."""
    from nanogpt import device
    import sample as sample_module

    monkeypatch.setattr(sample_module, "cpu_has_native_bf16", lambda: True)
    cfg = sample_module.check_config(SampleConfig(out_dir=char_run[0], device="cpu"))
    model = sample_module.load_model(cfg)[0]
    assert model.config.attention == "math" and model.config.block_size <= device.MATH_SAMPLING_MAX_BLOCK
    monkeypatch.setattr(device, "MATH_SAMPLING_MAX_BLOCK", model.config.block_size - 1)
    assert sample_module.load_model(cfg)[0].config.attention == "sdpa"


@pytest.mark.slow
def test_math_attention_with_an_sdpa_backend_is_one_line(tmp_path):
    assert one_line_error(run_sample(f"--out_dir={tmp_path}", "--attention=math", "--sdpa_backend=flash", *CPU)) == (
        "error: sdpa_backend='flash' chooses a kernel of attention=sdpa, not of math: use --attention=sdpa (or auto), "
        "or drop sdpa_backend"
    )


@pytest.mark.slow
def test_an_unknown_attention_is_one_line_before_any_weight_is_read(tmp_path):
    # the out_dir is empty: a check after reading weights would report the missing checkpoint instead
    assert one_line_error(run_sample(f"--out_dir={tmp_path}", "--attention=flash", *CPU)) == (
        "error: attention='flash' is not one of auto, math, sdpa"
    )

def test_batch_size_bounds_the_rows_per_batch_and_greedy_rows_equal_single_draws(char_run, monkeypatch):
    """--num_samples=5 --batch_size=2: batches of 2, 2 and 1 rows (the memory of 2 samples at a time); greedy, each
    row is the sample drawn alone (batch_size=1) and the 5 drawn as one batch, past block_size too."""
    out_dir, _ = char_run
    cfg = check_config(SampleConfig(out_dir=out_dir, num_samples=5, max_new_tokens=40, temperature=0.0,
                                    device="cpu", dtype="float32", start="The king"))
    model, tokenizer = load_model(cfg)
    rows = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda m, x, *a, **kw: rows.append(x.size(0)) or generate(m, x, *a, **kw))
    texts = {b: sample(model, tokenizer, "The king", dataclasses.replace(cfg, batch_size=b)).texts
             for b in (2, 1, None)}
    assert rows == [2, 2, 1] + [1] * 5 + [5]
    assert texts[2] == texts[1] == texts[None] and len(texts[None]) == 5


def test_batch_size_does_not_change_the_samples_each_has_its_own_stream(char_run, capsys):
    """Bug: one generator was shared across the batches, so --batch_size (a memory limit) changed the draws. The
    same seed gives the same samples whatever --batch_size (in float32), past block_size too; the
    samples differ from each other, and another seed gives others."""
    out_dir, _ = char_run
    command = ["sample.py", f"--out_dir={out_dir}", "--num_samples=5", "--max_new_tokens=40", "--start=The king", *CPU]
    runs = {}
    for batch_size in ("1", "2", "None"):
        r = run_in_process([*command, f"--batch_size={batch_size}"], capsys)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[batch_size] = samples_of(r.stdout)
    assert runs["1"] == runs["2"] == runs["None"] and len(set(runs["None"])) == 5
    other = samples_of(run_in_process([*command, "--seed=7"], capsys).stdout)
    assert not set(other) & set(runs["None"])


def test_sampled_rows_of_a_batch_follow_the_models_distribution_each_on_its_own_stream():
    """Each row of a batch draws from softmax(logits / temperature) as a sample drawn alone would: over 20,000 rows
    of one prompt, the first new token's frequencies are the float64 model's probabilities (total variation < 0.02;
    the sampling noise is ~0.005), and the rows are independent (two rows agree as often as independent draws would);
    the second token, past block_size (the window phase), too, given the first."""
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=6, n_layer=1, n_head=1, n_embd=8)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # a distribution far from uniform
    prompt = torch.tensor([[1, 2, 3, 4, 5, 0, 1, 2]])  # a full block: the second new token slides the window
    n = 20_000
    out = engine.generate(model, prompt.repeat(n, 1), 2, temperature=0.9, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = torch.softmax(model.double()(prompt)[0][0, -1] / 0.9, dim=-1)
    seen = torch.bincount(out[:, 8], minlength=6).double() / n
    assert 0.5 * (seen - expected).abs().sum() < 0.02, (seen, expected)
    agree = (out[: n // 2, 8] == out[n // 2 :, 8]).double().mean()
    assert abs(agree - (expected**2).sum()) < 0.02
    first = int(seen.argmax())  # the rows that drew the most likely first token: their second token
    second = out[out[:, 8] == first, 9]
    with torch.no_grad():
        window = torch.cat([prompt[:, 1:], torch.tensor([[first]])], dim=1)  # the last block_size tokens
        expected = torch.softmax(model(window)[0][0, -1] / 0.9, dim=-1)
    seen = torch.bincount(second, minlength=6).double() / second.numel()
    assert 0.5 * (seen - expected).abs().sum() < 0.03, (seen, expected)


def test_ids_past_the_tokenizers_vocabulary_are_never_sampled():
    """A model with more rows (80) than its tokenizer has tokens (65), as nanoGPT's GPT-2 runs have 50304 for 50257,
    whose weights make the extra ids by far the most likely: sample() draws none of them, greedy or sampled, with
    top_k and top_p, in the cache and past block_size (8)."""
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=8, vocab_size=80, n_layer=1, n_head=1, n_embd=8, bias=True))
    with torch.no_grad():  # the final features are all ones at every position: a token's logit is its row's sum
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[:65] = 0.0  # the tokenizer's ids: logit 0
        model.lm_head.weight[65:] = 4.0  # the rows past it: logit 32
    tokenizer = tokenizers.get_tokenizer({"vocab_size": 65, "tokenizer": "char",
                                      "itos": [chr(c) for c in range(32, 96)] + ["\n"]})
    for temperature, top_k, top_p in [(0.0, None, None), (1.0, None, None), (1.0, 5, None), (1.0, None, 0.9),
                                      (2.0, 200, 0.99)]:
        cfg = SampleConfig(num_samples=4, max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p,
                           device="cpu", dtype="float32")
        ids = sample(model, tokenizer, "AB", cfg).ids
        assert max(max(row) for row in ids) < 65, (temperature, top_k, top_p, ids)


# Samples past block_size from a 2 x 128 model, counting the page faults of the generation alone; argv: out_dir,
# keep_freed_memory (or "default": not given).
FAULT_PROBE = """
import dataclasses, os, resource, sys
sys.path.insert(0, ".")
import sample
from nanogpt.checkpoint_file import save_checkpoint
from model import GPT, GPTConfig
out_dir, keep = sys.argv[1], sys.argv[2]
if not os.path.exists(os.path.join(out_dir, "ckpt.pt")):
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=128, vocab_size=65))
    meta = {"vocab_size": 65, "tokenizer": "char", "itos": [chr(c) for c in range(32, 96)] + ["\\n"]}
    save_checkpoint(os.path.join(out_dir, "ckpt.pt"), {"model": model.state_dict(), "iter_num": 0, "config": {},
                    "model_args": dataclasses.asdict(model.config), "best_val_loss": 1.0, "meta": meta})
generate = sample.sample
def counted(*args):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    result = generate(*args)
    print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return result
sample.sample = counted
sample.main([f"--out_dir={out_dir}", "--num_samples=8", "--max_new_tokens=200", "--device=cpu:0", "--dtype=float32",
             *([f"--keep_freed_memory={keep}"] if keep != "default" else [])])
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_sampling_on_a_cpu_keeps_freed_memory_so_window_steps_do_not_fault_in_fresh_pages(tmp_path):
    """Every window step past block_size allocates the same large buffers (scores, MLP activations) again: with
    glibc's defaults each comes back from the OS as fresh pages (~75,000 page faults for these 8 x 200 tokens);
    keep_freed_memory=True, the default, keeps them (~4,500), on any CPU device name."""
    faults = {}
    for keep in ("False", "default"):
        r = run_script(["-c", FAULT_PROBE, str(tmp_path), keep], timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        faults[keep] = int(r.stdout.split("faults ")[1].split()[0])
    assert faults["default"] * 4 < faults["False"], faults


# sample.py run as its __main__ block by a host (as IPython's %run does), then: the host's collector after the
# run, and at the host's exit (an exit handler registered before the run's, so run after it); argv: out_dir
FREEZE_PROBE = """
import atexit, gc, runpy, sys
atexit.register(lambda: print("frozen at exit", gc.get_freeze_count(), flush=True))
sys.argv = ["sample.py", f"--out_dir={sys.argv[1]}", "--max_new_tokens=3", "--num_samples=1", "--device=cpu"]
runpy.run_path("sample.py", run_name="__main__")
print("frozen after the run", gc.get_freeze_count(), flush=True)
"""


@pytest.mark.slow
def test_the_command_moves_its_imports_objects_out_of_the_collectors_way_at_exit(char_run):
    """The objects the imports make (torch's, ~170k) are never garbage: at exit, before the interpreter's last
    collections walk them (0.3 s of a one-token command), the command moves them to the collector's permanent
    generation. At exit only: a host that runs sample.py as __main__ and goes on (IPython's %run) keeps a collector
    that frees what it drops."""
    r = run_script(["-c", FREEZE_PROBE, char_run[0]], timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split("frozen after the run ")[1].split()[0]) == 0
    assert int(r.stdout.split("frozen at exit ")[1].split()[0]) > 50_000


def test_a_window_dtype_this_machine_cannot_run_is_named_as_window_dtype():
    """Bug: --window_dtype=float16 on a CPU said "dtype='float16' is not supported", naming a key not given."""
    import sample as sample_module

    with pytest.raises(UserError, match=r"^window_dtype='float16' is not supported on the CPU: use bfloat16"):
        sample_module.check_config(SampleConfig(device="cpu", dtype="float32", window_dtype="float16"))


def test_a_ctrl_c_while_sampling_is_one_line_and_exit_130(char_run, monkeypatch, capsys):
    """Bug: Ctrl-C during a long sample (--max_new_tokens=100000) printed KeyboardInterrupt's traceback. Now one
    line on stderr and exit status 130 (128 + SIGINT)."""
    draw, calls = engine.sample_next_token, []

    def ctrl_c_at_the_third_token(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what Python's SIGINT handler raises
        return draw(*args, **kwargs)

    monkeypatch.setattr(engine, "sample_next_token", ctrl_c_at_the_third_token)
    r = run_in_process(["sample.py", f"--out_dir={char_run[0]}", "--device=cpu", "--num_samples=1",
                        "--max_new_tokens=50"], capsys)
    assert r.returncode == 130 and len(calls) == 3
    assert r.stderr.splitlines()[-1] == "interrupted (Ctrl-C)" and "Traceback" not in r.stderr
