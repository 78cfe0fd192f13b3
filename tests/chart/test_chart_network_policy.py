"""Every address a service dials is allowed by the rendered NetworkPolicies both ways: egress at the caller and
ingress at the callee, on the port the address names.

The dialled addresses are the rendered peer settings (each service's ``peers`` in goodput_contracts.topology,
e.g. ``GOODPUT_GATEWAY_SCHEDULER_ADDR``), resolved through the rendered Service to the pods behind it; the gateway
and the jobs worker also dial the inference pod the scheduler granted (``also_calls``), on its gRPC port. A policy
that a template change narrows, or a peer added to the topology without its policy, fails here rather than as a
timeout in a cluster that enforces policies.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from goodput_contracts import SERVICES

SCENARIOS = [None, "cpu-dev-values.yaml", "gpu-7b-values.yaml"]


def _labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_allows(peers: list[dict[str, Any]] | None, labels: dict[str, str]) -> bool:
    """``to``/``from`` of a rule: absent = anyone; else a podSelector (same namespace) that selects ``labels``."""
    if not peers:
        return True
    return any("podSelector" in p and "namespaceSelector" not in p and "ipBlock" not in p
               and _labels_match(p["podSelector"], labels) for p in peers)


def _port_allows(ports: list[dict[str, Any]] | None, port: int, names: dict[str, int]) -> bool:
    if not ports:
        return True
    for p in ports:
        value = p.get("port")
        number = names.get(value) if isinstance(value, str) else value
        if p.get("protocol", "TCP") == "TCP" and (value is None or number == port):
            return True
    return False


class Rendered:
    def __init__(self, docs: list[dict[str, Any]]) -> None:
        def component(d: dict[str, Any]) -> str:
            """The component, and -<pool> for an inference pool's resources (``inference-batch``)."""
            labels = d["metadata"].get("labels", {})
            pool = labels.get("goodput.dev/pool")
            return str(labels.get("app.kubernetes.io/component", "")) + (f"-{pool}" if pool else "")

        def base(d: dict[str, Any]) -> str:
            return str(d["metadata"].get("labels", {}).get("app.kubernetes.io/component", ""))

        self.deployments = {component(d): d for d in docs if d["kind"] == "Deployment"}
        # the component of each deployment key: every pool of the inference workers is `inference`
        self.base = {component(d): base(d) for d in docs if d["kind"] == "Deployment"}
        self.policies = {component(d): d for d in docs if d["kind"] == "NetworkPolicy"}
        self.configs = {component(d): d.get("data") or {} for d in docs if d["kind"] == "ConfigMap"}
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}

    def pod_labels(self, component: str) -> dict[str, str]:
        return dict(self.deployments[component]["spec"]["template"]["metadata"]["labels"])

    def container_ports(self, component: str) -> dict[str, int]:
        (c,) = self.deployments[component]["spec"]["template"]["spec"]["containers"]
        return {p["name"]: p["containerPort"] for p in c.get("ports", [])}

    def resolve(self, address: str) -> tuple[str, int]:
        """The component and container port behind ``host:port`` (``dns:///host.ns.svc...:port`` included), or
        behind ``k8s:///ns/service:port`` (the Service's EndpointSlices; port by name or number)."""
        m = (re.fullmatch(r"k8s:///[^/]+/([^:/]+):(\w[-\w]*)", address.strip())
             or re.fullmatch(r"(?:dns:///)?([^:/]+):(\d+)", address.strip()))
        assert m, f"cannot read the address {address!r}"
        host, port = m.group(1).split(".")[0], m.group(2)  # a number, or a port's name (k8s:///)
        service = self.services.get(host)
        assert service is not None, f"{address!r} names no Service of the release"
        (target,) = [c for c, d in self.deployments.items()
                     if _labels_match({"matchLabels": service["spec"]["selector"]}, self.pod_labels(c))]
        (sp,) = [p for p in service["spec"]["ports"] if str(p["port"]) == port or p.get("name") == port]
        tp = sp.get("targetPort", sp["port"])
        return target, self.container_ports(target)[tp] if isinstance(tp, str) else int(tp)

    def allowed(self, caller: str, callee: str, port: int) -> list[str]:
        """What is missing for ``caller`` to reach ``callee`` on ``port`` ([] when both directions allow it)."""
        missing = []
        names = self.container_ports(callee)
        if caller in self.policies:
            egress = self.policies[caller]["spec"].get("egress", [])
            if not any(_peer_allows(r.get("to"), self.pod_labels(callee))
                       and _port_allows(r.get("ports"), port, names) for r in egress):
                missing.append(f"egress of {caller} to {callee}:{port}")
        if callee in self.policies:
            ingress = self.policies[callee]["spec"].get("ingress", [])
            if not any(_peer_allows(r.get("from"), self.pod_labels(caller))
                       and _port_allows(r.get("ports"), port, names) for r in ingress):
                missing.append(f"ingress of {callee} from {caller}:{port}")
        return missing


def dialled(rendered: Rendered) -> list[tuple[str, str, int, str]]:
    """(caller, callee, port, why) for every address a rendered service dials."""
    out = []
    rendered_components = set(rendered.base.values())
    for svc in SERVICES.values():
        if svc.component not in rendered_components:
            continue
        config = rendered.configs.get(svc.component, {})
        for peer in svc.peers:
            value = str(config.get(svc.env(peer.setting), ""))
            if not value:
                assert peer.optional or SERVICES[peer.service].component not in rendered_components, \
                    f"{svc.component} has no {svc.env(peer.setting)} although {peer.service} is rendered"
                continue
            for address in value.split(","):
                callee, port = rendered.resolve(address)
                out.append((svc.component, callee, port, svc.env(peer.setting)))
        for key in svc.also_calls:
            for callee in (d for d, c in rendered.base.items() if c == SERVICES[key].component):  # every pool
                out.append((svc.component, callee, rendered.container_ports(callee)["grpc"], f"also calls {key}"))
    return out


@pytest.mark.parametrize("values", SCENARIOS)
def test_every_dialled_address_is_allowed_both_ways(chart: Any, values: str | None) -> None:
    rendered = Rendered(chart.docs(values, sets=("networkPolicy.enabled=true",)))
    assert rendered.policies, "no NetworkPolicy rendered"
    calls = dialled(rendered)
    assert {(caller, rendered.base[callee]) for caller, callee, _, _ in calls} >= {("gateway", "scheduler"),
                                                                    ("scheduler", "inference"),
                                                                    ("gateway", "inference")}
    missing = [f"{why}: {gap}" for caller, callee, port, why in calls for gap in rendered.allowed(caller, callee, port)]
    assert not missing, "\n".join(missing)


def test_the_check_fails_when_a_policy_leaves_a_dialled_port_out(chart: Any) -> None:
    rendered = Rendered(chart.docs())
    ingress = rendered.policies["scheduler"]["spec"]["ingress"]
    for rule in ingress:
        for p in rule.get("ports", []):
            p["port"] = 1  # the scheduler's policy now admits its callers on the wrong port
    assert rendered.allowed("gateway", "scheduler", SERVICES["scheduler"].grpc_port) == [
        f"ingress of scheduler from gateway:{SERVICES['scheduler'].grpc_port}"]
