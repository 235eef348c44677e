"""The layers' optimizers stepped one by one against as one (hetpilot.trainer.optimstep),
side by side in one run.

The trainer keeps an optimizer per layer; :class:`~hetpilot.trainer.optimstep.OptimizerStep`
steps them as one where that is exact. On a GPU the gain is kernel launches (lease K in
bench/RESULTS-gpu.md: 11.7% of a launch-bound GPT-2 iteration); on a CPU it is the
Python and dispatch work per optimizer and per multi-tensor op, shown here on the
layers of a GPT (``hetpilot.trainer.examples.gpt``) with AdamW, ``foreach`` on and off
(the trainer does not join ``foreach`` steps of CPU parameters: this bench is why).
Rounds alternate the two ways; the figure is the median over rounds.

    .venv/bin/python bench/optim_step.py [--blocks 12 --d-model 256 --steps 50 --rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from hetpilot.trainer.examples import gpt
from hetpilot.trainer.optimstep import OptimizerStep


def _seconds(stepper: OptimizerStep, optims: list[torch.optim.Optimizer], steps: int) -> float:
    stepper.step(optims)  # warm-up: states created
    started = time.perf_counter()
    for _ in range(steps):
        stepper.step(optims)
    return (time.perf_counter() - started) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers = gpt(vocab=1024, seq_len=64, d_model=args.d_model, heads=4,
                 blocks=args.blocks)["layers"]
    params = [[p for p in m.parameters() if p.requires_grad] for m in layers]
    n = sum(p.numel() for ps in params for p in ps)
    print(f"CPU, one thread: {len(layers)} layers of a GPT (d {args.d_model}, "
          f"{args.blocks} blocks, {n / 1e6:.1f} M parameters, {sum(map(len, params))} "
          f"tensors), AdamW; {args.steps} steps x {args.rounds} rounds each way")
    for ps in params:
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
    print("\n| foreach | one by one, ms/step | as one, ms/step | as one / one by one |\n"
          "|---|---|---|---|")
    for foreach in (False, True):
        optims = [torch.optim.AdamW(ps, lr=1e-4, foreach=foreach) for ps in params if ps]
        alone, one = OptimizerStep(merge=False), OptimizerStep(cpu_multi_tensor=True)
        a: list[float] = []
        b: list[float] = []
        for _ in range(args.rounds):
            a.append(_seconds(alone, optims, args.steps))
            b.append(_seconds(one, optims, args.steps))
        assert one.merged and not alone.merged
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {foreach} | {ma * 1e3:.3f} | {mb * 1e3:.3f} | {mb / ma:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
