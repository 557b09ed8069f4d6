"""The benchmarks' page-cache helpers on real files."""

from __future__ import annotations

import os

from hpkv.bench.refs import drop_page_cache, warm_page_cache
from hpkv.native import in_page_cache


def test_warm_page_cache_brings_dropped_files_back_whole(tmp_path: object) -> None:
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "sub"))
    paths = [os.path.join(root, "a"), os.path.join(root, "sub", "b")]
    for i, p in enumerate(paths):
        with open(p, "wb") as f:
            f.write(os.urandom(3 * 2**20 + 4096 * i + 7))  # not a whole number of pages
    assert drop_page_cache(root) == 2
    assert warm_page_cache(root) == 2
    assert all(in_page_cache(p) for p in paths)
