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
    (pinned to the same GPU product) waits with a sleeping container; the node agent on
    the node where it landed restores the checkpoint into it (``POST /v1/restore``);

  then it waits until the server answers, reuses the old API token and reports progress;
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
import json
import os
import time
from datetime import datetime, timezone
from typing import Any

from aiohttp import ClientError
from jupyterhub.utils import url_escape_path, url_path_join
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
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Enum, Float, Instance, Integer, List, Type, Unicode, default

from .checkpoint.base import CheckpointBackend, CheckpointInfo
from .checkpoint.kubernetes import agent_failure_is_transient
from .model import server_key
from .retry import Backoff

#: Pod annotation marking a placeholder pod, with the checkpoint id it waits for.
PLACEHOLDER_ANNOTATION = "gpusnap.jupyter.org/placeholder-for"
#: Pod annotation on a pod started from a checkpoint image (runtime restore).
RESTORED_FROM_ANNOTATION = "gpusnap.jupyter.org/restored-from"
#: Key of our record inside the spawner state.
STATE_KEY = "gpusnap"


#: Checkpoint lookups that could not tell whether a server has a checkpoint, by phase
#: ("stop": the server was stopped and left restorable; "start": a start was refused).
LOOKUP_FAILURES = Counter(
    "gpusnap_spawner_checkpoint_lookup_failures_total",
    "Checkpoint lookups of SnapKubeSpawner that failed (API server or checkpoint backend "
    "unreachable), by phase",
    ["phase"],
)


class AgentError(Exception):
    """The node agent answered with an error (its ``error`` and ``fix`` in the message).

    ``transient``: a failure worth another try (:func:`agent_failure_is_transient`)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class CheckpointLookupError(Exception):
    """Whether a server has a checkpoint cannot be told now (a source did not answer)."""


async def call_agent(
    url: str,
    path: str,
    token: str,
    body: dict | None = None,
    timeout: float = 30,
    backoff: Backoff | None = None,
) -> dict:
    """Call the node agent's JSON API (``GET`` without ``body``, ``POST`` with it).

    Raises :class:`AgentError` with the agent's ``error`` and ``fix`` on a 4xx/5xx answer,
    and with the reason when the agent cannot be reached. With ``backoff``, what
    :func:`~jupyterhub_gpusnap.checkpoint.kubernetes.agent_failure_is_transient` calls a
    moment's failure is tried again.
    """
    once = lambda: _call_agent_once(url, path, token, body, timeout)  # noqa: E731
    if backoff is None:
        return await once()
    method = "GET" if body is None else "POST"
    return await backoff.run(
        once, lambda e: getattr(e, "transient", False), f"node agent at {url}: {method} {path}"
    )


async def _call_agent_once(
    url: str, path: str, token: str, body: dict | None, timeout: float
) -> dict:
    method = "GET" if body is None else "POST"
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    req = HTTPRequest(
        url_path_join(url, path),
        method=method,
        headers=headers,
        body=None if body is None else json.dumps(body),
        connect_timeout=min(timeout, 10),
        request_timeout=timeout,
    )
    try:
        resp = await AsyncHTTPClient().fetch(req)
    except HTTPClientError as e:
        if e.response is None:
            raise AgentError(f"no answer from the node agent at {url}: {e}") from e
        try:
            err = json.loads(e.response.body or b"{}")
        except ValueError:
            err = {}
        said = isinstance(err, dict) and bool(err.get("error"))
        msg = err.get("error") if said else f"HTTP {e.code}"
        fix = err.get("fix") if said else ""
        raise AgentError(
            f"node agent at {url}: {msg}" + (f" (fix: {fix})" if fix else ""),
            transient=agent_failure_is_transient(method, e.code, said),
        ) from e
    except OSError as e:
        raise AgentError(
            f"cannot reach the node agent at {url}: {e}. Is the gpusnap agent DaemonSet running on "
            "that node, and does the hub's NetworkPolicy allow egress to the agent port?",
            transient=agent_failure_is_transient(method, 0, False),
        ) from e
    return json.loads(resp.body or b"{}")


SA_TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def agent_token(api_token: str = "", token_file: str = "") -> str:
    """The bearer token for the node agent: ``token_file``, else ``api_token``, else this
    pod's ServiceAccount token (for agents with ``auth="tokenreview"``)."""
    path = token_file or ("" if api_token else SA_TOKEN_FILE)
    if not path:
        return api_token
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        raise AgentError(
            f"no token for the node agent ({path}: {e.strerror}): set SnapKubeSpawner.agent_api_token "
            "(or the GPUSNAP_AGENT_TOKEN environment variable) or agent_token_file"
        ) from e


def _epoch(dt: datetime) -> float:
    """Seconds since the epoch of a Hub timestamp (naive datetimes are UTC)."""
    return (dt.replace(tzinfo=timezone.utc) if dt.tzinfo is None else dt).timestamp()


def human_bytes(n: int) -> str:
    """``12.3 GiB`` style sizes for progress messages."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


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


class SnapKubeSpawner(KubeSpawner):
    """KubeSpawner that restores a suspended server from its verified checkpoint."""

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

    @default("server_token_scopes")
    def _default_server_token_scopes(self):
        # JupyterHub's default plus access to the service: the server's extension reports its
        # kernels and terminals to the service with this token, and the Lab panel asks the
        # service with it (the Hub grants it only where users hold that access too:
        # hubconfig.user_role). A service named other than 'gpusnap': set
        # c.Spawner.server_token_scopes = hubconfig.server_token_scopes("<name>").
        from .hubconfig import server_token_scopes

        return server_token_scopes("gpusnap")

    agent_namespace = Unicode(
        "",
        help="""Namespace of the gpusnap node agent DaemonSet (helm-values/agent/ uses
        ``gpusnap-system``). Empty: the spawner's namespace. The hub needs ``list pods`` there.
        Keep equal to ``c.AgentLocator.agent_namespace`` of the service.
        """,
    ).tag(config=True)

    agent_label_selector = Unicode(
        "app.kubernetes.io/name=jupyterhub-gpusnap-agent",
        help="Label selector of the agent pods; the one on the placeholder pod's node restores it.",
    ).tag(config=True)

    agent_port = Integer(9780, help="Port of the node agent's HTTP API.").tag(config=True)

    agent_scheme = Unicode("http", help="'http' or 'https' for the node agent's API.").tag(
        config=True
    )

    agent_url_template = Unicode(
        "",
        help="""Fixed URL of the node agent instead of looking its pod up by label, with
        ``{host_ip}`` (the node's IP) and ``{node}`` (its name), e.g.
        ``http://{host_ip}:9780`` for an agent on the host network.
        """,
    ).tag(config=True)

    agent_api_token = Unicode(
        help="""Shared secret sent to the node agent as ``Authorization: Bearer``.

        Defaults to the ``GPUSNAP_AGENT_TOKEN`` environment variable (Z2JH: put it in
        ``hub.extraEnv`` from the Secret in helm-values/agent/). Leave empty and set
        ``agent_token_file`` when the agent checks ServiceAccount tokens (``auth=tokenreview``).
        """,
    ).tag(config=True)

    @default("agent_api_token")
    def _default_agent_api_token(self) -> str:
        return os.environ.get("GPUSNAP_AGENT_TOKEN", "")

    agent_token_file = Unicode(
        "",
        help="""File holding the token for the node agent, read on every call. Takes
        precedence over ``agent_api_token``. With neither set, the hub's ServiceAccount token
        (``/var/run/secrets/kubernetes.io/serviceaccount/token``) is sent, for agents running
        with ``auth="tokenreview"`` (add ``system:serviceaccount:<ns>:hub`` to their ``allowed_users``).
        """,
    ).tag(config=True)

    agent_request_timeout = Float(
        600,
        help="""Seconds the node agent may take for one restore call (pulling and unpacking
        the checkpoint image, CRIU restore, GPU memory back). Large GPU snapshots need minutes.
        """,
    ).tag(config=True)

    restore_timeout = Float(
        600,
        help="""Seconds a whole restore may take (pod scheduled and running, agent restore,
        server answering) before giving up and starting a fresh server instead.
        ``start_timeout`` (Z2JH: ``singleuser.startTimeout``) must be larger than this plus
        a normal start, or the Hub gives up first.
        """,
    ).tag(config=True)

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
        next start. The default reads the ConfigMaps the service's KubernetesBackend writes
        (configure it with ``c.KubeAPI`` and ``c.AgentLocator.namespace`` as for the
        service; the hub needs ``list configmaps`` there). None: never restore.
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
        while the lookup still fails, so a snapshot is never passed over. After this many
        seconds since the stop it gives up and starts fresh (any snapshot stays in the
        backend, listed by ``jupyterhub-gpusnap`` for admins). Fix the backend's
        reachability (``jupyterhub-gpusnap doctor``) rather than lowering this.
        """,
    ).tag(config=True)

    server_poll_interval = Float(
        0.5,
        help="Seconds between checks that a restored server answers.",
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
        self._snap: dict = {}
        self._restoring: dict | None = None
        self._progress_events: list[dict] = []
        self._progress_changed = asyncio.Event()
        self._backend: CheckpointBackend | None = None
        self._stopping_pod = None

    # ----- identity -------------------------------------------------------------------

    @property
    def server_key(self) -> str:
        """``user/server_name`` of this server, the name used in every log line."""
        return server_key(self.user.name, self.name)

    # ----- state ----------------------------------------------------------------------

    @property
    def pending_checkpoint(self) -> dict | None:
        """The checkpoint the next ``start()`` restores (a CheckpointInfo dict), or None."""
        return self._snap.get("checkpoint")

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
        self._snap["checkpoint"] = data
        if self.api_token:
            self._snap["api_token"] = self.api_token
        self.will_resume = True
        self.log.info(
            "%s: suspended with checkpoint %s; it will be restored on the next start",
            self.server_key,
            data.get("id"),
        )

    def get_state(self) -> dict:
        state = super().get_state()
        if self._snap:
            # holds the server's API token while suspended: spawner state is a secret
            state[STATE_KEY] = self._snap
        return state

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        snap = state.get(STATE_KEY)
        if snap:
            self._snap = dict(snap)
            if self._snap.get("checkpoint") or self._snap.get("lookup"):
                self.will_resume = True

    def clear_state(self) -> None:
        # the checkpoint reference and the token must outlive clear_state (the Hub calls
        # it after every stop and before every start)
        super().clear_state()

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
                self._snap.pop("lookup", None)
            elif not self.pending_checkpoint and not self._snap.get("lookup"):
                self.will_resume = False
        await super().stop(now=now)

    def _lookup_failed_at_stop(self, reason: str) -> None:
        """Leave the server restorable: keep its token and look again on the next start."""
        LOOKUP_FAILURES.labels(phase="stop").inc()
        started = self.orm_spawner.started if self.orm_spawner is not None else None
        self._snap["lookup"] = {
            "error": reason,
            "started": _epoch(started) if started is not None else 0.0,
            "stopped": time.time(),
        }
        if self.api_token:
            self._snap["api_token"] = self.api_token
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
                "%s: reading pod %s/%s failed: %s", self.server_key, self.namespace, self.pod_name, e
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

    async def _checkpoint_from_backend(self, run: dict | None = None) -> dict | None:
        """The backend's newest checkpoint of this server if it is of this run; raises
        :class:`CheckpointLookupError` when the backend does not answer."""
        if self.checkpoint_backend_class is None:
            return None
        if self._backend is None:
            self._backend = self.checkpoint_backend_class(parent=self)
        try:
            info = await self._backend.latest(self.user.name, self.name)
        except Exception as e:
            self.log.warning("%s: checkpoint backend lookup failed: %s", self.server_key, e)
            raise CheckpointLookupError(f"checkpoint backend lookup failed: {e}") from e
        if info is None:
            return None
        data = info.as_dict()
        return data if self._is_ours(data, run) else None

    async def _look_again(self) -> None:
        """Repeat the lookup that failed at stop; raise rather than start fresh over a snapshot."""
        run = self._snap["lookup"]
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
        self._snap.pop("lookup", None)
        if info is not None:
            held = self._snap.get("api_token")  # the stopped run's token, not the Hub's new one
            await self._add_gpu_facts(info)
            self.record_checkpoint(info)
            if held:
                self._snap["api_token"] = held
            return
        self._snap.pop("api_token", None)
        self.will_resume = False
        self.log.info("%s: no checkpoint of the last run: starting fresh", self.server_key)

    # ----- start: restore or fresh ----------------------------------------------------

    async def _start(self) -> str:
        self._progress_events = []
        if self._snap.get("lookup") and not self.pending_checkpoint:
            await self._look_again()
        checkpoint = self.pending_checkpoint
        if not checkpoint:
            return await super()._start()
        self._restoring = checkpoint
        try:
            url = await asyncio.wait_for(self._restore(checkpoint), self.restore_timeout)
        except Exception as e:
            reason = str(e) or type(e).__name__
            if isinstance(e, asyncio.TimeoutError):
                reason = f"the restore did not finish within {self.restore_timeout:g}s"
            await self._fall_back(checkpoint, reason)
            self._restoring = None
            return await super()._start()
        self._restoring = None
        token = self._snap.get("api_token")
        self._snap = {
            "restored": {
                "id": checkpoint.get("id"),
                "time": time.time(),
                "mode": self.restore_mode,
            },
            "failures": self._snap.get("failures", []),
        }
        if token:
            # only now: reusing it before success leaked the Hub's fresh token on failure
            self.api_token = token
        self.will_resume = False
        self.log.info("%s: restored from checkpoint %s", self.server_key, checkpoint.get("id"))
        self._emit("Server restored from its snapshot.", 100)
        return url

    async def _restore(self, checkpoint: dict) -> str:
        taken = checkpoint.get("created")
        when = (
            datetime.fromtimestamp(taken, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            if taken
            else "earlier"
        )
        size = int(checkpoint.get("image_bytes") or 0)
        self.log.info(
            "%s: restoring checkpoint %s (%s mode, %s)",
            self.server_key,
            checkpoint.get("id"),
            self.restore_mode,
            human_bytes(size),
        )
        self._emit(f"Restoring your server from a {human_bytes(size)} snapshot taken {when}…", 5)
        if self.restore_mode == "agent" and checkpoint.get("gpu_model"):
            self._emit(
                f"Waiting for a node with {checkpoint.get('gpu_count') or 1} × "
                f"{checkpoint['gpu_model']} (a snapshot restores only on the same GPU model)…",
                10,
            )
        url = await super()._start()
        pod = self.pod_reflector.pods.get(f"{self.namespace}/{self.pod_name}") or {}
        node = (pod.get("spec") or {}).get("nodeName", "")
        if self.restore_mode == "agent":
            agent = await self._agent_url(pod)
            self._emit(
                f"Placeholder pod running on node {node}; restoring {human_bytes(size)} of memory…",
                40,
            )
            body = {
                "namespace": self.namespace,
                "pod": self.pod_name,
                "container": "notebook",
                "image": checkpoint["id"],
            }
            result = await call_agent(
                agent,
                "/v1/restore",
                self._agent_token(),
                body,
                timeout=self.agent_request_timeout,
                backoff=self.backoff,
            )
            if not result.get("restored"):
                raise AgentError(f"node agent on {node} did not restore: {result}")
            self.log.info(
                "%s: agent on node %s restored checkpoint %s (pid %s)",
                self.server_key,
                node,
                checkpoint["id"],
                result.get("pid"),
            )
        self._emit("Memory restored; waiting for the server to answer…", 80)
        await self._wait_for_server(url)
        return url

    async def _fall_back(self, checkpoint: dict, reason: str) -> None:
        """Delete what the failed restore created and record why; the image is kept."""
        self.log.error(
            "%s: restore of checkpoint %s failed: %s. Starting a fresh server; the checkpoint "
            "is kept and can be restored by an admin.",
            self.server_key,
            checkpoint.get("id"),
            reason,
        )
        self._emit(
            f"Could not restore your snapshot ({reason}). Starting a fresh server instead; "
            "the snapshot is kept — ask your admin if you need it back.",
            50,
        )
        try:
            await super().stop(now=True)
        except Exception as e:
            self.log.warning("%s: could not delete the placeholder pod: %s", self.server_key, e)
        failures = list(self._snap.get("failures", []))
        failures.append({"id": checkpoint.get("id"), "time": time.time(), "error": reason})
        # the checkpoint stays in the backend; not restoring it again over a fresh server
        self._snap = {"failures": failures[-self.restore_failures_kept :]}
        self.will_resume = False

    async def _wait_for_server(self, url: str) -> None:
        """Wait until the restored server answers HTTP on its API (any non-5xx answer)."""
        if self.orm_spawner is not None and self.orm_spawner.server is not None:
            base = self.orm_spawner.server.base_url
        else:
            base = url_path_join(self.user.url, url_escape_path(self.name), "/")
        target = url_path_join(url, base, "api")
        client = AsyncHTTPClient()
        last = ""
        while True:
            try:
                resp = await client.fetch(
                    target, request_timeout=5, connect_timeout=5, raise_error=False
                )
                if resp.code < 500 and resp.code != 599:
                    return
                last = f"HTTP {resp.code}"
            except OSError as e:
                last = str(e)
            self.log.debug("%s: waiting for %s (%s)", self.server_key, target, last)
            await asyncio.sleep(self.server_poll_interval)

    async def _agent_url(self, pod: dict) -> str:
        """URL of the node agent on the node where ``pod`` runs."""
        node = (pod.get("spec") or {}).get("nodeName", "")
        if self.agent_url_template:
            host_ip = (pod.get("status") or {}).get("hostIP", "")
            return self.agent_url_template.format(host_ip=host_ip, node=node)
        namespace = self.agent_namespace or self.namespace
        try:
            pods = await self._kube(
                f"list agent pods on node {node}",
                lambda: self.api.list_namespaced_pod(
                    namespace,
                    label_selector=self.agent_label_selector,
                    field_selector=f"spec.nodeName={node}",
                ),
            )
        except ApiException as e:
            raise AgentError(
                f"cannot list the node agent pods in namespace {namespace}: {e.status} {e.reason}. "
                f"Grant the hub 'list pods' in {namespace} (helm-values/agent/rbac-hub.yaml)"
            ) from e
        ips = [p.status.pod_ip for p in pods.items if p.status and p.status.pod_ip]
        if not ips:
            raise AgentError(
                f"no gpusnap node agent pod runs on node {node} (selector {self.agent_label_selector} "
                f"in namespace {namespace}). Deploy the agent DaemonSet (helm-values/agent/) on GPU nodes"
            )
        ip = ips[0]
        return f"{self.agent_scheme}://{'[' + ip + ']' if ':' in ip else ip}:{self.agent_port}"

    def _agent_token(self) -> str:
        return agent_token(self.agent_api_token, self.agent_token_file)

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

    def _emit(self, message: str, progress: int | None = None) -> None:
        event: dict = {"message": message}
        if progress is not None:
            event["progress"] = progress
        self._progress_events.append(event)
        self._progress_changed.set()

    async def progress(self):
        """Our restore messages, interleaved with KubeSpawner's pod events."""
        pump_events: list[dict] = []

        async def pump():
            async for event in super(SnapKubeSpawner, self).progress():
                pump_events.append(event)
                self._progress_changed.set()

        pump_task = asyncio.ensure_future(pump())
        ours = theirs = 0
        try:
            while True:
                self._progress_changed.clear()
                while ours < len(self._progress_events):
                    yield self._progress_events[ours]
                    ours += 1
                while theirs < len(pump_events):
                    yield pump_events[theirs]
                    theirs += 1
                start = self._start_future
                if pump_task.done() and start is not None and start.done():
                    if ours == len(self._progress_events) and theirs == len(pump_events):
                        break
                    continue
                try:
                    await asyncio.wait_for(self._progress_changed.wait(), 1)
                except asyncio.TimeoutError:
                    pass
        finally:
            pump_task.cancel()
