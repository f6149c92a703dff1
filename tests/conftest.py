"""Shared test setup: the repo root on sys.path, offline data from ../shared/data when present."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED_DATA = os.path.join(ROOT, "..", "shared", "data")

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if os.path.isdir(os.path.join(SHARED_DATA, "tiktoken_cache")):
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(SHARED_DATA, "tiktoken_cache"))
if os.path.isfile(os.path.join(SHARED_DATA, "tinyshakespeare", "input.txt")):
    os.environ.setdefault("NANOGPT_SHAKESPEARE_TXT", os.path.join(SHARED_DATA, "tinyshakespeare", "input.txt"))
