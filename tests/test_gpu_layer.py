"""The GPU layer is a bottom floor: ``jupyterhub_gpusnap.gpu`` imports nothing above it.

Read from the source (every import, the lazy ones inside functions included), so no GPU
and no driver are needed.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import jupyterhub_gpusnap
from jupyterhub_gpusnap import errors
from jupyterhub_gpusnap.checkpoint import base
from jupyterhub_gpusnap.gpu.cuda import CudaDriverError, GpuBusy
from jupyterhub_gpusnap.signals import nvml as nvml_signal

PACKAGE = Path(jupyterhub_gpusnap.__file__).parent
# what the GPU layer may use of the project: itself and these modules, which import nothing
BOTTOM = {"jupyterhub_gpusnap.errors", "jupyterhub_gpusnap.model", "jupyterhub_gpusnap.procs"}


def project_imports(path: Path) -> set[str]:
    """The ``jupyterhub_gpusnap`` modules a file imports, relative imports resolved."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    if package.endswith(".__init__"):
        package = package[: -len(".__init__")]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                name = ".".join(parts + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if node.module is None:  # from . import x: x is a module
                found.update(f"{name}.{a.name}" for a in node.names)
            else:
                found.add(name)
    return {m for m in found if m == "jupyterhub_gpusnap" or m.startswith("jupyterhub_gpusnap.")}


def test_the_gpu_layer_imports_nothing_above_it():
    upward = {}
    for path in sorted((PACKAGE / "gpu").glob("*.py")):
        bad = {
            m
            for m in project_imports(path)
            if not m.startswith("jupyterhub_gpusnap.gpu") and m not in BOTTOM
        }
        if bad:
            upward[path.name] = sorted(bad)
    assert upward == {}


def test_what_the_gpu_layer_stands_on_imports_nothing_of_the_project():
    for name in sorted(BOTTOM):
        path = PACKAGE / (name.split(".", 1)[1].replace(".", "/") + ".py")
        assert project_imports(path) == set(), name


def test_the_gpu_modules_live_only_in_the_gpu_package():
    for old in (
        "jupyterhub_gpusnap.park",
        "jupyterhub_gpusnap.gpuview",
        "jupyterhub_gpusnap.autounpark",
        "jupyterhub_gpusnap.checkpoint.cuda",
        "jupyterhub_gpusnap.checkpoint.gpucompat",
    ):
        assert importlib.util.find_spec(old) is None, old
    own = [
        n
        for n, o in vars(nvml_signal).items()
        if inspect.isclass(o) and o.__module__ == nvml_signal.__name__
    ]
    assert own == ["NvmlSignal"]  # the NVML library is gpu.nvml; the signal only uses it


def test_gpu_errors_are_the_checkpoint_contract_errors():
    """A busy GPU is still a refusal the watcher retries, whichever module catches it."""
    assert base.CheckpointError is errors.CheckpointError
    assert base.CheckpointRefused is errors.CheckpointRefused
    assert issubclass(GpuBusy, base.CheckpointRefused)
    assert issubclass(CudaDriverError, base.CheckpointError)
