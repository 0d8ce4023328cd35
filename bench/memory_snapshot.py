"""CUDA memory snapshots of pipeline runs, and what is live at their peak.

Recording, on the GPU machine: :mod:`recpipe.bench.snapshot_recording`.

Analysis (any machine, CPU only: reads the pickle, never imports torch):

    python scripts/memory_snapshot.py SNAPSHOT.pickle [--top N] [--at allocated|active|reserved]
                                                      [--per-stream | --all] [--depth K] [--device D]

finds the moment of peak allocated / active / reserved memory in the trace and prints the
allocations live at that moment as a markdown table, grouped by a short stack signature (the
innermost ``recpipe`` / ``torchrec`` / ``fbgemm_gpu`` frame that allocated them) and stream,
in MiB, largest first. ``--per-stream`` gives one table per stream at the moment that stream's
own pool reached its reserved peak: the caching allocator keeps a stream's segments for that
stream, so peak reserved is about the sum of those per-stream peaks, each set by what was live
on that stream then (plus its cached free blocks: fragmentation). :func:`breakdown` is the
library entry point (a snapshot dict in, rows out).

Snapshot format used (``torch.cuda.memory._snapshot`` docstring): ``segments`` (``address``,
``total_size``, ``stream``, ``device``, ``blocks`` with ``size``, ``state``, ``frames``) and
``device_traces`` (per device, in time order: ``action`` in alloc / free_requested /
free_completed / segment_alloc / segment_free / segment_map / segment_unmap / oom / snapshot,
``addr``, ``size``, ``stream``, ``frames`` innermost first, optional ``time_us`` and
``user_metadata``). "allocated" memory ends at ``free_requested``; "active" memory (what
occupies the pool: also blocks whose free waits on a ``record_stream`` event) at
``free_completed``. The trace may be a ring buffer (``max_entries``): allocations made before
its window are reconstructed from free events and from the final ``segments`` state.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Moment = Literal["allocated", "active", "reserved"]
Frame = Mapping[str, Any]

#: Packages whose innermost frame names an allocation (searched innermost first).
DEFAULT_PACKAGES: tuple[str, ...] = ("recpipe", "torchrec", "fbgemm_gpu")
MIB = 2**20
_SEGMENT_GROW = ("segment_alloc", "segment_map")
_SEGMENT_SHRINK = ("segment_free", "segment_unmap")


# --------------------------------------------------------------------------------------------
# Analysis (pure Python)
# --------------------------------------------------------------------------------------------


@dataclass
class Allocation:
    """One block's life in the trace. Indices are trace positions; ``start == -1``: allocated
    before the trace window; ``freed`` / ``released`` == len(trace): still live at the end."""

    addr: int
    size: int
    stream: int
    frames: Sequence[Frame]
    start: int
    freed: int  # free_requested (allocated memory ends)
    released: int  # free_completed (the pool can reuse it)
    metadata: str = ""
    free_frames: Sequence[Frame] = ()

    def live(self, moment: int, kind: Moment) -> bool:
        """Live just after trace event ``moment`` (``-1``: at the window's start)."""
        end = self.freed if kind == "allocated" else self.released
        return self.start <= moment < end


@dataclass(frozen=True)
class Row:
    """Live bytes at a moment, grouped by allocation site and stream."""

    signature: str
    stream: str
    bytes: int
    count: int
    steps: str = ""

    @property
    def mib(self) -> float:
        return self.bytes / MIB


@dataclass
class Peak:
    """The moment a memory curve first reaches its maximum."""

    kind: Moment
    index: int  # trace position (-1: before the first event)
    bytes: int
    stream: str | None = None  # None: all streams
    time_us: int | None = None
    metadata: str = ""
    rows: list[Row] = field(default_factory=list)
    live_bytes: int = 0  # active bytes live then (same streams)
    reserved_bytes: int | None = None  # reserved then (same streams), where known


def load(path: str) -> dict:
    """A pickled snapshot, with stream names from ``<path>.streams.json`` if present (added as
    ``snapshot["stream_names"]``)."""
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    if not isinstance(snapshot, dict):
        raise ValueError(f"{path}: not a torch memory snapshot (a {type(snapshot).__name__})")
    side = path + ".streams.json"
    if os.path.exists(side):
        with open(side) as f:
            snapshot["stream_names"] = {int(k): str(v) for k, v in json.load(f).items()}
    return snapshot


def pick_device(snapshot: Mapping[str, Any], device: int | None = None) -> int:
    """``device`` if given, else the device with the most trace entries (else segments)."""
    if device is not None:
        return device
    traces = snapshot.get("device_traces") or []
    if traces and any(traces):
        return max(range(len(traces)), key=lambda d: len(traces[d] or []))
    devices = Counter(s.get("device", 0) for s in snapshot.get("segments") or [])
    return devices.most_common(1)[0][0] if devices else 0


def trace_of(snapshot: Mapping[str, Any], device: int) -> list[Mapping[str, Any]]:
    traces = snapshot.get("device_traces") or []
    return list(traces[device] or []) if device < len(traces) else []


def segments_of(snapshot: Mapping[str, Any], device: int) -> list[Mapping[str, Any]]:
    return [s for s in snapshot.get("segments") or [] if s.get("device", device) == device]


def _blocks(segment: Mapping[str, Any]) -> Iterable[tuple[int, Mapping[str, Any]]]:
    addr = int(segment.get("address", 0))
    for block in segment.get("blocks") or []:
        yield int(block.get("address", addr)), block
        addr = int(block.get("address", addr)) + int(block.get("size", 0))


def allocations(
    snapshot: Mapping[str, Any], device: int | None = None
) -> tuple[list[Allocation], int]:
    """Every allocation seen in the trace window of ``device`` (see :class:`Allocation`), and
    the trace length."""
    device = pick_device(snapshot, device)
    trace = trace_of(snapshot, device)
    n = len(trace)
    open_: dict[int, Allocation] = {}
    closed_at: dict[int, int] = {}
    out: list[Allocation] = []

    def before_window(e: Mapping[str, Any]) -> Allocation:
        a = Allocation(int(e.get("addr", 0)), int(e.get("size", 0)), int(e.get("stream", 0)),
                       (), -1, n, n, "", e.get("frames") or ())
        out.append(a)
        return a

    for i, e in enumerate(trace):
        action = e.get("action")
        if action not in ("alloc", "free_requested", "free_completed"):
            continue
        addr = int(e.get("addr", 0))
        if action == "alloc":
            stale = open_.pop(addr, None)
            if stale is not None:  # a free the window lost: close it here
                stale.freed, stale.released = min(stale.freed, i), min(stale.released, i)
            a = Allocation(addr, int(e.get("size", 0)), int(e.get("stream", 0)),
                           e.get("frames") or (), i, n, n, str(e.get("user_metadata") or ""))
            open_[addr] = a
            out.append(a)
        elif action == "free_requested":
            a = open_.get(addr)
            if a is None:
                a = open_[addr] = before_window(e)
            a.freed = min(a.freed, i)
            a.free_frames = e.get("frames") or a.free_frames
        else:  # free_completed
            a = open_.pop(addr, None)
            if a is None:  # allocated and free-requested before the window
                a = before_window(e)
                a.freed = -1
            a.freed, a.released = min(a.freed, i), i
            closed_at[addr] = i
    # Blocks live at the end with no event in the window: live all along.
    for seg in segments_of(snapshot, device):
        for addr, block in _blocks(seg):
            state = str(block.get("state", ""))
            if not state.startswith("active") or addr in open_:
                continue
            start = closed_at.get(addr, -1)
            a = Allocation(addr, int(block.get("size", 0)), int(seg.get("stream", 0)),
                           block.get("frames") or (), start, n, n)
            if state != "active_allocated":  # awaiting free: already requested
                a.freed = max(start, 0) if start >= 0 else -1
            out.append(a)
    return out, n


def _short(filename: str, packages: Sequence[str]) -> str | None:
    best = None
    for pkg in packages:
        k = filename.rfind(f"/{pkg}/")
        if k >= 0 and (best is None or k > best[0]):
            best = (k, filename[k + 1:])
    if best is None:
        for pkg in packages:  # relative paths ("torchrec/...")
            if filename.startswith(f"{pkg}/"):
                return filename
    return None if best is None else best[1]


def signature(
    frames: Sequence[Frame], packages: Sequence[str] = DEFAULT_PACKAGES, depth: int = 1
) -> str:
    """``"pkg/path.py:line func"`` of the innermost frame in one of ``packages`` (``depth`` > 1:
    that many such frames, innermost first, joined by ``" < "``); else the innermost Python
    frame outside torch; else ``"<no stack>"``."""
    picked: list[str] = []
    for f in frames or ():
        short = _short(str(f.get("filename", "")), packages)
        if short is not None:
            picked.append(f"{short}:{f.get('line', '?')} {f.get('name', '?')}")
            if len(picked) >= depth:
                break
    if picked:
        return " < ".join(picked)
    for f in frames or ():
        name = str(f.get("filename", ""))
        if name.endswith(".py") and "/torch/" not in name:
            return f"{os.path.basename(name)}:{f.get('line', '?')} {f.get('name', '?')}"
    if frames:
        f = frames[0]
        name = os.path.basename(str(f.get("filename", "?")))
        return f"{name}:{f.get('line', '?')} {f.get('name', '?')}"
    return "<no stack>"


# Function names on a stream's allocation stacks that identify torchrec's pipeline streams.
_STREAM_MARKERS: tuple[tuple[str, str], ...] = (
    ("copy_batch_to_gpu", "memcpy"),
    ("inplace_copy_batch_to_gpu", "memcpy"),
    ("split_runner", "recpipe_side"),
    ("start_sparse_data_dist", "data_dist"),
    ("wait_sparse_data_dist", "data_dist"),
    ("_backward", "main"),
    ("backward", "main"),
)


def stream_names(
    snapshot: Mapping[str, Any], allocs: Sequence[Allocation], sample: int = 20000
) -> dict[int, str]:
    """Names for the streams seen: the snapshot's ``stream_names`` (from the sidecar), else by
    the pipeline functions on their allocation stacks (majority over up to ``sample``
    allocations per stream), else ``default`` for stream 0 and the hex handle."""
    given = {int(k): str(v) for k, v in (snapshot.get("stream_names") or {}).items()}
    votes: dict[int, Counter] = defaultdict(Counter)
    seen: Counter = Counter()
    for a in allocs:
        if a.stream in given or seen[a.stream] >= sample:
            continue
        seen[a.stream] += 1
        names = {str(f.get("name", "")) for f in a.frames or ()}
        for marker, label in _STREAM_MARKERS:
            if marker in names:
                votes[a.stream][label] += 1
                break
    out = dict(given)
    for s in seen:
        if s in out:
            continue
        if votes[s]:
            out[s] = votes[s].most_common(1)[0][0] + ("?" if s != 0 else "")
        else:
            out[s] = "default" if s == 0 else hex(s)
    # Two streams guessed alike: tell them apart.
    counts = Counter(out.values())
    for s, name in list(out.items()):
        if counts[name] > 1 and s not in given:
            out[s] = f"{name}@{hex(s)}"
    return out


def _curve_peak(deltas: Sequence[tuple[int, int]], baseline: int) -> tuple[int, int]:
    """(index, value) where ``baseline`` + running sum of (index, delta) first peaks."""
    total, best, best_i = baseline, baseline, -1
    for i, d in deltas:
        total += d
        if total > best:
            best, best_i = total, i
    return best_i, best


def _deltas(
    allocs: Iterable[Allocation], kind: Moment, n: int
) -> tuple[list[tuple[int, int]], int]:
    events: list[tuple[int, int]] = []
    baseline = 0
    for a in allocs:
        end = a.freed if kind == "allocated" else a.released
        if a.start < 0:
            if end > -1:
                baseline += a.size
        else:
            events.append((a.start, a.size))
        if 0 <= end < n and end >= a.start:
            events.append((end, -a.size))
    events.sort(key=lambda x: (x[0], x[1]))  # frees before allocs at one index: none share
    return events, baseline


def _reserved(
    snapshot: Mapping[str, Any], device: int, stream: int | None
) -> tuple[list[tuple[int, int]], int, int]:
    """Segment deltas over the trace, the reserved bytes before it, and at its end."""
    trace = trace_of(snapshot, device)
    events = []
    for i, e in enumerate(trace):
        if stream is not None and int(e.get("stream", 0)) != stream:
            continue
        if e.get("action") in _SEGMENT_GROW:
            events.append((i, int(e.get("size", 0))))
        elif e.get("action") in _SEGMENT_SHRINK:
            events.append((i, -int(e.get("size", 0))))
    final = sum(int(s.get("total_size", 0)) for s in segments_of(snapshot, device)
                if stream is None or int(s.get("stream", 0)) == stream)
    return events, final - sum(d for _, d in events), final


def _rows(
    live: Iterable[Allocation], names: Mapping[int, str], packages: Sequence[str], depth: int,
) -> list[Row]:
    groups: dict[tuple[str, str], list[Allocation]] = defaultdict(list)
    for a in live:
        if a.frames:
            sig = signature(a.frames, packages, depth)
        elif a.start >= 0:
            sig = "<no stack>"
        elif a.free_frames:
            sig = "(before trace; freed at) " + signature(a.free_frames, packages, depth)
        else:
            sig = "(before trace)"
        groups[(sig, names.get(a.stream, hex(a.stream)))].append(a)
    rows = []
    for (sig, stream), group in groups.items():
        steps = sorted({a.metadata.removeprefix("step ") for a in group if a.metadata},
                       key=lambda s: (len(s), s))
        rows.append(Row(sig, stream, sum(a.size for a in group), len(group), ",".join(steps)))
    rows.sort(key=lambda r: (-r.bytes, r.signature, r.stream))
    return rows


def peak(
    snapshot: Mapping[str, Any],
    at: Moment = "allocated",
    stream: int | None = None,
    device: int | None = None,
    packages: Sequence[str] = DEFAULT_PACKAGES,
    depth: int = 1,
    top: int | None = None,
    _cache: dict | None = None,
) -> Peak:
    """The peak of ``at`` memory (of one stream's pool if ``stream`` is given) and the
    allocations live then (allocated ones for ``at="allocated"``, else active ones: for
    reserved, what occupied the pool when it had to grow)."""
    if at not in ("allocated", "active", "reserved"):
        raise ValueError(f"at: allocated, active or reserved, not {at!r}")
    device = pick_device(snapshot, device)
    cache = _cache if _cache is not None else {}
    if "allocs" not in cache:
        cache["allocs"], cache["n"] = allocations(snapshot, device)
        cache["names"] = stream_names(snapshot, cache["allocs"])
    allocs: list[Allocation] = cache["allocs"]
    n: int = cache["n"]
    names: dict[int, str] = cache["names"]
    mine = [a for a in allocs if stream is None or a.stream == stream]
    reserved_at: int | None = None
    trace = trace_of(snapshot, device)
    has_segments = bool(segments_of(snapshot, device)) or any(
        e.get("action") in _SEGMENT_GROW for e in trace)
    if at == "reserved":
        events, base, _ = _reserved(snapshot, device, stream)
        index, value = _curve_peak(events, base)
        reserved_at = value
        live_kind: Moment = "active"
        # The allocator logs segment_alloc just before the alloc that needed it: show that one too.
        if index >= 0:
            grown = int(trace[index].get("stream", 0))
            for j in range(index + 1, min(index + 64, len(trace))):
                if trace[j].get("action") == "alloc" and int(trace[j].get("stream", 0)) == grown:
                    index = j
                    break
    else:
        events, base = _deltas(mine, at, n)
        index, value = _curve_peak(events, base)
        live_kind = at
        r_events, r_base, _ = _reserved(snapshot, device, stream)
        reserved_at = r_base + sum(d for i, d in r_events if i <= index) if has_segments else None
    live = [a for a in mine if a.live(index, live_kind)]
    entry = trace[index] if 0 <= index < len(trace) else {}
    rows = _rows(live, names, packages, depth)
    return Peak(
        kind=at, index=index, bytes=value,
        stream=None if stream is None else names.get(stream, hex(stream)),
        time_us=entry.get("time_us"), metadata=str(entry.get("user_metadata") or ""),
        rows=rows[:top] if top else rows, live_bytes=sum(a.size for a in live),
        reserved_bytes=reserved_at,
    )


def breakdown(
    snapshot: Mapping[str, Any],
    at: Moment = "allocated",
    top: int | None = None,
    stream: int | None = None,
    device: int | None = None,
    packages: Sequence[str] = DEFAULT_PACKAGES,
    depth: int = 1,
) -> list[Row]:
    """Allocations live at the peak of ``at`` memory, grouped by (signature, stream), largest
    first (``top``: the first rows only). An empty snapshot gives ``[]``."""
    return peak(snapshot, at, stream, device, packages, depth, top).rows


def per_stream(
    snapshot: Mapping[str, Any],
    device: int | None = None,
    packages: Sequence[str] = DEFAULT_PACKAGES,
    depth: int = 1,
    top: int | None = None,
) -> list[Peak]:
    """For each stream with segments: the moment its pool reached its reserved peak, with the
    allocations then live on it. Largest pool first."""
    device = pick_device(snapshot, device)
    cache: dict = {}
    streams = {int(s.get("stream", 0)) for s in segments_of(snapshot, device)}
    streams |= {int(e.get("stream", 0)) for e in trace_of(snapshot, device)
                if e.get("action") in _SEGMENT_GROW}
    peaks = [peak(snapshot, "reserved", s, device, packages, depth, top, cache) for s in streams]
    return sorted(peaks, key=lambda p: -p.bytes)


@dataclass(frozen=True)
class Growth:
    """A pool's new segment, and the allocation that needed it."""

    index: int  # trace position of the segment event
    stream: str
    segment_bytes: int
    alloc_bytes: int  # the allocation that did not fit the pool's cached free blocks
    signature: str
    metadata: str
    cached_free: int  # the pool's reserved minus active bytes just before
    largest_free: int = 0  # the pool's largest free gap in one segment just before
    held: str = ""  # what was live in the pool's segments large enough for the allocation


@dataclass(frozen=True)
class _Segment:
    addr: int
    size: int
    stream: int
    start: int  # trace position of its segment event (-1: before the window)
    end: int  # trace position of its release (len(trace): still reserved at the end)


def _segments_in_window(snapshot: Mapping[str, Any], device: int) -> list[_Segment]:
    """Every segment that existed in the trace window, with when it came and went."""
    trace = trace_of(snapshot, device)
    n, out, open_ = len(trace), [], {}
    for i, e in enumerate(trace):
        addr, size, stream = int(e.get("addr", 0)), int(e.get("size", 0)), int(e.get("stream", 0))
        if e.get("action") in _SEGMENT_GROW:
            open_[addr] = _Segment(addr, size, stream, i, n)
        elif e.get("action") in _SEGMENT_SHRINK:
            seg = open_.pop(addr, None) or _Segment(addr, size, stream, -1, n)
            out.append(_Segment(seg.addr, seg.size, seg.stream, seg.start, i))
    came = {s.addr for s in open_.values()} | {s.addr for s in out if s.start >= 0}
    out += open_.values()
    out += [_Segment(int(g.get("address", 0)), int(g.get("total_size", 0)),
                     int(g.get("stream", 0)), -1, n)
            for g in segments_of(snapshot, device) if int(g.get("address", 0)) not in came]
    return out


def _free_gaps(seg: _Segment, live: Sequence[Allocation]) -> int:
    """The largest free gap in ``seg`` between the blocks ``live`` in it (by the sizes that
    the trace records: where those are requests, not rounded blocks, a gap may be up to the
    allocator's rounding smaller)."""
    best, at = 0, seg.addr
    for a in sorted(live, key=lambda a: a.addr):
        best, at = max(best, a.addr - at), max(at, a.addr + a.size)
    return max(best, seg.addr + seg.size - at)


def _held(
    need: int, segments: Sequence[_Segment], live: Sequence[Allocation],
    packages: Sequence[str], depth: int,
) -> tuple[int, str]:
    """The largest free gap among ``segments`` with the blocks ``live`` in them, and for each
    segment at least ``need`` bytes large, its live blocks (largest 3: MiB and where
    allocated)."""
    largest, held = 0, []
    for seg in sorted(segments, key=lambda g: -g.size):
        inside = [a for a in live if seg.addr <= a.addr < seg.addr + seg.size]
        largest = max(largest, _free_gaps(seg, inside))
        if seg.size >= need and inside:
            top = sorted(inside, key=lambda a: -a.size)[:3]
            blocks = ", ".join(f"{a.size / MIB:.1f} {signature(a.frames, packages, depth)}"
                               for a in top)
            held.append(f"{seg.size / MIB:.0f} MiB segment: {blocks}")
    return largest, "; ".join(held)


def growth(
    snapshot: Mapping[str, Any], device: int | None = None,
    packages: Sequence[str] = DEFAULT_PACKAGES, depth: int = 1,
) -> list[Growth]:
    """Every new segment in the trace window, in order: which allocation needed it, how much
    the pool held cached free then, its largest free gap (free bytes that did not fit:
    fragmentation), and what was live in the pool's segments that were large enough."""
    device = pick_device(snapshot, device)
    trace = trace_of(snapshot, device)
    allocs, _ = allocations(snapshot, device)
    segments = _segments_in_window(snapshot, device)
    names = stream_names(snapshot, allocs)
    mine: dict[int, list[Allocation]] = defaultdict(list)
    for a in allocs:
        mine[a.stream].append(a)
    reserved = {s: _reserved(snapshot, device, s)[1] for s in mine}
    out = []
    for i, e in enumerate(trace):
        stream, size = int(e.get("stream", 0)), int(e.get("size", 0))
        if e.get("action") in _SEGMENT_SHRINK:
            reserved[stream] = reserved.get(stream, 0) - size
        if e.get("action") not in _SEGMENT_GROW:
            continue
        need = next((t for t in trace[i + 1:i + 64]
                     if t.get("action") == "alloc" and int(t.get("stream", 0)) == stream), {})
        live = [a for a in mine.get(stream, ()) if a.live(i, "active")]
        active = sum(a.size for a in live)
        have = reserved.get(stream, 0)
        pool = [g for g in segments if g.stream == stream and g.start < i < g.end]
        largest, held = _held(int(need.get("size", 0)), pool, live, packages, depth)
        out.append(Growth(i, names.get(stream, hex(stream)), size, int(need.get("size", 0)),
                          signature(need.get("frames") or (), packages, depth),
                          str(need.get("user_metadata") or ""),
                          max(0, have - active),  # (0: the window missed a segment)
                          largest, held))
        reserved[stream] = have + size
    return out


def growth_markdown(rows: Sequence[Growth]) -> str:
    lines = ["| event | when | stream | new segment MiB | for MiB | allocated by | cached free "
             "before MiB | largest free gap MiB | live then in the segments it would fit |",
             "|---:|---|---|---:|---:|---|---:|---:|---|"]
    for g in rows:
        sig = g.signature.replace("|", "\\|")
        held = g.held.replace("|", "\\|")
        lines.append(f"| {g.index} | {g.metadata or '-'} | {g.stream} | "
                     f"{g.segment_bytes / MIB:.1f} | {g.alloc_bytes / MIB:.1f} | `{sig}` | "
                     f"{g.cached_free / MIB:.1f} | {g.largest_free / MIB:.1f} | {held or '-'} |")
    return "\n".join(lines)


def to_markdown(rows: Sequence[Row]) -> str:
    lines = ["| MiB | count | stream | allocated by | steps |", "|---:|---:|---|---|---|"]
    for r in rows:
        sig = r.signature.replace("|", "\\|")
        lines.append(f"| {r.mib:.1f} | {r.count} | {r.stream} | `{sig}` | {r.steps or '-'} |")
    return "\n".join(lines)


def _when(p: Peak) -> str:
    where = "the start of the trace window" if p.index < 0 else f"trace event {p.index}"
    extra = [f"t={p.time_us / 1e6:.3f} s" if p.time_us else "", p.metadata]
    return where + "".join(f", {x}" for x in extra if x)


def report_peak(p: Peak, shown: int | None = None) -> str:
    scope = f"stream {p.stream}" if p.stream else "all streams"
    head = f"**peak {p.kind}** ({scope}): {p.bytes / MIB:.1f} MiB at {_when(p)}"
    if p.kind == "reserved":
        head += f"; live then {p.live_bytes / MIB:.1f} MiB"
        head += f", cached free {(p.bytes - p.live_bytes) / MIB:.1f} MiB"
    elif p.reserved_bytes is not None:
        head += f"; reserved then {p.reserved_bytes / MIB:.1f} MiB"
    rows = p.rows[:shown] if shown else p.rows
    rest = sum(r.bytes for r in p.rows[len(rows):])
    tail = f"\n\n(+ {len(p.rows) - len(rows)} smaller groups, {rest / MIB:.1f} MiB)" if rest else ""
    return f"{head}\n\n{to_markdown(rows)}{tail}\n"


def full_report(snapshot: Mapping[str, Any], top: int = 25, device: int | None = None,
                depth: int = 1, packages: Sequence[str] = DEFAULT_PACKAGES) -> str:
    """Markdown: peak allocated, peak reserved, then every stream's pool at its own peak."""
    cache: dict = {}
    text = [settings_line(snapshot)]
    text += [report_peak(peak(snapshot, kind, None, device, packages, depth, None, cache), top)
             for kind in ("allocated", "reserved")]
    streams = per_stream(snapshot, device, packages, depth)
    text.append("### per stream (each pool at its own reserved peak)\n")
    text += [report_peak(p, top) for p in streams] or ["(no segments in this snapshot)\n"]
    return "\n".join(text)


def settings_line(snapshot: Mapping[str, Any]) -> str:
    """The allocator settings that change what peak reserved means (expandable segments...)."""
    settings = snapshot.get("allocator_settings") or {}
    keep = {k: v for k, v in settings.items()
            if k in ("expandable_segments", "max_split_size", "garbage_collection_threshold",
                     "roundup_power2_divisions", "release_lock_on_cudamalloc")}
    return f"allocator settings: {keep}\n" if keep else ""


# --------------------------------------------------------------------------------------------
# Self-test (a synthetic snapshot; no torch)
# --------------------------------------------------------------------------------------------


def _frames(*names: tuple[str, str, int]) -> list[dict]:
    return [{"filename": f, "name": n, "line": line} for f, n, line in names]


def _synthetic_snapshot() -> dict:
    """Two streams. Stream 0 (main): a block from before the window freed inside it, a
    ``free_requested`` whose ``free_completed`` comes later (record_stream). Stream 7
    (data_dist): two permutes; the second forces a new segment."""
    sp = "/x/site-packages"
    permute = _frames(("/x/torch/_ops.py", "__call__", 1),
                      (f"{sp}/torchrec/sparse/jagged_tensor.py", "permute", 10),
                      (f"{sp}/torchrec/distributed/train_pipeline/train_pipelines.py",
                       "start_sparse_data_dist", 20))
    dist_init = _frames((f"{sp}/torchrec/sparse/jagged_tensor.py", "dist_init", 30),
                        ("/tmp/recpipe-src/recpipe/pipeline/sparse_dist.py", "_wait_impl", 40))
    mm = _frames(("/x/torch/nn/modules/linear.py", "forward", 5), ("/w/model.py", "forward", 6),
                 ("/w/x.py", "_backward", 7))
    M = MIB
    trace = [
        {"action": "segment_alloc", "addr": 0x1000_0000, "size": 100 * M, "stream": 0},
        {"action": "alloc", "addr": 0x1000_0000, "size": 40 * M, "stream": 0, "frames": mm,
         "user_metadata": "step 1"},
        {"action": "free_requested", "addr": 0x5000_0000, "size": 8 * M, "stream": 0, "frames": mm},
        {"action": "free_completed", "addr": 0x5000_0000, "size": 8 * M, "stream": 0, "frames": mm},
        {"action": "segment_alloc", "addr": 0x2000_0000, "size": 64 * M, "stream": 7},
        {"action": "alloc", "addr": 0x2000_0000, "size": 64 * M, "stream": 7, "frames": permute,
         "user_metadata": "step 1"},
        {"action": "segment_alloc", "addr": 0x3000_0000, "size": 32 * M, "stream": 7},
        {"action": "alloc", "addr": 0x3000_0000, "size": 32 * M, "stream": 7, "frames": dist_init,
         "user_metadata": "step 2"},
        {"action": "free_requested", "addr": 0x3000_0000, "size": 32 * M, "stream": 7,
         "frames": dist_init},  # record_stream'd: completes later
        {"action": "alloc", "addr": 0x1000_0000 + 40 * M, "size": 50 * M, "stream": 0, "frames": mm,
         "user_metadata": "step 2"},
        {"action": "free_completed", "addr": 0x3000_0000, "size": 32 * M, "stream": 7},
        {"action": "free_requested", "addr": 0x2000_0000, "size": 64 * M, "stream": 7},
        {"action": "free_completed", "addr": 0x2000_0000, "size": 64 * M, "stream": 7},
    ]
    segments = [
        {"device": 0, "address": 0x1000_0000, "total_size": 100 * M, "stream": 0, "blocks": [
            {"address": 0x1000_0000, "size": 40 * M, "state": "active_allocated", "frames": mm},
            {"address": 0x1000_0000 + 40 * M, "size": 50 * M, "state": "active_allocated",
             "frames": mm},
            {"address": 0x1000_0000 + 90 * M, "size": 10 * M, "state": "inactive"}]},
        {"device": 0, "address": 0x2000_0000, "total_size": 64 * M, "stream": 7,
         "blocks": [{"address": 0x2000_0000, "size": 64 * M, "state": "inactive"}]},
        {"device": 0, "address": 0x3000_0000, "total_size": 32 * M, "stream": 7,
         "blocks": [{"address": 0x3000_0000, "size": 32 * M, "state": "inactive"}]},
        # a segment from before the window with a block live all along (no events)
        {"device": 0, "address": 0x6000_0000, "total_size": 4 * M, "stream": 0,
         "blocks": [{"address": 0x6000_0000, "size": 4 * M, "state": "active_allocated",
                     "frames": mm}]},
    ]
    return {"segments": segments, "device_traces": [trace]}


def self_test() -> None:
    """Checks :func:`breakdown` and friends on :func:`_synthetic_snapshot`; raises on failure."""
    s = _synthetic_snapshot()
    M = MIB
    allocs, n = allocations(s)
    assert n == 13 and len(allocs) == 6, (n, allocs)
    names = stream_names(s, allocs)
    assert names == {0: "main", 7: "data_dist?"}, names
    # allocated: 4 (all along) + 8 (before window, until event 2) -> at event 5: 4+40+64 = 108,
    # event 7: 140; event 8 frees 32 (requested) -> 108; event 9: +50 -> 158 = peak.
    p = peak(s, "allocated")
    assert (p.index, p.bytes) == (9, 158 * M), (p.index, p.bytes)
    rows = breakdown(s, "allocated")
    assert [(r.signature, r.stream, r.mib, r.count) for r in rows] == [
        ("model.py:6 forward", "main", 94.0, 3),
        ("torchrec/sparse/jagged_tensor.py:10 permute", "data_dist?", 64.0, 1),
    ], rows
    assert rows[0].steps == "1,2", rows[0]
    # active: the record_stream'd 32 MiB is still in the pool at event 9: 190.
    p = peak(s, "active")
    assert (p.index, p.bytes) == (9, 190 * M), (p.index, p.bytes)
    dist_init = "torchrec/sparse/jagged_tensor.py:30 dist_init"
    assert any(r.signature.startswith(dist_init) for r in p.rows)
    # reserved: 4 before the window, +100 +64 +32 -> 200 at event 6, for the alloc at event 7;
    # live then: 4+40+64+32 = 140.
    p = peak(s, "reserved")
    assert (p.index, p.bytes, p.live_bytes) == (7, 200 * M, 140 * M), p
    streams = per_stream(s)
    assert [(q.stream, q.bytes / M, q.index) for q in streams] == [
        ("main", 104.0, 1), ("data_dist?", 96.0, 7)], streams
    assert [(r.signature, r.mib) for r in streams[0].rows] == [("model.py:6 forward", 44.0), (
        "(before trace; freed at) model.py:6 forward", 8.0)], streams[0].rows
    assert [r.signature for r in streams[1].rows] == [
        "torchrec/sparse/jagged_tensor.py:10 permute", dist_init]
    # depth 2 and the recpipe path through a symlinked package folder
    assert signature(s["device_traces"][0][7]["frames"], depth=2) == (
        f"{dist_init} < recpipe/pipeline/sparse_dist.py:40 _wait_impl")
    # robustness: empty snapshot, no frames, ring-buffer window starting with frees
    assert breakdown({"segments": [], "device_traces": []}) == []
    assert breakdown({"segments": [], "device_traces": [[{"action": "free_completed", "addr": 1,
                                                          "size": 5, "stream": 0}]]},
                     at="active") == [Row("(before trace)", "default", 5, 1)]
    # growth: the three new segments in order, each with the allocation that needed it
    g = growth(s)
    assert [(x.index, x.stream, x.segment_bytes / M, x.alloc_bytes / M, x.cached_free / M)
            for x in g] == [(0, "main", 100.0, 40.0, 0.0), (4, "data_dist?", 64.0, 64.0, 0.0),
                            (6, "data_dist?", 32.0, 32.0, 0.0)], g
    assert g[2].signature == dist_init and g[2].metadata == "step 2", g[2]
    # at event 6 the 64 MiB segment is held whole by the permute; main's first segment (event
    # 0) found only the 4 MiB one from before the window, held by a block live all along
    assert [(x.largest_free / M, x.held) for x in g] == [
        (0.0, ""), (0.0, ""),
        (0.0, "64 MiB segment: 64.0 torchrec/sparse/jagged_tensor.py:10 permute")], g
    assert "| 0.0 | 64 MiB segment:" in growth_markdown(g)
    blocks = [Allocation(10, 20, 0, (), 0, 1, 1), Allocation(50, 10, 0, (), 0, 1, 1)]
    assert _free_gaps(_Segment(0, 100, 0, -1, 1), blocks) == 40  # 10, 20, then 60..100
    full_report(s)  # renders
    print("memory_snapshot self-test: ok")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


_EPILOG = """\
on the GPU machine (each run dumps after its last step, with <pickle>.md next to it):
    python3 scripts/bench_pipeline.py --config large --sharding table_wise,row_wise \\
        --pipelines torchrec,recpipe --repeats 1 --warmup 3 --steps 5 --snapshot $OUT/snap
then, anywhere (the analysis needs no torch):
    python3 scripts/memory_snapshot.py $OUT/snap/recpipe-rank0.pickle --per-stream --top 15
    python3 scripts/memory_snapshot.py $OUT/snap/recpipe-rank0.pickle --growth  # new segments
"""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", nargs="?", help="pickle from torch.cuda.memory._dump_snapshot")
    p.add_argument("--top", type=int, default=20, help="rows per table (default 20)")
    p.add_argument("--at", choices=("allocated", "active", "reserved"), default="allocated",
                   help="which peak: allocated (free_requested ends a block), active "
                        "(free_completed: record_stream'd blocks count until released), "
                        "reserved (segments)")
    p.add_argument("--per-stream", action="store_true",
                   help="one table per stream at its own pool's reserved peak")
    p.add_argument("--all", action="store_true", help="allocated + reserved + per stream")
    p.add_argument("--growth", action="store_true",
                   help="every new segment, the allocation that needed it, the pool's "
                        "cached free bytes and largest free gap then, and what was live in "
                        "the segments large enough for it")
    p.add_argument("--depth", type=int, default=1, help="package frames in each signature")
    p.add_argument("--packages", default=",".join(DEFAULT_PACKAGES),
                   help="frames of these packages name an allocation (innermost first)")
    p.add_argument("--device", type=int, default=None, help="device index (default: busiest)")
    p.add_argument("--self-test", action="store_true", help="run the built-in check and exit")
    a = p.parse_args(argv)
    if a.self_test:
        self_test()
        return 0
    if not a.snapshot:
        p.error("SNAPSHOT is required (or --self-test)")
    snapshot = load(a.snapshot)
    packages = tuple(x for x in a.packages.split(",") if x)
    if a.growth:
        print(growth_markdown(growth(snapshot, a.device, packages, a.depth)))
    elif a.all:
        print(full_report(snapshot, a.top, a.device, a.depth, packages))
    elif a.per_stream:
        streams = per_stream(snapshot, a.device, packages, a.depth)
        for q in streams:
            print(report_peak(q, a.top))
        if not streams:
            print("(no segments in this snapshot)")
    else:
        print(report_peak(peak(snapshot, a.at, None, a.device, packages, a.depth), a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
