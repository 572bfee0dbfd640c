"""The Helm values and Kubernetes manifests in helm-values/ are valid and consistent.

- values.yaml validates against Zero to JupyterHub's values schema (chart 4.4, vendored in
  tests/data/z2jh-values.schema.yaml; its header says where it came from). The chart validates the
  *merged* values (its defaults + ours), so the schema's ``required`` lists are dropped
  here: what is checked is that every key we set exists in the chart (no typo passes
  ``additionalProperties: false``) and has the right type.
- every manifest validates with kubernetes_validate (strict: unknown fields fail) for a
  recent Kubernetes version;
- the values, the manifests and the code agree on names (agent label, port, namespaces,
  ServiceAccounts), and the hub-side Python config in the values compiles.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from traitlets.config import Config, PyFileConfigLoader

from jupyterhub_gpusnap.agent.app import AgentApp
from jupyterhub_gpusnap.doctor import RBAC_NEEDS, granted_by_chart
from jupyterhub_gpusnap.hubconfig import REQUIRED_SCOPES
from jupyterhub_gpusnap.kube.agent import AgentConnection
from jupyterhub_gpusnap.kubespawner import SnapKubeSpawner

ROOT = Path(__file__).resolve().parent.parent
HELM = ROOT / "helm-values"
SCHEMA = Path(__file__).resolve().parent / "data" / "z2jh-values.schema.yaml"
K8S_VERSIONS = ["1.32", "1.33"]
MANIFESTS = sorted((HELM / "agent").glob("*.yaml"))


def drop_required(schema):
    """The schema without the object-level ``required`` lists the chart's defaults fill in.

    ``required`` inside ``oneOf``/``anyOf`` branches (a bare ``{"required": [...]}``) stays:
    it says which alternative a value is, not what the defaults provide.
    """
    if isinstance(schema, dict):
        is_object_schema = (
            "properties" in schema or "patternProperties" in schema or "type" in schema
        )
        return {
            k: drop_required(v)
            for k, v in schema.items()
            if not (k == "required" and is_object_schema)
        }
    if isinstance(schema, list):
        return [drop_required(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def z2jh_schema() -> dict:
    schema = yaml.safe_load(SCHEMA.read_text())
    # the real chart schema, not a stub: the sections our values set are all described
    assert schema["additionalProperties"] is False
    assert {"hub", "proxy", "singleuser", "scheduling", "cull", "custom"} <= set(
        schema["properties"]
    )
    return schema


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load((HELM / "values.yaml").read_text())


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_objects() -> list[dict]:
    return [d for p in MANIFESTS for d in docs(p)]


def test_values_validate_against_z2jh_schema(z2jh_schema, values):
    validator = jsonschema.Draft7Validator(drop_required(z2jh_schema))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(values)]
    assert errors == []


def test_schema_check_catches_a_typo(z2jh_schema, values):
    broken = copy.deepcopy(values)
    broken["hub"]["netwrkPolicy"] = broken["hub"].pop("networkPolicy")
    validator = jsonschema.Draft7Validator(drop_required(z2jh_schema))
    assert any("netwrkPolicy" in e.message for e in validator.iter_errors(broken))


def test_values_hub_config(values):
    hub = values["hub"]
    service = hub["services"]["gpusnap"]
    assert service["command"][0] == "jupyterhub-gpusnap"
    assert service["url"] == "http://hub:10101"
    assert {"name": "gpusnap", "port": 10101, "targetPort": 10101} in hub["service"]["extraPorts"]
    roles = hub["loadRoles"]
    # exactly what the service needs (hubconfig.REQUIRED_SCOPES): no access:servers, which
    # would let its token read users' files and run code in their servers
    assert set(roles["gpusnap-service"]["scopes"]) == set(REQUIRED_SCOPES)
    assert "access:servers" not in roles["gpusnap-service"]["scopes"]
    # servers report their kernels to the service with their own token: SnapKubeSpawner asks
    # the Hub to give it access to the service, which users hold (the user role above)
    assert "access:services!service=gpusnap" in SnapKubeSpawner._default_server_token_scopes(None)
    assert roles["gpusnap-service"]["services"] == ["gpusnap"]
    assert "access:services!service=gpusnap" in roles["user"]["scopes"]
    egress = hub["networkPolicy"]["egress"][0]
    assert egress["ports"] == [{"protocol": "TCP", "port": 9780}]
    assert egress["to"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "jupyterhub-gpusnap-agent"
    }
    # the Python snippets compile
    for name, source in hub["extraConfig"].items():
        compile(source, name, "exec")
    for f in hub["extraFiles"].values():
        if f["mountPath"].endswith(".py"):
            compile(f["stringData"], f["mountPath"], "exec")
    extra = hub["extraConfig"]["gpusnap.py"]
    assert 'c.JupyterHub.spawner_class = "jupyterhub_gpusnap.kubespawner.SnapKubeSpawner"' in extra
    assert "c.JupyterHub.template_paths" in extra
    assert (ROOT / "jupyterhub_gpusnap" / "templates" / "hub").is_dir()


def test_values_gpu_profile(values):
    profiles = {p["slug"]: p for p in values["singleuser"]["profileList"]}
    gpu = profiles["gpu-h100"]["kubespawner_override"]
    assert gpu["extra_resource_limits"] == {"nvidia.com/gpu": "1"}
    assert gpu["node_selector"]["nvidia.com/gpu.product"]
    # every kubespawner_override key is a KubeSpawner trait
    traits = set(SnapKubeSpawner.class_trait_names())
    for p in profiles.values():
        assert set(p.get("kubespawner_override", {})) <= traits
    assert values["cull"]["enabled"] is False
    g = values["custom"]["gpusnap"]
    assert g["restoreMode"] in ("agent", "runtime")
    assert values["singleuser"]["startTimeout"] > g["restoreTimeout"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifest_validates(path, version):
    objects = docs(path)
    assert objects, f"{path.name} holds no object"
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_manifest_validation_catches_a_typo():
    ds = next(o for o in all_objects() if o["kind"] == "DaemonSet")
    broken = copy.deepcopy(ds)
    broken["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_daemonset_is_what_the_agent_needs():
    objs = all_objects()
    ds = next(o for o in objs if o["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "jupyterhub-gpusnap-agent"
    # the hub side finds agents by this label (spawner, service, doctor)
    selector = AgentConnection.agent_label_selector.default_value
    key, _, value = selector.partition("=")
    assert labels[key] == value
    assert pod["hostPID"] is True and not pod.get("hostNetwork")
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    assert (
        container["ports"][0]["containerPort"] == AgentConnection.agent_port.default_value == 9780
    )
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert {
        "/var/lib/kubelet/checkpoints",
        "/proc",
        "/sys/fs/cgroup",
        "/run/nvidia/driver",
    } <= host_paths
    assert {
        "/var/lib/kubelet/checkpoints",
        "/host/proc",
        "/host/sys/fs/cgroup",
        "/run/nvidia/driver",
    } <= mounts
    assert pod["serviceAccountName"] == "gpusnap-agent"
    ns = ds["metadata"]["namespace"]
    assert ns == AgentConnection.agent_namespace.default_value
    # the agent config mounted from the ConfigMap compiles
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    compile(cm["data"]["agent_config.py"], "agent_config.py", "exec")
    # a restore writes the placeholder container's cgroup.procs
    cgroup = next(m for m in container["volumeMounts"] if m["name"] == "host-cgroup")
    assert not cgroup.get("readOnly")


def agent_from_configmap(tmp_path, monkeypatch) -> AgentApp:
    """The agent as configured by the ConfigMap's agent_config.py (loaded by traitlets)."""
    cm = next(o for o in all_objects() if o["kind"] == "ConfigMap")
    (tmp_path / "agent_config.py").write_text(cm["data"]["agent_config.py"])
    monkeypatch.setenv("HOST_IP", "10.0.0.7")  # from the downward API in the DaemonSet
    loader = PyFileConfigLoader("agent_config.py", path=str(tmp_path))
    config = loader.load_config()
    assert isinstance(config, Config)
    return AgentApp(config=config)


def test_agent_clusterrole_is_exactly_what_the_agent_uses_and_checks(tmp_path, monkeypatch):
    """The ClusterRole grants exactly the rules the configured agent uses, which are the
    rules its doctor reviews (AgentApp.rbac_needs): nothing more, nothing less."""
    role = next(
        o
        for o in all_objects()
        if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "gpusnap-agent"
    )
    rules = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    agent = agent_from_configmap(tmp_path, monkeypatch)
    needs = {
        (n.group, f"{n.resource}/{n.subresource}" if n.subresource else n.resource, n.verb)
        for n in agent.rbac_needs()
    }
    assert rules == needs
    # with this config: no nodes/proxy (exec into any pod) and no 'get nodes'
    assert rules == {
        ("", "nodes/checkpoint", "create"),
        ("", "pods", "get"),
        ("", "pods", "list"),
        ("authentication.k8s.io", "tokenreviews", "create"),
    }
    binding = next(
        o
        for o in all_objects()
        if o["kind"] == "ClusterRoleBinding" and o["metadata"]["name"] == "gpusnap-agent"
    )
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpusnap-agent", "namespace": "gpusnap-system"}
    ]


def test_hub_rbac_grants_exactly_what_doctor_checks():
    """rbac-hub.yaml grants the hub SA exactly the permissions doctor reviews that the
    Z2JH chart's hub Role does not already grant."""
    objs = docs(HELM / "agent" / "rbac-hub.yaml")
    granted = set()
    roles = {
        (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
        for o in objs
        if o["kind"] in ("Role", "ClusterRole")
    }
    for b in (o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": "jhub"}]
        role = roles[
            (b["roleRef"]["kind"], b["metadata"].get("namespace", ""), b["roleRef"]["name"])
        ]
        scope = b["metadata"].get("namespace", "")
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((verb, group, res, scope))
    scopes = {"ns": "jhub", "agent": "gpusnap-system", "": ""}
    needed = {
        (verb, group, f"{res}/{sub}" if sub else res, scopes[scope])
        for verb, group, res, sub, scope, _why in RBAC_NEEDS
        if not granted_by_chart(verb, group, res, scope)
    }
    assert granted == needed
    # what the chart grants is not granted twice
    assert not any(granted_by_chart(v, g, r, "ns") for v, g, r, scope in granted if scope == "jhub")


def test_dockerfiles_install_the_package():
    hub = (HELM / "Dockerfile.hub").read_text()
    agent = (HELM / "Dockerfile.agent").read_text()
    assert hub.startswith("#") and "FROM quay.io/jupyterhub/k8s-hub:" in hub
    assert "pip install" in hub and "[kubernetes]" in hub
    assert "29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9" in agent
    assert 'ENTRYPOINT ["jupyterhub-gpusnap-agent"]' in agent


def test_values_give_the_lab_panel_what_it_needs(values):
    """On Z2JH the panel's server extension reaches the service through the proxy (as the
    browser and the service itself do), in a notebook image that has the extension."""
    from urllib.parse import urlparse

    from jupyterhub_gpusnap.serverext.client import service_url_from_env

    singleuser = values["singleuser"]
    env = singleuser["extraEnv"]
    url = env["GPUSNAP_SERVICE_URL"]
    # what the extension uses, with the variables a Z2JH pod gets from KubeSpawner
    pod_env = {**env, "JUPYTERHUB_API_URL": "http://hub:8081/hub/api"}
    assert service_url_from_env(pod_env) == url
    name = next(iter(values["hub"]["services"]))
    assert urlparse(url).path == f"/services/{name}/"
    # the proxy's Service, as the service's own proxy_url; the Hub's API host serves no services
    config = values["hub"]["extraFiles"]["gpusnap-config"]["stringData"]
    proxy_url = next(
        line.split("=", 1)[1].strip().strip('"')
        for line in config.splitlines()
        if line.startswith("c.GpuSnap.proxy_url")
    )
    assert urlparse(url).netloc == urlparse(proxy_url).netloc == "proxy-public"
    # every profile runs the notebook image built with the extension (no profile overrides it)
    image = singleuser["image"]["name"]
    notebook = (HELM / "Dockerfile.notebook").read_text()
    assert f"-t {image}:{singleuser['image']['tag']} ." in notebook
    assert not [
        p for p in singleuser["profileList"] if "image" in p.get("kubespawner_override", {})
    ]
    install = next(line for line in notebook.splitlines() if "pip install" in line)
    assert "/tmp/jupyterhub-gpusnap" in install and "[" not in install  # the base package only


def test_agent_sees_the_node_root_and_only_the_snapshot_claim(tmp_path, monkeypatch, values):
    """A restore reads the placeholder container's runtime state, root filesystem and
    volumes under host_root: the DaemonSet mounts the node's / there, with the runtime's
    later mounts propagated. Checkpoints to a folder go only into the snapshot claim, and
    only when it is mounted (storage.target "pvc"), at the values' pvcPath."""
    ds = next(o for o in all_objects() if o["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "node-root")
    assert mount == {
        "name": "node-root",
        "mountPath": "/host",
        "mountPropagation": "HostToContainer",
    }
    volume = next(v for v in pod["volumes"] if v["name"] == "node-root")
    assert volume == {"name": "node-root", "hostPath": {"path": "/"}}

    import os

    ismount = os.path.ismount
    for mounted in (False, True):
        monkeypatch.setattr(
            os.path, "ismount", lambda p, m=mounted: m if p == "/snapshots" else ismount(p)
        )
        agent = agent_from_configmap(tmp_path, monkeypatch)
        assert agent.host_root == mount["mountPath"]
        assert agent.pvc_paths == (["/snapshots"] if mounted else [])
    # the folder the hub side names in a checkpoint request (KubernetesBackend.pvc_path)
    config = values["hub"]["extraFiles"]["gpusnap-config"]["stringData"]
    assert 'c.KubernetesBackend.pvc_path = storage.get("pvcPath", "/snapshots")' in config
    assert values["custom"]["gpusnap"]["storage"]["pvcPath"] == "/snapshots"
