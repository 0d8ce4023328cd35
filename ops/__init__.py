"""recpipe.ops: custom torch ops (``torch.ops.recpipe.*``) registered on import."""

from recpipe.ops.permute import PermuteResult, permute_2D_sparse_data, permute_into

__all__ = ["PermuteResult", "permute_2D_sparse_data", "permute_into"]
