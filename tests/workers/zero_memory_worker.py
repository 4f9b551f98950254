"""Run under torchrun (2 ranks): ZeRO-2's peak memory is below ZeRO-1's by most of what sharding the gradients
saves, on models of different shapes: few large layers (a bucket of 25 MiB and more at once) and many small ones.

Each measure is 07's own peak_memory (the resident set with glibc's mmap threshold lowered, so that freed tensors
leave it) around three AdamW steps of a fresh ZeroDDP; stage 1 and stage 2 alternate, twice each, and the lower
peak of each stage counts (the resident set moves a little between runs of the same code). For measuring by hand:
ZERO_SOURCE=path/to/another/07_zero.py compares another version, ZERO_SHAPE=8x1536 another shape (layers x width).
"""

import copy
import ctypes
import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_script  # noqa: E402

zero = load_script(os.environ.get("ZERO_SOURCE", "07_zero.py"))
SHAPES = {"few large layers (8 x 1024^2)": (8, 1024), "many small layers (128 x 256^2)": (128, 256)}
if os.environ.get("ZERO_SHAPE"):  # benchmarks: another shape, "LAYERSxWIDTH"
    SHAPES = {os.environ["ZERO_SHAPE"]: tuple(map(int, os.environ["ZERO_SHAPE"].split("x")))}


def train(base, stage, steps=3):
    model = copy.deepcopy(base)
    wrapped = zero.ZeroDDP(model, torch.optim.AdamW, stage=stage, lr=1e-3)
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + dist.get_rank())
        wrapped(torch.randn(32, base[0].in_features, generator=g)).square().mean().backward()
        wrapped.step()
        wrapped.zero_grad()
    return sum(b.grad.nbytes for b in wrapped.buckets)  # the averaged gradients this stage keeps


def main():
    dist.init_process_group("gloo")
    ctypes.CDLL(None).mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD, as 07's main sets it
    said = []
    for name, (layers, width) in SHAPES.items():
        torch.manual_seed(0)
        base = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        peaks, kept = {1: [], 2: []}, {}
        for stage in (1, 2, 1, 2):
            kept[stage], peak = zero.peak_memory(functools.partial(train, base, stage), torch.device("cpu"))
            peaks[stage].append(peak)
        saving = kept[1] - kept[2]
        gain = min(peaks[1]) - min(peaks[2])
        mine = torch.tensor([gain / saving])
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)  # the worst rank decides
        assert mine.item() > 0.5, (f"{name}: ZeRO-2's peak is {gain / 2**20:.1f} MiB below ZeRO-1's, less than half "
                                   f"of the {saving / 2**20:.1f} MiB sharding the gradients saves (peaks {peaks})")
        said.append(f"{name}: {mine.item():.0%} of {saving / 2**20:.1f} MiB")
    if dist.get_rank() == 0:
        print("OK ZeRO-2 below ZeRO-1 by " + "; ".join(said), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
