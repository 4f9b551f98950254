"""Run under torchrun (2 or 3 ranks): code written for PyTorch's DDP runs unchanged on ManualDDP, same results.

Each check trains ManualDDP and torch.nn.parallel.DistributedDataParallel side by side on the same data and
compares them bit for bit: the nanoGPT accumulation pattern (counting collectives), BatchNorm buffers, a subgroup,
PyTorch's communication hooks and our hand-written one, uneven inputs under join(), skipped unused buckets, the
delayed all-reduce, and the error for a gradient that becomes ready twice.
"""

import copy
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import identical_across_ranks, load_script  # noqa: E402

lesson = load_script("05_manual_ddp_gpt2.py")
ManualDDP, DDP = lesson.ManualDDP, nn.parallel.DistributedDataParallel
RANK, WORLD = 0, 1


class Net(nn.Module):
    def __init__(self, d=32, bn=False, reentrant=False):
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(8, d), nn.Linear(d, d), nn.Linear(d, 4)
        self.bn = nn.BatchNorm1d(d) if bn else None
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.bn is not None:
            h = self.bn(h)
        if self.reentrant:  # self.mid inside a reentrant checkpoint AND outside it: its gradient is ready twice
            h = checkpoint(self.mid, h, use_reentrant=True) + self.mid(h)
        else:
            h = h + torch.tanh(self.mid(h))
        return self.out(h)


def data(step, rank, micro=0, n=6):
    g = torch.Generator().manual_seed(100 * step + 10 * rank + micro)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def step_of(model, step, rank, micro=0):
    x, y = data(step, rank, micro)
    F.mse_loss(model(x), y).backward()


def pair(base, **kw):
    """The same weights wrapped by ManualDDP and by DDP, with an SGD each."""
    ours, theirs = ManualDDP(copy.deepcopy(base), **kw), DDP(copy.deepcopy(base), **kw)
    return [(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in (ours, theirs)]


def assert_same(a, b, what):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), f"{what}: {name} differs by {(x.float() - y.float()).abs().max().item():.3g}"


class Counting:
    """Counts the collectives issued through torch.distributed while active."""

    names = ("all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor")

    def __enter__(self):
        self.calls, self.saved = [], {n: getattr(dist, n) for n in self.names}
        for n, fn in self.saved.items():
            setattr(dist, n, self._counted(n, fn))
        return self

    def _counted(self, name, fn):
        def wrapper(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(dist, n, fn)


def check_accumulation(k=4):
    """nanoGPT's loop: require_backward_grad_sync = (last micro-step). No communication before the last one."""
    torch.manual_seed(0)
    (ours, opt), (theirs, topt) = pair(Net())
    for step in range(3):
        for model, o in ((ours, opt), (theirs, topt)):
            for micro in range(k):
                model.require_backward_grad_sync = micro == k - 1
                if model is ours:
                    with Counting() as c:
                        step_of(model, step, RANK, micro)
                    assert bool(c.calls) == (micro == k - 1), (micro, c.calls)
                    if micro == k - 2:  # still local: each rank holds the sum of its own micro-batches only
                        assert not identical_across_ranks([p.grad for p in model.parameters()])
                else:
                    step_of(model, step, RANK, micro)
            o.step()
            o.zero_grad()
        assert_same(ours, theirs, f"accumulation, step {step}")


def check_buffers():
    """BatchNorm statistics: rank 0's reach every rank before each forward (DDP's default), or stay per rank."""
    for flag in (True, False):
        torch.manual_seed(1)
        (ours, opt), (theirs, topt) = pair(Net(bn=True), broadcast_buffers=flag)
        for step in range(3):
            for model, o in ((ours, opt), (theirs, topt)):
                if step == 1:  # a no_sync step in between: as in DDP, the next forward does not broadcast
                    with model.no_sync():
                        step_of(model, 7, RANK)
                step_of(model, step, RANK)
                o.step()
                o.zero_grad()
        for model in (ours, theirs):
            model.eval()
            with torch.no_grad():
                model(data(9, RANK)[0])
        assert_same(ours, theirs, f"buffers, broadcast_buffers={flag}")
        assert identical_across_ranks(list(ours.module.buffers())) == flag


def check_subgroup():
    """process_group: ranks 1 and 2 of 3 train together; rank 1 is the group's 'rank 0'."""
    group = dist.new_group([1, 2])
    if RANK == 0:
        return
    torch.manual_seed(RANK)  # different replicas: the group's first member (global rank 1) must win
    base = Net()
    rank1 = [p.detach().clone() for p in base.parameters()]
    dist.broadcast_object_list(rank1, src=1, group=group)
    (ours, opt), (theirs, topt) = pair(base, process_group=group)
    assert all(torch.equal(p, q) for p, q in zip(ours.module.parameters(), rank1))
    for step in range(3):
        for model, o in ((ours, opt), (theirs, topt)):
            step_of(model, step, RANK)
            o.step()
            o.zero_grad()
        assert_same(ours, theirs, f"subgroup, step {step}")


def check_comm_hooks():
    """PyTorch's own hooks run unchanged on ManualDDP; ours (05's bf16_compress_hook) equals PyTorch's.

    (PowerSGD is not among them here: on gloo it deadlocks with PyTorch's own DDP too, because it issues its second
    all-reduce from the completion callback of the first. tests/test_gpu.py runs it on NCCL.)"""
    hooks = [(None, default_hooks.allreduce_hook), (None, default_hooks.fp16_compress_hook),
             (None, default_hooks.bf16_compress_hook)]
    results = {}
    for state, hook in hooks + [(None, lesson.bf16_compress_hook)]:
        torch.manual_seed(2)
        (ours, opt), (theirs, topt) = pair(Net(d=40), bucket_cap_mb=0.004)
        ours.register_comm_hook(state, hook)
        ref_hook = default_hooks.bf16_compress_hook if hook is lesson.bf16_compress_hook else hook
        theirs.register_comm_hook(state, ref_hook)
        for step in range(5):
            for model in (ours, theirs):
                step_of(model, step, RANK)
                if hook is lesson.bf16_compress_hook and WORLD != 2 and model is theirs:
                    # x/3 rounded to float32, then to bfloat16 (ours: divide first) against bfloat16(x)/3 (PyTorch's:
                    # cast first): each rank's term may differ by a bfloat16 rounding, 2^-8 of the largest term.
                    for p, q in zip(ours.parameters(), theirs.parameters()):
                        bound = WORLD * 2 ** -8 * q.grad.abs().max().item()
                        assert (p.grad - q.grad).abs().max().item() <= bound, (hook.__name__, step)
            for o in (opt, topt):
                o.step()
                o.zero_grad()
            if hook is lesson.bf16_compress_hook and WORLD != 2:
                for p, q in zip(ours.parameters(), theirs.parameters()):
                    p.data.copy_(q.data)  # compare the next step from the same weights
            else:
                assert_same(ours, theirs, f"{hook.__name__}, step {step}")
        results[hook.__name__ + str(hook is lesson.bf16_compress_hook)] = ours
    plain = results["allreduce_hookFalse"]
    for name in ("fp16_compress_hookFalse", "bf16_compress_hookFalse"):
        assert any(not torch.equal(p, q) for p, q in zip(plain.parameters(), results[name].parameters())), name


def check_join(divide_by_initial=True):
    """Uneven inputs: rank r has 2 + r batches. Ranks that run out shadow the others; all end identical."""
    torch.manual_seed(3)
    (ours, opt), (theirs, topt) = pair(Net(bn=True))
    with ours.join(divide_by_initial_world_size=divide_by_initial):
        for step in range(2 + RANK):
            step_of(ours, step, RANK)
            opt.step()
            opt.zero_grad()
    with Join([theirs], divide_by_initial_world_size=divide_by_initial):
        for step in range(2 + RANK):
            step_of(theirs, step, RANK)
            topt.step()
            topt.zero_grad()
    assert_same(ours, theirs, f"join, divide_by_initial_world_size={divide_by_initial}")
    assert identical_across_ranks(list(ours.parameters()) + list(ours.module.buffers()))


def check_ready_twice():
    """A parameter used inside a reentrant checkpoint and outside it: one clear error on every rank, no hang."""
    torch.manual_seed(4)
    model = ManualDDP(Net(reentrant=True))
    try:
        step_of(model, 0, RANK)
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    assert "mid.weight" in raised or "mid.bias" in raised, raised
    assert "use_reentrant=False" in raised, raised
    everyone = torch.tensor([1.0])
    dist.all_reduce(everyone)  # the group still works: nobody is stuck in a collective
    assert everyone.item() == WORLD
    # static_graph=True counts the hooks in the first iteration and waits for the last one: equal to DDP's.
    torch.manual_seed(4)
    (ours, opt), (theirs, topt) = pair(Net(reentrant=True), static_graph=True)
    for step in range(3):
        for model, o in ((ours, opt), (theirs, topt)):
            step_of(model, step, RANK)
            o.step()
            o.zero_grad()
        assert_same(ours, theirs, f"static_graph with reentrant checkpointing, step {step}")


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.used, self.unused = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x):
        return self.used(torch.tanh(self.body(x)))  # self.unused never takes part


def check_unused_skip_and_delay():
    """find_unused_parameters leaves .grad None where no rank used a parameter; skip_all_reduce_unused_params then
    sends no bucket of such parameters; delay_all_reduce_named_params still averages the parameters it names."""
    for skip in (False, True):
        torch.manual_seed(5)
        kw = dict(find_unused_parameters=True, skip_all_reduce_unused_params=skip, bucket_cap_mb=0.00001)
        (ours, opt), (theirs, topt) = pair(TwoHeads(), **kw)
        for step in range(3):
            with Counting() as c:
                step_of(ours, step, RANK)
            step_of(theirs, step, RANK)
            assert ours.module.unused.weight.grad is None and theirs.module.unused.weight.grad is None
            # find_unused_parameters keeps the first layout: one bucket per tensor here (10-byte cap), 2 unused
            assert c.calls.count("all_reduce") == 6 - 2 * skip + 1, (skip, c.calls)  # buckets + the used map
            for o in (opt, topt):
                o.step()
                o.zero_grad()
            assert_same(ours, theirs, f"find_unused_parameters, skip={skip}, step {step}")
    torch.manual_seed(6)
    base = TwoHeads()
    plain = ManualDDP(copy.deepcopy(base), find_unused_parameters=True)
    delayed_model = copy.deepcopy(base)
    delayed = ManualDDP(delayed_model, find_unused_parameters=True, param_to_hook_all_reduce=delayed_model.body.weight,
                        delay_all_reduce_named_params=list(delayed_model.used.named_parameters(prefix="used")))
    for model in (plain, delayed):
        step_of(model, 0, RANK)
    for p, q in zip(plain.module.used.parameters(), delayed.module.used.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    assert identical_across_ranks([p.grad for p in delayed.module.used.parameters()])


def check_constructor():
    torch.manual_seed(6 + RANK)  # different replicas on purpose
    net = Net()
    for kw, expected in [({"device_ids": [0]}, ValueError), ({"device_ids": [0, 1]}, ValueError),
                         ({"no_such_argument": 1}, TypeError), ({"mixed_precision": object()}, NotImplementedError)]:
        for cls in (ManualDDP, DDP):
            if cls is DDP and expected is NotImplementedError:
                continue
            try:
                cls(net, **kw)
                raise AssertionError(f"{cls.__name__}({kw}) accepted")
            except expected:
                pass
    kept = ManualDDP(copy.deepcopy(net), init_sync=False)
    assert not identical_across_ranks(list(kept.parameters()))
    try:
        ManualDDP(net, verify=True)
        raise AssertionError("verify=True accepted different replicas")
    except ValueError as e:
        assert "seed" in str(e)
    ManualDDP(net)  # broadcasts rank 0's weights
    assert identical_across_ranks(list(net.parameters()))
    gc.collect()
    again = ManualDDP(net)  # the same module wrapped anew: the dropped wrapper's hooks must stay quiet
    with Counting() as c:
        step_of(again, 0, RANK)
    assert c.calls == ["all_reduce"] * len(again.buckets), c.calls


def main():
    global RANK, WORLD
    dist.init_process_group("gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    only = os.environ.get("CHECKS", "").split(",")
    for name, check in [("constructor", check_constructor), ("accumulation", check_accumulation),
                        ("buffers", check_buffers), ("hooks", check_comm_hooks), ("join", check_join),
                        ("join_current", lambda: check_join(divide_by_initial=False)),
                        ("ready_twice", check_ready_twice), ("unused", check_unused_skip_and_delay),
                        ("subgroup", check_subgroup)]:
        if (only == [""] or name in only) and (name != "subgroup" or WORLD == 3):
            if RANK == 0:
                print("check", name, flush=True)
            check()
    dist.barrier()
    if RANK == 0:
        print(f"OK ManualDDP runs PyTorch-DDP code unchanged, with DDP's results, on {WORLD} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
