"""Pictures people look at: policies side by side, and the V trade-off.

matplotlib with the Agg backend (no display needed), imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .engine import SlotRecord

__all__ = ["plot_runs", "plot_sweep"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: Mapping[str, Sequence[SlotRecord]], path: str, title: str = "") -> None:
    """Three panels over slots: iteration time, cost rate against budget, backlog.

    The cost and backlog panels show every budgeted kind (price, power), one
    line style per kind; a kind without a budget is drawn without one.
    """
    plt = _pyplot()
    kinds = list(dict.fromkeys(k for recs in runs.values() for r in recs for k in r.budgets))
    kinds = kinds or ["price_per_hour"]
    fig, axes = plt.subplots(1 + 2 * len(kinds), 1, figsize=(10, 3 + 2.4 * len(kinds)), sharex=True)
    ax_t = axes[0]
    for name, recs in runs.items():
        ax_t.plot([r.slot for r in recs],
                  [float("nan") if r.effective_iteration_s is None else r.effective_iteration_s
                   for r in recs], label=name, lw=1.2)
    ax_t.set_ylabel("iteration s\n(incl. switching)")
    ax_t.legend(loc="upper right", fontsize=8, ncol=min(4, len(runs)))
    for i, kind in enumerate(kinds):
        ax_c, ax_q = axes[1 + 2 * i], axes[2 + 2 * i]
        budget_drawn = False
        for name, recs in runs.items():
            slots = [r.slot for r in recs]
            ax_c.plot(slots, [r.costs.get(kind, 0.0) for r in recs], label=name, lw=1.0)
            ax_q.plot(slots, [r.queues.get(kind, 0.0) for r in recs], label=name, lw=1.0)
            if not budget_drawn and any(kind in r.budgets for r in recs):
                ax_c.step(slots, [r.budgets.get(kind, float("nan")) for r in recs], where="post",
                          color="black", ls="--", lw=1.2, label="budget")
                budget_drawn = True
        ax_c.set_ylabel(f"{kind}\nrate")
        ax_c.legend(loc="upper right", fontsize=8, ncol=min(5, len(runs) + 1))
        ax_q.set_ylabel(f"{kind}\nbacklog Q")
    axes[-1].set_xlabel("slot")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str, title: str = "") -> None:
    """Average iteration time and average backlog against V (log x)."""
    plt = _pyplot()
    vs = [r["V"] for r in rows]
    fig, (ax_t, ax_q) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_t.plot(vs, [r["avg_iteration_s"] for r in rows], marker="o")
    ax_t.set_xscale("log")
    ax_t.set_xlabel("V")
    ax_t.set_ylabel("avg iteration s")
    for kind in rows[0]["avg_queues"] if rows else []:
        ax_q.plot(vs, [r["avg_queues"].get(kind) for r in rows], marker="o", label=kind)
    ax_q.set_xscale("log")
    ax_q.set_xlabel("V")
    ax_q.set_ylabel("avg backlog Q")
    ax_q.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
