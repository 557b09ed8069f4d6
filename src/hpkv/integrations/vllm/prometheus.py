"""hpkv's counters on vLLM's ``/metrics``.

The counters live in the scheduler process; ``/metrics`` is served by the API
server process. The plugin installs, in every process, a collector that reads
the engines' stats files (see :mod:`hpkv.integrations.statsfile`) when
Prometheus scrapes, so the numbers are fresh and nothing crosses processes
but JSON.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_installed = False


def install_collector() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError:  # pragma: no cover - prometheus_client is a dependency
        return

    from hpkv.core.config import HpkvConfig
    from hpkv.integrations.statsfile import read_all

    try:
        path = HpkvConfig.from_env().share_mem_file_path
    except Exception:  # the engine refuses a bad setting itself, naming it; /metrics just has no hpkv_*
        return

    class HpkvCollector:
        def collect(self) -> Iterator[Any]:
            docs = read_all(path)
            counters = (
                "hits",
                "misses",
                "corrupt",
                "bytes_read",
                "bytes_written",
                "writes",
                "writes_skipped",
                "evictions",
                "errors",
                "promotions",
                "page_cache_reads",
            )
            gauges = ("used_bytes", "capacity_bytes", "chunks")
            fams: dict[str, Any] = {}
            for name in counters:
                fams[name] = CounterMetricFamily(
                    f"hpkv_tier_{name}", f"hpkv per-tier {name}", labels=["tier", "pid"]
                )
            for name in gauges:
                fams[name] = GaugeMetricFamily(
                    f"hpkv_tier_{name}", f"hpkv per-tier {name}", labels=["tier", "pid"]
                )
            conn = CounterMetricFamily("hpkv_connector", "hpkv connector counters", labels=["what", "pid"])
            # Gauges: the write-behind's progress and longest wait, and the measured rates that decide
            # how much of a hit to load (engine/costs.py).
            parts = {
                part: GaugeMetricFamily(
                    f"hpkv_{part}", f"hpkv {part.replace('_', '-')}", labels=["what", "pid"]
                )
                for part in ("write_behind", "costs")
            }
            for doc in docs:
                pid = str(doc.get("pid"))
                for tier, vals in (doc.get("tiers") or {}).items():
                    if "." in tier:  # a rank's share ("storage.rank1"), already in the tier's total
                        continue
                    for name, fam in fams.items():
                        if name in vals:
                            fam.add_metric([tier, pid], float(vals[name]))
                for what, v in (doc.get("connector") or {}).items():
                    conn.add_metric([what, pid], float(v))
                for part, fam in parts.items():
                    for what, v in (doc.get(part) or {}).items():
                        fam.add_metric([what, pid], float(v))
            yield from fams.values()
            yield conn
            yield from parts.values()

    with contextlib.suppress(ValueError):  # already registered in this process
        REGISTRY.register(HpkvCollector())
