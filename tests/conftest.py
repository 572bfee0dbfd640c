"""Shared fixtures: a real JupyterHub (see helpers/realhub.py) and helpers for real process trees.

``hub_factory`` starts hubs from a config text and stops every one of them (servers
included) at teardown; ``hub`` is one hub with the harness defaults (simple spawner).
"""

from __future__ import annotations

import os
import pwd
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.process_tree import ProcessTree
from tests.helpers.realhub import RealHub


@pytest.fixture
async def hub_factory(tmp_path):
    """Start real hubs: ``hub = await hub_factory(config_text, **RealHub kwargs)``.

    Each hub lives in its own folder under ``tmp_path``; all are stopped at teardown.
    """
    hubs: list[RealHub] = []

    async def make(config: str = "", **kwargs) -> RealHub:
        hub = RealHub(tmp_path / f"hub{len(hubs)}", config, **kwargs)
        hubs.append(hub)
        await hub.start()
        return hub

    yield make
    for hub in reversed(hubs):
        await hub.stop()


@pytest.fixture
async def hub(hub_factory) -> RealHub:
    """A running real hub with the harness defaults (simple spawner, dummy auth)."""
    return await hub_factory()


# ---------------------------------------------------------------- real process trees for CRIU


@pytest.fixture
def sleepers():
    """Factory: ``pids = sleepers(n)`` — real processes standing in for servers' kernels
    (fake drivers check they live); all killed at teardown."""
    started: list[subprocess.Popen] = []

    def make(n: int) -> list[int]:
        new = [subprocess.Popen(["sleep", "300"]) for _ in range(n)]
        started.extend(new)
        return [p.pid for p in new]

    yield make
    for p in started:
        p.kill()
        p.wait()


@pytest.fixture
def process_tree(tmp_path):
    """Factory: ``tree = process_tree(pidns=False, unix_peer=None, program=TREE_PROGRAM)``;
    all killed at teardown."""
    trees: list[ProcessTree] = []

    def make(**kwargs) -> ProcessTree:
        tree = ProcessTree(tmp_path / f"tree{len(trees)}", **kwargs)
        trees.append(tree)
        return tree

    yield make
    for tree in trees:
        tree.kill()


# ---------------------------------------------------------------- real Unix users

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def traversable():
    """Let other users reach the Hub's Python and this checkout (o+x on the folders above
    them, as an install under /opt would have): a clone under /root is 0700. Put back after."""
    changed: list[tuple[Path, int]] = []
    for target in (Path(sys.executable).resolve(), Path(sys.executable).parent, REPO):
        for folder in [target, *target.parents] if target.is_dir() else target.parents:
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH:
                changed.append((folder, mode))
                os.chmod(folder, stat.S_IMODE(mode) | stat.S_IXOTH)
    yield
    for folder, mode in reversed(changed):
        os.chmod(folder, stat.S_IMODE(mode))


@pytest.fixture
def system_users():
    """``make()`` adds a real Unix user (useradd -m); all of them and their processes go at teardown."""
    made: list[str] = []

    def make() -> pwd.struct_passwd:
        name = f"gsu{secrets.token_hex(3)}"
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
        made.append(name)
        return pwd.getpwnam(name)

    yield make
    for name in made:
        subprocess.run(["pkill", "-KILL", "-u", name], check=False)
        subprocess.run(["userdel", "-r", "-f", name], check=False, capture_output=True)
