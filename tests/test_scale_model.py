"""scripts/scale_model.py, the scaling model on paper: its all-to-all, memory and overlap rules on
the tiny config's plans, and the CLI end to end (tiny sweep; the validation points are the
real configs' small plans)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recpipe.bench import scale_model as sm

TINY = sm.CONFIGS["tiny"]
TW_CW, TW_RW = ("table_wise", "column_wise"), ("table_wise", "row_wise")


@pytest.fixture(scope="module", autouse=True)
def quiet() -> None:
    sm._quiet_planner()


def _pooled(p: sm.Plan) -> list[tuple[int, float]]:
    return [(s.rank, s.pooled_bytes) for s in p.shards]


def test_one_node_has_no_inter_node_traffic() -> None:
    p = sm.plan(TINY, TW_CW, 8, sm.Links())
    per_rank = sm.link_bytes(_pooled(p), 8, 8)
    assert all(inter == 0 for _, inter in per_rank)
    assert all(intra > 0 for intra, _ in per_rank)  # every rank's batch takes others' embeddings
    slow_nic = sm.Links(inter_gb_s=0.001)
    assert sm.all_to_all_ms(_pooled(p), 8, slow_nic) == sm.all_to_all_ms(_pooled(p), 8, sm.Links())


def test_more_nodes_and_a_slower_nic_never_predict_less_all_to_all() -> None:
    links = [sm.Links(inter_gb_s=bw) for bw in (50.0, 25.0, 12.5)]
    times = [[sm.all_to_all_ms(_pooled(sm.plan(TINY, TW_CW, w, sm.Links())), w, lk) for lk in links]
             for w in (8, 16, 32, 64)]
    for row in times:
        assert row == sorted(row)  # slower NIC, same plan
    for col in zip(*times):
        assert list(col) == sorted(col)  # more nodes, same NIC
    assert times[-1][-1] > times[0][0]


def test_embedding_storage_per_rank_shrinks_and_sums_to_the_tables() -> None:
    largest = []
    for w in (1, 2, 4, 8):
        p = sm.plan(TINY, TW_CW, w, sm.Links())
        per_rank = p.per_rank("weight_bytes")
        assert sum(per_rank) == p.table_bytes == 12 * 1000 * 16 * 4
        largest.append(max(per_rank))
    assert largest == sorted(largest, reverse=True) and largest[-1] < largest[0]


def test_row_wise_ids_follow_the_zipf_law() -> None:
    """A row-wise table's ids split over its row blocks by the Zipf law of the synthetic ids:
    the shares add up to all of them and the first block gets most."""
    p2, p1 = sm.plan(TINY, TW_RW, 2, sm.Links()), sm.plan(TINY, TW_RW, 1, sm.Links())
    ids2, ids1 = p2.per_rank("ids_bytes"), p1.per_rank("ids_bytes")
    assert sum(ids2) == pytest.approx(2 * ids1[0])  # two ranks' batches, looked up once
    assert ids2[0] > 1.2 * ids2[1]


@pytest.mark.parametrize(("host_ms", "ids_ms", "overlap", "want_ms", "exposed_ms"), [
    (10.0, 1.0, 1.0, 10.0, 0.0),     # hidden in the link time the step leaves free
    (10.0, 1.0, 0.0, 10.0, 1.0),     # on the device's critical path, under the host's time
    (2.0, 1.0, 0.0, 7.0, 1.0),       # device-bound: 5 compute + 1 pooled + 1 ids
    (2.0, 1.0, 1.0, 6.0, 0.0),
    (10.0, 100.0, 1.0, 101.0, 91.0),  # 9 ms of free link time, the rest exposed
])
def test_input_dist_is_exposed_past_the_free_link_time(
        host_ms: float, ids_ms: float, overlap: float, want_ms: float, exposed_ms: float) -> None:
    """2 ranks, one shard each, NVLink at 450 x 0.75 GB/s: a shard's bytes b take b/2 / 337.5e6
    ms each way; the device does half of the 1-GPU kernel time (10 ms)."""
    bw = 337.5e6
    shards = tuple(sm.Shard(r, 0, 0, ids_ms * 2 * bw, 0.5 * 2 * bw, 1.0) for r in range(2))
    one_gpu = sm.Plan(1, (sm.Shard(0, 0, 0, 0.0, 0.0, 2.0),), 0.0, 0.0, 0)
    s = sm.step(sm.Plan(2, shards, 0.0, 0.0, 0), one_gpu, sm.Compute(host_ms, 10.0, ""), 0.0,
                sm.Links(), sm.Pipeline(input_overlap=overlap))
    assert (s.compute, s.pooled_a2a, s.ids_a2a) == pytest.approx((5.0, 1.0, ids_ms))
    assert (s.ms, s.ids_exposed) == pytest.approx((want_ms, exposed_ms))


def test_cli_writes_the_table_and_the_plot(tmp_path: Path) -> None:
    md, png = tmp_path / "m.md", tmp_path / "m.png"
    sm.main(["--model=tiny", "--step-ms=5", "--gpus=1", "--nodes=1,2", f"--out-md={md}",
             f"--out-png={png}"])
    text = md.read_text()
    assert "scale_model.py --model=tiny --step-ms=5" in text
    rows = [r for r in text.splitlines() if r.startswith("| 16 | 2 |")]
    assert len(rows) == 1 and "| no |" in rows[0]  # 2 nodes: not validated
    assert "| small TW/RW, 2 GPUs | ms/iter | 14.3 |" in text
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 10_000
