"""The chart's workloads as podman containers on this host: what the rendered manifests say, nothing invented.

:class:`ChartPods` reads ``helm template`` output and starts each Deployment's container the way a kubelet would from
its pod spec: the image and its pull name, ``command``/``args``, ``env`` (values, with ``$(VAR)`` expanded, and
``secretKeyRef``) and
``envFrom`` ConfigMaps, the Secret and ConfigMap volumes as read-only files (owned by the pod's ``fsGroup``, with
the volume's ``defaultMode``), ``emptyDir`` volumes as fresh writable mounts, and the security context: user and
group, ``readOnlyRootFilesystem``, dropped capabilities, no privilege escalation. Containers restart when they die,
as ``restartPolicy: Always`` does. The probes are run by :meth:`ChartPods.probe` as declared (``httpGet`` on the
named port, ``grpc`` health, ``tcpSocket``). The release's hook Jobs (``helm.sh/hook: pre-install``) run to
completion first, in the order of their hook weight, as Helm runs them before the release's other resources.

What Kubernetes would add and this host cannot: Services and cluster DNS. Every container shares the host's network
and every Service name of the release resolves to 127.0.0.1 (``--add-host``), so the chart's ports must be free here;
a Service's port must equal its target port (the chart's do). The Secrets cert-manager would issue are given by the
caller, as are the other Secrets the release expects to exist. A pod whose service account token is mounted gets
what the kubelet gives it: ``KUBERNETES_SERVICE_HOST``/``PORT`` and the token, CA and namespace files, pointing at the
API server the caller names (``kube_api``: a :class:`KubeApiStandIn` over HTTPS here).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_EXPAND = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(text: str, env: Mapping[str, str]) -> str:
    """``$(VAR)`` replaced by ``env``'s VAR (an entry defined before it), ``$$`` by ``$``, as the kubelet does in env
    values, commands and arguments; an unknown VAR is left as written."""
    return _EXPAND.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)

CONTAINERS_CONF = Path(__file__).resolve().parents[4] / "scripts" / "containers.conf"


def _size(quantity: object) -> str:
    """A Kubernetes quantity (``2Gi``, ``512Mi``) as podman writes it."""
    return str(quantity).replace("Gi", "g").replace("Mi", "m").replace("Ki", "k")


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs ``podman`` with the project's configuration (``scripts/containers.conf``), not the machine's."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    return subprocess.run(["podman", *args], env=env, check=check, text=True, capture_output=True, timeout=timeout)


class ChartPods:
    """Rendered manifests (``docs``), run as containers named ``<prefix><deployment name>``.

    ``secrets``: the data of each Secret the pods mount or reference that the manifests do not hold (name -> key ->
    bytes). ``hosts``: names besides the release's Services that resolve to this host (an external Redis's).
    """

    def __init__(self, docs: Iterable[Mapping[str, Any]], *, secrets: Mapping[str, Mapping[str, bytes]],
                 hosts: Iterable[str] = (), kube_api: tuple[int, bytes] | None = None,
                 namespace: str = "default", prefix: str = "goodput-pod-") -> None:
        self.docs = [d for d in docs if d]
        self.namespace = namespace
        self._kube_api = kube_api  # (its port on 127.0.0.1, the CA its certificate chains to)
        self._accounts = {d["metadata"]["name"]: d for d in self.docs if d["kind"] == "ServiceAccount"}
        self.prefix = prefix
        self._config_maps = {d["metadata"]["name"]: dict(d.get("data") or {})
                             for d in self.docs if d["kind"] == "ConfigMap"}
        self._secrets = {name: dict(data) for name, data in secrets.items()}
        for d in self.docs:
            if d["kind"] == "Secret":
                data = {k: base64.b64decode(v) for k, v in (d.get("data") or {}).items()}
                data.update({k: str(v).encode() for k, v in (d.get("stringData") or {}).items()})
                self._secrets[d["metadata"]["name"]] = data
        self._hosts = sorted({*hosts, *(d["metadata"]["name"] for d in self.docs if d["kind"] == "Service")})
        self.deployments = {d["metadata"]["name"]: d for d in self.docs if d["kind"] == "Deployment"}
        hooks = [d for d in self.docs if d["kind"] == "Job"
                 and "pre-install" in d["metadata"].get("annotations", {}).get("helm.sh/hook", "")]
        self.hooks = {d["metadata"]["name"]: d for d in sorted(
            hooks, key=lambda d: int(d["metadata"]["annotations"].get("helm.sh/hook-weight", "0")))}
        self._work = Path(tempfile.mkdtemp(prefix="goodput-pods-"))
        self.started: list[str] = []
        self._hooks_done: set[str] = set()

    # ------------------------------------------------------------------------------------------- the pod spec
    def pod_spec(self, deployment: str) -> dict[str, Any]:
        """The pod spec of a Deployment or of a hook Job."""
        return dict((self.deployments.get(deployment) or self.hooks[deployment])["spec"]["template"]["spec"])

    def container_spec(self, deployment: str) -> dict[str, Any]:
        containers = self.pod_spec(deployment)["containers"]
        assert len(containers) == 1, f"{deployment}: one container per pod expected, found {len(containers)}"
        return dict(containers[0])

    def port(self, deployment: str, port: int | str) -> int:
        """A probe's port: a number, or the name of one of the container's ports."""
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for declared in self.container_spec(deployment).get("ports", []):
            if declared.get("name") == port:
                return int(declared["containerPort"])
        raise KeyError(f"{deployment} declares no port named {port}")

    def _env(self, container: Mapping[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                env.update({k: str(v) for k, v in self._config_maps[source["configMapRef"]["name"]].items()})
            elif "secretRef" in source:
                env.update({k: v.decode() for k, v in self._secrets[source["secretRef"]["name"]].items()})
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = _expand(str(item["value"]), env)
                continue
            ref = item.get("valueFrom", {})
            if "secretKeyRef" in ref:
                env[item["name"]] = self._secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]].decode()
            elif "configMapKeyRef" in ref:
                key = ref["configMapKeyRef"]
                env[item["name"]] = str(self._config_maps[key["name"]][key["key"]])
            elif "fieldRef" in ref:  # the downward API: this host stands for the pod
                path = ref["fieldRef"]["fieldPath"]
                env[item["name"]] = {"status.podIP": "127.0.0.1", "spec.nodeName": "localhost"}.get(path, "goodput")
            else:
                raise ValueError(f"env {item['name']}: {sorted(ref)} is not supported here")
        return env

    def _files(self, deployment: str, volume: Mapping[str, Any], group: int) -> Path:
        """A Secret or ConfigMap volume as a folder of files, as the kubelet projects it."""
        if "secret" in volume:
            data = self._secrets[volume["secret"]["secretName"]]
            mode = volume["secret"].get("defaultMode", 0o644)
            items = volume["secret"].get("items")
        else:
            data = {k: str(v).encode() for k, v in self._config_maps[volume["configMap"]["name"]].items()}
            mode = volume["configMap"].get("defaultMode", 0o644)
            items = volume["configMap"].get("items")
        folder = self._work / deployment / volume["name"]
        folder.mkdir(parents=True, exist_ok=True)
        wanted = {i["key"]: i.get("path", i["key"]) for i in items} if items else {k: k for k in data}
        for key, path in wanted.items():
            target = folder / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[key])
            os.chown(target, 0, group)
            target.chmod(mode)
        return folder

    def run_args(self, deployment: str) -> list[str]:
        """The ``podman run`` arguments of a Deployment's container."""
        pod, container = self.pod_spec(deployment), self.container_spec(deployment)
        pod_sc, sc = pod.get("securityContext", {}), container.get("securityContext", {})
        user = sc.get("runAsUser", pod_sc.get("runAsUser"))
        group = sc.get("runAsGroup", pod_sc.get("runAsGroup", user))
        fs_group = pod_sc.get("fsGroup", group or 0)
        args = ["run", "--name", self.prefix + deployment, "--network", "host", "--pull", "never",
                "--read-only-tmpfs=false", "--hostname", deployment]
        args += ["-d", "--restart", "always"] if deployment in self.deployments else ["--rm"]
        args += [f"--add-host={host}:127.0.0.1" for host in self._hosts]
        if user is not None:
            args += ["--user", f"{user}:{group}"]
        if fs_group:
            args += ["--group-add", str(fs_group)]
        if sc.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        for cap in sc.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", cap]
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        limit = container.get("resources", {}).get("limits", {}).get("memory")
        if limit:
            args += ["--memory", _size(limit)]
        env = self._env(container)
        for name, value in env.items():
            args += ["--env", f"{name}={value}"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume, path = volumes[mount["name"]], mount["mountPath"]
            if "secret" in volume or "configMap" in volume:
                args += ["--volume", f"{self._files(deployment, volume, int(fs_group))}:{path}:ro"]
            elif "emptyDir" in volume and volume["emptyDir"].get("medium") == "Memory" and path == "/dev/shm":
                args += ["--shm-size", _size(volume["emptyDir"].get("sizeLimit", "64Mi"))]
            elif "emptyDir" in volume and volume["emptyDir"].get("medium") == "Memory":
                args += ["--tmpfs", f"{path}:size={_size(volume['emptyDir'].get('sizeLimit', '1Gi'))},mode=0777"]
            elif "emptyDir" in volume:
                # A folder on the node's disk, mode 0777 as the kubelet makes it; it outlives a restart of the
                # container, as an emptyDir outlives a restart within its pod. (A tmpfs would take the mode and owner
                # of the image's folder at that path instead.)
                folder = self._work / deployment / volume["name"]
                folder.mkdir(parents=True, exist_ok=True)
                folder.chmod(0o777)
                args += ["--volume", f"{folder}:{path}:rw"]
            else:
                raise ValueError(f"{deployment}: volume {mount['name']} ({sorted(volume)}) is not supported here")
        args += self._service_account(deployment, pod)
        if container.get("command"):
            args += ["--entrypoint", json.dumps([_expand(str(c), env) for c in container["command"]])]
        args.append(container["image"])
        args += [_expand(str(a), env) for a in container.get("args", [])]
        return args

    def _service_account(self, deployment: str, pod: Mapping[str, Any]) -> list[str]:
        """The kubelet's projected service account volume and the API server's address, when the token is mounted."""
        account = self._accounts.get(pod.get("serviceAccountName", "default"), {})
        automount = pod.get("automountServiceAccountToken", account.get("automountServiceAccountToken", True))
        if not automount or self._kube_api is None:
            return []
        port, ca = self._kube_api
        folder = self._work / deployment / "serviceaccount"
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in (("token", b"stand-in-token"), ("ca.crt", ca), ("namespace", self.namespace.encode())):
            (folder / name).write_bytes(data)
            (folder / name).chmod(0o644)
        return ["--volume", f"{folder}:/var/run/secrets/kubernetes.io/serviceaccount:ro",
                "--env", "KUBERNETES_SERVICE_HOST=127.0.0.1", "--env", f"KUBERNETES_SERVICE_PORT={port}"]

    # ---------------------------------------------------------------------------------------------- lifecycle
    def start(self, deployments: Iterable[str] | None = None) -> None:
        """Runs the hook Jobs (once) to completion, then starts the Deployments (default: all)."""
        for job in self.hooks:
            if job not in self._hooks_done:
                podman("rm", "-f", self.prefix + job, check=False)
                done = podman(*self.run_args(job), check=False, timeout=300)
                if done.returncode != 0:
                    raise RuntimeError(f"hook Job {job} failed ({done.returncode}): {done.stdout}{done.stderr}")
                self._hooks_done.add(job)
        for deployment in deployments or self.deployments:
            podman("rm", "-f", self.prefix + deployment, check=False)
            podman(*self.run_args(deployment))
            self.started.append(deployment)

    def name(self, deployment: str) -> str:
        return self.prefix + deployment

    def state(self, deployment: str) -> dict[str, Any]:
        out = podman("inspect", "--format", "{{json .State}}", self.name(deployment)).stdout
        return dict(json.loads(out))

    def crash(self, deployment: str) -> None:
        """Kills the container's process (SIGKILL, as the OOM killer or a crash would); it comes back by its restart
        policy. (``podman kill`` counts as a stop by the user, after which podman restarts nothing.)"""
        os.kill(int(podman("inspect", "--format", "{{.State.Pid}}", self.name(deployment)).stdout.strip()), 9)

    def restarts(self, deployment: str) -> int:
        """How often the container was restarted after it died (the kubelet's restartCount)."""
        return int(podman("inspect", "--format", "{{.RestartCount}}", self.name(deployment)).stdout.strip() or 0)

    def logs(self, deployment: str, tail: int = 40) -> str:
        done = podman("logs", "--tail", str(tail), self.name(deployment), check=False)
        return done.stdout + done.stderr

    def exec(self, deployment: str, *command: str) -> subprocess.CompletedProcess[str]:
        return podman("exec", self.name(deployment), *command, check=False)

    def probe(self, deployment: str, kind: str = "readinessProbe") -> bool:
        """Runs one of the container's declared probes once, as the kubelet would: True when it passes."""
        probe = self.container_spec(deployment).get(kind)
        if probe is None:
            raise KeyError(f"{deployment} declares no {kind}")
        timeout = float(probe.get("timeoutSeconds", 1))
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://127.0.0.1:{self.port(deployment, get['port'])}{get.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout) as answer:
                    return 200 <= answer.status < 400
            except OSError:
                return False
        if "grpc" in probe:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            port = self.port(deployment, probe["grpc"]["port"])
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                try:
                    answer = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=timeout)
                except grpc.RpcError:
                    return False
                return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
        if "tcpSocket" in probe:
            import socket

            try:
                socket.create_connection(("127.0.0.1", self.port(deployment, probe["tcpSocket"]["port"])),
                                         timeout=timeout).close()
            except OSError:
                return False
            return True
        raise ValueError(f"{deployment}: {kind} {sorted(probe)} is not supported here")

    def startup_budget_s(self, deployment: str) -> float:
        """How long the kubelet would wait for the container to start (its startupProbe's threshold × period)."""
        probe = self.container_spec(deployment).get("startupProbe") or self.container_spec(deployment)["readinessProbe"]
        return float(probe.get("failureThreshold", 3)) * float(probe.get("periodSeconds", 10))

    def stop(self) -> None:
        for deployment in self.started:
            with contextlib.suppress(subprocess.SubprocessError):
                podman("rm", "-f", "-t", "5", self.name(deployment), check=False)
        self.started.clear()
        shutil.rmtree(self._work, ignore_errors=True)
