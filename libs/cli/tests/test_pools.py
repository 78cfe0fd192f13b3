"""Model pools of a local platform (`goodput up --pools FILE`, and its default of two pools): the file in the chart's
shape, what each worker is told, and the mistakes refused by name. No process is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from goodput_cli.main import choose_pools, served_summary
from goodput_cli.pools import Pool, PoolsError, default_pools, load_pools, parse_pools
from goodput_cli.supervisor import Platform

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "docs" / "examples" / "pools-two-models.yaml"
CHART = REPO / "charts" / "goodput"


def _workers(platform: Platform) -> dict[str, dict[str, str]]:
    return {s.name: s.env for s in platform.plan() if s.name.startswith("worker-")}


@pytest.fixture(autouse=True)
def _no_inherited_worker_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GOODPUT_INFERENCE_KV_CACHE_SPACE_GB", "GOODPUT_INFERENCE_ENFORCE_EAGER", "VLLM_CPU_OMP_THREADS_BIND",
                 "GOODPUT_INFERENCE_MAX_NUM_SEQS", "GOODPUT_POOLS"):
        monkeypatch.delenv(name, raising=False)


def test_the_default_is_an_interactive_and_a_batch_pool_of_the_dev_model_one_worker_each(tmp_path: Path) -> None:
    platform = Platform(workdir=tmp_path, pools=default_pools())
    workers = _workers(platform)

    assert platform.workers == 2 and list(workers) == ["worker-0", "worker-1"]
    interactive, batch = workers["worker-0"], workers["worker-1"]
    assert interactive["GOODPUT_INFERENCE_POOL"] == "interactive"
    assert interactive["GOODPUT_INFERENCE_POOL_CLASSES"] == "P0,P1"
    assert batch["GOODPUT_INFERENCE_POOL"] == "batch"
    assert batch["GOODPUT_INFERENCE_POOL_CLASSES"] == "P2"
    # small batches for interactive work, larger ones for batch work
    assert int(interactive["GOODPUT_INFERENCE_MAX_NUM_SEQS"]) < int(batch["GOODPUT_INFERENCE_MAX_NUM_SEQS"])
    assert (int(interactive["GOODPUT_INFERENCE_MAX_NUM_BATCHED_TOKENS"])
            < int(batch["GOODPUT_INFERENCE_MAX_NUM_BATCHED_TOKENS"]))
    for env in workers.values():  # one model: the dev model under its own name, every local default kept
        assert "GOODPUT_INFERENCE_MODEL" not in env and "GOODPUT_INFERENCE_SERVED_MODEL_NAME" not in env
        assert env["GOODPUT_INFERENCE_ENFORCE_EAGER"] == "true"
        assert env["GOODPUT_INFERENCE_KV_CACHE_SPACE_GB"] == "1"
    # each worker its own ports and id; the scheduler knows both
    assert [w["GOODPUT_INFERENCE_WORKER_ID"] for w in workers.values()] == ["worker-0", "worker-1"]
    assert interactive["GOODPUT_INFERENCE_GRPC_PORT"] != batch["GOODPUT_INFERENCE_GRPC_PORT"]
    scheduler = next(s for s in platform.plan() if s.name == "scheduler").env
    assert scheduler["GOODPUT_SCHEDULER_WORKERS"] == f"{platform.worker_grpc(0)},{platform.worker_grpc(1)}"
    assert platform.pool_workers("batch") == [1]


def test_goodput_up_runs_the_default_pools_unless_told_workers_or_a_file(tmp_path: Path) -> None:
    assert [p.name for p in choose_pools(None, None)[0]] == ["interactive", "batch"]
    assert choose_pools(1, None) == ([], [])  # --workers N: N identical workers, every class, as before
    assert [p.name for p in choose_pools(None, EXAMPLE)[0]] == ["interactive", "batch", "smollm2-b"]
    with pytest.raises(PoolsError, match="--workers and --pools"):
        choose_pools(2, EXAMPLE)


def test_workers_without_pools_are_one_pool_less_fleet_as_before(tmp_path: Path) -> None:
    workers = _workers(Platform(workdir=tmp_path, workers=2))

    assert list(workers) == ["worker-0", "worker-1"]
    assert not any(k.startswith("GOODPUT_INFERENCE_POOL") for env in workers.values() for k in env)


def test_the_example_adds_a_second_model_under_its_own_name_and_alias(tmp_path: Path) -> None:
    pools, notes = load_pools(EXAMPLE)
    platform = Platform(workdir=tmp_path, pools=pools)
    workers = _workers(platform)

    assert platform.workers == 3 and platform.pool_workers("smollm2-b") == [2]
    second = workers["worker-2"]
    assert second["GOODPUT_INFERENCE_SERVED_MODEL_NAME"] == "smollm2-b"
    assert second["GOODPUT_INFERENCE_SERVED_MODEL_ALIASES"] == "b-chat"
    assert second["GOODPUT_INFERENCE_POOL_CLASSES"] == ""  # every class
    assert "GOODPUT_INFERENCE_MODEL" not in second  # path "": the dev model's weights again
    assert "GOODPUT_INFERENCE_SERVED_MODEL_NAME" not in workers["worker-0"]
    assert notes == ["pool smollm2-b: gpu is for Kubernetes only; ignored here (every local worker runs on this "
                     "machine)"]
    assert served_summary(pools, [("smollm2-135m-instruct", []), ("smollm2-b", ["b-chat"])]).splitlines()[-2:] == [
        "  smollm2-b: 1 worker of smollm2-b, aliases b-chat, classes all, max_num_seqs 16",
        "Models (pass one as `model`): smollm2-135m-instruct; smollm2-b (aliases: b-chat)"]


def test_a_pool_says_its_model_engine_and_every_vllm_setting_and_wins_over_inherited_settings(tmp_path: Path) -> None:
    doc = {"pools": [{
        "name": "big", "engine": "vllm", "replicas": 2, "aliases": ["large", "big-chat"],
        "model": {"path": "/models/Qwen2.5-0.5B-Instruct", "servedModelName": "qwen-0.5b", "source": "pvc"},
        "tensorParallelSize": 1, "maxNumSeqs": 4,
        "vllm": {"maxModelLen": 4096, "enablePrefixCaching": False, "speculativeConfig": {"method": "ngram"},
                 "dtype": "bfloat16", "kvCacheSpaceGb": 2, "maxNumSeqs": 99},
        "env": {"GOODPUT_INFERENCE_ENFORCE_EAGER": False, "EXTRA": 3}}]}
    pools, notes = parse_pools(doc)
    platform = Platform(workdir=tmp_path, pools=pools, env={"GOODPUT_INFERENCE_MAX_NUM_SEQS": "16",
                                                            "GOODPUT_INFERENCE_DTYPE": "float32"})
    workers = _workers(platform)

    assert list(workers) == ["worker-0", "worker-1"]
    env = workers["worker-1"]
    assert {k: env[k] for k in env if k.startswith("GOODPUT_INFERENCE_") and "PORT" not in k and "TLS" not in k} == {
        "GOODPUT_INFERENCE_POOL": "big", "GOODPUT_INFERENCE_POOL_CLASSES": "",
        "GOODPUT_INFERENCE_SERVED_MODEL_ALIASES": "large,big-chat", "GOODPUT_INFERENCE_ENGINE": "vllm",
        "GOODPUT_INFERENCE_MODEL": "/models/Qwen2.5-0.5B-Instruct", "GOODPUT_INFERENCE_SERVED_MODEL_NAME": "qwen-0.5b",
        "GOODPUT_INFERENCE_TENSOR_PARALLEL_SIZE": "1", "GOODPUT_INFERENCE_MAX_NUM_SEQS": "4",  # the shorthand wins
        "GOODPUT_INFERENCE_MAX_MODEL_LEN": "4096", "GOODPUT_INFERENCE_ENABLE_PREFIX_CACHING": "false",
        "GOODPUT_INFERENCE_SPECULATIVE_CONFIG": '{"method": "ngram"}', "GOODPUT_INFERENCE_DTYPE": "bfloat16",
        "GOODPUT_INFERENCE_KV_CACHE_SPACE_GB": "2", "GOODPUT_INFERENCE_ENFORCE_EAGER": "false",
        "GOODPUT_INFERENCE_WORKER_ID": "worker-1"}
    assert env["EXTRA"] == "3"
    # the pool's settings are the child's, over the supervisor's env
    assert platform.child_env(next(s for s in platform.plan() if s.name == "worker-0"))[
        "GOODPUT_INFERENCE_MAX_NUM_SEQS"] == "4"
    assert notes == ["pool big: model: source is for Kubernetes only; ignored here (every local worker runs on this "
                     "machine)"]


def test_a_chart_values_file_runs_here_with_what_the_pools_inherit(tmp_path: Path) -> None:
    """charts/goodput/ci/two-pools-values.yaml as it is: the pools inherit the inference block's model, and what only
    a cluster uses is noted, not refused."""
    pools, notes = load_pools(CHART / "ci" / "two-pools-values.yaml")

    assert [(p.name, p.classes, p.settings["MAX_NUM_SEQS"]) for p in pools] == [
        ("interactive", ("P0", "P1"), "16"), ("batch", ("P2",), "128")]
    assert {p.model_path for p in pools} == {"/models/Qwen2.5-7B-Instruct"}
    assert {p.served_model_name for p in pools} == {"qwen2.5-7b-instruct"}
    assert pools[1].settings["SCHEDULING_POLICY"] == "fcfs"
    assert any("resources, nodeSelector" in n for n in notes)
    assert any("autoscaling" in n and "pool batch" in n for n in notes)
    # "chat" is declared by the interactive pool only: the gateway would never resolve it (it needs every worker's)
    assert any("'chat' is not declared by pool batch" in n for n in notes)


def test_every_key_the_chart_accepts_is_run_here_or_ignored_here() -> None:
    """The chart's schema and the local parser agree on the keys (a key added to the chart is refused here until
    this parser knows what to do with it)."""
    from goodput_cli import pools as p

    inference = json.loads((CHART / "values.schema.json").read_text())["properties"]["inference"]["properties"]
    assert set(inference["pools"]["items"]["properties"]) == {*p.POOL_KEYS, *p.KUBERNETES_ONLY}
    assert set(inference) == {"pools", "model", "vllm", "env", "replicas", *p.KUBERNETES_ONLY,
                              *p.KUBERNETES_ONLY_BLOCK}
    assert set(inference["vllm"]["properties"]) == set(p.VLLM_SETTINGS)
    assert set(inference["model"]["properties"]) == {*p.MODEL_KEYS, *p.MODEL_KUBERNETES_ONLY}
    (pool,), _ = parse_pools({"pools": [{"name": "a", "costPerHour": 2.5}]})
    assert pool.worker_env()["GOODPUT_INFERENCE_POOL_COST_PER_HOUR"] == "2.5"


def test_json_files_and_the_inference_block_at_the_top(tmp_path: Path) -> None:
    path = tmp_path / "pools.json"
    path.write_text(json.dumps({"inference": {"model": {"servedModelName": "m"},
                                              "pools": [{"name": "a", "classes": "P2, P0"}]}}))
    (pool,), _ = load_pools(path)

    assert pool == Pool(name="a", classes=("P0", "P2"), served_model_name="m")


@pytest.mark.parametrize(("doc", "message"), [
    ({"pools": [{"name": "a", "maxNumSeq": 8}]}, "pool a: unknown key maxNumSeq"),
    ({"pools": [{"name": "a", "vllm": {"maxTokens": 8}}]}, r"pool a: vllm: unknown key maxTokens"),
    ({"pools": [{"name": "a", "classes": ["P3"]}]}, "'P3' is not a valid priority class"),
    ({"pools": [{"name": "a"}, {"name": "a"}]}, "the pool name 'a' is used twice"),
    ({"pools": [{"name": "Interactive"}]}, "must be a DNS label"),
    ({"pools": [{"name": "a", "engine": "tgi"}]}, "engine must be one of"),
    ({"pools": [{"name": "a", "maxNumSeqs": 0}]}, "maxNumSeqs must be an integer of at least 1"),
    ({"pools": [{"name": "a", "replicas": 0}]}, "at least one worker must run"),
    ({"pools": [{"name": "a", "aliases": ["has space"]}]}, "is not a valid model alias"),
    ({"pools": []}, "must be a non-empty list"),
    ({"inference": {"replicas": 1}}, "must be a non-empty list"),
    ({"pools": [{"name": "a"}], "workers": 2}, "unknown key workers"),
])
def test_mistakes_are_refused_by_name(doc: object, message: str) -> None:
    with pytest.raises(PoolsError, match=message):
        parse_pools(doc)


def test_a_file_that_is_not_yaml_or_not_there_is_refused_with_its_name(tmp_path: Path) -> None:
    bad = tmp_path / "pools.yaml"
    bad.write_text("pools: [\n")
    with pytest.raises(PoolsError, match=r"pools.yaml is not valid YAML"):
        load_pools(bad)
    with pytest.raises(PoolsError, match="cannot read the pools file"):
        load_pools(tmp_path / "missing.yaml")


def test_workers_must_match_the_pools(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the pools have 2 workers"):
        Platform(workdir=tmp_path, workers=3, pools=default_pools())
    with pytest.raises(KeyError, match="no pool 'nope'"):
        Platform(workdir=tmp_path, pools=default_pools()).pool_workers("nope")


def test_the_default_pools_are_the_chart_shape_the_example_starts_with() -> None:
    """The example file begins with the default pools, so adding a model is adding a pool to what runs."""
    example = yaml.safe_load(EXAMPLE.read_text())["pools"]
    assert parse_pools({"pools": example[:2]})[0] == default_pools()
