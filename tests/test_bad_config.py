"""Bad settings stop the service at start-up with one line that names the setting and the fix.

Each case runs the real ``python -m jupyterhub_gpusnap.app --config FILE`` as a subprocess and
expects a non-zero exit before it ever contacts the Hub (the Hub URL points at a closed port,
so a service that wrongly starts would loop on "Listing servers failed" until the timeout).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.realhub import free_port

#: (case id, config lines, words every failure line must contain)
CASES = [
    (
        "rule-duration-as-text",
        'c.GpuSnap.rules = [{"name": "students", "idle_window": "1h"}]',
        ["GpuSnap.rules", "'students'", "idle_window", "3600"],
    ),
    (
        "rule-unknown-key",
        'c.GpuSnap.rules = [{"name": "students", "idle_windw": 600}]',
        ["GpuSnap.rules", "'students'", "idle_windw", "did you mean 'idle_window'"],
    ),
    (
        "rule-duplicate-names",
        'c.GpuSnap.rules = [{"name": "a", "users": ["x"]}, {"name": "a", "users": ["y"]}]',
        ["GpuSnap.rules", "unique", "rename"],
    ),
    (
        "action-kill",
        'c.GpuSnap.action = "kill"',
        ["GpuSnap.action", "'suspend', 'stop' or 'none'", "'kill'"],
    ),
    (
        "park-window-not-below-idle-window",
        "c.GpuSnap.idle_window = 600\nc.GpuSnap.park_window = 600",
        ["GpuSnap", "park_window", "idle_window", "lower park_window"],
    ),
    (
        "interval-zero",
        "c.GpuSnap.interval = 0",
        ["GpuSnap.interval", "> 0"],
    ),
    (
        "interval-not-a-number",
        'c.GpuSnap.interval = "often"',
        ["interval", "float", "'often'"],
    ),
    (
        "db-url-unparsable",
        'c.GpuSnap.db_url = "gpusnap.sqlite"',
        ["GpuSnap.db_url", "'gpusnap.sqlite'", "sqlite:////"],
    ),
    (
        "db-url-folder-missing",
        'c.GpuSnap.db_url = "sqlite:////nonexistent-gpusnap-dir/sub/gpusnap.sqlite"',
        ["GpuSnap.db_url", "/nonexistent-gpusnap-dir/sub", "does not exist"],
    ),
    (
        "encryption-without-chunks",
        'c.GpuSnap.action = "suspend"\nc.LocalBackend.encryption_key_file = "/etc/gpusnap-keys"',
        ["LocalBackend.encryption_key_file", "LocalBackend.storage = 'chunks'"],
    ),
    (
        "encryption-key-file-missing",
        'c.GpuSnap.action = "suspend"\nc.LocalBackend.storage = "chunks"\n'
        'c.LocalBackend.encryption_key_file = "/nonexistent/keys"',
        ["/nonexistent/keys", "keys --new", "chmod 600"],
    ),
    (
        "criu-too-quiet-to-verify",
        'c.GpuSnap.action = "suspend"\nc.LocalBackend.dump_extra_args = ["-v2"]',
        ["LocalBackend.dump_extra_args", "'-v2'", "Dumping finished successfully", "-v3"],
    ),
    (
        "config-file-does-not-run",
        "c.GpuSnap.interval = (",
        ["config file", "SyntaxError"],
    ),
]


def run_service(
    tmp_path: Path, config: str | None, env_token: bool = True, extra_args=()
) -> tuple[int, str]:
    """Run the service with ``config`` as its file; return (exit status, output)."""
    cfg = tmp_path / "gpusnap_config.py"
    if config is not None:
        cfg.write_text(
            "c = get_config()  # noqa\n"
            f"c.GpuSnap.db_url = 'sqlite:///{tmp_path / 'gpusnap.sqlite'}'\n"
            "c.GpuSnap.action = 'stop'\n"  # no checkpoint backend needed to start
            f"{config}\n"
        )
    env = dict(os.environ)
    env.pop("JUPYTERHUB_API_TOKEN", None)
    closed = free_port()
    env.update(
        JUPYTERHUB_API_URL=f"http://127.0.0.1:{closed}/hub/api",
        JUPYTERHUB_SERVICE_URL=f"http://127.0.0.1:{free_port()}",
        PYTHONUNBUFFERED="1",
    )
    if env_token:
        env["JUPYTERHUB_API_TOKEN"] = "0123456789abcdef"
    proc = subprocess.run(
        [sys.executable, "-m", "jupyterhub_gpusnap.app", "--config", str(cfg), *extra_args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr


def assert_one_line_failure(code: int, output: str, words: list[str]) -> None:
    assert code != 0, f"the service accepted the bad setting:\n{output}"
    assert "Traceback" not in output, f"a traceback instead of a message:\n{output}"
    lines = [line for line in output.splitlines() if all(w in line for w in words)]
    assert lines, f"no line names {words}:\n{output}"
    assert "Listing servers" not in output, f"the service started before failing:\n{output}"


@pytest.mark.parametrize("config,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_setting_fails_at_start_up(tmp_path, config, words):
    code, output = run_service(tmp_path, config)
    assert_one_line_failure(code, output, words)


def test_missing_hub_token_names_the_variable(tmp_path):
    code, output = run_service(tmp_path, "", env_token=False)
    assert_one_line_failure(code, output, ["JUPYTERHUB_API_TOKEN", "api_token"])


def test_missing_config_file_is_an_error(tmp_path):
    # --config names a file that is not there: not a silent start with every default
    code, output = run_service(tmp_path, None)
    assert_one_line_failure(
        code, output, ["GpuSnap.config_file", "does not exist", "--generate-config"]
    )


def test_bad_value_on_the_command_line(tmp_path):
    code, output = run_service(tmp_path, "", extra_args=["--GpuSnap.action=kill"])
    assert_one_line_failure(code, output, ["GpuSnap.action", "'kill'"])


def test_a_good_config_passes_these_checks(tmp_path):
    """The same harness with valid settings gets past start-up (so the failures above are the settings')."""
    cfg = (
        'c.GpuSnap.rules = [{"name": "students", "idle_window": 3600, "park_window": 600}]\n'
        "c.GpuSnap.interval = 0.2\n"
    )
    (tmp_path / "gpusnap_config.py").write_text(
        "c = get_config()  # noqa\n"
        f"c.GpuSnap.db_url = 'sqlite:///{tmp_path / 'gpusnap.sqlite'}'\nc.GpuSnap.action = 'stop'\n"
        + cfg
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterhub_gpusnap.app",
            "--config",
            str(tmp_path / "gpusnap_config.py"),
        ],
        cwd=tmp_path,
        env={
            **os.environ,
            "JUPYTERHUB_API_TOKEN": "0123456789abcdef",
            "JUPYTERHUB_API_URL": f"http://127.0.0.1:{free_port()}/hub/api",
            "JUPYTERHUB_SERVICE_URL": f"http://127.0.0.1:{free_port()}",
            "PYTHONUNBUFFERED": "1",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # it runs its loop and reports the unreachable Hub instead of exiting
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "Listing servers failed" in line:
                break
        assert any("Listing servers failed" in line for line in seen), "".join(seen)
        assert proc.poll() is None, "".join(seen)
    finally:
        proc.kill()
        proc.wait()
