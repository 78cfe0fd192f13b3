"""Gateway settings (env prefix GOODPUT_GATEWAY_)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from goodput_core.breaker import BreakerSettings
from goodput_core.settings import ServiceSettings, SettingsGroup, service_config

from goodput_gateway.profile import LatencyProfile


class QuotaSettings(SettingsGroup):
    """The per-tenant limits and budgets in Redis (goodput_gateway.quotas)."""

    prefix: str = Field("goodput:quota", description="Prefix of the quota counters' Redis keys.")
    timeout_s: float = Field(0.5, gt=0, description="Longest a quota step may wait on Redis; slower counts "
                                                    "as unreachable.")
    quantum_s: int = Field(0, ge=0, le=60, description="Requests-per-minute limits also enforced pro rata over "
                           "this many seconds (as OpenAI quantises them: rpm 600 with 1 s is 10 per second), so "
                           "a tenant cannot spend its minute in one burst; 0 = per minute only.")
    fail_open_share: float = Field(1.0, gt=0, le=1, description="Redis unreachable: the share of every rate "
                                   "and concurrency limit each replica enforces on its own, and of the "
                                   "budget Redis last showed left (1 / replicas keeps the total).")
    retry_s: float = Field(5.0, gt=0, description="After Redis failed, how long the local bound is used "
                                                  "before Redis is tried again.")


class MeteringSettings(SettingsGroup):
    """Metered usage (goodput_gateway.metering) and its GPU-seconds estimate."""

    usage_prefix: str = Field("goodput:usage", description="Prefix of the usage records' Redis keys.")
    retention_days: float = Field(400.0, gt=0, description="How long a month's or day's usage is kept.")
    flush_s: float = Field(1.0, gt=0, description="How often counted usage is written to Redis.")
    prefill_tokens_per_s: float = Field(10_000.0, gt=0, description="Estimated GPU-seconds: one GPU's "
                                                                    "prefill rate (prompt tokens/s).")
    decode_tokens_per_s: float = Field(2_500.0, gt=0, description="Estimated GPU-seconds: one GPU's decode "
                                                                  "throughput at a typical batch (tokens/s).")


class Limits(SettingsGroup):
    """Input bounds: every field a caller sends has one (REST 400/413/431, gRPC INVALID_ARGUMENT or
    RESOURCE_EXHAUSTED), checked before anything is spent on it."""

    prompt_chars: int = Field(32_768, ge=1, description="Largest prompt (sum of message contents), in "
                                                         "characters; token limits are the worker's.")
    messages: int = Field(256, ge=1, description="Most messages in one chat request.")
    tools_chars: int = Field(32_768, ge=2, description="Largest tools list of one request (its functions' names, "
                                                       "descriptions and parameter schemas), in characters.")
    choices: int = Field(8, ge=1, le=128, description="Most answers one request may ask for (n).")
    logit_bias: int = Field(300, ge=0, description="Most logit_bias entries in one request.")
    top_logprobs: int = Field(20, ge=0, le=20, description="Most top tokens per position a request may ask for "
                                                           "(top_logprobs; gRPC SamplingParams.logprobs).")
    response_schema_chars: int = Field(16_384, ge=2, description="Largest response_format JSON Schema (and gRPC "
                                                                 "SamplingParams.json_schema), in characters.")
    json_depth: int = Field(32, ge=4, le=256, description="Deepest nesting of arrays and objects in a REST body, a "
                                                          "batch line or a JSON Schema (OpenAI's own shapes need "
                                                          "6).")
    schema_repetition: int = Field(1000, ge=1, description="Largest repetition count (minItems, maxItems, "
                                                           "minLength, maxLength, min/maxProperties...) in a "
                                                           "response_format or tool JSON Schema: constrained "
                                                           "decoding compiles each into grammar states.")
    body_bytes: int = Field(1 << 20, ge=1024, description="Largest REST request body, chunked bodies included "
                                                          "(413 as soon as it is passed).")
    header_bytes: int = Field(16 << 10, ge=1024, description="Largest REST request head: the request line and "
                                                             "all headers together (431).")
    grpc_message_bytes: int = Field(4 << 20, ge=1024, description="Largest gRPC request message on the public "
                                                                  "port (RESOURCE_EXHAUSTED); read only after "
                                                                  "its API key is checked.")
    message_chars: int = Field(32_768, ge=1, description="Longest single message or prompt, in characters "
                                                         "(the whole prompt is bounded by max_prompt_chars).")
    name_chars: int = Field(256, ge=1, description="Longest identifier a caller sends: model, user (the session "
                                                   "id), prompt_cache_key, safety_identifier, knowledge base, "
                                                   "message name.")
    stop_sequences: int = Field(4, ge=0, description="Most stop sequences in one request, and most stop_token_ids.")
    stop_chars: int = Field(256, ge=1, description="Longest stop sequence, in characters.")
    query_chars: int = Field(2000, ge=1, description="Longest search query, in characters (longer is refused; "
                                                     "the RAG query is cut to rag_max_query_chars instead).")
    embed_input_chars: int = Field(32_768, ge=1, description="Longest embeddings input, in characters.")
    embed_batch: int = Field(256, ge=1, description="Most inputs in one embeddings request.")
    file_bytes: int = Field(16 << 20, ge=1024, description="Largest file uploaded to /v1/files (a batch's "
                                                            "input JSONL).")
    batch_requests: int = Field(10_000, ge=1, description="Most requests (lines) in one batch.")


class LadderSettings(SettingsGroup):
    """The degradation ladder (goodput_gateway.ladder)."""

    enabled: bool = Field(True, description="Take the latency profile's degradation ladder when a class "
                                            "misses its SLO or runs stages over budget (goodput_gateway."
                                            "ladder); false = never degrade.")
    interval_s: float = Field(2.0, gt=0, description="How often the ladder may move a class one step.")
    raise_at: float = Field(0.1, gt=0, le=1, description="Share of a class's recent requests missing "
                                                         "their SLO (or a budget) that takes the next step.")
    lower_at: float = Field(0.02, ge=0, le=1, description="Share below which the ladder steps back.")


class FeedbackSettings(SettingsGroup):
    """What became of each answer (POST /v1/feedback; goodput_gateway.feedback)."""

    ttl_s: float = Field(86_400.0, gt=0, description="How long an answer takes feedback (POST "
                                                     "/v1/feedback) after it was given.")
    max_local: int = Field(100_000, ge=1, description="Answers remembered for feedback in this process "
                                                      "(all of them when there is no Redis: REDIS_URL, else "
                                                      "QUOTA_REDIS_URL).")
    prefix: str = Field("goodput:feedback", description="Prefix of the feedback store's Redis keys.")
    flush_s: float = Field(0.05, gt=0, le=5, description="How often the answers kept for feedback are "
                           "written to Redis, together in one pipeline (not one write per answer); this "
                           "replica knows its own at once, the others within this long.")


class TraceSettings(SettingsGroup):
    """The workload trace (goodput_gateway.trace_recorder): capacity planning and simulator
    calibration."""

    path: str = Field("", description="File of the workload trace: one JSON line per sampled finished answer "
                                      "(arrival, class, model, prompt/cached/output tokens, max_tokens, "
                                      "finish, TTFT, TPOT; no prompt text, the tenant as a salted hash) in "
                                      "goodput_contracts.trace's format, for loadtests.replay and "
                                      "loadtests.calibrate; empty = off.")
    sample: float = Field(0.01, ge=0, le=1, description="Fraction of finished answers written to the trace "
                                                        "(drawn per request); 1 = every one.")
    max_bytes: int = Field(100 << 20, ge=1024, description="Size at which the trace file is renamed to "
                                                           "<path>.1 (replacing the previous one) and a new "
                                                           "one begun: at most twice this on disk.")
    salt: SecretStr = Field(SecretStr(""), description="Salt of the tenant's hash in the trace (the same on "
                                                       "every replica links a tenant's requests across "
                                                       "them); empty = a random salt per process.")


class RagSettings(SettingsGroup):
    """Retrieval-augmented generation (goodput_gateway.rag)."""

    top_k: int = Field(5, ge=1, le=50, description="RAG: chunks retrieved for a request.")
    rerank: bool = Field(False, description="RAG: ask the retriever to rerank its candidates (skipped by the "
                                            "ladder's skip_rerank step).")
    max_context_chars: int = Field(6000, ge=0, description="RAG: most characters of retrieved context "
                                                           "(also bounded by the model's context window).")
    max_query_chars: int = Field(2000, ge=1, description="RAG: the search query is the last user message, "
                                                         "cut to this length.")


class JobSettings(SettingsGroup):
    """Deferred batch work (goodput_gateway.jobs): parked P2 requests, POST /v1/jobs, the Batch API."""

    queue: str = Field("goodput-jobs", description="Celery queue of the job workers "
                                                   "(`celery -A goodput_gateway.worker worker -Q <queue>`).")
    prefix: str = Field("goodput:jobs", description="Prefix of the jobs' Redis keys.")
    worker_http_port: int = Field(9107, ge=0, le=65535, description="/metrics (and the probes' /healthz) of a "
                                                                   "Celery jobs worker (0 = none).")
    park_shed_p2: bool = Field(True, description="Park P2 requests the scheduler sheds as jobs (429 + job id).")
    deadline_s: float = Field(86_400.0, gt=0, description="A job not completed by then expires.")
    result_ttl_s: float = Field(7 * 86_400.0, gt=0, description="How long a finished job stays fetchable.")
    retry_base_s: float = Field(1.0, gt=0, description="First retry backoff of a parked job (doubles).")
    file_ttl_s: float = Field(30 * 86_400.0, gt=0, description="How long an uploaded or result file is kept.")
    retry_cap_s: float = Field(60.0, gt=0, description="Longest wait between a parked job's attempts.")
    lease_s: float = Field(60.0, gt=0, description="A jobs worker's claim on a running job lapses this long after "
                           "its last renewal (renewed every third of it while the job runs): a worker that dies "
                           "lets it lapse, and the job runs again.")
    lost_after_s: float = Field(600.0, gt=0, description="A waiting job whose message has not started it this "
                                "long after it was due is sent again (its message was lost; a copy that arrives "
                                "too is harmless: one attempt starts). Keep it above the longest queue wait.")
    sweep_interval_s: float = Field(15.0, ge=0, description="How often one jobs worker sweeps the jobs: sends "
                                    "lost messages again, requeues jobs whose worker died, expires jobs past "
                                    "their deadline (0 = no sweeper in this worker).")
    sweep_batch: int = Field(1000, ge=1, description="Most jobs of each kind one sweep handles.")
    mac_key: SecretStr = Field(SecretStr(""), description="Key of the MAC every job and batch record carries "
                               "(HMAC-SHA256; the gateways' and the jobs workers' own secret): a record another "
                               "Redis user wrote without it is never run nor shown. Required where jobs run.")
    mac_key_previous: SecretStr = Field(SecretStr(""), description="A key being rotated out: records it sealed "
                                        "still verify (new ones get mac_key). Empty = none.")


class ResponsesSettings(SettingsGroup):
    """Stored Responses API responses (goodput_gateway.responses)."""

    prefix: str = Field("goodput:responses", description="Prefix of stored responses' Redis keys (REDIS_URL, "
                                                         "else QUOTA_REDIS_URL; shared by every replica).")
    ttl_s: float = Field(30 * 86_400.0, gt=0, description="How long a stored response (and so its "
                                                          "previous_response_id continuation) is kept.")
    local_max: int = Field(10_000, ge=1, description="Without Redis: most responses kept in this process.")


class ResumeSettings(SettingsGroup):
    """Stream resume (goodput_gateway.resume)."""

    window_s: float = Field(0.0, ge=0, description="Stream resume: a streamed answer's events are numbered "
                            "(SSE `id:`, gRPC `seq`) and kept this long after the stream ended or its client "
                            "left; a client that reconnects within it (GET /v1/streams/{id} or the same POST "
                            "with Last-Event-ID; gRPC ResumeStream) gets the rest without a second "
                            "generation. A generation whose client left runs on while a resume is possible "
                            "and is cut when nobody has followed it for this long. 0 = off: a client that "
                            "goes away cancels its generation.")
    max_events: int = Field(4096, ge=1, description="Stream resume: most events kept per stream (the oldest "
                            "are dropped beyond it; resuming before them is 410).")
    max_bytes: int = Field(1 << 20, ge=1024, description="Stream resume: most bytes of events kept per "
                           "stream (the oldest are dropped beyond it).")
    flush_s: float = Field(0.05, gt=0, description="Stream resume: how often the events recorded since the "
                           "last write go to Redis, every stream's in one pipeline (a stream's first event at "
                           "once): a reconnect on another replica lags the stream by about this much.")
    redis_url: str = Field("", description="Stream resume: Redis of the event buffers, shared by every "
                           "replica (short-lived, rewritten at token rate: an instance without persistence "
                           "suits it); empty = REDIS_URL, else QUOTA_REDIS_URL; all empty = this process "
                           "only (a resume must reach the same replica).")
    prefix: str = Field("goodput:streams", description="Stream resume: prefix of the event buffers' Redis "
                        "keys.")
    local_max_bytes: int = Field(64 << 20, ge=1 << 16, description="Stream resume without Redis: most bytes "
                                 "of finished streams' events kept in this process (the oldest streams are "
                                 "dropped first).")
    max_total_bytes: int = Field(256 << 20, ge=1 << 20, description="Stream resume: most bytes of events "
                                 "all recordings (running and finished) hold in a replica's memory. Reaching it, "
                                 "finished streams kept here are forgotten first (oldest first); a running "
                                 "stream keeps only what its clients have yet to read (resuming before that is "
                                 "410); a new stream is served without a recording: its client gets every event, "
                                 "but it cannot be resumed (404) and its client leaving cancels it, as with "
                                 "resume off (goodput_gateway_stream_buffer_full_total).")
    max_followers_per_stream: int = Field(4, ge=1, description="Stream resume: most resumes following one "
                                          "stream at once on a replica (its client's own response aside); one "
                                          "more is 429 `too_many_stream_followers`.")
    max_followers_per_tenant: int = Field(256, ge=1, description="Stream resume: most resumes following a "
                                          "tenant's streams at once on a replica; one more is 429 "
                                          "`too_many_tenant_followers`.")
    max_reader_connections: int = Field(64, ge=1, description="Stream resume: most Redis connections a "
                                        "replica's resumes read with (a pool of their own, apart from the "
                                        "writes): a resume waits for a free one, and is 503 `store_unavailable` "
                                        "after 5 s without one.")
    stall_timeout_s: float = Field(30.0, gt=0, description="Stream resume: a client following a running "
                                   "stream that falls RESUME__MAX_EVENTS or RESUME__MAX_BYTES behind paces the "
                                   "generation (it waits for the client, keeping its worker slot, within the "
                                   "request's deadline); one that reads nothing for this long is let go: the "
                                   "generation goes on without it, and it gets 410 `stream_events_dropped` "
                                   "once the events it missed are dropped.")


class QuarantineSettings(SettingsGroup):
    """Requests suspected of crashing their inference worker (goodput_gateway.quarantine)."""

    ttl_s: float = Field(600.0, ge=0, description="A request whose worker was lost after accepting it is suspected "
                         "of the crash when the worker held it alone (no other request of this replica on it, and "
                         "the scheduler's last count of its leases no higher), or when it is the second worker lost "
                         "with the same request within this time; a worker lost with several requests suspects none "
                         "of them (a kill or a rollout: they go on on other workers). A suspected request is not "
                         "retried, continued nor parked as a job, it is counted, and the same request (a hash of "
                         "tenant, model, prompt, tools and sampling; never the content) is refused for this long "
                         "(422 / FAILED_PRECONDITION request_quarantined). In this replica only (each gateway "
                         "replica and jobs worker keeps its own; a restart forgets it). 0 = off: every worker lost "
                         "mid-request is taken for an outage and the request goes on elsewhere.")
    max_entries: int = Field(10_000, ge=1, description="Most requests remembered, quarantined or lost once with a "
                             "worker (the oldest are forgotten first).")


class GatewaySettings(ServiceSettings):
    model_config = service_config("GOODPUT_GATEWAY_", nested=True)

    grpc_port: int = 50051
    http_port: int = Field(8080, description="REST API (OpenAI-compatible) and /healthz.")
    metrics_port: int = Field(8090, ge=0, le=65535, description="/metrics (and /healthz) for the scraper, never on "
                                                                "the public REST port: its tenant and key counts are "
                                                                "not the callers'; 0 = no /metrics.")
    scheduler_addr: str = Field("127.0.0.1:50052", description="Scheduler gRPC address: one, a comma-separated list "
                                                            "of its replicas' ip:port, or a dns:/// name resolving "
                                                            "to them (calls go to the leader).")
    api_keys_file: str = Field("", description="JSON file of API keys (mount a Secret here).")
    api_keys: str = Field("", description="The same JSON inline (from a secretKeyRef). Merged with the file.")
    api_keys_reload_s: float = Field(2.0, ge=0, description="How often the keys file is checked for changes and "
                                                            "re-read (a rotated key stops working); 0 = never.")
    # ---- tenants: quotas (goodput_gateway.quotas) and metering (goodput_gateway.metering) ----
    quota_redis_url: str = Field("", description="Redis of the per-tenant limits, budgets, usage and storage "
                                                 "ledger (goodput_gateway.storage), shared by every replica; give it "
                                                 "an instance apart from redis_url's, so that no store can fill it; "
                                                 "empty = redis_url; both empty = counters in this process (right "
                                                 "for one replica only).")
    metrics_tenants: str = Field("", description="Tenants with a label of their own in the per-tenant metrics, "
                                                 "comma-separated; \"*\" = all (few tenants only); others are "
                                                 "\"other\".")
    # ---- input bounds: every field a caller sends has one (REST 400/413/431, gRPC INVALID_ARGUMENT or
    # RESOURCE_EXHAUSTED), checked before anything is spent on it ----
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request does not set it "
                                                           "(capped by the context window).")
    request_timeout_s: float = Field(300.0, gt=0, description="Longest deadline of any request end to end: a "
                                                              "caller's (gRPC deadline, X-Goodput-Deadline-Ms or "
                                                              "Request-Timeout-Ms header) or its class's is capped "
                                                              "by it.")
    # ---- workload trace (goodput_gateway.trace_recorder): capacity planning and simulator calibration ----
    breakers: BreakerSettings = Field(default_factory=BreakerSettings,
                                      description="Circuit breakers in front of the cache, retriever, embedder and "
                                                  "scheduler (goodput_core.breaker), JSON, e.g. "
                                                  '{"failure_threshold": 5, "reset_timeout_s": 5}.')
    latency_profile: LatencyProfile = Field(
        default_factory=LatencyProfile,
        description='Per class (P0, P1, P2): default deadline, stage budgets, SLO and degradation ladder, JSON '
                    'overriding the defaults field by field, e.g. {"P0": {"deadline_s": 30, "budgets": '
                    '{"cache_lookup": 0.05}, "slo": {"ttft_s": 1}}} (goodput_gateway.profile).')
    models_cache_s: float = Field(2.0, ge=0, description="How long the list of served models is reused.")
    model_fallbacks: dict[str, str] = Field(
        default_factory=dict, description='Lighter models that answer for a model when its pool is saturated (the '
                                          'scheduler sheds or its queue is full) or down (no healthy worker, the '
                                          'scheduler unavailable), JSON {"qwen-72b": "qwen-7b"}; opt-in per model '
                                          "here and per key (model_fallback in the keys file). The answer's `model` "
                                          "and X-Goodput-Degraded: model_fallback say so.")
    auto_models: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description='Models `model: "auto"` may choose from, comma-separated; empty = every '
                                          "model served. Auto picks the cheapest pool predicted to meet the "
                                          "request's class SLO (goodput_gateway.autoroute); list only models whose "
                                          "answers are good enough for what is sent as auto.")
    speculative_start: bool = Field(False, description="Opt-in. Start the worker call on the worker the scheduler "
                                                       "granted last for the same model, class and session while "
                                                       "the lease is being granted, where that worker had slots to "
                                                       "spare, so the lease's "
                                                       "round trip overlaps the worker's start; a grant elsewhere, a "
                                                       "queued lease or a refusal cancels it (the worker aborts it) "
                                                       "before the caller sees anything (a wrong guess costs the "
                                                       "guessed worker what it did before the cancel, up to a "
                                                       "prefill step). false = the worker is called after the grant.")
    embedder_addr: str = Field("", description="Embedder gRPC address (embeddings, indexing); empty = off.")
    retriever_addr: str = Field("", description="Retriever gRPC address (search, RAG); empty = off.")
    knowledge_timeout_s: float = Field(30.0, gt=0, description="Timeout of an embed, search or index call.")
    # ---- response cache (goodput_gateway.caching) ----
    cache_addr: str = Field("", description="Cache service gRPC address; empty = no response cache.")
    cache_semantic: bool = Field(True, description="Allow semantic (L2) hits; exact (L1) only when false.")
    cache_timeout_s: float = Field(0.25, gt=0, description="Longest a cache lookup may take; slower is served "
                                                           "uncached (fail-open).")
    # ---- deferred batch work (goodput_gateway.jobs) ----
    redis_url: str = Field("", description="Redis of the data tenants store: deferred jobs (store and Celery "
                                           "broker), files, batches, stored responses, answers kept for feedback, "
                                           "stream-resume recordings; empty = jobs off (shed P2 requests get "
                                           "their 429 and are not parked), the rest on QUOTA_REDIS_URL.")
    # ---- stream resume (goodput_gateway.resume) ----

    quotas: QuotaSettings = Field(default_factory=QuotaSettings)
    metering: MeteringSettings = Field(default_factory=MeteringSettings)
    limits: Limits = Field(default_factory=Limits)
    ladder: LadderSettings = Field(default_factory=LadderSettings)
    feedback: FeedbackSettings = Field(default_factory=FeedbackSettings)
    trace: TraceSettings = Field(default_factory=TraceSettings)
    rag: RagSettings = Field(default_factory=RagSettings)
    jobs: JobSettings = Field(default_factory=JobSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    resume: ResumeSettings = Field(default_factory=ResumeSettings)
    quarantine: QuarantineSettings = Field(default_factory=QuarantineSettings)

    @model_validator(mode="after")
    def _metrics_apart(self) -> GatewaySettings:
        if self.metrics_port and self.metrics_port == self.http_port:
            raise ValueError(f"metrics_port {self.metrics_port} is the public REST port (http_port): give /metrics "
                             "a port of its own")
        return self

    @field_validator("auto_models", mode="before")
    @classmethod
    def _split_models(cls, value: object) -> object:
        if isinstance(value, str):
            return [m.strip() for m in value.split(",") if m.strip()]
        return value
