"""Scheduler settings (env prefix GOODPUT_SCHEDULER_).

What an operator sets: the workers and how they are found and checked, the per-worker cap, the priority classes'
queues and shares, shedding, leader election, and the placement profile. Related knobs are grouped (a pydantic model
per group: ``GOODPUT_SCHEDULER_<GROUP>__<FIELD>``, or the whole group as JSON in ``GOODPUT_SCHEDULER_<GROUP>``):
``GUARD`` (the latency guard and the P0-ready reserve), ``SATURATION`` (what counts as overload), ``PREDICT``
(deadline prediction and its priors), ``MUX`` (bounds of the lease stream). Placement parameters (the prefill gate's
budget, the load score's weights, prefix and session affinity) live only in the placement profile
(:mod:`goodput_scheduler.placement.profile`), and knobs a benchmark settled are named constants beside the code that
uses them (:data:`goodput_scheduler.guard.P0_READY_PER_TTFT`).

Example:
    >>> import os
    >>> os.environ["GOODPUT_SCHEDULER_GUARD__P0_TTFT_SLO_RATIO"] = "1.25"
    >>> SchedulerSettings().guard.p0_ttft_slo_ratio
    1.25
    >>> del os.environ["GOODPUT_SCHEDULER_GUARD__P0_TTFT_SLO_RATIO"]
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from goodput_contracts.speed import SpeedEstimate
from goodput_core.settings import ServiceSettings, SettingsGroup, SharingGroupsSetting, service_config

from goodput_scheduler.endpointslices import SCHEME, ServiceTarget
from goodput_scheduler.predict import DEFAULT_SPEED_PRIOR

__all__ = ["GuardSettings", "MuxSettings", "PredictSettings", "SaturationSettings", "SchedulerSettings"]


class GuardSettings(SettingsGroup):
    """The latency guard (goodput_scheduler.guard): P1/P2 leases per worker adapt (AIMD) so P0's TTFT stays near its
    unloaded value, and while P0 traffic is present some workers are kept free of P1/P2 prefill for it."""

    enabled: bool = Field(True, description="Adapt the P1/P2 leases a worker may hold to keep P0's TTFT within "
                                            "p0_ttft_slo_ratio of its unloaded value (and keep the P0-ready reserve); "
                                            "off = only the class shares bound P1/P2.")
    p0_ttft_target_s: float = Field(0.0, ge=0, description="P0 TTFT the guard defends; 0 = p0_ttft_slo_ratio x the "
                                                           "learned unloaded P0 TTFT.")
    p0_ttft_slo_ratio: float = Field(1.5, gt=1, description="Target P0 TTFT as a multiple of its unloaded value "
                                     "(lower: P0 closer to unloaded, more P1/P2 held back and shed).")
    p0_ready_workers: int = Field(1, ge=0, description="While P0 traffic is present, at least this many workers are "
                                  "kept free of P1/P2 prefill (only decoding), so a new P0 prompt starts at the next "
                                  "engine step instead of after a batch prompt's chunk; more as P0 arrives faster "
                                  "(guard.P0_READY_PER_TTFT). Never all workers. Costs up to this share of the fleet's "
                                  "batch-prefill throughput while it lasts; 0 = off.")
    p0_recent_s: float = Field(30.0, gt=0, description="P0 traffic counts as present for this long after a P0 "
                                                       "request arrives (for p0_ready_workers).")
    interval_s: float = Field(1.0, gt=0, description="Seconds between the guard's adjustments.")
    percentile: float = Field(0.95, gt=0, lt=1, description="P0 TTFT percentile the guard compares to the target.")
    min_samples: int = Field(8, ge=1, description="P0 TTFTs the guard waits for before a verdict (at most ten "
                                                  "intervals).")
    decrease: float = Field(0.5, gt=0, lt=1, description="Factor applied to the P1/P2 limit when P0 misses the target.")


class SaturationSettings(SettingsGroup):
    """What counts as saturation 1.0, the overload signal SHED_P2_AT and SHED_P1_AT are compared with (the largest of
    the three)."""

    queue_s: float = Field(5.0, gt=0, description="Queued work worth this many seconds of the observed drain rate.")
    kv: float = Field(0.9, gt=0, le=1, description="Mean KV-cache usage of the workers.")
    gpu: float = Field(0.98, gt=0, le=1, description="Mean GPU utilisation of the workers (ignored without GPUs).")


class PredictSettings(SettingsGroup):
    """Deadline prediction (goodput_scheduler.predict) and the speed priors every worker starts from."""

    deadlines: bool = Field(True, description="Refuse at once a request predicted not to finish before its deadline "
                                              "(queue wait plus its predicted service time): 504, or 429 + "
                                              "Retry-After when it would fit once the queue ahead has drained.")
    prefill_s_per_token: float = Field(DEFAULT_SPEED_PRIOR.prefill_s_per_token, ge=0,
                                       description="Prior of the prefill time per prompt token, until requests have "
                                                   "finished.")
    tpot_s: float = Field(DEFAULT_SPEED_PRIOR.tpot_base_s, ge=0, description="Prior of the decode time per output "
                          "token, until requests have finished (optimistic: nothing is refused for want of data).")
    tpot_per_seq_s: float = Field(DEFAULT_SPEED_PRIOR.tpot_per_seq_s, ge=0, description="Prior of what each sequence "
                                  "in a batch adds to the decode time per token (each worker's own line is learned "
                                  "from its finished leases).")

    def speed_prior(self) -> SpeedEstimate:
        """Every worker's speed until its own leases have taught the scheduler better."""
        return SpeedEstimate(prefill_s_per_token=self.prefill_s_per_token, tpot_base_s=self.tpot_s,
                             tpot_per_seq_s=self.tpot_per_seq_s)


class MuxSettings(SettingsGroup):
    """Bounds of the multiplexed lease stream (LeaseBatches, the gateway's one lease path)."""

    max_leases: int = Field(10_000, ge=1, description="Leases one stream may hold open at once.")
    max_batch: int = Field(4096, ge=1, le=1_000_000, description="Lease messages one LeaseBatches message may carry "
                           "(a gateway sends what queued up behind its previous write, 512 at most); a larger batch "
                           "ends the stream INVALID_ARGUMENT.")


class SchedulerSettings(ServiceSettings):
    model_config = service_config("GOODPUT_SCHEDULER_", nested=True)

    grpc_port: int = 50052
    http_port: int = 9102
    workers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Inference workers, comma-separated: host:port; dns:///name:port (every address the name "
                    "resolves to, re-resolved; a headless Service); or k8s:///namespace/service:port, the "
                    "Service's EndpointSlices watched through the Kubernetes API (needs get/list/watch on "
                    "endpointslices), where port is a Service port's name or a number: a ready endpoint is placed "
                    "on, a terminating or unready one drains (no new grants, its leases finish), a vanished one is "
                    "removed once its leases are released.")
    discovery_interval_s: float = Field(5.0, gt=0, description="Seconds between DNS look-ups of `dns:///` "
                                                                "worker entries.")
    kube_api_url: str = Field("", description="Kubernetes API server URL for `k8s:///` worker entries, used as is "
                              "without credentials (e.g. `kubectl proxy`'s http://127.0.0.1:8001); empty = the pod's "
                              "service account in a cluster, else the kubeconfig (KUBECONFIG or ~/.kube/config).")
    worker_drain_timeout_s: float = Field(120.0, gt=0, description="Longest a worker whose Kubernetes endpoint is gone "
                                          "is kept for its leases to be released before it is removed anyway.")
    health_interval_s: float = Field(1.0, gt=0, description="Seconds between health/load checks of a worker.")
    health_timeout_s: float = Field(1.0, gt=0, description="Timeout of one health or load check.")
    unhealthy_after: int = Field(2, ge=1, description="Consecutive failed checks that eject a worker.")
    healthy_after: int = Field(1, ge=1, description="Consecutive passed checks that re-admit a worker.")
    max_inflight_per_worker: int = Field(0, ge=0, description="Leases one worker may hold at once; 0 = the worker's "
                                                              "own engine batch size (the max_num_seqs it reports, "
                                                              "64 until it has), so each pool's batch limit holds.")
    # ---- priority classes: queue depth (0 = unbounded) and longest queue wait (0 = no hard timeout) ----
    p0_max_queue: int = Field(20, ge=0, description="P0 (interactive) requests that may wait; more are shed. "
                                                   "0 = unbounded.")
    p0_timeout_s: float = Field(30.0, ge=0, description="Longest a P0 request waits in the queue (0 = none).")
    p1_max_queue: int = Field(100, ge=0, description="P1 (near-real-time) requests that may wait; 0 = unbounded.")
    p1_timeout_s: float = Field(60.0, ge=0, description="Longest a P1 request waits in the queue (0 = none).")
    p2_max_queue: int = Field(0, ge=0, description="P2 (batch) requests that may wait; 0 = unbounded.")
    p2_timeout_s: float = Field(0.0, ge=0, description="Longest a P2 request waits in the queue (0 = none).")
    p1_max_share: float = Field(0.9, gt=0, le=1, description="P1 is granted only while a worker holds fewer than "
                                                             "this share of its cap (headroom kept for P0).")
    p2_max_share: float = Field(0.75, gt=0, le=1, description="P2 is granted only while a worker holds fewer "
                                                              "than this share of its cap.")
    queue_policy: Literal["priority", "fifo"] = Field(
        "priority", description="`priority`: strict priority between classes, tenant fairness and deadlines "
                                "inside one; `fifo`: one arrival-order queue, no shedding by class (a baseline).")
    fifo_max_queue: int = Field(200, ge=0, description="queue_policy=fifo: requests that may wait; 0 = unbounded.")
    guard: GuardSettings = Field(default_factory=GuardSettings)
    # ---- overload: a saturation signal with hysteresis sheds P2, then P1 ----
    shed_p2_at: float = Field(1.0, gt=0, description="Saturation at or above which new P2 requests are shed.")
    shed_p1_at: float = Field(2.0, gt=0, description="Saturation at or above which new P1 requests are shed too.")
    shed_hysteresis: float = Field(0.2, ge=0, description="Saturation must fall this far below a threshold "
                                                          "before that class is admitted again.")
    saturation: SaturationSettings = Field(default_factory=SaturationSettings)
    predict: PredictSettings = Field(default_factory=PredictSettings)
    # ---- placement: the steps and their parameters are the profile's (goodput_scheduler.placement.profile) ----
    profile: str = Field("", description="Placement profile: JSON, or the path of a JSON/YAML file (filters, weighted "
                         "scorers, picker, each step's parameters); empty = the default profile.")
    cache_sharing_groups: SharingGroupsSetting = Field(
        default_factory=dict, description='Prefix and session affinity: tenants whose prompts count for each other, '
        'JSON {"group": ["tenant-a", "tenant-b"]} (the workers\' setting of the same name); affinity never crosses '
        "other tenants.")
    no_worker_wait_s: float = Field(10.0, ge=0, description="How long a request waits for a healthy worker "
                                                            "to appear before UNAVAILABLE.")
    leader_election: Literal["none", "redis", "kubernetes"] = Field(
        "none", description="Active-passive replicas (goodput_scheduler.leader): `none` = this replica always leads "
                            "(run one); `redis` = a lock key in LEADER_REDIS_URL; `kubernetes` = a "
                            "coordination.k8s.io Lease (LEADER_LEASE_NAME in LEADER_NAMESPACE).")
    leader_redis_url: str = Field("", description="leader_election=redis: the Redis holding the lock.")
    leader_key: str = Field("goodput:scheduler:leader", min_length=1, description="leader_election=redis: the "
                                                                                 "lock's key.")
    leader_lease_name: str = Field("goodput-scheduler", min_length=1, description="leader_election=kubernetes: "
                                                                                 "the Lease's name.")
    leader_namespace: str = Field("", description="leader_election=kubernetes: the Lease's namespace; empty = the "
                                                  "pod's own (POD_NAMESPACE, or the service account's).")
    leader_ttl_s: float = Field(3.0, gt=0, le=60, description="A leader that has not renewed for this long is "
                                                             "replaced (the failover time after a crash).")
    leader_renew_s: float = Field(1.0, gt=0, le=20, description="How often the leader renews; it steps down when "
                                                               "it cannot renew within leader_ttl_s minus this.")
    leader_retry_s: float = Field(0.5, gt=0, le=20, description="How often a standby tries to take the lead.")
    mux: MuxSettings = Field(default_factory=MuxSettings)

    @field_validator("workers", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [w.strip() for w in value.split(",") if w.strip()]
        return value

    @field_validator("workers")
    @classmethod
    def _check_k8s_entries(cls, value: list[str]) -> list[str]:
        for entry in value:
            if entry.startswith(SCHEME):
                ServiceTarget.parse(entry)  # ValueError names the expected form
        return value

    @model_validator(mode="after")
    def _check_election(self) -> SchedulerSettings:
        if self.leader_election != "none" and not self.leader_renew_s < self.leader_ttl_s:
            raise ValueError("leader_renew_s must be shorter than leader_ttl_s")
        if self.leader_election == "redis" and not self.leader_redis_url:
            raise ValueError("leader_election=redis needs leader_redis_url")
        return self
