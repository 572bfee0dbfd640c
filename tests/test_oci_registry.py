"""Checkpoint images against a real registry (Debian's docker-registry), restored by the agent.

A real runc container's checkpoint, in the archive CRI-O writes, is pushed as an OCI
image (chunked upload), verified, pulled back by digest and restored by the agent's
``/v1/restore`` into a real placeholder container: the process comes back with its memory.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from pathlib import Path

import psutil
import pytest

from jupyterhub_gpusnap.agent.ship import PvcStore, RegistryStore, Shipper
from jupyterhub_gpusnap.checkpoint import oci
from jupyterhub_gpusnap.gpu.compat import GpuNeeds
from tests.helpers.fake_kube import Cluster, Workload, cgroup2_mount, tar_bytes
from tests.helpers.registry import Registry, docker_config

pytestmark = [pytest.mark.k8s, pytest.mark.criu]


@pytest.fixture
async def registry(tmp_path):
    r = await Registry(tmp_path / "registry").start()
    yield r
    r.stop()


def test_image_config_manifest_and_references_follow_the_oci_spec():
    layer = oci.Descriptor(oci.LAYER_TYPE, "sha256:" + "1" * 64, 4096)
    config_bytes = oci.image_config(layer.digest, created=0.0)
    config = json.loads(config_bytes)
    assert config["rootfs"] == {"type": "layers", "diff_ids": [layer.digest]}
    assert (config["architecture"], config["os"], config["created"]) == (
        "amd64",
        "linux",
        "1970-01-01T00:00:00Z",
    )
    cfg = oci.Descriptor(oci.CONFIG_TYPE, oci.digest_bytes(config_bytes), len(config_bytes))
    ann = oci.checkpoint_annotations("notebook", "alice/gpu", 3 << 30, created=0.0)
    manifest = json.loads(oci.image_manifest(cfg, [layer], ann))
    assert (
        manifest["schemaVersion"] == 2
        and manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    )
    assert manifest["config"] == {
        "mediaType": "application/vnd.oci.image.config.v1+json",
        "digest": cfg.digest,
        "size": len(config_bytes),
    }
    assert manifest["layers"] == [
        {
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer.digest,
            "size": 4096,
        }
    ]
    assert manifest["annotations"] == {
        "io.kubernetes.cri-o.annotations.checkpoint.name": "notebook",
        "org.criu.checkpoint.container.name": "notebook",
        "org.jupyterhub.gpusnap.server": "alice/gpu",
        "org.jupyterhub.gpusnap.gpu-bytes": str(3 << 30),
        "org.jupyterhub.gpusnap.created": "1970-01-01T00:00:00Z",
    }

    ref = oci.ImageRef.parse("registry.example.org:5000/gpusnap/alice:t1@sha256:" + "a" * 64)
    assert (ref.registry, ref.name, ref.tag, ref.digest) == (
        "registry.example.org:5000",
        "gpusnap/alice",
        "t1",
        "sha256:" + "a" * 64,
    )
    assert oci.ImageRef.parse("localhost:5000/snap").tag == ""
    with pytest.raises(ValueError, match="no registry host"):
        oci.ImageRef.parse("alice")
    tag = oci.tag_for("alice/My Server", created=0.0)
    assert tag == "alice-My-Server-19700101T000000Z"


def test_docker_config_reads_secret_and_cli_shapes(tmp_path):
    secret = docker_config(tmp_path / "a.json", "reg.example:5000", "u1", "p:w")
    assert oci.load_docker_config(secret) == {"reg.example:5000": ("u1", "p:w")}
    cli = tmp_path / "b.json"
    cli.write_text(
        json.dumps({"auths": {"https://reg.example": {"username": "u2", "password": "x"}}})
    )
    assert oci.load_docker_config(cli) == {"reg.example": ("u2", "x")}


async def kubelet_archive(cluster: Cluster, work: Workload) -> str:
    """A kubelet-layout archive of ``work`` (real CRIU dump) in the fake kubelet's folder."""
    cluster.add_user_pod("alice", work)
    path = await cluster.kube.kubelet_checkpoint("jhub", "jupyter-alice", "notebook")
    return str(cluster.kube.checkpoints / os.path.basename(path))


async def test_archive_pushed_pulled_by_digest_and_restored_by_the_agent(tmp_path, registry):
    cluster = Cluster(tmp_path)
    # the agent reads this machine's /proc and cgroup v2 tree: the workload is a real runc
    # container, and the restore goes into a real placeholder container
    await cluster.start(
        AgentApp__restore_dir=str(tmp_path / "restore"),
        PodMapper__proc_root="/proc",
        PodMapper__cgroup_root=str(cgroup2_mount()),
    )
    work = Workload(tmp_path, ballast=3 << 20).start()
    try:
        before = await work.wait_lines(3)
        secret = before[0][0]
        archive = await kubelet_archive(cluster, work)
        size = os.path.getsize(archive)
        shipper = Shipper(registry_scheme="http", chunk_size=1 << 20)  # several PATCH chunks
        shipped = await RegistryStore(shipper, f"{registry.host}/gpusnap/alice").ship(
            Path(archive), server="alice/", container="notebook", gpu_bytes=0, created=time.time()
        )
        assert shipped.id == f"{registry.host}/gpusnap/alice@{shipped.digest}"
        layer_digest, layer_size = oci.sha256_file(archive)
        client = oci.RegistryClient(registry.host, scheme="http")
        manifest = await oci.verify_image(client, "gpusnap/alice", shipped.digest)
        assert manifest["layers"][0] == {
            "mediaType": oci.LAYER_TYPE,
            "digest": layer_digest,
            "size": size,
        }
        assert size > 3 << 20 and layer_size == size

        # the pod is deleted; the spawner's placeholder pod takes its place on the node
        work.stop()
        cluster.kube.pods.pop(("jhub", "jupyter-alice"))
        placeholder = work.placeholder()
        cluster.add_user_pod("alice", placeholder_for=shipped.id, runtime=placeholder)
        code, body = await cluster.restore_into(shipped.id)
        assert code == 200, body
        restored = body["pid"]
        assert body["restored"] is True and restored in placeholder.cgroup_pids()
        lines_at_restore = len(work.lines())
        after = await work.wait_lines(lines_at_restore + 2)
        new = after[lines_at_restore:]
        # the same process memory: the same secret, and the counter goes on from the dump
        assert all(s == secret for s, _ in new)
        assert new[0][1] > 1
        assert psutil.Process(restored).is_running()
        assert not (tmp_path / "restore").exists() or list((tmp_path / "restore").iterdir()) == []
    finally:
        work.close()
        for r in cluster.agent._restored:
            r.criu.wait(timeout=30)
        await cluster.stop()


async def test_restore_refuses_an_image_that_is_not_a_checkpoint(tmp_path, registry):
    cluster = Cluster(tmp_path)
    await cluster.start(AgentApp__restore_into="agent")
    try:
        not_checkpoint = tmp_path / "plain.tar"
        not_checkpoint.write_bytes(tar_bytes({"etc/motd": b"hello\n"}))
        store = RegistryStore(Shipper(registry_scheme="http"), f"{registry.host}/gpusnap/alice")
        shipped = await store.ship(
            not_checkpoint, server="alice/", container="notebook", gpu_bytes=0, created=time.time()
        )
        code, body = await cluster.restore_into(shipped.id)
        assert code == 422 and "checkpoint/inventory.img" in body["error"]
        code, body = await cluster.restore_into(f"{registry.host}/gpusnap/alice:latest")
        assert code == 502 and "no digest" in body["error"]
    finally:
        await cluster.stop()


async def test_gpu_image_is_refused_from_its_annotations_before_its_layer_is_pulled(
    tmp_path, registry
):
    """A GPU checkpoint image says what it needs in its manifest annotations; this
    machine has no GPU, so the agent refuses it after reading only the manifest."""
    cluster = Cluster(tmp_path)
    restore_dir = tmp_path / "restore"
    await cluster.start(AgentApp__restore_into="agent", AgentApp__restore_dir=str(restore_dir))
    try:
        archive = tmp_path / "checkpoint.tar"
        archive.write_bytes(tar_bytes({"checkpoint/inventory.img": b"not really"}))
        needs = GpuNeeds(
            holds_gpu=True, model="NVIDIA H100 80GB HBM3", devices=[0], driver_version="580.1"
        )
        store = RegistryStore(Shipper(registry_scheme="http"), f"{registry.host}/gpusnap/alice")
        shipped = await store.ship(
            archive,
            server="alice/",
            container="notebook",
            gpu_bytes=1 << 30,
            created=0.0,
            gpu=needs,
        )
        client = oci.RegistryClient(registry.host, scheme="http")
        manifest = await oci.verify_image(client, "gpusnap/alice", shipped.digest)
        assert manifest["annotations"]["org.jupyterhub.gpusnap.gpu-model"] == needs.model
        assert manifest["annotations"]["org.jupyterhub.gpusnap.driver-version"] == "580.1"
        assert await store.gpu_needs(shipped.id) == needs

        code, body = await cluster.agent_call(
            "POST",
            "/v1/restore",
            {"namespace": "jhub", "pod": "jupyter-alice", "image": shipped.id},
        )
        assert code == 409, body
        assert "holds GPU memory from NVIDIA H100 80GB HBM3" in body["error"]
        assert "no usable GPU" in body["error"] and "gpu-node-1" in body["error"]
        assert body["fix"] == "restore it on a node with that GPU"
        assert not restore_dir.exists() or list(restore_dir.iterdir()) == []
    finally:
        await cluster.stop()


async def test_basic_auth_registry_needs_the_secrets_credentials(tmp_path):
    registry = await Registry(tmp_path / "registry", "basic").start()
    blob = tmp_path / "layer.tar"
    blob.write_bytes(os.urandom(2 << 20) + tar_bytes({"a": b"b"}))
    try:
        anonymous = oci.RegistryClient(registry.host, scheme="http")
        with pytest.raises(oci.RegistryError) as err:
            await oci.push_archive(
                anonymous, f"{registry.host}/gpusnap/alice", blob, {}, "t1", time.time()
            )
        assert err.value.code == 401 and "docker_config_path" in str(err.value)

        wrong = docker_config(tmp_path / "wrong.json", registry.host, password="nope")
        with pytest.raises(oci.RegistryError, match="401"):
            await oci.push_archive(
                oci.RegistryClient(registry.host, scheme="http", docker_config_path=str(wrong)),
                f"{registry.host}/gpusnap/alice",
                blob,
                {},
                "t1",
                time.time(),
            )

        good = docker_config(tmp_path / "good.json", registry.host)
        client = oci.RegistryClient(
            registry.host, scheme="http", docker_config_path=str(good), chunk_size=1 << 20
        )
        pushed = await oci.push_archive(
            client, f"{registry.host}/gpusnap/alice", blob, {}, "t1", time.time()
        )
        assert client._auth_header == "Basic " + base64.b64encode(b"pusher:secret").decode()
        assert await client.list_tags("gpusnap/alice") == ["t1"]
        pulled = tmp_path / "pulled.tar"
        await oci.pull_layer(client, pushed.ref, pulled)
        assert pulled.read_bytes() == blob.read_bytes()
    finally:
        registry.stop()


async def test_verification_notices_a_blob_the_registry_lost(tmp_path, registry):
    blob = tmp_path / "layer.tar"
    blob.write_bytes(tar_bytes({"checkpoint/pages-1.img": os.urandom(1 << 20)}))
    client = oci.RegistryClient(registry.host, scheme="http")
    pushed = await oci.push_archive(
        client, f"{registry.host}/gpusnap/alice", blob, {}, "t1", time.time()
    )
    layer_digest = pushed.manifest["layers"][0]["digest"]
    data = [p for p in registry.blob_files() if p.parent.name == layer_digest.split(":")[1]]
    assert len(data) == 1
    data[0].unlink()
    with pytest.raises(oci.RegistryError, match="is missing from"):
        await oci.verify_image(client, "gpusnap/alice", pushed.digest)


async def test_pvc_copy_is_verified_and_fetched_back(tmp_path):
    archive = tmp_path / "archive.tar"
    archive.write_bytes(tar_bytes({"checkpoint/inventory.img": b"\x01" * 64, "config.dump": b"{}"}))
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    store = PvcStore(Shipper(chunk_size=16), pvc)
    shipped = await store.ship(archive, server="alice/", container="", gpu_bytes=0, created=0.0)
    assert shipped.id == str(pvc / "alice-19700101T000000Z.tar")
    assert shipped.digest == oci.sha256_file(archive)[0]
    images = await store.fetch(shipped.id, tmp_path / "unpacked")
    assert (images / "inventory.img").read_bytes() == b"\x01" * 64

    with open(shipped.id, "r+b") as f:  # the PVC copy changes behind our back
        f.seek(600)
        f.write(b"\xff")
    from jupyterhub_gpusnap.kube import AgentError

    with pytest.raises(AgentError, match="corrupt"):
        await store.fetch(shipped.id, tmp_path / "again")


def test_the_store_is_chosen_once_from_the_target_or_the_image(tmp_path):
    """A checkpoint's target names its store, refused before anything is frozen; a
    restore's image names the store that holds it."""
    from jupyterhub_gpusnap.kube import AgentError

    shipper = Shipper()
    registry = shipper.for_target({"kind": "registry", "repository": "r.example/u"}, [])
    assert isinstance(registry, RegistryStore) and registry.repository == "r.example/u"
    pvc = shipper.for_target({"kind": "pvc", "path": str(tmp_path)}, [str(tmp_path)])
    assert isinstance(pvc, PvcStore) and pvc.folder == tmp_path
    with pytest.raises(AgentError, match="target.kind must be 'registry' or 'pvc'") as e:
        shipper.for_target({"kind": "s3"}, [str(tmp_path)])
    assert e.value.code == 400
    with pytest.raises(AgentError, match="checkpoints to a PVC are off") as e:
        shipper.for_target({"kind": "pvc", "path": str(tmp_path)}, [])
    assert e.value.code == 403
    with pytest.raises(AgentError, match="is not one of AgentApp.pvc_paths") as e:
        shipper.for_target({"kind": "pvc", "path": "/etc"}, [str(tmp_path)])
    assert e.value.code == 403

    assert isinstance(shipper.for_image(str(tmp_path / "alice.tar")), PvcStore)
    assert isinstance(shipper.for_image("r.example/u@sha256:" + "0" * 64), RegistryStore)


async def test_tar_with_escaping_paths_is_refused(tmp_path):
    from jupyterhub_gpusnap.agent.ship import extract_archive
    from jupyterhub_gpusnap.kube import AgentError

    evil = tmp_path / "evil.tar"
    evil.write_bytes(tar_bytes({"../../etc/cron.d/x": b"* * * * * root sh\n"}))
    with pytest.raises(AgentError, match="unsafe path"):
        await asyncio.to_thread(extract_archive, evil, tmp_path / "out")
    assert not (tmp_path / "etc").exists()


async def test_token_auth_registry_gets_a_bearer_token_from_the_realm(tmp_path):
    registry = await Registry(tmp_path / "registry", "token").start()
    blob = tmp_path / "layer.tar"
    blob.write_bytes(tar_bytes({"checkpoint/pages-1.img": os.urandom(1 << 20)}))
    try:
        anonymous = oci.RegistryClient(registry.host, scheme="http")
        with pytest.raises(oci.RegistryError) as err:
            await oci.push_archive(anonymous, f"{registry.host}/gpusnap/alice", blob, {}, "t1", 0.0)
        assert err.value.code == 401 and "token service" in str(err.value)

        good = docker_config(tmp_path / "good.json", registry.host)
        client = oci.RegistryClient(registry.host, scheme="http", docker_config_path=str(good))
        pushed = await oci.push_archive(
            client, f"{registry.host}/gpusnap/alice", blob, {}, "t1", 0.0
        )
        assert client._auth_header.startswith("Bearer ey")
        # the registry's challenge lists the actions in no fixed order
        assert {"repository:gpusnap/alice:pull,push", "repository:gpusnap/alice:push,pull"} & set(
            registry.tokens.issued
        )
        pulled = tmp_path / "pulled.tar"
        await oci.pull_layer(client, pushed.ref, pulled)
        assert pulled.read_bytes() == blob.read_bytes()
    finally:
        registry.stop()


def test_sweep_keeps_only_the_archive_of_the_failed_push(tmp_path):
    """After a failed push the agent keeps that archive (a retry can ship it) and no other
    archive of the container: at most one per container, whatever the failures."""
    import logging

    from jupyterhub_gpusnap.agent.ship import sweep_archives

    names = [
        "checkpoint-jupyter-alice_jhub-notebook-2026-11-25T16:00:00Z.tar",
        "checkpoint-jupyter-alice_jhub-notebook-2026-11-25T17:00:00Z.tar",
        "checkpoint-jupyter-bob_jhub-notebook-2026-11-25T17:00:00Z.tar",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"archive")
    log = logging.getLogger("test")
    newest = tmp_path / names[1]
    removed = sweep_archives(tmp_path, "jhub", "jupyter-alice", "notebook", log, keep=newest)
    assert [p.name for p in removed] == [names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == names[1:]
    # once a checkpoint of the container ships, nothing of it stays
    sweep_archives(tmp_path, "jhub", "jupyter-alice", "notebook", log)
    assert [p.name for p in tmp_path.iterdir()] == [names[2]]
