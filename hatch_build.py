"""Builds the JupyterLab extension (labextension/ → jupyterhub_gpusnap/labextension/).

The built bundle is not committed: webpack writes a new ``remoteEntry.<hash>.js`` whenever the
build's absolute path or the JupyterLab version differs, so a committed bundle could never match
every build. Instead every wheel and sdist build (``pip install .``, ``pip install -e .``,
``python -m build``) runs this hook, which builds the bundle when it is missing or older than
its sources, and records a digest of the sources it was built from in
``jupyterhub_gpusnap/labextension/build-inputs.sha256``. An sdist carries the built bundle and
its digest, so a wheel built from the sdist needs no Node.js.

``python hatch_build.py`` builds it by hand with the running interpreter's JupyterLab
(``.venv/bin/python hatch_build.py``); ``--check`` only says whether the bundle is current.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SOURCE = ROOT / "labextension"
BUNDLE = ROOT / "jupyterhub_gpusnap" / "labextension"
STAMP = BUNDLE / "build-inputs.sha256"
#: what the bundle is built from; node_modules comes from package-lock.json
INPUTS = ("package.json", "package-lock.json", "tsconfig.json", "src", "style")


def inputs_digest(source: Path = SOURCE) -> str:
    """sha256 over the names and contents of the extension's source files, in a stable order."""
    h = hashlib.sha256()
    for name in INPUTS:
        path = source / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if not f.exists():
                continue
            h.update(f.relative_to(source).as_posix().encode() + b"\0")
            h.update(f.read_bytes() + b"\0")
    return h.hexdigest()


def is_current() -> bool:
    """The bundle exists and was built from the sources as they are now."""
    return (
        (BUNDLE / "package.json").exists()
        and STAMP.exists()
        and STAMP.read_text().split()[0] == inputs_digest()
    )


def build(python: str = sys.executable) -> None:
    """``npm ci`` (when node_modules is missing or older than the lock file) and ``npm run build``
    against ``python``'s JupyterLab."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "building the JupyterLab extension needs Node.js and npm (apt-get install nodejs npm, "
            "or .ci/setup); a wheel built from an sdist needs neither"
        )
    env = dict(os.environ, PYTHON=python)
    installed = SOURCE / "node_modules" / ".package-lock.json"
    lock = SOURCE / "package-lock.json"
    if not installed.exists() or lock.stat().st_mtime > installed.stat().st_mtime:
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--silent"], cwd=SOURCE, env=env, check=True)
    # old hashed files would otherwise stay beside the new ones and ship in the wheel
    shutil.rmtree(BUNDLE / "static", ignore_errors=True)
    subprocess.run([npm, "run", "build", "--silent"], cwd=SOURCE, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    STAMP.write_text(f"{inputs_digest()}  labextension/{{{','.join(INPUTS)}}}\n")


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script, outside a build
    BuildHookInterface = object


class LabExtensionHook(BuildHookInterface):
    """Builds the bundle before a wheel or sdist is assembled, when it is not current."""

    def dependencies(self) -> list[str]:
        # the build needs JupyterLab's staging folder (shared package versions); only then
        return [] if is_current() or not SOURCE.exists() else ["jupyterlab>=4,<5"]

    def initialize(self, version, build_data) -> None:
        if not SOURCE.exists():  # a wheel built from an sdist: the bundle came with it
            return
        if not is_current():
            self.app.display_info("building the JupyterLab extension (labextension/)")
            build()


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        current = is_current()
        print(f"{BUNDLE.relative_to(ROOT)}: {'current' if current else 'missing or older than labextension/'}")
        sys.exit(0 if current else 1)
    build()
