"""HpkvConnectorV1: hpkv as a vLLM v1 KV connector.

Enable it with the seed's command line::

    --kv-transfer-config '{"kv_connector":"HpkvConnectorV1","kv_role":"kv_both"}'

(the name is registered by hpkv's vLLM plugin), or without plugins with
``"kv_connector_module_path":"hpkv.integrations.vllm.connector"``. Settings come
from ``HPKV_*`` variables, ``HPKV_CONFIG_FILE`` and ``kv_connector_extra_config``
(highest precedence). Roles: ``kv_both`` loads and stores, ``kv_producer`` only
stores, ``kv_consumer`` only loads.

The scheduler-side instance owns the catalog and every tier (see
:mod:`hpkv.integrations.vllm.scheduler`); the worker-side instances copy
between pool slots and the paged KV (:mod:`hpkv.integrations.vllm.worker`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.keys import Namespace
from hpkv.core.layout import KVLayout
from hpkv.integrations.vllm.kvgroups import KVGroups, describe_groups
from hpkv.integrations.vllm.meta import HpkvMeta
from hpkv.tiers.memory.hostslots import uses_host_pool
from hpkv.tiers.memory.pool import agreed_pool_path

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("hpkv")

# vLLM's hybrid KV cache manager (several KV cache groups) is served where vLLM can take a failed
# load as the request's (``failed_recving``, vLLM ≥ 0.32): it cannot map a failed block of a model
# with several groups back to its request. With an older vLLM the connector does not declare
# SupportsHMA, and vLLM runs such a model as one group (its hybrid manager off).
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    _HMA: tuple[type, ...] = (SupportsHMA,)
except ImportError:
    _HMA = ()


def _setup_logging() -> None:
    """hpkv's lines go to stderr like vLLM's own, at INFO, once per process."""
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [hpkv] %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def defer_writes(write_behind: str) -> bool:
    """Whether the write-behind is paced (``HPKV_WRITE_BEHIND``): it prefers the engine's idle time,
    for at most CASCADE_PACE_S per chunk (the default, on the CPU build and on a GPU alike: writes
    during a computing step take CPU and memory bandwidth from the step's own host work)."""
    return write_behind != "immediate"


class HpkvConnectorV1(KVConnectorBase_V1, *_HMA):  # type: ignore[misc]
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        _setup_logging()
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        self.config = HpkvConfig.load(extra, source="kv_connector_extra_config")
        record.set_auth_key(self.config.auth_key_bytes)  # workers seal what they store
        self.namespace, self.block_size, self.layer_names, self.groups = _describe_engine(
            vllm_config, kv_cache_config, self.config
        )
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm.platforms import current_platform

            from hpkv.integrations.vllm.scheduler import HpkvScheduler

            # A cache miss must never fail a request: recompute what could not be loaded.
            if ktc.kv_load_failure_policy != "recompute":
                ktc.kv_load_failure_policy = "recompute"

            self._scheduler = HpkvScheduler(
                self.config,
                self.namespace,
                self.block_size,
                load=ktc.is_kv_consumer,
                store=ktc.is_kv_producer,
                defer_cascade=defer_writes(self.config.write_behind),
                adopt_pools=[
                    _start_pool_path(vllm_config, self.config, self.namespace, r, worker=False)
                    for r in range(self.namespace.world_size)
                ],
                gpu=not current_platform.is_cpu(),
                device=_device_name(current_platform),
                groups=self.groups,
            )
            _on_stop_signals(self._scheduler.stopping)
            if self.groups.count > 1:
                log.info(
                    "hpkv: %d KV cache groups (%s): every group's KV of a chunk in one record, loads "
                    "asynchronous",
                    self.groups.count,
                    self.groups.describe(),
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from hpkv.integrations.vllm.worker import HpkvWorker

            rank = get_tensor_model_parallel_rank()
            self.namespace = self.namespace.for_rank(rank)
            self._worker = HpkvWorker(
                self.namespace,
                self.config.chunk_size,
                self.block_size,
                _backend_name(vllm_config, self.layer_names),
                layerwise=self.config.layerwise_load,
                start_pool=_start_pool_path(vllm_config, self.config, self.namespace, rank, worker=True),
                config=self.config,
                groups=self.groups,
            )
            self._layer_index = {n: i for i, n in enumerate(self.layer_names)}

    # -- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise HpkvConfigError(f"hpkv: KV caches for layers {missing[:3]} were not registered")
        self._worker.register_kv_caches([kv_caches[n] for n in self.layer_names])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, HpkvMeta):
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # CUDA with layerwise_load: the compute stream waits for this layer's copies only.
        if self._worker is not None:
            i = self._layer_index.get(layer_name)
            if i is not None:
                self._worker.wait_layer(i)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # chunks are gathered whole in wait_for_save, after every layer is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, HpkvMeta):
            self._worker.save(meta)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_results() if self._worker is not None else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Async loads whose copies all landed on this rank (vLLM waits for every rank's word).
        done = self._worker.finished_loads() if self._worker is not None else set()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Several KV cache groups: a failed async load is the request's (vLLM recomputes it).
        _, done = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_loads() if self._worker is not None else set()
        return KVConnectorTransferResults(finished_recving=set(done or ()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side ------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # True while an async load still writes into the request's blocks: vLLM frees them once
        # the workers report it received.
        delay = self._scheduler.request_finished(request) if self._scheduler is not None else False
        return delay, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's hybrid KV cache manager (SupportsHMA): the same, every group's blocks at once.
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def has_pending_push_work(self) -> bool:
        # On CUDA a store's copy lands after the step that queued it; without this the engine goes
        # idle after the last request and the workers' results (commit, cascade) wait for the next one.
        return self._scheduler is not None and self._scheduler.has_pending_ops()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss


def _describe_engine(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, config: HpkvConfig
) -> tuple[Namespace, int, list[str], KVGroups]:
    """Namespace (rank 0), engine block size, layer order (the record's: group after group) and
    KV cache groups, from what vLLM configured."""
    if kv_cache_config is None:
        raise HpkvConfigError("hpkv needs vLLM's kv_cache_config (vLLM ≥ 0.11)")
    groups, layer_names, spec = describe_groups(kv_cache_config.kv_cache_groups)
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise HpkvConfigError("hpkv does not support pipeline parallelism yet (--pipeline-parallel-size > 1)")
    mla = bool(getattr(spec, "use_mla", False)) or type(spec).__name__.startswith("MLA")
    layout = KVLayout(
        num_layers=len(layer_names),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        dtype=spec.dtype,
        num_kv=1 if mla else 2,
    )
    mc = vllm_config.model_config
    fingerprint = hashlib.sha256(mc.hf_config.to_json_string().encode()).hexdigest()[:16]
    # Engine settings that change the KV bytes without changing the layout: the KV cache dtype
    # (fp8 variants share a torch dtype) and the weights' quantization.
    kv_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    quant = getattr(mc, "quantization", None) or "none"
    model_id = f"{mc.model}@{mc.revision or ''}#{fingerprint}|kv={kv_dtype}|q={quant}"
    if groups.count > 1:
        # The record's layers go group after group: another grouping is another record.
        order = hashlib.sha256("\n".join(layer_names).encode()).hexdigest()[:8]
        model_id += f"|groups={groups.describe()}#{order}"
    ns = Namespace(model_id, layout, config.chunk_size, 0, pc.tensor_parallel_size, config.salt)
    return ns, int(spec.block_size), layer_names, groups


def _start_pool_path(
    vllm_config: VllmConfig, config: HpkvConfig, namespace: Namespace, rank: int, *, worker: bool
) -> str | None:
    """The pool file of TP rank ``rank`` that its worker makes at start (vLLM sets up the workers'
    KV caches before it builds the scheduler) and the scheduler then maps instead of making its
    own: page-locking it for CUDA is then part of the start, not of the first request.

    Both sides name it from what they share: the engine process's pid (the scheduler's own; a
    worker's own under the in-process executor, its parent's under vLLM's multiprocess one),
    the model's key digest, vLLM's per-launch ``engine_id`` and the rank. None where they cannot
    agree (Ray and other executors, a pool path naming one file, no memory tier): the scheduler
    then makes the pool, as before, and the worker maps it at the first step."""
    if config.mem_pool_size <= 0 or uses_host_pool(config):
        return None  # the host pool's files are made by the pool process (see HpkvWorker)
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend == "uni":
        pid = os.getpid()
    elif backend == "mp":
        pid = os.getppid() if worker else os.getpid()
    else:
        return None
    engine_id = vllm_config.kv_transfer_config.engine_id if vllm_config.kv_transfer_config else None
    launch = hashlib.sha256(str(engine_id).encode()).hexdigest()[:8]
    tag = f"{namespace.logical_digest.hex()[:6]}e{launch}r{rank}"
    return agreed_pool_path(config.share_mem_file_path, pid, tag)


def _device_name(platform: Any) -> str:
    """The engine's device ("NVIDIA H200", "cpu"), asked without starting a CUDA context here."""
    try:
        return str(platform.get_device_name())
    except Exception:
        return ""


def _on_stop_signals(callback: Callable[[], None]) -> None:
    """Start ``callback`` when the engine process is told to stop (SIGTERM, SIGINT), before the
    handler vLLM installed: the write-behind can start writing at once rather than when vLLM's
    shutdown reaches the connector (which, by default, it never does: the engine is killed first).
    The callback runs on a thread of its own: the handler interrupts the main thread between any two
    bytecodes, possibly inside a lock the callback needs (the cascade's, the rates'). Only from the
    process's main thread (where vLLM builds the scheduler); elsewhere nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        before = signal.getsignal(sig)

        def handler(signum: int, frame: Any, before: Any = before) -> None:
            threading.Thread(target=callback, name="hpkv-stopping", daemon=True).start()
            if callable(before):
                before(signum, frame)
            elif before == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


def _backend_name(vllm_config: VllmConfig, layer_names: list[str]) -> str:
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
        backend = next(iter(layers.values())).get_attn_backend()
        return str(backend.get_name())
    except Exception:
        from vllm.platforms import current_platform

        return "CPU_ATTN" if current_platform.is_cpu() else "FLASH_ATTN"
