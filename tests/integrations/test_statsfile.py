"""The counters file: written without following planted links, read without blocking on a FIFO."""

from __future__ import annotations

import os
import threading
from typing import Any

from hpkv.integrations.statsfile import StatsFile, read_all


def test_a_link_at_the_temp_name_is_not_followed_and_a_fifo_is_skipped(tmp_path: Any) -> None:
    d = str(tmp_path / "pool")
    sf = StatsFile.for_pool_dir(d, "m")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    os.symlink(victim, f"{sf.path}.tmp")
    sf.write(lambda: {"connector": {"loaded_tokens": 1}}, force=True)
    assert victim.read_text() == "keep me"
    os.mkfifo(os.path.join(d, "hpkv-1.stats.json"))  # pid 1 is alive: not skipped as dead
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(read_all(d)), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "reading the counters blocked on a FIFO"
    assert [doc["connector"]["loaded_tokens"] for doc in out[0]] == [1]
