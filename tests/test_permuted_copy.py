"""The permuted copy's block write (recpipe.pipeline.permuted_copy.write_permuted), on CPU: the
pipeline's use of it on 2 ranks is in test_pipeline_parity.py."""

import torch

from recpipe.ops import permute_2D_sparse_data
from recpipe.pipeline.buffers import front_view, whole_view
from recpipe.pipeline.permuted_copy import write_permuted


def test_write_permuted_gives_p1s_values_and_weights() -> None:
    lengths = torch.tensor([2, 1, 0, 1, 3, 0, 4, 0, 1], dtype=torch.int32)  # 3 features x 3
    values = torch.arange(12, dtype=torch.int64)
    weights = torch.rand(12)
    order = (2, 0, 1)
    targets = [torch.empty_like(values), torch.empty_like(weights)]
    assert write_permuted(lengths, [values, weights], targets, order)
    _, p1_values, p1_weights = permute_2D_sparse_data(
        torch.tensor(order, dtype=torch.int32), lengths.view(3, -1), values, weights, 12
    )
    assert torch.equal(targets[0], p1_values) and torch.equal(targets[1], p1_weights)


def test_write_permuted_copies_as_is_where_the_lengths_do_not_describe_the_values() -> None:
    values = torch.arange(5)
    target = torch.empty_like(values)
    assert not write_permuted(torch.tensor([1, 1]), [values, None], [target, None], (1, 0))
    assert torch.equal(target, values)
    target.zero_()
    assert not write_permuted(None, [values, None], [target, None], (1, 0))  # (no lengths seen)
    assert torch.equal(target, values)


def test_slot_tensors_are_views_of_the_slot_memory() -> None:
    """The slot's tensors are views (the CUDA sanitizer counts ``set_`` onto shared memory as a
    write): at the front of the slot's bytes, and over a taken-over tensor's whole storage."""
    buffer = torch.zeros(64, dtype=torch.uint8)
    like = torch.arange(3, dtype=torch.int64)
    front = front_view(buffer, like)
    assert front._is_view() and front.dtype == like.dtype and front.shape == like.shape
    front.copy_(like)
    assert front.data_ptr() == buffer.data_ptr()
    assert buffer[:24].view(torch.int64).tolist() == [0, 1, 2]
    storage = torch.empty(40, dtype=torch.uint8).untyped_storage()  # a padded buffer's
    padded = torch.empty(0, dtype=torch.int32).set_(storage, 0, (4,))
    whole = whole_view(padded)
    assert whole is not None and whole._is_view() and whole.numel() == 40
    assert whole.data_ptr() == padded.data_ptr()
    assert whole_view(torch.arange(8)[2:]) is None  # not from the storage's start
