"""The README's figures, each drawn from a real run on the machine that runs this.

  python docs/figures.py                      # all six into docs/ (about 5 minutes on a 2-core CPU)
  python docs/figures.py ring curves          # some of them
  python docs/figures.py ring --quick --out /tmp/figs   # smaller runs (the test suite's check)

  ring     bus bandwidth against message size: 03's hand-written ring and dist.all_reduce, on 2 and 3 ranks
  overlap  one profiled training step of 05's model on 2 ranks (benchmarks/overlap.py): backward beside each
           bucket's all-reduce, naive DDP below
  memory   what a rank holds (parameters, gradients, optimizer state): DDP, ZeRO-1 and ZeRO-2 (07), DDP, ZeRO-2,
           08's FSDP and PyTorch's fully_shard (08), from the scripts' own tables
  curves   05's loss with --impl naive, manual and torch: one curve, three times
  scaling  benchmarks/costmodel.py's predictions (no run): scaling efficiency and memory per GPU, 8 to 1,024 GPUs,
           GPT-2, GPT-2 XL and a 7B Llama under DDP, ZeRO-1, ZeRO-2, FSDP and HSDP, and where each fits in 80 GiB
  fsdp     benchmarks/costmodel.py's FSDP step event by event (no run), with PyTorch's backward prefetch and without

Each PNG carries its caption (the command, the machine, the torch version) under the plot and, for tools, in its
PNG text fields (Title, Description: the axes and the series drawn).
"""

import argparse
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from lessons import load  # noqa: E402


def torchrun(nproc, script, args, timeout=900, ok=(0,)):
    """Run a script of this repository under torchrun on the CPU; its output, or an exit with what it said."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / script), "--device", "cpu", *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode not in ok:
        sys.exit(f"error: {' '.join(cmd[2:])} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return res.stdout


def machine():
    return f"{os.cpu_count()}-core CPU, {platform.system()}, gloo, torch {torch.__version__}"


def save(fig, path, title, command, axes, series):
    fig.text(0.01, 0.005, f"{command}\n{machine()}", fontsize=7, color="0.35", va="bottom")
    fig.savefig(path, dpi=90, metadata={"Title": title, "Description": f"axes: {axes}; series: {', '.join(series)}"})
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def ring(out, quick):
    max_bytes, iters = (64 << 10, 2) if quick else (16 << 20, 20)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, marker in ((2, "o"), (3, "s")):
            path = Path(tmp) / f"ring{n}.json"
            torchrun(n, "benchmarks/all_reduce.py", ["--max-bytes", max_bytes, "--iters", iters, "--json", path])
            rows = json.loads(path.read_text())["rows"]
            sizes = [r["bytes"] for r in rows]
            for impl, style in (("ring", "-"), ("library", "--")):
                label = f"{'hand-written ring' if impl == 'ring' else 'dist.all_reduce'}, {n} ranks"
                ax.plot(sizes, [r[f"{impl}_busbw_gbps"] for r in rows], style, marker=marker, label=label)
                series.append(label)
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
           title="All-reduce: 03's ring against the library's")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.subplots_adjust(bottom=0.24)
    save(fig, out / "ring_busbw.png", ax.get_title(), "python docs/figures.py ring" + (" --quick" * quick),
         "message size (bytes) / bus bandwidth (GB/s)", series)


def overlap(out, quick):
    reader = load("benchmarks/overlap.py")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    rows, labels, series = 0, [], []
    with tempfile.TemporaryDirectory() as tmp:
        for impl in ("manual", "naive"):
            prof = Path(tmp) / impl
            # 05's steps under the profiler (exit 1 when nothing overlapped: the naive one)
            torchrun(2, "benchmarks/overlap.py", ["--impl", impl, "--out", prof], ok=(0, 1))
            trace = json.loads((prof / "trace_rank0.json").read_text())
            _, t0, (b0, _, b1), launches, work = reader.steps(trace)[-1]  # the last profiled step
            ms = [(s - t0) / 1e3 for s in (b0, b1)]
            ax.barh(rows, ms[1] - ms[0], left=ms[0], color="0.6", height=0.6)
            labels.append(f"{impl}: backward")
            rows += 1
            for s, e in work:  # when gloo's thread worked on each all-reduce
                ax.barh(rows, (e - s) / 1e3, left=(s - t0) / 1e3, color="C0" if impl == "manual" else "C3", height=0.6)
            ax.plot([(s - t0) / 1e3 for s in launches], [rows] * len(launches), "k|", markersize=12)  # launches
            labels.append(f"{impl}: {len(work)} all-reduce(s)")
            series += [f"{impl} backward", f"{impl} all-reduce"]
            rows += 1.5
    ax.set_yticks([0, 1, 2.5, 3.5], labels)
    ax.invert_yaxis()
    ax.set(xlabel="ms from the start of the step (rank 0, a profiled step)",
           title="05: buckets all-reduced while backward runs (manual) vs after it (naive)\n"
                 "grey: backward; bars: an all-reduce at work; |: its launch")
    ax.grid(axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.27, bottom=0.3, top=0.82)
    save(fig, out / "ddp_overlap.png", ax.get_title(), "python docs/figures.py overlap",
         "ms from the step's start / backward and all-reduces", series)


def table(text, first_column):
    """Rank 0's rows of a markdown table the scripts print: {row name: [numbers]}."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[0] == "0" and cells[1] in first_column:
            rows[cells[1]] = [float(re.match(r"[\d.]+", c).group()) for c in cells[2:]]
    return rows


def memory(out, quick):
    plt = pyplot()
    size = ["--n-layer", 2, "--n-embd", 64] if quick else ["--n-layer", 4, "--n-embd", 128]
    zero = table(torchrun(2, "07_zero.py", size + ["--steps", 2]), {"parameters", "gradients", "optimizer state"})
    fsdp = table(torchrun(2, "08_fsdp.py", size + ["--max-steps", 2]), {"DDP", "ZeRO-2", "ours", "fully_shard"})
    # 07's table: a row per kind, a column per method; 08's: a row per method, columns params, grads, optimizer.
    panels = [("07_zero.py", ["DDP", "ZeRO-1", "ZeRO-2"],
               [zero["parameters"], zero["gradients"], zero["optimizer state"]]),
              ("08_fsdp.py (its own GPT-2 size)", ["DDP", "ZeRO-2", "FSDP (ours)", "fully_shard"],
               [[fsdp[m][k] for m in ("DDP", "ZeRO-2", "ours", "fully_shard")] for k in range(3)])]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, (title, names, kinds) in zip(axes, panels):
        bottom = [0.0] * len(names)
        for kind, values, color in zip(("parameters", "gradients", "optimizer state"), kinds, ("C0", "C1", "C2")):
            ax.bar(names, values, bottom=bottom, label=kind, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set(title=title, ylabel="MiB held by rank 0 (of 2)")
        ax.tick_params(axis="x", labelsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle("What a rank holds: each stage shards one more kind of state")
    fig.subplots_adjust(bottom=0.22, top=0.82, wspace=0.3)
    save(fig, out / "memory_per_rank.png", "What a rank holds", "python docs/figures.py memory",
         "method / MiB (stacked: parameters, gradients, optimizer state)",
         ["DDP", "ZeRO-1", "ZeRO-2", "FSDP (ours)", "fully_shard"])


def curves(out, quick):
    plt = pyplot()
    steps = 12 if quick else 150
    fig, ax = plt.subplots(figsize=(7, 4))
    series = []
    for impl, style in (("naive", "-"), ("manual", "--"), ("torch", ":")):
        text = torchrun(2, "05_manual_ddp_gpt2.py", ["--impl", impl, "--max-steps", steps, "--log-every", 3,
                                                     "--sample-tokens", 0])
        points = [(int(m[1]), float(m[2])) for m in re.finditer(r"^step\s+(\d+)/\d+ \| loss\s+([\d.]+)", text, re.M)]
        ax.plot(*zip(*points), style, linewidth=2.5 if impl == "naive" else 1.5, label=f"--impl {impl}")
        series.append(f"--impl {impl}")
    ax.set(xlabel="step", ylabel="loss (mean over ranks)",
           title="05 on 2 ranks: naive, hand-written and PyTorch's DDP train the same model")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.subplots_adjust(bottom=0.24)
    save(fig, out / "learning_curves.png", ax.get_title(), "python docs/figures.py curves", "step / loss", series)


def scaling(out, quick):
    cm = load("benchmarks/costmodel.py")
    plt = pyplot()
    gpus = [8, 64, 1024] if quick else [8, 16, 32, 64, 128, 256, 512, 1024]
    models = ("gpt2", "gpt2-xl", "llama-7b")
    styles = {"ddp": "-", "zero1": "--", "zero2": "-.", "fsdp": ":", "hsdp": (0, (6, 1, 1, 1, 1, 1))}
    fig, axes = plt.subplots(1, 3, figsize=(13, 5.2))
    series = []
    for model, color in zip(models, ("C0", "C1", "C2")):
        for strategy, style in styles.items():
            label = f"{model} {strategy}"
            series.append(label)
            for ax, hw, key in ((axes[0], "h100-ib", "scaling_efficiency"), (axes[1], "100gbe", "scaling_efficiency"),
                                (axes[2], "h100-ib", "memory_gib_per_gpu")):
                rows = [cm.predict(cm.Run(model, n, strategy), hw) for n in gpus]
                ys = [r[key] for r in rows]
                ax.plot(gpus, ys, linestyle=style, color=color, label=label if ax is axes[2] else None)
                # a filled marker where it fits in 80 GiB, a cross where it does not
                ax.scatter([n for n, r in zip(gpus, rows) if r["fits"]], [y for y, r in zip(ys, rows) if r["fits"]],
                           color=color, s=10)
                ax.scatter([n for n, r in zip(gpus, rows) if not r["fits"]],
                           [y for y, r in zip(ys, rows) if not r["fits"]], color=color, marker="x", s=30)
    for ax, title in ((axes[0], "scaling efficiency, h100-ib (8 x 400 Gb/s IB a node)"),
                      (axes[1], "scaling efficiency, 100gbe (one 100 Gb/s port a node)"),
                      (axes[2], "memory per GPU (GiB); x: does not fit 80 GiB")):
        ax.set(xscale="log", xlabel="GPUs (8 per node)", title=title)
        ax.set_xticks(gpus, [str(n) for n in gpus], fontsize=7)
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1.02)
    axes[1].set_ylim(0, 1.02)
    axes[2].axhline(80, color="k", linewidth=0.8)
    axes[2].set_yscale("log")
    fig.legend(*axes[2].get_legend_handles_labels(), fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 0.08))
    fig.suptitle("Predicted by benchmarks/costmodel.py: bf16 + AdamW, 4 x context tokens per GPU, 40% of peak FLOPs")
    fig.subplots_adjust(bottom=0.34, top=0.85, wspace=0.25)
    save(fig, out / "costmodel_scaling.png", "Scaling efficiency and memory per GPU, predicted",
         "python docs/figures.py scaling", "GPUs / scaling efficiency (h100-ib, 100gbe), memory per GPU GiB", series)


def fsdp(out, quick):
    """benchmarks/costmodel.py's FSDP step, event by event: six layers of a 13B model (MPT-13B's, 40 in all) on
    one node of 8 H100s, one sequence of 2048 tokens a GPU at 40% of peak, with PyTorch's backward prefetch and
    without it."""
    cm = load("benchmarks/costmodel.py")
    plt = pyplot()
    shape = dataclasses.replace(cm.model_shape("mpt-13b"), layers=6)
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.6), sharex=True)
    colors = {"forward": "C0", "backward": "C1", "all-gather": "C2", "reduce-scatter": "C3"}
    for ax, prefetch in zip(axes, (False, True)):
        trace = []
        run = cm.predict(cm.Run(shape, 8, "fsdp", batch=1, seq=2048, mfu=0.4, prefetch=prefetch), "h100-nvlink",
                         trace=trace)
        for kind, unit, start, end in trace:
            row = 0 if kind in ("forward", "backward") else 1
            ax.barh(row, (end - start) * 1e3, left=start * 1e3, height=0.6, color=colors[kind], edgecolor="white")
            if end - start > 0.0015:
                ax.text((start + end) / 2 * 1e3, row, "E" if unit == 0 else str(unit), ha="center", va="center",
                        fontsize=7, color="white")
        ax.set_yticks([0, 1], ["compute", "collectives\n(one queue)"])
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(("BackwardPrefetch.BACKWARD_PRE (the default): the next all-gather before this reduce-scatter"
                      if prefetch else "backward_prefetch=None: each all-gather waits behind the reduce-scatter")
                     + f"\nstep {run['step_ms']:.1f} ms, communication exposed {run['exposed_comm_ms']:.1f} ms",
                     fontsize=9)
    axes[1].set_xlabel("ms from the start of the step (predicted, no run)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), ncol=4, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 0.06))
    fig.suptitle("FSDP's step in benchmarks/costmodel.py: 6 layers of a 13B model, 8 H100s, 1 x 2048 tokens a GPU "
                 "(E: embeddings and head)", fontsize=10)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.25, top=0.86, hspace=0.5)
    save(fig, out / "fsdp_timeline.png", "FSDP's step with and without backward prefetch, predicted",
         "python docs/figures.py fsdp", "ms from the step's start / compute and collectives",
         ["forward", "backward", "all-gather", "reduce-scatter", "backward_prefetch=None", "BACKWARD_PRE"])


FIGURES = {"ring": ring, "overlap": overlap, "memory": memory, "curves": curves, "scaling": scaling, "fsdp": fsdp}

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("figures", nargs="*", help=f"any of {', '.join(FIGURES)} (default: all)")
    p.add_argument("--out", type=Path, default=REPO / "docs", help="directory for the PNGs")
    p.add_argument("--quick", action="store_true", help="smaller runs, for a check rather than the README")
    a = p.parse_args()
    if set(a.figures) - set(FIGURES):
        p.error(f"unknown figure(s) {sorted(set(a.figures) - set(FIGURES))}: choose from {', '.join(FIGURES)}")
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.figures or FIGURES:
        FIGURES[name](a.out, a.quick)
