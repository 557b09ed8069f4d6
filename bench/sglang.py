"""``python -m bench.sglang``: hpkv under SGLang's HiCacheController next to SGLang's own ``file`` backend.

Both backends are built by SGLang's factory from the flags a user passes and driven by SGLang's
controller threads (backup: ``write_storage``; prefetch: ``batch_exists`` then the page reads into
the host pool), on CPU: the controller and host pools are SGLang's, no server runs. Per round, with fresh
pages, in alternating order: backup N pages (hpkv: until its write-behind is on disk, as the file
backend writes synchronously), restart the controller, prefetch them with the files in the page
cache (after a sync, so no write-back runs under it), then again after dropping them from it. Both
write into the same directory. The reference, measured in the same rounds: a raw read of hpkv's
files of the same pages, 4 threads (hpkv's storage I/O threads), buffered from the page cache and
with O_DIRECT after dropping it.

``--spin``: a thread spins in Python beside the controller for the whole run, as SGLang's scheduler
thread polls without sleeping on a GPU server: every hand-over of Python's GIL then waits for it.

Run it in the SGLang environment: ``make bench-sglang`` (``.venv-sglang/bin/python -m bench.sglang``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time
from typing import Any

import torch

from hpkv.bench.refs import drop_page_cache, raw_read_gbps

SYSTEMS = ("hpkv", "file")
OPS = ("backup", "prefetch (page cache)", "prefetch (dropped)")


def _extra(system: str, directory: str, shm: str) -> tuple[str, dict[str, Any]]:
    from tests.sglang import rig

    if system == "hpkv":
        return "dynamic", rig.hpkv_extra({"kv_storage_path": directory, "share_mem_file_path": shm})
    return "file", {"file_storage_path": directory}


def one_round(args: argparse.Namespace, system: str, seed: int, shm: str) -> dict[str, float]:
    from tests.sglang import rig

    backend, extra = _extra(system, args.dir, shm)
    kw: dict[str, Any] = {
        "page": args.page_size,
        "shape": (args.layers, args.heads, args.dim),
        "device_tokens": args.pages * args.page_size,
        "model": "bench/7b-shaped",
        "host_ratio": 2,
    }
    toks = rig.tokens(args.pages, seed, page=args.page_size)
    r = rig.rig(backend, extra, **kw)
    try:
        idx, pages = rig.fill_host(r, args.pages, seed + 1)
        t0 = time.perf_counter()
        done = rig.backup(r, toks, idx)
        if system == "hpkv":
            r.backend.flush()
        backup = time.perf_counter() - t0
        if done != args.pages * args.page_size:
            raise RuntimeError(f"{system}: backup wrote {done} of {args.pages * args.page_size} tokens")
    finally:
        r.close()
    out = {"backup": backup}
    os.sync()  # both systems: the kernel's write-back of the new files done before any read is timed
    for op, drop in (("prefetch (page cache)", False), ("prefetch (dropped)", True)):
        if drop:
            drop_page_cache(args.dir)
        r = rig.rig(backend, extra, **kw)  # a restart: only the directory is shared
        try:
            t0 = time.perf_counter()
            got = rig.prefetch(r, toks)
            out[op] = time.perf_counter() - t0
            if got.loaded_tokens != args.pages * args.page_size or got.host_indices is None:
                raise RuntimeError(f"{system}: {op} loaded {got.loaded_tokens} tokens")
            for i in (0, args.pages - 1):  # the bytes: first and last page
                if not torch.equal(rig.page_bytes(r, got.host_indices, i), pages[i]):
                    raise RuntimeError(f"{system}: {op} page {i} differs from what was backed up")
        finally:
            r.close()
    return out


def _spin(stop: threading.Event) -> None:
    """Python bytecode without a pause (SGLang's scheduler loop, polling): it holds the GIL for
    whole switch intervals."""
    n = 0
    while not stop.is_set():
        n += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sglang", description=__doc__)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64, help="SGLang's --page-size (tokens)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=4, help="KV heads (Qwen2-7B: 28 layers, 4 x 128)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default="out/bench-sglang/storage", help="the storage directory both use")
    ap.add_argument("--out", default="out/bench-sglang")
    ap.add_argument("--spin", action="store_true", help="a Python thread spinning beside the controller")
    args = ap.parse_args(argv)
    stop = threading.Event()
    if args.spin:
        threading.Thread(target=_spin, args=(stop,), daemon=True, name="spin").start()
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    shm = f"/dev/shm/hpkv-bench-sglang-{os.getpid()}"
    page_bytes = 2 * args.layers * args.page_size * args.heads * args.dim * 2
    total = args.pages * page_bytes
    res: dict[str, dict[str, list[float]]] = {s: {op: [] for op in OPS} for s in SYSTEMS}
    raw: dict[str, list[float]] = {"page cache": [], "dropped": []}
    try:
        for rnd in range(args.rounds):
            order = SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1]
            for s in order:
                for op, t in one_round(args, s, 1000 * rnd + (0 if s == "hpkv" else 500), shm).items():
                    res[s][op].append(t)
            hpkv_files = os.path.join(args.dir, "v1")
            raw["page cache"].append(raw_read_gbps(hpkv_files, args.pages, 4, cold=False, repeat=1))
            raw["dropped"].append(raw_read_gbps(hpkv_files, args.pages, 4, cold=True, repeat=1))
            print(
                f"round {rnd}: "
                + "  ".join(f"{s} {' / '.join(f'{res[s][op][-1]:.3f}' for op in OPS)} s" for s in order),
                flush=True,
            )
    finally:
        stop.set()
        shutil.rmtree(shm, ignore_errors=True)
    print(
        f"\nbench.sglang: {args.pages} pages x {args.page_size} tokens, "
        f"{page_bytes / 2**20:.2f} MiB per page ({args.layers} layers, {args.heads} KV heads x {args.dim}, "
        f"bf16), {args.rounds} rounds, interleaved; storage {args.dir}"
        + ("; a Python thread spinning beside them" if args.spin else "")
    )
    print(f"{'operation':<24}{'system':<7}{'median s':>10}{'min-max s':>17}{'pages/s':>10}{'GB/s':>8}  x ref")
    report: dict[str, Any] = {"args": vars(args), "page_bytes": page_bytes, "raw_read_gbps": raw, "rows": []}
    for op in OPS:
        ref_key = "dropped" if "dropped" in op else "page cache"
        ref = statistics.median(raw[ref_key]) if "prefetch" in op else None
        for s in SYSTEMS:
            ts = res[s][op]
            med = statistics.median(ts)
            gbps = total / med / 1e9
            xref = f"{gbps / ref:.2f}x" if ref else "-"
            print(
                f"{op:<24}{s:<7}{med:>10.3f}{f'{min(ts):.3f}-{max(ts):.3f}':>17}"
                f"{args.pages / med:>10.0f}{gbps:>8.2f}  {xref}"
            )
            report["rows"].append(
                {"op": op, "system": s, "seconds": ts, "gbps": gbps, "x_ref": gbps / ref if ref else None}
            )
    for k, v in raw.items():
        print(
            f"reference: raw read of the same {args.pages} files, 4 threads, {k}: "
            f"{statistics.median(v):.2f} GB/s ({min(v):.2f}-{max(v):.2f})"
        )
    for op in OPS:
        ratio = statistics.median(res["file"][op]) / statistics.median(res["hpkv"][op])
        print(f"{op}: hpkv is {ratio:.2f}x the speed of SGLang's file backend (median times)")
    path = os.path.join(args.out, "sglang.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"every round: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
