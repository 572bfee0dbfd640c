"""bench/gpu_notebook.py's goal lines: a lazy restore is judged against an eager one of the
same run, and says so when there is none (not "OVER")."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import gpu_notebook  # noqa: E402


def row(mode: str, click: float, ratio: float | None) -> dict:
    return {"gib": 8.0, "storage": "files", "mode": mode, "click_to_kernel_s": click,
            "full_vs_eager": ratio}  # fmt: skip


def test_a_lazy_restore_is_judged_against_the_eager_one_of_its_run():
    lines = gpu_notebook.restore_verdicts(
        [row("eager", 6.5, None), row("lazy", 1.4, 1.05), row("lazy", 2.4, 1.2)]
    )
    assert lines == [
        "8 GiB files lazy: click 1.40 s (goal <= 2 s) ok; full restore 1.05x eager (goal <= 1.1) ok",
        "8 GiB files lazy: click 2.40 s (goal <= 2 s) OVER; full restore 1.2x eager (goal <= 1.1) OVER",
    ]


def test_without_an_eager_restore_the_full_restore_is_not_compared():
    (line,) = gpu_notebook.restore_verdicts([row("lazy", 1.7, None)])
    assert line == (
        "8 GiB files lazy: click 1.70 s (goal <= 2 s) ok; full restore not compared (no eager "
        "restore of this size and storage in this run)"
    )


def test_logs_keeps_criu_s_restore_log_of_each_restore_and_the_lazy_ones_two_more(tmp_path):
    import asyncio
    import os

    folder, logs = tmp_path / "ckpt", tmp_path / "logs"
    folder.mkdir()
    (folder / "restore-20261126T100000Z.log").write_text("older restore\n")
    (folder / "restore-20261126T110000Z.log").write_text("eager restore\n")
    os.utime(folder / "restore-20261126T100000Z.log", (1, 1))  # the newest by time is kept
    asyncio.run(gpu_notebook.keep_logs(logs, folder, "1_files", "eager"))
    (folder / "restore-20261126T120000Z.log").write_text("lazy restore\n")
    os.utime(folder / "restore-20261126T110000Z.log", (2, 2))
    (folder / "lazy-pages.log").write_text("daemon\n")
    (folder / "page-server.log").write_text("page server\n")
    asyncio.run(gpu_notebook.keep_logs(logs, folder, "1_files", "lazy"))
    asyncio.run(gpu_notebook.keep_logs(logs, folder, "1_files", "lazy"))
    kept = {p.name: p.read_text() for p in logs.iterdir()}
    assert kept == {
        "1_files_1_eager_restore.log": "eager restore\n",
        **{f"1_files_{n}_lazy_restore.log": "lazy restore\n" for n in (1, 2)},
        **{f"1_files_{n}_lazy_lazy-pages.log": "daemon\n" for n in (1, 2)},
        **{f"1_files_{n}_lazy_page-server.log": "page server\n" for n in (1, 2)},
    }
