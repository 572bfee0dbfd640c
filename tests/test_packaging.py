"""What a wheel built from this tree ships: the license, the declared dependencies, and the Lab
extension built from the sources in labextension/ (hatch_build.py; docs/install.md, "The Lab
extension's bundle")."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAB_SHARE = "share/jupyter/labextensions/jupyterhub-gpusnap/"


def hook_module():
    spec = importlib.util.spec_from_file_location("hatch_build", ROOT / "hatch_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_bundle_in_the_tree_is_built_from_the_current_sources():
    """The bundle the Hub's JupyterLab loads is the one labextension/ builds today (.ci/setup
    and every pip install rebuild it; `.venv/bin/python hatch_build.py` by hand)."""
    hb = hook_module()
    stamp = hb.STAMP.read_text().split()[0]
    assert stamp == hb.inputs_digest(), (
        "jupyterhub_gpusnap/labextension was built from other sources than labextension/ holds "
        "now: run .venv/bin/python hatch_build.py"
    )
    pkg = json.loads((hb.BUNDLE / "package.json").read_text())
    load = pkg["jupyterlab"]["_build"]["load"]
    assert (hb.BUNDLE / load).is_file()


def test_the_digest_sees_a_changed_source(tmp_path):
    hb = hook_module()
    copy = tmp_path / "labextension"
    shutil.copytree(hb.SOURCE, copy, ignore=shutil.ignore_patterns("node_modules", "lib"))
    before = hb.inputs_digest(copy)
    assert before == hb.inputs_digest()
    src = sorted((copy / "src").rglob("*.ts"))[0]
    src.write_text(src.read_text() + "\n// changed\n")
    assert hb.inputs_digest(copy) != before


def test_the_built_bundle_is_not_committed():
    """A rebuild never leaves `git status` dirty: the bundle is ignored, not tracked."""
    if (ROOT / ".git").exists():
        tracked = subprocess.run(["git", "ls-files", "jupyterhub_gpusnap/labextension"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
        assert tracked == ""
        ignored = subprocess.run(["git", "check-ignore", "-q", "jupyterhub_gpusnap/labextension/package.json"],
                                 cwd=ROOT)
        assert ignored.returncode == 0
    else:  # an sdist: the bundle comes built, with the digest of the sources beside it
        assert hook_module().is_current()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                   check=True)
    (path,) = out.glob("jupyterhub_gpusnap-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_ships_the_lab_extension_as_built_from_the_sources(wheel):
    names = wheel.namelist()
    data = next(n.split(LAB_SHARE)[0] for n in names if LAB_SHARE in n)
    pkg = json.loads(wheel.read(data + LAB_SHARE + "package.json"))
    assert pkg["name"] == "jupyterhub-gpusnap"
    assert data + LAB_SHARE + pkg["jupyterlab"]["_build"]["load"] in names
    install = json.loads(wheel.read(data + LAB_SHARE + "install.json"))
    assert install["packageManager"] == "python"
    assert install["packageName"] == "jupyterhub-gpusnap"
    stamp = wheel.read(data + LAB_SHARE + "build-inputs.sha256").decode().split()[0]
    assert stamp == hook_module().inputs_digest()
    # the server extension's switch for jupyter_server
    assert data + "etc/jupyter/jupyter_server_config.d/jupyterhub_gpusnap.json" in names


def test_the_wheel_carries_the_license_and_declares_jupyter_server(wheel):
    names = wheel.namelist()
    license_name = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    text = wheel.read(license_name).decode()
    assert text.startswith("BSD 3-Clause License")
    assert "jupyterhub-gpusnap contributors" in text
    metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    # a runtime requirement, not only a test extra: the server extension imports it
    assert "Requires-Dist: jupyter-server>=2.10" in requires
    assert "License-Expression: BSD-3-Clause" in metadata
