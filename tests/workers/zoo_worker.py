"""Run under torchrun (the suite runs 3 ranks): models not designed for our wrappers, each wrapper against
PyTorch's own, bit for bit: ddp_dropin's ManualDDP against DistributedDataParallel, 07's ZeroDDP against DDP with
ZeroRedundancyOptimizer, 08's fully_shard against PyTorch's fully_shard.

The zoo: an embedding tied to the head, a frozen layer, BatchNorm (an int64 buffer), int32, uint8 and bool
buffers, layers in bfloat16 and float64 beside float32 ones, odd sizes that leave every dtype misaligned in a
byte buffer, a layer only one rank uses and one no rank uses. Each rank builds its model from ITS OWN seed, so
the frozen layer and the buffers differ across ranks until a wrapper makes them agree (as DDP does, from rank 0).
Everything is checked on all ranks of the launch, then again on a group of two.
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import identical_across_ranks, load_script  # noqa: E402

ManualDDP = load_script("ddp_dropin.py").ManualDDP
ZeroDDP = load_script("07_zero.py").ZeroDDP
fsdp = load_script("08_fsdp.py")
DDP = nn.parallel.DistributedDataParallel
VOCAB, D = 37, 13
OPTS = dict(lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)
ME = 0  # this process's rank in the group being checked


class Island(nn.Module):
    """A layer in a dtype of its own (a bf16 adapter, a float64 head), between float32 layers."""

    def __init__(self, d_in, d_out, dtype):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out, dtype=dtype)

    def forward(self, h):
        return self.fc(h.to(self.fc.weight.dtype)).to(h.dtype)


class Zoo(nn.Module):
    """Registered in forward order, so that backward produces gradients in reverse registration order."""

    def __init__(self, solo=False, spare=False, islands=(torch.bfloat16, torch.float64)):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.bn = nn.BatchNorm1d(D)
        self.bf16 = Island(D, 7, islands[0])  # 98 elements: 196 bytes in bf16
        self.fp64 = Island(7, D, islands[1])
        self.solo = nn.Linear(D, D) if solo else None  # used by group rank 0 ("alternating": others every 2nd step)
        self.alternating = solo == "alternating"
        self.spare = nn.Linear(D, 3) if spare else None  # used by no rank
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("seen", torch.zeros(3, dtype=torch.int32))
        self.register_buffer("flags", torch.rand(5) > 0.5)
        self.register_buffer("mark", torch.randint(0, 255, (3,), dtype=torch.uint8))

    def forward(self, x):
        h = self.frozen(self.emb(x))
        h = self.bn(h.flatten(0, 1)).view_as(h)
        h = h + self.fp64(torch.tanh(self.bf16(h)))
        if self.solo is not None and (ME == 0 or self.alternating and self.seen[0] % 2):
            h = h + self.solo(h)
        self.seen += 1
        h = h * (1 + self.flags.float().mean() + self.mark.float().mean() / 255)
        return self.head(h)


def zoo(**kw):
    """Each rank its own seed: without the wrapper's broadcast, frozen weights and buffers would differ."""
    torch.manual_seed(100 + dist.get_rank())
    return Zoo(**kw)


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + ME)
    return torch.randint(0, VOCAB, (4, 9), generator=g)


def loss_of(model, x):
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def bits(a, b):
    """Equal bit for bit (torch.equal alone calls -0.0 and 0.0 equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def assert_same(ours, theirs, what):
    assert ours.keys() == theirs.keys(), (what, ours.keys() ^ theirs.keys())
    for k in ours:
        assert bits(ours[k], theirs[k]), f"{what}: {k} differs"


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def check_manual_ddp(group, steps=4):
    """ManualDDP == DDP: construction (rank 0's frozen weights and buffers everywhere), then every step."""
    fp32 = dict(islands=(torch.float32, torch.float32))  # one dtype, buffers left alone: the frozen layer alone
    configs = [(fp32, dict(broadcast_buffers=False)), ({}, {}),
               (dict(solo="alternating", spare=True), dict(find_unused_parameters=True)),
               ({}, dict(bucket_cap_mb=0.0003, gradient_as_bucket_view=True)),
               (dict(solo=True), dict(static_graph=True, broadcast_buffers=False)),
               ({}, dict(forward_sync_buffers=False))]
    for model_kw, ddp_kw in configs:
        what = f"ManualDDP {model_kw} {ddp_kw}"
        base = zoo(**model_kw)
        ours, theirs = ManualDDP(copy.deepcopy(base), process_group=group, **ddp_kw), \
            DDP(copy.deepcopy(base), process_group=group, **ddp_kw)
        assert_same(state(ours.module), state(theirs.module), f"{what}, construction")
        assert identical_across_ranks([ours.module.frozen.weight], group), f"{what}: frozen weights differ"
        opts = [torch.optim.AdamW(m.parameters(), **OPTS) for m in (ours, theirs)]
        for step in range(steps):
            for model, opt in zip((ours, theirs), opts):
                loss_of(model, batch(step)).backward()
                opt.step()
                opt.zero_grad()
            assert_same(state(ours.module), state(theirs.module), f"{what}, step {step}")
        params = [p for p in ours.parameters() if p.dtype == torch.float32]
        assert identical_across_ranks(params, group), f"{what}: replicas differ"
        # DDP's logging data (Lightning reads it): the keys ours fills hold DDP's values ('dtypes' spelt our way;
        # buckets of several dtypes left over at the end of a rebuild are listed in another order by DDP's C++ map).
        mine, real = ours._get_ddp_logging_data(), theirs._get_ddp_logging_data()
        if "rebuilt_bucket_sizes" in mine:
            mine["rebuilt_bucket_sizes"], real["rebuilt_bucket_sizes"] = (
                sorted(d["rebuilt_bucket_sizes"].split(", ")) for d in (mine, real))
        differ = {k: (v, real.get(k)) for k, v in mine.items()
                  if k not in ("dtypes", "can_set_static_graph") and v != real.get(k)}
        assert not differ, (what, differ)
        # DDP says 0 once the set of unused parameters changed (here: on the ranks that use 'solo' every 2nd step;
        # DDP itself reports it for the first DDP of a process only), else nothing while training.
        assert mine.get("can_set_static_graph") == (0 if model_kw.get("solo") == "alternating" and ME else None)


def check_zero(group, steps=4, cap=0.0004):
    """ZeroDDP, stages 1 and 2 == DDP + AdamW, bit for bit; and == DDP + ZeroRedundancyOptimizer(AdamW), which
    takes one dtype only (so on the zoo with float32 islands)."""
    for islands, sharded in (((torch.bfloat16, torch.float64), False), ((torch.float32, torch.float32), True)):
        base = zoo(solo=True, islands=islands)
        ref = copy.deepcopy(base)
        theirs = DDP(ref, process_group=group, bucket_cap_mb=cap, static_graph=True)
        if sharded:
            opt = ZeroRedundancyOptimizer(list(ref.parameters()), torch.optim.AdamW, process_group=group, **OPTS)
        else:
            opt = torch.optim.AdamW(ref.parameters(), **OPTS)
        zeros = [ZeroDDP(copy.deepcopy(base), torch.optim.AdamW, stage=s, process_group=group, bucket_cap_mb=cap,
                         **OPTS) for s in (1, 2)]
        for z in zeros:
            assert_same(state(z.module), state(ref), "ZeroDDP, construction")
        for step in range(-2, steps):  # two backward passes first: DDP with static_graph settles its buckets
            for model, o in [(theirs, opt)] + [(z, z) for z in zeros]:
                if step >= 0:  # a micro-batch accumulated first: DDP broadcasts no buffers before the next forward
                    with model.no_sync():
                        loss_of(model, batch(100 + step)).backward()
                loss_of(model, batch(step)).backward()
                if step >= 0:
                    o.step()
                o.zero_grad()
            for stage, z in zip((1, 2), zeros):
                assert_same(state(z.module), state(ref), f"ZeroDDP stage {stage} ({type(opt).__name__}), step {step}")


def check_fsdp(group, steps=4):
    """08's fully_shard == PyTorch's: a unit per dtype (fully_shard wants one dtype a unit), then the root."""
    base = zoo(spare=True)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    mesh = DeviceMesh.from_group(group, "cpu")
    for m in (ours.bf16, ours.fp64, ours):
        fsdp.fully_shard(m, process_group=group)
    for m in (theirs.bf16, theirs.fp64, theirs):
        torch_fully_shard(m, mesh=mesh)
    opts = [torch.optim.AdamW(m.parameters(), **OPTS) for m in (ours, theirs)]
    full = StateDictOptions(full_state_dict=True)
    for step in range(steps):
        for model, opt in zip((ours, theirs), opts):
            loss_of(model, batch(step)).backward()
            opt.step()
            opt.zero_grad()
        mine = fsdp.full_state_dict(ours)
        assert_same(mine, {k: v for k, v in get_model_state_dict(theirs, options=full).items()}, f"fsdp step {step}")


def main():
    global ME
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    pair = dist.new_group([0, 1])
    for group in (dist.group.WORLD, pair):
        if dist.get_rank() not in dist.get_process_group_ranks(group):
            continue
        ME = dist.get_rank(group)
        check_manual_ddp(group)
        check_zero(group)
        check_fsdp(group)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"OK the zoo on {world} ranks and on 2: ManualDDP == DDP, ZeroDDP == DDP + ZeroRedundancyOptimizer, "
              "fully_shard == fully_shard, bit for bit", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
