"""One topology: the chart's service meta, docs/services.md and the supervisor all follow goodput_contracts.topology.

The meta is read from _helpers.tpl itself (plain YAML inside the define), so this runs without helm; the rendered
ports and network policies are then checked with helm against the same definition.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from goodput_contracts import SERVICES, callers

from goodput_cli.supervisor import Platform

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "charts" / "goodput" / "templates" / "_helpers.tpl"
SERVICES_MD = REPO / "docs" / "services.md"


def chart_meta() -> dict[str, Any]:
    text = HELPERS.read_text()
    body = text.split('{{- define "goodput.serviceMeta" -}}', 1)[1].split("{{- end }}", 1)[0]
    body = re.sub(r"^\s*\{\{-? */\*.*?\*/ *-?\}\}\s*$", "", body, flags=re.M | re.S)
    return yaml.safe_load(body)


def test_the_charts_service_meta_is_the_topology() -> None:
    meta = chart_meta()
    assert set(meta) == set(SERVICES)
    for key, svc in SERVICES.items():
        m = meta[key]
        assert (m["component"], m["prefix"], m["grpcPort"], m["httpPort"]) == (
            svc.component, svc.prefix, svc.grpc_port, svc.http_port), key
        assert m.get("httpPortSetting", "HTTP_PORT") == svc.http_port_setting, key
        celery = m.get("celery") or {}
        assert (celery.get("app", ""), celery.get("queueSetting", "")) == (svc.celery_app, svc.queue_setting), key
        assert sorted(m["egressTo"]) == sorted(svc.calls), f"{key} calls"
        assert sorted(m["ingressFrom"]) == sorted(callers(key)), f"{key} is called by"
        assert sorted(m["external"]) == sorted(svc.external), key
    # a metrics port of its own (the gateway's: its REST port is public) is the chart's default too
    values = yaml.safe_load((REPO / "charts" / "goodput" / "values.yaml").read_text())
    assert {k: s.metrics_port for k, s in SERVICES.items() if s.metrics_port} == {
        k: v["service"]["metricsPort"] for k, v in values.items()
        if isinstance(v, dict) and (v.get("service") or {}).get("metricsPort")}


def test_docs_services_md_lists_the_topologys_ports_and_prefixes() -> None:
    rows = [line for line in SERVICES_MD.read_text().split("## Processes", 1)[1].split("##", 1)[0].splitlines()
            if line.startswith("| ") and "`goodput_" in line]
    seen = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        package = re.search(r"`(goodput_\w+)", cells[1]).group(1)  # type: ignore[union-attr]
        grpc = re.match(r"(\d+)", cells[2])
        http = re.match(r"(\d+)", cells[3])
        seen[cells[0]] = (package, int(grpc.group(1)) if grpc else 0, int(http.group(1)) if http else 0,
                          cells[4].strip("`"))
    by_ports = {(s.package, s.grpc_port, s.http_port, s.prefix) for s in SERVICES.values()}
    assert set(seen.values()) == by_ports


def test_the_supervisor_wires_every_peer_of_the_topology(tmp_path: Path) -> None:
    specs = {s.name: s for s in Platform(workdir=tmp_path, workers=1, port_offset=7).plan()}
    names = {"inference": "worker-0", "indexWorker": "index-worker", "jobsWorker": "jobs-worker"}
    for key, svc in SERVICES.items():
        env = specs[names.get(key, key)].env
        if svc.grpc_port:
            assert env[svc.env("GRPC_PORT")] == str(svc.grpc_port + 7), key
        assert env[svc.env(svc.http_port_setting)] == str(svc.http_port + 7), key
        if svc.metrics_port:
            assert env[svc.env("METRICS_PORT")] == str(svc.metrics_port + 7), key
        for peer in svc.peers:
            if (key, peer.service) == ("cache", "embedder"):  # embeds in-process on one machine
                assert svc.env(peer.setting) not in env
                continue
            assert env[svc.env(peer.setting)].endswith(f":{SERVICES[peer.service].grpc_port + 7}"), (key, peer)


def test_rendered_ports_and_network_policies_follow_the_topology(chart: Any) -> None:
    docs = chart.docs()
    deployments = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs
                   if d["kind"] == "Deployment"}
    policies = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs
                if d["kind"] == "NetworkPolicy"}
    for svc in SERVICES.values():
        (c,) = deployments[svc.component]["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert (ports.get("grpc", 0), ports["http"], ports.get("metrics", 0)) == (
            svc.grpc_port, svc.http_port, svc.metrics_port), svc.key
        if svc.component in policies:
            egress_ports = {p["port"] for rule in policies[svc.component]["spec"].get("egress", [])
                            for p in rule.get("ports", []) if rule.get("to") and "podSelector" in rule["to"][0]}
            assert {SERVICES[k].grpc_port for k in svc.calls} <= egress_ports, svc.key
