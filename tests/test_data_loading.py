"""qkv.data.loading.batch_loader: the batches of torch's DataLoader, a batch per indexing."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from qkv.data.loading import batch_loader


def _dataset(n: int = 37) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 9, (n, 5), generator=g), torch.arange(n),
                         torch.randn(n, 2, 3, generator=g))


def _assert_same_batches(ours: DataLoader, reference: DataLoader) -> None:
    ours_batches, ref_batches = list(ours), list(reference)
    assert len(ours_batches) == len(ref_batches) == len(ours) == len(reference)
    for a, b in zip(ours_batches, ref_batches, strict=True):
        assert type(a) is type(b)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_same_batches_as_dataloader(shuffle, drop_last):
    ds = _dataset()
    for seed in (0, 1):
        ours = batch_loader(ds, 8, shuffle=shuffle, drop_last=drop_last,
                            generator=torch.Generator().manual_seed(seed))
        reference = DataLoader(ds, batch_size=8, shuffle=shuffle, drop_last=drop_last,
                               generator=torch.Generator().manual_seed(seed))
        _assert_same_batches(ours, reference)


def test_same_batches_with_a_distributed_sampler():
    ds = _dataset()
    for rank in (0, 1):
        def sampler(rank=rank):
            return DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)

        _assert_same_batches(batch_loader(ds, 4, sampler=sampler()),
                             DataLoader(ds, batch_size=4, sampler=sampler()))


def test_same_draws_from_the_generator():
    # what the loader leaves in the generator is what DataLoader leaves: code that draws
    # from it afterwards sees the same numbers
    ds = _dataset()
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    list(batch_loader(ds, 8, shuffle=True, generator=g1))
    list(DataLoader(ds, batch_size=8, shuffle=True, generator=g2))
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_other_datasets_are_loaded_as_dataloader_does():
    class Squares(Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> torch.Tensor:  # an int index only
            return torch.tensor([i * i])

    ours = batch_loader(Squares(), 4, shuffle=True, generator=torch.Generator().manual_seed(0))
    reference = DataLoader(Squares(), batch_size=4, shuffle=True,
                           generator=torch.Generator().manual_seed(0))
    for a, b in zip(ours, reference, strict=True):
        assert torch.equal(a, b)
