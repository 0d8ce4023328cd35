"""recpipe.kjt.release_storage frees only what its caller owns, whole storages only; a released
KJT's cached views let go of its memory."""

from __future__ import annotations

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.kjt import copy_batch, release_storage
from recpipe.pipeline.compat import drop_cached_views


def _kjt(values: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(["a", "b"], values, torch.tensor([1, 2, 0, 3]))


def test_frees_owned_whole_storages_only() -> None:
    kjt = _kjt(torch.arange(6))
    owned = {kjt.values().untyped_storage().data_ptr()}
    assert release_storage(kjt, owned) == 6 * 8
    assert kjt.values().untyped_storage().nbytes() == 0
    assert kjt.lengths().untyped_storage().nbytes() == 4 * 8  # not owned: kept


def test_leaves_views_and_foreign_tensors() -> None:
    packed = torch.arange(10)
    kjt = _kjt(packed[:6])  # a view into a larger buffer
    assert release_storage(kjt, {packed.untyped_storage().data_ptr()}) == 0
    assert packed.untyped_storage().nbytes() == 10 * 8
    other = _kjt(torch.arange(6))
    assert release_storage(other, set()) == 0 and other.values().tolist() == list(range(6))


def test_copy_batch_without_a_stream_is_plain_to() -> None:
    kjt = _kjt(torch.arange(6))
    made: list[torch.Tensor] = []
    out = copy_batch(kjt, torch.device("cpu"), None, made)
    assert out.values() is kjt.values() and made == []  # nothing copied, nothing owned



def test_dropping_the_to_dict_cache_lets_go_of_the_values_memory() -> None:
    """torchrec's input validation calls ``to_dict()`` on a module's first batch; its cached
    views must not keep a released KJT's memory (the copy ring reuses it)."""
    kjt = _kjt(torch.arange(6))
    users = torch._C._storage_Use_Count(kjt.values().untyped_storage()._cdata)
    kjt.to_dict()
    assert torch._C._storage_Use_Count(kjt.values().untyped_storage()._cdata) > users
    drop_cached_views(kjt)
    assert torch._C._storage_Use_Count(kjt.values().untyped_storage()._cdata) == users
