from __future__ import annotations

import pytest
import torch

from mimo.core.batch import PackedBatch
from mimo.core.errors import DataError


def make(lens=(3, 1, 4)):
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])
    return PackedBatch(
        tokens=torch.randint(0, 50, (t,)),
        positions=positions,
        cu_seqlens=cu,
        labels=torch.randint(0, 50, (t,)),
        loss_mask=torch.ones(t, dtype=torch.bool),
        image_slots={"<image>": torch.tensor([1, 2, 5])},
    )


def test_valid_batch_and_properties():
    b = make()
    b.validate()
    assert b.num_tokens == 8 and b.num_samples == 3 and b.seqlens == [3, 1, 4] and b.max_seqlen == 4
    assert b.to("cpu").image_slots["<image>"].tolist() == [1, 2, 5]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: setattr(b, "positions", torch.arange(8)), "restart"),
        (lambda b: setattr(b, "cu_seqlens", b.cu_seqlens.long()), "int32"),
        (lambda b: setattr(b, "labels", b.labels[:-1]), "labels"),
        (lambda b: b.image_slots.update({"<image>": torch.tensor([5, 1])}), "ascending"),
    ],
)
def test_inconsistent_batches_are_rejected(mutate, match):
    b = make()
    mutate(b)
    with pytest.raises(DataError, match=match):
        b.validate()
