"""Run under torchrun (3 or more ranks; the suite runs 4): code written for PyTorch's DDP runs unchanged on
ManualDDP, with the same results.

Each check trains ManualDDP and torch.nn.parallel.DistributedDataParallel side by side on the same data and
compares them bit for bit: the nanoGPT accumulation pattern (counting collectives), BatchNorm buffers, a subgroup,
PyTorch's communication hooks and our hand-written one, uneven inputs under join(), skipped unused buckets, the
delayed all-reduce, and the error for a gradient that becomes ready twice. And against one process on the whole
batch (with tied weights and a parameter only rank 0 uses, and the naive tutorial DDP), PyTorch's bucket sizes,
no_sync accumulation against the large batch, and a backward whose forward bypassed the wrapper.
"""

import copy
import gc
import io
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

lesson = load_script("05_manual_ddp_gpt2.py")  # DDPCore and average_gradients
dropin = load_script("ddp_dropin.py")  # ManualDDP, built on that DDPCore
ManualDDP, DDP = dropin.ManualDDP, nn.parallel.DistributedDataParallel
RANK, WORLD = 0, 1
EXACT = None  # the sizes check_exact covered


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


def lockstep(pairs, steps, what):
    """Train both of pair()'s (model, optimizer) side by side on this rank's data; bit for bit after every step."""
    (ours, _), (theirs, _) = pairs
    for step in range(steps):
        for model, o in pairs:
            step_of(model, step, RANK)
            o.step()
            o.zero_grad()
        assert_same(ours, theirs, f"{what}, step {step}")


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
    """process_group: ranks 1 and 2 train together, the others stay out; rank 1 is the group's 'rank 0'."""
    group = dist.new_group([1, 2])
    if RANK not in (1, 2):
        return
    torch.manual_seed(RANK)  # different replicas: the group's first member (global rank 1) must win
    base = Net()
    rank1 = [p.detach().clone() for p in base.parameters()]
    dist.broadcast_object_list(rank1, src=1, group=group)
    pairs = pair(base, process_group=group)
    assert all(torch.equal(p, q) for p, q in zip(pairs[0][0].module.parameters(), rank1))
    lockstep(pairs, 3, "subgroup")


def check_comm_hooks():
    """PyTorch's own hooks run unchanged on ManualDDP; ours (ddp_dropin's bf16_compress_hook) equals PyTorch's.

    (PowerSGD is not among them here: on gloo it deadlocks with PyTorch's own DDP too, because it issues its second
    all-reduce from the completion callback of the first. It needs NCCL and 2 GPUs: not yet tested here.)"""
    hooks = [(None, default_hooks.allreduce_hook), (None, default_hooks.fp16_compress_hook),
             (None, default_hooks.bf16_compress_hook)]
    results = {}
    for state, hook in hooks + [(None, dropin.bf16_compress_hook)]:
        torch.manual_seed(2)
        (ours, opt), (theirs, topt) = pair(Net(d=40), bucket_cap_mb=0.004)
        ours.register_comm_hook(state, hook)
        ref_hook = default_hooks.bf16_compress_hook if hook is dropin.bf16_compress_hook else hook
        theirs.register_comm_hook(state, ref_hook)
        for step in range(5):
            for model in (ours, theirs):
                step_of(model, step, RANK)
                if hook is dropin.bf16_compress_hook and WORLD != 2 and model is theirs:
                    # x/3 rounded to float32, then to bfloat16 (ours: divide first) against bfloat16(x)/3 (PyTorch's:
                    # cast first): each rank's term may differ by a bfloat16 rounding, 2^-8 of the largest term.
                    for p, q in zip(ours.parameters(), theirs.parameters()):
                        bound = WORLD * 2 ** -8 * q.grad.abs().max().item()
                        assert (p.grad - q.grad).abs().max().item() <= bound, (hook.__name__, step)
            for o in (opt, topt):
                o.step()
                o.zero_grad()
            if hook is dropin.bf16_compress_hook and WORLD != 2:
                for p, q in zip(ours.parameters(), theirs.parameters()):
                    p.data.copy_(q.data)  # compare the next step from the same weights
            else:
                assert_same(ours, theirs, f"{hook.__name__}, step {step}")
        results[hook.__name__ + str(hook is dropin.bf16_compress_hook)] = ours
    plain = results["allreduce_hookFalse"]
    for name in ("fp16_compress_hookFalse", "bf16_compress_hookFalse"):
        assert any(not torch.equal(p, q) for p, q in zip(plain.parameters(), results[name].parameters())), name
    # Between 2 ranks halving is exact, so dividing before the cast (ours) or after the sum (PyTorch's) rounds the
    # same: bit for bit, on a group of two (its hook state and DDP's process_group both that group).
    two = dist.new_group([0, 1])
    if RANK < 2:
        torch.manual_seed(2)
        pairs = pair(Net(d=40), bucket_cap_mb=0.004, process_group=two)
        pairs[0][0].register_comm_hook(two, dropin.bf16_compress_hook)
        pairs[1][0].register_comm_hook(two, default_hooks.bf16_compress_hook)
        lockstep(pairs, 5, "bf16_compress_hook on a group of 2")


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


def check_join_switch():
    """join(divide_by_initial_world_size=False), then join(True) on the same wrapper: the second divides by the world
    size again, not by the last count of ranks still training (as DDP)."""
    torch.manual_seed(4)
    (ours, opt), (theirs, topt) = pair(Net())
    for model, o, join in ((ours, opt, ours.join), (theirs, topt, lambda **kw: Join([theirs], **kw))):
        for initial in (False, True):
            with join(divide_by_initial_world_size=initial):
                for step in range(1 + RANK):
                    step_of(model, step, RANK)
                    o.step()
                    o.zero_grad()
    assert_same(ours, theirs, "join(False) then join(True)")


def check_pickle():
    """torch.save(wrapper) and copy.deepcopy(wrapper) after training, as DDP allows: the copy trains on, in step
    with a copy of DDP's; with a subgroup, both refuse."""
    torch.manual_seed(5)
    pairs = pair(Net(bn=True))
    lockstep(pairs, 2, "before the copy")
    saved = io.BytesIO()
    torch.save(pairs[0][0], saved)
    saved.seek(0)
    theirs = pairs[1][0]  # not DDP's copy: on 4 ranks a deep-copied DDP differs from its original in the last bit
    loaded = torch.load(saved, weights_only=False)
    assert type(loaded).__module__ == "ddp_dropin", type(loaded)  # what a new process imports to load it
    lockstep([(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (loaded, theirs)], 2, "torch.save/load copy")
    deep = copy.deepcopy(loaded)
    lockstep([(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in (deep, theirs)], 1, "deep copy")
    group = dist.new_group([0, 1])
    if RANK in (0, 1):
        for cls in (ManualDDP, DDP):
            try:
                copy.deepcopy(cls(Net(), process_group=group))
            except RuntimeError:
                continue
            raise AssertionError(f"{cls.__name__} with a subgroup was pickled")


class Named(nn.Module):
    """A frozen layer, BatchNorm's buffers (an int64 one among them) and a parameter DDP is told to leave alone."""

    def __init__(self):
        super().__init__()
        self.net, self.frozen, self.bn = Net(), nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.frozen.requires_grad_(False)
        self.ignored = nn.Parameter(torch.zeros(3))
        self._ddp_params_and_buffers_to_ignore = ["ignored"]

    def forward(self, x):
        return self.bn(self.frozen(self.net(x))) + self.ignored.sum()


def check_names():
    """For every set of constructor arguments the suite uses (and each of DDP's alone): the wrapper's state_dict()
    keys, named_parameters() (names and the tensors themselves) and named_buffers() are DDP's, in DDP's order. A
    strict load into the bare model, or an optimizer built from wrapper.parameters(), must not tell them apart."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    model = Named()
    first, last = list(model.net.named_parameters())[:2], model.net.out.bias
    mesh = init_device_mesh("cpu", (WORLD,))
    sets = [{}, {"bucket_cap_mb": 0.002}, {"bucket_cap_mb_list": [0.001, 0.01]}, {"find_unused_parameters": True},
            {"static_graph": True}, {"static_graph": True, "find_unused_parameters": True},
            {"broadcast_buffers": False}, {"forward_sync_buffers": False}, {"init_sync": False},
            {"gradient_as_bucket_view": True}, {"batched_grad_copy": True}, {"check_reduction": True, "dim": 0},
            {"skip_all_reduce_unused_params": True, "find_unused_parameters": True},
            {"bucket_cap_mb": 0.00005, "find_unused_parameters": True},
            {"delay_all_reduce_named_params": [(f"net.{n}", p) for n, p in first], "param_to_hook_all_reduce": last},
            {"delay_all_reduce_named_params": [(f"net.{n}", p) for n, p in first], "param_to_hook_all_reduce": last,
             "find_unused_parameters": True},
            {"process_group": dist.new_group(list(range(WORLD)))}, {"device_mesh": mesh}]
    cases = [(lesson.DDPCore, {}), (lesson.DDPCore, {"bucket_cap_mb": 0.002})] + [(ManualDDP, kw) for kw in sets]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated, for both classes
        for cls, kw in cases:
            ours, theirs = cls(model, **kw), DDP(model, **kw)
            for what in ("state_dict().keys", "named_parameters", "named_buffers"):
                get = (lambda m: list(m.state_dict().keys())) if what.startswith("state") else (
                    lambda m, what=what: [name for name, _ in getattr(m, what)()])
                assert get(ours) == get(theirs), f"{cls.__name__}{kw}: {what} {get(ours)} != DDP's {get(theirs)}"
            assert [id(p) for p in ours.parameters()] == [id(p) for p in theirs.parameters()], kw
            model.load_state_dict({k.removeprefix("module."): v for k, v in ours.state_dict().items()}, strict=True)


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
    lockstep(pair(Net(reentrant=True), static_graph=True), 3, "static_graph with reentrant checkpointing")


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.used, self.unused = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x):
        return self.used(torch.tanh(self.body(x)))  # self.unused never takes part


def check_unused_skip_and_delay():
    """find_unused_parameters leaves .grad None where no rank used a parameter; skip_all_reduce_unused_params then
    sends no bucket of such parameters; delay_all_reduce_named_params still averages the parameters it names.
    Without find_unused_parameters, skip_all_reduce_unused_params skips nothing (DDP cannot know a parameter unused);
    with static_graph it skips what the first backward left unused: bit for bit DDP's, whichever flags go with it."""
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
    for make, kw in ((Net, {}), (TwoHeads, {"static_graph": True}),
                     (TwoHeads, {"static_graph": True, "find_unused_parameters": True})):
        torch.manual_seed(5)
        lockstep(pair(make(), skip_all_reduce_unused_params=True, bucket_cap_mb=0.00001, **kw), 4,
                 f"skip_all_reduce_unused_params with {kw}")
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


# --- equal to one process on the whole batch, and PyTorch's bucket sizes ---
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
    manual = ManualDDP(ours, bucket_cap_mb=0.00005, find_unused_parameters=True)  # 52-byte cap: a bucket a tensor
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
    # Ranks other than 0 never use 'extra': as under DDP, that takes find_unused_parameters=True, whose buckets are
    # cut by size once, from the start (one per tensor here). On rank 0, which uses every parameter, each bucket
    # went out from a backward hook while backward was still running, in every step.
    assert len(manual.buckets) == len(list(ours.parameters())), len(manual.buckets)
    if RANK == 0:
        assert launched_early == [len(manual.buckets)] * steps, launched_early
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


def check_exact():
    """exact_worker's bit-for-bit checks, in this launch too: on every rank, and on a group of 3 within 4."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import exact_worker
    global EXACT
    EXACT = exact_worker.check_every_size()


def main():
    global RANK, WORLD
    dist.init_process_group("gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    only = os.environ.get("CHECKS", "").split(",")
    for name, check in [("constructor", check_constructor), ("accumulation", check_accumulation),
                        ("buffers", check_buffers), ("hooks", check_comm_hooks), ("join", check_join),
                        ("join_current", lambda: check_join(divide_by_initial=False)),
                        ("join_switch", check_join_switch), ("pickle", check_pickle),
                        ("ready_twice", check_ready_twice), ("unused", check_unused_skip_and_delay),
                        ("subgroup", check_subgroup), ("single_process", check_training),
                        ("bucket_sizes", check_bucket_layout), ("no_sync", check_no_sync),
                        ("bypassed", check_forward_bypassed), ("names", check_names), ("exact", check_exact)]:
        if (only == [""] or name in only) and (name != "subgroup" or WORLD >= 3):
            if RANK == 0:
                print("check", name, flush=True)
            check()
    dist.barrier()
    if RANK == 0:
        exact = f"; bit-identical at every step on {EXACT} ranks" if EXACT else ""
        print(f"OK ManualDDP runs PyTorch-DDP code unchanged, with DDP's results, on {WORLD} ranks{exact}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
