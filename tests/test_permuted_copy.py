"""The permuted copy's block write (recpipe.pipeline.permuted_copy.write_permuted), on CPU: the
pipeline's use of it on 2 ranks is in test_pipeline_parity.py."""

import torch

from recpipe.ops import permute_2D_sparse_data
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
