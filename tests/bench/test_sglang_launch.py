"""The SGLang launch line hpkv's bench and GPU tests run is the one the README gives users."""

from __future__ import annotations

import json
import os
import re

import pytest

from hpkv.bench.sglang_server import HPKV_EXTRA, sglang_command, sum_docs
from hpkv.cli.main import _engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_readme_launches_sglang_with_the_backend_the_tests_load() -> None:
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## Use it with SGLang", 1)[1].split("\n## ", 1)[0]
    extra = json.loads(re.search(r"'(\{\"backend_name\".*?\})'", section).group(1))  # type: ignore[union-attr]
    assert extra == HPKV_EXTRA
    cmd = sglang_command("/m", port=1, backend="hpkv")
    for flag in re.findall(r"(--[a-z-]+)", section.split("```bash", 1)[1].split("```", 1)[0]):
        assert flag in cmd, f"the README passes {flag}; the tested launch line does not"
    assert json.loads(cmd[cmd.index("--hicache-storage-backend-extra-config") + 1]) == HPKV_EXTRA


def test_each_l3_backend_gets_the_same_flags_but_its_own() -> None:
    none, file, hpkv = (sglang_command("/m", port=1, backend=b) for b in ("none", "file", "hpkv"))
    assert "--hicache-storage-backend" not in none
    assert file[: len(none)] == none and hpkv[: len(none)] == none
    with pytest.raises(ValueError, match="mooncake"):
        sglang_command("/m", port=1, backend="mooncake")


def test_counters_of_several_ranks_are_summed() -> None:
    docs = [
        {"tiers": {"storage": {"hits": 3, "writes": 1}}, "connector": {"read": 3}},
        {"tiers": {"storage": {"hits": 2}, "valkey": {"hits": 1}}, "connector": {"read": 2}},
    ]
    got = sum_docs(docs)
    assert got["tiers"] == {"storage": {"hits": 5, "writes": 1}, "valkey": {"hits": 1}}
    assert got["connector"] == {"read": 5} and got["engines"] == 2


def test_bench_ttft_takes_the_engine_out_of_its_arguments() -> None:
    assert _engine(["--engine", "sglang", "--prompts", "2"]) == (["--prompts", "2"], "sglang")
    assert _engine(["--engine=vllm", "--x"]) == (["--x"], "vllm")
    assert _engine([]) == ([], "vllm")
    with pytest.raises(SystemExit, match="trt"):
        _engine(["--engine", "trt"])
