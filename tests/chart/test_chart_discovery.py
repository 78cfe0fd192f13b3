"""How the rendered scheduler finds the inference workers and elects its leader: by default it watches their
Service's EndpointSlices and holds a coordination.k8s.io Lease, with a ServiceAccount of its own allowed only to read
EndpointSlices and to read, create and update Leases in the release namespace (and the only pod with an API token),
and a NetworkPolicy egress to the API server; ``scheduler.discovery=dns`` with ``leaderElection=none`` renders none
of it. Its replicas sit behind a headless Service, so the gateways see each and call the leader."""

from __future__ import annotations

from typing import Any

import pytest

SCENARIOS = [None, "cpu-dev-values.yaml", "gpu-7b-values.yaml", "autoscaling-off-values.yaml"]


def _kinds(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pod(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"
                 and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return dict(deploy["spec"]["template"]["spec"])


ENDPOINTSLICES = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
LEASES = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}


@pytest.mark.parametrize("values", SCENARIOS)
def test_the_scheduler_may_read_endpointslices_and_hold_its_lease_and_nothing_else(chart: Any,
                                                                                   values: str | None) -> None:
    docs = chart.docs(values)
    (role,) = _kinds(docs, "Role").values()
    assert role["metadata"] == {**role["metadata"], "name": "goodput-scheduler", "namespace": "goodput"}
    assert role["rules"] == [ENDPOINTSLICES, LEASES]
    assert not _kinds(docs, "ClusterRole") and not _kinds(docs, "ClusterRoleBinding")
    (binding,) = _kinds(docs, "RoleBinding").values()
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "goodput-scheduler"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "goodput-scheduler", "namespace": "goodput"}]
    assert "goodput-scheduler" in _kinds(docs, "ServiceAccount")

    scheduler = _pod(docs, "scheduler")
    assert scheduler["serviceAccountName"] == "goodput-scheduler" and scheduler["automountServiceAccountToken"]
    for d in docs:  # every other pod keeps the shared account, without a token
        if d["kind"] == "Deployment" and d["metadata"]["name"] != "goodput-scheduler":
            pod = d["spec"]["template"]["spec"]
            assert pod["serviceAccountName"] == "goodput" and pod["automountServiceAccountToken"] is False


def test_the_scheduler_watches_the_inference_service_it_may_reach(chart: Any) -> None:
    docs = chart.docs("gpu-7b-values.yaml")
    config = _kinds(docs, "ConfigMap")["goodput-scheduler"]["data"]
    # one entry per model pool's Service (inference.pools)
    assert config["GOODPUT_SCHEDULER_WORKERS"] == ("k8s:///goodput/goodput-inference-interactive:grpc,"
                                                   "k8s:///goodput/goodput-inference-batch:grpc")
    # the entry names a port of that Service by name, as its EndpointSlices carry it
    for pool in ("interactive", "batch"):
        inference = _kinds(docs, "Service")[f"goodput-inference-{pool}"]
        assert "grpc" in {p["name"] for p in inference["spec"]["ports"]}
    egress = _kinds(docs, "NetworkPolicy")["goodput-scheduler"]["spec"]["egress"]
    api_ports = [{p["port"] for p in rule["ports"]} for rule in egress if "to" not in rule]
    assert {443, 6443} in api_ports, "the scheduler must reach the API server"
    for name, policy in _kinds(docs, "NetworkPolicy").items():
        if name != "goodput-scheduler":
            assert all(not ({443, 6443} & {p["port"] for p in r.get("ports", [])}) for r in policy["spec"]["egress"])


def test_api_server_peers_come_from_values(chart: Any) -> None:
    docs = chart.docs(set_json=('networkPolicy.egress.kubernetes.to=[{"ipBlock": {"cidr": "10.0.0.1/32"}}]',))
    egress = _kinds(docs, "NetworkPolicy")["goodput-scheduler"]["spec"]["egress"]
    assert {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}],
            "ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]} in egress


def test_scheduler_replicas_elect_a_leader_behind_a_headless_service(chart: Any) -> None:
    docs = chart.docs()
    assert _kinds(docs, "Deployment")["goodput-scheduler"]["spec"]["replicas"] == 2
    config = _kinds(docs, "ConfigMap")["goodput-scheduler"]["data"]
    assert (config["GOODPUT_SCHEDULER_LEADER_ELECTION"], config["GOODPUT_SCHEDULER_LEADER_LEASE_NAME"],
            config["GOODPUT_SCHEDULER_LEADER_NAMESPACE"]) == ("kubernetes", "goodput-scheduler", "goodput")
    assert _kinds(docs, "Service")["goodput-scheduler"]["spec"]["clusterIP"] == "None"
    gateway = _kinds(docs, "ConfigMap")["goodput-gateway"]["data"]
    assert gateway["GOODPUT_GATEWAY_SCHEDULER_ADDR"] == "goodput-scheduler:50052"  # resolves to every replica
    # DNS discovery still needs the Lease: only that rule is left
    (role,) = _kinds(chart.docs(sets=("scheduler.discovery=dns",)), "Role").values()
    assert role["rules"] == [LEASES]


def test_dns_discovery_and_one_replica_need_no_api_access(chart: Any) -> None:
    docs = chart.docs(sets=("scheduler.discovery=dns", "scheduler.leaderElection=none", "scheduler.replicas=1"))
    assert not _kinds(docs, "Role") and not _kinds(docs, "RoleBinding")
    assert set(_kinds(docs, "ServiceAccount")) == {"goodput"}
    scheduler = _pod(docs, "scheduler")
    assert scheduler["serviceAccountName"] == "goodput" and scheduler["automountServiceAccountToken"] is False
    config = _kinds(docs, "ConfigMap")["goodput-scheduler"]["data"]
    assert config["GOODPUT_SCHEDULER_WORKERS"] == ("dns:///goodput-inference-interactive.goodput.svc.cluster.local:50061,"
                                                   "dns:///goodput-inference-batch.goodput.svc.cluster.local:50061")
    egress = _kinds(docs, "NetworkPolicy")["goodput-scheduler"]["spec"]["egress"]
    assert all(not ({443, 6443} & {p["port"] for p in r.get("ports", [])}) for r in egress)


def test_no_rbac_without_a_scheduler(chart: Any) -> None:
    docs = chart.docs(sets=("scheduler.enabled=false",))
    assert not _kinds(docs, "Role") and "goodput-scheduler" not in _kinds(docs, "ServiceAccount")


def test_the_schema_refuses_an_unknown_discovery(chart: Any) -> None:
    proc = chart.run([chart.helm, "template", "goodput", str(chart.path), "--set", "scheduler.discovery=consul"])
    assert proc.returncode != 0 and "discovery" in proc.stderr
