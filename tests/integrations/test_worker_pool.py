"""The worker's pool file at start (a CPU worker over CPU_ATTN-shaped KV tensors; the CUDA case runs
in make test-gpu-e2e): made under the agreed name, kept when the scheduler maps it, dropped when the
scheduler made its own."""

from __future__ import annotations

import os

import torch

from hpkv import HpkvConfig
from hpkv.core.keys import Namespace
from hpkv.integrations.vllm.meta import HpkvMeta
from hpkv.integrations.vllm.worker import HpkvWorker
from hpkv.tiers.memory.pool import ShmPool, agreed_pool_path, pool_file_path
from tests.conftest import CHUNK, SMALL

BLOCK = 8
SIZE = 4 << 20


def started_worker(shm_dir: str) -> tuple[HpkvWorker, str]:
    path = agreed_pool_path(shm_dir, os.getpid(), "w0e00r0")
    assert path is not None
    cfg = HpkvConfig(mem_pool_size=SIZE, share_mem_file_path=shm_dir, chunk_size=CHUNK)
    w = HpkvWorker(Namespace("worker", SMALL, CHUNK), CHUNK, BLOCK, "CPU_ATTN", start_pool=path, config=cfg)
    L, H, D = SMALL.num_layers, SMALL.num_kv_heads, SMALL.head_dim
    w.register_kv_caches([torch.zeros(16, H, BLOCK, 2 * D, dtype=SMALL.dtype) for _ in range(L)])
    assert os.path.exists(path)  # made at start, before any step
    return w, path


def test_the_pool_made_at_start_is_kept_when_the_scheduler_maps_it(shm_dir: str) -> None:
    w, path = started_worker(shm_dir)
    try:
        assert w.pool is not None
        made = w.pool
        scheduler = ShmPool.adopt(path, SIZE)
        assert scheduler is not None
        w.start_load(HpkvMeta(pool_paths=[path], pool_size=SIZE))
        assert w.pool is made and not os.path.exists(path)  # mapped by both: the name goes
        scheduler.view[100:104] = b"hpkv"
        assert bytes(made.view[100:104]) == b"hpkv"
        out = w.take_results()
        assert out.attached == 1 and not out.computed
        w.start_load(HpkvMeta(pool_paths=[path], pool_size=SIZE, computes=True))  # later steps: nothing
        out = w.take_results()  # but a report all the same, saying whether the step computed
        assert out.results == {} and out.attached == 0 and out.computed
        # vLLM hands a step's connector output on only when it is not empty: this one is.
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput

        handed = ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(kv_connector_worker_meta=out))
        assert handed is not EMPTY_MODEL_RUNNER_OUTPUT and handed.kv_connector_output is not None
        scheduler.close()
    finally:
        w.shutdown()


def test_the_pool_made_at_start_is_dropped_when_the_scheduler_made_its_own(shm_dir: str) -> None:
    w, path = started_worker(shm_dir)
    own = ShmPool(pool_file_path(shm_dir, "sched"), SIZE)
    try:
        w.start_load(HpkvMeta(pool_paths=[own.path], pool_size=SIZE))
        assert not os.path.exists(path)  # its memory is given back
        assert w.pool is not None and w.pool.path == own.path
        own.view[0:4] = b"mine"
        assert bytes(w.pool.view[0:4]) == b"mine"
        out = w.take_results()
        assert out is not None and out.attached == 1
    finally:
        w.shutdown()
        own.close()
