"""A checkpoint holding GPU memory restores only where the same GPUs and driver are."""

from __future__ import annotations

import pytest

from jupyterhub_gpusnap.checkpoint import CheckpointError
from jupyterhub_gpusnap.checkpoint.local import LocalBackend, gpu_mismatch
from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.model import Server

H100 = "NVIDIA H100 80GB HBM3"


def manifest(**kw) -> Manifest:
    m = Manifest(user="alice", server="", created=0.0, cuda_pids=[42], gpu_model=H100,
                 gpu_count=1, driver_version="580.159.04")
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
        (manifest(), here(driver_version="590.10"), ["580.159.04", "590.10", "before upgrading the driver"]),
    ],
    ids=["same", "cpu-only", "no-gpu", "other-model", "too-few-gpus", "other-driver"],
)
def test_gpu_mismatch_names_the_difference_and_the_fix(m, host, words):
    why = gpu_mismatch(m, host)
    assert bool(why) == bool(words)
    for w in words:
        assert w in why


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
