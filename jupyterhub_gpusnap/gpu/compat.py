"""Whether the GPU memory in a checkpoint can be restored where it is asked to be.

The CUDA driver restores a process's checkpointed GPU memory only onto the same GPU
model, onto devices that exist, and under the driver version that checkpointed it.
A restore that ignores this fails late (after CRIU has rebuilt the process tree) or
leaves a process whose GPU state cannot come back. So both the local backend (from
its manifest) and the node agent (from the checkpoint image's annotations) compare
what a checkpoint needs with the GPUs present *before* CRIU runs, and refuse with a
message that names the difference and the fix.

:class:`GpuNeeds` is what a checkpoint records; ``here`` is what a host or node has,
in the shape of :meth:`CudaCheckpoint.gpu_inventory` (``gpu_model``, ``gpu_count``,
``driver_version``, and ``error`` when NVML could not be read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: OCI manifest annotations the node agent writes on a checkpoint image (strings, as
#: annotations must be). ``gpu-count`` is the number of GPUs the checkpointed processes
#: held memory on; ``0`` for a checkpoint without GPU state.
ANNOTATION_GPU_MODEL = "org.jupyterhub.gpusnap.gpu-model"
ANNOTATION_GPU_COUNT = "org.jupyterhub.gpusnap.gpu-count"
ANNOTATION_GPU_DEVICES = "org.jupyterhub.gpusnap.gpu-devices"
ANNOTATION_DRIVER = "org.jupyterhub.gpusnap.driver-version"


@dataclass
class GpuNeeds:
    """What restoring a checkpoint's GPU memory needs.

    ``holds_gpu``: the checkpoint carries GPU memory (False: it restores anywhere).
    ``model``: the NVML name of the GPU it was taken on (e.g. ``NVIDIA H100 80GB HBM3``).
    ``devices``: the device indices its processes held memory on.
    ``driver_version``: the NVIDIA driver that checkpointed it (e.g. ``580.159.04``).
    """

    holds_gpu: bool = False
    model: str = ""
    devices: list[int] = field(default_factory=list)
    driver_version: str = ""

    @property
    def count(self) -> int:
        """How many GPUs the checkpointed processes used."""
        return len(self.devices)

    @classmethod
    def from_manifest(cls, m: Any) -> GpuNeeds:
        """From a local checkpoint :class:`~.manifest.Manifest` (its ``cuda_pids``,
        ``gpu_model``, ``driver_version`` and ``extra['gpu_devices']``)."""
        return cls(
            holds_gpu=bool(m.cuda_pids),
            model=m.gpu_model or "",
            devices=[int(d) for d in (m.extra.get("gpu_devices") or [])],
            driver_version=m.driver_version or "",
        )

    def as_dict(self) -> dict:
        """JSON form, as the agent's checkpoint reply carries it."""
        return {
            "model": self.model,
            "count": self.count,
            "devices": list(self.devices),
            "driver_version": self.driver_version,
        }

    def annotations(self) -> dict[str, str]:
        """The OCI annotations recording these needs (always written, ``gpu-count: 0``
        for a CPU-only checkpoint)."""
        if not self.holds_gpu:
            return {ANNOTATION_GPU_COUNT: "0"}
        return {
            ANNOTATION_GPU_MODEL: self.model,
            ANNOTATION_GPU_COUNT: str(max(self.count, 1)),
            ANNOTATION_GPU_DEVICES: ",".join(str(d) for d in self.devices),
            ANNOTATION_DRIVER: self.driver_version,
        }

    @classmethod
    def from_annotations(cls, ann: dict) -> GpuNeeds | None:
        """Read :meth:`annotations` back; None when the image records nothing about GPUs
        (taken before they were recorded) or records it unreadably."""
        if ANNOTATION_GPU_COUNT not in ann:
            return None
        try:
            count = int(ann[ANNOTATION_GPU_COUNT])
            text = ann.get(ANNOTATION_GPU_DEVICES, "")
            devices = [int(d) for d in text.split(",") if d.strip()]
        except (TypeError, ValueError):
            return None
        return cls(
            holds_gpu=count > 0,
            model=ann.get(ANNOTATION_GPU_MODEL, ""),
            devices=devices,
            driver_version=ann.get(ANNOTATION_DRIVER, ""),
        )


def gpu_difference(needs: GpuNeeds, here: dict, where: str = "host") -> tuple[str, str]:
    """``(difference, fix)`` when GPU memory needing ``needs`` cannot be restored on the
    ``where`` ("host" or "node") whose GPUs are ``here``; ``("", "")`` when it can."""
    if not needs.holds_gpu:
        return "", ""
    if not here.get("gpu_count"):
        reason = here.get("error") or "NVML finds no GPU"
        return (
            f"it holds GPU memory from {needs.model or 'a GPU'} but this {where} has no usable "
            f"GPU ({reason})",
            f"restore it on a {where} with that GPU",
        )
    if needs.model and here.get("gpu_model") != needs.model:
        return (
            f"it was taken on {needs.model} and this {where} has {here.get('gpu_model')}",
            "the driver restores GPU memory only onto the same GPU model: restore it on a "
            f"{needs.model} {where}",
        )
    if needs.devices and max(needs.devices) >= here["gpu_count"]:
        top = max(needs.devices)
        return (
            f"it used GPU {top} and this {where} has {here['gpu_count']} GPU(s)",
            f"restore it on a {where} with at least {top + 1}",
        )
    if (
        needs.driver_version
        and here.get("driver_version")
        and here["driver_version"] != needs.driver_version
    ):
        return (
            f"it was taken with NVIDIA driver {needs.driver_version} and this {where} runs "
            f"{here['driver_version']}",
            "GPU checkpoints restore only under the driver that took them: go back to "
            f"{needs.driver_version} to restore it (restore suspended servers before upgrading "
            "the driver)",
        )
    return "", ""


def gpu_mismatch(m: Any, here: dict) -> str:
    """Why GPU memory checkpointed as manifest ``m`` cannot be restored on a host with GPUs
    ``here`` (a :meth:`CudaCheckpoint.gpu_inventory`), or '' if it can. The driver restores
    GPU memory only onto the same GPU model, count and driver."""
    why, fix = gpu_difference(GpuNeeds.from_manifest(m), here)
    return f"{why}; {fix}" if why else ""


__all__ = [
    "ANNOTATION_DRIVER",
    "ANNOTATION_GPU_COUNT",
    "ANNOTATION_GPU_DEVICES",
    "ANNOTATION_GPU_MODEL",
    "GpuNeeds",
    "gpu_difference",
    "gpu_mismatch",
]
