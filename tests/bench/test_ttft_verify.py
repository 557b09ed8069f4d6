"""The TTFT benchmark's verdicts: a row counts only when the counters show the tier it claims."""

from __future__ import annotations

import pytest

from hpkv.bench.report import diff_interval, print_system, resolved
from hpkv.bench.verify import Expect, Row, System, verify_engine, verify_hpkv

E = Expect(prompts=2, chunks=4, tokens=1100, block_size=64)


def hp(**kw: int) -> dict[str, int]:
    d = dict.fromkeys(
        ("loaded_tokens", "stored_tokens", "memory_hits", "memory_promotions", "storage_hits",
         "page_cache_reads", "valkey_hits", "memory_bytes_read", "prefix_cache_hits",
         "external_prefix_cache_hits"),
        0,
    )  # fmt: skip
    d.update(kw)
    return d


def test_memory_row_served_by_the_engine_cache_is_invalid() -> None:
    # The prefix cache was not reset: vLLM served the prompts itself, hpkv's pool saw nothing.
    ok, proof = verify_hpkv("memory", hp(prefix_cache_hits=2 * 1088, loaded_tokens=2 * 12), E)
    assert not ok and "memory pool hits 0/8" in proof and "engine cache hits 2176" in proof
    # Even with every chunk counted, an engine-cache hit in the same row makes it invalid.
    assert not verify_hpkv("memory", hp(memory_hits=8, prefix_cache_hits=64), E)[0]
    assert verify_hpkv("memory", hp(memory_hits=8, loaded_tokens=2 * 1099), E)[0]


def test_memory_row_that_promoted_from_storage_is_invalid() -> None:
    assert not verify_hpkv("memory", hp(memory_hits=8, memory_promotions=3, storage_hits=3), E)[0]


def test_storage_rows() -> None:
    warm = hp(storage_hits=8, memory_promotions=8, memory_hits=8, page_cache_reads=8)
    assert verify_hpkv("storage", warm, E)[0]
    ok, proof = verify_hpkv("storage-cold", warm, E)
    assert not ok and "8 read from the page cache" in proof  # the cold row must not hit the page cache
    assert verify_hpkv("storage-cold", hp(storage_hits=8, memory_promotions=8, memory_hits=8), E)[0]
    assert not verify_hpkv("storage", hp(storage_hits=7, memory_promotions=7, memory_hits=8), E)[0]


def test_mixed_needs_both_tiers() -> None:
    e = Expect(2, 4, 1100, in_memory=2)
    assert verify_hpkv("mixed", hp(memory_hits=8, storage_hits=4, memory_promotions=4), e)[0]
    assert not verify_hpkv("mixed", hp(memory_hits=8, storage_hits=8, memory_promotions=8), e)[0]
    assert not verify_hpkv("mixed", hp(memory_hits=8), e)[0]


def test_valkey_row_needs_one_exists_and_one_get_per_chunk() -> None:
    assert verify_hpkv("valkey", hp(valkey_hits=8, keyspace_hits=16), E)[0]
    assert not verify_hpkv("valkey", hp(valkey_hits=8, keyspace_hits=8), E)[0]  # no lookup asked
    assert not verify_hpkv("valkey", hp(valkey_hits=8, keyspace_hits=24), E)[0]  # a second GET
    assert not verify_hpkv("valkey", hp(valkey_hits=8, storage_hits=1, keyspace_hits=16), E)[0]


def test_prefill_and_gpu_rows() -> None:
    assert verify_hpkv("prefill", hp(stored_tokens=2048), E)[0]
    assert not verify_hpkv("prefill", hp(stored_tokens=2048, loaded_tokens=256), E)[0]
    assert verify_hpkv("gpu", hp(prefix_cache_hits=2 * 1088, loaded_tokens=2 * 11), E)[0]
    assert not verify_hpkv("gpu", hp(prefix_cache_hits=0, memory_hits=8, loaded_tokens=2 * 1099), E)[0]


def test_peer_rows_from_vllm_counters() -> None:
    assert verify_engine("prefill", {"prefix_cache_hits": 0, "external_prefix_cache_hits": 0}, E)[0]
    assert verify_engine("gpu", {"prefix_cache_hits": 2 * 1088}, E)[0]
    hit = {"prefix_cache_hits": 0, "external_prefix_cache_hits": 2 * 1099}
    ok, proof = verify_engine("memory", hit, E, "LMCache's L1")
    assert ok and proof.endswith("; LMCache's L1")
    # Not reset: the engine's own cache served the memory row.
    assert not verify_engine("memory", {"prefix_cache_hits": 2 * 1088, "external_prefix_cache_hits": 0}, E)[0]
    # The connector supplied only part of each prompt.
    assert not verify_engine("storage", {"prefix_cache_hits": 0, "external_prefix_cache_hits": 2 * 512}, E)[0]
    assert not verify_engine("valkey", dict(hit, keyspace_hits=0), E)[0]
    assert verify_engine("valkey", dict(hit, keyspace_hits=8), E)[0]


def test_a_failed_start_is_reported_by_its_root_cause() -> None:
    from hpkv.bench.server import first_error as _first_error

    log = "\n".join(
        [
            "(APIServer pid=1) WARNING [system_utils.py:255] This can cause fd limit errors like "
            "`OSError: [Errno 24] Too many open files`",
            "Traceback (most recent call last):",
            "    raise RuntimeError(",
            "(EngineCore pid=2) ERROR 11-30 13:24:32 [core.py:1510] RuntimeError: Worker failed with error "
            "'CPU Offloading is currently only supported on CUDA-alike and XPU GPUs', please check",
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert _first_error(log).startswith("RuntimeError: Worker failed with error 'CPU Offloading")
    assert _first_error("no exception here") == "no exception here"


def _row(name: str, ttfts: list[float]) -> Row:
    return Row(name, ttfts, True, "proof")


def test_a_hit_row_within_the_gpu_rows_noise_claims_no_load_rate(capsys: pytest.CaptureFixture[str]) -> None:
    gpu = _row("gpu", [0.040, 0.041, 0.043, 0.045, 0.050, 0.042])
    close = _row("memory", [0.042, 0.044, 0.046, 0.048, 0.041, 0.047])  # median above, quartiles overlap
    far = _row("storage", [0.090, 0.095, 0.1, 0.11, 0.092, 0.094])
    assert not resolved(close, gpu) and resolved(far, gpu)
    x = System("hpkv", rows=[_row("prefill", [0.2] * 6), gpu, close, far])
    x.refs = {"memory": ("pinned H2D", 50.0), "storage": ("raw read", 1.0)}
    print_system(x, 448 << 20, False)
    out = capsys.readouterr().out
    memory = next(ln for ln in out.splitlines() if ln.startswith("memory"))
    storage = next(ln for ln in out.splitlines() if ln.startswith("storage"))
    assert "unresolved" in memory and "GB/s" not in memory
    assert "GB/s" in storage and "0.0900-0.1100" in storage  # the spread, min-max
    assert "x!" in storage and "above the reference" in out  # 8.9 GB/s over a 1 GB/s reference
    assert "95% interval" in out and "1/sqrt(prompts)" in out


def test_more_prompts_resolve_a_hit_the_gpu_rows_spread_hides() -> None:
    """A memory hit 9 ms above a GPU-hit row that varies by 30 ms (as on the H200): 8 samples of each
    cannot tell them apart, 100 can, though the two rows' spreads still overlap."""
    import random

    def rows(n: int) -> tuple[Row, Row]:
        r = random.Random(1)
        gpu = [0.045 + r.random() * 0.030 for _ in range(n)]
        return _row("memory", [0.054 + r.random() * 0.030 for _ in range(n)]), _row("gpu", gpu)

    assert not resolved(*rows(8))
    many = rows(100)
    assert resolved(*many)
    lo, hi = diff_interval(*many)
    assert 0 < lo < 0.009 < hi
    hit, gpu = many
    assert min(hit.ttfts) < max(gpu.ttfts)  # the spreads overlap all the same


def test_hpkv_layerwise_is_hpkv_with_its_own_setting() -> None:
    import argparse

    from hpkv.bench.serve import SYSTEMS as SERVE_SYSTEMS
    from hpkv.bench.ttft_run import SYSTEMS, VARIANT_ENV, Runner

    assert "hpkv-layerwise" in SYSTEMS
    assert set(VARIANT_ENV) <= set(SYSTEMS)
    assert {"hpkv-sync", "hpkv-async"} <= set(SERVE_SYSTEMS)
    assert VARIANT_ENV["hpkv-sync"] == {"HPKV_ASYNC_LOAD": "false"}  # the load mode before "auto"
    args = argparse.Namespace(url=None)
    hits = ["prefill", "gpu", "memory", "storage", "valkey"]
    lw = Runner(args, "hpkv-layerwise", None, [], E, [])
    none = Runner(args, "none", None, [], E, [])
    try:
        assert lw.hpkv and lw.plan(hits) == hits  # every tier row, proven by hpkv's counters
        assert not none.hpkv and none.plan(hits) == ["prefill", "gpu"]
    finally:
        import shutil

        for r in (lw, none):
            shutil.rmtree(r.shm, ignore_errors=True)
            shutil.rmtree(r.work, ignore_errors=True)


def _load_line(tokens: int, gbps: float, what: str) -> str:
    """One line in the format of worker._log_load, as the H200 logged it."""
    return (
        f"(EngineCore pid=1828) INFO 12-02 20:59:21 [hpkv] hpkv: Retrieved {tokens} out of {tokens} "
        f"required tokens (from 8192 total tokens). size: 0.4697 gb, cost 9.4983 ms, "
        f"throughput: {gbps} GB/s ({what})\n"
    )


LOG = (
    _load_line(63, 2.2355, "memory: 1 chunks")
    + _load_line(8191, 49.4516, "memory: 32 chunks")
    + _load_line(8191, 47.9389, "storage: 32 chunks; async, 41.0 ms from the lookup to now")
    + _load_line(
        8191,
        37.4028,
        "storage: 32 chunks; async, 9 parts, the last enqueued 23.5 ms after the lookup, its copies 2.1 ms; "
        "31.3 ms from the lookup to now",
    )
    + _load_line(8191, 34.0897, "memory: 32 chunks")
)


def test_load_rates_are_the_whole_loads_logged_after_an_offset(tmp_path) -> None:
    """The rates come from the worker's own line (the format of worker._log_load, as the H200 logged
    it): whole loads only (not the GPU-hit row's partial block), not async spans, after ``since``."""
    from hpkv.bench.server import Server

    log = tmp_path / "vllm.log"
    log.write_text(_load_line(8191, 52.0, "memory: 32 chunks"))
    since = log.stat().st_size
    with open(log, "a") as f:
        f.write(LOG)
    server = Server(model="m", port=1, env={}, log_path=str(log))
    assert server.load_rates(since, 4096) == [49.4516, 34.0897]
    assert server.load_rates(0, 4096) == [52.0, 49.4516, 34.0897]
    assert server.load_rates(since, 1) == [2.2355, 49.4516, 34.0897]


def test_copy_lines_set_each_hit_rows_loads_against_the_memory_reference(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpu = _row("gpu", [0.050, 0.055, 0.060])
    mem = Row("memory", [0.052, 0.056, 0.061], True, "proof", copies=[49.5, 50.0, 34.1, 49.0])
    sto = Row("storage", [0.08, 0.09, 0.085], True, "proof", copies=[48.0, 48.5])
    x = System("hpkv", rows=[_row("prefill", [0.2] * 3), gpu, mem, sto])
    x.refs = {"memory": ("pinned host-to-GPU copy", 55.0), "storage": ("raw read", 20.0)}
    print_system(x, 448 << 20, False)
    out = capsys.readouterr().out
    memory = next(ln for ln in out.splitlines() if ln.strip().startswith("memory") and "GB/s median" in ln)
    storage = next(ln for ln in out.splitlines() if ln.strip().startswith("storage") and "GB/s median" in ln)
    assert "49.25 GB/s median" in memory and "min 34.10" in memory and "4 loads" in memory
    assert "= 0.90x pinned host-to-GPU copy (55.00 GB/s)" in memory
    assert "48.25 GB/s median" in storage and "= 0.88x pinned host-to-GPU copy" in storage
    assert "the copy lines below" in out  # the memory row is unresolved and says where its rate is


def test_chunks_left_to_recompute_are_counted_out_of_a_hit_row() -> None:
    """A cost-aware hit loads only what beats recomputing: the row proves what it loaded plus what
    it left, never a load it did not make."""
    cold = hp(storage_hits=2, memory_promotions=2, memory_hits=2, left=6)
    ok, proof = verify_hpkv("storage-cold", cold, E)
    assert ok and "storage hits 2/8" in proof and "6 left to recompute" in proof
    assert not verify_hpkv("storage-cold", hp(storage_hits=2, memory_promotions=2, left=5), E)[0]
    every = hp(left=8, keyspace_hits=8)  # one EXISTS per chunk, no GET
    assert verify_hpkv("valkey", every, E)[0]
    assert not verify_hpkv("valkey", hp(left=8, keyspace_hits=16), E)[0]
    e = Expect(2, 4, 1100, in_memory=2)
    assert verify_hpkv("mixed", hp(memory_hits=4, left=4), e)[0]  # memory loaded, storage left
    # No prompt's whole load would pay for itself: nothing looked up, every chunk recomputed.
    ok, proof = verify_hpkv("memory", hp(not_worth=2), E)
    assert ok and "memory pool hits 0/8" in proof and "8 left to recompute" in proof
    assert not verify_hpkv("memory", hp(not_worth=1), E)[0]  # the other prompt's 4 chunks are unaccounted


def test_a_row_that_left_chunks_to_recompute_claims_no_load_rate(capsys: pytest.CaptureFixture[str]) -> None:
    gpu = _row("gpu", [0.060] * 6)
    cold = _row("storage-cold", [0.22, 0.23, 0.22, 0.30, 0.22, 0.22])
    cold.deltas = {"left": 352}
    x = System("hpkv", rows=[_row("prefill", [0.25] * 6), gpu, cold])
    x.refs = {"storage-cold": ("raw O_DIRECT read", 2.0)}
    print_system(x, 448 << 20, False)
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("storage-cold"))
    assert "recomputed" in line and "GB/s" not in line and "slower to read than to compute" in out
