"""Host-to-device batch copies into memory of the consuming stream (no ``record_stream``).

torchrec's pipelines copy each batch on a side stream (``memcpy``) and then call
``record_stream(main)`` on every tensor, so the caching allocator keeps each block from reuse
until main's work on it is done, which in practice holds one more batch. torchrec 1.8's
``enable_inplace_copy_batch`` instead allocates on main and copies on the side stream, but only
for batches whose ``to()`` takes a ``data_copy_stream`` argument.

:func:`copy_batch` does that for any ``Pipelineable`` (any ``to(device, non_blocking)``), on
every torchrec version: it runs the batch's own ``to`` under a mode that turns each host-to-
device ``Tensor.to`` into an allocation on the current stream and a ``copy_`` on the copy stream,
ordered by one event recorded after the allocation. KJT metadata (cached ``length_per_key``,
strides) stays what the batch's ``to`` makes of it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import NamedTuple, TypeVar

import torch
from torch.overrides import TorchFunctionMode

T = TypeVar("T")


class Later(NamedTuple):
    """A destination that the caller of :func:`copy_batch` writes itself, later: the batch
    gets ``tensor`` unwritten."""

    tensor: torch.Tensor


#: ``into(k, src)``: the device tensor (``src``'s shape and dtype) that the batch's ``k``-th
#: host-to-device copy writes, on the copy stream; it orders that stream after the memory's last
#: readers itself. None: a fresh allocation. :class:`Later`: no copy here (the caller's).
Destination = Callable[[int, torch.Tensor], "torch.Tensor | Later | None"]


class _CopyOn(TorchFunctionMode):
    """Inside: ``t.to(device, ...)`` of a host tensor is recorded in ``made``; the ``k``-th goes
    into ``into(k, t)`` where that gives a tensor; else, with ``inplace``, it allocates on the
    current stream and copies on ``stream``. Other calls run unchanged."""

    def __init__(
        self, device: torch.device, stream: torch.Stream, made: list[torch.Tensor], inplace: bool,
        into: Destination | None,
    ) -> None:
        super().__init__()
        self.device, self.stream, self.made, self.inplace = device, stream, made, inplace
        self.into = into

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.to or not self._is_host_to_device(args, kwargs):
            return func(*args, **kwargs)
        src, non_blocking = args[0], kwargs.get("non_blocking", False)
        out = None if self.into is None else self.into(len(self.made), src)
        if isinstance(out, Later):
            out = out.tensor
        elif out is not None:
            with self.stream:
                out.copy_(src, non_blocking=non_blocking)
        elif self.inplace:
            out = torch.empty_like(src, device=self.device)  # on the current stream
            self.stream.wait_event(torch.cuda.current_stream(self.device).record_event())
            with self.stream:
                out.copy_(src, non_blocking=non_blocking)
        else:
            out = func(*args, **kwargs)
        self.made.append(out)
        return out

    def _is_host_to_device(self, args: tuple, kwargs: dict) -> bool:
        if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type != "cpu":
            return False
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(target, (str, int)):
            target = torch.device(target)
        extra = set(kwargs) - {"device", "non_blocking"}
        return (isinstance(target, torch.device) and _indexed(target) == self.device
                and not extra and len(args) <= 2)


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def copy_batch(
    batch: T, device: torch.device, stream: torch.Stream | None,
    made: list[torch.Tensor] | None = None, inplace: bool = True, into: Destination | None = None,
) -> T:
    """``batch.to(device, non_blocking=True)`` with every host-to-device copy on ``stream``.

    ``inplace``: every destination is allocated on the current stream (the consumer), ordered
    before the copy by an event. The caller makes the consumer wait on ``stream`` before it
    reads the result (``current_stream().wait_stream(stream)``) and needs no ``record_stream``:
    the memory belongs to the current stream, so freeing it there is ordered after the
    consumer's reads. Else the copy is allocated on ``stream`` too (torchrec's default path;
    the consumer must ``record_stream``). Host tensors must stay valid until the copy ends
    (pinned memory: the host allocator tracks it).

    ``made`` (if given) gets every tensor the copy wrote, in the order of the ``to`` calls: the
    caller's (and ``into``'s) memory, as opposed to tensors that ``to`` returned as they were
    (already on ``device``). ``into`` (see :data:`Destination`) may give the ``k``-th its
    memory.
    ``stream=None`` (CPU pipelines): a plain ``batch.to(device, non_blocking=True)``, where
    ``into`` may still give destinations (:class:`Later` ones only: nothing is copied on CPU).
    """
    if stream is None and into is None:
        return batch.to(device, non_blocking=True)
    mode = _CopyOn(
        _indexed(torch.device(device)), stream, [] if made is None else made, inplace, into
    )
    current = torch.cuda.current_stream() if inplace else stream
    with nullcontext() if stream is None else torch.cuda.stream(current), mode:
        return batch.to(device, non_blocking=True)
