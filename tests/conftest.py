import sys
from pathlib import Path

import pytest
import torch

from qkv.data.tokenizers import BPE_DIR_ENV

# The six-token example of LLMs-from-scratch §3.3: "Your journey starts with one step".
BOOK_INPUTS = [
    [0.43, 0.15, 0.89],
    [0.55, 0.87, 0.66],
    [0.57, 0.85, 0.64],
    [0.22, 0.58, 0.33],
    [0.77, 0.25, 0.10],
    [0.05, 0.80, 0.55],
]

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def inputs() -> torch.Tensor:
    return torch.tensor(BOOK_INPUTS)


@pytest.fixture
def batch(inputs) -> torch.Tensor:
    return torch.stack((inputs, inputs))


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Run the suite on one intra-op thread.

    The models under test are tiny: one thread is as fast as two, and two spinning
    threads slow down about tenfold when other processes compete for the cores.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# huggingface_hub's module-level settings, read from the environment when it is imported.
HF_CONSTANTS = {"HF_HOME": "", "HF_HUB_CACHE": "hub", "HF_ASSETS_CACHE": "assets",
                "HF_XET_CACHE": "xet", "HF_TOKEN_PATH": "token",
                "HF_STORED_TOKENS_PATH": "stored_tokens"}


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch, tmp_path_factory):
    """Nothing may download at test time: fail any attempt to fetch a tiktoken encoding,
    keep tiktoken's file cache and $QKV_BPE_DIR out of the tests, and hold the Hugging
    Face Hub offline with its cache and token in an empty temporary folder (a repo id
    given to ``qkv lm import`` then fails as offline; tests/test_hub.py's fake Hub on
    127.0.0.1 lifts this for its own server)."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    monkeypatch.delenv(BPE_DIR_ENV, raising=False)
    home = tmp_path_factory.getbasetemp() / "hf-home"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    for name in ("HF_ENDPOINT", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        for name, under in HF_CONSTANTS.items():
            monkeypatch.setattr(constants, name, str(home / under) if under else str(home))
    try:
        import tiktoken
    except ImportError:
        return

    def refuse(name):
        raise AssertionError(f"test tried to download the {name!r} encoding")

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
