"""Give a KeyedJaggedTensor's device memory back before the object dies."""

from __future__ import annotations

from collections.abc import Container, Iterator

import torch

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def kjt_tensors(kjt: KeyedJaggedTensor) -> Iterator[torch.Tensor]:
    """The tensors that hold ``kjt``'s memory: values, lengths, offsets, weights (those set)."""
    for t in (kjt.values(), kjt.lengths_or_none(), kjt.offsets_or_none(), kjt.weights_or_none()):
        if t is not None:
            yield t


def release_storage(kjt: KeyedJaggedTensor, owned: Container[int]) -> int:
    """Free the storage of ``kjt``'s values, lengths, offsets and weights (``resize_(0)``, as
    torchrec 1.8's ``clear_storage``); returns the bytes freed. The object stays, empty.

    Only storages whose ``data_ptr`` is in ``owned`` go (the caller's own copies: never the
    user's tensors), and only where the tensor spans its whole storage: a view into a larger
    buffer (a batch packed into one allocation) is left alone.

    Contract: no stream reads ``kjt`` after this except those the allocator knows about
    (the allocating stream, and streams recorded with ``record_stream``: torchrec's
    ``start_sparse_data_dist`` records data_dist on the batch); the allocator reuses the
    memory only after their work queued so far is done.
    """
    freed = 0
    seen: set[int] = set()
    for t in kjt_tensors(kjt):
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or ptr not in owned or storage.nbytes() != t.numel() * t.element_size():
            continue
        seen.add(ptr)
        freed += storage.nbytes()
        storage.resize_(0)
    return freed


def kjt_nbytes(kjt: KeyedJaggedTensor) -> int:
    """Bytes of ``kjt``'s values, weights and lengths (what a permute of it reads and writes)."""
    return sum(
        t.numel() * t.element_size()
        for t in (kjt.values(), kjt.weights_or_none(), kjt.lengths())
        if t is not None
    )
