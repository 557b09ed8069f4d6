"""``HPKV_STEP_TRACE``: what the connector saw of each engine step, one JSON line per event.

For finding where a request's time went under load (which other requests shared its steps,
which loads and stores rode along, how long each step took from its scheduling to its
workers' report). Off unless the variable names a directory; the engine's scheduler then
writes ``steps-<pid>.jsonl`` there. Events, each with ``t`` (``time.monotonic()``, the clock
of vLLM's own request timings on Linux):

- ``lookup``: a request's lookup answered (``id``, ``len`` prompt tokens, ``computed`` by
  vLLM's own cache, ``hit`` tokens or null for "ask again", ``async``);
- ``step``: a step scheduled (``tokens`` to compute, ``reqs`` id -> tokens this step,
  ``loads`` [id, chunks, async], ``stores`` chunks);
- ``done``: a step's report from the workers (``computed``: whether it computed);
- ``finished``: vLLM is done with a request.

Plain JSON text, written with buffering and flushed once per step.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from hpkv.integrations.vllm.meta import HpkvMeta

STEP_TRACE_FILE = "steps-{pid}.jsonl"


class StepTrace:
    def __init__(self, directory: str | None) -> None:
        self._f: IO[str] | None = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, STEP_TRACE_FILE.format(pid=os.getpid()))
            self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    @property
    def on(self) -> bool:
        return self._f is not None

    def event(self, ev: str, flush: bool = False, **fields: Any) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps({"t": round(time.monotonic(), 6), "ev": ev, **fields}) + "\n")
        if flush:
            self._f.flush()

    def lookup(
        self, req_id: str, prompt_len: int, computed: int, hit: int | None, asynchronous: bool
    ) -> None:
        if self._f is not None:
            fields: dict[str, Any] = {"id": req_id, "len": prompt_len, "computed": computed, "hit": hit}
            fields["async"] = asynchronous  # a keyword in Python
            self.event("lookup", **fields)

    def step(self, so: SchedulerOutput, meta: HpkvMeta) -> None:
        """A step scheduled: what it computes for whom, and the loads and stores it carries."""
        if self._f is not None:
            loads = [[x.req_id, len(x.chunks), x.asynchronous] for x in meta.loads]
            reqs = dict(so.num_scheduled_tokens)
            total = so.total_num_scheduled_tokens
            self.event("step", True, tokens=total, reqs=reqs, loads=loads, stores=len(meta.stores))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
