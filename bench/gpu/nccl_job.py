"""For ``bench/gpu/nccl_checks.sh`` (issue 14, a machine with 2+ GPUs): a GPT-2-small job
for ``hetpilot train --model``, the plans it runs, and the trainer's link probe over NCCL.

    python3 -P bench/gpu/nccl_job.py plans DIR        # writes one.json, pp.json, dp.json
    torchrun --standalone --nproc-per-node 2 bench/gpu/nccl_job.py links

Not yet run: no machine with two GPUs has been lent to this project.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def job() -> dict[str, Any]:
    """GPT-2 small (12 blocks, d 768, 12 heads, sequence 512, vocabulary 50304; tied
    embedding and head), batch 32, microbatch 8: bench/gpu_lm.py's model."""
    from hetpilot.trainer.examples import gpt

    spec = gpt(vocab=50304, seq_len=512, d_model=768, heads=12, blocks=12)
    spec["global_batch"], spec["microbatch_size"] = 32, 8
    return spec


def plans(out: Path, layers: int = 15, batch: int = 32, micro: int = 8) -> None:
    """One GPU; a 2-stage 1F1B pipeline cut after block 6; two data-parallel groups."""
    def group(samples: int, *stages: tuple[str, int, int]) -> dict[str, Any]:
        return {"samples": samples,
                "stages": [{"device": d, "layers": [a, b]} for d, a, b in stages]}

    cut = layers // 2
    written = {
        "one": [group(batch, ("gpu:0", 0, layers))],
        "pp": [group(batch, ("gpu:0", 0, cut), ("gpu:1", cut, layers))],
        "dp": [group(batch // 2, ("gpu:0", 0, layers)), group(batch // 2, ("gpu:1", 0, layers))],
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, groups in written.items():
        (out / f"{name}.json").write_text(json.dumps(
            {"version": 1, "microbatch_size": micro, "schedule": "1f1b", "groups": groups}))


def links() -> None:
    """The link probe ``hetpilot train --daemon`` runs on Attach, over NCCL between GPUs."""
    import os

    import torch
    import torch.distributed as dist
    from hetpilot.trainer.linkprobe import measure_links

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        measured = measure_links(torch.device("cuda", local))
        if dist.get_rank() == 0:
            for pair, link in measured.items():
                print("link", pair, link)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["plans"]:
        plans(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["links"]:
        links()
    else:
        sys.exit(__doc__)
