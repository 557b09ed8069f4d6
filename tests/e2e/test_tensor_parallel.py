"""Tensor parallel size 2 on the CPU build: each rank stores and loads its own shard.

vLLM-CPU binds each rank's threads to a NUMA node; this machine has one, so
the ranks are bound by hand (VLLM_CPU_OMP_THREADS_BIND="0|1").
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile

from tests.e2e.conftest import CHUNK, Counters, make_server, text, words_prompt


def test_tp2_memory_and_storage_hits_per_rank(demo_model: str) -> None:
    tmp = tempfile.mkdtemp(prefix="hpkv-e2e-tp2-")
    cpus = sorted(os.sched_getaffinity(0))
    bind = f"{cpus[0]}|{cpus[-1]}" if len(cpus) > 1 else f"{cpus[0]}|{cpus[0]}"
    s = make_server(
        demo_model,
        tmp,
        "tp2",
        8451,
        env={"VLLM_CPU_OMP_THREADS_BIND": bind},
        vllm_args=["--tensor-parallel-size", "2"],
    )
    p = words_prompt(demo_model, 1000, seed=21)
    s.start()
    try:
        pools = sorted(glob.glob(os.path.join(s.env["HPKV_SHARE_MEM_FILE_PATH"], "*.shm")))
        assert len(pools) == 2, pools  # one pool file per rank
        # The host pool's files for this model and two ranks, made by the pool process, each mapped
        # by its rank's worker process at start and by the scheduler.
        for r, path in enumerate(pools):
            name = os.path.basename(path)
            assert re.fullmatch(rf"hpkv-\d+-[0-9a-f]{{16}}w2s\d+r{r}\.shm", name), pools
        cold = text(s, p)
        log = s.log_tail(100_000)
        assert "mapped at the first request instead" not in log
        s.reset_prefix_cache()
        c = Counters(s)
        assert text(s, p) == cold
        assert c.delta("memory", "hits") == 3
        from tests.e2e.conftest import wait_for

        wait_for(lambda: s.hpkv_stats()["tiers"]["storage"]["writes"] == 6, what="3 chunks × 2 ranks on disk")
        s.restart()
        c = Counters(s)
        assert text(s, p) == cold
        assert c.delta("storage", "hits") == 6  # every rank read its own shard of 3 chunks
        assert c.delta("storage.rank0", "hits") == c.delta("storage.rank1", "hits") == 3
        assert c.delta("connector", "loaded_tokens") == 3 * CHUNK
    finally:
        s.stop()
        shutil.rmtree(s.env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
