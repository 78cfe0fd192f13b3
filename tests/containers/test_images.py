"""The images, built by ``make images`` (scripts/images.py) from our Dockerfiles, and the platform run from them as the
chart configures it: the rendered Deployments of the CPU scenario (ci/cpu-dev-values.yaml + ci/podman-values.yaml)
started as podman containers by :class:`goodput_testing.ChartPods`, with the mTLS Secrets cert-manager would issue,
the API keys Secret, and this machine's Redis.

The official ``openai`` SDK streams a chat answer from the real vLLM CPU engine and gets an embedding through the
gateway container; every probe answers as declared; a killed container comes back; the root filesystem is read-only
and the process is uid 10001 in every image.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import yaml
from redis import Redis

from goodput_core.tls import ensure_dev_pki
from goodput_testing import ChartPods, KubeApiStandIn, endpoint_slice, podman, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "goodput"
TAG = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
# (image, its service's package): every image imports its service whole, as it would start it.
IMAGES = {"gateway": "goodput_gateway", "scheduler": "goodput_scheduler", "cache": "goodput_cache",
          "embedder": "goodput_embedder", "retriever": "goodput_retriever", "inference-cpu": "goodput_inference"}
API_KEY = "sk-containers-test"
MODEL = "smollm2-135m-instruct"
NAMESPACE = "goodput"

@pytest.fixture(scope="session")
def images() -> dict[str, object]:
    """Every image, built (or found up to date in podman's layer cache) by scripts/images.py."""
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "images.py")], text=True, capture_output=True,
                          timeout=2400)
    assert done.returncode == 0, f"make images failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return dict(json.loads((REPO / ".tools" / "images" / "images.json").read_text()))

@pytest.mark.parametrize("image", sorted(IMAGES))
def test_each_image_runs_its_service_as_uid_10001_on_a_read_only_root(images: dict[str, object], image: str) -> None:
    """Its own declared dependencies are enough to import the whole service; the root filesystem refuses a write; no
    compiler was left behind by the build; the process is the chart's uid 10001."""
    script = (f"import importlib, os, pkgutil, {IMAGES[image]} as p\n"
              "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
              "    importlib.import_module(m.name)\n"
              "print(os.getuid(), os.getgid())\n")
    ran = podman("run", "--rm", "--read-only", "--network", "none", "--entrypoint", "python", f"goodput/{image}:{TAG}",
                 "-c", script, check=False, timeout=300)
    assert ran.returncode == 0, f"goodput/{image} cannot import its service:\n{ran.stderr[-3000:]}"
    assert ran.stdout.split() == ["10001", "10001"]
    write = podman("run", "--rm", "--read-only", "--network", "none", "--entrypoint", "sh", f"goodput/{image}:{TAG}",
                   "-c", "touch /opt/venv/x || exit 3; command -v gcc cc g++ && exit 4; exit 0", check=False)
    assert write.returncode == 3, (write.returncode, write.stdout, write.stderr)
    tools = podman("run", "--rm", "--network", "none", "--entrypoint", "sh", f"goodput/{image}:{TAG}",
                   "-c", "command -v gcc cc g++ make || true", check=False)
    assert tools.stdout.strip() == "", f"build tools left in goodput/{image}: {tools.stdout}"
    sbom = json.loads((REPO / ".tools" / "images" / "sbom" / f"{image}.cdx.json").read_text())
    assert sbom["bomFormat"] == "CycloneDX" and any(c["name"] == "grpcio" for c in sbom["components"])

def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True

@contextlib.contextmanager
def _kube_api(pki: Path) -> Iterator[tuple[Callable[[dict[str, Any]], None], int]]:
    """The API server the scheduler watches EndpointSlices on (none can run here: goodput_testing's stand-in, over
    HTTPS with a certificate of the release's CA, as the in-cluster address is); yields how to apply an object, and
    its port."""
    files = ensure_dev_pki(pki, ["kube-apiserver"])["kube-apiserver"]
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.cert, files.key)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    api = KubeApiStandIn()
    asyncio.run_coroutine_threadsafe(api.start(ssl_context=context), loop).result(10)

    async def apply(obj: dict[str, Any]) -> None:
        api.apply(obj)

    try:
        port = int(api.url.rsplit(":", 1)[1])
        yield (lambda obj: asyncio.run_coroutine_threadsafe(apply(obj), loop).result(10)), port
    finally:
        asyncio.run_coroutine_threadsafe(api.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(scope="module")
def platform(images: dict[str, object], redis_url: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChartPods]:
    redis = urlsplit(redis_url)
    db = 9  # a database of its own, emptied first: the platform's default key prefixes, and no answer cached before
    Redis.from_url(redis_url, db=db).flushdb()
    rendered = subprocess.run(
        [str(REPO / ".tools" / "bin" / "helm"), "template", "goodput", str(CHART), "--namespace", NAMESPACE,
         "-f", str(CHART / "ci" / "cpu-dev-values.yaml"), "-f", str(CHART / "ci" / "podman-values.yaml"),
         "--set", f"external.redis.url=redis://redis-master:{redis.port or 6379}/{db}"],
        text=True, capture_output=True)
    assert rendered.returncode == 0, f"the chart does not render:\n{rendered.stderr}"
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    # What cert-manager would write: one Secret per Certificate, for the identity its URI names (the release's
    # prefix spiffe://<trust domain>/<namespace>/<release>/, the same for all).
    pki_dir = tmp_path_factory.mktemp("pki")
    certificates = {d["spec"]["uris"][0].rpartition("/")[2]: d for d in docs
                    if d["kind"] == "Certificate" and d["spec"].get("uris")}
    prefix = {c["spec"]["uris"][0].rpartition("/")[0] + "/" for c in certificates.values()}
    assert len(prefix) == 1, prefix
    pki = ensure_dev_pki(pki_dir, certificates, prefix=prefix.pop())
    secrets: dict[str, dict[str, bytes]] = {
        c["spec"]["secretName"]: {"tls.crt": pki[key].cert.read_bytes(), "tls.key": pki[key].key.read_bytes(),
                                  "ca.crt": pki[key].ca.read_bytes()} for key, c in certificates.items()}
    keys = {"keys": [{"id": "containers", "key_sha256": hashlib.sha256(API_KEY.encode()).hexdigest(),
                      "tenant": "containers"}]}
    secrets["goodput-api-keys"] = {"api-keys.json": json.dumps(keys).encode()}
    with _kube_api(pki_dir) as (apply, api_port):
        ca = next(iter(pki.values())).ca.read_bytes()
        pods = ChartPods(docs, secrets=secrets, hosts=["redis-master"], namespace=NAMESPACE,
                         kube_api=(api_port, ca))
        ports = sorted({int(p["containerPort"]) for name in pods.deployments
                        for p in pods.container_spec(name).get("ports", [])})
        taken = [p for p in ports if not _port_free(p)]
        assert not taken, f"the chart's ports {taken} are taken on this host; the containers share its network"
        started = time.monotonic()
        pods.start()
        try:
            for name in pods.deployments:
                budget = pods.startup_budget_s(name)
                kind = "startupProbe" if "startupProbe" in pods.container_spec(name) else "readinessProbe"
                try:
                    wait_until(lambda n=name, k=kind: pods.probe(n, k) or pods.restarts(n) >= 3, timeout=budget,
                               interval=1.0)
                except AssertionError:
                    pytest.fail(f"{name} did not start within its {kind}'s {budget:.0f} s:\n{pods.logs(name)}")
                assert pods.restarts(name) < 3, f"{name} keeps failing (a crash loop):\n{pods.logs(name)}"
                # The EndpointSlice controller's part: a ready pod's address under its Service.
                for service in (d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == name):
                    port = service["spec"]["ports"][0]
                    apply(endpoint_slice(NAMESPACE, name, name=f"{name}-slice", address="127.0.0.1",
                                         port=int(port["port"]), port_name=port.get("name", "grpc")))
            pods.ready_s = time.monotonic() - started  # type: ignore[attr-defined]
            yield pods
        finally:
            pods.stop()
            # The hook Job's Redis users (goodput-<service>): Redis keeps them in memory until deleted.
            admin = Redis.from_url(redis_url)
            users = [u for u in admin.execute_command("ACL", "USERS") if u.startswith(b"goodput-")]
            if users:
                admin.execute_command("ACL", "DELUSER", *users)


def test_every_container_connects_to_redis_as_its_own_user(platform: ChartPods, redis_url: str) -> None:
    """The chart's hook Job made one ACL user per service, and each container uses its own: Redis itself keeps the
    cache's credentials off the jobs and the embedder's off the quotas (tests/security/test_redis_acl.py)."""
    clients = Redis.from_url(redis_url).client_list()
    users = {c["user"] for c in clients}
    # Those that hold a connection (the embedder opens one only to start an indexing job).
    assert {"goodput-gateway", "goodput-jobsWorker", "goodput-cache", "goodput-indexWorker"} <= users, users


def _client() -> openai.OpenAI:
    return openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key=API_KEY, timeout=120, max_retries=0)

def test_the_sdk_streams_an_answer_and_embeds_through_the_gateway_container(platform: ChartPods) -> None:
    client = _client()
    started = time.monotonic()
    stream = client.chat.completions.create(model=MODEL, stream=True, max_tokens=24, temperature=0,
                                            messages=[{"role": "user", "content": "Name a colour."}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    first_answer_s = time.monotonic() - started
    assert text.strip(), "the stream carried no text"
    vector = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a question about colours"]).data[0].embedding
    assert len(vector) == 384
    print(f"\ncontainers ready in {platform.ready_s:.0f} s; first answer {first_answer_s:.1f} s later: {text!r}")  # type: ignore[attr-defined]

def test_every_probe_answers_as_the_chart_declares(platform: ChartPods) -> None:
    failing = [f"{name} {kind}" for name in platform.deployments
               for kind in ("readinessProbe", "livenessProbe") if not platform.probe(name, kind)]
    assert not failing, failing
    for name in platform.deployments:
        identity = platform.exec(name, "sh", "-c", "id -u; touch /opt/venv/x 2>/dev/null && echo writable")
        assert identity.stdout.split() == ["10001"], f"{name}: {identity.stdout} {identity.stderr}"

def test_a_killed_container_comes_back_and_serves_again(platform: ChartPods) -> None:
    """The scheduler's process is killed: a request meanwhile gets an answer or a clear error; the container restarts
    (restartPolicy Always), passes its readiness probe again, and the platform answers again."""
    name = next(n for n in platform.deployments if n.endswith("scheduler"))
    restarts = platform.restarts(name)
    platform.crash(name)
    # A request while it is down gets an answer (a retry found it back) or a clear error, never a 500 or a hang.
    try:
        _client().chat.completions.create(model=MODEL, max_tokens=8, temperature=0.7,
                                          messages=[{"role": "user", "content": "Are you there?"}])
    except openai.APIStatusError as exc:
        assert exc.status_code in (429, 502, 503, 504) and isinstance(exc.body, dict), (exc.status_code, exc.body)
    wait_until(lambda: platform.restarts(name) > restarts and platform.probe(name, "readinessProbe"),
               timeout=platform.startup_budget_s(name), interval=1.0)
    answer = wait_until(lambda: _answer_or_none(), timeout=60, interval=2.0)
    assert answer.strip()

def _answer_or_none() -> str | None:
    try:
        reply = _client().chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                                  messages=[{"role": "user", "content": "Say hello."}])
    except openai.APIError:
        return None
    return reply.choices[0].message.content or None
