"""How fast a worker serves, as the scheduler learns it and everyone who predicts reads it: one formula, so the
scheduler's placement by predicted finish time and the gateway's ``model: "auto"`` choice cannot disagree.

A worker's speed is three numbers (:class:`SpeedEstimate`), learned per worker from the leases it finished:

* ``prefill_s_per_token``: seconds from the grant to the first token, per prompt token ahead of it (its own
  prompt and the prompts still being prefilled there when it was granted);
* ``tpot_base_s`` and ``tpot_per_seq_s``: the time per output token as a line in the batch size,
  ``tpot(batch) = tpot_base_s + tpot_per_seq_s x batch``. Decode is memory-bound: a step reads the weights once
  whatever the batch (the base) and each sequence adds its KV reads (the slope). A slower GPU, a bigger model or a
  longer context shows in these numbers, not in lease counts.

A request's predicted service on a worker holding ``batch`` leases with ``pending`` prompt tokens still prefilling
(:meth:`SpeedEstimate.predict`):

    ttft  = prefill_s_per_token x (pending + prompt_tokens) + tpot(batch + 1)
    tpot  = tpot(batch + 1)
    total = ttft + tpot x (output_tokens - 1)

Example:
    >>> fast = SpeedEstimate(prefill_s_per_token=0.0001, tpot_base_s=0.012, tpot_per_seq_s=0.0003)
    >>> slow = fast.scaled(2.0)
    >>> p = fast.predict(prompt_tokens=500, output_tokens=101, batch=9)
    >>> round(p.ttft_s, 3), round(p.tpot_s, 4), round(p.total_s, 3)
    (0.065, 0.015, 1.565)
    >>> slow.predict(prompt_tokens=500, output_tokens=101, batch=0).total_s > p.total_s   # idle, but 2x slower
    True
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Prediction", "SpeedEstimate"]


@dataclass(frozen=True)
class Prediction:
    """One request's predicted latency on one worker, in seconds."""

    ttft_s: float  # from the grant to the first token
    tpot_s: float  # per output token after the first
    total_s: float  # from the grant to the last token


@dataclass(frozen=True)
class SpeedEstimate:
    prefill_s_per_token: float
    tpot_base_s: float
    tpot_per_seq_s: float
    samples: int = 0  # finished leases behind the estimate (0: the priors)

    def tpot_at(self, batch: float) -> float:
        """Seconds per output token with ``batch`` sequences running."""
        return self.tpot_base_s + self.tpot_per_seq_s * max(batch, 1.0)

    def predict(self, *, prompt_tokens: int, output_tokens: int, batch: int = 0,
                pending_prefill: int = 0) -> Prediction:
        """The request placed on a worker that holds ``batch`` leases, ``pending_prefill`` prompt tokens of which
        are still being prefilled."""
        tpot = self.tpot_at(batch + 1)
        ttft = self.prefill_s_per_token * (max(pending_prefill, 0) + max(prompt_tokens, 0)) + tpot
        return Prediction(ttft_s=ttft, tpot_s=tpot, total_s=ttft + tpot * max(output_tokens - 1, 0))

    def scaled(self, factor: float) -> SpeedEstimate:
        """The same worker ``factor`` times slower (a benchmark's slower GPU)."""
        return SpeedEstimate(self.prefill_s_per_token * factor, self.tpot_base_s * factor,
                             self.tpot_per_seq_s * factor, self.samples)
