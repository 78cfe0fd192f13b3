"""How long a request will take once it runs, learned from the requests that finished: the backpressure of seed
002 (refuse at once what cannot finish in time, rather than start it and cut it).

Service time = prefill (seconds per prompt token x prompt tokens) + decode (seconds per output token x the tokens
expected), each an exponentially weighted mean over finished leases (the gateway's release carries the tokens and
the time to first token; the lease's own duration gives the decode time). The tokens expected are max_tokens, or
twice the mean answer length seen when that is less (most answers end well before a generous max_tokens), except
for an answer that runs to max_tokens (ignore_eos, as benchmarks ask). Until a
request has finished, the priors (settings) stand: they are optimistic on purpose (a fast GPU's numbers), so nothing
is refused for want of data.

    >>> p = ServiceTimePredictor(prefill_s_per_token=0.0001, tpot_s=0.001)
    >>> round(p.service_s(prompt_tokens=1000, max_tokens=400), 3)
    0.5
    >>> p.observe(prompt_tokens=100, completion_tokens=101, ttft_s=0.05, duration_s=2.05)
    >>> round(p.tpot_s, 4), round(p.prefill_s_per_token, 6), p.expected_tokens(400), p.expected_tokens(100)
    (0.0048, 0.00018, 202, 100)
    >>> p.expected_tokens(400, fixed=True)  # ignore_eos: the answer runs to max_tokens
    400
"""

from __future__ import annotations

import math

from goodput_contracts.speed import SpeedEstimate

__all__ = ["DEFAULT_SPEED_PRIOR", "ServiceTimePredictor", "WorkerSpeed"]

# The default priors (of the settings PREDICT__PREFILL_S_PER_TOKEN, PREDICT__TPOT_S and PREDICT__TPOT_PER_SEQ_S).
DEFAULT_SPEED_PRIOR = SpeedEstimate(prefill_s_per_token=0.0001, tpot_base_s=0.001, tpot_per_seq_s=0.00003)


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
        self.mean_completion += (self.alpha if self.observed > 1 else 1.0) * (completion_tokens - self.mean_completion)
        ttft_s = min(ttft_s, duration_s)
        if prompt_tokens > 0:
            self.prefill_s_per_token += self.alpha * (ttft_s / prompt_tokens - self.prefill_s_per_token)
        if completion_tokens > 1:
            tpot = max(duration_s - ttft_s, 0.0) / (completion_tokens - 1)
            self.tpot_s += self.alpha * (tpot - self.tpot_s)

    def expected_tokens(self, max_tokens: int, *, fixed: bool = False) -> int:
        """Output tokens to expect of a request: max_tokens when its answer runs to it (``fixed``: ignore_eos)."""
        if fixed or not self.observed:
            return max(max_tokens, 0)
        return max(min(max_tokens, math.ceil(2 * self.mean_completion)), 0)

    def service_s(self, *, prompt_tokens: int, max_tokens: int, fixed: bool = False) -> float:
        """Predicted seconds from a grant to the last token."""
        return self.prefill_s_per_token * max(prompt_tokens, 0) + \
            self.tpot_s * self.expected_tokens(max_tokens, fixed=fixed)


class WorkerSpeed:
    """One worker's :class:`~goodput_contracts.speed.SpeedEstimate`, learned from the leases it finished: the
    prefill seconds per prompt token as an exponentially weighted mean, and the time per output token as a line in
    the batch size, fitted by exponentially weighted least squares (recent leases weigh most, so a worker that slows
    down is seen within tens of requests). Until ``min_samples`` leases have finished, or while the batch sizes seen
    are too alike to fit a slope, the prior's slope relative to its base is kept and only the level is learned.

    >>> from goodput_contracts.speed import SpeedEstimate
    >>> speed = WorkerSpeed(SpeedEstimate(prefill_s_per_token=0.0001, tpot_base_s=0.01, tpot_per_seq_s=0.001))
    >>> for batch in (1, 5, 9, 13) * 10:      # a worker whose steps take 20 ms + 2 ms per sequence
    ...     tpot = 0.02 + 0.002 * batch
    ...     speed.observe(prompt_tokens=100, completion_tokens=51, ttft_s=0.05 + tpot, duration_s=0.05 + 51 * tpot,
    ...                   batch=batch)
    >>> est = speed.estimate()
    >>> round(est.tpot_base_s, 3), round(est.tpot_per_seq_s, 4), round(est.prefill_s_per_token, 5), est.samples
    (0.02, 0.002, 0.0005, 40)
    """

    def __init__(self, prior: SpeedEstimate, *, alpha: float = 0.1, min_samples: int = 4) -> None:
        self.prior = prior
        self.alpha = alpha
        self.min_samples = min_samples
        self.samples = 0
        self._prefill = prior.prefill_s_per_token
        self._x = self._y = self._xx = self._xy = 0.0  # weighted moments of (batch, tpot)
        self._decode_samples = 0

    def observe(self, *, prompt_tokens: int, completion_tokens: int, ttft_s: float, duration_s: float,
                batch: float, pending_prefill: int = 0) -> None:
        """A finished lease: its tokens, time from grant to first token and to the end, the batch it ran in (mean
        leases held on its worker while it ran) and the prompt tokens ahead of it when it was granted."""
        if ttft_s <= 0 or duration_s <= 0:
            return
        self.samples += 1
        ttft_s = min(ttft_s, duration_s)
        batch = max(batch, 1.0)
        if completion_tokens > 1:
            tpot = max(duration_s - ttft_s, 0.0) / (completion_tokens - 1)
            a = self.alpha if self._decode_samples else 1.0
            self._decode_samples += 1
            self._x += a * (batch - self._x)
            self._y += a * (tpot - self._y)
            self._xx += a * (batch * batch - self._xx)
            self._xy += a * (batch * tpot - self._xy)
        tokens = prompt_tokens + max(pending_prefill, 0)
        if tokens > 0:  # the first token also waited one decode step
            per_token = max(ttft_s - self.estimate().tpot_at(batch), 0.0) / tokens
            self._prefill += (self.alpha if self.samples > 1 else 1.0) * (per_token - self._prefill)

    def _line(self) -> tuple[float, float]:
        """(base, slope) of the time per output token in the batch size."""
        p = self.prior
        if not self._decode_samples:
            return p.tpot_base_s, p.tpot_per_seq_s
        var = self._xx - self._x * self._x
        if self._decode_samples >= self.min_samples and var > 0.25:
            slope = max((self._xy - self._x * self._y) / var, 0.0)
            base = self._y - slope * self._x
            if base > 0:
                return base, slope
        # one batch size seen (or a line through a negative base): keep the prior's shape at the observed level
        ratio = p.tpot_per_seq_s / p.tpot_base_s if p.tpot_base_s > 0 else 0.0
        base = self._y / (1.0 + ratio * self._x)
        return base, ratio * base

    def estimate(self) -> SpeedEstimate:
        base, slope = self._line()
        return SpeedEstimate(prefill_s_per_token=self._prefill, tpot_base_s=base, tpot_per_seq_s=slope,
                             samples=self.samples)
