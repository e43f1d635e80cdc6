from pathlib import Path

import pytest
import torch

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
