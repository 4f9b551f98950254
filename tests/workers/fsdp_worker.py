"""Run under torchrun (2 or 3 ranks, gloo): 08's fully_shard against PyTorch's on the same data.

A toy model with a tied embedding/head, frozen weights, odd sizes and parameters with fewer rows than ranks (the
script checks a Hugging Face GPT-2 against fully_shard itself; tests/test_fsdp.py runs it). Checked: the shards
(torch.chunk's, plain tensors, fully_shard's local tensors), the gradients and the weights after AdamW steps bit
for bit (fp32, bf16 compute, bf16 with fp32 reduction, gradient accumulation with sync off, clipping, two forward
calls before one backward, activation checkpointing), DDP within float tolerance, the bytes each rank holds and
sends, the units in flight, the order of launches, resuming from full state dicts, bad input. (Ranks hold
identical full weights by construction: each element lives on one rank, and every rank gathers it from there.)
Usage: [ALSO_ZERO=1] torchrun --nproc_per_node=N tests/workers/fsdp_worker.py
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_script  # noqa: E402

fsdp = load_script("08_fsdp.py")
RANK, WORLD = 0, 1
VOCAB, D = 37, 13  # odd sizes: most chunks are uneven and padded


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(1, D))  # fewer rows than ranks: empty chunks
        self.pair = nn.Parameter(torch.randn(2, D))  # on 3 ranks too
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D + 1)
        self.fc2 = nn.Linear(2 * D + 1, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.ln(h)))) * self.gate + 0.1 * self.frozen(h) + self.pair.sum(0)


class Toy(nn.Module):
    def __init__(self, blocks=3, checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint  # activation checkpointing around each block, as large FSDP jobs use it
        self.scale = nn.Parameter(torch.ones(D))  # the root's own, before its children: FSDP's order puts it last
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: sharded once, in the root's unit

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            if self.checkpoint:  # forward again inside backward; FSDP must gather the weights for it
                h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=False)
            else:
                h = b(h)
        return self.head(h * self.scale)


def data(step, rank, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, VOCAB, (4, 9), generator=g)


def loss_of(model, x):
    return F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())


def shard_both(base, group=None, unit_class=fsdp.Unit, **mp):
    """Two copies of base: one sharded by ours, one by PyTorch's fully_shard, block by block, then the root (over
    `group`, default all ranks: ours takes the group, fully_shard a mesh made from it). unit_class: 08's
    CountingUnit where a check reads the bytes it counts."""
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")  # without one: the machine's accelerator
    for m in [*ours.blocks, ours]:
        fsdp.fully_shard(m, process_group=group, unit_class=unit_class, **mp)
    for m in [*theirs.blocks, theirs]:
        torch_fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(**mp))
    return ours, theirs


def bits(a, b):
    """Equal bit for bit (torch.equal alone calls -0.0 and 0.0 equal)."""
    same_kind = a.dtype == b.dtype and a.shape == b.shape
    return same_kind and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def theirs_full(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


class Counted:
    """Counts the collectives our backward issues: the reduce-scatter (on gloo an in-place all-reduce) and the
    all-gathers, by wrapping torch.distributed's functions, which 08 looks up at each call."""

    gathers = ("all_gather_single", "broadcast")  # 08 gathers with broadcasts on gloo
    names = ("reduce_scatter_single", "all_reduce", *gathers)

    def __enter__(self):
        self.calls, self.real = [], {n: getattr(dist, n) for n in self.names}
        for name, fn in self.real.items():
            setattr(dist, name, self.wrap(name, fn))
        return self

    def wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(dist, name, fn)


def check_shards():
    """Rank r keeps torch.chunk(p, N)[r] as a plain tensor parameter, equal to fully_shard's local tensor."""
    torch.manual_seed(0)
    base = Toy()
    ours, theirs = shard_both(base)
    full = dict(base.named_parameters())
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        chunks = torch.chunk(full[name].detach(), WORLD)
        mine = chunks[RANK] if RANK < len(chunks) else full[name][:0]
        assert type(p) is nn.Parameter and not hasattr(p, "to_local"), type(p)
        assert bits(p.detach(), mine) and bits(p.detach(), q.to_local().detach()), name
        assert p.requires_grad == full[name].requires_grad, name
    assert ours.head.weight is ours.emb.weight  # the tie survives
    assert len(list(ours.parameters())) == len(list(base.parameters()))
    empty = [n for n, p in ours.named_parameters() if p.numel() == 0]
    assert (RANK == 0) == (not empty), empty  # gate (1 row) is empty on ranks > 0; pair (2 rows) on rank 2


def check_training(steps=3, accum=1, clip=None, group=None, forwards=1, checkpoint=False, **mp):
    """Gradients after every backward and weights after AdamW (weight decay on): bit for bit fully_shard's.
    forwards=2: two forward calls, then one backward of their summed loss (a unit's weights are gathered again for
    the second graph; autograd sums both graphs' weight gradients before the unit reduces them, once)."""
    torch.manual_seed(1)
    ours, theirs = shard_both(Toy(checkpoint=checkpoint), group, **mp)
    rank = dist.get_rank(group)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
    for step in range(steps):
        for micro in range(accum):
            last = micro == accum - 1
            for m in (ours, theirs):
                m.set_requires_gradient_sync(last)
            with Counted() as counted:
                sum(loss_of(ours, data(step, rank, micro + 5 * k)) / accum for k in range(forwards)).backward()
            sum(loss_of(theirs, data(step, rank, micro + 5 * k)) / accum for k in range(forwards)).backward()
            reduced = [c for c in counted.calls if c not in Counted.gathers]
            if last:  # one reduce per unit (the root's and each block's), nothing before the last micro-batch
                assert len(reduced) == len(fsdp._units(ours)), counted.calls
            else:
                assert not reduced and all(p.grad is None for p in ours.parameters()), counted.calls
        for p, q in zip(ours.parameters(), theirs.parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or bits(p.grad, q.grad.to_local()))
        if clip:
            a = fsdp.clip_grad_norm_(ours.parameters(), clip)
            b = nn.utils.clip_grad_norm_(theirs.parameters(), clip).full_tensor()
            assert bits(a, b), (a, b)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    a, b = fsdp.full_state_dict(ours), theirs_full(theirs)
    assert a.keys() == b.keys() == Toy().state_dict().keys()
    differ = [k for k in a if not bits(a[k], b[k])]
    assert not differ, f"{mp} accum={accum} clip={clip}: ours != fully_shard in {differ}"
    return a


def check_against_ddp(ours_state, steps=3):
    """fp32, no accumulation: equal to PyTorch's DDP within float tolerance (it sums, then divides)."""
    torch.manual_seed(1)
    model = Toy()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        loss_of(ddp, data(step, RANK)).backward()
        opt.step()
        opt.zero_grad()
    gap = max((ours_state[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert gap < 1e-5, gap
    return gap


def check_clip_against_full_model():
    """The global norm over shards equals clip_grad_norm_ over one process's full gradients (all ranks' data)."""
    torch.manual_seed(2)
    base = Toy()
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    for m in [*ours.blocks, ours]:
        fsdp.fully_shard(m)
    loss_of(ours, data(7, RANK)).backward()
    (sum(loss_of(ref, data(7, r)) for r in range(WORLD)) / WORLD).backward()
    a, b = fsdp.clip_grad_norm_(ours.parameters(), 0.1), nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert torch.allclose(a, b, rtol=1e-5), (a, b)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        if p.grad is not None:
            chunks = torch.chunk(q.grad, WORLD)
            mine = chunks[RANK] if RANK < len(chunks) else q.grad[:0]
            assert torch.allclose(p.grad, mine, rtol=1e-4, atol=1e-7), name
    return a.item()


def storages(tensors):
    """Bytes of the storages behind tensors, each once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def check_memory_and_traffic():
    """Held bytes from the tensors: 1/N of the model (up to padding) and equal to fully_shard's; at most the root
    and two blocks gathered at once; bytes sent equal to fully_shard's (counted through its custom comm hooks)."""
    torch.manual_seed(3)
    base = Toy(blocks=4)
    ours, theirs = shard_both(base, unit_class=fsdp.CountingUnit)  # it counts the bytes it sends
    numel = sum(p.numel() for p in base.parameters())
    padded = sum(-(-len(p) // WORLD) * p[0].numel() for p in base.parameters())
    units = fsdp._units(ours)
    assert sum(u.flat.numel() for u in units) == padded <= numel / WORLD + sum(p[0].numel() for p in base.parameters())
    assert storages(p for p in ours.parameters()) == 4 * padded  # the shards are views of each unit's buffer
    assert sum(p.numel() for p in ours.parameters()) == sum(q.to_local().numel() for q in theirs.parameters())
    in_flight, unshard = [], fsdp.Unit.unshard

    def watched(unit, wait=True):
        unshard(unit, wait)
        in_flight.append(sum(u.full[0].untyped_storage().nbytes() > 0 or u.gather is not None for u in units))
    fsdp.Unit.unshard = watched
    counted = {"bytes": 0}

    class AllGather:
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            counted["bytes"] += output_tensor.nbytes * (WORLD - 1) // WORLD
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

    class ReduceScatter(AllGather):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            counted["bytes"] += input_tensor.nbytes * (WORLD - 1) // WORLD
            return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
    for m in [*theirs.blocks, theirs]:
        m.set_custom_all_gather(AllGather())
        m.set_custom_reduce_scatter(ReduceScatter())
    try:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
        for step in range(2):
            for m, opt in zip((ours, theirs), opts):
                loss_of(m, data(step, RANK)).backward()
                if step == 1 and m is ours:
                    grads = storages(p.grad for p in ours.parameters() if p.grad is not None)
                    trainable = sum(-(-len(p) // WORLD) * p[0].numel() for p in base.parameters() if p.requires_grad)
                    assert grads == 4 * trainable, (grads, trainable)  # views of the reduce-scatter outputs
                opt.step()
                opt.zero_grad()
    finally:
        fsdp.Unit.unshard = unshard
    assert max(in_flight) <= 3, in_flight  # the root (kept after forward), the current block, the next one
    state = [v for s in opts[0].state.values() for v in s.values() if v.dim()]
    assert sum(v.numel() for v in state) == 2 * sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert ours.fsdp_unit.sent == counted["bytes"] > 0, (ours.fsdp_unit.sent, counted)
    return padded, numel


class TracedUnit(fsdp.Unit):
    """08's Unit, also recording forwards, backwards and launches in the order they happen (on the root: the last
    step's). Every override calls Unit's own."""

    def pre_forward(self, module, args, kwargs):
        if self.root is None or self.root is self:  # the root, starting a forward: a new step's record
            self.events = []
        args, kwargs = super().pre_forward(module, args, kwargs)
        self.root.events.append(f"forward {self.name}")
        return args, kwargs

    def pre_backward(self, grad):
        starts = self.state != "backward"  # not when another of its outputs started it
        super().pre_backward(grad)  # launches the previous unit's all-gather first
        if starts:
            self.root.events.append(f"backward {self.name}")

    def start_gather(self):
        self.root.events.append(f"all-gather {self.name}")
        return super().start_gather()

    def start_reduce(self, rows):
        self.root.events.append(f"reduce-scatter {self.name}")
        return super().start_reduce(rows)


def check_launch_order():
    """The next unit's all-gather is launched before the current one computes, forward and backward, and each
    block's reduce-scatter is launched while backward goes on."""
    torch.manual_seed(4)
    model = Toy(blocks=4)
    for m in [*model.blocks, model]:
        fsdp.fully_shard(m, unit_class=TracedUnit)  # it records the events
    for step in range(2):  # the second step shows the steady state
        loss_of(model, data(step, RANK)).backward()
    ev = model.fsdp_unit.events
    split = ev.index("forward blocks.3") + 1
    fwd, bwd = {e: i for i, e in enumerate(ev[:split])}, {e: i for i, e in enumerate(ev[split:])}
    assert len(fwd) == split and len(bwd) == len(ev) - split, ev  # each unit gathered once per pass
    order = ["root"] + [f"blocks.{i}" for i in range(4)]
    for a, b in zip(order, order[1:]):
        assert fwd[f"all-gather {b}"] < fwd[f"forward {a}"], ev  # forward prefetch
    for a, b in zip(order[2:], order[1:]):
        assert bwd[f"all-gather {b}"] < bwd[f"backward {a}"], ev  # backward prefetch, in reverse
    for i in range(1, 4):  # launched when block i's backward is done, before block i - 1's begins
        assert bwd[f"backward blocks.{i}"] < bwd[f"reduce-scatter blocks.{i}"] < bwd[f"backward blocks.{i - 1}"], ev
    assert ev[0] == "all-gather root" and ev[-1] == "reduce-scatter root", ev  # the root: first in, last out
    return ev


def check_resume(steps=4, stop=2):
    """Weights from full_state_dict and AdamW's from full_optim_state_dict, loaded into a fresh sharded model:
    training on from there ends bit for bit where training without a stop ends."""
    torch.manual_seed(5)
    base = Toy()

    def sharded():
        model = copy.deepcopy(base)
        for m in [*model.blocks, model]:
            fsdp.fully_shard(m)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def train(model, opt, steps):
        for step in steps:
            loss_of(model, data(step, RANK)).backward()
            opt.step()
            opt.zero_grad()
    whole, opt = sharded()
    train(whole, opt, range(steps))
    first, opt = sharded()
    train(first, opt, range(stop))
    ckpt = {"model": fsdp.full_state_dict(first), "optimizer": fsdp.full_optim_state_dict(first, opt)}
    assert ckpt["model"].keys() == base.state_dict().keys()
    resumed, opt = sharded()
    fsdp.load_full_state_dict(resumed, ckpt["model"])
    fsdp.load_full_optim_state_dict(resumed, opt, ckpt["optimizer"])
    assert all(bits(a, b) for a, b in zip(resumed.parameters(), first.parameters()))
    train(resumed, opt, range(stop, steps))
    a, b = fsdp.full_state_dict(resumed), fsdp.full_state_dict(whole)
    assert all(bits(a[k], b[k]) for k in a), "resumed != uninterrupted"


def check_reshard(pair, steps=2):
    """A full state written by 2 ranks resumes on 3, and one written by 3 on 2: ours takes its chunks by hand,
    fully_shard gets them from PyTorch's distributed checkpoint (DCP). Checked bit for bit at every hand-over: our
    full state is DCP's for fully_shard (names, tensors, AdamW's step and moments), it comes back unchanged from
    the new number of ranks, and ours and fully_shard train on from it to the same weights and state."""
    torch.manual_seed(6)
    base, state, mine = Toy(), None, None
    for phase, group in enumerate((pair, None, pair)):  # None: all 3 ranks
        if group is None or RANK < 2:
            ours, theirs = shard_both(base, group)
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
            if state:
                fsdp.load_full_state_dict(ours, state["model"])
                fsdp.load_full_optim_state_dict(ours, opts[0], state["optimizer"])
                set_state_dict(theirs, opts[1], model_state_dict=dict(state["model"]),
                               optim_state_dict=copy.deepcopy(state["optimizer"]),
                               options=StateDictOptions(full_state_dict=True))
                assert fsdp.same_bits(full_states(ours, theirs, opts), state), f"phase {phase}: resharding changed it"
            for step in range(phase * steps, (phase + 1) * steps):
                for m, opt in zip((ours, theirs), opts):
                    loss_of(m, data(step, dist.get_rank(group))).backward()
                    opt.step()
                    opt.zero_grad()
            mine = full_states(ours, theirs, opts)
        box = [mine if RANK == 0 else None]  # what the next phase's ranks read from rank 0's checkpoint
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    steps_taken = state["optimizer"]["state"]["blocks.0.gate"]["step"].item()
    assert steps_taken == 3 * steps, steps_taken  # AdamW's step count went through every hand-over


def full_states(ours, theirs, opts):
    """Our full weights and AdamW state, checked equal to DCP's get_state_dict of fully_shard's."""
    a = {"model": fsdp.full_state_dict(ours), "optimizer": fsdp.full_optim_state_dict(ours, opts[0])}
    model, optim = get_state_dict(theirs, opts[1], options=StateDictOptions(full_state_dict=True))
    assert fsdp.same_bits(a, {"model": model, "optimizer": optim}), "ours != DCP's full state of fully_shard"
    return a


def check_bad_input():
    """One clear error for each, as PyTorch's: an unknown keyword, a module sharded twice, a tie across units."""
    errors = []
    for attempt in ("keyword", "twice", "tie"):
        model = Toy(blocks=1)
        try:
            if attempt == "keyword":
                fsdp.fully_shard(model, mp_policy=MixedPrecisionPolicy())
            elif attempt == "twice":
                fsdp.fully_shard(model.blocks[0])
                fsdp.fully_shard(model.blocks[0])
            else:
                model.blocks[0].fc1.weight = model.head.weight = nn.Parameter(torch.randn(2 * D + 1, D))
                fsdp.fully_shard(model.blocks[0])
                fsdp.fully_shard(model)
            raise AssertionError(f"{attempt}: accepted")
        except (TypeError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    assert errors[0].startswith("TypeError") and "mp_policy" in errors[0], errors
    assert "sharded already" in errors[1] and "shared with" in errors[2], errors
    return errors


def checks():
    """Every check, on the default group (initialised by the caller); returns the OK line."""
    global RANK, WORLD
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    check_shards()
    fp32 = check_training()
    check_training(accum=3, clip=0.3)
    check_training(param_dtype=torch.bfloat16)
    check_training(steps=2, forwards=2, checkpoint=True)
    check_training(accum=2, clip=0.3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pair = dist.new_group([0, 1])  # and fp32 on 2 ranks, a pair within this launch (the sums of two terms)
    if RANK < 2:
        check_training(accum=2, group=pair)
    gap = check_against_ddp(fp32)
    check_clip_against_full_model()
    padded, numel = check_memory_and_traffic()
    check_launch_order()
    check_resume()
    check_reshard(pair)
    check_bad_input()
    dist.barrier()
    return (f"OK 08 == fully_shard bit for bit on {WORLD} ranks (fp32, bf16, accumulation, clipping, two forwards "
            f"and activation checkpointing, resume, 2 -> 3 -> 2 ranks through full state and DCP) and "
            f"on a pair (fp32, accumulation); "
            f"DDP within {gap:.1e}; each rank holds {padded} of {numel} elements")


def main():
    """This file alone; with ALSO_ZERO=1 zero_worker's checks first, in the same launch (the suite's way: one
    launch, one import of torch per rank, for the two lessons that shard)."""
    dist.init_process_group("gloo")
    said = []
    if os.environ.get("ALSO_ZERO") == "1":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import zero_worker
        said.append(zero_worker.checks())
    said.append(checks())
    if dist.get_rank() == 0:
        print("\n".join(said), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
