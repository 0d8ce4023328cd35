"""recpipe.kjt: permute KeyedJaggedTensors into buffers sized from host metadata."""

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

__all__ = [
    "Allocator",
    "PermuteBuffers",
    "PermuteInto",
    "PermuteSpec",
    "Runner",
    "allocate",
    "kjt_permute_spec",
    "permute_kjt",
    "permute_spec",
    "write_into",
]
