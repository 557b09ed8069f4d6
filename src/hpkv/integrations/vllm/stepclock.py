"""How long the engine took for each step that computed: the prefill rate's samples (engine/costs.py).

vLLM's scheduler sends a step (``build_connector_meta``) and later hands its output back
(``update_connector_output``), in the same order. With async scheduling the next step is sent before
the previous one's output is back, so a step's time runs from when it could start (sent, and the
step before it reported) to its report.
"""

from __future__ import annotations

import time
from collections import deque

# Steps a vLLM engine can have sent and not yet reported (as engine/cascade.py's STEPS_IN_FLIGHT_MAX);
# beyond it the oldest is forgotten (vLLM hands on no output of an empty step no worker spoke in).
STEPS_IN_FLIGHT = 8


class StepClock:
    def __init__(self) -> None:
        self._out: deque[tuple[float, int, bool]] = deque(maxlen=STEPS_IN_FLIGHT)  # (sent, tokens, computes)
        self._last_report = 0.0

    def sent(self, tokens: int, computes: bool) -> None:
        """The scheduler sent a step of ``tokens`` scheduled tokens (``computes``: any to compute)."""
        self._out.append((time.monotonic(), tokens, computes))

    def reported(self, computed: bool | None) -> tuple[int, float] | None:
        """A step's output is back: the oldest step of its kind (``computed``; None: of any kind).
        Returns (tokens, seconds) for a step that computed, else None."""
        now = time.monotonic()
        i = next((k for k, s in enumerate(self._out) if computed is None or s[2] == computed), None)
        if i is None:
            return None
        sent, tokens, computes = self._out[i]
        del self._out[i]
        began = max(sent, self._last_report)
        self._last_report = now
        return (tokens, now - began) if computes else None
