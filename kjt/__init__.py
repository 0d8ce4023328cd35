"""recpipe.kjt: permute KeyedJaggedTensors into buffers sized from host metadata."""

from recpipe.kjt.permute import (
    Allocator,
    PermuteBuffers,
    PermuteInto,
    PermuteSpec,
    allocate,
    kjt_permute_spec,
    permute_kjt,
    permute_spec,
)

__all__ = [
    "Allocator",
    "PermuteBuffers",
    "PermuteInto",
    "PermuteSpec",
    "allocate",
    "kjt_permute_spec",
    "permute_kjt",
    "permute_spec",
]
