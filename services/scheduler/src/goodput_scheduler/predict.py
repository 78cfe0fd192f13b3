"""How long a request will take once it runs, learned from the requests that finished: the backpressure of seed
002 (refuse at once what cannot finish in time, rather than start it and cut it).

Service time = prefill (seconds per prompt token x prompt tokens) + decode (seconds per output token x the tokens
expected), each an exponentially weighted mean over finished leases (the gateway's release carries the tokens and
the time to first token; the lease's own duration gives the decode time). The tokens expected are max_tokens, or
twice the mean answer length seen when that is less (most answers end well before a generous max_tokens). Until a
request has finished, the priors (settings) stand: they are optimistic on purpose (a fast GPU's numbers), so nothing
is refused for want of data.

    >>> p = ServiceTimePredictor(prefill_s_per_token=0.0001, tpot_s=0.001)
    >>> round(p.service_s(prompt_tokens=1000, max_tokens=400), 3)
    0.5
    >>> p.observe(prompt_tokens=100, completion_tokens=101, ttft_s=0.05, duration_s=2.05)
    >>> round(p.tpot_s, 4), round(p.prefill_s_per_token, 6), p.expected_tokens(400), p.expected_tokens(100)
    (0.0048, 0.00018, 202, 100)
"""

from __future__ import annotations

import math

__all__ = ["ServiceTimePredictor"]


class ServiceTimePredictor:
    def __init__(self, *, prefill_s_per_token: float, tpot_s: float, alpha: float = 0.2) -> None:
        self.prefill_s_per_token = prefill_s_per_token
        self.tpot_s = tpot_s
        self.alpha = alpha
        self.observed = 0
        self.mean_completion = 0.0

    def observe(self, *, prompt_tokens: int, completion_tokens: int, ttft_s: float, duration_s: float) -> None:
        """A finished request: its prompt and answer lengths, time to first token, and lease duration."""
        if ttft_s <= 0 or duration_s <= 0:
            return
        self.observed += 1
        self.mean_completion = completion_tokens if self.observed == 1 else \
            self.mean_completion + self.alpha * (completion_tokens - self.mean_completion)
        ttft_s = min(ttft_s, duration_s)
        if prompt_tokens > 0:
            self.prefill_s_per_token += self.alpha * (ttft_s / prompt_tokens - self.prefill_s_per_token)
        if completion_tokens > 1:
            tpot = max(duration_s - ttft_s, 0.0) / (completion_tokens - 1)
            self.tpot_s += self.alpha * (tpot - self.tpot_s)

    def expected_tokens(self, max_tokens: int) -> int:
        if not self.observed:
            return max(max_tokens, 0)
        return max(min(max_tokens, math.ceil(2 * self.mean_completion)), 0)

    def service_s(self, *, prompt_tokens: int, max_tokens: int) -> float:
        """Predicted seconds from a grant to the last token."""
        return self.prefill_s_per_token * max(prompt_tokens, 0) + self.tpot_s * self.expected_tokens(max_tokens)
