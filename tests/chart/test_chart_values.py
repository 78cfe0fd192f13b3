"""Assertions on what the chart renders: autoscaling, GPUs, probes, security, secrets, the schema."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from goodput_core.clients import GRPC_EXPERIMENTS

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "goodput"
K8S = REPO / "k8s"
SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))

ALL_SCENARIOS = [None, *SCENARIOS]
SECRETISH = re.compile(r"KEY|PASSWORD|TOKEN|SECRET")
# Contract settings (docs/services.md) whose names look secret but hold plain numbers or paths.
NOT_SECRET = {"GOODPUT_INFERENCE_MAX_PROMPT_TOKENS", "GOODPUT_INFERENCE_MAX_NUM_BATCHED_TOKENS",
              "GOODPUT_GATEWAY_API_KEYS_FILE",
              # The keys file's reload period and the metering's token rates.
              "GOODPUT_GATEWAY_API_KEYS_RELOAD_S", "GOODPUT_GATEWAY_METERING__PREFILL_TOKENS_PER_S",
              "GOODPUT_GATEWAY_METERING__DECODE_TOKENS_PER_S",
              # The path of the mounted TLS Secret's key, not the key.
              *(f"{prefix}TLS_KEY_FILE" for prefix in ("GOODPUT_GATEWAY_", "GOODPUT_SCHEDULER_", "GOODPUT_INFERENCE_",
                                                       "GOODPUT_EMBEDDER_", "GOODPUT_RETRIEVER_", "GOODPUT_CACHE_"))}


def _containers(deploy: dict[str, Any]) -> list[dict[str, Any]]:
    spec = deploy["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """Manifests of one kind, keyed by their app.kubernetes.io/component label; an inference pool's also as
    `inference-<pool>` (goodput.dev/pool), and `inference` is the first pool's."""
    out: dict[str, dict[str, Any]] = {}
    for d in docs:
        if d["kind"] == kind:
            labels = d["metadata"].get("labels", {})
            key = labels.get("app.kubernetes.io/component", d["metadata"]["name"])
            if "goodput.dev/pool" in labels:
                out[f"{key}-{labels['goodput.dev/pool']}"] = d
                out.setdefault(key, d)
            else:
                out[key] = d
    return out


def _config(docs: list[dict[str, Any]], component: str) -> dict[str, str]:
    return by_kind(docs, "ConfigMap")[component]["data"]


def test_inference_hpa_scales_on_gpu_utilisation_and_queue_depth(chart: Any) -> None:
    hpa = by_kind(chart.docs(), "HorizontalPodAutoscaler")["inference-interactive"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "goodput-inference-interactive",
    }
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert set(metrics) == {"Pods", "Object"}

    gpu = metrics["Pods"]["pods"]
    assert gpu["metric"]["name"] == "DCGM_FI_DEV_GPU_UTIL"
    assert gpu["target"] == {"type": "AverageValue", "averageValue": "80"}

    queue = metrics["Object"]["object"]
    assert queue["metric"]["name"] == "goodput_scheduler_queue_depth"
    assert queue["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": "goodput-scheduler"}
    assert queue["target"] == {"type": "AverageValue", "averageValue": "4"}
    assert queue["metric"]["selector"]["matchExpressions"] == [
        {"key": "priority", "operator": "In", "values": ["P0", "P1"]}
    ]

    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] < behavior["scaleDown"]["stabilizationWindowSeconds"]
    assert behavior["scaleDown"]["policies"] and behavior["scaleUp"]["policies"]


def test_hpa_metrics_match_the_adapter_rules(chart: Any) -> None:
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    exposed = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    hpa = by_kind(chart.docs(), "HorizontalPodAutoscaler")["inference"]
    used = {m.get("pods", m.get("object", {})).get("metric", {}).get("name") for m in hpa["spec"]["metrics"]}
    assert used <= exposed


def test_cpu_services_scale_on_cpu(chart: Any) -> None:
    hpas = by_kind(chart.docs(), "HorizontalPodAutoscaler")
    for component in ("gateway", "embedder", "retriever", "cache", "indexing-worker", "jobs-worker"):
        metrics = hpas[component]["spec"]["metrics"]
        assert [m["type"] for m in metrics] == ["Resource"], component
        assert metrics[0]["resource"]["name"] == "cpu"
        assert metrics[0]["resource"]["target"]["type"] == "Utilization"
    # The scheduler's queues live in its memory: never scaled out by default.
    assert "scheduler" not in hpas


def test_hpa_behavior_comes_from_values(chart: Any) -> None:
    hpa = by_kind(chart.docs("gpu-72b-tp2-values.yaml"), "HorizontalPodAutoscaler")["inference"]
    assert hpa["spec"]["maxReplicas"] == 4
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 900
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "85"


@pytest.mark.parametrize("values", ALL_SCENARIOS)
def test_no_replicas_when_an_hpa_owns_the_deployment(chart: Any, values: str | None) -> None:
    docs = chart.docs(values)
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    for component, deploy in by_kind(docs, "Deployment").items():
        if component in hpas:
            assert "replicas" not in deploy["spec"], component
            assert hpas[component]["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
        else:
            assert deploy["spec"]["replicas"] >= 1, component


def test_autoscaling_off_renders_no_hpa_and_fixed_replicas(chart: Any) -> None:
    docs = chart.docs("autoscaling-off-values.yaml")
    assert not by_kind(docs, "HorizontalPodAutoscaler")
    assert by_kind(docs, "Deployment")["inference"]["spec"]["replicas"] == 4


@pytest.mark.parametrize(
    ("values", "tp"),
    [(None, 1), ("gpu-7b-values.yaml", 1), ("gpu-14b-a30-values.yaml", 1), ("gpu-72b-tp2-values.yaml", 2)],
)
def test_gpu_requests_equal_tensor_parallel_size(chart: Any, values: str | None, tp: int) -> None:
    docs = chart.docs(values)
    deploy = by_kind(docs, "Deployment")["inference"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == tp
    assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
    assert _config(docs, "inference")["GOODPUT_INFERENCE_TENSOR_PARALLEL_SIZE"] == str(tp)
    # Only the inference workers (every pool's) get GPUs.
    for component, other in by_kind(docs, "Deployment").items():
        if component.split("-")[0] != "inference":
            for c in _containers(other):
                assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {})), component


def test_cpu_dev_requests_no_gpu(chart: Any) -> None:
    docs = chart.docs("cpu-dev-values.yaml")
    deploy = by_kind(docs, "Deployment")["inference"]
    assert "nvidia.com/gpu" not in json.dumps(deploy)
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"].startswith("goodput/inference-cpu:")
    assert _config(docs, "inference")["GOODPUT_INFERENCE_KV_CACHE_SPACE_GB"] == "2"


def test_gpu_worker_pod_shape(chart: Any) -> None:
    docs = chart.docs("gpu-72b-tp2-values.yaml")
    pod = by_kind(docs, "Deployment")["inference"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # Shared memory for tensor parallelism.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # The model from a read-only PVC.
    assert volumes[mounts["/models"]]["persistentVolumeClaim"]["claimName"] == "goodput-models-72b"
    # Long model load: the startup probe allows 30 minutes before liveness applies.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    # Streams get drained: the grace period covers preStop + DRAIN_GRACE_S.
    drain = int(_config(docs, "inference")["GOODPUT_INFERENCE_DRAIN_GRACE_S"])
    assert pod["terminationGracePeriodSeconds"] >= drain + 10
    # GPU node pool.
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    config = _config(docs, "inference")
    assert config["GOODPUT_INFERENCE_MODEL"] == "/models/Qwen2.5-72B-Instruct-AWQ"
    assert config["GOODPUT_INFERENCE_QUANTIZATION"] == "awq_marlin"
    assert json.loads(config["GOODPUT_INFERENCE_SPECULATIVE_CONFIG"])["method"] == "ngram"
    assert config["GOODPUT_INFERENCE_ENABLE_PREFIX_CACHING"] == "true"


@pytest.mark.parametrize("values", ALL_SCENARIOS)
def test_every_container_has_probes(chart: Any, values: str | None) -> None:
    for component, deploy in by_kind(chart.docs(values), "Deployment").items():
        for c in deploy["spec"]["template"]["spec"]["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, f"{component}/{c['name']} has no {probe}"
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            if "grpc" in ports and component == "gateway":
                # Native gRPC probes against grpc.health.v1 on the (public, plaintext) gRPC port.
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert c[probe]["grpc"]["port"] == ports["grpc"], f"{component} {probe}"
            else:
                # The kubelet's gRPC probe has no client certificate: mutual-TLS servers are probed on /healthz.
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, f"{component} {probe}"


def test_internal_tls_settings_mounts_and_certificates(chart: Any) -> None:
    docs = chart.docs()
    certificates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    configs = by_kind(docs, "ConfigMap")
    for component, deploy in by_kind(docs, "Deployment").items():
        spec = deploy["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tls"]
        assert mount == {"name": "tls", "mountPath": "/etc/goodput/tls", "readOnly": True}, component
        (volume,) = [v for v in spec["volumes"] if v["name"] == "tls"]
        secret = volume["secret"]["secretName"]
        data = configs[component]["data"]
        (prefix,) = {k.removesuffix("TLS_CERT_FILE") for k in data if k.endswith("TLS_CERT_FILE")}
        assert (data[prefix + "TLS_CERT_FILE"], data[prefix + "TLS_KEY_FILE"], data[prefix + "TLS_CA_FILE"]) == (
            "/etc/goodput/tls/tls.crt", "/etc/goodput/tls/tls.key", "/etc/goodput/tls/ca.crt"), component
        assert prefix + "INSECURE_INTERNAL" not in data, component
        (cert,) = [d for d in certificates.values() if d["spec"]["secretName"] == secret]
        key = cert["spec"]["commonName"]
        # the identity the service authorizes by: this release's (namespace goodput, release goodput) URI
        assert cert["spec"]["uris"] == [f"spiffe://goodput/goodput/goodput/{key}"], component
        assert (data[prefix + "TLS_TRUST_DOMAIN"], data[prefix + "TLS_RELEASE"]) == ("goodput", "goodput/goodput")
        assert {"server auth", "client auth"} <= set(cert["spec"]["usages"]), component
        assert cert["spec"]["issuerRef"]["name"] == "goodput-ca", component
    # No issuer given: the release bootstraps its own CA.
    assert certificates["goodput-ca"]["spec"]["isCA"] is True
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "Issuer"} == {"goodput-selfsigned", "goodput-ca"}


def test_internal_tls_from_an_issuer_or_existing_secrets(chart: Any) -> None:
    docs = chart.docs(sets=("tls.certManager.issuerRef.name=platform-ca",
                            "tls.certManager.issuerRef.kind=ClusterIssuer",
                            "tls.existingSecrets.scheduler=my-scheduler-tls", "tls.trustDomain=example.org"))
    assert not [d for d in docs if d["kind"] == "Issuer"]
    certificates = [d for d in docs if d["kind"] == "Certificate"]
    # A shared issuer: the URIs name this release and trust domain, which every service checks callers against.
    assert {d["spec"]["uris"][0].rpartition("/")[0] for d in certificates} == {"spiffe://example.org/goodput/goodput"}
    assert {v for d in by_kind(docs, "ConfigMap").values() for k, v in d["data"].items()
            if k.endswith("TLS_TRUST_DOMAIN")} == {"example.org"}
    assert all(d["spec"]["issuerRef"]["name"] == "platform-ca" for d in certificates)
    assert all(d["spec"]["issuerRef"]["kind"] == "ClusterIssuer" for d in certificates)
    assert "scheduler" not in {d["spec"]["commonName"] for d in certificates}  # the user's Secret instead
    scheduler = by_kind(docs, "Deployment")["scheduler"]["spec"]["template"]["spec"]
    (volume,) = [v for v in scheduler["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "my-scheduler-tls"
    # Without cert-manager, every rendered service needs its Secret (or the explicit insecure fallback).
    proc = chart.run([chart.helm, "template", "goodput", str(chart.path), "--set", "tls.certManager.enabled=false"])
    assert proc.returncode != 0 and "internal gRPC is mutual TLS" in proc.stderr


def test_tls_insecure_is_explicit_plaintext_with_a_warning(chart: Any) -> None:
    docs = chart.docs(sets=("tls.insecure=true",))
    assert not [d for d in docs if d["kind"] in ("Certificate", "Issuer")]
    for component, deploy in by_kind(docs, "Deployment").items():
        spec = deploy["spec"]["template"]["spec"]
        assert "tls" not in {v["name"] for v in spec["volumes"]}, component
        data = by_kind(docs, "ConfigMap")[component]["data"]
        assert [v for k, v in data.items() if k.endswith("INSECURE_INTERNAL")] == ["true"], component
        (c,) = spec["containers"]
        if any(p["name"] == "grpc" for p in c["ports"]):
            assert "grpc" in c["readinessProbe"], component  # plaintext: native gRPC probes again
    # helm renders NOTES.txt only on install (which needs a cluster): the warning is read from the template.
    notes = (chart.path / "templates" / "NOTES.txt").read_text()
    assert "{{- if .Values.tls.insecure }}\n\nWARNING: tls.insecure is true: internal gRPC is PLAINTEXT" in notes


def test_ports_follow_the_contract(chart: Any) -> None:
    expected = {
        "gateway": (50051, 8080),
        "scheduler": (50052, 9102),
        "inference": (50061, 9161),
        "embedder": (50053, 9103),
        "retriever": (50054, 9104),
        "cache": (50055, 9105),
        "indexing-worker": (None, 9106),
        "jobs-worker": (None, 9107),
    }
    docs = chart.docs()
    for component, (grpc, http) in expected.items():
        (c,) = by_kind(docs, "Deployment")[component]["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports.get("grpc") == grpc and ports["http"] == http, component


def test_scheduler_gets_the_workers_and_gateway_the_services(chart: Any) -> None:
    docs = chart.docs()
    sched = _config(docs, "scheduler")
    # the inference Service's EndpointSlices by default (test_chart_discovery.py); DNS with scheduler.discovery=dns
    # (one entry per model pool; the pool-less Service when inference.pools is empty)
    assert sched["GOODPUT_SCHEDULER_WORKERS"] == ("k8s:///goodput/goodput-inference-interactive:grpc,"
                                                  "k8s:///goodput/goodput-inference-batch:grpc")
    no_pools = ("inference.pools=null",)
    assert _config(chart.docs(sets=no_pools), "scheduler")["GOODPUT_SCHEDULER_WORKERS"] == (
        "k8s:///goodput/goodput-inference:grpc")
    assert _config(chart.docs(sets=(*no_pools, "scheduler.discovery=dns")), "scheduler")[
        "GOODPUT_SCHEDULER_WORKERS"] == "dns:///goodput-inference.goodput.svc.cluster.local:50061"
    assert by_kind(docs, "Service")["inference-interactive"]["spec"]["clusterIP"] == "None"
    gw = _config(docs, "gateway")
    assert gw["GOODPUT_GATEWAY_SCHEDULER_ADDR"] == "goodput-scheduler:50052"
    assert gw["GOODPUT_GATEWAY_CACHE_ADDR"] == "goodput-cache:50055"
    assert gw["GOODPUT_GATEWAY_RETRIEVER_ADDR"] == "goodput-retriever:50054"
    assert gw["GOODPUT_GATEWAY_EMBEDDER_ADDR"] == "goodput-embedder:50053"
    for component, data in ((c, _config(docs, c)) for c in ("gateway", "scheduler", "inference")):
        prefix = f"GOODPUT_{component.upper()}_"
        assert data[prefix + "GRPC_HOST"] == "0.0.0.0"


@pytest.mark.parametrize("values", ALL_SCENARIOS)
def test_pods_run_as_non_root_with_read_only_root(chart: Any, values: str | None) -> None:
    for component, deploy in by_kind(chart.docs(values), "Deployment").items():
        pod = deploy["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, component
        assert pod["securityContext"]["runAsUser"] != 0, component
        for c in _containers(deploy):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True, component
            assert sc["allowPrivilegeEscalation"] is False, component
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/tmp", "/cache"} <= mounts, component


@pytest.mark.parametrize("values", ALL_SCENARIOS)
def test_no_secret_in_plain_env(chart: Any, values: str | None) -> None:
    docs = chart.docs(values)
    for component, deploy in by_kind(docs, "Deployment").items():
        for c in _containers(deploy):
            for env in c.get("env", []):
                name = env["name"]
                if SECRETISH.search(name) and name not in NOT_SECRET:
                    assert "value" not in env, f"{component}: {name} has a literal value"
                    assert "secretKeyRef" in env["valueFrom"], f"{component}: {name} not from a Secret"
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        for name in cm.get("data", {}):
            assert not SECRETISH.search(name) or name in NOT_SECRET, f"{cm['metadata']['name']}: {name}"


def test_secrets_come_from_existing_secrets(chart: Any) -> None:
    docs = chart.docs(
        sets=(
            "external.redis.existingSecret=redis-auth",
            "redisUsers.enabled=false",  # else every service's own Redis user: test_chart_redis.py
            "external.qdrant.existingSecret=qdrant-auth",
            "external.elasticsearch.existingSecret=es-auth",
        ),
    )
    deploys = by_kind(docs, "Deployment")

    def env(component: str) -> dict[str, dict[str, Any]]:
        return {e["name"]: e for e in deploys[component]["spec"]["template"]["spec"]["containers"][0].get("env", [])}

    # The API keys are a mounted file, not env (env never sees a rotated key): test_chart_tenancy.py.
    assert "GOODPUT_GATEWAY_API_KEYS" not in env("gateway")
    sched = env("scheduler")  # the scheduler keeps no durable state: no Redis, so no Redis credentials either
    assert not {"GOODPUT_REDIS_PASSWORD", "GOODPUT_SCHEDULER_REDIS_URL"} & set(sched)
    for component in ("gateway", "jobs-worker"):
        redis_env = env(component)
        assert redis_env["GOODPUT_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-auth"
        assert redis_env["GOODPUT_GATEWAY_REDIS_URL"]["value"].startswith("redis://:$(GOODPUT_REDIS_PASSWORD)@")
    retr = env("retriever")
    assert retr["GOODPUT_RETRIEVER_QDRANT_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "qdrant-auth"
    assert retr["GOODPUT_RETRIEVER_ELASTICSEARCH_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "es-auth"


def test_celery_workers_run_their_app_and_serve_metrics_on_the_probed_port(chart: Any) -> None:
    docs = chart.docs()
    deploys = by_kind(docs, "Deployment")
    # component: (Celery app, env prefix, setting of the metrics port)
    workers = {"indexing-worker": ("goodput_embedder.jobs", "GOODPUT_EMBEDDER_", "WORKER_HTTP_PORT"),
               "jobs-worker": ("goodput_gateway.worker", "GOODPUT_GATEWAY_", "JOBS__WORKER_HTTP_PORT")}
    for component, (app, prefix, port_setting) in workers.items():
        (c,) = deploys[component]["spec"]["template"]["spec"]["containers"]
        assert c["command"][:4] == ["celery", "-A", app, "worker"], component
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert set(ports) == {"http"}, component
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, f"{component} {probe}"
        # The worker's metrics server listens where the kubelet probes: the pod IP, on the container port.
        config = _config(docs, component)
        assert config[prefix + port_setting] == str(ports["http"]), component
        assert config[prefix + "GRPC_HOST"] == "0.0.0.0", component


def test_jobs_worker_shares_the_gateways_jobs_settings(chart: Any) -> None:
    docs = chart.docs(sets=("gateway.config.jobsQueue=batch-jobs", "gateway.config.jobsPrefix=acme:jobs",
                            "gateway.env.GOODPUT_GATEWAY_JOBS__RETRY_CAP_S=30"))
    gw, jobs = _config(docs, "gateway"), _config(docs, "jobs-worker")
    for name in ("JOBS__QUEUE", "JOBS__PREFIX", "JOBS__PARK_SHED_P2", "SCHEDULER_ADDR", "CACHE_ADDR", "RETRIEVER_ADDR",
                 "EMBEDDER_ADDR", "REQUEST_TIMEOUT_S", "JOBS__RETRY_CAP_S"):
        assert jobs["GOODPUT_GATEWAY_" + name] == gw["GOODPUT_GATEWAY_" + name], name
    assert gw["GOODPUT_GATEWAY_JOBS__QUEUE"] == "batch-jobs" and gw["GOODPUT_GATEWAY_JOBS__PREFIX"] == "acme:jobs"
    (c,) = by_kind(docs, "Deployment")["jobs-worker"]["spec"]["template"]["spec"]["containers"]
    assert "--queues=batch-jobs" in c["command"]
    # Both park and run jobs in the same Redis.
    urls = {}
    for component in ("gateway", "jobs-worker"):
        (container,) = by_kind(docs, "Deployment")[component]["spec"]["template"]["spec"]["containers"]
        urls[component] = {e["name"]: e.get("value") for e in container["env"]}["GOODPUT_GATEWAY_REDIS_URL"]
    # (each as its own Redis user)
    assert urls["gateway"] == urls["jobs-worker"].replace("-jobsWorker:", "-gateway:") \
        == "redis://goodput-gateway:$(GOODPUT_REDIS_PASSWORD)@redis-master.goodput-data.svc.cluster.local:6379/0"


def test_jobs_worker_network_policy_reaches_the_gateways_pipeline(chart: Any) -> None:
    policies = by_kind(chart.docs(), "NetworkPolicy")
    egress = {
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: [p["port"] for p in rule["ports"]]
        for rule in policies["jobs-worker"]["spec"]["egress"]
        for peer in rule.get("to", [])
        if "podSelector" in peer and "namespaceSelector" not in peer
    }
    assert egress == {"scheduler": [50052], "inference": [50061], "cache": [50055], "retriever": [50054],
                      "embedder": [50053]}
    assert any([p["port"] for p in rule["ports"]] == [6379] for rule in policies["jobs-worker"]["spec"]["egress"])
    # ...and those services let it in (only its metrics port is open, to the scrapers).
    for component in egress:
        callers = [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                   for rule in policies[component]["spec"]["ingress"] if rule["ports"][0]["port"] == "grpc"
                   for peer in rule["from"]]
        assert "jobs-worker" in callers, component
    (ingress,) = policies["jobs-worker"]["spec"]["ingress"]
    assert [p["port"] for p in ingress["ports"]] == ["http"] and ingress["from"]


def test_no_jobs_worker_without_the_gateways_redis(chart: Any) -> None:
    for sets in (("gateway.config.useRedis=false",), ("gateway.enabled=false",), ("jobsWorker.enabled=false",)):
        docs = chart.docs(sets=sets)
        assert "jobs-worker" not in by_kind(docs, "Deployment"), sets
        assert "jobs-worker" not in by_kind(docs, "ConfigMap"), sets
    docs = chart.docs(sets=("gateway.config.useRedis=false",))
    (gw,) = by_kind(docs, "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"]
    assert "GOODPUT_GATEWAY_REDIS_URL" not in {e["name"] for e in gw.get("env", [])}


def test_config_change_rolls_pods(chart: Any) -> None:
    def checksum(docs: list[dict[str, Any]]) -> str:
        deploy = by_kind(docs, "Deployment")["inference-interactive"]
        return deploy["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    before = checksum(chart.docs())
    after = checksum(chart.docs(sets=("inference.vllm.maxModelLen=4096",)))
    assert before != after


@pytest.mark.parametrize(
    "bad",
    [
        "gateway.replicaz=3",  # misspelt key
        "inference.vllm.tensorParalelSize=2",  # misspelt nested key
        "inference.autoscaling.queueDepth.target=4",  # unknown key in the HPA block
        "shceduler.replicas=1",  # misspelt service
        "gateway.env.UPSTREAM_API_KEY=hunter2",  # a secret as a plain env var
        "podSecurityContext.runAsNonRoot=false",  # root pods
    ],
)
def test_schema_rejects_bad_values(chart: Any, bad: str) -> None:
    proc = chart.run([chart.helm, "template", "goodput", str(CHART), "--set", bad])
    assert proc.returncode != 0, f"--set {bad} was accepted"
    assert "schema" in proc.stderr, proc.stderr


def test_schema_is_strict_throughout() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            # An object schema (not an if/not condition, which only matches) must refuse unknown keys.
            if "properties" in node and node.get("type") == "object":
                assert node.get("additionalProperties") is False, f"{path} allows unknown keys"
            for key, child in node.items():
                walk(child, f"{path}/{key}")
        elif isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, f"{path}/{i}")

    walk(schema, "#")


def test_every_value_is_documented() -> None:
    """Every value in values.yaml has a `# --` comment above it or above an enclosing key."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*(?:- )?)([A-Za-z][\w./-]*):(.*)$", line)
        if not m:
            continue
        indent, rest = len(m.group(1)), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        documented = (j >= 0 and lines[j].strip().startswith("# --")) or any(d for _, d in stack)
        if rest.strip() and not documented:
            undocumented.append(f"{i + 1}: {line.strip()}")
        stack.append((indent, documented))
    assert not undocumented, "values without a `# --` comment:\n" + "\n".join(undocumented)


@pytest.mark.parametrize("values", ALL_SCENARIOS)
def test_network_policies_expose_only_the_gateway(chart: Any, values: str | None) -> None:
    docs = chart.docs(values)
    policies = by_kind(docs, "NetworkPolicy")
    if values == "cpu-dev-values.yaml":
        assert not policies
        return
    assert set(policies) == set(by_kind(docs, "Deployment"))
    for component, policy in policies.items():
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            if component == "gateway":
                continue
            # Everything but the gateway is reached only from named pods or the metrics scrapers.
            assert rule.get("from"), f"{component} accepts {ports} from anywhere"
    inference_from = [
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for rule in policies["inference"]["spec"]["ingress"]
        if "grpc" in {p["port"] for p in rule["ports"]}
        for peer in rule["from"]
    ]
    assert sorted(inference_from) == ["gateway", "jobs-worker", "scheduler"]


def test_pdbs_for_every_service(chart: Any) -> None:
    docs = chart.docs()
    assert set(by_kind(docs, "PodDisruptionBudget")) == set(by_kind(docs, "Deployment"))



def test_tenant_cache_sharing_reaches_workers_and_scheduler_and_the_salt_key_comes_from_a_secret(chart: Any) -> None:
    """The workers salt prefix caches per tenant and the scheduler keys affinity the same way: both get the same
    sharing groups; the salt's key is a Secret, never a plain value."""
    docs = chart.docs(sets=("tenancy.cacheSharingGroups.support={acme-a,acme-b}",
                            "tenancy.cacheSaltKey.existingSecret=salt"))
    expected = {"support": ["acme-a", "acme-b"]}
    assert json.loads(_config(docs, "inference")["GOODPUT_INFERENCE_CACHE_SHARING_GROUPS"]) == expected
    assert json.loads(_config(docs, "scheduler")["GOODPUT_SCHEDULER_CACHE_SHARING_GROUPS"]) == expected
    deploy = by_kind(docs, "Deployment")["inference"]
    env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    assert env["GOODPUT_INFERENCE_CACHE_SALT_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "salt",
                                                                                    "key": "cache-salt-key"}
    defaults = chart.docs()
    assert "GOODPUT_INFERENCE_CACHE_SHARING_GROUPS" not in _config(defaults, "inference")  # every tenant alone


def test_a_metrics_port_of_its_own_is_wired_through_env_pod_service_monitor_and_policy(chart: Any) -> None:
    """gateway.service.metricsPort keeps /metrics off the public REST port: the process is told (METRICS_PORT), the
    pod and the Service name the port, Prometheus scrapes it and the NetworkPolicy lets only metricsFrom reach it."""
    docs = chart.docs(sets=("gateway.service.metricsPort=9180",))
    assert _config(docs, "gateway")["GOODPUT_GATEWAY_METRICS_PORT"] == "9180"
    container = by_kind(docs, "Deployment")["gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 9180, "protocol": "TCP"} in container["ports"]
    service_ports = {p["name"]: p["port"] for p in by_kind(docs, "Service")["gateway"]["spec"]["ports"]}
    assert service_ports["metrics"] == 9180
    assert by_kind(docs, "ServiceMonitor")["gateway"]["spec"]["endpoints"][0]["port"] == "metrics"
    ingress = by_kind(docs, "NetworkPolicy")["gateway"]["spec"]["ingress"]
    metrics_rules = [r for r in ingress if {"port": "metrics", "protocol": "TCP"} in r["ports"]]
    assert len(metrics_rules) == 1 and metrics_rules[0].get("from"), "only networkPolicy.metricsFrom reaches it"
    defaults = chart.docs()  # by default too: the gateway's metrics are never on its public port
    assert _config(defaults, "gateway")["GOODPUT_GATEWAY_METRICS_PORT"] == "8090"
    assert by_kind(defaults, "ServiceMonitor")["gateway"]["spec"]["endpoints"][0]["port"] == "metrics"
    assert by_kind(defaults, "ServiceMonitor")["scheduler"]["spec"]["endpoints"][0]["port"] == "http"
    with pytest.raises(Exception, match="gateway.service.metricsPort must be set"):
        chart.docs(sets=("gateway.service.metricsPort=0",))


def test_cross_encoders_mount_from_a_claim_and_are_required_when_enabled(chart: Any) -> None:
    off = chart.docs()
    assert _config(off, "retriever")["GOODPUT_RETRIEVER_RERANKER"] == "auto"
    assert _config(off, "gateway")["GOODPUT_GATEWAY_RAG__RERANK"] == "false"
    docs = chart.docs(sets=("retriever.crossEncoder.enabled=true", "retriever.crossEncoder.claimName=models",
                            "retriever.crossEncoder.subPath=goodput-reranker-minilm",
                            "cache.crossEncoder.enabled=true", "cache.crossEncoder.claimName=models"))
    retriever, cache = _config(docs, "retriever"), _config(docs, "cache")
    assert (retriever["GOODPUT_RETRIEVER_RERANKER"], retriever["GOODPUT_RETRIEVER_RERANKER_MODEL"]) == (
        "cross-encoder", "/models/reranker")
    assert (cache["GOODPUT_CACHE_VERIFIER"], cache["GOODPUT_CACHE_VERIFIER_MODEL"]) == (
        "cross-encoder", "/models/verifier")
    assert _config(docs, "gateway")["GOODPUT_GATEWAY_RAG__RERANK"] == "true"
    for component, path in (("retriever", "/models/reranker"), ("cache", "/models/verifier")):
        pod = by_kind(docs, "Deployment")[component]["spec"]["template"]["spec"]
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == path)
        assert mount["readOnly"] is True
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    subpath = next(m for m in by_kind(docs, "Deployment")["retriever"]["spec"]["template"]["spec"]["containers"][0]
                   ["volumeMounts"] if m["mountPath"] == "/models/reranker")
    assert subpath["subPath"] == "goodput-reranker-minilm"
    with pytest.raises(Exception, match="claimName is required"):
        chart.docs(sets=("cache.crossEncoder.enabled=true",))


def test_the_cache_gets_its_l2_memory_budget_and_the_pod_limit_stays_above_it(chart: Any) -> None:
    docs = chart.docs()
    budget = int(_config(docs, "cache")["GOODPUT_CACHE_MAX_L2_BYTES"])
    assert budget == 256 << 20
    limit = by_kind(docs, "Deployment")["cache"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limit["memory"] == "1Gi" and budget + (300 << 20) < 1 << 30  # the model and runtime fit beside it
    assert _config(chart.docs(sets=("cache.config.maxL2Bytes=536870912",)), "cache")[
        "GOODPUT_CACHE_MAX_L2_BYTES"] == "536870912"
    with pytest.raises(Exception, match="maxL2Bytes"):
        chart.docs(sets=("cache.config.maxL2Bytes=1000",))


COMPONENTS = ("gateway", "scheduler", "inference", "embedder", "retriever", "cache", "indexing-worker", "jobs-worker")


def test_every_service_starts_with_the_platforms_grpc_experiments(chart: Any) -> None:
    # gRPC reads GRPC_EXPERIMENTS once, before its first channel: the pods get it from their ConfigMap, the same
    # value the images and the local supervisor set (goodput_core.clients.GRPC_EXPERIMENTS).
    docs = chart.docs()
    for component in COMPONENTS:
        assert _config(docs, component)["GRPC_EXPERIMENTS"] == GRPC_EXPERIMENTS, component
    # Empty: gRPC's own defaults. The variable is still set (to ""), so the images' ENV does not apply either.
    plain = chart.docs(sets=("common.grpcExperiments=",))
    for component in COMPONENTS:
        assert _config(plain, component)["GRPC_EXPERIMENTS"] == "", component
