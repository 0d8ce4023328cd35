"""recpipe.kjt: permute KeyedJaggedTensors into buffers sized from host metadata."""

from recpipe.kjt.copy import Destination, Later, copy_batch
from recpipe.kjt.permute import (
    Allocator,
    PermuteBuffers,
    PermuteInto,
    PermuteSpec,
    Runner,
    allocate,
    kjt_permute_spec,
    permute_kjt,
    permute_spec,
    write_into,
)
from recpipe.kjt.redirect import RedirectStats, as_type, redirecting_kjt_type
from recpipe.kjt.storage import kjt_nbytes, kjt_tensors, release_storage

__all__ = [
    "Allocator",
    "Destination",
    "Later",
    "PermuteBuffers",
    "PermuteInto",
    "PermuteSpec",
    "RedirectStats",
    "Runner",
    "allocate",
    "copy_batch",
    "as_type",
    "kjt_nbytes",
    "kjt_tensors",
    "kjt_permute_spec",
    "permute_kjt",
    "permute_spec",
    "redirecting_kjt_type",
    "release_storage",
    "write_into",
]
