"""``jupyterhub-gpusnap doctor|keys|unpack``: traitlets subcommands of the service's command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jupyterhub_gpusnap.app import SUBCOMMANDS, GpuSnapCommand, main
from jupyterhub_gpusnap.doctor import DoctorApp
from jupyterhub_gpusnap.keys_cli import KeysApp
from jupyterhub_gpusnap.unpack_cli import UnpackApp


@pytest.fixture(autouse=True)
def fresh_instances():
    """A subcommand's Application is a traitlets singleton: one per test."""
    yield
    for cls in (GpuSnapCommand, DoctorApp, KeysApp, UnpackApp):
        cls.clear_instance()


def test_the_subcommands_are_traitlets_subcommands():
    assert set(GpuSnapCommand().subcommands) == {"doctor", "keys", "unpack"} == set(SUBCOMMANDS)
    command = GpuSnapCommand()
    command.parse_command_line(["keys", "--new", "k1"])
    assert isinstance(command.subapp, KeysApp) and command.subapp.new == "k1"
    KeysApp.clear_instance()
    command = GpuSnapCommand()
    command.parse_command_line(["unpack", "/a", "/b", "--key-file", "/k"])
    assert isinstance(command.subapp, UnpackApp)
    assert command.subapp.extra_args == ["/a", "/b"] and command.subapp.key_file == "/k"


def test_keys_new_through_the_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["keys", "--new", "2026-11"])
    assert exit_.value.code == 0
    kid, key = capsys.readouterr().out.split()
    assert kid == "2026-11" and len(key) == 44  # base64 of 32 bytes


def test_keys_lists_the_keys_in_use(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["keys", "--checkpoint-dir", str(tmp_path)])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.split() == ["key", "id", "checkpoints", "in", "key", "file"]


def test_unpack_without_its_folders_says_how_to_call_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["unpack"])
    assert exit_.value.code == 2
    assert "usage: jupyterhub-gpusnap unpack CHECKPOINT DEST" in capsys.readouterr().err


def test_unpack_refuses_a_folder_that_is_not_empty(capsys, tmp_path):
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "x").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["unpack", str(tmp_path / "checkpoint"), str(tmp_path / "dest")])
    assert exit_.value.code == 2
    assert f"error: {tmp_path / 'dest'} is not empty" in capsys.readouterr().err


def test_help_names_the_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "jupyterhub_gpusnap.app", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Subcommands" in out.stdout
    for name, (_, help_) in SUBCOMMANDS.items():
        assert f"\n{name}\n    {help_}" in out.stdout
    assert "--config=<Unicode>" in out.stdout  # the service's own options, as before
