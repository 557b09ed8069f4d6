"""Each generated token's log-probabilities, recorded under load, and the check built on them.

In bf16 on a GPU, even with vLLM's batch-invariant kernels, a request's greedy text can change with
what it was batched with and where its prefill was split (a cache hit moves that split): where two
candidate tokens are nearly tied, the last bits decide. A text that differs from vLLM alone's is
then still right if it differs only at such a tie: the same tokens with the same log-probabilities
(within ``tolerance``) up to a token where the two choices were within ``tolerance`` of each other in
both runs. KV from the wrong prompt, or wrong bytes, moves log-probabilities far more than that, which
the bench shows by running the same check between requests with different prompts (:func:`power`).
"""

from __future__ import annotations

import json
import time
from typing import Any

# One generated token: (token, its log-probability, the top candidates' log-probabilities).
Step = tuple[str, float, dict[str, float]]


class LogprobClient:
    """A request function with the interface of vLLM's benchmark client (its ``RequestFunc``) for the
    completions endpoint, streamed, that also keeps each token's ``top`` log-probabilities by request
    id (``steps``)."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.steps: dict[str, list[Step]] = {}

    async def __call__(self, request_func_input: Any, session: Any, pbar: Any = None) -> Any:
        from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

        rfi = request_func_input
        payload = {
            "model": rfi.model_name or rfi.model,
            "prompt": rfi.prompt,
            "max_tokens": rfi.output_len,
            "logprobs": self.top,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": rfi.ignore_eos,
            # Candidates named by id: several tokens can decode to the same text (e.g. "" for a
            # partial UTF-8 sequence), which would make two runs' candidates look alike or apart.
            "return_tokens_as_token_ids": True,
            **(rfi.extra_body or {}),
        }
        headers = {"x-request-id": rfi.request_id} if rfi.request_id else {}
        http = session  # vLLM's aiohttp client, passed by that keyword
        out = RequestFuncOutput(prompt_len=rfi.prompt_len)
        steps: list[Step] = []
        start = last = out.start_time = time.perf_counter()
        text = ""
        try:
            async with http.post(url=rfi.api_url, json=payload, headers=headers) as response:
                if response.status != 200:
                    out.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return out
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[len("data: ") :])
                    if choices := data.get("choices"):
                        now = time.perf_counter()
                        if not steps and not text:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                        text += choices[0].get("text") or ""
                        steps.extend(_steps(choices[0].get("logprobs")))
                    elif usage := data.get("usage"):
                        out.output_tokens = usage.get("completion_tokens") or 0
            out.success = bool(text or steps)
            out.error = "" if out.success else "no token came back"
        except Exception as e:  # a failed request is counted by the benchmark, as with vLLM's client
            out.error = f"{type(e).__name__}: {e}"
        finally:
            out.generated_text = text
            out.latency = last - start
            if rfi.request_id:
                self.steps[rfi.request_id] = steps
            if pbar is not None:
                pbar.update(1)
        return out


def _steps(logprobs: dict[str, Any] | None) -> list[Step]:
    if not logprobs:
        return []
    tokens = logprobs.get("tokens") or []
    chosen = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [{}] * len(tokens)
    return [(t, float(lp), dict(top or {})) for t, lp, top in zip(tokens, chosen, tops, strict=True)]


def check(mine: list[Step], ref: list[Step], tolerance: float) -> tuple[bool, int, float, str]:
    """``mine`` against ``ref``: (right, the first token that differs (``len`` if none), the largest
    log-probability difference up to it, why). Right: at every token up to the first that differs,
    each candidate both runs ranked has log-probabilities within ``tolerance`` of each other, and
    at that token each run's choice was within ``tolerance`` of the other's (a tie in both)."""
    n = min(len(mine), len(ref))
    first = next((i for i in range(n) if mine[i][0] != ref[i][0]), n)
    largest = 0.0
    for i in range(min(first + 1, n)):
        (_, lp_a, top_a), (_, lp_b, top_b) = mine[i], ref[i]
        diffs = [abs(top_a[t] - top_b[t]) for t in top_a.keys() & top_b.keys()]
        largest = max(largest, *diffs, abs(lp_a - lp_b) if i < first else 0.0)
    if largest > tolerance:
        return False, first, largest, f"log-probabilities differ by {largest:.3g} by token {first}"
    if first == n:
        if len(mine) != len(ref):
            return False, first, largest, f"{len(mine)} tokens against {len(ref)}"
        return True, first, largest, "equal"
    a, b = mine[first][0], ref[first][0]
    gaps = []
    for (_, lp, top), other in ((mine[first], b), (ref[first], a)):
        if other not in top:
            why = f"token {first}: {other!r} is not among the other run's top {len(top)}"
            return False, first, largest, why
        gaps.append(lp - top[other])
    if max(gaps) > tolerance:
        return False, first, largest, f"token {first}: not a tie (margins {gaps[0]:.3g}, {gaps[1]:.3g})"
    return True, first, largest, f"a tie at token {first} (margins {gaps[0]:.3g}, {gaps[1]:.3g})"


def power(
    runs_steps: list[list[Step]], ref_steps: list[list[Step]], others: list[int], tolerance: float
) -> int:
    """How many of ``runs_steps`` the check passes against ``ref_steps`` of request ``others[i]`` (a
    different prompt): the check's power; a check that passed these would prove nothing."""
    return sum(
        check(mine, ref_steps[j], tolerance)[0]
        for mine, j in zip(runs_steps, others, strict=True)
        if mine and ref_steps[j]
    )
