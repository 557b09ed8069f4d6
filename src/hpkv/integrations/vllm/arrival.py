"""The remote tiers' existence check made when vLLM queues a request (the connector's
``on_new_request``), for its first lookup to use.

Without it a lookup that needs the check answers "ask again" and the request waits one more engine step
for the round trip; a request that waited in vLLM's queue now finds the answer in. The scheduler
(scheduler.py) keeps one per request and uses it once.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpkv.engine.catalog import Catalog

# An answer older than this is asked again at the lookup: another engine may have stored the chunks since.
FRESH_S = 2.0

Names = list[str | None]  # per chunk asked: the remote tier that holds it, or None


@dataclass
class ArrivalCheck:
    answer: Future[Names]  # for the chunks at ``chunks``
    chunks: list[int] = field(default_factory=list)  # indexes into the prompt's chunks
    since: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, catalog: Catalog, lks: list[bytes], tenant: str) -> ArrivalCheck | None:
        """Ask the remote tiers about the chunks the local ones lack (on a thread; never waits);
        None when the local tiers hold every chunk."""
        where = catalog.locate_local(lks, tenant)
        gaps = [i for i, w in enumerate(where) if w is None]
        if not gaps:
            return None
        return cls(catalog.probe_remote([lks[i] for i in gaps], tenant), gaps)

    def answer_for(self, chunks: list[int]) -> Future[Names] | None:
        """The answer for ``chunks``, if this check asked about all of them and is recent (else
        None: ask again)."""
        if time.monotonic() - self.since > FRESH_S:
            return None
        at = {c: j for j, c in enumerate(self.chunks)}
        if any(c not in at for c in chunks):  # a chunk left the local tiers since
            return None

        def pick(f: Future[Names]) -> Names:
            names = f.result()
            return [names[at[c]] for c in chunks]

        out: Future[Names] = Future()
        if self.answer.done():
            out.set_result(pick(self.answer))
            return out

        def settle(f: Future[Names]) -> None:
            try:
                out.set_result(pick(f))
            except Exception:  # cancelled or failed: absent, as a failed check answers
                out.set_result([None] * len(chunks))

        self.answer.add_done_callback(settle)
        return out
