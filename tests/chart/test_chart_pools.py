"""Model pools (inference.pools): each pool renders its own ConfigMap, Deployment, Service, HPA and PDB, named
<fullname>-inference-<pool> and labelled goodput.dev/pool, inheriting the `inference` block unless it overrides it;
the scheduler watches every pool's Service; the scheduler's RBAC and the workers' certificate stay one each."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

DEFAULT_POOLS = {"interactive": ("P0,P1", "16", "2048"), "batch": ("P2", "128", "8192")}
THREE_POOLS = {"interactive": 1, "batch": 1, "qwen-72b": 2}  # pool -> tensor-parallel size


def _named(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _inference(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """The inference workers' manifests of one kind, by pool ("" for the pool-less one)."""
    return {d["metadata"]["labels"].get("goodput.dev/pool", ""): d for d in docs
            if d["kind"] == kind and d["metadata"]["labels"].get("app.kubernetes.io/component") == "inference"}


def _helm_template(chart: Any, *args: str) -> Any:
    return chart.run([chart.helm, "template", "goodput", str(chart.path), "--namespace", "goodput", *args])


def test_default_values_render_two_pools_of_one_model(chart: Any) -> None:
    docs = chart.docs()
    deployments = _inference(docs, "Deployment")
    assert set(deployments) == set(DEFAULT_POOLS), "no pool-less goodput-inference next to the pools"
    configs = _inference(docs, "ConfigMap")
    for pool, (classes, max_num_seqs, batched_tokens) in DEFAULT_POOLS.items():
        name = f"goodput-inference-{pool}"
        deploy = deployments[pool]
        assert deploy["metadata"]["name"] == name
        assert deploy["spec"]["selector"]["matchLabels"]["goodput.dev/pool"] == pool
        assert deploy["spec"]["template"]["metadata"]["labels"]["goodput.dev/pool"] == pool
        (container,) = deploy["spec"]["template"]["spec"]["containers"]
        assert container["envFrom"] == [{"configMapRef": {"name": name}}]
        env = configs[pool]["data"]
        assert configs[pool]["metadata"]["name"] == name
        assert env["GOODPUT_INFERENCE_POOL"] == pool
        assert env["GOODPUT_INFERENCE_POOL_CLASSES"] == classes
        assert env["GOODPUT_INFERENCE_MAX_NUM_SEQS"] == max_num_seqs
        assert env["GOODPUT_INFERENCE_MAX_NUM_BATCHED_TOKENS"] == batched_tokens
        # everything else comes from the inference block: one model, one image
        assert env["GOODPUT_INFERENCE_SERVED_MODEL_NAME"] == "qwen2.5-7b-instruct"
        assert container["image"].startswith("goodput/inference:")
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    # each pool scales on its own queue: the batch pool's P2 demand buys batch GPUs only
    hpas = _inference(docs, "HorizontalPodAutoscaler")
    priorities = {pool: next(m for m in hpa["spec"]["metrics"] if m["type"] == "Object")["object"]["metric"]
                  ["selector"]["matchExpressions"][0]["values"] for pool, hpa in hpas.items()}
    assert priorities == {"interactive": ["P0", "P1"], "batch": ["P2"]}
    assert hpas["batch"]["spec"]["maxReplicas"] == 4


@pytest.mark.parametrize("values", ["two-pools-values.yaml", "three-pools-values.yaml"])
def test_each_pool_has_its_deployment_service_hpa_and_pdb(chart: Any, values: str) -> None:
    docs = chart.docs(values)
    pools = set(_inference(docs, "Deployment"))
    assert pools == ({"interactive", "batch"} if values.startswith("two") else set(THREE_POOLS))
    for kind in ("ConfigMap", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"):
        manifests = _inference(docs, kind)
        assert set(manifests) == pools, kind
        for pool, d in manifests.items():
            assert d["metadata"]["name"] == f"goodput-inference-{pool}", kind
            assert d["metadata"]["labels"]["goodput.dev/pool"] == pool, kind
    for pool, svc in _inference(docs, "Service").items():
        assert svc["spec"]["clusterIP"] == "None"  # headless: one address per ready worker, as without pools
        assert svc["spec"]["selector"]["goodput.dev/pool"] == pool
        assert "grpc" in {p["name"] for p in svc["spec"]["ports"]}
    for pool, hpa in _inference(docs, "HorizontalPodAutoscaler").items():
        assert hpa["spec"]["scaleTargetRef"]["name"] == f"goodput-inference-{pool}"
    for pool, pdb in _inference(docs, "PodDisruptionBudget").items():
        assert pdb["spec"]["selector"]["matchLabels"]["goodput.dev/pool"] == pool


@pytest.mark.parametrize("values", ["two-pools-values.yaml", "three-pools-values.yaml"])
def test_the_scheduler_watches_every_pool(chart: Any, values: str) -> None:
    docs = chart.docs(values)
    services = [f"goodput-inference-{pool}" for pool in _inference(docs, "Deployment")]
    workers = _named(docs, "ConfigMap")["goodput-scheduler"]["data"]["GOODPUT_SCHEDULER_WORKERS"]
    assert workers.split(",") == [f"k8s:///goodput/{s}:grpc" for s in services]
    docs = chart.docs(values, sets=("scheduler.discovery=dns",))
    workers = _named(docs, "ConfigMap")["goodput-scheduler"]["data"]["GOODPUT_SCHEDULER_WORKERS"]
    assert workers.split(",") == [f"dns:///{s}.goodput.svc.cluster.local:50061" for s in services]


def test_rbac_and_certificate_once_for_all_pools(chart: Any) -> None:
    docs = chart.docs("three-pools-values.yaml")
    # the scheduler's Role covers every EndpointSlice of the namespace: one for all pools
    assert list(_named(docs, "Role")) == ["goodput-scheduler"]
    assert list(_named(docs, "RoleBinding")) == ["goodput-scheduler"]
    (rule,) = [r for r in _named(docs, "Role")["goodput-scheduler"]["rules"] if r["resources"] == ["endpointslices"]]
    assert "resourceNames" not in rule
    # the pools are one service (spiffe://goodput/goodput/goodput/inference): one certificate, mounted by every pool
    certificates = [n for n in _named(docs, "Certificate") if n.startswith("goodput-inference")]
    assert certificates == ["goodput-inference"]
    for deploy in _inference(docs, "Deployment").values():
        secrets = {v["secret"]["secretName"] for v in deploy["spec"]["template"]["spec"]["volumes"] if "secret" in v}
        assert secrets == {"goodput-inference-tls"}


def test_a_pool_overrides_model_gpus_and_engine_settings(chart: Any) -> None:
    docs = chart.docs("three-pools-values.yaml")
    deployments, configs = _inference(docs, "Deployment"), _inference(docs, "ConfigMap")
    for pool, tp in THREE_POOLS.items():
        pod = deployments[pool]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["requests"]["nvidia.com/gpu"] == tp, pool
        assert container["resources"]["limits"]["nvidia.com/gpu"] == tp, pool
        assert configs[pool]["data"]["GOODPUT_INFERENCE_TENSOR_PARALLEL_SIZE"] == str(tp), pool
    big = configs["qwen-72b"]["data"]
    assert big["GOODPUT_INFERENCE_MODEL"] == "/models/Qwen2.5-72B-Instruct-AWQ"
    assert big["GOODPUT_INFERENCE_SERVED_MODEL_NAME"] == "qwen2.5-72b-instruct"
    assert big["GOODPUT_INFERENCE_SERVED_MODEL_ALIASES"] == "large,qwen-large"
    assert big["GOODPUT_INFERENCE_QUANTIZATION"] == "awq_marlin"
    assert big["GOODPUT_INFERENCE_MAX_MODEL_LEN"] == "16384"
    assert big["GOODPUT_INFERENCE_POOL_CLASSES"] == "P0,P1,P2"
    assert deployments["qwen-72b"]["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert deployments["batch"]["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-L4"}  # inherited
    (container,) = deployments["qwen-72b"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["memory"] == "96Gi"
    assert container["startupProbe"]["failureThreshold"] == 180
    assert container["startupProbe"]["periodSeconds"] == 10
    # the small model's pools keep the inference block's model, no aliases, the default engine
    small = configs["batch"]["data"]
    assert small["GOODPUT_INFERENCE_MODEL"] == "/models/Qwen2.5-7B-Instruct"
    assert "GOODPUT_INFERENCE_SERVED_MODEL_ALIASES" not in small and "GOODPUT_INFERENCE_ENGINE" not in small


def test_a_pool_may_turn_off_what_the_inference_block_turns_on(chart: Any) -> None:
    docs = chart.docs(set_json=(
        'inference.pools=[{"name": "fixed", "replicas": 3, "autoscaling": {"enabled": false},'
        ' "pdb": {"enabled": false}, "engine": "sim", "gpu": {"enabled": false}}]',))
    (deploy,) = _inference(docs, "Deployment").values()
    assert deploy["spec"]["replicas"] == 3
    assert not _inference(docs, "HorizontalPodAutoscaler") and not _inference(docs, "PodDisruptionBudget")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in str(container["resources"])
    data = _inference(docs, "ConfigMap")["fixed"]["data"]
    assert data["GOODPUT_INFERENCE_ENGINE"] == "sim"
    assert "GOODPUT_INFERENCE_POOL_CLASSES" not in data  # no classes: the pool serves every class


def test_without_pools_the_single_inference_deployment_renders(chart: Any) -> None:
    docs = chart.docs(sets=("inference.pools=null",))
    deployments = _inference(docs, "Deployment")
    assert list(deployments) == [""]
    assert deployments[""]["metadata"]["name"] == "goodput-inference"
    data = _inference(docs, "ConfigMap")[""]["data"]
    assert "GOODPUT_INFERENCE_POOL" not in data and "GOODPUT_INFERENCE_MAX_NUM_BATCHED_TOKENS" not in data
    workers = _named(docs, "ConfigMap")["goodput-scheduler"]["data"]["GOODPUT_SCHEDULER_WORKERS"]
    assert workers == "k8s:///goodput/goodput-inference:grpc"


@pytest.mark.parametrize(("pools", "error"), [
    ('[{"name": "a"}, {"name": "a"}]', "used twice"),
    ('[{"name": "a", "tensorParallelSize": 2, "gpu": {"count": 1}}]', "below its tensor-parallel size"),
    ('[{"name": "Not_A_Label"}]', "pattern"),
    ('[{"name": "a", "classes": ["P3"]}]', "classes.0"),
    ('[{"name": "a", "maxNumSeq": 8}]', "maxNumSeq"),
    ('[{"classes": ["P0"]}]', "name"),
])
def test_bad_pools_are_refused(chart: Any, pools: str, error: str) -> None:
    proc = _helm_template(chart, "--set-json", f"inference.pools={pools}")
    assert proc.returncode != 0 and error in proc.stderr, proc.stderr


def test_each_pool_reports_its_price_and_the_gateway_gets_its_routing_settings(chart: Any) -> None:
    """costPerHour reaches the pool's workers (what model "auto" weighs), each worker's lease cap is its own
    maxNumSeqs (maxInflightPerWorker 0), and the gateway gets MODEL_FALLBACKS and AUTO_MODELS."""
    docs = chart.docs()
    configs = _inference(docs, "ConfigMap")
    assert {pool: c["data"]["GOODPUT_INFERENCE_POOL_COST_PER_HOUR"] for pool, c in configs.items()} == \
        {"interactive": "1", "batch": "1"}
    maps = _named(docs, "ConfigMap")
    assert maps["goodput-scheduler"]["data"]["GOODPUT_SCHEDULER_MAX_INFLIGHT_PER_WORKER"] == "0"
    gateway = maps["goodput-gateway"]["data"]
    assert (gateway["GOODPUT_GATEWAY_MODEL_FALLBACKS"], gateway.get("GOODPUT_GATEWAY_AUTO_MODELS", "")) == ("{}", "")
    docs = chart.docs(set_json=('gateway.config.modelFallbacks={"big": "small"}',
                                'gateway.config.autoModels=["small", "big"]',
                                'inference.pools=[{"name": "big", "costPerHour": 4.5}]'))
    gateway = _named(docs, "ConfigMap")["goodput-gateway"]["data"]
    assert gateway["GOODPUT_GATEWAY_MODEL_FALLBACKS"] == '{"big":"small"}'
    assert gateway["GOODPUT_GATEWAY_AUTO_MODELS"] == "small,big"
    assert _inference(docs, "ConfigMap")["big"]["data"]["GOODPUT_INFERENCE_POOL_COST_PER_HOUR"] == "4.5"


def test_the_sizing_calculators_values_snippet_renders_as_a_pool(chart: Any, tmp_path: Any) -> None:
    """`goodput size`'s values snippet is a valid pool: the schema takes it and the pool gets its GPUs and price."""
    from goodput_cli.gpus import GPUS
    from goodput_cli.sizing import SHAPES, pool_values, size

    plan = size(SHAPES["72B"], context=8192, concurrency=16, quantization="int8", gpus=[GPUS["A100-80"]])
    assert plan.recommended is not None and plan.recommended.count == 2
    values = tmp_path / "sized.yaml"
    values.write_text("inference:\n  " + pool_values(plan, plan.recommended, name="qwen-72b",
                                                      model="/models/Qwen2.5-72B").replace("\n", "\n  "))
    proc = chart.run([chart.helm, "template", "goodput", str(chart.path), "--namespace", "goodput",
                      "-f", str(values)])
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    (container,) = _inference(docs, "Deployment")["qwen-72b"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    env = _inference(docs, "ConfigMap")["qwen-72b"]["data"]
    assert float(env["GOODPUT_INFERENCE_POOL_COST_PER_HOUR"]) == plan.recommended.cost_per_hour > 0
    assert env["GOODPUT_INFERENCE_TENSOR_PARALLEL_SIZE"] == "2"
