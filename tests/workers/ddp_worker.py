"""Run under torchrun: ManualDDP equals one process on the whole batch and PyTorch's DDP.

The model has tied weights (embedding = output head, like GPT-2) and a parameter used on rank 0 only.
Buckets are tiny so there are many. Checked over several optimizer steps with zero_grad(set_to_none=True):
gradients (manual, naive, torch DDP, single-process reference), weights after the steps, bit-identical ranks,
buckets launched during backward, no_sync accumulation, construction broadcast and verify=True.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import identical_across_ranks, load_script  # noqa: E402

lesson = load_script("05_manual_ddp_gpt2.py")
ManualDDP = lesson.ManualDDP
RANK, WORLD = 0, 1


class Tiny(nn.Module):
    def __init__(self, vocab=40, d=24):
        super().__init__()
        # Registered first, so it lands in the LAST bucket (buckets go in reverse registration order) and
        # the buckets before it can still go out during backward on the ranks that do not use it.
        self.extra = nn.Linear(d, d)  # used on rank 0 only
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh())
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied, as in GPT-2

    def forward(self, x, use_extra):
        h = self.body(self.emb(x))
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)


def shard(step, rank, micro=0, batch=4, seq=6, vocab=40):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def loss_of(model, data, use_extra):
    logits = model(data[:, :-1], use_extra)
    return F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def close(a, b, what):
    for x, y in zip(a, b):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), f"{what}: max diff {(x - y).abs().max().item()}"


def check_training(steps=4):
    torch.manual_seed(0)
    base = Tiny()
    ref, ours, naive, theirs = (copy.deepcopy(base) for _ in range(4))
    manual = ManualDDP(ours, bucket_cap_mb=0.00005)  # 52-byte cap: once rebuilt, every tensor has its own bucket
    for t in naive.parameters():  # the naive tutorial: rank 0's weights, then average_gradients after backward
        dist.broadcast(t.data, src=0)
    torch_ddp = nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=0.00005, find_unused_parameters=True)
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for name, m in
            [("ref", ref), ("manual", ours), ("naive", naive), ("torch", theirs)]}
    launched_early = []
    finish = manual._finish
    manual._finish = lambda: (launched_early.append(manual._next), finish())[1]
    for step in range(steps):
        # Reference: one process sees every rank's shard; DDP's gradient is the mean of per-rank means.
        loss = sum(loss_of(ref, shard(step, r), use_extra=(r == 0)) for r in range(WORLD)) / WORLD
        loss.backward()
        for wrapped in (manual, naive, torch_ddp):
            loss_of(wrapped, shard(step, RANK), use_extra=(RANK == 0)).backward()
        lesson.average_gradients(naive, WORLD)
        close(grads(ours), grads(ref), f"step {step}: manual vs single process")
        close(grads(ours), grads(theirs), f"step {step}: manual vs torch DDP")
        close(grads(naive), grads(ref), f"step {step}: naive vs single process")
        assert identical_across_ranks(grads(ours)), f"step {step}: grads differ across ranks"
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    close(list(ours.parameters()), list(ref.parameters()), "weights after steps: manual vs single process")
    close(list(ours.parameters()), list(theirs.parameters()), "weights after steps: manual vs torch DDP")
    assert identical_across_ranks(list(ours.parameters())), "weights differ across ranks"
    # Step 0 runs as one bucket (DDP's rule); from step 1 on the buckets are rebuilt, one per tensor here. On rank 0,
    # which uses every parameter, each bucket went out from a backward hook while backward was still running. (On
    # the others the bucket of the unused 'extra' only completes at the end of backward, and buckets launch in order.)
    assert len(manual.buckets) == len(list(ours.parameters())), len(manual.buckets)
    if RANK == 0:
        assert launched_early == [1] + [len(manual.buckets)] * (steps - 1), launched_early
    return len(manual.buckets)


def check_bucket_layout():
    """ManualDDP packs exactly the buckets PyTorch's DDP ends up with, for its default and explicit caps."""
    torch.manual_seed(2)
    # Gradients arrive in reverse registration order here, as in GPT-2; PyTorch's DDP rebuilds its buckets
    # in arrival order after the first iteration, ManualDDP uses reverse registration order from the start.
    dims = (512, 256, 512, 384, 512, 128)  # 0.25-0.75 MiB layers: the 1 MiB first bucket holds some, not all
    base = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(dims, dims[1:])])
    for cap in (None, 0.5, 2):
        ours = ManualDDP(copy.deepcopy(base), bucket_cap_mb=cap)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
        sizes = {}

        def record(sizes, bucket):  # a comm hook sees each bucket's flat buffer
            sizes[bucket.index()] = bucket.buffer().numel() * bucket.buffer().element_size()
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
        theirs.register_comm_hook(sizes, record)
        for _ in range(3):  # PyTorch's DDP settles its buckets after the first iteration
            sizes.clear()
            for model in (ours, theirs):
                model(torch.randn(4, 512)).square().mean().backward()
        mine = [b.flat.numel() * b.flat.element_size() for b in ours.buckets]
        assert mine == [sizes[i] for i in range(len(sizes))], (cap, mine, sizes)


def check_no_sync(k=3):
    torch.manual_seed(1)
    ref, ours = Tiny(), Tiny()
    ours.load_state_dict(ref.state_dict())
    manual = ManualDDP(ours, bucket_cap_mb=0.002)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    try:
        with manual.no_sync():
            for m in range(k - 1):
                (loss_of(manual, shard(9, RANK, m), RANK == 0) / k).backward()
        assert not calls, "no_sync must not communicate"
        (loss_of(manual, shard(9, RANK, k - 1), RANK == 0) / k).backward()
        assert calls, "the backward after no_sync must communicate"
    finally:
        dist.all_reduce = real
    loss = sum(loss_of(ref, shard(9, r, m), r == 0) for r in range(WORLD) for m in range(k)) / (k * WORLD)
    loss.backward()
    close(grads(ours), grads(ref), "no_sync accumulation vs large batch")


def check_forward_bypassed():
    """A backward whose forward did not go through ManualDDP (no .grad in the buckets yet) is still averaged."""
    torch.manual_seed(3)
    ref, ours = Tiny(), Tiny()
    ours.load_state_dict(ref.state_dict())
    manual = ManualDDP(ours, bucket_cap_mb=0.002)
    loss_of(manual.module, shard(5, RANK), True).backward()  # autograd makes fresh .grad tensors: copied in
    (sum(loss_of(ref, shard(5, r), True) for r in range(WORLD)) / WORLD).backward()
    close(grads(ours), grads(ref), "backward around the wrapper's forward vs single process")
    views = [v.data_ptr() for b in manual.buckets for v in b.views]
    assert sorted(p.grad.data_ptr() for p in ours.parameters()) == sorted(views), "grads are not bucket views"


def check_construction():
    torch.manual_seed(100 + RANK)  # deliberately different replicas
    model = Tiny()
    rank0 = [p.detach().clone() for p in model.parameters()]
    dist.broadcast_object_list(obj := [rank0], src=0)
    try:
        ManualDDP(model, verify=True)
        raise AssertionError("verify=True accepted different replicas")
    except ValueError as e:
        assert "seed" in str(e)
    ManualDDP(model)  # broadcasts rank 0's weights
    assert identical_across_ranks(list(model.parameters()))
    close(list(model.parameters()), obj[0], "after construction every rank holds rank 0's weights")
    ManualDDP(model, verify=True)  # now identical: accepted


def main():
    global RANK, WORLD
    dist.init_process_group("gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    n = check_training()
    check_bucket_layout()
    check_no_sync()
    check_forward_bypassed()
    check_construction()
    dist.barrier()
    if RANK == 0:
        print(f"OK ManualDDP == single process == torch DDP ({n} buckets, tied + unused params) on {WORLD} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
