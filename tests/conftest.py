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


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    """Nothing may download at test time: fail any attempt to fetch a tiktoken encoding,
    and keep tiktoken's file cache and $QKV_BPE_DIR out of the tests."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    monkeypatch.delenv(BPE_DIR_ENV, raising=False)
    try:
        import tiktoken
    except ImportError:
        return

    def refuse(name):
        raise AssertionError(f"test tried to download the {name!r} encoding")

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
