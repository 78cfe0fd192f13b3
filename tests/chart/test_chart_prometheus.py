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


DASHBOARD = REPO / "charts" / "goodput" / "dashboards" / "goodput.json"


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


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


def test_dashboard_queries_are_valid_promql(chart: Any, promtool: str, tmp_path: Path) -> None:
    # Grafana variables replaced by what Grafana would send, then checked as recording rules.
    rules = [
        {"record": f"dashboard:query_{i}", "expr": e.replace("$__rate_interval", "5m").replace("$namespace", "goodput")}
        for i, e in enumerate(_dashboard_exprs())
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False))
    proc = chart.run([promtool, "check", "rules", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
