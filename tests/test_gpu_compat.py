"""A checkpoint holding GPU memory restores only where the same GPUs and driver are."""

from __future__ import annotations

import pytest

from jupyterhub_gpusnap.checkpoint import CheckpointError, local_restore
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.gpu.compat import (
    GpuNeeds,
    gpu_difference,
    gpu_mismatch,
)
from jupyterhub_gpusnap.model import Server

H100 = "NVIDIA H100 80GB HBM3"


def manifest(**kw) -> Manifest:
    m = Manifest(
        user="alice",
        server="",
        created=0.0,
        cuda_pids=[42],
        gpu_model=H100,
        gpu_count=1,
        driver_version="580.159.04",
    )
    m.extra["gpu_devices"] = kw.pop("devices", [0])
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def here(**kw) -> dict:
    return {"gpu_model": H100, "gpu_count": 1, "driver_version": "580.159.04", **kw}


@pytest.mark.parametrize(
    "m,host,words",
    [
        (manifest(), here(), []),
        (manifest(cuda_pids=[]), {}, []),  # CPU-only checkpoint: restores anywhere
        (manifest(), {"error": "NVML Shared Library Not Found"}, ["no usable GPU", "NVML Shared"]),
        (manifest(), here(gpu_model="NVIDIA A100-SXM4-40GB"), ["A100", "same GPU model", H100]),
        (manifest(devices=[0, 3]), here(gpu_count=2), ["GPU 3", "2 GPU(s)", "at least 4"]),
        (
            manifest(),
            here(driver_version="590.10"),
            ["580.159.04", "590.10", "before upgrading the driver"],
        ),
    ],
    ids=["same", "cpu-only", "no-gpu", "other-model", "too-few-gpus", "other-driver"],
)
def test_gpu_mismatch_names_the_difference_and_the_fix(m, host, words):
    why = gpu_mismatch(m, host)
    assert bool(why) == bool(words)
    for w in words:
        assert w in why


def test_local_backend_and_agent_share_one_check():
    assert local_restore.gpu_mismatch is gpu_mismatch


def test_needs_round_trip_through_image_annotations_and_name_the_node():
    needs = GpuNeeds(holds_gpu=True, model=H100, devices=[0, 3], driver_version="580.159.04")
    ann = needs.annotations()
    assert ann == {
        "org.jupyterhub.gpusnap.gpu-model": H100,
        "org.jupyterhub.gpusnap.gpu-count": "2",
        "org.jupyterhub.gpusnap.gpu-devices": "0,3",
        "org.jupyterhub.gpusnap.driver-version": "580.159.04",
    }
    assert GpuNeeds.from_annotations(ann) == needs
    assert needs.as_dict() == {
        "model": H100,
        "count": 2,
        "devices": [0, 3],
        "driver_version": "580.159.04",
    }
    cpu_only = GpuNeeds.from_annotations(GpuNeeds().annotations())
    assert cpu_only == GpuNeeds() and gpu_difference(cpu_only, {}) == ("", "")
    # an image from before GPU needs were recorded, or with unreadable ones: nothing known
    assert GpuNeeds.from_annotations({"org.jupyterhub.gpusnap.gpu-bytes": "0"}) is None
    assert GpuNeeds.from_annotations({"org.jupyterhub.gpusnap.gpu-count": "two"}) is None

    why, fix = gpu_difference(needs, here(gpu_count=4, gpu_model="NVIDIA L4"), "node")
    assert why == f"it was taken on {H100} and this node has NVIDIA L4"
    assert fix.endswith(f"restore it on a {H100} node")
    assert gpu_difference(needs, here(gpu_count=4), "node") == ("", "")


@pytest.mark.criu
async def test_a_gpu_checkpoint_is_refused_here_before_criu_runs(tmp_path, process_tree):
    backend = LocalBackend(checkpoint_dir=str(tmp_path / "ckpt"), min_free_bytes=0)
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": tree.pid}))
    folder = backend.folder(info.id)
    m = Manifest.load(folder)
    # As if it had been taken on a GPU host: this host has no GPU (CI) or another one.
    m.cuda_pids, m.gpu_model, m.gpu_count = [m.pid], "NVIDIA B300 (not here)", 8
    m.save(folder)
    with pytest.raises(CheckpointError, match="cannot be restored here"):
        await backend.restore(info)
    assert not list(folder.glob("restore-*.log")), "CRIU ran anyway"
    assert Manifest.load(folder).status == "verified"
