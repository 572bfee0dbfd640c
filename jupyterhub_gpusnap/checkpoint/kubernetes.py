"""The ``kubernetes`` checkpoint backend: checkpoints through the node agent, records in ConfigMaps.

How a checkpoint is taken: the server's pod is read from the API server (its name
and namespace from the KubeSpawner state, else ``pod_name_template``); the agent
pod on the same node is found by label; its ``POST /v1/checkpoint`` freezes GPU
memory, has the kubelet checkpoint the container, ships the archive (OCI image or
PVC), verifies it and deletes the node's copy. The backend then records the verified
checkpoint so the spawner can find it.

Where checkpoints are recorded: one ConfigMap per checkpoint in ``namespace``,
named ``gpusnap-<server hash>-<created ms>``, labelled
``app.kubernetes.io/managed-by=jupyterhub-gpusnap`` and
``gpusnap.jupyter.org/server=<hash of user/server>``, holding the
:class:`CheckpointInfo` as JSON under ``checkpoint.json``. ConfigMaps work for both
targets (registry and PVC), need only namespaced RBAC (configmaps: create, get,
list, delete) and survive hub restarts. ``delete`` removes the record and, for
registry images, the manifest (when ``delete_images`` and the credentials allow).

The container keeps running after a kubelet checkpoint: the service stops the
server through the Hub once :meth:`checkpoint` returns, which deletes the pod and
frees the GPU.

How a checkpoint is restored: ``SnapKubeSpawner`` starts a placeholder pod and calls
:meth:`restore` with it as ``into``; the agent on the placeholder's node restores the
checkpoint into its container (``POST /v1/restore``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field

from traitlets import Bool, Enum, Float, Instance, Integer, Unicode, default

from ..gpu.view import GpuReading, from_agent
from ..kube.agent import AgentLocator, safe_name
from ..kube.api import KubeAPI
from ..kube.errors import AgentError
from ..model import Server
from . import oci
from .base import (
    CheckpointBackend,
    CheckpointError,
    CheckpointInfo,
    CheckpointRefused,
    Restored,
    RestoreTarget,
    Suspension,
)

MANAGED_BY = "app.kubernetes.io/managed-by"
SERVER_LABEL = "gpusnap.jupyter.org/server"
ID_LABEL = "gpusnap.jupyter.org/id"


def _hash(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


@dataclass
class KubeSuspension(Suspension):
    """A suspension through a node agent: where the pod runs, what was asked, the answer."""

    namespace: str = ""
    pod: str = ""
    node: str = ""
    agent: str = ""
    body: dict = field(default_factory=dict)
    result: dict = field(default_factory=dict)
    info: CheckpointInfo | None = None


class KubernetesBackend(CheckpointBackend):
    """Checkpoints Kubernetes servers through the node agents (kubelet checkpoint + OCI/PVC)."""

    # the servers run on other nodes: their agents park and read GPU memory there
    supports_park = True
    supports_gpu_memory = True

    target = Enum(
        ["registry", "pvc"],
        "registry",
        help="Where agents ship checkpoints: 'registry' (an OCI image per checkpoint, pushed to "
        "repository_template) or 'pvc' (an archive in pvc_path on a volume the agents mount).",
    ).tag(config=True)

    repository_template = Unicode(
        "registry.example.org/gpusnap/{username}",
        help="Repository for checkpoint images, per server. Fields: {username}, {servername} "
        "(lowercase [a-z0-9-]). The agents need push and pull rights there.",
    ).tag(config=True)

    pvc_path = Unicode(
        "/snapshots",
        help="For target='pvc': the folder where the checkpoint PVC is mounted in the agent pods.",
    ).tag(config=True)

    timeout = Integer(
        300,
        help="Seconds the kubelet may take to checkpoint a container (passed as ?timeout=). "
        "Allow about 1 s per 250 MB of container memory.",
    ).tag(config=True)

    delete_images = Bool(
        True,
        help="delete() also deletes the image's manifest from the registry (needs delete rights "
        "and a registry with deletes enabled); otherwise only the record goes.",
    ).tag(config=True)

    registry_scheme = Unicode(
        "https", help="Scheme the service uses to reach the registry for deletes."
    ).tag(config=True)

    docker_config_path = Unicode(
        "", help="Docker config JSON with the registry credentials the service uses for deletes."
    ).tag(config=True)

    gpu_memory_timeout = Float(
        10.0,
        help="Seconds each node agent may take to answer GET /v1/gpus when the service reads "
        "free GPU memory per node (make-room, Watcher.min_free_gpu_memory). A node whose agent "
        "does not answer in time is left out of that tick (logged) and read again on the next.",
    ).tag(config=True)

    locator = Instance(AgentLocator)

    @default("locator")
    def _locator(self) -> AgentLocator:
        return AgentLocator(parent=self)

    @property
    def api(self) -> KubeAPI:
        return self.locator.api

    @property
    def namespace(self) -> str:
        return self.locator.namespace

    def target_for(self, server: Server) -> dict:
        if self.target == "pvc":
            return {"kind": "pvc", "path": self.pvc_path}
        repo = self.repository_template.format(
            username=safe_name(server.user),
            servername=safe_name(server.name) if server.name else "default",
        )
        return {"kind": "registry", "repository": repo}

    async def check(self, server: Server) -> None:
        """Refuse (nothing changed) when the server's pod or the agent on its node cannot be found."""
        await self.do_preflight(server)

    # -- checkpoint(): the agent on the pod's node freezes, dumps, ships and verifies in
    # one call (do_dump); this side checks first and records the result.
    async def do_preflight(self, server: Server) -> KubeSuspension:
        """The server's pod, its node and the agent there, or refuse."""
        namespace, pod = self.locator.pod_of(server)
        try:
            node = await self.locator.node_of(namespace, pod)
            base = await self.locator.agent_url(node)
        except AgentError as e:
            raise CheckpointRefused(f"{server.key}: {e}") from e
        return KubeSuspension(server, namespace=namespace, pod=pod, node=node, agent=base)

    async def do_dump(self, s: KubeSuspension) -> None:
        """The agent's checkpoint (GPU memory, kubelet checkpoint, shipped, verified);
        a failure is the agent's to undo (it resumes the pod's GPU memory itself)."""
        server = s.server
        s.body = {
            "namespace": s.namespace,
            "pod": s.pod,
            "container": self.locator.container,
            "timeout": self.timeout,
            "target": self.target_for(server),
        }
        self.log.info(
            "%s: checkpointing pod %s/%s on node %s", server.key, s.namespace, s.pod, s.node
        )
        try:
            s.result = await self.locator.call(
                s.agent,
                "POST",
                "/v1/checkpoint",
                s.body,
                timeout=self.timeout + self.locator.agent_timeout,
            )
        except AgentError as e:
            raise CheckpointError(
                f"{server.key}: checkpoint failed, the server keeps running: {e}"
            ) from e

    async def do_verify(self, s: KubeSuspension) -> None:
        if s.result.get("status") != "verified":
            raise CheckpointError(
                f"{s.server.key}: the agent returned an unverified checkpoint: {s.result}"
            )

    async def do_record(self, s: KubeSuspension) -> CheckpointInfo:
        """A ConfigMap per checkpoint (:meth:`_record`)."""
        server, result, target = s.server, s.result, s.body["target"]
        s.info = CheckpointInfo(
            id=result["id"],
            user=server.user,
            server_name=server.name,
            created=time.time(),
            status="verified",
            image_bytes=int(result.get("image_bytes") or 0),
            gpu_bytes=int(result.get("gpu_bytes") or 0),
            location=target.get("repository") or target.get("path", ""),
            extra={
                "digest": result.get("digest", ""),
                "node": result.get("node", s.node),
                "namespace": s.namespace,
                "pod": s.pod,
                "container": self.locator.container,
                "target": self.target,
            },
        )
        await self._record(s.info)
        return s.info

    async def do_end(self, s: KubeSuspension, info: CheckpointInfo) -> None:
        # the pod's processes end when the Hub stops the server
        self.log.info(
            "%s: checkpoint %s verified (%d bytes)", s.server.key, info.id, info.image_bytes
        )

    async def do_resume(self, s: KubeSuspension, error: Exception) -> Exception:
        """A verified checkpoint that could not be recorded: the pod's GPU memory back."""
        if s.phase == "record" and isinstance(error, AgentError) and s.info is not None:
            await self._unpark(s.agent, s.namespace, s.pod)
            return CheckpointError(
                f"{s.server.key}: checkpoint {s.info.id} is verified but could not be recorded "
                f"({error}); the server keeps running. Fix: {error.fix}"
            )
        return error

    async def _unpark(self, base: str, namespace: str, pod: str) -> None:
        """Bring GPU memory back after a checkpoint that will not be used."""
        try:
            await self.locator.call(
                base, "POST", "/v1/unpark", {"namespace": namespace, "pod": pod}
            )
        except AgentError as e:
            if e.code != 409:  # 409: no CUDA on that node, nothing was parked
                self.log.warning("unpark of %s/%s failed: %s", namespace, pod, e)

    async def park(self, server: Server, unpark: bool = False):
        """Park (or unpark) ``server``'s GPU memory through the agent on its pod's node;
        a :class:`~jupyterhub_gpusnap.gpu.park.ParkResult`. Raises :class:`CheckpointRefused`
        when the agent declines (GPU busy, host RAM short, no CUDA on the node: 409) and
        :class:`CheckpointError` otherwise."""
        from ..gpu.park import ParkResult

        namespace, pod = self.locator.pod_of(server)
        try:
            node = await self.locator.node_of(namespace, pod)
            base = await self.locator.agent_url(node)
            result = await self.locator.call(
                base,
                "POST",
                "/v1/unpark" if unpark else "/v1/park",
                {"namespace": namespace, "pod": pod},
            )
        except AgentError as e:
            action = "unpark" if unpark else "park"
            if e.code == 409:
                raise CheckpointRefused(f"{server.key}: {action} refused: {e}", retry=True) from e
            raise CheckpointError(f"{server.key}: {action} failed: {e}. Fix: {e.fix}") from e
        return ParkResult(
            pids=list(result.get("pids", [])),
            bytes_moved=int(result.get("bytes", 0)),
            seconds=float(result.get("seconds", 0.0)),
        )

    async def gpu_memory(self, servers: list[Server]) -> GpuReading:
        """Free memory of every GPU on every node with an agent, and the bytes each of
        ``servers`` holds on each.

        Asks every agent pod (``GET /v1/gpus``), not only those on nodes that run
        ``servers``: one list of the agent pods instead of one pod lookup per server,
        and a node whose GPU is short through other workloads still shows in
        ``gpusnap_gpu_free_bytes``. Agents are asked side by side; one that fails or has
        no NVML is named in ``missing`` and the other nodes are still read.
        """
        server_of_pod = {"/".join(self.locator.pod_of(s)): s.key for s in servers}
        reading = GpuReading()
        try:
            urls = await self.locator.agent_urls()
        except AgentError as e:
            reading.missing[""] = f"cannot list the agent pods: {e}"
            return reading
        if not urls:
            reading.missing[""] = (
                f"no gpusnap agent pod runs (selector {self.locator.agent_label_selector} in "
                f"namespace {self.locator.agent_namespace})"
            )
            return reading
        nodes = sorted(urls)
        answers = await asyncio.gather(
            *(
                self.locator.call(urls[n], "GET", "/v1/gpus", timeout=self.gpu_memory_timeout)
                for n in nodes
            ),
            return_exceptions=True,
        )
        for node, answer in zip(nodes, answers, strict=True):
            if isinstance(answer, AgentError):
                reading.missing[node] = str(answer)
            elif isinstance(answer, BaseException):
                reading.missing[node] = f"{type(answer).__name__}: {answer}"
            elif not answer.get("gpus"):
                reading.missing[node] = answer.get("reason") or "no GPU"
            else:
                reading.gpus += from_agent(node, answer, server_of_pod)
        return reading

    async def restore(
        self, info: CheckpointInfo, timeout: float = 600.0, into: RestoreTarget | None = None
    ) -> Restored:
        """Ask the agent on the node of ``into`` (the placeholder pod, running) to restore
        ``info`` into it, within ``timeout`` seconds; the restored tree's root pid on that
        node, and the agent's answer.

        Raises :class:`AgentError` with what an admin must do: no agent on that node, the
        agent pods not listable, the agent's own error and fix, or an answer that is not
        a restore.
        """
        if into is None:
            raise CheckpointError(
                f"{info.key}: a Kubernetes restore needs the pod to restore into (into=)"
            )
        node, host_ip = await self.locator.placement_of(into.namespace, into.pod)
        base = await self._agent_to_restore(node, host_ip)
        result = await self.locator.call(
            base,
            "POST",
            "/v1/restore",
            {
                "namespace": into.namespace,
                "pod": into.pod,
                "container": into.container or self.locator.container,
                "image": info.id,
            },
            timeout=timeout,
        )
        if not result.get("restored"):
            raise AgentError(f"node agent on {node} did not restore: {result}")
        return Restored(pid=int(result.get("pid") or 0), node=node, detail=result)

    async def _agent_to_restore(self, node: str, host_ip: str) -> str:
        """URL of the agent on ``node``; when none can be found, what to deploy or grant."""
        locator = self.locator
        try:
            return await locator.agent_url(node, host_ip)
        except AgentError as e:
            if e.code == 503:
                raise AgentError(
                    f"no gpusnap node agent pod runs on node {node} (selector "
                    f"{locator.agent_label_selector} in namespace {locator.agent_namespace}). "
                    "Deploy the agent DaemonSet (helm-values/agent/) on GPU nodes",
                    code=503,
                ) from e
            if e.code == 403:
                raise AgentError(
                    f"cannot list the node agent pods in namespace {locator.agent_namespace}: "
                    f"{e.message}. Grant the hub 'list pods' in {locator.agent_namespace} "
                    "(helm-values/agent/rbac-hub.yaml)",
                    code=403,
                ) from e
            raise

    # -- records ---------------------------------------------------------------------------

    def _configmap(self, info: CheckpointInfo) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": f"gpusnap-{_hash(info.key, 10)}-{int(info.created * 1000)}",
                "labels": {
                    MANAGED_BY: "jupyterhub-gpusnap",
                    SERVER_LABEL: _hash(info.key),
                    ID_LABEL: _hash(info.id),
                },
                "annotations": {"gpusnap.jupyter.org/server-name": info.key},
            },
            "data": {"checkpoint.json": json.dumps(info.as_dict())},
        }

    async def _record(self, info: CheckpointInfo) -> None:
        cm = self._configmap(info)
        # a create whose answer was lost is not done twice (KubeAPI.request: 409 on a retry)
        await self.api.request("POST", f"/api/v1/namespaces/{self.namespace}/configmaps", body=cm)

    async def _records(self, selector: str) -> list[tuple[str, CheckpointInfo]]:
        result = await self.api.request(
            "GET",
            f"/api/v1/namespaces/{self.namespace}/configmaps",
            query={"labelSelector": selector},
        )
        out = []
        for cm in result.get("items") or []:
            try:
                data = json.loads((cm.get("data") or {})["checkpoint.json"])
                data.pop("server", None)
                out.append((cm["metadata"]["name"], CheckpointInfo(**data)))
            except (KeyError, TypeError, ValueError) as e:
                self.log.warning(
                    "ignoring malformed checkpoint record %s: %s", cm["metadata"].get("name"), e
                )
        out.sort(key=lambda item: item[1].created, reverse=True)
        return out

    async def latest(self, user: str, server_name: str) -> CheckpointInfo | None:
        key = f"{user}/{server_name}"
        records = await self._records(
            f"{MANAGED_BY}=jupyterhub-gpusnap,{SERVER_LABEL}={_hash(key)}"
        )
        verified = [info for _, info in records if info.status == "verified" and info.key == key]
        return verified[0] if verified else None

    async def list(self, user: str | None = None) -> list[CheckpointInfo]:
        records = await self._records(f"{MANAGED_BY}=jupyterhub-gpusnap")
        return [info for _, info in records if user is None or info.user == user]

    async def delete(self, checkpoint_id: str) -> None:
        records = await self._records(
            f"{MANAGED_BY}=jupyterhub-gpusnap,{ID_LABEL}={_hash(checkpoint_id)}"
        )
        for name, info in records:
            if info.id != checkpoint_id:
                continue
            if (
                self.delete_images
                and info.extra.get("target", "registry") == "registry"
                and "@" in info.id
            ):
                ref = oci.ImageRef.parse(info.id)
                client = oci.RegistryClient(
                    ref.registry,
                    scheme=self.registry_scheme,
                    docker_config_path=self.docker_config_path,
                    parent=self,
                )
                try:
                    await client.delete_manifest(ref.name, ref.digest)
                except oci.RegistryError as e:
                    self.log.warning("%s: image %s stays in the registry: %s", info.key, info.id, e)
            # a 404 on a retry: an earlier try deleted it (KubeAPI.request)
            await self.api.request(
                "DELETE", f"/api/v1/namespaces/{self.namespace}/configmaps/{name}"
            )
            self.log.info("%s: checkpoint %s deleted", info.key, info.id)
