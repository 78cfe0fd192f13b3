"""promtool checks: the alert rules and their unit tests, and the prometheus-adapter queries.

prometheus-adapter's config is not a Prometheus rules file, so its PromQL is checked this way: every
metricsQuery template has its variables (<<.GroupBy>>, <<.LabelMatchers>>, <<.Series>>) replaced with the
values the adapter would use for the inference HPA, the results are written as recording rules, and
promtool both checks them (`check rules`) and evaluates them on sample series (`test rules`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES_DIR = REPO / "charts" / "goodput" / "files" / "prometheus"
ADAPTER = REPO / "k8s" / "prometheus-adapter" / "values.yaml"

# What the adapter substitutes for each rule when the inference HPA asks for the metric.
ADAPTER_SAMPLES = {
    "DCGM_FI_DEV_GPU_UTIL": {
        "group_by": "pod",
        "matchers": 'namespace="goodput",pod=~"goodput-inference-a|goodput-inference-b"',
    },
    "goodput_scheduler_queue_depth": {
        "group_by": "service",
        # The HPA's selector (priority In [P0, P1]) arrives as a matcher.
        "matchers": 'namespace="goodput",service="goodput-scheduler",priority=~"P0|P1"',
    },
}


def test_alert_rules_pass_promtool_check(chart: Any, promtool: str) -> None:
    proc = chart.run([promtool, "check", "rules", str(RULES_DIR / "alerts.yaml")])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alert_rules_unit_tests(chart: Any, promtool: str) -> None:
    proc = chart.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=RULES_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alerts_cover_slo_burn_and_saturation() -> None:
    groups = yaml.safe_load((RULES_DIR / "alerts.yaml").read_text())["groups"]
    alerts = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    assert {"GoodputP0TTFTBudgetBurnFast", "GoodputP0TTFTBudgetBurnSlow"} <= alerts
    assert {"GoodputErrorBudgetBurnFast", "GoodputErrorBudgetBurnSlow"} <= alerts
    assert {"GoodputP0QueueNearFull", "GoodputKVCacheSaturated", "GoodputGPUSaturated", "GoodputShedding"} <= alerts
    tested = (RULES_DIR / "alerts_test.yaml").read_text()
    untested = sorted(a for a in alerts if f"alertname: {a}\n" not in tested)
    # The slow-burn twins share the fast ones' recording rules, which are unit-tested.
    assert set(untested) <= {"GoodputP0TTFTBudgetBurnSlow", "GoodputErrorBudgetBurnSlow"}, untested


# The gateway's per-tenant metrics (issue 15: quotas, fair share, metering), with the labels the dashboard and the
# alerts group by. They are defined in services/gateway (goodput_gateway.metering and .quotas), not derived from it
# here (the chart tests do not import the services): keep this list in step with the gateway's metrics.
GATEWAY_TENANT_METRICS = {
    "goodput_tenant_requests_total": ("tenant", "model", "outcome"),
    "goodput_tenant_tokens_total": ("tenant", "model", "kind"),
    "goodput_tenant_cache_hits_total": ("tenant", "model"),
    "goodput_tenant_saved_tokens_total": ("tenant", "model"),
    "goodput_tenant_gpu_seconds_total": ("tenant", "model"),
    "goodput_quota_refused_total": ("tenant", "limit"),
    "goodput_quota_fail_open_total": ("reason",),
    "goodput_tenant_budget_used_ratio": ("tenant",),
    "goodput_tenant_budget_soft_ratio": ("tenant",),
    "goodput_usage_flush_errors_total": (),
    "goodput_quota_store_lost": (),
}


def test_alerts_cover_tenant_budgets_and_quota_fail_open() -> None:
    groups = yaml.safe_load((RULES_DIR / "alerts.yaml").read_text())["groups"]
    rules = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    assert {"GoodputTenantBudgetSoftThreshold", "GoodputTenantBudgetExhausted", "GoodputQuotaFailOpen"} <= set(rules)
    for name in ("GoodputTenantBudgetSoftThreshold", "GoodputTenantBudgetExhausted"):
        assert "goodput_tenant_budget_used_ratio" in rules[name]["expr"], name
        assert "{{ $labels.tenant }}" in rules[name]["annotations"]["summary"], name
    assert "goodput_tenant_budget_soft_ratio" in rules["GoodputTenantBudgetSoftThreshold"]["expr"]
    assert "goodput_quota_fail_open_total" in rules["GoodputQuotaFailOpen"]["expr"]
    assert "goodput_quota_store_lost" in rules["GoodputQuotaStoreLost"]["expr"]
    # Every goodput_tenant_* / goodput_quota_* / goodput_usage_* name an alert uses is one the gateway exports.
    used = set(re.findall(r"goodput_(?:tenant|quota|usage)_\w+", yaml.safe_dump(groups)))
    assert used <= set(GATEWAY_TENANT_METRICS), used - set(GATEWAY_TENANT_METRICS)


def _adapter_rules() -> list[dict[str, Any]]:
    return yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]


def _expand(rule: dict[str, Any]) -> str:
    name = rule["name"]["as"]
    sample = ADAPTER_SAMPLES[name]
    series = rule["seriesQuery"].split("{")[0].strip("'\" ")
    return (
        rule["metricsQuery"]
        .replace("<<.GroupBy>>", sample["group_by"])
        .replace("<<.LabelMatchers>>", sample["matchers"])
        .replace("<<.Series>>", series)
    )


def test_adapter_queries_are_valid_promql(chart: Any, promtool: str, tmp_path: Path) -> None:
    rules = _adapter_rules()
    assert {r["name"]["as"] for r in rules} == set(ADAPTER_SAMPLES)
    for r in rules:
        assert "<<.LabelMatchers>>" in r["metricsQuery"] and "<<.GroupBy>>" in r["metricsQuery"]
    recording = {
        "groups": [
            {
                "name": "prometheus-adapter-queries",
                "rules": [{"record": f"adapter:{r['name']['as']}", "expr": _expand(r)} for r in rules],
            }
        ]
    }
    path = tmp_path / "adapter-rules.yaml"
    path.write_text(yaml.safe_dump(recording, sort_keys=False))
    proc = chart.run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # Evaluate them: a tensor-parallel pod's two GPUs are averaged; P2 backlog is not counted.
    test = {
        "rule_files": [path.name],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    {
                        "series": 'DCGM_FI_DEV_GPU_UTIL{namespace="goodput",pod="goodput-inference-a",gpu="0"}',
                        "values": "60x20",
                    },
                    {
                        "series": 'DCGM_FI_DEV_GPU_UTIL{namespace="goodput",pod="goodput-inference-a",gpu="1"}',
                        "values": "80x20",
                    },
                    {
                        "series": 'DCGM_FI_DEV_GPU_UTIL{namespace="goodput",pod="goodput-other",gpu="0"}',
                        "values": "100x20",
                    },
                    {
                        "series": 'goodput_scheduler_queue_depth{namespace="goodput",service="goodput-scheduler",'
                        'priority="P0"}',
                        "values": "3x20",
                    },
                    {
                        "series": 'goodput_scheduler_queue_depth{namespace="goodput",service="goodput-scheduler",'
                        'priority="P1"}',
                        "values": "5x20",
                    },
                    {
                        "series": 'goodput_scheduler_queue_depth{namespace="goodput",service="goodput-scheduler",'
                        'priority="P2"}',
                        "values": "500x20",
                    },
                ],
                "promql_expr_test": [
                    {
                        "expr": "adapter:DCGM_FI_DEV_GPU_UTIL",
                        "eval_time": "4m",
                        "exp_samples": [
                            {"labels": 'adapter:DCGM_FI_DEV_GPU_UTIL{pod="goodput-inference-a"}', "value": 70}
                        ],
                    },
                    {
                        "expr": "adapter:goodput_scheduler_queue_depth",
                        "eval_time": "4m",
                        "exp_samples": [
                            {
                                "labels": 'adapter:goodput_scheduler_queue_depth{service="goodput-scheduler"}',
                                "value": 8,
                            }
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "adapter_test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    proc = chart.run([promtool, "test", "rules", "adapter_test.yaml"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_prometheus_rule_in_chart_embeds_the_tested_file(chart: Any) -> None:
    rule = chart.by_kind(chart.docs(), "PrometheusRule")
    (doc,) = rule.values()
    assert doc["spec"] == yaml.safe_load((RULES_DIR / "alerts.yaml").read_text())


DASHBOARDS = REPO / "charts" / "goodput" / "dashboards"
DASHBOARD = DASHBOARDS / "goodput.json"
LATENCY_DASHBOARD = DASHBOARDS / "latency-breakdown.json"

# What Grafana sends for each dashboard variable (every value of a multi-value variable, "All" for tenant and model).
GRAFANA_VARIABLES = {
    "__rate_interval": "5m",
    "namespace": "goodput",
    "priority": "P0|P1|P2",
    "tenant": ".*",
    "model": ".*",
}


def _dashboard_exprs(path: Path = DASHBOARD) -> list[str]:
    dash = json.loads(path.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _as_sent(expr: str) -> str:
    """A dashboard query with its variables replaced by what Grafana would send."""
    return re.sub(r"\$(\w+)", lambda m: GRAFANA_VARIABLES[m.group(1)], expr)


def test_dashboard_has_a_tenants_row_with_usage_refusals_budgets_and_gpu_time() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = [p for p in panels if p["type"] == "row"]
    (row,) = [r for r in rows if r["title"].startswith("Tenants")]
    end = min((r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > row["gridPos"]["y"]), default=float("inf"))
    exprs = [t["expr"] for p in panels if row["gridPos"]["y"] < p["gridPos"]["y"] < end
             for t in p.get("targets", [])]
    text = "\n".join(exprs)
    for metric in GATEWAY_TENANT_METRICS:
        assert metric in text, metric
    for grouping in ("by (tenant, kind)", "by (tenant, outcome)", "by (tenant, limit)", "by (tenant)"):
        assert grouping in text, grouping
    # Every goodput_tenant_* / goodput_quota_* / goodput_usage_* name the dashboard queries is one the gateway exports.
    used = set(re.findall(r"goodput_(?:tenant|quota|usage)_\w+", "\n".join(_dashboard_exprs())))
    assert used <= set(GATEWAY_TENANT_METRICS), used - set(GATEWAY_TENANT_METRICS)
    # The same data source and panel ids unique, like the rest of the dashboard.
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]


def test_dashboard_shows_what_sres_tune_by(chart: Any) -> None:
    text = "\n".join(_dashboard_exprs())
    for metric in (
        "goodput_gateway_ttft_seconds",
        "goodput_gateway_itl_seconds",
        "goodput_gateway_e2e_seconds",
        "goodput_gateway_stage_seconds",
        "goodput_scheduler_queue_depth",
        "goodput_scheduler_shed_total",
        "goodput_cache_lookups_total",
        "DCGM_FI_DEV_GPU_UTIL",
        "goodput_worker_kv_cache_usage_ratio",
    ):
        assert metric in text, metric
    assert "by (le, priority)" in text and "by (stage)" in text and "by (layer)" in text
    (cm,) = [d for d in chart.docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "goodput.json" in cm["data"]


@pytest.mark.parametrize("dashboard", sorted(p.name for p in DASHBOARDS.glob("*.json")))
def test_dashboard_queries_are_valid_promql(chart: Any, promtool: str, tmp_path: Path, dashboard: str) -> None:
    # Grafana variables replaced by what Grafana would send, then checked as recording rules.
    rules = [
        {"record": f"dashboard:query_{i}", "expr": _as_sent(e)}
        for i, e in enumerate(_dashboard_exprs(DASHBOARDS / dashboard))
    ]
    assert rules, dashboard
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False))
    proc = chart.run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


# The per-stage latency, budget, degradation, breaker, goodput and efficiency metrics that the latency breakdown
# dashboard and the goodput-latency-budgets alerts read, with their labels (besides namespace and pod, which the scrape
# adds). They are defined in services/gateway, services/inference (the engine's busy time, generated tokens and peak
# token rate) and services/scheduler (idle while work waited), not derived from them here (the chart tests do not
# import the services): keep this list in step with those metrics.
LATENCY_METRICS = {
    "goodput_gateway_stage_seconds": ("stage", "priority"),
    "goodput_gateway_e2e_seconds": ("priority",),
    "goodput_gateway_ttft_seconds": ("priority",),
    "goodput_gateway_itl_seconds": ("priority",),
    "goodput_gateway_stage_budget_seconds": ("stage", "priority"),
    "goodput_gateway_budget_breaches_total": ("stage", "priority"),
    "goodput_gateway_degradations_total": ("step", "priority"),
    "goodput_gateway_deadline_refusals_total": ("priority", "reason"),
    "goodput_gateway_breaker_state": ("dependency",),
    "goodput_gateway_slo_requests_total": ("priority", "tenant", "model", "result"),
    "goodput_gateway_goodput_tokens_total": ("priority", "tenant", "model"),
    "goodput_gateway_goodput_discarded_tokens_total": ("priority", "tenant", "model"),
    "goodput_worker_engine_busy_seconds_total": (),
    "goodput_worker_generated_tokens_total": (),
    "goodput_worker_peak_tokens_per_second": (),
    "goodput_scheduler_idle_while_queued_seconds_total": ("priority",),
    "goodput_scheduler_queued_with_idle_workers": (),
}
LATENCY_ALERTS = {
    "GoodputStageOverBudget",
    "GoodputStageBudgetBreachesHigh",
    "GoodputBreakerOpen",
    "GoodputP0SLOAttainmentLow",
    "GoodputDegradationLadderShedding",
}
_SELECTOR = re.compile(r"\b(goodput_\w+?)(?:_bucket|_sum|_count)?\{([^}]*)\}")
_BY = re.compile(r"\b(?:by|on) \(([^)]*)\)")


def _check_names_and_labels(promql: str) -> None:
    """Every goodput_gateway_* / goodput_worker_* / goodput_scheduler_* name the PromQL reads is a LATENCY_METRICS one,
    and every label it matches or groups on is one of theirs (or le, namespace, pod)."""
    names = {re.sub(r"_(?:bucket|sum|count)$", "", m)
             for m in re.findall(r"\bgoodput_(?:gateway|worker|scheduler)_\w+", promql)}
    assert names <= set(LATENCY_METRICS), names - set(LATENCY_METRICS)
    known = {"le", "namespace", "pod"} | {label for labels in LATENCY_METRICS.values() for label in labels}
    for name, matchers in _SELECTOR.findall(promql):
        used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
        assert used <= set(LATENCY_METRICS[name]) | {"namespace"}, (name, used)
    for grouping in _BY.findall(promql):
        used = {label.strip() for label in grouping.split(",") if label.strip()}
        assert used <= known, (grouping, used - known)


def _latency_panels() -> list[dict[str, Any]]:
    return json.loads(LATENCY_DASHBOARD.read_text())["panels"]


def test_latency_budget_alerts_compare_stages_to_the_exported_budgets() -> None:
    groups = yaml.safe_load((RULES_DIR / "alerts.yaml").read_text())["groups"]
    (group,) = [g for g in groups if g["name"] == "goodput-latency-budgets"]
    rules = {r["alert"]: r for r in group["rules"]}
    assert set(rules) == LATENCY_ALERTS
    over = rules["GoodputStageOverBudget"]["expr"]
    assert "histogram_quantile(0.95, sum by (le, stage, priority) (rate(goodput_gateway_stage_seconds_bucket" in over
    # Every gateway replica exports the budgets: reduced to one series per stage and class before matching.
    assert "> on (stage, priority)\nmax by (stage, priority) (goodput_gateway_stage_budget_seconds" in over
    assert rules["GoodputStageOverBudget"]["for"] == "10m"
    assert rules["GoodputBreakerOpen"]["for"] == "2m"
    assert rules["GoodputP0SLOAttainmentLow"]["for"] == "15m"
    assert 'step="shed"' in rules["GoodputDegradationLadderShedding"]["expr"]
    uid = json.loads(LATENCY_DASHBOARD.read_text())["uid"]
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"page", "ticket"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert rule["annotations"]["dashboard"].startswith(f"/d/{uid}"), name
        _check_names_and_labels(rule["expr"])


def test_latency_dashboard_shows_stages_budgets_ladder_breakers_and_goodput(chart: Any) -> None:
    dash = json.loads(LATENCY_DASHBOARD.read_text())
    panels = dash["panels"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "priority", "tenant", "model"} <= set(variables)
    for name in ("priority", "tenant", "model"):
        assert variables[name]["multi"] and variables[name]["includeAll"], name
    exprs = _dashboard_exprs(LATENCY_DASHBOARD)
    text = "\n".join(exprs)
    # Every variable a query uses is one the dashboard defines (or Grafana's own).
    assert set(re.findall(r"\$(\w+)", text)) <= set(variables) | {"__rate_interval"}
    for metric in set(LATENCY_METRICS) - {"goodput_gateway_ttft_seconds", "goodput_gateway_itl_seconds"}:
        assert metric in text, metric
    _check_names_and_labels(text)
    # The per-class stage quantiles: one row per priority class, p50 / p95 / p99 stacked by stage.
    (repeated,) = [p for p in panels if p["type"] == "row" and p.get("repeat") == "priority"]
    stacked = [p for p in panels if p["type"] == "timeseries"
               and p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
               and repeated["gridPos"]["y"] < p["gridPos"]["y"] < repeated["gridPos"]["y"] + 10]
    assert [p["targets"][0]["expr"].split(",")[0] for p in stacked] == [
        "histogram_quantile(0.5", "histogram_quantile(0.95", "histogram_quantile(0.99"]
    for p in stacked:
        assert "by (le, stage)" in p["targets"][0]["expr"] and 'priority=~"$priority"' in p["targets"][0]["expr"]
    # Tenant and model filter the metrics that carry them.
    for e in exprs:
        if "goodput_gateway_slo_requests_total" in e or "goodput_gateway_goodput_tokens_total" in e:
            assert 'tenant=~"$tenant",model=~"$model"' in e, e
    # The same conventions as the overview dashboard.
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
    # Shipped in the same ConfigMap as the overview, unchanged.
    (cm,) = [d for d in chart.docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboards")]
    assert json.loads(cm["data"]["latency-breakdown.json"]) == dash
    assert "goodput.json" in cm["data"]


def _panel_expr(title: str) -> str:
    (panel,) = [p for p in _latency_panels() if p["title"] == title]
    return _as_sent(panel["targets"][0]["expr"])


def test_latency_dashboard_queries_read_the_right_numbers(chart: Any, promtool: str, tmp_path: Path) -> None:
    # The queries whose vector matching only shows at evaluation: share of end-to-end time, p95 over a budget that
    # two gateway replicas export, SLO attainment, goodput per engine-second over two workers, breakers, engines idle
    # while work waited, runtime efficiency per worker. (Rounded: rate() extrapolation leaves float noise, and
    # promtool compares exactly.)
    queries = {
        "share": "Share of end-to-end time by stage ($priority)",
        "over_budget": "Stage p95 over its budget ($priority)",
        "attainment": "SLO attainment by class",
        "goodput_per_engine_second": "Goodput tokens per engine-second by tenant and model",
        "breakers": "Circuit breakers by dependency",
        "idle_while_queued": "Engine idle while work waited",
        "runtime_efficiency": "Runtime efficiency",
    }
    path = tmp_path / "latency-dashboard-rules.yaml"
    rules = [{"record": f"dashboard:{name}", "expr": _panel_expr(title)} for name, title in queries.items()]
    path.write_text(yaml.safe_dump({"groups": [{"name": "latency-dashboard", "rules": rules}]}, sort_keys=False))

    def series(name: str, labels: str, values: str) -> dict[str, str]:
        return {"series": f'{name}{{namespace="goodput",{labels}}}', "values": values}

    bucket = "goodput_gateway_stage_seconds_bucket"
    test = {
        "rule_files": [path.name],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                # P0: 60 requests a minute, 15 s of retrieval and 6 s of rerank against 60 s end to end.
                series("goodput_gateway_stage_seconds_sum", 'stage="retrieval",priority="P0"', "0+15x20"),
                series("goodput_gateway_stage_seconds_sum", 'stage="rerank",priority="P0"', "0+6x20"),
                series("goodput_gateway_e2e_seconds_sum", 'priority="P0"', "0+60x20"),
                # P0 retrieval: p95 is 1 s (the top tenth between 0.5 and 1.5 s); budget 0.5 s on two replicas.
                series(bucket, 'stage="retrieval",priority="P0",le="0.5"', "0+54x20"),
                series(bucket, 'stage="retrieval",priority="P0",le="1.5"', "0+60x20"),
                series(bucket, 'stage="retrieval",priority="P0",le="+Inf"', "0+60x20"),
                series("goodput_gateway_stage_budget_seconds", 'stage="retrieval",priority="P0",pod="gw-a"', "0.5x20"),
                series("goodput_gateway_stage_budget_seconds", 'stage="retrieval",priority="P0",pod="gw-b"', "0.5x20"),
                # SLO: P0 3 of 4 met, P1 all met.
                series("goodput_gateway_slo_requests_total", 'priority="P0",tenant="acme",model="qwen",result="met"',
                       "0+30x20"),
                series("goodput_gateway_slo_requests_total",
                       'priority="P0",tenant="acme",model="qwen",result="missed"', "0+10x20"),
                series("goodput_gateway_slo_requests_total", 'priority="P1",tenant="globex",model="qwen",result="met"',
                       "0+20x20"),
                # Goodput: acme 10 tokens/s, globex 5; two engines busy all the time.
                series("goodput_gateway_goodput_tokens_total", 'priority="P0",tenant="acme",model="qwen"', "0+600x20"),
                series("goodput_gateway_goodput_tokens_total", 'priority="P1",tenant="globex",model="qwen"',
                       "0+300x20"),
                series("goodput_worker_engine_busy_seconds_total", 'pod="inference-a"', "0+60x20"),
                series("goodput_worker_engine_busy_seconds_total", 'pod="inference-b"', "0+60x20"),
                # Breakers: the retriever's is open on one replica of two.
                series("goodput_gateway_breaker_state", 'dependency="retriever",pod="gw-a"', "2x20"),
                series("goodput_gateway_breaker_state", 'dependency="retriever",pod="gw-b"', "0x20"),
                series("goodput_gateway_breaker_state", 'dependency="cache",pod="gw-a"', "0x20"),
                # Idle while work waited: 1.5 workers on average while P2 waited, none while P0 did.
                series("goodput_scheduler_idle_while_queued_seconds_total", 'priority="P2",pod="sched-a"',
                       "0+90x20"),
                series("goodput_scheduler_idle_while_queued_seconds_total", 'priority="P0",pod="sched-a"', "0x20"),
                # Runtime efficiency: inference-a makes 30 tokens/s against a peak of 60; inference-b has no peak yet.
                series("goodput_worker_generated_tokens_total", 'pod="inference-a"', "0+1800x20"),
                series("goodput_worker_peak_tokens_per_second", 'pod="inference-a"', "60x20"),
                series("goodput_worker_generated_tokens_total", 'pod="inference-b"', "0+600x20"),
                series("goodput_worker_peak_tokens_per_second", 'pod="inference-b"', "0x20"),
            ],
            "promql_expr_test": [
                {"expr": "round(dashboard:share, 0.001)", "eval_time": "10m", "exp_samples": [
                    {"labels": '{stage="retrieval",priority="P0"}', "value": 0.25},
                    {"labels": '{stage="rerank",priority="P0"}', "value": 0.1},
                ]},
                {"expr": "round(dashboard:over_budget, 0.001)", "eval_time": "10m", "exp_samples": [
                    {"labels": '{stage="retrieval",priority="P0"}', "value": 2},
                ]},
                {"expr": "round(dashboard:attainment, 0.001)", "eval_time": "10m", "exp_samples": [
                    {"labels": '{priority="P0"}', "value": 0.75},
                    {"labels": '{priority="P1"}', "value": 1},
                ]},
                {"expr": "round(dashboard:goodput_per_engine_second, 0.001)", "eval_time": "10m", "exp_samples": [
                    {"labels": '{tenant="acme",model="qwen"}', "value": 5},
                    {"labels": '{tenant="globex",model="qwen"}', "value": 2.5},
                ]},
                {"expr": "round(dashboard:breakers, 0.001)", "eval_time": "10m", "exp_samples": [
                    {"labels": '{dependency="retriever"}', "value": 2},
                    {"labels": '{dependency="cache"}', "value": 0},
                ]},
                {"expr": "round(dashboard:idle_while_queued, 0.001)", "eval_time": "10m", "exp_samples": [
                    {"labels": '{priority="P2"}', "value": 1.5},
                    {"labels": '{priority="P0"}', "value": 0},
                ]},
                {"expr": "round(dashboard:runtime_efficiency, 0.001)", "eval_time": "10m", "exp_samples": [
                    {"labels": '{pod="inference-a"}', "value": 0.5},
                ]},
            ],
        }],
    }
    (tmp_path / "latency_dashboard_test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    proc = chart.run([promtool, "test", "rules", "latency_dashboard_test.yaml"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
