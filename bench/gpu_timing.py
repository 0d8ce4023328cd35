"""GPU execution time of one call, for the benchmark scripts."""

from __future__ import annotations

from collections.abc import Callable

import torch

SPIN_CYCLES = 4_000_000  # ~2 ms at H100/H200 clocks: longer than the host time of any call here


def device_ms(fn: Callable[[], object], spin_cycles: int = SPIN_CYCLES) -> float:
    """Milliseconds between CUDA events around one call of ``fn`` on the current stream, with a
    spin kernel queued first: the host has queued the whole call before the GPU reaches it, so
    launch and Python costs (hidden behind the GPU in training) are not counted."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(spin_cycles)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
