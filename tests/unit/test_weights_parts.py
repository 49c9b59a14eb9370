"""Pure pieces of weight sync: bucketing, the P2P partition, the schema check, sender options."""

from __future__ import annotations

import pytest
import torch

from furlong.weights.base import buckets
from furlong.weights.factory import make_sender
from furlong.weights.p2p import gather_to, partition
from furlong.weights.report import SyncReport, WeightSyncError
from furlong.weights.schema import check_against


def named(*sizes: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes)]


def test_buckets_keep_order_and_bound_size():
    groups = buckets(named(10, 10, 30, 5, 5), bucket_bytes=80)  # float32: 40, 40, 120, 20, 20 bytes
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert buckets(named(1), bucket_bytes=1) == [named(1)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_partition_covers_every_tensor_once_and_balances(world_size):
    sizes = [5, 1, 9, 9, 2, 7, 3]
    owner = partition(sizes, world_size)
    assert len(owner) == len(sizes) and set(owner) == set(range(world_size))
    assert owner[sizes.index(9)] == 0  # rank 0 always owns something: it stamps the version
    loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(world_size)]
    assert max(loads) - min(loads) <= max(sizes)
    assert partition(sizes, world_size) == owner  # deterministic: ranks agree without talking


def test_partition_then_assembly_rebuilds_the_model():
    """Single-process stand-in for N ranks: the owned parts, put together, are exactly the model."""
    items = named(7, 3, 11, 2, 5)
    for i, (_, t) in enumerate(items):
        t.fill_(i)
    owner = partition([t.numel() * 4 for _, t in items], 3)
    parts = [[(n, gather_to(t, owner[k], r, 3)) for k, (n, t) in enumerate(items) if owner[k] == r] for r in range(3)]
    assembled = dict(p for part in parts for p in part)
    assert list(sorted(assembled)) == sorted(n for n, _ in items)
    assert all(torch.equal(assembled[n], t) for n, t in items)
    assert gather_to(items[0][1], owner=1, rank=0, world_size=3) is None


def test_schema_check_names_the_tensor():
    schema = {"a.weight": ((2, 3), "float32"), "ids": ((4,), "int64")}
    check_against(schema, [("a.weight", (2, 3), torch.bfloat16)], "u")  # floats cast on load
    with pytest.raises(WeightSyncError, match=r"'b\.weight': no such parameter"):
        check_against(schema, [("b.weight", (2, 3), torch.float32)], "u")
    with pytest.raises(WeightSyncError, match=r"'a\.weight': shape \[3, 2\]"):
        check_against(schema, [("a.weight", (3, 2), torch.float32)], "u")
    with pytest.raises(WeightSyncError, match="'ids': dtype"):
        check_against(schema, [("ids", (4,), torch.int32)], "u")
    check_against(None, [("anything", (1,), torch.float32)], "u")  # no schema: the engine decides


def test_make_sender_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="weights.transport"):
        make_sender("carrier-pigeon")
    with pytest.raises(ValueError, match="bucket_mb"):
        make_sender("shm", bucket_mb=0)
    with pytest.raises(ValueError, match="weights.transport=disk"):
        make_sender("disk")  # no directory
    with pytest.raises(ValueError, match="backend"):
        make_sender("broadcast", backend="mpi")
    with pytest.raises(ValueError, match="rank"):
        make_sender("p2p", rank=2, world_size=2)
    with pytest.raises(RuntimeError, match="connect"):
        make_sender("disk", directory=tmp_path).push(named(1), 1)


def test_push_rejects_malformed_input_before_sending():
    s = make_sender("shm")
    s.urls = ["http://127.0.0.1:9"]  # connected in appearance only: nothing may be sent
    with pytest.raises(WeightSyncError, match="given twice"):
        s.push([("a", torch.zeros(1)), ("a", torch.zeros(1))], 1)
    with pytest.raises(WeightSyncError, match=r"named_tensors\[0\]"):
        s.push([("a", [1.0])], 1)
    with pytest.raises(WeightSyncError, match="nothing to send"):
        s.push([], 1)
    with pytest.raises(ValueError, match="pause_mode"):
        s.push(named(1), 1, pause_mode="nap")


def test_report_rates_and_summary():
    r = SyncReport("shm", 3, bytes=2_000_000_000, seconds=2.0, buckets=4, tensors=10)
    assert r.gbps == 1.0 and r.ok and "1.00 GB/s" in r.summary()


@pytest.mark.parametrize("transport", ["shm", "delta", "broadcast", "disk"])
def test_non_zero_rank_only_drains_the_collective(transport, tmp_path):
    """Under FSDP every rank iterates the state dict; only rank 0 of a funnel transport talks to engines."""
    s = make_sender(transport, rank=1, world_size=2, run_dir=tmp_path)
    s.connect(["http://127.0.0.1:9"], "token")  # nothing listens there: an inactive rank must not call it
    drained = []
    report = s.push(((n, t) for n, t in named(3, 4) if not drained.append(n)), 5)
    assert drained == ["t0", "t1"] and report.engines == {} and report.version == 5
    s.close()


def test_package_exports_the_driver_entry_points(tmp_path):
    import furlong.weights.checksums  # noqa: F401  (a submodule must not shadow the function)
    from furlong.weights import make_sender as ms
    from furlong.weights import verify

    assert callable(verify) and verify.__name__ == "verify"
    assert ms("disk", run_dir=tmp_path).directory == tmp_path / "weights"
