"""Unit tests for ulfmtrain.data: the ulfmds format, converters, partition plans and LocalShard."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from ulfmtrain.data.format import MAGIC, RECORD_ALIGN, DatasetError, DatasetFile, dataset_paths
from ulfmtrain.data.plan import (
    RecoveryPlan,
    check_coverage,
    initial_holdings,
    merge_ranges,
    plan_recovery,
    ranges_len,
    split_ranges,
)
from ulfmtrain.data.shard import LocalShard
from ulfmtrain.data.sources import arrays_to_dataset, digits_to_dataset, records_for_bytes, synthetic_dataset
from ulfmtrain.data.writer import write_dataset, write_dataset_chunks

FIX = "python -m ulfmtrain data"


def _arrays(n: int = 37, seed: int = 0) -> dict[str, np.ndarray]:
    """Return a mixed-dtype set of per-field arrays with ``n`` records."""
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((n, 3, 5)).astype(np.float32),
        "y": rng.integers(0, 10, n).astype(np.int64),
        "flag": rng.integers(0, 2, n).astype(np.uint8),
        "w": rng.standard_normal((n, 2)).astype(">f8"),  # big-endian input is stored little-endian
    }


def _header(path: Path) -> dict:
    """Return the JSON header of a ulfmds file."""
    raw = path.read_bytes()
    (hlen,) = struct.unpack_from("<I", raw, 8)
    return json.loads(raw[12 : 12 + hlen])


@pytest.fixture
def ds_path(tmp_path: Path) -> Path:
    """Return a small dataset file written from :func:`_arrays`."""
    p = tmp_path / "d" / "train.ulfmds"
    write_dataset(p, _arrays(), meta={"source": "test", "classes": 10})
    return p


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """Assert two per-field dicts hold equal arrays."""
    assert set(a) == set(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# --------------------------------------------------------------------------- format


def test_layout_matches_documented_format(ds_path: Path) -> None:
    raw = ds_path.read_bytes()
    assert raw[:8] == MAGIC
    (hlen,) = struct.unpack_from("<I", raw, 8)
    hbytes = raw[12 : 12 + hlen]
    assert struct.unpack_from("<I", raw, 12 + hlen)[0] == zlib.crc32(hbytes)
    h = json.loads(hbytes)
    assert h["format"] == "ulfmds" and h["version"] == 1 and h["count"] == 37
    assert h["fields"][0] == {"name": "x", "dtype": "<f4", "shape": [3, 5]}
    assert h["fields"][1] == {"name": "y", "dtype": "<i8", "shape": []}
    assert h["fields"][3]["dtype"] == "<f8"
    assert h["record_size"] == 60 + 8 + 1 + 16
    assert h["crc_offset"] == 12 + hlen + 4
    assert h["data_offset"] % RECORD_ALIGN == 0 and h["data_offset"] >= h["crc_offset"] + 4 * 37
    assert len(raw) == h["data_offset"] + 37 * h["record_size"]
    assert h["meta"] == {"source": "test", "classes": 10}
    # Record 5 is the concatenation of its fields' little-endian bytes.
    a = _arrays()
    rec = raw[h["data_offset"] + 5 * h["record_size"] : h["data_offset"] + 6 * h["record_size"]]
    expect = a["x"][5].tobytes() + a["y"][5].tobytes() + a["flag"][5].tobytes() + a["w"][5].astype("<f8").tobytes()
    assert rec == expect
    assert struct.unpack_from("<I", raw, h["crc_offset"] + 4 * 5)[0] == zlib.crc32(rec)


def test_round_trip(ds_path: Path) -> None:
    a = _arrays()
    with DatasetFile(ds_path) as ds:
        assert ds.count == len(ds) == 37
        assert [f[0] for f in ds.fields] == ["x", "y", "flag", "w"]
        assert ds.meta["classes"] == 10
        got = ds.read(0, ds.count)
        _assert_same(got, a)
        assert got["w"].dtype == np.dtype("<f8")
        assert got["x"].flags.writeable


def test_sub_ranges_read_ranges_and_nbytes(ds_path: Path) -> None:
    a = _arrays()
    with DatasetFile(ds_path) as ds:
        _assert_same(ds.read(4, 11), {k: v[4:11] for k, v in a.items()})
        empty = ds.read(7, 7)
        assert empty["x"].shape == (0, 3, 5) and empty["y"].shape == (0,)
        ranges = [(30, 37), (0, 3), (10, 12), (12, 12)]
        idx = np.r_[30:37, 0:3, 10:12]
        _assert_same(ds.read_ranges(ranges), {k: v[idx] for k, v in a.items()})
        _assert_same(ds.read_ranges([(2, 9)]), {k: v[2:9] for k, v in a.items()})
        assert ds.read_ranges([])["y"].shape == (0,)
        assert ds.nbytes(ranges) == 12 * ds.record_size + 12 * 4
        before = ds.bytes_read
        ds.read_ranges(ranges)
        assert ds.bytes_read - before == ds.nbytes(ranges)
        with pytest.raises(ValueError):
            ds.read(30, 38)
        with pytest.raises(ValueError):
            ds.read(5, 4)
        assert isinstance(ds.drop_cache(), bool)
    with DatasetFile(ds_path, verify=False) as ds:
        before = ds.bytes_read
        ds.read(0, 10)
        assert ds.bytes_read - before == ds.nbytes([(0, 10)]) == 10 * ds.record_size


def test_empty_dataset(tmp_path: Path) -> None:
    p = tmp_path / "e.ulfmds"
    write_dataset(p, {"x": np.zeros((0, 4), np.float32)})
    with DatasetFile(p) as ds:
        assert ds.count == 0
        assert ds.read(0, 0)["x"].shape == (0, 4)


def test_chunked_write_equals_one_shot(tmp_path: Path) -> None:
    a = _arrays(50)
    one, chunked = tmp_path / "one.ulfmds", tmp_path / "chunked.ulfmds"
    write_dataset(one, a, meta={"k": 1})
    fields = [(k, v.dtype, v.shape[1:]) for k, v in a.items()]
    bounds = [0, 1, 17, 17, 40, 50]
    chunks = ({k: v[lo:hi] for k, v in a.items()} for lo, hi in zip(bounds, bounds[1:]))
    write_dataset_chunks(chunked, fields, 50, chunks, meta={"k": 1})
    assert one.read_bytes() == chunked.read_bytes()


def test_chunked_write_count_mismatch(tmp_path: Path) -> None:
    p = tmp_path / "c.ulfmds"
    fields = [("x", np.float32, (2,))]
    with pytest.raises(DatasetError, match="expected 5"):
        write_dataset_chunks(p, fields, 5, [{"x": np.zeros((3, 2))}])
    with pytest.raises(DatasetError, match="more than"):
        write_dataset_chunks(p, fields, 2, [{"x": np.zeros((3, 2))}])
    with pytest.raises(DatasetError, match="shape"):
        write_dataset_chunks(p, fields, 3, [{"x": np.zeros((3, 4))}])
    with pytest.raises(DatasetError, match="fields"):
        write_dataset_chunks(p, fields, 3, [{"z": np.zeros((3, 2))}])
    assert not p.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary files left behind


# --------------------------------------------------------------------------- converters


def test_digits_converter(tmp_path: Path) -> None:
    train, test = digits_to_dataset(tmp_path / "digits", test_fraction=0.2, seed=0)
    assert train.name == "train.ulfmds" and test.name == "test.ulfmds"
    with DatasetFile(train) as tr, DatasetFile(test) as te:
        assert tr.count + te.count == 1797
        assert te.count == pytest.approx(0.2 * 1797, abs=1)
        assert tr.meta["source"] == "sklearn.load_digits" and tr.meta["classes"] == 10
        a, b = tr.read(0, tr.count), te.read(0, te.count)
    for d in (a, b):
        assert d["x"].shape[1:] == (1, 8, 8) and d["x"].dtype == np.float32
        assert d["y"].dtype == np.int64
        assert d["x"].min() >= 0.0 and d["x"].max() <= 1.0
    assert a["x"].max() == 1.0
    # Stratified: every class's share is the same in both splits, within one sample.
    ca, cb = np.bincount(a["y"], minlength=10), np.bincount(b["y"], minlength=10)
    assert np.all(cb > 0)
    assert np.all(np.abs(cb - (ca + cb) * 0.2) <= 1)
    # Shuffled: the train labels are not in the sklearn order.
    from sklearn.datasets import load_digits

    assert not np.array_equal(a["y"][:50], load_digits().target[:50])
    # Deterministic for a seed.
    train2, _ = digits_to_dataset(tmp_path / "again", seed=0)
    assert train.read_bytes() == train2.read_bytes()


def test_arrays_to_dataset(tmp_path: Path) -> None:
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    y = np.array([0, 1, 2, 0, 1, 2], dtype=np.int64)
    train, test = arrays_to_dataset(tmp_path, x, y)
    assert test is None
    with DatasetFile(train) as ds:
        _assert_same(ds.read(0, 6), {"x": x, "y": y})
        assert ds.meta["classes"] == 3
    train, test = arrays_to_dataset(tmp_path, x, y, x[:2], y[:2], meta={"classes": 7})
    assert test is not None
    with DatasetFile(test) as ds:
        _assert_same(ds.read(0, 2), {"x": x[:2], "y": y[:2]})
        assert ds.meta["classes"] == 7
    with pytest.raises(ValueError):
        arrays_to_dataset(tmp_path, x, y, x_test=x)


def test_synthetic_count_and_learnable(tmp_path: Path) -> None:
    p = synthetic_dataset(tmp_path / "syn.ulfmds", records=3000, features=32, classes=4, seed=3, chunk_records=700)
    with DatasetFile(p) as ds:
        assert ds.count == 3000
        assert ds.meta["classes"] == 4
        d = ds.read(0, ds.count)
    x, y = d["x"], d["y"]
    assert x.shape == (3000, 32) and x.dtype == np.float32 and y.dtype == np.int64
    assert set(np.unique(y)) == {0, 1, 2, 3}
    means = np.stack([x[y == c].mean(axis=0) for c in range(4)])
    # Class means are far apart compared with their estimation noise ...
    dist = np.linalg.norm(means[:, None] - means[None], axis=-1)
    assert dist[~np.eye(4, dtype=bool)].min() > 2.0
    # ... so a nearest-class-mean classifier fitted on half beats chance by far on the other half.
    fit = np.stack([x[:1500][y[:1500] == c].mean(axis=0) for c in range(4)])
    pred = np.argmin(((x[1500:, None] - fit[None]) ** 2).sum(-1), axis=1)
    assert (pred == y[1500:]).mean() > 0.9


def test_synthetic_independent_of_chunking(tmp_path: Path) -> None:
    a = synthetic_dataset(tmp_path / "a.ulfmds", records=2500, features=8, seed=1, chunk_records=2500)
    b = synthetic_dataset(tmp_path / "b.ulfmds", records=2500, features=8, seed=1, chunk_records=333)
    c = synthetic_dataset(tmp_path / "c.ulfmds", records=2500, features=8, seed=2, chunk_records=333)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_records_for_bytes() -> None:
    assert records_for_bytes(4096 * 100, features=1024) == 100
    assert records_for_bytes(4096 * 100 + 1, features=1024) == 101
    assert records_for_bytes(0) == 0
    assert records_for_bytes(1 << 30) * 1024 * 4 == 1 << 30


# --------------------------------------------------------------------------- bad input


def _expect_error(path: Path, word: str) -> DatasetError:
    """Open ``path`` and assert a one-line DatasetError naming ``word`` and the fix."""
    with pytest.raises(DatasetError) as info:
        with DatasetFile(path) as ds:
            ds.read(0, ds.count)
    msg = str(info.value)
    assert "\n" not in msg
    assert word in msg
    assert FIX in msg
    assert str(path) in msg
    return info.value


def test_missing_file(tmp_path: Path) -> None:
    _expect_error(tmp_path / "nope" / "train.ulfmds", "missing")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    _expect_error(tmp_path, "directory")


def test_dataset_paths_finds_train_and_optional_test(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=rf"^dataset directory '{tmp_path}' has no train.ulfmds: "
                                           rf"create it with `{FIX} digits {tmp_path}`$"):
        dataset_paths(tmp_path)
    train, _ = arrays_to_dataset(tmp_path, np.zeros((4, 2), np.float32), np.arange(4))
    assert dataset_paths(tmp_path) == (train, None)
    train, test = arrays_to_dataset(tmp_path, np.zeros((4, 2), np.float32), np.arange(4),
                                    np.zeros((2, 2), np.float32), np.arange(2))
    assert dataset_paths(tmp_path) == (train, test)


def test_bad_magic(ds_path: Path) -> None:
    raw = bytearray(ds_path.read_bytes())
    raw[:8] = b"NOTULFM!"
    ds_path.write_bytes(bytes(raw))
    _expect_error(ds_path, "magic")


def test_tiny_file_is_bad_magic(tmp_path: Path) -> None:
    p = tmp_path / "tiny.ulfmds"
    p.write_bytes(b"ULF")
    _expect_error(p, "magic")


@pytest.mark.parametrize("where", [0, 5, -1])
def test_corrupted_header_byte(ds_path: Path, where: int) -> None:
    raw = bytearray(ds_path.read_bytes())
    (hlen,) = struct.unpack_from("<I", raw, 8)
    pos = 12 + (where % hlen)
    raw[pos] ^= 0x20
    ds_path.write_bytes(bytes(raw))
    _expect_error(ds_path, "header")


def test_header_with_valid_crc_but_bad_json(ds_path: Path) -> None:
    raw = bytearray(ds_path.read_bytes())
    (hlen,) = struct.unpack_from("<I", raw, 8)
    bad = b"{" * hlen
    raw[12 : 12 + hlen] = bad
    struct.pack_into("<I", raw, 12 + hlen, zlib.crc32(bad))
    ds_path.write_bytes(bytes(raw))
    _expect_error(ds_path, "header")


@pytest.mark.parametrize("keep", [1000, -1, 20])
def test_truncated_file(ds_path: Path, keep: int) -> None:
    raw = ds_path.read_bytes()
    ds_path.write_bytes(raw[:keep])
    err = _expect_error(ds_path, "truncated")
    if keep == 1000:
        assert f"expected {len(raw)} bytes, found 1000" in str(err)


def test_flipped_record_byte_names_record(ds_path: Path) -> None:
    h = _header(ds_path)
    raw = bytearray(ds_path.read_bytes())
    raw[h["data_offset"] + 23 * h["record_size"] + 7] ^= 0x01
    ds_path.write_bytes(bytes(raw))
    err = _expect_error(ds_path, "record 23")
    assert "checksum" in str(err)
    # Ranges not touching the bad record still read fine; verify=False skips the check.
    with DatasetFile(ds_path) as ds:
        ds.read(0, 23)
        ds.read(24, 37)
        with pytest.raises(DatasetError, match="record 23"):
            ds.read_ranges([(0, 2), (20, 30)])
    with DatasetFile(ds_path, verify=False) as ds:
        ds.read(0, 37)


def test_failing_writer_leaves_old_file_intact(ds_path: Path) -> None:
    before = ds_path.read_bytes()
    with pytest.raises(DatasetError, match="mismatched lengths"):
        write_dataset(ds_path, {"x": np.zeros((5, 2)), "y": np.zeros(4)})

    def broken_chunks():
        yield {"x": np.zeros((2, 2), np.float32)}
        raise RuntimeError("generator died")

    with pytest.raises(RuntimeError):
        write_dataset_chunks(ds_path, [("x", np.float32, (2,))], 4, broken_chunks())
    assert ds_path.read_bytes() == before
    assert sorted(p.name for p in ds_path.parent.iterdir()) == [ds_path.name]
    with DatasetFile(ds_path) as ds:
        _assert_same(ds.read(0, ds.count), _arrays())


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    p = tmp_path / "w.ulfmds"
    with pytest.raises(DatasetError):
        write_dataset(p, {})
    with pytest.raises(DatasetError):
        write_dataset(p, {"x": np.float32(1.0)})
    with pytest.raises(DatasetError):
        write_dataset(p, {"x": np.array([object()] * 3)})
    with pytest.raises(DatasetError, match="JSON"):
        write_dataset(p, {"x": np.zeros(3)}, meta={"bad": object()})
    with pytest.raises(DatasetError):
        write_dataset_chunks(p, [("x", np.float32, ()), ("x", np.int64, ())], 0, [])
    assert not p.exists()


# --------------------------------------------------------------------------- plans


def test_merge_split_len() -> None:
    assert merge_ranges([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4), (10, 11)]) == [(0, 3), (5, 9), (10, 11)]
    assert merge_ranges([]) == []
    assert ranges_len([(0, 3), (5, 9)]) == 7
    assert split_ranges([(0, 3), (10, 14)], 3) == [[(0, 2)], [(2, 3), (10, 11)], [(11, 14)]]
    assert split_ranges([(0, 2)], 4) == [[], [(0, 1)], [], [(1, 2)]]
    assert split_ranges([], 2) == [[], []]
    with pytest.raises(ValueError):
        split_ranges([(0, 2)], 0)
    with pytest.raises(ValueError):
        merge_ranges([(3, 1)])


@pytest.mark.parametrize("seed", range(20))
def test_split_ranges_random(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(1000, size=2 * int(rng.integers(1, 8)), replace=False))
    ranges = [(int(a), int(b)) for a, b in cuts.reshape(-1, 2)]
    parts = int(rng.integers(1, 9))
    out = split_ranges(ranges, parts)
    total = ranges_len(ranges)
    assert len(out) == parts
    flat = [i for piece in out for a, b in piece for i in range(a, b)]
    assert flat == [i for a, b in ranges for i in range(a, b)]
    assert [ranges_len(p) for p in out] == [total * (i + 1) // parts - total * i // parts for i in range(parts)]


@pytest.mark.parametrize("count,world", [(0, 1), (1, 4), (10, 3), (1797, 4), (1000, 7)])
def test_initial_holdings_cover(count: int, world: int) -> None:
    h = initial_holdings(count, world)
    assert sorted(h) == list(range(world))
    check_coverage(h, count)
    sizes = [ranges_len(r) for r in h.values()]
    assert max(sizes) - min(sizes) <= 1


def test_check_coverage_errors() -> None:
    with pytest.raises(ValueError, match=r"\[3, 4\).*no rank"):
        check_coverage({0: [(0, 3)], 1: [(4, 10)]}, 10)
    with pytest.raises(ValueError, match=r"\[8, 10\).*no rank"):
        check_coverage({0: [(0, 8)]}, 10)
    with pytest.raises(ValueError, match=r"\[4, 5\).*twice.*ranks 0 and 1"):
        check_coverage({0: [(0, 5)], 1: [(4, 10)]}, 10)
    with pytest.raises(ValueError, match="past the end"):
        check_coverage({0: [(0, 12)]}, 10)
    check_coverage({0: [(0, 2), (7, 10)], 1: [(2, 7)]}, 10)


def _check_plan(old: dict, dead: set[int], plan: RecoveryPlan, count: int) -> None:
    """Assert the invariants every recovery plan must satisfy."""
    survivors = sorted(set(old) - dead)
    assert sorted(plan.holdings) == sorted(plan.reads) == survivors
    check_coverage(plan.holdings, count)
    lost = merge_ranges(r for d in dead for r in old[d])
    assert plan.lost == lost
    for s in survivors:
        held = {i for a, b in plan.holdings[s] for i in range(a, b)}
        assert {i for a, b in old[s] for i in range(a, b)} <= held  # survivors keep their records
        assert plan.holdings[s] == merge_ranges(plan.holdings[s])
    if plan.mode == "partial":
        sizes = [ranges_len(plan.reads[s]) for s in survivors]
        assert sum(sizes) == ranges_len(lost)
        assert max(sizes) - min(sizes) <= 1
        assert merge_ranges(r for s in survivors for r in plan.reads[s]) == lost
        for s in survivors:
            assert merge_ranges(old[s] + plan.reads[s]) == plan.holdings[s]
    else:
        for s in survivors:
            assert plan.reads[s] == plan.holdings[s]


@pytest.mark.parametrize("mode", ["partial", "full"])
@pytest.mark.parametrize("dead", [{1}, {3}, {0}, {1, 2}, {0, 3}, {0, 1, 2}])
def test_plan_recovery_of_four(mode: str, dead: set[int]) -> None:
    old = initial_holdings(1797, 4)
    plan = plan_recovery(old, dead, mode)
    assert plan.mode == mode
    _check_plan(old, dead, plan, 1797)


def test_plan_recovery_shares_go_in_rank_order() -> None:
    plan = plan_recovery(initial_holdings(100, 4), [1])
    # Lost [25, 50) is split contiguously: rank 0 gets the first 8, rank 2 the next 8, rank 3 the last 9.
    assert plan.reads == {0: [(25, 33)], 2: [(33, 41)], 3: [(41, 50)]}
    assert plan.holdings == {0: [(0, 33)], 2: [(33, 41), (50, 75)], 3: [(41, 50), (75, 100)]}
    assert plan.lost == [(25, 50)]


@pytest.mark.parametrize("mode", ["partial", "full"])
@pytest.mark.parametrize("seed", range(12))
def test_repeated_failures_down_to_one(mode: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    world = int(rng.integers(2, 9))
    count = int(rng.integers(0, 500))
    holdings = initial_holdings(count, world)
    while len(holdings) > 1:
        k = int(rng.integers(1, len(holdings)))
        dead = {int(d) for d in rng.choice(sorted(holdings), size=k, replace=False)}
        plan = plan_recovery(holdings, dead, mode)
        _check_plan(holdings, dead, plan, count)
        holdings = plan.holdings
    assert list(holdings.values()) == [[(0, count)] if count else []]


def test_plan_recovery_errors() -> None:
    h = initial_holdings(10, 2)
    with pytest.raises(ValueError, match="mode"):
        plan_recovery(h, [1], "bogus")
    with pytest.raises(ValueError, match="survivors"):
        plan_recovery(h, [0, 1])
    with pytest.raises(ValueError, match="not in the holdings"):
        plan_recovery(h, [5])
    plan = plan_recovery(h, [])
    assert plan.holdings == h and plan.lost == [] and plan.reads == {0: [], 1: []}


# --------------------------------------------------------------------------- LocalShard


@pytest.fixture
def digits_ds(tmp_path: Path):
    """Yield an open verified digits training set."""
    train, _ = digits_to_dataset(tmp_path / "digits")
    with DatasetFile(train) as ds:
        yield ds


def _assert_shard_fresh(shard: LocalShard, ds: DatasetFile) -> None:
    """Assert the shard holds exactly its holdings, in its index order, and gathers batches from them."""
    assert shard.holdings == merge_ranges(shard.holdings) == merge_ranges(shard.order)
    fresh = ds.read_ranges(shard.order)
    _assert_same(shard.arrays, fresh)
    assert len(shard) == len(next(iter(fresh.values())))
    for arr in shard.arrays.values():
        assert arr.flags.c_contiguous
    idx = np.random.default_rng(len(shard)).integers(0, len(shard), size=min(len(shard), 40))
    _assert_same(shard.take(idx), {k: v[idx] for k, v in fresh.items()})


@pytest.mark.parametrize("mode", ["partial", "full"])
def test_local_shard_apply(digits_ds: DatasetFile, mode: str) -> None:
    ds = digits_ds
    holdings = initial_holdings(ds.count, 4)
    shards = {r: LocalShard(ds, h) for r, h in holdings.items()}
    for shard in shards.values():
        _assert_shard_fresh(shard, ds)
    for dead in ([1], [3], [0]):
        plan = plan_recovery(holdings, dead, mode)
        for d in dead:
            del shards[d]
        for r, shard in shards.items():
            got, seconds = shard.apply(plan, r)
            assert got == ds.nbytes(plan.reads[r])
            assert seconds >= 0.0
            assert shard.holdings == plan.holdings[r]
            _assert_shard_fresh(shard, ds)
        holdings = plan.holdings
    (last,) = shards.values()
    assert len(last) == ds.count


@pytest.mark.parametrize("seed", range(6))
def test_local_shard_random_failures(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = tmp_path / "r.ulfmds"
    n = int(rng.integers(1, 300))
    write_dataset(p, {"v": np.arange(n, dtype=np.int32), "z": rng.standard_normal((n, 3))})
    with DatasetFile(p) as ds:
        holdings = initial_holdings(n, int(rng.integers(2, 7)))
        shards = {r: LocalShard(ds, h) for r, h in holdings.items()}
        while len(shards) > 1:
            dead = {int(d) for d in rng.choice(sorted(shards), size=int(rng.integers(1, len(shards))), replace=False)}
            plan = plan_recovery(holdings, dead, str(rng.choice(["partial", "full"])))
            shards = {r: s for r, s in shards.items() if r not in dead}
            for r, s in shards.items():
                assert s.apply(plan, r)[0] == ds.nbytes(plan.reads[r])
                _assert_shard_fresh(s, ds)
                np.testing.assert_array_equal(s.arrays["v"], [i for a, b in s.order for i in range(a, b)])
            holdings = plan.holdings


def test_local_shard_rejects_foreign_plan(digits_ds: DatasetFile) -> None:
    holdings = initial_holdings(digits_ds.count, 4)
    shard = LocalShard(digits_ds, holdings[2])
    plan = plan_recovery(holdings, [1])
    with pytest.raises(ValueError):
        shard.apply(plan, 1)  # rank 1 is dead
    with pytest.raises(ValueError):
        shard.apply(plan, 0)  # plan for rank 0 was not made from rank 2's records


def test_index_of_maps_record_ids_whatever_the_storage_order(digits_ds: DatasetFile) -> None:
    """A partial reload appends a segment, a full one re-reads in order: the same ids give the same records."""
    part = LocalShard(digits_ds, [(200, 250)])
    plan = plan_recovery({0: [(200, 250)], 1: [(0, 100)]}, [1], mode="partial")
    part.apply(plan, 0)
    full = LocalShard(digits_ds, [(0, 100), (200, 250)])
    ids = np.array([249, 0, 99, 200, 5])
    assert not np.array_equal(part.index_of(ids), full.index_of(ids))       # stored differently...
    for k in ("x", "y"):                                                     # ...the same records
        np.testing.assert_array_equal(part.take(part.index_of(ids))[k], full.take(full.index_of(ids))[k])
    np.testing.assert_array_equal(part.take(part.index_of(ids))["y"], digits_ds.read(0, 1437)["y"][ids])
    with pytest.raises(ValueError, match="not in this shard"):
        part.index_of(np.array([150]))
