"""The README's concept drawings: what the lessons do, drawn from the rules the scripts follow (no run needed).

  python docs/diagrams.py                  # all four into docs/ (a few seconds)
  python docs/diagrams.py ring --out /tmp  # some of them, elsewhere

  tree     02's binomial tree broadcast: who sends to whom in each round, on 8 ranks and on 6 with --src 2
  ring     03's ring all-reduce on 4 ranks: the reduce-scatter's steps, then the all-gather's
  buckets  05's buckets over backward: gradients fill them back to front, each all-reduce starts as its bucket
           completes while backward goes on; naive DDP's all-reduces after backward, below
  shards   what each rank holds (parameters, gradients, optimizer state) under DDP, ZeRO-1, ZeRO-2 (07), FSDP (08)

SVG with its text kept as text (any size on a projector, searchable), written byte for byte the same on every run
with the same matplotlib: no date, fixed ids. (docs/figures.py draws the measured figures.)
"""

import argparse
import math
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KIND = {"parameters": "C0", "gradients": "C1", "optimizer state": "C2"}  # the colours of docs/memory_per_rank.png
HELD, SUMMING, DONE, JUST = "#c6dbef", "#6baed6", "#74c476", "#fd8d3c"  # cells: own, partial sum, full sum, new


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # Text as <text> elements, not glyph outlines; ids salted by a constant, not drawn at random: the same bytes.
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "ddp-from-scratch", "font.size": 15,
                         "font.family": "sans-serif", "font.sans-serif": ["DejaVu Sans", "Arial", "Helvetica"]})
    return plt


def save(fig, path, title, description):
    fig.savefig(path, format="svg", metadata={"Date": None, "Title": title, "Description": description})
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


def canvas(ax, width, height, top=0.0):
    """Data coordinates = the drawing's own units, y pointing down (rank 0 on top), no axes drawn."""
    ax.set(xlim=(0, width), ylim=(height, -top), aspect="equal")
    ax.axis("off")


def arrow(ax, start, end, color="black", width=2.0, bend=0.0, shrink=0):
    """An arrow from start to end, bent to the right by `bend`; `shrink` points short of both ends."""
    ax.annotate("", end, start, arrowprops=dict(arrowstyle="-|>", color=color, lw=width, mutation_scale=20,
                                                shrinkA=shrink, shrinkB=shrink, connectionstyle=f"arc3,rad={bend}"))


# --- 02: the binomial tree ---
def tree_sends(world, src):
    """[(round, sender, receiver)] of 02's tree_broadcast: ranks renumbered from src (vrank 0 = src); in round k
    the 2**(k-1) vranks that hold the data each send it to vrank + 2**(k-1)."""
    sends = []
    for k in range(math.ceil(math.log2(world))):
        step = 1 << k  # round k+1: the vranks below `step` hold the data
        for v in range(step):
            if v + step < world:
                sends.append((k + 1, (v + src) % world, (v + step + src) % world))
    return sends


def tree(out):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(15, 7))
    for ax, world, src in zip(axes, (8, 6), (0, 2)):
        sends = tree_sends(world, src)
        rounds = sends[-1][0]
        got = {src: 0} | {dst: k for k, _, dst in sends}  # the round in which each rank first holds the data
        ax.set(xlim=(-1.3, rounds + 0.4), ylim=(7.6, -0.9))
        ax.axis("off")
        for r in range(world):
            ax.text(-0.3, r, f"rank {r}" + (" (src)" if r == src else ""), ha="right", va="center",
                    fontweight="bold" if r == src else "normal")
            ax.plot([0, rounds], [r, r], color="0.85", lw=1.5, zorder=0)
            for k in range(rounds + 1):  # the source green, the ranks it has reached blue
                fill = (DONE if r == src else SUMMING) if got[r] <= k else "white"
                ax.plot(k, r, "o", markersize=20, markerfacecolor=fill, markeredgecolor="0.3", zorder=3)
        for k, a, b in sends:  # in round k, sender a to receiver b: from the dot's side that faces b
            nudge = 0.1 if b > a else -0.1
            arrow(ax, (k - 0.88, a + nudge), (k - 0.12, b - nudge))
        for k in range(rounds + 1):
            ax.text(k, -0.6, "start" if k == 0 else f"round {k}", ha="center", va="center")
        if src == 0:
            title = f"{world} ranks, src 0: {rounds} rounds"
        else:
            title = (f"{world} ranks, --src {src}: counted from the source,\n"
                     f"rank {src} is vrank 0, rank {src + 1} vrank 1...")
        ax.set_title(title, fontsize=16)
    fig.suptitle("02: tree_broadcast, a binomial tree: each round, every rank holding the data sends it to one more\n"
                 "the holders double each round: ceil(log2 N) rounds, where the source alone would need N-1 sends",
                 fontsize=17)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.8, bottom=0.02, wspace=0.1)
    save(fig, out / "tree_broadcast.svg", "02: the binomial tree broadcast",
         "ranks top to bottom, rounds left to right; an arrow is one send; filled: the rank holds the data")


# --- 03: the ring ---
def ring_steps(world):
    """[(phase, step, sends, held)] after each step of 03's ring_all_reduce on `world` ranks: sends are (sender,
    chunk); held[r][c] is the set of ranks whose chunk c is summed into rank r's chunk c."""
    held = [[{r} for _ in range(world)] for r in range(world)]
    steps = [("start", 0, [], held)]
    for s in range(world - 1):  # rank r sends chunk r-s to rank r+1, which adds it to its own chunk r-s
        sends = [(r, (r - s) % world) for r in range(world)]
        new = [[set(cell) for cell in row] for row in held]
        for r, c in sends:
            new[(r + 1) % world][c] |= held[r][c]
        held = new
        steps.append(("reduce-scatter", s + 1, sends, held))
    for s in range(world - 1):  # rank r passes on chunk r+1-s, complete; rank r+1 overwrites its own with it
        sends = [(r, (r + 1 - s) % world) for r in range(world)]
        new = [[set(cell) for cell in row] for row in held]
        for r, c in sends:
            new[(r + 1) % world][c] = set(held[r][c])
        held = new
        steps.append(("all-gather", s + 1, sends, held))
    return steps


def ring(out, world=4):
    plt = pyplot()
    steps = ring_steps(world)
    fig, axes = plt.subplots(2, world, figsize=(16, 9.6))
    panels = [axes[0][i] for i in range(world)] + [axes[1][i] for i in range(1, world)]
    for ax, (phase, s, sends, held) in zip(panels, steps):
        canvas(ax, world + 1.6, world + 0.5, top=0.7)
        received = {((r + 1) % world, c) for r, c in sends}
        for r in range(world):
            ax.text(1.45, r + 0.5, f"rank {r}", ha="right", va="center", fontsize=14)
            for c in range(world):
                cell = held[r][c]
                color = DONE if len(cell) == world else SUMMING if len(cell) > 1 else HELD
                ax.add_patch(plt.Rectangle((1.6 + c, r), 1, 1, facecolor=color, edgecolor="white", lw=2))
                if (r, c) in received:
                    ax.add_patch(plt.Rectangle((1.65 + c, r + 0.05), 0.9, 0.9, fill=False, edgecolor=JUST, lw=3))
                label = "all" if len(cell) == world else "+".join(map(str, sorted(cell)))
                ax.text(2.1 + c, r + 0.5, label, ha="center", va="center", fontsize=13 if len(cell) < 3 else 11)
        ax.text(1.45, -0.5, "chunk", ha="right", va="center", fontsize=13)
        for c in range(world):
            ax.text(2.1 + c, -0.5, str(c), ha="center", va="center", fontsize=13)
        for r, c in sends:  # down one row to the right neighbour; the last rank's goes round to rank 0
            x = 1.6 + c + 0.8
            if r + 1 < world:
                arrow(ax, (x, r + 0.7), (x, r + 1.3), color="black")
            else:
                arrow(ax, (x, r + 0.7), (x, r + 1.15), color="black")
                arrow(ax, (x, -0.25), (x, 0.3), color="black")
        if phase == "start":
            title = "start: each rank's own tensor\ncut into N chunks"
        elif phase == "reduce-scatter":
            title = f"reduce-scatter, step {s}:\nreceive a chunk, add it to yours"
        else:
            title = f"all-gather, step {s}:\nreceive a full chunk, copy it"
        ax.set_title(title, fontsize=15, color="C3" if phase == "all-gather" else "black")
    # The ring itself, where the all-gather row starts.
    ax = axes[1][0]
    canvas(ax, 4, 4)
    at = [(2 + 1.3 * math.sin(2 * math.pi * r / world), 2 - 1.3 * math.cos(2 * math.pi * r / world))
          for r in range(world)]
    for r, (x, y) in enumerate(at):
        ax.add_patch(plt.Circle((x, y), 0.42, facecolor=HELD, edgecolor="0.3", lw=1.5))
        ax.text(x, y, str(r), ha="center", va="center", fontsize=18, fontweight="bold")
        arrow(ax, at[r], at[(r + 1) % world], bend=-0.25, shrink=24)
    ax.set_title("the ring: each step, every rank\nsends one chunk right, receives one", fontsize=15)
    fig.suptitle(f"03: ring_all_reduce on {world} ranks: {world - 1} steps of reduce-scatter, then {world - 1} of "
                 "all-gather\ncells: whose chunks are summed in; orange: arrived this step; green: the full sum; "
                 f"each rank sends 2(N-1)/N of the tensor", fontsize=16)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.84, bottom=0.01, wspace=0.08, hspace=0.28)
    save(fig, out / "ring_steps.svg", "03: the ring all-reduce, step by step",
         "ranks top to bottom, chunks left to right, one panel per step; arrows: each rank's send to its right "
         "neighbour")


# --- 05: buckets over backward ---
def bucket_timeline(layers=6, per_bucket=2, backward=1.0, all_reduce=1.6, latency=0.3):
    """(backward blocks, bucket all-reduces, naive all-reduces) as [(label, start, end, bucket)], in time units.

    Backward computes the last layer's gradients first, so the buckets take the parameters in reverse order and
    bucket 0 fills first. A bucket's all-reduce starts once its last gradient is in and the one before has
    finished (collectives run one at a time, in order). Naive DDP all-reduces each gradient after backward:
    the same bytes, plus a message's fixed cost per gradient."""
    blocks = [(f"layer {layers - i}", i * backward, (i + 1) * backward, i // per_bucket) for i in range(layers)]
    reduces, free = [], 0.0
    for b in range(layers // per_bucket):
        ready = blocks[(b + 1) * per_bucket - 1][2]
        start = max(ready, free)
        free = start + all_reduce
        reduces.append((f"bucket {b}", start, free, b))
    each = all_reduce / per_bucket + latency
    naive = [(f"{layers - i}", layers * backward + i * each, layers * backward + (i + 1) * each, None)
             for i in range(layers)]
    return blocks, reduces, naive


def buckets(out):
    plt = pyplot()
    blocks, reduces, naive = bucket_timeline()
    fig, ax = plt.subplots(figsize=(15, 6.6))
    rows = {"backward": 0, "all-reduce (05)": 1, "naive: backward": 3.0, "naive: all-reduce": 4.0}
    for label, start, end, b in blocks:
        for row in ("backward", "naive: backward"):
            ax.barh(rows[row], end - start, left=start, height=0.62, color=f"C{b}", alpha=0.45, edgecolor="white",
                    lw=2)
            ax.text((start + end) / 2, rows[row], label, ha="center", va="center", fontsize=13)
    for label, start, end, b in reduces:
        ax.barh(rows["all-reduce (05)"], end - start, left=start, height=0.62, color=f"C{b}", edgecolor="white",
                lw=2)
        ax.text((start + end) / 2, rows["all-reduce (05)"], label, ha="center", va="center", color="white",
                fontweight="bold")
        ready = max(end for _, _, end, bucket in blocks if bucket == b)  # its last gradient is in
        ax.plot([ready, ready], [rows["backward"] + 0.31, rows["all-reduce (05)"] - 0.31], ":", color="0.2", lw=1.8)
    for label, start, end, _ in naive:
        ax.barh(rows["naive: all-reduce"], end - start, left=start, height=0.62, color="C3", edgecolor="white", lw=2)
        ax.text((start + end) / 2, rows["naive: all-reduce"], label, ha="center", va="center", color="white")
    ours, theirs = reduces[-1][2], naive[-1][2]
    for row, end in (("all-reduce (05)", ours), ("naive: all-reduce", theirs)):
        ax.plot([end, end], [rows[row] - 0.45, rows[row] + 0.45], color="black", lw=3)
        ax.text(end + 0.12, rows[row], "optimizer\nstep", va="center", fontsize=13)
    ax.annotate("bucket 0 complete: its hook launches the all-reduce, and backward goes on",
                (reduces[0][1], rows["all-reduce (05)"] + 0.31), (reduces[0][1] + 0.3, rows["all-reduce (05)"] + 0.85),
                fontsize=13, va="center", arrowprops=dict(arrowstyle="-|>", color="0.2", lw=1.5))
    ax.text(naive[0][1] - 0.2, rows["naive: all-reduce"], "one all-reduce per gradient,\nonly after backward",
            fontsize=13, ha="right", va="center")
    ax.set_yticks(list(rows.values()), list(rows))
    ax.tick_params(axis="y", length=0)
    ax.set_ylim(4.5, -0.9)
    ax.set_xlim(-1.4, theirs + 1.5)
    ax.set_xticks([])
    ax.set_xlabel("time →  (illustrative units; docs/ddp_overlap.png is a measured step)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.text(0, -0.62, "gradients arrive back to front (last layer first): bucket 0 takes the last layers",
            fontsize=13, va="center")
    fig.suptitle("05: buckets leave during backward: each bucket's all-reduce starts as soon as its gradients are "
                 f"in\nstep done at {ours:.1f} instead of {theirs:.1f}: all but the last bucket's all-reduce hides "
                 "behind backward", fontsize=16)
    fig.subplots_adjust(left=0.14, right=0.98, top=0.84, bottom=0.1)
    save(fig, out / "bucket_overlap.svg", "05: buckets all-reduced while backward runs",
         "time left to right; rows: backward per layer, bucket all-reduces, naive DDP's backward and all-reduces")


# --- 07 and 08: who holds what ---
SCHEMES = {  # per kind: True if every rank holds all of it, False if only its own 1/N shard
    "DDP": {"parameters": True, "gradients": True, "optimizer state": True},
    "ZeRO-1 (07)": {"parameters": True, "gradients": True, "optimizer state": False},
    "ZeRO-2 (07)": {"parameters": True, "gradients": False, "optimizer state": False},
    "FSDP (08)": {"parameters": False, "gradients": False, "optimizer state": False},
}
BYTES = {"parameters": 1, "gradients": 1, "optimizer state": 2}  # in P, fp32: AdamW keeps two moments a weight


def bytes_held(scheme, world):
    """What one rank holds under `scheme`, in P (the parameters' bytes in fp32)."""
    return sum(size * (1 if SCHEMES[scheme][kind] else 1 / world) for kind, size in BYTES.items())


def shards(out, world=4):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(SCHEMES), figsize=(16, 7.6))
    unit = 1.6  # the length of P
    for ax, (scheme, full) in zip(axes, SCHEMES.items()):
        canvas(ax, 2 * unit + 0.3, world * 1.45 + 0.2, top=0.3)
        for r in range(world):
            top = r * 1.45 + 0.2
            for i, (kind, size) in enumerate(BYTES.items()):
                y, width = top + i * 0.38, size * unit / world
                for k in range(world):  # the kind's N shards: this rank's is k == r
                    mine = full[kind] or k == r
                    ax.add_patch(plt.Rectangle((0.15 + k * width, y), width, 0.3, lw=1.2,
                                               facecolor=KIND[kind] if mine else "white",
                                               edgecolor="white" if mine else "0.6", linestyle="-" if mine else ":"))
            ax.text(0.15, top - 0.05, f"rank {r}", fontsize=13, va="bottom")
        ax.set_title(f"{scheme}\n{bytes_held(scheme, world):g}P per rank", fontsize=17)
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND.values()] +
               [plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="0.6", linestyle=":")],
               labels=["parameters (P)", "gradients (P)", "optimizer state (AdamW: 2P)", "not held: another rank's"],
               loc="lower center", ncol=4, frameon=False, fontsize=14)
    fig.suptitle(f"What each of {world} ranks holds: each stage shards one more kind of state\n"
                 "P: the parameters' bytes in fp32. Not drawn, in flight: one bucket's full gradients (ZeRO-2), one "
                 "unit's full parameters (FSDP)",
                 fontsize=17)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.8, bottom=0.1, wspace=0.08)
    save(fig, out / "zero_shards.svg", "What each rank holds: DDP, ZeRO-1, ZeRO-2, FSDP",
         "one column per scheme, ranks top to bottom, bars: parameters, gradients, optimizer state cut in N shards")


DIAGRAMS = {"tree": tree, "ring": ring, "buckets": buckets, "shards": shards}

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("diagrams", nargs="*", help=f"any of {', '.join(DIAGRAMS)} (default: all)")
    p.add_argument("--out", type=Path, default=REPO / "docs", help="directory for the SVGs")
    a = p.parse_args()
    if set(a.diagrams) - set(DIAGRAMS):
        p.error(f"unknown diagram(s) {sorted(set(a.diagrams) - set(DIAGRAMS))}: choose from {', '.join(DIAGRAMS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.diagrams or DIAGRAMS:
        DIAGRAMS[name](a.out)
