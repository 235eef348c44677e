"""Storage faults are visible: SqliteStore on real SQLite files that fill up or are damaged."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hetpilot.daemon.errors import DamagedStore, StorageFull, StorageUnavailable
from hetpilot.daemon.records import AgentRecord, JobRecord, JobStatus, PlanRecord
from hetpilot.daemon.sqlite_store import SqliteStore

pytestmark = pytest.mark.timeout(30)

BIG = "x" * 1_000_000  # far more than a full database has room for


def _job(job_id: str) -> JobRecord:
    return JobRecord(job_id=job_id, owner="alice", name="n", state="running", global_batch=8,
                     microbatch_size=2, schedules=("1f1b",), budgets={"price_per_hour": 3.0},
                     V=10.0, slot_s=1.0, allowed_hosts=("a",), model_json="{}")


def _plan(job_id: str, version: int, plan: dict[str, object] | None = None) -> PlanRecord:
    return PlanRecord(job_id=job_id, version=version, slot=version, plan=plan or {"groups": []},
                      iteration_s=0.5, costs={}, queues={}, warnings=())


def _fill(store: SqliteStore) -> None:
    """A page quota at the pages in use: the next write that needs a page gets SQLITE_FULL."""
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count={pages}")


def _store_with_jobs(path: Path, n: int = 20) -> None:
    store = SqliteStore(path)
    for i in range(n):
        store.create_job(_job(f"j{i}"))
        store.record_slot(f"j{i}", status=JobStatus(slot=1), controller_state={"q": [i] * 50},
                          plan=_plan(f"j{i}", 1))
    store.close()  # checkpoints: every page is in the main file


def test_disk_full_raises_storage_full_and_recovers(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    seen: list[bool] = []
    store.on_writable_change = seen.append
    store.create_job(_job("j1"))
    store.record_slot("j1", status=JobStatus(slot=1), controller_state={"q": 1},
                      plan=_plan("j1", 1))
    _fill(store)

    with pytest.raises(StorageFull, match="full") as err:
        store.record_slot("j1", status=JobStatus(slot=2), controller_state={"big": BIG},
                          plan=_plan("j1", 2))
    assert "cannot rollback" not in str(err.value)
    assert isinstance(err.value.__cause__, sqlite3.OperationalError)
    assert not store.writable and seen == [False]
    with pytest.raises(StorageFull):  # a single-statement write, too
        store.put_agent(AgentRecord(host="a", probe_address=BIG, devices=()))
    with pytest.raises(StorageFull):
        store.create_job(_job("j2").with_changes(model_json=BIG))

    # reads still work, and nothing of the failed writes was committed
    assert store.job_status("j1") == (JobStatus(slot=1), {"q": 1})
    assert [p.version for p in store.plans("j1")] == [1]
    assert [j.job_id for j in store.list_jobs()] == ["j1"] and store.agents() == []
    assert not store.writable and seen == [False]

    store._db.execute("PRAGMA max_page_count=1073741823")  # room again
    assert store.probe() is True
    assert store.writable and seen == [False, True]
    store.record_slot("j1", status=JobStatus(slot=2), controller_state={"big": BIG},
                      plan=_plan("j1", 2))
    assert store.job_status("j1")[1] == {"big": BIG} and seen == [False, True]
    store.close()


@pytest.mark.parametrize("damage", ["pages", "index"])
def test_damaged_pages_are_refused_at_open(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "state.db"
    _store_with_jobs(path)
    data = bytearray(path.read_bytes())
    assert len(data) > 4 * 4096
    if damage == "pages":  # keep page 1 (header and schema), garbage over every page after it
        data[4096:] = random.Random(13).randbytes(len(data) - 4096)
    else:  # one index page claims 65535 cells: SQLite reads it, quick_check reports it
        db = sqlite3.connect(path)
        [(page,)] = db.execute("SELECT rootpage FROM sqlite_schema WHERE name=?",
                               ("sqlite_autoindex_jobs_1",)).fetchall()
        db.close()
        data[(page - 1) * 4096 + 3:(page - 1) * 4096 + 5] = b"\xff\xff"
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedStore) as err:
        SqliteStore(path)
    message = str(err.value)
    assert "\n" not in message and len(message) <= 300 + len(str(path))
    assert message.startswith(f"{path} is damaged (") and "restore a backup" in message
    if damage == "index":
        assert f"quick_check: *** in database main *** Page {page}:" in message


def test_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(random.Random(7).randbytes(8192))
    with pytest.raises(DamagedStore, match=r"is damaged .*not a database") as err:
        SqliteStore(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_zero_length_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.touch()
    with pytest.raises(DamagedStore, match="empty") as err:
        SqliteStore(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "remove it" in message
    assert path.stat().st_size == 0 and sorted(tmp_path.iterdir()) == [path]


def test_a_failing_body_rolls_back_and_raises_its_own_error(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    store.create_job(_job("j1"))
    store.record_slot("j1", status=JobStatus(slot=1), controller_state={"q": 1},
                      plan=_plan("j1", 1))
    # the status row is written, then the plan fails to serialise: a bug, not a fault
    with pytest.raises(TypeError):
        store.record_slot("j1", status=JobStatus(slot=2), controller_state={"q": 2},
                          plan=_plan("j1", 2, {"bad": object()}))
    # a constraint violation is the caller's error, not the storage's
    with pytest.raises(sqlite3.IntegrityError):
        store.record_slot("j1", status=JobStatus(slot=3), controller_state={"q": 3},
                          plan=_plan("j1", 1))
    with pytest.raises(KeyError):
        store.update_job(_job("missing"))
    assert store.job_status("j1") == (JobStatus(slot=1), {"q": 1})
    assert [p.version for p in store.plans("j1")] == [1]
    assert store.writable and not store._db.in_transaction
    store.record_slot("j1", status=JobStatus(slot=2), controller_state={"q": 2})
    assert store.job_status("j1") == (JobStatus(slot=2), {"q": 2})
    store.close()


@pytest.mark.parametrize("fault", ["delete", "replace", "truncate", "overwrite"])
def test_a_file_lost_while_open_refuses_writes(tmp_path: Path, fault: str) -> None:
    """SQLite keeps answering from its cache and WAL after the file under it is gone or
    damaged, so writes would be acknowledged and then lost. The store checks the file
    before each write: the write is refused (StorageUnavailable naming the file),
    ``writable`` clears and no probe brings it back. The next start sees what the WAL
    and the file still hold: the acknowledged job, or a refusal, or (deleted) nothing;
    never the refused write."""
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    seen: list[bool] = []
    store.on_writable_change = seen.append
    store.create_job(_job("j1"))
    if fault == "delete":
        path.unlink()
    elif fault == "replace":
        (tmp_path / "other").write_bytes(b"not ours" * 100)
        (tmp_path / "other").replace(path)
    elif fault == "truncate":
        with path.open("r+b") as f:
            f.truncate(0)
    else:
        with path.open("r+b") as f:
            f.write(b"\0" * 4096)
    with pytest.raises(StorageUnavailable, match=str(path)) as err:
        store.create_job(_job("j2"))
    assert "while the daemon ran" in str(err.value)
    assert not store.writable and seen == [False]
    assert store.probe() is False and not store.writable
    assert store.get_job("j1") is not None  # reads: what it holds, from its cache
    store.close()
    try:
        again = SqliteStore(path)
    except DamagedStore:
        return
    assert [j.job_id for j in again.list_jobs()] == ([] if fault == "delete" else ["j1"])
    again.close()


def test_a_healthy_file_is_written_as_before(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    for i in range(5):
        store.create_job(_job(f"j{i}"))
    assert store.writable and store.probe()
    store.close()
    reopened = SqliteStore(tmp_path / "state.db")
    assert len(reopened.list_jobs()) == 5
    reopened.close()


def test_a_truncation_that_keeps_the_header_refuses_writes(tmp_path: Path) -> None:
    """Cut to half its size, the file still starts with the SQLite header but is shorter
    than the page count in it: the next write is refused, not acknowledged into a WAL
    whose database is gone (the fault campaign's 'truncated to half' went undetected)."""
    path = tmp_path / "state.db"
    _store_with_jobs(path)
    store = SqliteStore(path)
    store.create_job(_job("before"))
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(StorageUnavailable, match="was truncated while the daemon ran"):
        store.create_job(_job("after"))
    assert not store.writable
    store.close()


@pytest.mark.parametrize("fault", ["truncate", "overwrite", "replace"])
def test_no_checkpoint_into_a_lost_file_at_stop_or_next_start(tmp_path: Path, fault: str) -> None:
    """Stopping with the file lost writes nothing into what is at the path now (SQLite's
    own close would checkpoint its WAL into a file damaged in place), and the WAL, which
    holds the last writes, stays where it is, as it was: a marker beside it makes the next
    start refuse the pair (rather than read that WAL as the WAL of that file) and say how
    to go on, leaving both as they were."""
    path = tmp_path / "state.db"
    _store_with_jobs(path)
    store = SqliteStore(path)
    for i in range(5):  # pages in the WAL only
        store.create_job(_job(f"w{i}"))
    if fault == "truncate":
        with path.open("r+b") as f:
            f.truncate(0)
    elif fault == "overwrite":
        with path.open("r+b") as f:
            f.write(random.Random(3).randbytes(path.stat().st_size))
    else:
        (tmp_path / "other").write_bytes(random.Random(4).randbytes(path.stat().st_size))
        (tmp_path / "other").replace(path)
    damaged = path.read_bytes()
    with pytest.raises(StorageUnavailable):
        store.create_job(_job("refused"))
    wal = (tmp_path / "state.db-wal").read_bytes()
    assert len(wal) > 0
    store.close()
    assert path.read_bytes() == damaged
    assert (tmp_path / "state.db-wal").read_bytes() == wal  # never moved aside
    assert not list(tmp_path.glob("*-wal.lost"))
    assert "was" in (tmp_path / "state.db.lost").read_text()
    # the next start, as the daemon's: its own process (this one keeps the lost connection)
    code = ("import sys\nfrom hetpilot.daemon.errors import DamagedStore\n"
            "from hetpilot.daemon.sqlite_store import SqliteStore\n"
            "try:\n    SqliteStore(sys.argv[1])\nexcept DamagedStore as e:\n"
            "    print(e)\n    sys.exit(3)\n")
    run = subprocess.run([sys.executable, "-c", code, str(path)], timeout=60,
                         capture_output=True, text=True)
    assert run.returncode == 3 and "was lost while a daemon ran" in run.stdout
    assert "state.db.lost" in run.stdout
    assert path.read_bytes() == damaged
    assert (tmp_path / "state.db-wal").read_bytes() == wal
