"""A small job's slots while two large jobs plan: the planning lanes (daemon/planner_process.py).

    .venv/bin/python bench/daemon_lanes.py            # about 70 s on a 2-core VM

A real ``hetpilot daemon`` subprocess, 4 EMULATED hosts of 8 devices reporting every
0.3 s, and one small job (the example model, slot 0.5 s). The bench counts the small
job's slots per second alone (10 s), then while two jobs at the documented limits plan
beside it (1024 layers each, 16384 microbatches, slot 0.05 s: about 35 s or more per
solve; 40 s), and prints both with the large jobs' slots. With one planning process
the small job made no slot at all in those 40 s (the daemon fuzz campaign of
2026-11-24); with the heavy lane it keeps its rate.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import grpc
from hetpilot.v1 import job_pb2, job_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, Daemon, EmulatedAgents, metadata, submit_request, write_config

OWNER_TOKEN, CLUSTER_TOKEN = "bench-owner-token-1", "bench-cluster-token-2"


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="hetpilot-lanes-"))
    config = write_config(tmp / "daemon.toml", cluster_token=CLUSTER_TOKEN,
                          owner_tokens={"bench": OWNER_TOKEN}, report_interval_s=0.3,
                          heartbeat_timeout_s=3.0)
    daemon = Daemon(tmp / "state", config, log=tmp / "daemon.log", metrics=False)
    address = daemon.start()
    agents = EmulatedAgents(address, CLUSTER_TOKEN, [f"h{i}" for i in range(4)], devices=8,
                            interval=0.3).start()
    stub = job_pb2_grpc.JobServiceStub(grpc.insecure_channel(address))
    md = metadata(OWNER_TOKEN)

    def slot(job_id: str) -> int:
        return int(stub.GetJob(job_pb2.GetJobRequest(job_id=job_id), metadata=md,
                               timeout=10).slot)

    def rate(job_id: str, seconds: float) -> float:
        s0, t0 = slot(job_id), time.monotonic()
        time.sleep(seconds)
        return (slot(job_id) - s0) / (time.monotonic() - t0)

    try:
        small = stub.SubmitJob(submit_request(name="small", slot_s=0.5), metadata=md,
                               timeout=30).job_id
        deadline = time.monotonic() + 120  # planning process up, caches warm
        while slot(small) < 5 and time.monotonic() < deadline:
            time.sleep(0.5)
        alone = rate(small, 10)
        base = json.loads((ROOT / "examples" / "model.json").read_text())
        big_model = json.dumps({**base, "layers": [dict(base["layers"][1], name=f"l{i}")
                                                   for i in range(1024)]})
        bigs = [stub.SubmitJob(submit_request(name=f"big{i}", model_json=big_model,
                                              global_batch=16384, microbatch_size=1,
                                              slot_s=0.05), metadata=md, timeout=30).job_id
                for i in range(2)]
        beside = rate(small, 40)
        print("EMULATED devices (4 hosts x 8, CPU only); the small job's slots per second:")
        print(f"  alone: {alone:.2f}")
        print(f"  beside two 1024-layer jobs of 16384 microbatches: {beside:.2f} "
              f"({beside / alone:.0%} of alone); the large jobs' slots after 40 s: "
              f"{[slot(b) for b in bigs]}")
        return 0 if beside >= 0.5 * alone else 1
    finally:
        agents.stop()
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
