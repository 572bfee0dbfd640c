"""file_pages: where in their files lie the pages a process wrote in its private file
mappings, from a CRIU image, and reading them ahead (LocalBackend.file_pages_ahead)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jupyterhub_gpusnap.checkpoint import file_pages
from jupyterhub_gpusnap.checkpoint.file_pages import (
    Area,
    read_ahead,
    read_ahead_image,
    read_areas,
    read_files,
    written_file_ranges,
)
from jupyterhub_gpusnap.checkpoint.pagemap import PAGE, PE_LAZY, PE_PRESENT, read_pagemaps
from jupyterhub_gpusnap.checkpoint.protobuf import varint


# ------------------------------------------------------------ a CRIU image, written by hand
def field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, bytes):
        return varint(number << 3 | 2) + varint(len(value)) + value
    return varint(number << 3) + varint(value)


def image_file(path: Path, records: list[bytes]) -> None:
    path.write_bytes(b"\0" * 8 + b"".join(struct.pack("<I", len(r)) + r for r in records))


def vma(start: int, end: int, pgoff: int, shmid: int, status: int) -> bytes:
    return b"".join(field(n, v) for n, v in [(1, start), (2, end), (3, pgoff), (4, shmid),
                                              (5, 3), (6, 2), (7, status), (8, 1)])  # fmt: skip


def reg_file(fid: int, name: str) -> bytes:
    reg = field(1, fid) + field(2, 0) + field(3, 0) + field(5, b"") + field(6, name.encode())
    return field(1, 1) + field(2, fid) + field(3, reg)


def pagemap(path: Path, runs: list[tuple[int, int, int]]) -> None:
    """pagemap-<pid>.img: (vaddr, pages, flags) records after the head (pages_id 1)."""
    image_file(path, [field(1, 1)] + [field(1, a) + field(2, n) + field(4, f) for a, n, f in runs])


PRIVATE = file_pages.VMA_FILE_PRIVATE | 1  # VMA_AREA_REGULAR | VMA_FILE_PRIVATE
ANON = (1 << 9) | 1  # VMA_ANON_PRIVATE


@pytest.fixture
def image(tmp_path):
    """An image of process 7 mapping lib.so privately twice (from offsets 0 and 0x5000), the
    second area right after the first, plus an anonymous area; and 9 mapping a file that
    is gone."""
    lib = tmp_path / "lib.so"
    lib.write_bytes(os.urandom(16 * PAGE))
    image_file(
        tmp_path / "files.img", [reg_file(3, str(lib)), reg_file(4, str(tmp_path / "gone.so"))]
    )
    image_file(tmp_path / "mm-7.img", [b"".join(field(14, v) for v in [
        vma(0x10000, 0x13000, 0, 3, PRIVATE),
        vma(0x13000, 0x16000, 0x5000, 3, PRIVATE),
        vma(0x20000, 0x30000, 0, 0, ANON),
    ])])  # fmt: skip
    image_file(tmp_path / "mm-9.img", [field(14, vma(0x10000, 0x11000, 0, 4, PRIVATE))])
    pagemap(tmp_path / "pagemap-7.img", [
        (0x11000, 3, PE_PRESENT),  # 0x11000-0x13000 in the first area, 0x13000 in the second
        (0x15000, 1, PE_PRESENT),  # the second area's last page
        (0x20000, 4, PE_PRESENT | PE_LAZY),  # anonymous: never a file's
    ])  # fmt: skip
    pagemap(tmp_path / "pagemap-9.img", [(0x10000, 1, PE_PRESENT)])
    return tmp_path


def test_the_written_pages_of_private_file_mappings_are_placed_in_their_files(image):
    assert read_files(image) == {3: str(image / "lib.so"), 4: str(image / "gone.so")}
    assert read_areas(image / "mm-7.img") == [Area(0x10000, 0x13000, 0, 3),
                                              Area(0x13000, 0x16000, 0x5000, 3)]  # fmt: skip
    ranges = written_file_ranges(image, read_pagemaps(image))
    # 0x11000-0x13000 -> file 0x1000-0x3000; 0x13000 -> 0x5000; 0x15000 -> 0x7000
    assert ranges[str(image / "lib.so")] == [(0x1000, 0x2000), (0x5000, 0x1000), (0x7000, 0x1000)]
    assert ranges[str(image / "gone.so")] == [(0, PAGE)]
    assert len(ranges) == 2  # nothing of the anonymous area


def test_reading_ahead_skips_missing_and_non_regular_files_without_blocking(image, tmp_path):
    lib = str(image / "lib.so")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading would block without O_NONBLOCK
    done = []
    t = threading.Thread(target=lambda: done.append(read_ahead({
        lib: [(0x1000, 0x2000)], str(image / "gone.so"): [(0, PAGE)], str(fifo): [(0, PAGE)],
    })), daemon=True)  # fmt: skip
    t.start()
    t.join(10)
    assert done == [0x2000]
    assert read_ahead_image(image) == 3 * PAGE + PAGE  # lib.so's four pages; gone.so skipped


def test_an_image_it_cannot_read_gives_nothing(image):
    (image / "files.img").write_bytes(b"\0" * 8 + struct.pack("<I", 40) + b"\xff" * 3)
    assert written_file_ranges(image, read_pagemaps(image)) == {}
    (image / "mm-7.img").unlink()
    (image / "files.img").unlink()
    assert read_ahead_image(image) == 0
    (image / "pagemap-7.img").write_bytes(b"short")
    assert read_ahead_image(image) == 0  # a damaged pagemap: the restore says so, not this


# ------------------------------------------------------------ a real process, dumped by CRIU
@pytest.mark.criu
def test_a_real_python_process_has_written_pages_in_its_libraries(tmp_path):
    criu = shutil.which("criu")
    assert criu, "criu is not installed (.ci/install-criu.sh)"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import ctypes, time; print('up', flush=True); time.sleep(120)"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline() == b"up\n"
        images = tmp_path / "img"
        images.mkdir()
        done = subprocess.run(
            [criu, "dump", "-t", str(proc.pid), "-D", str(images), "-o", "dump.log",
             "--leave-running", "--shell-job"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (images / "dump.log").read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    ranges = written_file_ranges(images, read_pagemaps(images))
    names = {Path(n).name for n in ranges}
    # the interpreter (or its shared library) and the C library: written data, relocations
    assert any(n.startswith(("python", "libpython")) for n in names), names
    assert any(n.startswith("libc.so") for n in names), names
    for name, spans in ranges.items():  # a mapping may reach past the file's end (.bss)
        size = os.path.getsize(name)
        assert all(off % PAGE == 0 and n % PAGE == 0 and off < size for off, n in spans), spans
    t = time.monotonic()
    assert read_ahead_image(images) == sum(n for spans in ranges.values() for _, n in spans)
    assert time.monotonic() - t < 30
