{{/*
Generic resources of one service, driven by its values and "goodput.serviceMeta".
Every template takes (dict "root" $ "svc" "<values key>").
*/}}

{{- define "goodput.configmap" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "goodput.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "goodput.labels" . | nindent 4 }}
data:
  {{- include "goodput.config" . | nindent 2 }}
{{- end }}

{{- define "goodput.deployment" -}}
{{- include "goodput.validate" . }}
{{- $root := .root }}
{{- $v := index $root.Values .svc }}
{{- $meta := include "goodput.meta" . | fromYaml }}
{{- $name := include "goodput.componentName" . }}
{{- $g := $root.Values.global }}
{{- $tlsSecret := include "goodput.tlsSecret" . }}
{{- /* The gateway's gRPC port is public (plaintext, API keys); the others are mutual TLS unless tls.insecure. */}}
{{- $grpcProbe := or (not $tlsSecret) (eq .svc "gateway") }}
{{- $apiKeysFile := include "goodput.apiKeysFile" . }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "goodput.labels" . | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "goodput.selectorLabels" . | nindent 6 }}
  {{- if eq .svc "inference" }}
  strategy:
    # Never drop below the current GPU capacity during a rollout: bring a new worker up first.
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  {{- end }}
  template:
    metadata:
      labels:
        {{- include "goodput.selectorLabels" . | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        # Rolls the pods when their settings change (they are loaded with envFrom, which does not).
        checksum/config: {{ include "goodput.configmap" . | sha256sum }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- $ownAccount := ternary (include "goodput.schedulerServiceAccountName" $root) "" (eq .svc "scheduler") }}
      {{- if $ownAccount }}
      # Its own account: it watches the inference workers' EndpointSlices (scheduler-rbac.yaml), so it needs a token.
      serviceAccountName: {{ $ownAccount }}
      automountServiceAccountToken: true
      {{- else }}
      serviceAccountName: {{ include "goodput.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
      {{- end }}
      {{- with $g.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      containers:
        - name: {{ $meta.component }}
          image: {{ include "goodput.image" . | quote }}
          imagePullPolicy: {{ $v.image.pullPolicy | default $g.imagePullPolicy }}
          {{- with $meta.celery }}
          command:
            - celery
            - -A
            - {{ .app }}
            - worker
            - --loglevel={{ $root.Values.common.logLevel }}
            - --concurrency={{ $v.config.concurrency }}
            # No gossip, mingle or heartbeat: they need Celery's broadcast keys and channels, outside the queue's own
            # (its Redis user holds only those; remote control is off: goodput_contracts.redis_access.celery_conf).
            - --without-gossip
            - --without-mingle
            - --without-heartbeat
            {{- with include "goodput.celeryQueues" $ }}
            - --queues={{ . }}
            {{- end }}
          {{- end }}
          ports:
            {{- if $meta.grpcPort }}
            - name: grpc
              containerPort: {{ $meta.grpcPort }}
              protocol: TCP
            {{- end }}
            - name: http
              containerPort: {{ $meta.httpPort }}
              protocol: TCP
            {{- with (include "goodput.metricsPort" .) }}
            - name: metrics
              containerPort: {{ . }}
              protocol: TCP
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ $name }}
          {{- $secretEnv := include "goodput.secretEnv" . | trim }}
          {{- if or $secretEnv $v.extraEnv }}
          env:
            {{- with $secretEnv }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- end }}
          startupProbe:
            {{- include "goodput.probe" (dict "meta" $meta "timing" $v.probes.startup "grpcProbe" $grpcProbe) | nindent 12 }}
          readinessProbe:
            {{- include "goodput.probe" (dict "meta" $meta "timing" $v.probes.readiness "grpcProbe" $grpcProbe) | nindent 12 }}
          livenessProbe:
            {{- include "goodput.probe" (dict "meta" $meta "timing" $v.probes.liveness "grpcProbe" $grpcProbe) | nindent 12 }}
          {{- if gt (int $v.preStopSleepSeconds) 0 }}
          lifecycle:
            preStop:
              exec:
                command: ["sleep", "{{ $v.preStopSleepSeconds }}"]
          {{- end }}
          resources:
            {{- include "goodput.resources" . | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: cache
              mountPath: /cache
            {{- if $tlsSecret }}
            - name: tls
              mountPath: {{ $root.Values.tls.mountPath }}
              readOnly: true
            {{- end }}
            {{- if $apiKeysFile }}
            # The whole volume, never a subPath: a subPath mount is not updated when the Secret changes.
            - name: api-keys
              mountPath: {{ dir $apiKeysFile }}
              readOnly: true
            {{- end }}
            {{- if and (has .svc (list "retriever" "cache")) $v.crossEncoder.enabled }}
            - name: cross-encoder
              mountPath: {{ $v.crossEncoder.mountPath }}
              readOnly: true
              {{- with $v.crossEncoder.subPath }}
              subPath: {{ . }}
              {{- end }}
            {{- end }}
            {{- if eq .svc "inference" }}
            - name: dshm
              mountPath: /dev/shm
            - name: data
              mountPath: /data
            {{- if eq $v.model.source "pvc" }}
            - name: models
              mountPath: {{ $v.model.pvc.mountPath }}
              readOnly: true
              {{- with $v.model.pvc.subPath }}
              subPath: {{ . }}
              {{- end }}
            {{- end }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $root.Values.common.tmpSizeLimit }}
        - name: cache
          emptyDir:
            sizeLimit: {{ $root.Values.common.cacheSizeLimit }}
        {{- if $tlsSecret }}
        # The service's certificate and key and the CA its peers must chain to (tls.certManager or
        # tls.existingSecrets); cert-manager renews it in place.
        - name: tls
          secret:
            secretName: {{ $tlsSecret }}
            defaultMode: 0440
        {{- end }}
        {{- if $apiKeysFile }}
        # The API keys (GOODPUT_GATEWAY_API_KEYS_FILE). The kubelet rewrites the file when the Secret changes (within
        # its sync period) and the gateway re-reads it within API_KEYS_RELOAD_S: key rotation needs no restart.
        - name: api-keys
          secret:
            secretName: {{ $root.Values.apiKeys.existingSecret }}
            defaultMode: 0440
            items:
              - key: {{ $root.Values.apiKeys.key }}
                path: {{ base $apiKeysFile }}
        {{- end }}
        {{- if and (has .svc (list "retriever" "cache")) $v.crossEncoder.enabled }}
        # The cross-encoder (the retriever's reranker, the cache's verifier): a model folder, read-only.
        - name: cross-encoder
          persistentVolumeClaim:
            claimName: {{ required (printf "%s.crossEncoder.claimName is required when it is enabled" .svc) $v.crossEncoder.claimName }}
            readOnly: true
        {{- end }}
        {{- if eq .svc "inference" }}
        # Tensor-parallel ranks and NCCL exchange through shared memory; the runtime's default 64 MiB
        # /dev/shm makes multi-GPU workers crash or crawl.
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSizeLimit }}
        - name: data
          emptyDir:
            sizeLimit: {{ $v.dataSizeLimit }}
        {{- if eq $v.model.source "pvc" }}
        - name: models
          persistentVolumeClaim:
            claimName: {{ $v.model.pvc.claimName }}
            readOnly: true
        {{- end }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- range $v.topologySpreadConstraints }}
        {{- $c := deepCopy . }}
        {{- if not $c.labelSelector }}
        {{- $_ := set $c "labelSelector" (dict "matchLabels" (include "goodput.selectorLabels" $ | fromYaml)) }}
        {{- end }}
        - {{- toYaml $c | nindent 10 }}
        {{- end }}
      {{- end }}
{{- end }}

{{- define "goodput.service" -}}
{{- $v := index .root.Values .svc }}
{{- $meta := include "goodput.meta" . | fromYaml }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "goodput.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "goodput.labels" . | nindent 4 }}
  {{- with $v.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if eq .svc "inference" }}
  # Headless: DNS returns one address per ready worker pod, so the scheduler can health-check and place
  # on each worker and the gateway can stream from the one it was granted.
  clusterIP: None
  publishNotReadyAddresses: false
  {{- else if eq .svc "scheduler" }}
  # Headless: DNS returns every replica, leader and standby; the gateways' channels health-check each for the
  # Scheduler service and call only the one that serves it (the leader), following it when it changes.
  clusterIP: None
  publishNotReadyAddresses: false
  {{- else }}
  type: {{ $v.service.type }}
  {{- end }}
  selector:
    {{- include "goodput.selectorLabels" . | nindent 4 }}
  ports:
    {{- if $meta.grpcPort }}
    - name: grpc
      port: {{ $meta.grpcPort }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- end }}
    - name: http
      port: {{ $meta.httpPort }}
      targetPort: http
      protocol: TCP
      appProtocol: http
    {{- with (include "goodput.metricsPort" .) }}
    - name: metrics
      port: {{ . }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- end }}
{{- end }}

{{- define "goodput.hpa" -}}
{{- $v := index .root.Values .svc }}
{{- $a := $v.autoscaling }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "goodput.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "goodput.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "goodput.componentName" . }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    {{- if and $a.gpuUtilization $a.gpuUtilization.enabled }}
    # GPU busy time per pod (DCGM exporter -> Prometheus -> prometheus-adapter, averaged over the
    # pod's GPUs). Saturates early, so it is paired with the queue below.
    - type: Pods
      pods:
        metric:
          name: {{ $a.gpuUtilization.metricName }}
        target:
          type: AverageValue
          averageValue: {{ $a.gpuUtilization.targetAverageValue | quote }}
    {{- end }}
    {{- if and $a.queueDepth $a.queueDepth.enabled }}
    # Requests waiting in the scheduler's queues, divided by the current worker count (AverageValue):
    # the demand GPUs cannot serve yet.
    - type: Object
      object:
        describedObject:
          apiVersion: v1
          kind: Service
          name: {{ include "goodput.componentName" (dict "root" .root "svc" "scheduler") }}
        metric:
          name: {{ $a.queueDepth.metricName }}
          {{- with $a.queueDepth.priorities }}
          selector:
            matchExpressions:
              - key: priority
                operator: In
                values:
                  {{- toYaml . | nindent 18 }}
          {{- end }}
        target:
          type: AverageValue
          averageValue: {{ $a.queueDepth.targetAverageValue | quote }}
    {{- end }}
    {{- if $a.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $a.targetCPUUtilizationPercentage }}
    {{- end }}
  {{- with $a.behavior }}
  behavior:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{- define "goodput.pdb" -}}
{{- $p := (index .root.Values .svc).pdb }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "goodput.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "goodput.labels" . | nindent 4 }}
spec:
  {{- if not (kindIs "invalid" $p.minAvailable) }}
  minAvailable: {{ $p.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $p.maxUnavailable | default 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "goodput.selectorLabels" . | nindent 6 }}
{{- end }}

{{- define "goodput.serviceMonitor" -}}
{{- $sm := .root.Values.metrics.serviceMonitor }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "goodput.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "goodput.labels" . | nindent 4 }}
    {{- with $sm.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "goodput.selectorLabels" . | nindent 6 }}
  endpoints:
    - port: {{ ternary "metrics" "http" (ne (include "goodput.metricsPort" .) "") }}
      path: /metrics
      interval: {{ $sm.interval }}
      scrapeTimeout: {{ $sm.scrapeTimeout }}
{{- end }}

{{/*
Ingress: the gateway from anywhere (or networkPolicy.gatewayIngressFrom), other services only from the
components that call them on the request path; /metrics from networkPolicy.metricsFrom.
Egress: DNS, the components this one calls, its external stores, the OTLP collector.
*/}}
{{- define "goodput.networkPolicy" -}}
{{- $root := .root }}
{{- $np := $root.Values.networkPolicy }}
{{- $meta := include "goodput.meta" . | fromYaml }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "goodput.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "goodput.labels" . | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "goodput.selectorLabels" . | nindent 6 }}
  policyTypes:
    - Ingress
    - Egress
  ingress:
    {{- if eq .svc "gateway" }}
    - ports:
        - port: grpc
          protocol: TCP
        - port: http
          protocol: TCP
      {{- with $np.gatewayIngressFrom }}
      from:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- else if $meta.ingressFrom }}
    - ports:
        - port: grpc
          protocol: TCP
      from:
        {{- range $meta.ingressFrom }}
        - podSelector:
            matchLabels:
              {{- include "goodput.selectorLabels" (dict "root" $root "svc" .) | nindent 14 }}
        {{- end }}
    {{- end }}
    {{- $metricsPort := include "goodput.metricsPort" . }}
    {{- if or (ne .svc "gateway") $metricsPort }}
    - ports:
        - port: {{ ternary "metrics" "http" (ne $metricsPort "") }}
          protocol: TCP
      {{- with $np.metricsFrom }}
      from:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- end }}
  egress:
    - to:
        {{- toYaml $np.dns.to | nindent 8 }}
      ports:
        {{- toYaml $np.dns.ports | nindent 8 }}
    {{- range $meta.egressTo }}
    {{- $peer := include "goodput.meta" (dict "root" $root "svc" .) | fromYaml }}
    - to:
        - podSelector:
            matchLabels:
              {{- include "goodput.selectorLabels" (dict "root" $root "svc" .) | nindent 14 }}
      ports:
        - port: {{ $peer.grpcPort }}
          protocol: TCP
    {{- end }}
    {{- $external := $meta.external }}
    {{- if eq $root.Values.common.otel.exporter "otlp" }}{{ $external = append $external "otlp" }}{{ end }}
    {{- if and (eq .svc "scheduler") (include "goodput.schedulerServiceAccountName" $root) }}{{ $external = append $external "kubernetes" }}{{ end }}
    {{- range $external }}
    {{- $e := index $np.egress . }}
    - ports:
        {{- toYaml $e.ports | nindent 8 }}
      {{- with $e.to }}
      to:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- end }}
{{- end }}

{{/* Everything one service needs, separated by ---. ctx: root, svc */}}
{{- define "goodput.component" -}}
{{- $v := index .root.Values .svc }}
{{- if include "goodput.enabled" . }}
---
{{ include "goodput.configmap" . }}
---
{{ include "goodput.deployment" . }}
---
{{ include "goodput.service" . }}
{{- if $v.autoscaling.enabled }}
---
{{ include "goodput.hpa" . }}
{{- end }}
{{- if $v.pdb.enabled }}
---
{{ include "goodput.pdb" . }}
{{- end }}
{{- if .root.Values.metrics.serviceMonitor.enabled }}
---
{{ include "goodput.serviceMonitor" . }}
{{- end }}
{{- if .root.Values.networkPolicy.enabled }}
---
{{ include "goodput.networkPolicy" . }}
{{- end }}
{{- end }}
{{- end }}
