"""Run under torchrun (2-3 ranks): ZeroDDP stages 1 and 2 equal PyTorch's DDP + the same optimizer. (The suite
runs these checks inside fsdp_worker's 3-rank launch.)

The model has a tied embedding/head, a frozen layer, odd sizes, a bias with fewer elements than ranks, a 0-dim
parameter and a layer only one rank uses; buckets are tiny, so shards start and end inside tensors. Checked, with
AdamW (weight decay on matrices only) over several steps: averaged gradients and weights bit-identical to DDP's,
ranks bit-identical, SGD too, stage 1 equal to torch's ZeroRedundancyOptimizer, per-rank optimizer-state and
gradient bytes 1/N of DDP's (up to padding), checkpoints in AdamW's own format both ways, resume equal to
uninterrupted, gradient accumulation (no_sync, and backward calls adding up), a process group, and bad input as
one clear error.
"""

import copy
import io
import itertools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import identical_across_ranks, load_script  # noqa: E402

ZeroDDP = load_script("07_zero.py").ZeroDDP
RANK, WORLD = 0, 1
CAP = 0.0004  # MiB: ~100 floats per bucket, so most shards start or end inside a tensor
OPTS = dict(lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5))  # a 0-dim parameter (a temperature, CLIP's logit scale)

    def forward(self, x):
        return x * self.t


class Toy(nn.Module):
    """Registered in the order backward reaches them, reversed, as in GPT-2: then DDP's settled bucket layout
    (gradient arrival order) is the reverse registration order that ZeroDDP uses from the start."""

    def __init__(self, vocab=29, d=13):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(d, 17), nn.Tanh(), nn.Linear(17, d), nn.Tanh())
        self.neck = nn.Sequential(nn.Linear(d, 1), nn.Tanh(), nn.Linear(1, d))  # a bias of 1 element < N ranks
        self.extra = nn.Linear(d, d)  # used on one rank only: elsewhere its gradient counts as zero in the mean
        self.extra_rank = 0
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter
        self.scale = Scale()

    def forward(self, x):
        h = self.body(self.frozen(self.emb(x)))
        h = h + self.neck(h)
        if RANK == self.extra_rank:
            h = h + self.extra(h)
        return self.scale(self.head(h))


def groups(model):
    """Two groups, as a training script would make them; the frozen weight is listed too, as AdamW allows."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2]},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randint(0, 29, (4, 9), generator=g)


def loss_of(model, data):
    return F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())


def ddp(model):
    # static_graph: 'extra' is unused on ranks > 0, always; DDP then settles its buckets in gradient arrival order.
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=CAP, static_graph=True)


def warm_up(wrapped, opt):
    """Two backward passes, no step: PyTorch's DDP with static_graph settles its bucket layout in them (before,
    it packs its buckets in forward order), so that each step after compares like with like."""
    for k in (998, 999):
        loss_of(wrapped, batch(k)).backward()
        opt.zero_grad()


def train(wrapped, opt, steps, start=0):
    """``steps`` optimizer steps from ``start``, after the warm-up."""
    warm_up(wrapped, opt)
    for step in range(start, start + steps):
        loss_of(wrapped, batch(step)).backward()
        opt.step()
        opt.zero_grad()


def weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def storage_bytes(tensors):
    """Bytes of the distinct storages behind ``tensors``: what is really held."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def per_element_bytes(state):
    """AdamW's two moments: all of its state but the step counts."""
    return sum(v.nbytes for s in state.values() for k, v in s.items() if k != "step")


def equal_states(a, b):
    """Two optimizer state_dicts hold the same numbers, bit for bit."""
    assert a["state"].keys() == b["state"].keys(), (sorted(a["state"]), sorted(b["state"]))
    for i, s in a["state"].items():
        assert s.keys() == b["state"][i].keys(), (i, s.keys(), b["state"][i].keys())
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v).cpu(), torch.as_tensor(b["state"][i][k]).cpu()), (i, k)


def check_equals_ddp(base, stage, steps=4):
    """Every step's averaged gradients and the final weights and checkpoint equal DDP + AdamW's, bit for bit."""
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    torch_ddp, opt = ddp(ref), torch.optim.AdamW(groups(ref), **OPTS)
    zero = ZeroDDP(ours, torch.optim.AdamW, stage=stage, bucket_cap_mb=CAP, params=groups(ours), **OPTS)
    starts = [set(itertools.accumulate([0] + b.numels)) for b in zero.buckets]  # where tensors start, per bucket
    assert any(k * b.shard not in s for b, s in zip(zero.buckets, starts) for k in range(1, WORLD)), "no cut inside"
    number = {p: i for i, p in enumerate(zero.params)}
    ref_params = [p for g in groups(ref) for p in g["params"]]
    launched, real_finish = [], zero._finish

    def finish():  # how many buckets the hooks had launched when backward ended
        launched.append(zero._next)
        real_finish()
    zero._finish = finish

    warm_up(torch_ddp, opt)
    warm_up(zero, zero)
    for step in range(steps):
        for wrapped in (torch_ddp, zero):
            loss_of(wrapped, batch(step)).backward()
        # The averaged gradient of every piece of this rank's shard == DDP's for that slice, bit for bit.
        for piece, i, off in zero.pieces:
            assert torch.equal(piece.grad, ref_params[i].grad.reshape(-1)[off : off + piece.numel()]), (stage, i)
        ddp_grads = storage_bytes(p.grad for p in ref_params if p.grad is not None)
        for o in (opt, zero):
            o.step()
            o.zero_grad()
    assert torch.equal(weights(ours), weights(ref)), f"stage {stage}: weights != DDP + AdamW's"
    # Communication overlapped backward: buckets went out from the hooks, before backward was over. (Not on the
    # ranks that do not use 'extra': its bucket is the first, and buckets go out in order.)
    assert len(launched) == steps + 2 and (RANK != 0 or min(launched) >= len(zero.buckets) - 1), launched
    assert identical_across_ranks([weights(ours)]), f"stage {stage}: ranks differ"
    assert number[ours.frozen.weight] in zero.numbers[0] and not any(
        t[1] == number[ours.frozen.weight] for t in zero.pieces), "the frozen weight must stay out of the shards"
    # The checkpoint: gathered to rank 0, it is AdamW's own state_dict under DDP, bit for bit.
    ours_sd, ref_sd = zero.state_dict(), opt.state_dict()
    if RANK == 0:
        assert ours_sd["param_groups"] == ref_sd["param_groups"], (ours_sd["param_groups"], ref_sd["param_groups"])
        equal_states(ours_sd, ref_sd)
    else:
        assert ours_sd is None
    return opt, zero, ddp_grads


def check_memory(zeros, ddp_opt, ddp_grads):
    """Optimizer state and (stage 2) gradients held per rank are 1/N of DDP's, up to the padding, measured on the
    tensors actually held; every element's state is held by exactly one rank."""
    ddp_state = per_element_bytes(ddp_opt.state)
    for stage, zero in zeros.items():
        padding = 4 * sum(b.flat.numel() - b.used for b in zero.buckets)  # fewer than N floats per bucket
        state = per_element_bytes(zero.optim.state)
        total = torch.tensor([state])
        dist.all_reduce(total)
        assert total.item() == ddp_state, (stage, total.item(), ddp_state)  # nothing twice, nothing missing
        assert abs(state - ddp_state / WORLD) <= 2 * padding, (stage, state, ddp_state / WORLD)
        held = storage_bytes(piece.grad for piece, _, _ in zero.pieces)
        want = (ddp_grads + padding) / (WORLD if stage == 2 else 1)
        assert held == want, (stage, held, want)
        assert all(p.grad is None for p in zero.module.parameters()), "autograd's gradients must be freed"


def check_zero_redundancy_optimizer(base, steps=4):
    """Stage 1 == torch's ZeroRedundancyOptimizer over torch's DDP, weights and consolidated state, bit for bit."""
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    theirs = ZeroRedundancyOptimizer(list(a.parameters()), torch.optim.AdamW, **OPTS)
    train(ddp(a), theirs, steps)
    zero = ZeroDDP(b, torch.optim.AdamW, stage=1, bucket_cap_mb=CAP, **OPTS)  # params=None: module.parameters()
    train(zero, zero, steps)
    assert torch.equal(weights(a), weights(b)), "stage 1 != ZeroRedundancyOptimizer"
    theirs.consolidate_state_dict(to=0)
    ours_sd = zero.state_dict()
    if RANK == 0:
        equal_states(ours_sd, theirs.state_dict())


def check_checkpoints(base, stage, k=3, m=3):
    """ZeRO's checkpoint resumes under ZeRO and under DDP + plain AdamW; a plain AdamW checkpoint resumes under
    ZeRO; each equals the uninterrupted run, bit for bit."""
    whole = copy.deepcopy(base)
    zero = ZeroDDP(whole, torch.optim.AdamW, stage=stage, bucket_cap_mb=CAP, params=groups(whole), **OPTS)
    train(zero, zero, k + m)

    def saved(model, opt):
        """The bytes rank 0 would write to disk, on every rank; torch.load them once per use (a loaded optimizer
        keeps tensors of the state_dict it was given, and steps them)."""
        sd = opt.state_dict()
        buf = [None]
        if RANK == 0:
            f = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": sd}, f)
            buf[0] = f.getvalue()
        dist.broadcast_object_list(buf, src=0)
        return buf[0]

    half = copy.deepcopy(base)
    first = ZeroDDP(half, torch.optim.AdamW, stage=stage, bucket_cap_mb=CAP, params=groups(half), **OPTS)
    train(first, first, k)
    blob = saved(half, first)
    torch.manual_seed(123)
    for resume_with_zero in (True, False):
        ckpt = torch.load(io.BytesIO(blob))
        fresh = Toy()  # other initial weights: all must come from the checkpoint
        fresh.load_state_dict(ckpt["model"])
        if resume_with_zero:
            wrapped = opt = ZeroDDP(fresh, torch.optim.AdamW, stage=stage, bucket_cap_mb=CAP, params=groups(fresh),
                                    **OPTS)
        else:
            wrapped, opt = ddp(fresh), torch.optim.AdamW(groups(fresh), **OPTS)
        opt.load_state_dict(ckpt["optimizer"])
        train(wrapped, opt, m, start=k)
        assert torch.equal(weights(fresh), weights(whole)), f"stage {stage}: resumed (zero={resume_with_zero})"
    # The other way: a checkpoint of DDP + plain AdamW, resumed under ZeRO.
    plain = copy.deepcopy(base)
    wrapped, opt = ddp(plain), torch.optim.AdamW(groups(plain), **OPTS)
    train(wrapped, opt, k)
    ckpt = torch.load(io.BytesIO(saved(plain, opt)))
    train(wrapped, opt, m, start=k)
    fresh = Toy()
    fresh.load_state_dict(ckpt["model"])
    zero = ZeroDDP(fresh, torch.optim.AdamW, stage=stage, bucket_cap_mb=CAP, params=groups(fresh), **OPTS)
    zero.load_state_dict(ckpt["optimizer"])
    train(zero, zero, m, start=k)
    assert torch.equal(weights(fresh), weights(plain)), f"stage {stage}: plain AdamW checkpoint resumed under ZeRO"


def check_sgd(base, steps=3):
    """Another elementwise optimizer, whose state has no step count: SGD with momentum and weight decay."""
    opts = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.SGD(a.parameters(), **opts)
    train(ddp(a), opt, steps)
    zero = ZeroDDP(b, torch.optim.SGD, stage=2, bucket_cap_mb=CAP, **opts)
    train(zero, zero, steps)
    assert torch.equal(weights(a), weights(b)), "SGD: stage 2 != DDP + SGD"
    sd = zero.state_dict()
    if RANK == 0:
        assert sd["param_groups"] == opt.state_dict()["param_groups"]
        equal_states(sd, opt.state_dict())


def check_accumulation(base, stage, steps=3):
    """Gradient accumulation as DDP does it, in both ways: a micro-batch inside no_sync() (autograd sums locally,
    the next backward reduces the sum) and two backward calls, each reduced, adding up until zero_grad(). Bit for
    bit DDP's, except two reduced backwards in stage 2: each rank holds only its shard of the last mean, so it
    adds the new mean to it where DDP reduces (last mean + new gradient); equal within rounding."""
    ref, ours = copy.deepcopy(base), copy.deepcopy(base)
    torch_ddp, opt = ddp(ref), torch.optim.AdamW(groups(ref), **OPTS)
    zero = ZeroDDP(ours, torch.optim.AdamW, stage=stage, bucket_cap_mb=CAP, params=groups(ours), **OPTS)
    warm_up(torch_ddp, opt)
    warm_up(zero, zero)
    for step in range(steps):
        for wrapped, o in ((torch_ddp, opt), (zero, zero)):
            with wrapped.no_sync():
                loss_of(wrapped, batch(100 + step)).backward()
            for micro in range(2):
                loss_of(wrapped, batch(200 + 2 * step + micro)).backward()
            o.step()
            o.zero_grad()
    if stage == 1:
        assert torch.equal(weights(ours), weights(ref)), "accumulation: stage 1 != DDP + AdamW"
    else:
        assert torch.allclose(weights(ours), weights(ref), rtol=0, atol=1e-5), "accumulation: stage 2 != DDP"
    assert identical_across_ranks([weights(ours)]), f"accumulation, stage {stage}: ranks differ"


def check_state_dict_before_a_step(base):
    """No step yet: the checkpoint is an AdamW state_dict with groups and no state, as AdamW's own."""
    model = copy.deepcopy(base)
    zero = ZeroDDP(model, torch.optim.AdamW, bucket_cap_mb=CAP, params=groups(model), **OPTS)
    sd = zero.state_dict()
    assert RANK != 0 or sd == torch.optim.AdamW(groups(copy.deepcopy(base)), **OPTS).state_dict(), sd


def check_process_group(base, steps=3):
    """On a group of the last two ranks: equal to DDP on that group; the checkpoint goes to the group's rank 0."""
    group = dist.new_group([WORLD - 2, WORLD - 1])  # every rank creates it, only its members use it
    if RANK < WORLD - 2:
        return
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    a.extra_rank = b.extra_rank = WORLD - 2  # some rank of the group must use it: one no rank uses DDP leaves alone
    wrapped = nn.parallel.DistributedDataParallel(a, bucket_cap_mb=CAP, static_graph=True, process_group=group)
    opt = torch.optim.AdamW(groups(a), **OPTS)
    train(wrapped, opt, steps)
    zero = ZeroDDP(b, torch.optim.AdamW, process_group=group, bucket_cap_mb=CAP, params=groups(b), **OPTS)
    train(zero, zero, steps)
    assert torch.equal(weights(a), weights(b)), "on a process group: weights != DDP + AdamW's"
    sd = zero.state_dict()
    assert (sd is None) == (RANK != WORLD - 2), (RANK, sd is None)
    if sd is not None:
        equal_states(sd, opt.state_dict())


def check_bad_input(base):
    for kwargs, error, says in [(dict(stage=3), ValueError, "stage must be 1 or 2"),
                                (dict(lrr=0.1), TypeError, "unexpected keyword argument 'lrr'"),
                                (dict(bucket_cap_mb=0), ValueError, "bucket_cap_mb must be positive")]:
        try:
            ZeroDDP(copy.deepcopy(base), torch.optim.AdamW, **kwargs)
            raise AssertionError(f"{kwargs} accepted")
        except error as e:
            assert says in str(e), (kwargs, e)


def checks():
    """Every check, on the default group (initialised by the caller); returns the OK line."""
    global RANK, WORLD
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = Toy()
    assert min(p.numel() for p in base.parameters()) < max(WORLD, 3)
    check_bad_input(base)
    check_state_dict_before_a_step(base)
    check_process_group(base)
    zeros = {}
    for stage in (1, 2):
        ref_opt, zeros[stage], ddp_grads = check_equals_ddp(base, stage)
    check_memory(zeros, ref_opt, ddp_grads)
    check_zero_redundancy_optimizer(base)
    check_sgd(base)
    for stage in (1, 2):
        check_checkpoints(base, stage)
        check_accumulation(base, stage)
    dist.barrier()
    return (f"OK ZeroDDP stages 1 and 2 == DDP + AdamW bit for bit on {WORLD} ranks "
            f"({len(zeros[2].buckets)} buckets; tied, frozen, odd and tiny parameters); SGD too; stage 1 "
            f"== ZeroRedundancyOptimizer; state and gradients 1/N; checkpoints resume both ways; accumulation")


def main():
    dist.init_process_group("gloo")
    said = checks()
    if dist.get_rank() == 0:
        print(said, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
