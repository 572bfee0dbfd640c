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
        tracked = subprocess.run(
            ["git", "ls-files", "jupyterhub_gpusnap/labextension"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert tracked == ""
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", "jupyterhub_gpusnap/labextension/package.json"], cwd=ROOT
        )
        assert ignored.returncode == 0
    else:  # an sdist: the bundle comes built, with the digest of the sources beside it
        assert hook_module().is_current()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
    )
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


# -- the notebook image: the base package without the Hub side (docs/notebook-image.md) --------

#: What only the Hub side (service, spawners, storage, email) needs: the "hub" extra, never the
#: base package that goes into every single-user image.
HUB_SIDE = ["jupyterhub", "sqlalchemy", "zstandard", "cryptography", "aiosmtplib", "kubespawner"]
HUB_SIDE_DISTS = {
    "jupyterhub",
    "sqlalchemy",
    "zstandard",
    "cryptography",
    "aiosmtplib",
    "jupyterhub-kubespawner",
    "kubernetes",
    "kubernetes-asyncio",
}


def _name(text: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(text)


def wheel_requirements(wheel: zipfile.ZipFile):
    """(base requirements, {extra: requirements}) from the wheel's METADATA."""
    from packaging.requirements import Requirement

    metadata = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")))
    base, extras = [], {}
    for line in metadata.decode().splitlines():
        if line.startswith("Provides-Extra:"):
            extras.setdefault(line.split(":", 1)[1].strip(), [])
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None:
            base.append(req)
            continue
        for extra in extras:
            if req.marker.evaluate({"extra": extra}):
                extras[extra].append(req)
    return base, extras


def installed_closure(requirements) -> dict:
    """The installed distributions (of this test environment) that ``requirements`` pull in,
    following each one's own requirements and extras: what pip would install for them."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    found: dict = {}
    todo = [(req, "the base package") for req in requirements]
    done: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        req, why = todo.pop()
        key = (_name(req.name), tuple(sorted(req.extras)))
        if key in done:
            continue
        done.add(key)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            raise AssertionError(f"{req} (needed by {why}) is not installed here") from None
        found[_name(req.name)] = dist
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is not None and not any(
                sub.marker.evaluate({"extra": e}) for e in (*req.extras, "")
            ):
                continue
            todo.append((sub, req.name))
    return found


def test_the_base_package_leaves_the_hub_side_to_the_hub_extra(wheel):
    """``pip install jupyterhub-gpusnap`` (a notebook image) pulls no Hub-side dependency; the
    ``hub`` extra has them all, and the ``test``/``demo``/``kubernetes`` extras pull ``hub``
    (so ``.ci/setup``'s ``-e .[test]`` and ``.[demo]`` install what they always did)."""
    base, extras = wheel_requirements(wheel)
    assert {_name(r.name) for r in base} == {
        "jupyter-server",
        "tornado",
        "traitlets",
        "psutil",
        "nvidia-ml-py",
    }
    pulled = set(installed_closure(base))
    assert not pulled & HUB_SIDE_DISTS, sorted(pulled & HUB_SIDE_DISTS)
    hub = {_name(r.name) for r in extras["hub"]}
    assert {"jupyterhub", "sqlalchemy", "zstandard", "cryptography", "aiosmtplib"} <= hub
    for extra in ("test", "demo", "kubernetes"):
        # hatchling writes a self-reference (jupyterhub-gpusnap[hub]) out as the hub extra's list
        assert hub <= {_name(r.name) for r in extras[extra]}, extra
    everything = [r for reqs in (base, *extras.values()) for r in reqs]
    # the kubernetes client: nothing imports it (kubespawner brings kubernetes_asyncio)
    assert "kubernetes" not in {_name(r.name) for r in everything}


@pytest.fixture(scope="module")
def light_venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed without its Hub side: ``pip install --no-deps
    --no-index`` of the wheel, and of its base requirements only what they pull in, offline:
    the distributions installed here, linked into a folder the venv reads (a ``.pth``)."""
    root = tmp_path_factory.mktemp("light")
    base, _ = wheel_requirements(wheel)
    site = root / "deps"
    site.mkdir()
    for dist in installed_closure(base).values():
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "light-deps.pth").write_text(str(site) + "\n")
    wheel_path = Path(wheel.filename)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel_path),
        ],
        check=True,
    )
    return venv


def light_env(root: Path) -> dict:
    """A clean environment: nothing of this checkout or of the test venv on the paths."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(root),
        "JUPYTER_CONFIG_DIR": str(root / "jupyter-config"),
        "JUPYTER_DATA_DIR": str(root / "jupyter-data"),
        "JUPYTER_RUNTIME_DIR": str(root / "jupyter-runtime"),
        "LANG": "C.UTF-8",
    }


def test_the_notebook_side_imports_without_the_hub_side(light_venv):
    """In the light venv the server extension and the node agent import; the Hub side's
    dependencies are absent, and the service says which extra it needs."""
    script = (
        "import importlib, importlib.util, json\n"
        f"absent = [m for m in {HUB_SIDE!r} if importlib.util.find_spec(m) is None]\n"
        "import jupyterhub_gpusnap.serverext, jupyterhub_gpusnap.gpu.autounpark\n"
        "import jupyterhub_gpusnap.agent.app\n"
        "try:\n"
        "    importlib.import_module('jupyterhub_gpusnap.app')\n"
        "    service = ''\n"
        "except ImportError as e:\n"
        "    service = e.name\n"
        "print(json.dumps({'absent': absent, 'service': service,\n"
        "                  'file': jupyterhub_gpusnap.serverext.__file__}))\n"
    )
    root = light_venv.parent
    out = subprocess.run(
        [light_venv / "bin" / "python", "-c", script],
        capture_output=True,
        text=True,
        cwd=root,
        env=light_env(root),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["absent"] == HUB_SIDE
    assert result["service"] in HUB_SIDE  # the service needs the hub extra
    # the installed wheel, not this checkout
    assert result["file"].startswith(str(light_venv))
    # the service's command says what to install instead of a traceback
    out = subprocess.run(
        [light_venv / "bin" / "jupyterhub-gpusnap", "--help"],
        capture_output=True,
        text=True,
        cwd=root,
        env=light_env(root),
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "pip install 'jupyterhub-gpusnap[hub]'" in out.stderr
    assert "docs/notebook-image.md" in out.stderr


def test_the_server_extension_loads_in_a_server_without_the_hub_side(light_venv):
    """A real jupyter_server from the light venv: the wheel's config enables the extension,
    its handlers answer, and the Lab extension is where JupyterLab looks for it."""
    import socket
    import time
    import urllib.error
    import urllib.request

    root = light_venv.parent
    no_hub = f"import importlib.util as u; assert not [m for m in {HUB_SIDE!r} if u.find_spec(m)]"
    check = subprocess.run(
        [light_venv / "bin" / "python", "-c", no_hub],
        cwd=root,
        env=light_env(root),
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr  # the server below runs without the Hub side
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "light-test-token"
    log = open(root / "server.log", "wb")
    server = subprocess.Popen(
        [
            light_venv / "bin" / "python",
            "-m",
            "jupyter_server",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.open_browser=False",
            "--ServerApp.allow_root=True",
        ],
        cwd=root,
        env=light_env(root),
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def get(path: str) -> tuple[int, dict]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"token {token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, (root / "server.log").read_text()
            try:
                if get("/api/status")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (root / "server.log").read_text()
            time.sleep(0.2)
        code, status = get("/gpusnap/status")
        assert code == 404 and "not running under JupyterHub" in status["message"], status
        code, local = get("/gpusnap/autounpark")
        assert code == 200 and local["resuming"] is False
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    text = (root / "server.log").read_text()
    assert "jupyterhub_gpusnap.serverext | extension was successfully loaded" in text, text
    lab = light_venv / LAB_SHARE / "package.json"
    assert json.loads(lab.read_text())["name"] == "jupyterhub-gpusnap"
