"""Run under torchrun (2+ ranks): 05's DDPCore alone, and ManualDDP with DDP's options, give weights bit-identical
to PyTorch's DDP after EVERY step.
(The suite runs these checks inside dropin_worker's 4-rank launch; the GPU tier runs this file.)

TEST_DEVICE=cuda (the GPU tier) runs the same on CUDA tensors, ranks sharing GPUs over gloo unless
TEST_BACKEND=nccl; deterministic kernels there (the embedding's backward otherwise adds with atomics).

With 3+ ranks the ring sums each element in an order that depends on where it sits in its bucket, so bit-identity
needs DDP's bucket layout at every step: one bucket in parameter order first, then the buckets rebuilt once in the
order gradients really arrived (static_graph: one step later; find_unused_parameters: never rebuilt).
"""

import contextlib
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import identical_across_ranks, load_script  # noqa: E402

DDPCore = load_script("05_manual_ddp_gpt2.py").DDPCore
ManualDDP = load_script("ddp_dropin.py").ManualDDP  # on that DDPCore
DDP = nn.parallel.DistributedDataParallel
DEVICE = torch.device("cpu")


class OutOfOrder(nn.Module):
    """Registered in one order, used in another: gradients arrive neither in registration order nor reversed."""

    def __init__(self, d=48, vocab=64, unused=False):
        super().__init__()
        self.late = nn.Linear(d, d)  # registered first, used last
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, 3 * d + 1)  # odd size
        self.down = nn.Linear(3 * d + 1, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.unused = nn.Linear(d, d) if unused else None  # never used: find_unused_parameters' case

    def forward(self, x):
        h = self.emb(x)
        h = h + self.down(torch.tanh(self.mid(h)))
        return self.head(torch.tanh(self.late(h)))


class WithBatchNorm(nn.Module):
    """BatchNorm's running statistics: buffers that rank 0 broadcasts before every synced forward."""

    def __init__(self, d=16, vocab=64):
        super().__init__()
        self.emb, self.bn, self.head = nn.Embedding(vocab, d), nn.BatchNorm1d(d), nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        return self.head(torch.relu(self.bn(h.flatten(0, 1)).view_as(h)))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, 64, (4, 9), generator=g).to(DEVICE)


def loss_of(model, data, **kw):
    out = model(data[:, :-1], **kw)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())


def train_both(make, steps=4, accum=1, group=None, ours_class=ManualDDP, **kw):
    """Train ours (ManualDDP, or the core alone) and DDP from the same weights on the same data; compare bit for bit
    after every step. Accumulation: the first accum - 1 micro-batches inside no_sync()."""
    torch.manual_seed(dist.get_rank())  # different weights on each rank: the wrapper must start from rank 0's
    base = make().to(DEVICE)
    if DEVICE.type == "cuda" and ours_class is ManualDDP:  # the core takes no device_ids: inputs are on DEVICE
        kw = dict(kw, device_ids=[DEVICE.index])
    ours, theirs = (wrapper(copy.deepcopy(base), process_group=group, **kw) for wrapper in (ours_class, DDP))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
    rank = dist.get_rank(group)
    for step in range(steps):
        for model, opt in zip((ours, theirs), opts):
            for micro in range(accum):
                sync = contextlib.nullcontext() if micro == accum - 1 else model.no_sync()
                with sync:
                    (loss_of(model, batch(step, rank, micro)) / accum).backward()
            opt.step()
            opt.zero_grad()
        for (name, a), b in [*zip(ours.module.named_parameters(), theirs.module.parameters()),
                             *zip(ours.module.named_buffers(), theirs.module.buffers())]:
            assert torch.equal(a, b), (f"{ours_class.__name__} {kw} accum {accum} step {step}: {name} differs by "
                                       f"{(a - b).abs().max().item():.3g}")
    assert identical_across_ranks(list(ours.parameters()), group), f"{ours_class.__name__} {kw}: ranks differ"
    return ours


def check_exact(group=None):
    """Every case, on `group` (None: all ranks)."""
    layouts = {}
    for make in (OutOfOrder, gpt2):
        # The core alone: default buckets (1 MiB first, then 25) and tiny ones (many buckets, rebuilt in the
        # observed order), with and without no_sync accumulation.
        for kw in ({}, {"bucket_cap_mb": 0.01}):
            for accum in (1, 3):
                core = train_both(make, accum=accum, group=group, ours_class=DDPCore, **kw)
                layouts[(make.__name__, tuple(kw.items()))] = [b.indices for b in core.buckets]
        for kw in ({}, {"bucket_cap_mb": 0.01}, {"static_graph": True}, {"find_unused_parameters": True}):
            ours = train_both(make, group=group, **kw)
            if not kw.get("static_graph") and not kw.get("find_unused_parameters"):  # the core's layout, unchanged
                assert [b.indices for b in ours.buckets] == layouts[(make.__name__, tuple(kw.items()))]
        train_both(make, accum=3, bucket_cap_mb=0.005, group=group)
    train_both(WithBatchNorm, accum=2, group=group, ours_class=DDPCore)  # buffers as DDP's too, no_sync included
    ours = train_both(lambda: OutOfOrder(unused=True), find_unused_parameters=True, bucket_cap_mb=0.01, group=group)
    assert ours.module.unused.weight.grad is None
    if DEVICE.type == "cuda":  # bf16 autocast, as GPU users train: still bit-identical
        with torch.autocast("cuda", dtype=torch.bfloat16):
            train_both(gpt2, group=group)
    n = len(list(OutOfOrder().parameters())) - 1  # tied: one tensor
    # The rebuilt order is not reversed registration order for this model: the point of observing it.
    assert layouts[("OutOfOrder", ())] != [list(range(n))[::-1]], layouts[("OutOfOrder", ())]


def check_every_size():
    """On all ranks, and with 4 on a group of 3 and on two pairs side by side as well (a DDP over a group runs
    exactly as one over a world of that size): one launch of 4 covers sums of 2, 3 and 4 terms. Returns what it
    covered, for the OK line."""
    check_exact()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != 4:
        return str(world)
    three = dist.new_group([0, 1, 2])
    if rank < 3:
        check_exact(three)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order
    check_exact(pairs[rank // 2])
    return "4, a group of 3 and 2"


def main():
    global DEVICE
    if os.environ.get("TEST_DEVICE") == "cuda":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
        torch.use_deterministic_algorithms(True)
    dist.init_process_group(os.environ.get("TEST_BACKEND", "gloo"))
    sizes = check_every_size()
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"OK DDPCore and ManualDDP bit-identical to DDP at every step on {sizes} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
