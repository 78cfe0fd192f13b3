{{/*
Shared snippets. Every service is rendered by the same generic templates (configmap, deployment,
service, hpa, pdb, servicemonitor, networkpolicy) from a context dict:
  (dict "root" $ "svc" "<values key>")
and the static facts of the service in "goodput.serviceMeta" (ports, env prefix, component, who may call
it and whom it calls), which follow the topology of libs/contracts (goodput_contracts.topology) and
docs/services.md; tests/chart/test_chart_topology.py fails when they drift apart. A Celery worker has no gRPC port (grpcPort 0) and
names its app, the setting holding its queue and the setting of its metrics port (httpPortSetting,
default HTTP_PORT) in its meta.
*/}}

{{- define "goodput.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "goodput.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "goodput.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels shared by every resource of the release; pass the root context. */}}
{{- define "goodput.commonLabels" -}}
app.kubernetes.io/name: {{ include "goodput.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{ include "goodput.releaseLabels" . }}
{{- end }}

{{- define "goodput.releaseLabels" -}}
helm.sh/chart: {{ include "goodput.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: goodput
{{- end }}

{{/* Static facts of every service (docs/services.md). */}}
{{- define "goodput.serviceMeta" -}}
gateway:
  component: gateway
  prefix: GOODPUT_GATEWAY_
  grpcPort: 50051
  httpPort: 8080
  ingressFrom: []
  egressTo: [scheduler, inference, cache, retriever, embedder]
  external: [redis]
scheduler:
  component: scheduler
  prefix: GOODPUT_SCHEDULER_
  grpcPort: 50052
  httpPort: 9102
  ingressFrom: [gateway, jobsWorker]
  egressTo: [inference]
  external: []
inference:
  component: inference
  prefix: GOODPUT_INFERENCE_
  grpcPort: 50061
  httpPort: 9161
  ingressFrom: [gateway, scheduler, jobsWorker]
  egressTo: []
  external: []
embedder:
  component: embedder
  prefix: GOODPUT_EMBEDDER_
  grpcPort: 50053
  httpPort: 9103
  ingressFrom: [gateway, retriever, cache, jobsWorker]
  {{- /* The indexer writes through the retriever's IndexStore, the single owner of the stores. */}}
  egressTo: [retriever]
  external: [redis, qdrant, elasticsearch]
retriever:
  component: retriever
  prefix: GOODPUT_RETRIEVER_
  grpcPort: 50054
  httpPort: 9104
  ingressFrom: [gateway, embedder, indexWorker, jobsWorker]
  egressTo: [embedder]
  external: [qdrant, elasticsearch]
cache:
  component: cache
  prefix: GOODPUT_CACHE_
  grpcPort: 50055
  httpPort: 9105
  ingressFrom: [gateway, jobsWorker]
  egressTo: [embedder]
  external: [redis]
indexWorker:
  component: indexing-worker
  prefix: GOODPUT_EMBEDDER_
  grpcPort: 0
  httpPort: 9106
  httpPortSetting: WORKER_HTTP_PORT
  celery: {app: goodput_embedder.jobs, queueSetting: INDEX_QUEUE}
  ingressFrom: []
  {{- /* A job embeds in-process and writes through the retriever. */}}
  egressTo: [retriever]
  external: [redis, qdrant, elasticsearch]
jobsWorker:
  component: jobs-worker
  prefix: GOODPUT_GATEWAY_
  grpcPort: 0
  httpPort: 9107
  httpPortSetting: JOBS__WORKER_HTTP_PORT
  celery: {app: goodput_gateway.worker, queueSetting: JOBS__QUEUE}
  ingressFrom: []
  {{- /* A job runs through the gateway's own pipeline, so it calls what the gateway calls. */}}
  egressTo: [scheduler, inference, cache, retriever, embedder]
  external: [redis]
{{- end }}

{{/* The meta dict of one service: include "goodput.meta" $ctx | fromYaml */}}
{{- define "goodput.meta" -}}
{{- $all := include "goodput.serviceMeta" . | fromYaml }}
{{- index $all .svc | toYaml }}
{{- end }}

{{/* A number as a plain string: whole floats (YAML ints arrive as float64) without an exponent. */}}
{{- define "goodput.num" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/* Values of one service. */}}
{{- define "goodput.values" -}}
{{- index .root.Values .svc | toYaml }}
{{- end }}

{{/* Name of a component's resources: <fullname>-<component>, and -<pool> for an inference pool.
ctx: root, svc (, pool) */}}
{{- define "goodput.componentName" -}}
{{- $meta := include "goodput.meta" . | fromYaml }}
{{- $name := printf "%s-%s" (include "goodput.fullname" .root) $meta.component }}
{{- with .pool }}{{ $name = printf "%s-%s" $name . }}{{ end }}
{{- $name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of a component's resources. ctx: root, svc */}}
{{- define "goodput.labels" -}}
{{ include "goodput.releaseLabels" .root }}
{{ include "goodput.selectorLabels" . }}
{{- end }}

{{/* Selector labels of a component, and goodput.dev/pool for an inference pool (a selector without the pool, as the
NetworkPolicies' peers use, matches every pool's workers). ctx: root, svc (, pool) */}}
{{- define "goodput.selectorLabels" -}}
{{- $meta := include "goodput.meta" . | fromYaml -}}
app.kubernetes.io/name: {{ include "goodput.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ $meta.component }}
{{- with .pool }}
goodput.dev/pool: {{ . }}
{{- end }}
{{- end }}

{{/* Merges the map src into the map dst, in place: maps key by key, anything else (lists included) replaced. Unlike
mergeOverwrite it also applies false, 0 and empty values. dict "dst" "src" */}}
{{- define "goodput.deepMerge" -}}
{{- $dst := .dst }}
{{- range $k, $v := .src }}
{{- if and (kindIs "map" $v) (kindIs "map" (index $dst $k)) }}
{{- include "goodput.deepMerge" (dict "dst" (index $dst $k) "src" $v) }}
{{- else }}
{{- $_ := set $dst $k (deepCopy $v) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The inference values of one pool (YAML): inference's, with the pool's overrides and shorthands applied and the
pool itself under `pool` (name, classes, engine, aliases). dict "root" "pool" */}}
{{- define "goodput.poolValues" -}}
{{- $p := .pool }}
{{- $v := deepCopy .root.Values.inference }}
{{- $_ := unset $v "pools" }}
{{- $over := omit $p "name" "classes" "engine" "aliases" "gpu" "tensorParallelSize" "maxNumSeqs" "maxNumBatchedTokens"
  "costPerHour" }}
{{- include "goodput.deepMerge" (dict "dst" $v "src" $over) }}
{{- range $key := list "tensorParallelSize" "maxNumSeqs" "maxNumBatchedTokens" }}
{{- if hasKey $p $key }}{{ $_ := set $v.vllm $key (index $p $key) }}{{ end }}
{{- end }}
{{- $gpu := $p.gpu | default dict }}
{{- if hasKey $gpu "enabled" }}{{ $_ := set $v.gpu "enabled" $gpu.enabled }}{{ end }}
{{- with $gpu.count }}{{ $_ := set $v.gpu "count" . }}{{ end }}
{{- with $gpu.type }}
{{- $_ := set $v "nodeSelector" (merge (dict "nvidia.com/gpu.product" .) ($v.nodeSelector | default dict)) }}
{{- end }}
{{- $_ := set $v "pool" (dict "name" $p.name "classes" ($p.classes | default list) "engine" ($p.engine | default "")
  "aliases" ($p.aliases | default list) "costPerHour" ($p.costPerHour | default 0)) }}
{{- toYaml $v }}
{{- end }}

{{/* Checks of inference.pools that the schema cannot express. Pass the root context. */}}
{{- define "goodput.validatePools" -}}
{{- $seen := dict }}
{{- range $pool := .Values.inference.pools }}
{{- if hasKey $seen .name }}
{{- fail (printf "inference.pools: the name %q is used twice" .name) }}
{{- end }}
{{- $_ := set $seen .name true }}
{{- $tp := .tensorParallelSize | default ($.Values.inference.vllm.tensorParallelSize) | int }}
{{- with (.gpu | default dict).count }}
{{- if lt (int .) $tp }}
{{- fail (printf "inference.pools[%s]: gpu.count (%v) is below its tensor-parallel size (%v)" $pool.name . $tp) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The scheduler's own ServiceAccount when it watches EndpointSlices (scheduler.discovery kubernetes): the only
pod that talks to the API server, so the only one with a token and a Role. Empty otherwise. */}}
{{- define "goodput.schedulerServiceAccountName" -}}
{{- if and .Values.scheduler.enabled (or (eq .Values.scheduler.discovery "kubernetes") (eq .Values.scheduler.leaderElection "kubernetes")) }}
{{- include "goodput.componentName" (dict "root" . "svc" "scheduler") }}
{{- end }}
{{- end }}

{{- define "goodput.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "goodput.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Full image reference of a service. ctx: root, svc */}}
{{- define "goodput.image" -}}
{{- $v := index .root.Values .svc }}
{{- $g := .root.Values.global }}
{{- $tag := $v.image.tag | default $g.imageTag | default .root.Chart.AppVersion }}
{{- printf "%s%s:%s" $g.imageRegistry $v.image.repository $tag }}
{{- end }}

{{/* In-cluster gRPC address of a service. ctx: root, svc */}}
{{- define "goodput.grpcAddr" -}}
{{- $meta := include "goodput.meta" . | fromYaml }}
{{- printf "%s:%v" (include "goodput.componentName" .) $meta.grpcPort }}
{{- end }}

{{/* True ("true") when a service is enabled. The jobs workers also need the gateway and its Redis
(gateway.config.useRedis): without them no job is ever parked. ctx: root, svc */}}
{{- define "goodput.enabled" -}}
{{- $on := (index .root.Values .svc).enabled }}
{{- if eq .svc "jobsWorker" }}
{{- $gw := .root.Values.gateway }}
{{- $on = and $on $gw.enabled $gw.config.useRedis }}
{{- end }}
{{- if $on }}true{{ end }}
{{- end }}

{{/*
Plain (non-secret) settings of a service as a flat name -> string map; rendered into its ConfigMap
and loaded with envFrom. ctx: root, svc
*/}}
{{- define "goodput.config" -}}
{{- $root := .root }}
{{- $v := index $root.Values .svc }}
{{- $meta := include "goodput.meta" . | fromYaml }}
{{- $p := $meta.prefix }}
{{- $c := $root.Values.common }}
{{- $env := dict }}
{{- /* GRPC_HOST is where every server of the process binds, the Celery workers' metrics included:
the kubelet probes the pod IP. */}}
{{- $_ := set $env (printf "%sGRPC_HOST" $p) "0.0.0.0" }}
{{- if $meta.grpcPort }}
{{- $_ := set $env (printf "%sGRPC_PORT" $p) (toString $meta.grpcPort) }}
{{- end }}
{{- $_ := set $env (printf "%s%s" $p ($meta.httpPortSetting | default "HTTP_PORT")) (toString $meta.httpPort) }}
{{- $_ := set $env (printf "%sLOG_LEVEL" $p) $c.logLevel }}
{{- $_ := set $env (printf "%sLOG_FORMAT" $p) $c.logFormat }}
{{- $_ := set $env (printf "%sOTEL_EXPORTER" $p) $c.otel.exporter }}
{{- $_ := set $env (printf "%sDRAIN_GRACE_S" $p) (include "goodput.num" $v.drainGraceSeconds) }}
{{- with (include "goodput.metricsPort" .) }}
{{- $_ := set $env (printf "%sMETRICS_PORT" $p) . }}
{{- end }}
{{- /* Always set, empty included: an empty value gives gRPC's defaults over the images' ENV. */}}
{{- $_ := set $env "GRPC_EXPERIMENTS" ($c.grpcExperiments | default "") }}
{{- if $c.otel.endpoint }}
{{- $_ := set $env "OTEL_EXPORTER_OTLP_ENDPOINT" $c.otel.endpoint }}
{{- end }}
{{- if $root.Values.tls.insecure }}
{{- $_ := set $env (printf "%sINSECURE_INTERNAL" $p) "true" }}
{{- else }}
{{- $mount := $root.Values.tls.mountPath }}
{{- $_ := set $env (printf "%sTLS_CERT_FILE" $p) (printf "%s/tls.crt" $mount) }}
{{- $_ := set $env (printf "%sTLS_KEY_FILE" $p) (printf "%s/tls.key" $mount) }}
{{- $_ := set $env (printf "%sTLS_CA_FILE" $p) (printf "%s/ca.crt" $mount) }}
{{- $_ := set $env (printf "%sTLS_TRUST_DOMAIN" $p) $root.Values.tls.trustDomain }}
{{- $_ := set $env (printf "%sTLS_RELEASE" $p) (include "goodput.tlsRelease" $root) }}
{{- end }}
{{- $_ := set $env "OTEL_SERVICE_NAME" (printf "goodput-%s" $meta.component) }}
{{- /* Writable locations: the root filesystem is read-only. */}}
{{- $_ := set $env "HOME" "/tmp" }}
{{- $_ := set $env "XDG_CACHE_HOME" "/cache" }}
{{- $_ := set $env "PYTHONDONTWRITEBYTECODE" "1" }}
{{- $extra := include (printf "goodput.config.%s" .svc) . | fromYaml }}
{{- range $k, $val := $extra }}
{{- /* An empty setting is left out so the service's own default applies. */}}
{{- if ne (toString $val) "" }}
{{- $_ := set $env $k (toString $val) }}
{{- end }}
{{- end }}
{{- range $k, $val := $v.env }}
{{- $_ := set $env $k (include "goodput.num" $val) }}
{{- end }}
{{- toYaml $env }}
{{- end }}

{{- define "goodput.config.gateway" -}}
{{- $v := .root.Values.gateway }}
{{- $p := "GOODPUT_GATEWAY_" }}
{{ $p }}SCHEDULER_ADDR: {{ include "goodput.grpcAddr" (dict "root" .root "svc" "scheduler") | quote }}
{{ $p }}LIMITS__PROMPT_CHARS: {{ include "goodput.num" $v.config.maxPromptChars | quote }}
{{ $p }}LIMITS__MESSAGES: {{ include "goodput.num" $v.config.maxMessages | quote }}
{{ $p }}LIMITS__BODY_BYTES: {{ include "goodput.num" $v.config.maxBodyBytes | quote }}
{{ $p }}REQUEST_TIMEOUT_S: {{ include "goodput.num" $v.config.requestTimeoutSeconds | quote }}
{{ $p }}LATENCY_PROFILE: {{ toJson ($v.config.latencyProfile | default dict) | quote }}
{{ $p }}RAG__RERANK: {{ and .root.Values.retriever.enabled .root.Values.retriever.crossEncoder.enabled | quote }}
{{- range $svc, $flag := dict "cache" "useCache" "retriever" "useRetriever" "embedder" "useEmbedder" }}
{{- $on := and (index $v.config $flag) (index $.root.Values $svc).enabled }}
{{ $p }}{{ upper $svc }}_ADDR: {{ ternary (include "goodput.grpcAddr" (dict "root" $.root "svc" $svc)) "" $on | quote }}
{{- end }}
{{- /* Deferred jobs (REDIS_URL comes from goodput.secretEnv when useRedis): read by the jobs workers too. */}}
{{ $p }}JOBS__QUEUE: {{ $v.config.jobsQueue | quote }}
{{ $p }}JOBS__PREFIX: {{ $v.config.jobsPrefix | quote }}
{{ $p }}JOBS__PARK_SHED_P2: {{ ternary "true" "false" $v.config.parkShedP2 | quote }}
{{ $p }}MODEL_FALLBACKS: {{ toJson ($v.config.modelFallbacks | default dict) | quote }}
{{ $p }}AUTO_MODELS: {{ join "," ($v.config.autoModels | default list) | quote }}
{{- with include "goodput.apiKeysFile" . }}
{{ $p }}API_KEYS_FILE: {{ . | quote }}
{{ $p }}API_KEYS_RELOAD_S: {{ include "goodput.num" $.root.Values.apiKeys.reloadSeconds | quote }}
{{- end }}
{{- /* Tenants' quotas and metering (QUOTA_REDIS_URL comes from goodput.secretEnv when tenancy.quotas.redis.url is
set; else the gateway's REDIS_URL holds them). */}}
{{- $q := .root.Values.tenancy.quotas }}
{{- $m := .root.Values.tenancy.metering }}
{{ $p }}QUOTAS__PREFIX: {{ $q.prefix | quote }}
{{ $p }}QUOTAS__TIMEOUT_S: {{ include "goodput.num" $q.timeoutSeconds | quote }}
{{ $p }}QUOTAS__FAIL_OPEN_SHARE: {{ include "goodput.quotaFailOpenShare" .root | quote }}
{{ $p }}QUOTAS__RETRY_S: {{ include "goodput.num" $q.retrySeconds | quote }}
{{ $p }}QUOTAS__QUANTUM_S: {{ $q.quantumSeconds | int | quote }}
{{ $p }}METERING__USAGE_PREFIX: {{ $m.usagePrefix | quote }}
{{ $p }}METERING__RETENTION_DAYS: {{ include "goodput.num" $m.usageRetentionDays | quote }}
{{ $p }}METERING__FLUSH_S: {{ include "goodput.num" $m.flushSeconds | quote }}
{{ $p }}METRICS_TENANTS: {{ join "," $m.metricsTenants | quote }}
{{ $p }}METERING__PREFILL_TOKENS_PER_S: {{ include "goodput.num" $m.prefillTokensPerSecond | quote }}
{{ $p }}METERING__DECODE_TOKENS_PER_S: {{ include "goodput.num" $m.decodeTokensPerSecond | quote }}
{{- end }}

{{/* QUOTAS__FAIL_OPEN_SHARE: tenancy.quotas.failOpenShare, or 1 / the gateway's replicas (its HPA's minReplicas when
autoscaling), so that the replicas enforcing locally while Redis is unreachable together allow about the limit, never
less. Pass the root context. */}}
{{- define "goodput.quotaFailOpenShare" -}}
{{- $share := .Values.tenancy.quotas.failOpenShare }}
{{- if kindIs "invalid" $share }}
{{- $gw := .Values.gateway }}
{{- $n := ternary $gw.autoscaling.minReplicas $gw.replicas $gw.autoscaling.enabled | int }}
{{- $share = round (divf 1 (max 1 $n)) 4 }}
{{- end }}
{{- include "goodput.num" $share }}
{{- end }}

{{/* The path of the API keys file when this service mounts the keys Secret (apiKeys.existingSecret): the gateway,
and the jobsWorker, which runs a parked job under its tenant's limits and budget as the keys file sets them (and
fails it once the tenant has no key any more). Empty otherwise. ctx: root, svc */}}
{{- define "goodput.apiKeysFile" -}}
{{- $k := .root.Values.apiKeys }}
{{- if and (has .svc (list "gateway" "jobsWorker")) $k.existingSecret }}
{{- printf "%s/%s" (trimSuffix "/" $k.mountPath) $k.key }}
{{- end }}
{{- end }}

{{- /* The jobs workers run parked requests through the gateway's pipeline: the gateway's settings (its
config and env; jobsWorker.env goes on top), so both use the same queue, key prefix and addresses. */}}
{{- define "goodput.config.jobsWorker" -}}
{{ include "goodput.config.gateway" . }}
{{- range $k, $val := .root.Values.gateway.env }}
{{ $k }}: {{ include "goodput.num" $val | quote }}
{{- end }}
{{- end }}

{{/* Queues a Celery worker consumes: <svc>.config.queues, else the value of its meta's queueSetting in
its settings (empty = the app's default queue). ctx: root, svc */}}
{{- define "goodput.celeryQueues" -}}
{{- $meta := include "goodput.meta" . | fromYaml }}
{{- $config := include "goodput.config" . | fromYaml }}
{{- $queues := (index .root.Values .svc).config.queues }}
{{- $queues | default (index $config (printf "%s%s" $meta.prefix $meta.celery.queueSetting)) | default "" }}
{{- end }}

{{- define "goodput.config.scheduler" -}}
{{- $v := .root.Values.scheduler }}
{{- $p := "GOODPUT_SCHEDULER_" }}
{{- $workers := $v.config.workers }}
{{- if not $workers }}
{{- /* One entry per inference Service: each pool's, or the one pool-less Service. */}}
{{- $pools := list "" }}
{{- with .root.Values.inference.pools }}{{ $pools = list }}{{ range . }}{{ $pools = append $pools .name }}{{ end }}{{ end }}
{{- $entries := list }}
{{- range $pools }}
{{- $inference := include "goodput.componentName" (dict "root" $.root "svc" "inference" "pool" .) }}
{{- if eq $v.discovery "kubernetes" }}
{{- /* The Service's EndpointSlices, its port named grpc (RBAC in scheduler-rbac.yaml). */}}
{{- $entries = append $entries (printf "k8s:///%s/%s:grpc" $.root.Release.Namespace $inference) }}
{{- else }}
{{- $entries = append $entries (printf "dns:///%s.%s.svc.cluster.local:50061" $inference $.root.Release.Namespace) }}
{{- end }}
{{- end }}
{{- $workers = join "," $entries }}
{{- end }}
{{ $p }}WORKERS: {{ $workers | quote }}
{{ $p }}HEALTH_INTERVAL_S: {{ include "goodput.num" $v.config.healthIntervalSeconds | quote }}
{{ $p }}UNHEALTHY_AFTER: {{ include "goodput.num" $v.config.unhealthyAfter | quote }}
{{ $p }}HEALTHY_AFTER: {{ include "goodput.num" $v.config.healthyAfter | quote }}
{{ $p }}MAX_INFLIGHT_PER_WORKER: {{ include "goodput.num" $v.config.maxInflightPerWorker | quote }}
{{ $p }}LEADER_ELECTION: {{ $v.leaderElection | quote }}
{{ $p }}LEADER_LEASE_NAME: {{ include "goodput.componentName" (dict "root" .root "svc" "scheduler") | quote }}
{{ $p }}LEADER_NAMESPACE: {{ .root.Release.Namespace | quote }}
{{- range $cls, $c := $v.config.classes }}
{{ $p }}{{ upper $cls }}_MAX_QUEUE: {{ include "goodput.num" $c.maxQueue | quote }}
{{ $p }}{{ upper $cls }}_TIMEOUT_S: {{ include "goodput.num" $c.timeoutSeconds | quote }}
{{- end }}
{{ $p }}P1_MAX_SHARE: {{ include "goodput.num" $v.config.p1MaxShare | quote }}
{{ $p }}P2_MAX_SHARE: {{ include "goodput.num" $v.config.p2MaxShare | quote }}
{{ $p }}SHED_P2_AT: {{ include "goodput.num" $v.config.shedP2At | quote }}
{{ $p }}SHED_P1_AT: {{ include "goodput.num" $v.config.shedP1At | quote }}
{{ $p }}SHED_HYSTERESIS: {{ include "goodput.num" $v.config.shedHysteresis | quote }}
{{ $p }}GUARD__ENABLED: {{ ternary "true" "false" $v.config.latencyGuard | quote }}
{{ $p }}GUARD__P0_TTFT_SLO_RATIO: {{ include "goodput.num" $v.config.p0TtftSloRatio | quote }}
{{ $p }}GUARD__P0_TTFT_TARGET_S: {{ include "goodput.num" $v.config.p0TtftTargetSeconds | quote }}
{{ $p }}PROFILE: {{ $v.config.profile | quote }}
{{- /* The same groups as the workers': a group's tenants share prefix affinity as they share cached prefixes. */}}
{{ $p }}CACHE_SHARING_GROUPS: {{ ternary "" (toJson .root.Values.tenancy.cacheSharingGroups) (empty .root.Values.tenancy.cacheSharingGroups) | quote }}
{{- end }}

{{- define "goodput.config.inference" -}}
{{- $v := .root.Values.inference }}
{{- $l := $v.vllm }}
{{- $p := "GOODPUT_INFERENCE_" }}
{{ $p }}MODEL: {{ $v.model.path | quote }}
{{ $p }}SERVED_MODEL_NAME: {{ $v.model.servedModelName | quote }}
{{ $p }}TENSOR_PARALLEL_SIZE: {{ include "goodput.num" $l.tensorParallelSize | quote }}
{{ $p }}GPU_MEMORY_UTILIZATION: {{ include "goodput.num" $l.gpuMemoryUtilization | quote }}
{{ $p }}MAX_NUM_SEQS: {{ include "goodput.num" $l.maxNumSeqs | quote }}
{{ $p }}MAX_NUM_BATCHED_TOKENS: {{ ternary (include "goodput.num" $l.maxNumBatchedTokens) "" (gt (int ($l.maxNumBatchedTokens | default 0)) 0) | quote }}
{{ $p }}MAX_MODEL_LEN: {{ include "goodput.num" $l.maxModelLen | quote }}
{{ $p }}ENABLE_PREFIX_CACHING: {{ ternary "true" "false" $l.enablePrefixCaching | quote }}
{{ $p }}QUANTIZATION: {{ $l.quantization | quote }}
{{ $p }}SPECULATIVE_CONFIG: {{ ternary "" (toJson $l.speculativeConfig) (empty $l.speculativeConfig) | quote }}
{{ $p }}TOOL_CALL_PARSER: {{ $l.toolCallParser | quote }}
{{ $p }}TOOL_CHAT_TEMPLATE: {{ $l.toolChatTemplate | quote }}
{{ $p }}SCHEDULING_POLICY: {{ $l.schedulingPolicy | quote }}
{{ $p }}DTYPE: {{ $l.dtype | quote }}
{{ $p }}KV_CACHE_DTYPE: {{ $l.kvCacheDtype | quote }}
{{ $p }}ENFORCE_EAGER: {{ ternary "true" "false" ($l.enforceEager | default false) | quote }}
{{ $p }}MAX_PROMPT_TOKENS: {{ include "goodput.num" $l.maxPromptTokens | quote }}
{{ $p }}CACHE_SHARING_GROUPS: {{ ternary "" (toJson .root.Values.tenancy.cacheSharingGroups) (empty .root.Values.tenancy.cacheSharingGroups) | quote }}
{{- if $l.kvCacheSpaceGb }}
{{ $p }}KV_CACHE_SPACE_GB: {{ include "goodput.num" $l.kvCacheSpaceGb | quote }}
VLLM_CPU_KVCACHE_SPACE: {{ include "goodput.num" $l.kvCacheSpaceGb | quote }}
{{- end }}
{{- with $v.pool }}
{{ $p }}POOL: {{ .name | quote }}
{{ $p }}POOL_CLASSES: {{ join "," .classes | quote }}
{{ $p }}ENGINE: {{ .engine | quote }}
{{ $p }}SERVED_MODEL_ALIASES: {{ join "," .aliases | quote }}
{{ $p }}POOL_COST_PER_HOUR: {{ include "goodput.num" .costPerHour | quote }}
{{- end }}
{{ $p }}DATA_DIR: "/data"
HF_HOME: "/cache/huggingface"
HF_HUB_OFFLINE: "1"
VLLM_CACHE_ROOT: "/cache/vllm"
VLLM_CONFIG_ROOT: "/cache/vllm-config"
TRITON_CACHE_DIR: "/cache/triton"
{{- end }}

{{- define "goodput.config.embedder" -}}
{{- $p := "GOODPUT_EMBEDDER_" }}
{{ $p }}QDRANT_URL: {{ .root.Values.external.qdrant.url | quote }}
{{ $p }}ELASTICSEARCH_URL: {{ .root.Values.external.elasticsearch.url | quote }}
{{- /* The indexer writes through the retriever, the single owner of the stores (its IndexStore API). */}}
{{ $p }}RETRIEVER_ADDR: {{ ternary (include "goodput.grpcAddr" (dict "root" .root "svc" "retriever")) "" .root.Values.retriever.enabled | quote }}
HF_HOME: "/cache/huggingface"
HF_HUB_OFFLINE: "1"
{{- end }}

{{- define "goodput.config.indexWorker" -}}
{{ include "goodput.config.embedder" . }}
{{- end }}

{{- define "goodput.config.retriever" -}}
{{- $p := "GOODPUT_RETRIEVER_" }}
{{ $p }}QDRANT_URL: {{ .root.Values.external.qdrant.url | quote }}
{{ $p }}ELASTICSEARCH_URL: {{ .root.Values.external.elasticsearch.url | quote }}
{{ $p }}EMBEDDER_ADDR: {{ ternary (include "goodput.grpcAddr" (dict "root" .root "svc" "embedder")) "" (and .root.Values.retriever.config.useEmbedder .root.Values.embedder.enabled) | quote }}
{{ $p }}LEXICAL_BACKEND: {{ ternary "elasticsearch" "tantivy" (ne .root.Values.external.elasticsearch.url "") | quote }}
{{- /* Without a Qdrant or Elasticsearch URL the stores are embedded: their files go to the writable cache emptyDir
(the root filesystem is read-only) and live as long as the pod; a cluster that keeps its indexes sets both URLs. */}}
{{ $p }}DATA_DIR: "/cache/retriever"
{{- with .root.Values.retriever.crossEncoder }}
{{ $p }}RERANKER: {{ ternary "cross-encoder" "auto" .enabled | quote }}
{{ $p }}RERANKER_MODEL: {{ ternary .mountPath "" .enabled | quote }}
{{- end }}
HF_HOME: "/cache/huggingface"
HF_HUB_OFFLINE: "1"
{{- end }}

{{- define "goodput.config.cache" -}}
{{- $p := "GOODPUT_CACHE_" }}
{{ $p }}EMBEDDER_ADDR: {{ ternary (include "goodput.grpcAddr" (dict "root" .root "svc" "embedder")) "" (and .root.Values.cache.config.useEmbedder .root.Values.embedder.enabled) | quote }}
{{- with .root.Values.cache.crossEncoder }}
{{ $p }}VERIFIER: {{ ternary "cross-encoder" "auto" .enabled | quote }}
{{ $p }}VERIFIER_MODEL: {{ ternary .mountPath "" .enabled | quote }}
{{- end }}
{{- with .root.Values.cache.config }}
{{ $p }}THRESHOLD: {{ include "goodput.num" .threshold | quote }}
{{ $p }}TENANT_THRESHOLDS: {{ toJson .tenantThresholds | quote }}
{{ $p }}GUARD: {{ .guard | quote }}
{{ $p }}AMBIGUITY_MARGIN: {{ include "goodput.num" .ambiguityMargin | quote }}
{{ $p }}MAX_ENTRIES: {{ include "goodput.num" .maxEntries | quote }}
{{ $p }}MAX_L2_BYTES: {{ include "goodput.num" .maxL2Bytes | quote }}
{{- end }}
{{- end }}

{{/*
Env entries that involve Secrets (always secretKeyRef) or values composed from them with $(VAR)
expansion, which envFrom does not do. ctx: root, svc
*/}}
{{- define "goodput.secretEnv" -}}
{{- $root := .root }}
{{- $meta := include "goodput.meta" . | fromYaml }}
{{- $p := $meta.prefix }}
{{- $ext := $root.Values.external }}
{{- $usesRedis := has "redis" $meta.external }}
{{- if eq .svc "gateway" }}{{ $usesRedis = $root.Values.gateway.config.useRedis }}{{ end }}
{{- if $usesRedis }}
{{- /* Each service's REDIS_URL is its role's Redis (docs/operations.md, "Redis"): the cache's entries on
external.cacheRedis, the Celery queues and job stores (gateway, jobsWorker, embedder, indexWorker) on
external.queueRedis; external.redis where that is empty. */}}
{{- $role := ternary "CACHE" "QUEUE" (eq .svc "cache") }}
{{- $own := ternary $ext.cacheRedis $ext.queueRedis (eq .svc "cache") }}
{{- if $own.url }}
{{- include "goodput.redisUrlEnv" (dict "root" $root "svc" .svc "redis" $own "name" (printf "%sREDIS_URL" $p) "password" (printf "GOODPUT_REDIS_%s_PASSWORD" $role)) }}
{{- else }}
{{- include "goodput.redisUrlEnv" (dict "root" $root "svc" .svc "redis" $ext.redis "name" (printf "%sREDIS_URL" $p) "password" "GOODPUT_REDIS_PASSWORD") }}
{{- end }}
{{- if has .svc (list "gateway" "jobsWorker") }}
{{- /* The key job and batch records are sealed with: a record another Redis user wrote never runs. */}}
- name: {{ $p }}JOBS__MAC_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "goodput.credentialsSecret" $root }}
      key: jobs-mac-key
{{- end }}
{{- if and (eq .svc "cache") (or $ext.cacheRedis.url $ext.queueRedis.url) }}
{{- /* The cache's entries and the knowledge-base versions apart: it reads and follows the versions where the
indexer (the embedder, on the queues' Redis) writes them. */}}
{{- if $ext.queueRedis.url }}
{{- include "goodput.redisUrlEnv" (dict "root" $root "svc" .svc "redis" $ext.queueRedis "name" (printf "%sKB_REDIS_URL" $p) "password" "GOODPUT_REDIS_QUEUE_PASSWORD") }}
{{- else }}
{{- include "goodput.redisUrlEnv" (dict "root" $root "svc" .svc "redis" $ext.redis "name" (printf "%sKB_REDIS_URL" $p) "password" "GOODPUT_REDIS_PASSWORD") }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (has "qdrant" $meta.external) $ext.qdrant.existingSecret }}
- name: {{ $p }}QDRANT_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $ext.qdrant.existingSecret }}
      key: {{ $ext.qdrant.apiKeyKey }}
{{- end }}
{{- if and (has "elasticsearch" $meta.external) $ext.elasticsearch.existingSecret }}
- name: {{ $p }}ELASTICSEARCH_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $ext.elasticsearch.existingSecret }}
      key: {{ $ext.elasticsearch.apiKeyKey }}
{{- end }}
{{- if and (eq .svc "inference") $root.Values.tenancy.cacheSaltKey.existingSecret }}
- name: {{ $p }}CACHE_SALT_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.tenancy.cacheSaltKey.existingSecret }}
      key: {{ $root.Values.tenancy.cacheSaltKey.key }}
{{- end }}
{{- /* The API keys are a mounted file (goodput.apiKeysFile), not env: env never sees a rotated key. */}}
{{- $qr := $root.Values.tenancy.quotas.redis }}
{{- if and (eq $p "GOODPUT_GATEWAY_") $qr.url }}
{{- include "goodput.redisUrlEnv" (dict "root" $root "svc" .svc "redis" $qr "name" (printf "%sQUOTA_REDIS_URL" $p) "password" "GOODPUT_QUOTA_REDIS_PASSWORD") }}
{{- else if and (eq $p "GOODPUT_GATEWAY_") $usesRedis $ext.queueRedis.url }}
{{- /* REDIS_URL is the queues' Redis, with the data tenants store: quotas, usage and the storage ledger stay on
external.redis, apart from it. */}}
{{- include "goodput.redisUrlEnv" (dict "root" $root "svc" .svc "redis" $ext.redis "name" (printf "%sQUOTA_REDIS_URL" $p) "password" "GOODPUT_REDIS_PASSWORD") }}
{{- end }}
{{- end }}

{{/* One Redis URL setting with its credentials, the password substituted by Kubernetes from an env entry defined
just before it: with redisUsers.enabled, the service's own ACL user (goodput.redisUser) and its password from the
credentials Secret; else the Redis's existingSecret, if any. ctx: root, svc, redis (url, existingSecret,
passwordKey), name (the setting's env name), password (the password's env name) */}}
{{- define "goodput.redisUrlEnv" -}}
{{- $u := urlParse .redis.url }}
{{- if .root.Values.redisUsers.enabled }}
- name: {{ .password }}
  valueFrom:
    secretKeyRef:
      name: {{ include "goodput.credentialsSecret" .root }}
      key: redis-{{ .svc }}
- name: {{ .name }}
  value: {{ printf "%s://%s:$(%s)@%s%s" $u.scheme (include "goodput.redisUser" .) .password $u.host $u.path | quote }}
{{- else if .redis.existingSecret }}
- name: {{ .password }}
  valueFrom:
    secretKeyRef:
      name: {{ .redis.existingSecret }}
      key: {{ .redis.passwordKey }}
- name: {{ .name }}
  value: {{ printf "%s://:$(%s)@%s%s" $u.scheme .password $u.host $u.path | quote }}
{{- else }}
- name: {{ .name }}
  value: {{ .redis.url | quote }}
{{- end }}
{{- end }}

{{/* The Secret of the release's own credentials: each Redis ACL user's password, the jobs' MAC key. ctx: root */}}
{{- define "goodput.credentialsSecret" -}}
{{- printf "%s-credentials" (include "goodput.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Redis ACL user of a service (goodput_contracts.redis_access.user_name). ctx: root, svc */}}
{{- define "goodput.redisUser" -}}
{{- printf "%s-%s" (.root.Values.redisUsers.namespace | default (include "goodput.fullname" .root)) .svc }}
{{- end }}

{{/* A probe handler: native gRPC on the gRPC port (grpc.health.v1), HTTP /healthz where there is none. */}}
{{- define "goodput.probe" -}}
{{- /* The kubelet's gRPC probe speaks plaintext only: a mutual-TLS server is probed on /healthz. */}}
{{- if and .meta.grpcPort .grpcProbe -}}
grpc:
  port: {{ .meta.grpcPort }}
{{- else -}}
httpGet:
  path: /healthz
  port: http
{{- end }}
{{ toYaml .timing }}
{{- end }}

{{/* Container resources, with one GPU per tensor-parallel rank on inference workers. ctx: root, svc */}}
{{- define "goodput.resources" -}}
{{- $v := index .root.Values .svc }}
{{- $res := deepCopy ($v.resources | default dict) }}
{{- if and (eq .svc "inference") $v.gpu.enabled }}
{{- $n := int ($v.gpu.count | default $v.vllm.tensorParallelSize) }}
{{- $_ := set $res "requests" (merge (dict $v.gpu.resourceName $n) ($res.requests | default dict)) }}
{{- $_ := set $res "limits" (merge (dict $v.gpu.resourceName $n) ($res.limits | default dict)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Sanity checks that the schema cannot express. ctx: root, svc */}}
{{/* The release part of the identities' URIs (TLS_RELEASE): <namespace>/<release>, so a certificate another
release got from a shared issuer names nobody here. */}}
{{- define "goodput.tlsRelease" -}}
{{ .Release.Namespace }}/{{ .Release.Name }}
{{- end }}

{{/* A service's identity URI: spiffe://<tls.trustDomain>/<namespace>/<release>/<service key>. */}}
{{- define "goodput.spiffeId" -}}
spiffe://{{ .root.Values.tls.trustDomain }}/{{ include "goodput.tlsRelease" .root }}/{{ .svc }}
{{- end }}

{{/* The Secret with a service's certificate (tls.crt, tls.key, ca.crt); empty when internal gRPC is plaintext.
ctx: root, svc */}}
{{- define "goodput.tlsSecret" -}}
{{- $tls := .root.Values.tls }}
{{- if not $tls.insecure }}
{{- /* One certificate per service: the pools of the inference workers share theirs. */}}
{{- index $tls.existingSecrets .svc | default (printf "%s-tls" (include "goodput.componentName" (dict "root" .root "svc" .svc))) }}
{{- end }}
{{- end }}

{{- define "goodput.validate" -}}
{{- $v := index .root.Values .svc }}
{{- $tls := .root.Values.tls }}
{{- if not (or $tls.insecure $tls.certManager.enabled (index $tls.existingSecrets .svc)) }}
{{- fail (printf "%s: internal gRPC is mutual TLS; set tls.certManager.enabled=true, tls.existingSecrets.%s, or tls.insecure=true (quick installs only)" .svc .svc) }}
{{- end }}
{{- if lt (int $v.terminationGracePeriodSeconds) (add $v.drainGraceSeconds $v.preStopSleepSeconds | int) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must cover preStopSleepSeconds + drainGraceSeconds (%v), or in-flight streams are killed" .svc $v.terminationGracePeriodSeconds (add $v.drainGraceSeconds $v.preStopSleepSeconds)) }}
{{- end }}
{{- if and $v.autoscaling.enabled (gt (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas must not exceed maxReplicas" .svc) }}
{{- end }}
{{- range $r := list "cacheRedis" "queueRedis" }}
{{- $e := index $.root.Values.external $r }}
{{- if and $e.existingSecret (not $e.url) }}
{{- fail (printf "external.%s.existingSecret is set but external.%s.url is empty (empty = external.redis, whose password is external.redis.existingSecret)" $r $r) }}
{{- end }}
{{- end }}
{{- $qr := .root.Values.tenancy.quotas.redis }}
{{- if and (eq .svc "gateway") $qr.existingSecret (not $qr.url) }}
{{- fail "tenancy.quotas.redis.existingSecret is set but tenancy.quotas.redis.url is empty: the gateway's own Redis (external.redis) takes its password from external.redis.existingSecret" }}
{{- end }}
{{- if and (eq .svc "inference") (eq $v.model.source "pvc") (not $v.model.pvc.claimName) }}
{{- fail "inference.model.pvc.claimName is required when inference.model.source is pvc" }}
{{- end }}
{{- end }}

{{/* The port /metrics is served on when it has one of its own (<svc>.service.metricsPort); empty = the HTTP port.
ctx: root, svc */}}
{{- define "goodput.metricsPort" -}}
{{- $v := index .root.Values .svc }}
{{- $port := dig "service" "metricsPort" 0 $v }}
{{- if and (eq .svc "gateway") (not $port) }}
{{- fail "gateway.service.metricsPort must be set: the gateway's /metrics (tenants' and keys' counts) is never served on its public REST port" }}
{{- end }}
{{- if $port }}{{ $port }}{{ end }}
{{- end }}
