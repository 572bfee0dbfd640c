"""SnapKubeSpawner: KubeSpawner that brings a suspended server back from its checkpoint.

The service checkpoints an idle server (through the node agent and the kubelet) and then
stops it through the Hub. This spawner's part is the other half:

* on ``stop()`` it looks up the verified checkpoint the service recorded just before it
  stopped the server (``checkpoint_backend_class``, by default the Kubernetes backend's
  ConfigMap records), keeps it in spawner state across ``clear_state()`` and sets
  ``will_resume`` so that the Hub keeps the server's API token, which the checkpointed
  processes still hold;
* on ``start()`` with such a checkpoint it restores instead of starting fresh:

  - ``restore_mode = "runtime"``: the pod's image becomes the checkpoint image, and a
    runtime that restores checkpoint images (CRI-O) brings the container back;
  - ``restore_mode = "agent"``: a placeholder pod with the same image and GPU request
    (pinned to the same GPU product) waits with a sleeping container; the checkpoint
    backend restores the checkpoint into it (``restore(info, into=<the placeholder>)``:
    the node agent on the node where it landed, ``POST /v1/restore``);

  then it waits until the server answers, reuses the old API token and reports progress
  (the flow of :class:`~jupyterhub_gpusnap.spawner_restore.RestoreMixin`, shared with the
  local spawners; this module supplies its Kubernetes hooks);
* calls to the node agent and the API server that fail for a moment (no answer, a
  gateway's 502/503/504, an API server's 5xx) are tried again (``Backoff``); an error the
  agent itself answers is final;
* on any failure of the restore it deletes the placeholder, keeps the checkpoint image,
  starts a fresh server and says why in the progress messages and the log;
* when ``stop()`` cannot tell whether a checkpoint exists (API server or checkpoint
  backend unreachable), the stop goes on (the user or the service asked for it, and the
  service stops a server only after its checkpoint is verified and recorded), but the
  server is left *restorable*: the API token is kept, the lookup is counted
  (``gpusnap_spawner_checkpoint_lookup_failures_total``) and repeated on the next start,
  which restores the checkpoint if one of that run turns up and refuses to start fresh
  over it while the lookup still fails (for at most ``checkpoint_lookup_retry_seconds``).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from typing import Any

from aiohttp import ClientError
from kubernetes_asyncio.client import (
    V1Affinity,
    V1NodeAffinity,
    V1NodeSelector,
    V1NodeSelectorRequirement,
    V1NodeSelectorTerm,
    V1ResourceRequirements,
)
from kubernetes_asyncio.client.exceptions import ApiException
from kubespawner import KubeSpawner
from prometheus_client import Counter
from traitlets import Enum, Float, Instance, Integer, List, Type, Unicode, default

from .checkpoint.base import CheckpointBackend, CheckpointError, CheckpointInfo, RestoreTarget
from .kube.errors import AgentError  # noqa: F401  (what a failed agent restore raises)
from .retry import Backoff
from .spawner_restore import STATE_KEY, RestoreMixin, checkpoint_info, human_bytes

#: Pod annotation marking a placeholder pod, with the checkpoint id it waits for.
PLACEHOLDER_ANNOTATION = "gpusnap.jupyter.org/placeholder-for"
#: Pod annotation on a pod started from a checkpoint image (runtime restore).
RESTORED_FROM_ANNOTATION = "gpusnap.jupyter.org/restored-from"


#: Checkpoint lookups that could not tell whether a server has a checkpoint, by phase
#: ("stop": the server was stopped and left restorable; "start": a start was refused).
LOOKUP_FAILURES = Counter(
    "gpusnap_spawner_checkpoint_lookup_failures_total",
    "Checkpoint lookups of SnapKubeSpawner that failed (API server or checkpoint backend "
    "unreachable), by phase",
    ["phase"],
)


class CheckpointLookupError(Exception):
    """Whether a server has a checkpoint cannot be told now (a source did not answer)."""


def _epoch(dt: datetime) -> float:
    """Seconds since the epoch of a Hub timestamp (naive datetimes are UTC)."""
    return (dt.replace(tzinfo=timezone.utc) if dt.tzinfo is None else dt).timestamp()


def add_required_node_affinity(pod: Any, key: str, values: list[str]) -> None:
    """Require ``key In values`` on the node, in every existing nodeSelectorTerm.

    Terms are ORed by the scheduler, expressions inside a term ANDed: adding the
    requirement to each term keeps the admin's affinity and adds ours to all of it.
    """
    spec = pod.spec
    if spec.affinity is None:
        spec.affinity = V1Affinity()
    if spec.affinity.node_affinity is None:
        spec.affinity.node_affinity = V1NodeAffinity()
    na = spec.affinity.node_affinity
    if na.required_during_scheduling_ignored_during_execution is None:
        na.required_during_scheduling_ignored_during_execution = V1NodeSelector(
            node_selector_terms=[]
        )
    selector = na.required_during_scheduling_ignored_during_execution
    terms = selector.node_selector_terms
    if not terms:
        terms.append(V1NodeSelectorTerm(match_expressions=[]))
    for term in terms:
        # terms coming from config may be plain dicts
        requirement = V1NodeSelectorRequirement(key=key, operator="In", values=list(values))
        if isinstance(term, dict):
            term.setdefault("matchExpressions", []).append(
                {"key": key, "operator": "In", "values": list(values)}
            )
        else:
            if term.match_expressions is None:
                term.match_expressions = []
            term.match_expressions.append(requirement)


class SnapKubeSpawner(RestoreMixin, KubeSpawner):
    """KubeSpawner that restores a suspended server from its verified checkpoint: the
    Kubernetes hooks of :class:`~jupyterhub_gpusnap.spawner_restore.RestoreMixin`.

    :attr:`gpusnap_state` holds ``checkpoint`` (the one the next start restores) and
    ``api_token`` (the one its processes hold) while suspended, ``lookup`` after a stop
    that could not look, ``restored`` and the last ``failures`` for admins.
    """

    restore_mode = Enum(
        ["agent", "runtime"],
        default_value="agent",
        help="""How a checkpointed server comes back.

        - ``agent`` (default; needed for GPU pods and for runtimes without a restore path,
          e.g. containerd >= 2.4): a placeholder pod with the same image and GPU request
          is created, and the gpusnap node agent on its node restores the checkpoint into it.
        - ``runtime``: the pod's image is set to the checkpoint image and the container
          runtime restores it (CRI-O; containerd 2.1-2.3). CPU-only servers.

        Run ``jupyterhub-gpusnap doctor`` to see which your nodes support.
        """,
    ).tag(config=True)

    agent_request_timeout = Float(
        600,
        help="""Seconds the node agent may take for one restore call (pulling and unpacking
        the checkpoint image, CRIU restore, GPU memory back). Large GPU checkpoints need minutes.
        """,
    ).tag(config=True)

    @default("restore_timeout")
    def _default_restore_timeout(self) -> float:
        return 600.0  # the pod scheduled and running, the agent's restore, the server answering

    placeholder_command = List(
        Unicode(),
        ["sleep", "infinity"],
        help="""Command of the placeholder pod's container, which waits until the agent
        restores the checkpoint into it. The image must have this command.
        """,
    ).tag(config=True)

    gpu_product_label = Unicode(
        "nvidia.com/gpu.product",
        help="""Node label naming the GPU model (set by NVIDIA GPU feature discovery).
        A restore is pinned to nodes whose label equals the checkpoint's GPU model:
        CUDA state restores only onto the same GPU model.
        """,
    ).tag(config=True)

    gpu_resource_name = Unicode(
        "nvidia.com/gpu",
        help="Extended resource name of a GPU; a restore requests the checkpoint's GPU count of it.",
    ).tag(config=True)

    checkpoint_backend_class = Type(
        "jupyterhub_gpusnap.checkpoint.kubernetes.KubernetesBackend",
        klass=CheckpointBackend,
        allow_none=True,
        help="""Where the service records verified checkpoints; consulted on stop: its newest
        verified checkpoint of this server, taken after the server started, is kept for the
        next start, which restores it through this backend (``restore_mode = "agent"``: its
        ``restore(into=<the placeholder pod>)``). The default reads the ConfigMaps the
        service's KubernetesBackend writes and restores through the node agents (configure
        it with ``c.KubeAPI``, ``c.AgentLocator.namespace`` and ``c.AgentConnection`` as for
        the service; the hub needs ``list configmaps`` there). None: never restore.
        """,
    ).tag(config=True)

    checkpoint_max_age = Float(
        1800,
        help="""A checkpoint found when the server stops is kept for the next start only if
        it was taken at most this many seconds before. The service stops a server right after
        its checkpoint; an older checkpoint means that stop did not happen and the user kept
        working, and restoring it would bring back an older state than the one they left.
        """,
    ).tag(config=True)

    checkpoint_lookup_retry_seconds = Float(
        86400,
        help="""When ``stop()`` could not look for a checkpoint (API server or checkpoint
        backend unreachable), the next start looks again and refuses to start a fresh server
        while the lookup still fails, so a checkpoint is never passed over. After this many
        seconds since the stop it gives up and starts fresh (any checkpoint stays in the
        backend, listed by ``jupyterhub-gpusnap`` for admins). Fix the backend's
        reachability (``jupyterhub-gpusnap doctor``) rather than lowering this.
        """,
    ).tag(config=True)

    restore_failures_kept = Integer(
        5,
        help="How many past restore failures the spawner state keeps for admins to read.",
    ).tag(config=True)

    backoff = Instance(Backoff)

    @default("backoff")
    def _default_backoff(self) -> Backoff:
        return Backoff(parent=self)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._restoring: dict | None = None
        self._backend: CheckpointBackend | None = None
        self._stopping_pod = None

    # ----- state ----------------------------------------------------------------------

    @property
    def pending_checkpoint(self) -> dict | None:
        """The checkpoint the next ``start()`` restores (a CheckpointInfo dict), or None."""
        return self.gpusnap_state.get("checkpoint")

    def record_checkpoint(self, info: CheckpointInfo | dict) -> None:
        """Keep ``info`` (a verified checkpoint) and the server's API token for the next start.

        Sets ``will_resume`` so the Hub keeps the API token the checkpointed processes hold.
        """
        data = info.as_dict() if isinstance(info, CheckpointInfo) else dict(info)
        if data.get("status") != "verified":
            raise ValueError(
                f"{self.server_key}: checkpoint {data.get('id')!r} is {data.get('status')!r}, "
                "only a verified checkpoint can be restored"
            )
        self.gpusnap_state["checkpoint"] = data
        if self.api_token:
            self.gpusnap_state["api_token"] = self.api_token
        self.will_resume = True
        self.log.info(
            "%s: suspended with checkpoint %s; it will be restored on the next start",
            self.server_key,
            data.get("id"),
        )

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        if state.get(STATE_KEY) and (
            self.gpusnap_state.get("checkpoint") or self.gpusnap_state.get("lookup")
        ):
            self.will_resume = True

    # ----- stop: notice the checkpoint ------------------------------------------------

    async def stop(self, now: bool = False) -> None:
        if self._restoring is None:
            try:
                info = await self._checkpoint_of_running_pod()
            except CheckpointLookupError as e:
                info = None
                self._lookup_failed_at_stop(str(e))
            if info is not None:
                await self._add_gpu_facts(info)
                self.record_checkpoint(info)
                self.gpusnap_state.pop("lookup", None)
            elif not self.pending_checkpoint and not self.gpusnap_state.get("lookup"):
                self.will_resume = False
        await super().stop(now=now)

    def _lookup_failed_at_stop(self, reason: str) -> None:
        """Leave the server restorable: keep its token and look again on the next start."""
        LOOKUP_FAILURES.labels(phase="stop").inc()
        started = self.orm_spawner.started if self.orm_spawner is not None else None
        self.gpusnap_state["lookup"] = {
            "error": reason,
            "started": _epoch(started) if started is not None else 0.0,
            "stopped": time.time(),
        }
        if self.api_token:
            self.gpusnap_state["api_token"] = self.api_token
        self.will_resume = True
        self.log.error(
            "%s: cannot tell whether the server has a checkpoint: %s. Stopping it anyway and "
            "keeping its API token; the next start looks again and restores a checkpoint of "
            "this run if there is one. Fix: make the API server and the checkpoint backend "
            "reachable from the hub (jupyterhub-gpusnap doctor).",
            self.server_key,
            reason,
        )

    async def _add_gpu_facts(self, info: dict) -> None:
        """Fill ``gpu_model``/``gpu_count`` from the pod and its node where the record lacks them.

        A restore must land on the same GPU model with the same count: the node's
        ``gpu_product_label`` and the pod's GPU limit say what the checkpoint ran on.
        """
        pod = self._stopping_pod
        if pod is None:
            return
        if not info.get("gpu_count"):
            count = 0
            for c in pod.spec.containers or []:
                limits = (c.resources.limits if c.resources else None) or {}
                count += int(limits.get(self.gpu_resource_name, 0) or 0)
            info["gpu_count"] = count
        if not info.get("gpu_model") and info["gpu_count"] and pod.spec.node_name:
            try:
                node = await self._kube(
                    f"read node {pod.spec.node_name}",
                    lambda: self.api.read_node(pod.spec.node_name),
                )
                info["gpu_model"] = (node.metadata.labels or {}).get(self.gpu_product_label, "")
            except ApiException as e:
                self.log.warning(
                    "%s: cannot read node %s for its GPU model (%s %s); the restore will not be "
                    "pinned to a GPU model. Grant the hub 'get nodes' (helm-values/agent/rbac-hub.yaml)",
                    self.server_key,
                    pod.spec.node_name,
                    e.status,
                    e.reason,
                )

    async def _checkpoint_of_running_pod(self, run: dict | None = None) -> dict | None:
        """The verified checkpoint the service recorded of the run now stopping, if any.

        ``run`` (``{"started", "stopped"}`` epochs) judges a run that already stopped. The
        pod is read too (its GPU request and node give the restore's placement). Raises
        :class:`CheckpointLookupError` when the checkpoint backend does not answer.
        """
        self._stopping_pod = None
        try:
            self._stopping_pod = await self._kube(
                f"read pod {self.namespace}/{self.pod_name}",
                lambda: self.api.read_namespaced_pod(self.pod_name, self.namespace),
            )
        except ApiException as e:
            if e.status != 404:
                self.log.warning(
                    "%s: reading pod %s/%s failed: %s %s; the restore will not be pinned to "
                    "its GPU model",
                    self.server_key, self.namespace, self.pod_name, e.status, e.reason,
                )  # fmt: skip
        except Exception as e:
            self.log.warning(
                "%s: reading pod %s/%s failed: %s",
                self.server_key,
                self.namespace,
                self.pod_name,
                e,
            )
        if self.checkpoint_backend_class is None:
            return None
        return await self._checkpoint_from_backend(run)

    async def _kube(self, what: str, call):
        """A Kubernetes API call of ours (KubeSpawner retries its own), tried again with
        ``backoff`` on no answer and 5xx, never on 4xx."""

        def transient(e: BaseException) -> bool:
            if isinstance(e, ApiException):
                return (e.status or 0) >= 500
            return isinstance(e, (OSError, asyncio.TimeoutError, ClientError))

        return await self.backoff.run(call, transient, f"{self.server_key}: {what}")

    def _is_ours(self, info: dict, run: dict | None = None) -> bool:
        """Is ``info`` a verified checkpoint of this server, taken during this run, just now?

        ``run`` (``{"started", "stopped"}``) is a run that already stopped; default: the
        running one, judged now.
        """
        created = float(info.get("created") or 0)
        if run is not None:
            start_epoch = float(run.get("started") or 0) or None
            at = float(run.get("stopped") or time.time())
        else:
            started = self.orm_spawner.started if self.orm_spawner is not None else None
            start_epoch = _epoch(started) if started is not None else None
            at = time.time()
        why = ""
        if info.get("status") != "verified" or not info.get("id"):
            why = f"status {info.get('status')}"
        elif (info.get("user"), info.get("server_name")) != (self.user.name, self.name):
            why = f"it is of {info.get('user')}/{info.get('server_name')}"
        elif start_epoch is not None and created < start_epoch:
            why = "taken before this server started"
        elif created and at - created > self.checkpoint_max_age:
            why = (
                f"taken {at - created:.0f}s before the stop, more than checkpoint_max_age "
                f"({self.checkpoint_max_age:g}s): the server kept running after it"
            )
        if why:
            self.log.warning(
                "%s: not restoring checkpoint %s on the next start: %s",
                self.server_key,
                info.get("id"),
                why,
            )
        return not why

    @property
    def checkpoint_backend(self) -> CheckpointBackend | None:
        """The backend (``checkpoint_backend_class``) this spawner finds checkpoints in and
        restores them through, built once; None: never restore."""
        if self._backend is None and self.checkpoint_backend_class is not None:
            self._backend = self.checkpoint_backend_class(parent=self)
        return self._backend

    async def _checkpoint_from_backend(self, run: dict | None = None) -> dict | None:
        """The backend's newest checkpoint of this server if it is of this run; raises
        :class:`CheckpointLookupError` when the backend does not answer."""
        backend = self.checkpoint_backend
        if backend is None:
            return None
        try:
            info = await backend.latest(self.user.name, self.name)
        except Exception as e:
            self.log.warning("%s: checkpoint backend lookup failed: %s", self.server_key, e)
            raise CheckpointLookupError(f"checkpoint backend lookup failed: {e}") from e
        if info is None:
            return None
        data = info.as_dict()
        return data if self._is_ours(data, run) else None

    async def _look_again(self) -> None:
        """Repeat the lookup that failed at stop; raise rather than start fresh over a snapshot."""
        run = self.gpusnap_state["lookup"]
        try:
            info = await self._checkpoint_of_running_pod(run)
        except CheckpointLookupError as e:
            waited = time.time() - float(run.get("stopped") or 0)
            if waited < self.checkpoint_lookup_retry_seconds:
                LOOKUP_FAILURES.labels(phase="start").inc()
                self.log.error(
                    "%s: not starting: cannot tell whether the server has a snapshot to restore "
                    "(%s). Fix: make the API server and the checkpoint backend reachable from "
                    "the hub (jupyterhub-gpusnap doctor), then start again.",
                    self.server_key,
                    e,
                )
                raise CheckpointLookupError(
                    f"Cannot tell whether your server has a snapshot to restore ({e}). It is "
                    "not started fresh so that the snapshot is not passed over: try again in a "
                    "few minutes, or ask your admin to fix the checkpoint storage."
                ) from e
            self.log.warning(
                "%s: checkpoint lookup still fails %.0fs after the stop (more than "
                "checkpoint_lookup_retry_seconds): starting fresh; a snapshot, if any, stays "
                "in the backend: %s",
                self.server_key,
                waited,
                e,
            )
            info = None
        self.gpusnap_state.pop("lookup", None)
        if info is not None:
            # the stopped run's token, not the Hub's new one
            held = self.gpusnap_state.get("api_token")
            await self._add_gpu_facts(info)
            self.record_checkpoint(info)
            if held:
                self.gpusnap_state["api_token"] = held
            return
        self.gpusnap_state.pop("api_token", None)
        self.will_resume = False
        self.log.info("%s: no checkpoint of the last run: starting fresh", self.server_key)

    # ----- start: restore or fresh ----------------------------------------------------

    async def _start(self) -> str:
        return await self.restore_or_start_fresh()

    async def checkpoint_to_restore(self) -> dict | None:
        if self.gpusnap_state.get("lookup") and not self.pending_checkpoint:
            await self._look_again()
        return self.pending_checkpoint or None

    async def resume_token(self, checkpoint: dict) -> str:
        """The token the stopped run held, kept in the spawner state at its stop."""
        return self.gpusnap_state.get("api_token") or ""

    async def restore_checkpoint(self, checkpoint: dict) -> str:
        """A pod for the checkpoint (:meth:`get_pod_manifest`): with ``restore_mode="agent"``
        a placeholder the checkpoint backend restores into (:meth:`CheckpointBackend.restore`
        with ``into=`` the placeholder), else the checkpoint image itself."""
        backend = self.checkpoint_backend
        if self.restore_mode == "agent" and backend is None:
            raise CheckpointError(
                f"checkpoint {checkpoint.get('id')}: no checkpoint_backend_class to restore it with"
            )
        self._restoring = checkpoint
        size = int(checkpoint.get("image_bytes") or 0)
        self.log.info("%s: restore mode %s", self.server_key, self.restore_mode)
        if self.restore_mode == "agent" and checkpoint.get("gpu_model"):
            self.emit(
                f"Waiting for a node with {checkpoint.get('gpu_count') or 1} × "
                f"{checkpoint['gpu_model']} (a snapshot restores only on the same GPU model)…",
                10,
            )
        url = await super()._start()
        pod = self.pod_reflector.pods.get(f"{self.namespace}/{self.pod_name}") or {}
        node = (pod.get("spec") or {}).get("nodeName", "")
        if self.restore_mode == "agent":
            self.emit(
                f"Placeholder pod running on node {node}; restoring {human_bytes(size)} of memory…",
                40,
            )
            restored = await backend.restore(
                checkpoint_info(checkpoint),
                timeout=self.agent_request_timeout,
                into=RestoreTarget(self.namespace, self.pod_name, "notebook"),
            )
            self.log.info(
                "%s: agent on node %s restored checkpoint %s (pid %s)",
                self.server_key,
                restored.node,
                checkpoint["id"],
                restored.pid,
            )
        return url

    async def discard_restore(self, checkpoint: dict, error: BaseException, reason: str) -> None:
        """Delete what the failed restore created and record why; the image is kept."""
        try:
            await super().stop(now=True)
        except Exception as e:
            self.log.warning("%s: could not delete the placeholder pod: %s", self.server_key, e)
        failures = list(self.gpusnap_state.get("failures", []))
        failures.append({"id": checkpoint.get("id"), "time": time.time(), "error": reason})
        # the checkpoint stays in the backend; not restoring it again over a fresh server
        self.gpusnap_state = {"failures": failures[-self.restore_failures_kept :]}
        self.will_resume = False
        self._restoring = None

    def restored(self, checkpoint: dict, url: str) -> str:
        self._restoring = None
        self.gpusnap_state = {
            "restored": {
                "id": checkpoint.get("id"),
                "time": time.time(),
                "mode": self.restore_mode,
            },
            "failures": self.gpusnap_state.get("failures", []),
        }
        self.will_resume = False
        return url

    async def start_fresh(self) -> str:
        return await super()._start()

    # ----- the pod --------------------------------------------------------------------

    async def get_pod_manifest(self):
        pod = await super().get_pod_manifest()
        checkpoint = self._restoring
        if not checkpoint:
            return pod
        container = next(c for c in pod.spec.containers if c.name == "notebook")
        annotations = pod.metadata.annotations = dict(pod.metadata.annotations or {})
        if self.restore_mode == "runtime":
            container.image = checkpoint["id"]
            annotations[RESTORED_FROM_ANNOTATION] = checkpoint["id"]
            return pod
        container.command = list(self.placeholder_command)
        container.args = None
        annotations[PLACEHOLDER_ANNOTATION] = checkpoint["id"]
        count = int(checkpoint.get("gpu_count") or 0)
        if count:
            if container.resources is None:
                container.resources = V1ResourceRequirements()
            limits = dict(container.resources.limits or {})
            limits[self.gpu_resource_name] = str(count)
            container.resources.limits = limits
            if (
                container.resources.requests
                and self.gpu_resource_name in container.resources.requests
            ):
                requests = dict(container.resources.requests)
                requests[self.gpu_resource_name] = str(count)
                container.resources.requests = requests
        if checkpoint.get("gpu_model"):
            add_required_node_affinity(pod, self.gpu_product_label, [checkpoint["gpu_model"]])
        return pod

    # ----- progress -------------------------------------------------------------------

    def base_progress(self):
        """KubeSpawner's pod events, interleaved with our restore messages."""
        return KubeSpawner.progress(self)
