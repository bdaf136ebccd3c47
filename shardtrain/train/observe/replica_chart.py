"""`shardtrain report` for a run of replica groups (fault.mode = replicas; docs/faults.md):
the quorum's changes as lines, and the loss with each loss and rejoin marked on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardtrain.train.observe.charts import pyplot, save_png


def replica_events(records: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """(step, kind, text) for every step whose record says a group was lost or rejoined,
    or that state was transferred, or that a step was not applied; kind is lost, rejoined
    or aborted."""
    out = []
    for r in records:
        step = r["step"]
        if r.get("committed") is False:
            out.append((step, "aborted", f"step {step}: not applied (a group failed inside "
                                         "it; taken again)"))
        if r.get("lost"):
            out.append((step, "lost", f"step {step}: lost group(s) {r['lost']}, "
                                      f"quorum {r.get('quorum')} {r.get('groups')}"))
        got, sent = r.get("transfer_bytes", 0), r.get("sent_bytes", 0)
        quorum = f"quorum {r.get('quorum')} {r.get('groups')}"
        if got:
            text = (f"this group rejoined from a live peer ({got / 2**20:.2f} MiB received in "
                    f"{r.get('transfer_s', 0.0):.2f} s)")
        elif r.get("rejoined"):
            text = f"group(s) {r['rejoined']} rejoined" + (
                f" ({sent / 2**20:.2f} MiB sent)" if sent else "")
        elif sent:
            text = f"{sent / 2**20:.2f} MiB sent to a rejoining group"
        else:
            continue
        out.append((step, "rejoined", f"step {step}: {text}, {quorum}"))
    return out


def replica_lines(records: list[dict[str, Any]]) -> list[str]:
    if not any("quorum" in r for r in records):
        return []
    events = replica_events(records)
    sizes = sorted({r["quorum"] for r in records if "quorum" in r})
    return [f"replica groups: quorum sizes {sizes}, {len(events)} event(s)",
            *(f"  {text}" for _, _, text in events)]


_COLOURS = {"lost": "tab:red", "rejoined": "tab:green", "aborted": "tab:gray"}


def plot_replica_loss(records: list[dict[str, Any]], path: Path) -> bool:
    """The applied steps' loss, a vertical line at each event (red: lost, green: rejoined,
    grey: a step not applied), the steps run by fewer than every group shaded; False (no
    file) for a run without replica groups."""
    if not any("quorum" in r for r in records):
        return False
    plt = pyplot()
    applied = [r for r in records if r.get("committed", True)]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([r["step"] for r in applied], [r["loss"] for r in applied], color="tab:blue",
            label="loss")
    full = max(r.get("quorum", 0) for r in records)
    for r in applied:
        if r.get("quorum", full) < full:
            ax.axvspan(r["step"] - 0.5, r["step"] + 0.5, color="tab:orange", alpha=0.15, lw=0)
    seen = set()
    for step, kind, _ in replica_events(records):
        ax.axvline(step, color=_COLOURS[kind], ls="--", lw=1,
                   label=None if kind in seen else kind)
        seen.add(kind)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss; shaded: steps with fewer than every replica group")
    ax.legend(loc="upper right")
    save_png(fig, path)
    return True
