"""The engine's step times (integrations/vllm/stepclock.py), as vLLM's async scheduling sends them."""

from __future__ import annotations

import time

from hpkv.integrations.vllm.stepclock import StepClock


def test_a_step_sent_before_the_last_reported_is_timed_from_that_report() -> None:
    clock = StepClock()
    clock.sent(2048, True)
    clock.sent(2048, True)  # async scheduling: the next step goes out early
    time.sleep(0.05)
    first = clock.reported(True)
    time.sleep(0.02)
    second = clock.reported(True)
    assert first is not None and second is not None
    assert first[0] == second[0] == 2048
    assert first[1] >= 0.05
    assert 0.02 <= second[1] < 0.05  # from the first one's report, not from when it was sent


def test_a_step_that_computed_nothing_is_no_sample_and_reports_match_their_kind() -> None:
    clock = StepClock()
    assert clock.reported(True) is None  # nothing out
    clock.sent(0, False)
    clock.sent(512, True)
    took = clock.reported(True)  # the computing step, though the empty one was sent first
    assert took is not None and took[0] == 512
    assert clock.reported(False) is None  # the empty step: matched by kind, no sample
    assert clock.reported(None) is None  # nothing left out
