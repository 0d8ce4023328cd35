"""Redirect the permutes of chosen KeyedJaggedTensor objects, and nothing else.

torchrec reaches the two permutes of the sparse input distribution through a KJT object:

- P1: ``features.permute(order, order_tensor)`` on a sharded module's input KJT (``input_dist``);
- P2: ``type(self._input).dist_init(...)`` in ``KJTAllToAllTensorsAwaitable._wait_impl``: a
  staticmethod looked up on the class of the KJT that entered the all-to-all.

:func:`redirecting_kjt_type` makes a subclass of ``KeyedJaggedTensor`` whose ``permute`` and
``dist_init`` run torchrec's own methods with their fbgemm 2D permute done by a :data:`Runner`.
Assigned to exactly those objects (``kjt.__class__ = cls``, see :func:`as_type`), it runs Python
at these two methods only: the :class:`~recpipe.kjt.PermuteInto` mode is active for the few
torch calls inside them, and every other torch call of the input dist takes torch's C++ path.
Nothing global changes: the class is made per caller (a pipeline), and a KJT that was not
assigned it behaves as torchrec's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recpipe.kjt.permute import PermuteInto, Runner


@dataclass
class RedirectStats:
    """What an interception did: the permutes it redirected at each site (P1, ``input_dist``;
    P2, ``dist_init``) and the torch calls its mode saw (its whole Python footprint)."""

    input_dist: int = 0
    dist_init: int = 0
    seen: int = 0


def redirecting_kjt_type(
    permute_runner: Callable[[], Runner | None],
    dist_init_runner: Callable[[], Runner],
    stats: RedirectStats,
    on_permute: Callable[[KeyedJaggedTensor], None] | None = None,
) -> type[KeyedJaggedTensor]:
    """A ``KeyedJaggedTensor`` subclass whose permutes go through runners.

    ``permute_runner()`` / ``dist_init_runner()`` are called on each ``permute`` (P1) /
    ``dist_init`` (P2), on the caller's thread and stream, and return the runner for that call
    (``permute_runner() is None``: torchrec's permute as it is, no mode). ``on_permute(kjt)``
    is called after each P1 with the KJT that was permuted (its input).
    ``stats`` adds up the permutes redirected at each site and the torch calls the mode saw.
    Results are plain ``KeyedJaggedTensor`` (torchrec constructs them), exactly torchrec's but
    for where the permuted tensors live.
    """

    def redirect(site: str, run: Runner, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        mode = PermuteInto(run)
        with mode:
            out = method(*args, **kwargs)
        setattr(stats, site, getattr(stats, site) + mode.calls)
        stats.seen += mode.seen
        return out

    def permute(self: KeyedJaggedTensor, *args: Any, **kwargs: Any) -> KeyedJaggedTensor:
        run = permute_runner()
        if run is None:
            out = KeyedJaggedTensor.permute(self, *args, **kwargs)
        else:
            out = redirect("input_dist", run, KeyedJaggedTensor.permute, self, *args, **kwargs)
        if on_permute is not None:
            on_permute(self)
        return out

    def dist_init(*args: Any, **kwargs: Any) -> KeyedJaggedTensor:
        return redirect("dist_init", dist_init_runner(), KeyedJaggedTensor.dist_init, *args, **kwargs)

    return type(
        "RedirectingKeyedJaggedTensor",
        (KeyedJaggedTensor,),
        {"__slots__": (), "__module__": __name__, "permute": permute,
         "dist_init": staticmethod(dist_init)},
    )


@contextmanager
def as_type(kjts: list[KeyedJaggedTensor], cls: type[KeyedJaggedTensor]) -> Iterator[None]:
    """Within the block, each of ``kjts`` (plain ``KeyedJaggedTensor``) is of class ``cls``;
    restored on exit, also on error."""
    for kjt in kjts:
        kjt.__class__ = cls
    try:
        yield
    finally:
        for kjt in kjts:
            kjt.__class__ = KeyedJaggedTensor
