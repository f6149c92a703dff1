"""Shared test setup: the repo root on sys.path, offline data from ../shared/data when present, and the fixtures
many test files use (data_dir: the tiny character dataset of the training tests)."""
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED_DATA = os.path.join(ROOT, "..", "shared", "data")

os.environ.setdefault("WANDB_MODE", "disabled")
# pytest-xdist's workers share the machine's cores: each gets its share of threads (and the processes it starts, through
# the environment), or N workers x N threads oversubscribe the cores and a tiny model's step spins for nothing (the
# suite ran 2x slower on 2 cores, some tests 8x).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
# Each pytest-xdist worker compiles into its own inductor cache (with the processes it starts): processes that
# shared one cache folder have hit sporadic inductor C++ compile errors.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"nanogpt_tests_inductor_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if os.path.isdir(os.path.join(SHARED_DATA, "tiktoken_cache")):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(SHARED_DATA, "tiktoken_cache"))
if os.path.isfile(os.path.join(SHARED_DATA, "tinyshakespeare", "input.txt")):
    os.environ.setdefault("NANOGPT_SHAKESPEARE_TXT", os.path.join(SHARED_DATA, "tinyshakespeare", "input.txt"))

import hashlib  # noqa: E402

import pytest  # noqa: E402

GPT2_BPE_URLS = (  # the files tiktoken's "gpt2" encoding reads, cached under sha1(url)
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)


@pytest.fixture()
def gpt2_bpe():
    """The GPT-2 BPE tokenizer from a tiktoken cache; skips (with the reason) where there is none."""
    from nanogpt import tokenizers

    cache = os.environ.get("TIKTOKEN_CACHE_DIR", "")
    names = [hashlib.sha1(url.encode()).hexdigest() for url in GPT2_BPE_URLS]
    if not cache or not all(os.path.isfile(os.path.join(cache, n)) for n in names):
        pytest.skip("GPT-2 BPE unavailable offline: set TIKTOKEN_CACHE_DIR to a folder with tiktoken's gpt2 files")
    return tokenizers.gpt2_tokenizer()


@pytest.fixture()
def data_dir(tmp_path):
    """A tiny learnable character dataset (helpers.make_char_dataset) in tmp_path/tinychar: dataset 'tinychar'."""
    from helpers import make_char_dataset

    d = tmp_path / "tinychar"
    make_char_dataset(d)
    return d


@pytest.fixture()
def wandb_settings(monkeypatch):
    """wandb reads its settings (WANDB_MODE, the server, the key) once per process: a test that changes them has them
    read anew at its end too, its environment undone, so that the tests after it see the process's own."""
    wandb = pytest.importorskip("wandb")
    yield wandb
    monkeypatch.undo()
    wandb.teardown()
