"""bench/lazy_pages_log.py reads the daemon's pace from its log: the copy of each 4 MiB
background answer (until its next request) and the receiving of the next one."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import lazy_pages_log  # noqa: E402

LOG = """\
(00.500000) uffd: 7-14: #PF at 0x5000
(00.500010) uffd: 7-14: #PF at 0x5000: asking for 65536 bytes
(00.502010) uffd: 7-14: uffd_copy: 0x5000/65536
(01.000000) uffd: 7-14: background: 1024 pages at 0x1000000, up to 8 requests in flight
(01.001000) uffd: 7-14: uffd_copy: 0x1000000/4194304
(01.002500) uffd: 7-14: background: 1024 pages at 0x1400000, up to 8 requests in flight
(01.003000) uffd: 7-14: uffd_copy: 0x1400000/4194304
(01.004000) uffd: 7-14: background: 1024 pages at 0x1800000, up to 8 requests in flight
(01.010000) uffd: 7-14: uffd_copy: 0x1800000/4194304
(01.010100) uffd: 7-14: uffd_copy: 0x9000/8192
"""


def test_the_daemons_copy_and_receive_times(tmp_path):
    log = tmp_path / "lazy-pages.log"
    log.write_text(LOG)
    (row,) = lazy_pages_log.summarize(log)
    assert (row["pid"], row["faults"], row["wait_median_ms"]) == (7, 1, 2.0)
    assert row["background"] == 3 and row["copies_4mib"] == 2
    # copies: 1.001 -> 1.0025 and 1.003 -> 1.004 (the next request follows the copy)
    assert row["copy_ms"] == 1.0
    # receiving: 1.000 -> 1.001, 1.0025 -> 1.003, 1.004 -> 1.010 (lower median; 90th pct)
    assert row["receive_ms"] == 1.0 and row["receive_p90_ms"] == 1.0
    assert lazy_pages_log._ms([0.001, 0.002, 0.003, 0.004, 0.006], 0.9) == 4.0


COPIER_LOG = """\
(01.000000) uffd: 9-14: background: 1024 pages at 0x1000000, up to 8 requests in flight
(01.001000) uffd: 9-14: uffd_copy: 0x1000000/4194304 by a copier
(01.001100) uffd: 9-14: background: 1024 pages at 0x1400000, up to 8 requests in flight
(01.002000) uffd: 9-14: uffd_copy: 0x1400000/4194304 by a copier
(01.002500) uffd: 9-14: copier: 1024 of 1024 pages at 0x1000000 in 1400 us, errno 0
(01.003000) uffd: 9-14: copier: 1024 of 1024 pages at 0x1400000 in 1600 us, errno 0
(01.004000) uffd: 9-14: copier: 16 of 16 pages at 0x9000 in 30 us, errno 0
"""


def test_the_copiers_times(tmp_path):
    log = tmp_path / "lazy-pages.log"
    log.write_text(COPIER_LOG)
    (row,) = lazy_pages_log.summarize(log)
    # two 4 MiB copies (1.4 and 1.6 ms; lower median), not the 64 KiB one
    assert row["copier_copies"] == 2 and row["copier_ms"] == 1.4
    assert row["copier_p90_ms"] == 1.4
    # the hand-over (1.001 -> 1.0011) is the daemon's own copy time now
    assert row["copy_ms"] == 0.1
    # the copiers' last copy, not the last hand-over
    assert row["last_copy_s"] == 1.004


# the page server's log of the same restore (wall clock; the daemon started at 1000.0)
SERVER_LOG = """\
# read written kind process vaddr pages
1000.500100 1000.502000 fault 7 0x5000 16
1001.000200 1001.000700 background 7 0x1000000 1024
1001.003000 1001.003100 background 7 0x1400000 1024
1001.004500 1001.008000 background 7 0x1800000 1024
1001.009000 - background 7 0x1c00000 1024
"""


def test_both_sides_of_each_round_trip_from_the_page_servers_log_beside(tmp_path):
    log = tmp_path / "1_files_1_lazy-pages.log"
    log.write_text(LOG)
    (row,) = lazy_pages_log.summarize(log)
    assert "joined" not in row, "joined without the page server's log"
    (tmp_path / "1_files_1_page-server.log").write_text(SERVER_LOG)
    (row,) = lazy_pages_log.summarize(log)
    # three 4 MiB answers in both logs (the one never sent, and the fault, are not)
    assert row["joined"] == 3
    # the clocks are set by the quickest request (0.2 ms): the others took 0.3 ms more
    assert (row["to_server_ms"], row["to_server_p90_ms"]) == (0.3, 0.3)
    # read to written: 0.5, 0.1 and 3.5 ms
    assert (row["server_ms"], row["server_p90_ms"]) == (0.5, 0.5)
    # written to copied: 0.5, 0.1 and 2.2 ms
    assert row["to_daemon_ms"] == 0.5
    assert lazy_pages_log._server_log(log) == tmp_path / "1_files_1_page-server.log"


def test_the_table_has_the_round_trips_when_the_first_process_has_none(tmp_path, capsys):
    # process 1 (listed first) only faulted: no 4 MiB answers to join, so its row has
    # fewer columns than process 7's; the table must still show the round trips
    log = tmp_path / "1_files_1_lazy_lazy-pages.log"
    first = (
        "(00.400000) uffd: 1-11: #PF at 0x7000: asking for 4096 bytes\n"
        "(00.401000) uffd: 1-11: uffd_copy: 0x7000/4096\n"
    )
    log.write_text(first + LOG)
    (tmp_path / "1_files_1_lazy_page-server.log").write_text(SERVER_LOG)
    rows = lazy_pages_log.summarize(log)
    assert [r["pid"] for r in rows] == [1, 7] and "to_server_ms" not in rows[0]
    sys.argv = ["lazy_pages_log.py", str(log)]
    lazy_pages_log.main()
    header = capsys.readouterr().out.splitlines()[0].split()
    assert {"joined", "to_server_ms", "server_ms", "to_daemon_ms"} <= set(header)
