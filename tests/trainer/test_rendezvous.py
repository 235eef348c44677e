"""Process-group start-up across torchrun restarts (``hetpilot.trainer.rendezvous``).

The unit test replays what torchrun's shared agent store looks like in a
restarted round: the previous round's keys are still there. The end-to-end
test kills a rank of a real ``torchrun --max-restarts`` job mid-run and checks
that the restarted ranks resume from the checkpoint and end bit-for-bit where
an uninterrupted run ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from hetpilot.trainer.checkpoint import export_state_dict, resolve
from hetpilot.trainer.rendezvous import round_prefix


def _round(port: int, world: int, delays: list[float]) -> list[str]:
    """One round: rank r starts after delays[r] s, on its own client of the store."""
    prefixes: list[str] = [""] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            time.sleep(delays[r])
            client = dist.TCPStore("127.0.0.1", port, is_master=False,
                                   timeout=timedelta(seconds=20))
            prefixes[r] = round_prefix(client, r, world, timedelta(seconds=20), poll_s=0.005)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return prefixes


def test_round_prefix_is_fresh_and_shared_despite_old_keys() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=20))
    seen: set[str] = set()
    # rank 0 first; then the others first, so that they find the previous round's
    # answers waiting for them (and must not take them); then all at once
    for delays in ([0.0, 0.2, 0.3], [0.4, 0.0, 0.1], [0.0, 0.0, 0.0], [0.3, 0.0, 0.0]):
        prefixes = _round(server.port, 3, delays)
        assert len(set(prefixes)) == 1, prefixes
        assert prefixes[0] not in seen
        seen.add(prefixes[0])
    assert _round(server.port, 1, [0.0])[0] not in seen  # a single rank needs nobody


_WORKER = """
from datetime import timedelta
import torch, torch.distributed as dist
from hetpilot.trainer.rendezvous import init_process_group
init_process_group("gloo", timeout=timedelta(seconds=20))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("sum", t.item())
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_worker_rounds_on_one_agent_store_all_connect() -> None:
    """What torchrun does on restarts, without torchrun: one long-lived store (ours, as the
    agent's) and round after round of 2 fresh workers. Each round leaves its gloo peer
    addresses in the store (``default_pg/0//cpu//0/<rank>``); plain ``env://`` init then
    reads a dead round's address whenever the peer has not rewritten its key yet, and
    fails or hangs (seen in about every other round); the per-round prefix never does."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           multi_tenant=True, timeout=timedelta(seconds=20))
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(server.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    for n, delay in enumerate([0.0, 0.0, 0.5, 0.0, 0.0]):
        procs = []
        for rank in range(2):
            procs.append(subprocess.Popen([sys.executable, "-c", _WORKER],
                                          env={**env, "RANK": str(rank)}, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            time.sleep(delay)
        try:
            outs = [p.communicate(timeout=30) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for p, (out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0 and "sum 3.0" in out, f"round {n}: {err[-2000:]}"


# -- end to end: torchrun restarts after a SIGKILL --------------------------------------

PLAN = {  # 2-stage 1F1B pipeline over both ranks (4 iterations per epoch)
    "microbatch_size": 4, "schedule": "1f1b",
    "groups": [{"samples": 16, "stages": [{"device": "local:0", "layers": [0, 2]},
                                          {"device": "local:1", "layers": [2, 6]}]}],
}
EPOCHS = 6


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the workers torchrun's agent started), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _worker_rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _committed_step(ckpt: Path) -> int:
    where = resolve(ckpt)
    try:
        return int(json.loads((where / "meta.json").read_text())["step"]) if where else -1
    except (OSError, ValueError):  # pruned while we read: a newer one is there
        return -1


def _torchrun(out: Path, kills: list[tuple[int, int]]) -> tuple[int, str, int]:
    """Run the job; for each ``(step, rank)`` of ``kills`` in turn, SIGKILL that rank's
    worker once a commit at or past ``step`` exists (so it dies mid-epoch or mid-save,
    and each kill lands in a later round). Returns (rc, stderr, kills done)."""
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(PLAN))
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    ckpt = out / "ckpt"
    # --emulate-tflops paces each op (sleeps; the arithmetic is untouched): ~0.5 s an epoch
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--max-restarts", str(len(kills)), "--nproc-per-node", "2", "-m", "hetpilot", "train",
           "--model", "hetpilot.trainer.examples:mlp", "--plan", str(out / "plan.json"),
           "--epochs", str(EPOCHS), "--device-id", "local:{local_rank}",
           "--checkpoint", str(ckpt), "--resume", "--emulate-tflops", "1e-7"]
    done = 0
    with (out / "stderr.txt").open("w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 90  # about 25 s on two busy test workers
            while proc.poll() is None and time.monotonic() < deadline:
                if done < len(kills) and _committed_step(ckpt) >= kills[done][0]:
                    for pid in _children(proc.pid):
                        if _worker_rank(pid) == kills[done][1]:
                            os.kill(pid, signal.SIGKILL)
                            done += 1
                            break
                time.sleep(0.02)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return rc, (out / "stderr.txt").read_text(), done


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_torchrun_restart_resumes_from_checkpoint_exactly(tmp_path: Path) -> None:
    """The documented recipe (torchrun --max-restarts, --checkpoint --resume) without
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE: each killed rank costs a restart, not the job,
    and the result equals an uninterrupted run's exactly (float32; same plan, same
    data order, optimizer state restored: no arithmetic differs)."""
    kills = [(8, 1), (16, 0)]  # rank 1 in the first round, rank 0 in the second
    rc, stderr, done = _torchrun(tmp_path / "killed", kills)
    assert done == 2, f"the job ended after {done} kills:\n{stderr[-3000:]}"
    assert rc == 0, stderr[-3000:]
    assert stderr.count("exitcode: -9") == 2  # the agent saw both kills ...
    assert stderr.count("rank 1: EMULATED device speed") == 3  # ... and started 3 rounds
    rc, stderr, _ = _torchrun(tmp_path / "whole", [])
    assert rc == 0, stderr[-3000:]
    assert stderr.count("rank 1: EMULATED device speed") == 1
    got, want = export_state_dict(tmp_path / "killed" / "ckpt"), \
        export_state_dict(tmp_path / "whole" / "ckpt")
    assert got.keys() == want.keys() and len(got) == 12
    assert json.loads((resolve(tmp_path / "killed" / "ckpt") / "meta.json").read_text())[
        "epoch"] == EPOCHS
    for key, value in want.items():
        assert float((got[key] - value).abs().max()) <= 1e-9, key
