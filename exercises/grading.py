"""The rungs of the ladder, in order, each with its check. At the end, EXERCISES lists them.

Each check_* function grades one rung. It compares the participant's code with the library it
replaces. It raises Failed with a message that names the first thing wrong, and a hint for the
usual cause. On success it returns lines of information. Each check runs on every rank of a gloo
process group, except the sampler's, which needs none. The harness around it (harness.py) runs a
rank, counts what a solution sends, and catches hangs. exercises/check.py, notebooks/ranks.py and
the project's own tests of 02-05 and 07 all grade through here.
"""

import contextlib
import copy
import functools
import itertools
import math
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [p for p in (HERE, os.path.dirname(HERE)) if p not in sys.path]  # harness, lessons
import harness  # noqa: E402
from harness import (  # noqa: E402
    Exercise,
    Failed,
    agree,
    barrier,
    book,
    brief,
    count_ready,
    differs_from_rank0,
    dtype_name,
    first_difference,
    gather_objects,
    gather_tensors,
    hinted,
    index_of,
    kind_of,
    num,
    recording,
    uncounted_all_reduce,
    watching,
)

import lessons  # noqa: E402

# notebooks/ranks.py grades in a notebook's own ranks. It reads these four names here too.
_books, _checker_frame = harness._books, harness._checker_frame
hang_record, install_counters = harness.hang_record, harness.install_counters


# --- rung 1: tree_broadcast (02_broadcast.py) ---
def check_tree_broadcast(tree_broadcast: Callable[[torch.Tensor, int], object]) -> list[str]:
    """Equal to dist.broadcast from every source, in place, in ceil(log2 N) rounds.

    The source sends one message per round."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rounds = math.ceil(math.log2(world))
    cases = [(src, dtype, shape) for src in range(world)
             for dtype in (torch.float32, torch.int64, torch.bfloat16)
             for shape in ((5,), (3 * world + 1,), (), (4, 6))]
    for i, (src, dtype, shape) in enumerate(cases):
        label = (f"case {i + 1} of {len(cases)} (src={src}, {dtype_name(dtype)}, "
                 f"shape {tuple(shape)})")
        g = torch.Generator().manual_seed(100 * rank + i)
        x = (torch.randn(shape, generator=g) * 100).to(dtype)  # a different tensor on every rank
        inputs = gather_tensors(x)  # everyone's input, to say whose tensor a rank ended up with
        with recording() as rec, watching(label):
            tree_broadcast(x, src)
        results = gather_tensors(x)
        problem = None
        if not torch.equal(x, inputs[src]):
            problem = _broadcast_problem(x, inputs, results, src, rank)
        elif rank == src and rec.count("send") > rounds:
            problem = hinted(
                f"the source sent {rec.count('send')} messages to reach {world} ranks. A binomial "
                f"tree needs only ceil(log2 {world}) = {rounds} rounds, with one send each for the "
                "source",
                "in round k, every rank that already holds the data (vrank < 2**k) sends it to "
                "vrank + 2**k. So the number of holders doubles each round. A source that sends to "
                "everyone is a line, not a tree")
        elif rank != src and rec.count("recv") != 1:
            problem = hinted(f"this rank received {rec.count('recv')} messages. Each rank other "
                             "than the source receives the data exactly once")
        agree(problem, label)
    sends = f"{rounds} message{'s' * (rounds != 1)}"
    return [f"{len(cases)} cases on {world} ranks (every source, 3 dtypes, 4 shapes): equal to "
            f"dist.broadcast, in place, with the source sending {sends} (ceil(log2 {world}) "
            "rounds)"]


RELATIVE_TO_SRC = ("the tree must start at src. Number the ranks from it, with "
                   "vrank = (rank - src) % N. Turn a partner's vrank back into a rank with "
                   "(vrank + src) % N")


def _broadcast_problem(x, inputs, results, src, rank):
    owner = next((k for k, t in enumerate(inputs) if torch.equal(x, t)), None)
    if owner is not None and owner != src and all(torch.equal(t, inputs[owner]) for t in results):
        return hinted(f"every rank holds rank {owner}'s tensor, not the source's (src={src})",
                      RELATIVE_TO_SRC)
    if owner == rank:
        return hinted(f"this rank's tensor still holds its own values, not rank {src}'s. Nothing "
                      "was received into it",
                      "receive into `tensor` itself, in place. `tensor = tensor.clone()` or a new "
                      "buffer leaves the caller's tensor unchanged. Or the tree never reached this "
                      "rank. With vrank = (rank - src) % N, round k reaches vranks 2**k to "
                      "2**(k+1) - 1")
    if owner is not None:
        return hinted(f"this rank holds rank {owner}'s tensor, not the source's (src={src})",
                      RELATIVE_TO_SRC)
    i = first_difference(x, inputs[src])
    return hinted(f"element {i} should be {num(inputs[src].reshape(-1)[i])} (rank {src}'s), but it "
                  f"is {num(x.reshape(-1)[i])}")


# --- rung 2: ring_all_reduce (03_all_reduce.py) ---
RING_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def ring_cases(world):
    """(dtype, shape, transposed, kind), the easy ones first. The first failure is the simplest."""
    numels = [4 * world, 4 * world + 1, 7, 1000, (1 << 16) + 3, world + 1, world, world - 1, 2, 1]
    shapes = [(n,) for n in dict.fromkeys(numels) if n > 0] + [(), (3, 5, 7), (64, 33)]
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
              torch.uint8]
    for dtype in dtypes:
        for shape in shapes:
            for transposed in ([False, True] if len(shape) == 2 else [False]):
                kinds = ["integer-valued", "random"] if dtype.is_floating_point else ["integer"]
                for kind in kinds:
                    yield dtype, shape, transposed, kind


def check_ring_all_reduce(ring_all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """Equal to dist.all_reduce, over sizes, shapes and dtypes, in place, the same on every rank.

    Integer values must match exactly, random floats closely. The traffic must be a ring's, 2(N-1)/N
    of the tensor sent per rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = list(ring_cases(world))
    traffic = None
    for i, (dtype, shape, transposed, kind) in enumerate(cases):
        label = (f"case {i + 1} of {len(cases) + 1} ({dtype_name(dtype)}, shape {tuple(shape)}"
                 f"{', transposed' if transposed else ''}, {kind} values)")
        g = torch.Generator().manual_seed(1000 * rank + i)
        if kind == "random":
            x = torch.randn(shape, generator=g).to(dtype)
        else:
            low, high = (0, 4) if dtype == torch.uint8 else (-8, 8)
            x = torch.randint(low, high, shape, generator=g).to(dtype)
        if transposed:
            x = x.t()  # not contiguous, and the result must still land in x itself
        mine, lib = x.clone(), x.clone()
        uncounted_all_reduce(lib)
        with recording() as rec, watching(label):
            out = ring_all_reduce(x)
        problem = _ring_problem(out, x, mine, lib, kind, world)
        if problem is None and rec.count("collective"):
            problem = hinted(f"ring_all_reduce called {', '.join(rec.names('collective'))}. The "
                             "exercise is to build it from point-to-point messages (send and recv, "
                             "or isend and irecv)")
        agree(problem, label)
        agree(differs_from_rank0([("the result", x)],
                                 "one rank, the chunk's owner, sums each chunk. The others copy "
                                 "its result, and never sum again in another order. So the owner's "
                                 "bits must go round"), label)
        if dtype == torch.float32 and shape == ((1 << 16) + 3,) and kind == "random":
            traffic = (rec.bytes("send"), x.numel() * x.element_size())
    label = f"case {len(cases) + 1} of {len(cases) + 1} (an empty tensor)"
    empty = torch.empty(0)
    with watching(label):
        out = ring_all_reduce(empty)
    agree(None if out is empty
          else hinted("an empty tensor must come back as itself (return tensor)"), label)
    sent, nbytes = traffic
    bound = 2 * (world - 1) * math.ceil(nbytes / 4 / world) * 4  # 2(N-1) chunks, each the largest
    agree(None if sent <= bound else hinted(
        f"this rank sent {sent:,} bytes to all-reduce {nbytes:,}. That is {sent / nbytes:.2f}x the "
        f"tensor, where a ring sends 2(N-1)/N = {2 * (world - 1) / world:.2f}x",
        "each step sends one chunk, 1/N of the tensor, to the right neighbour. The reduce-scatter "
        "takes N-1 steps, and so does the all-gather. Sending the whole tensor every step costs "
        "N/2 times more"), "the traffic check")
    return [f"{len(cases) + 1} cases on {world} ranks (7 dtypes, odd sizes, fewer elements than "
            "ranks, a transposed tensor, an empty one): equal to dist.all_reduce, in place, the "
            f"same on every rank, bit for bit. Each rank sent {sent / nbytes:.2f}x the tensor "
            "(2(N-1)/N)"]


def _ring_problem(out, x, mine, lib, kind, world):
    got, want, own = x.reshape(-1), lib.reshape(-1), mine.reshape(-1)
    n = got.numel()
    bounds = [(int(c[0]), int(c[-1])) if len(c) else None
              for c in torch.arange(n).tensor_split(world)]

    def close(a, b):
        if kind != "random":
            return torch.equal(a, b)
        tol = RING_TOL[a.dtype]
        return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol * world)

    copy_back = ("if you worked on a copy, copy the result back with tensor.copy_(). "
                 "tensor.contiguous() and .flatten() make a copy of a tensor that is not "
                 "contiguous")
    if close(got, want):
        if out is x:
            return None
        return hinted(f"ring_all_reduce returned {kind_of(out)}, not the tensor it was given. "
                      "Return `tensor`, which holds the sum")
    returned_new = torch.is_tensor(out) and out is not x and out.shape == x.shape
    if returned_new and close(out.reshape(-1), want):
        return hinted("ring_all_reduce returned the sum in a new tensor, and left its argument "
                      "unchanged. The sum must go into the argument, in place",
                      "write the sum into `tensor` itself. And " + copy_back)
    if torch.equal(got, own):
        return hinted("the tensor still holds this rank's own input. Nothing was written into it",
                      "sum in place. And " + copy_back)
    ok = [b is not None and close(got[b[0]:b[1] + 1], want[b[0]:b[1] + 1]) for b in bounds]
    twice = [b is not None and not ok[c] and close(got[b[0]:b[1] + 1], (want + own)[b[0]:b[1] + 1])
             for c, b in enumerate(bounds)]
    i = first_difference(got, want, close_enough=kind == "random",
                         tol=RING_TOL.get(got.dtype, 0) * world)
    c = next(k for k, b in enumerate(bounds) if b is not None and b[0] <= i <= b[1])
    where = (f"chunk {c} of {world} (elements {bounds[c][0]}-{bounds[c][1]} of the flattened "
             f"tensor, split with tensor_split({world})), element {i} should be {num(want[i])}, "
             f"but it is {num(got[i])}")
    if any(twice):
        return hinted(f"{where}. That chunk holds the sum plus this rank's own values",
                      "in the all-gather, a finished chunk from the left overwrites yours (copy_). "
                      "It is not added, because your own share is already in it")
    nonempty = [k for k, b in enumerate(bounds) if b is not None]
    if sum(ok) == 1 and len(nonempty) > 1:
        return hinted(f"{where}. Only chunk {ok.index(True)} holds the full sum on this rank, the "
                      "chunk it owns after the reduce-scatter. The other chunks hold partial sums",
                      "the all-gather phase seems missing, or it sends unfinished chunks. After "
                      "the reduce-scatter, N-1 more steps pass each finished chunk on. Step s "
                      "sends chunk (r + 1 - s) % N, and overwrites chunk (r - s) % N with what "
                      "arrives")
    hint = ("check the chunk indices. In step s of the reduce-scatter, rank r sends chunk (r - s) "
            "% N to its right. It adds what it receives into chunk (r - s - 1) % N. In the "
            "all-gather it sends chunk (r + 1 - s) % N, and overwrites chunk (r - s) % N")
    if n < world:
        hint = (f"with fewer elements ({n}) than ranks ({world}), some chunks are empty. Every "
                "rank must skip the same empty chunks, or send them, since a message of size zero "
                "is fine. Also " + hint)
    elif n % world:
        hint = (f"{n} elements do not split evenly into {world} chunks, so chunk sizes differ by "
                "one. A receive buffer must have the size of the chunk it receives, not of your "
                "own. Also " + hint)
    return hinted(where, hint)


def ring_speed(ring_all_reduce: Callable[[torch.Tensor], torch.Tensor], numel: int = 1 << 20,
               rounds: int = 5) -> list[str]:
    """For information only: the ring's bus bandwidth against dist.all_reduce's, at one size.

    busbw = bytes / time * 2(N-1)/N, as nccl-tests define it. benchmarks/all_reduce.py measures
    every size."""
    world = dist.get_world_size()
    x = torch.zeros(numel)  # sums of zeros stay zero over many calls
    impls = {"ring": ring_all_reduce, "library": uncounted_all_reduce}
    times = {"ring": [], "library": []}
    for i in range(rounds + 1):  # round 0 warms up and is not timed
        order = ["ring", "library"] if i % 2 else ["library", "ring"]  # flips, so noise hits both
        for name in order:
            barrier()
            t0 = time.perf_counter()
            with watching("the speed measurement"):
                impls[name](x)
            if i:
                times[name].append(time.perf_counter() - t0)
    t = torch.tensor([times["ring"], times["library"]], dtype=torch.float64)
    # A collective is as slow as its slowest rank.
    uncounted_all_reduce(t, op=dist.ReduceOp.MAX, group=book())
    ring_s, lib_s = t.median(dim=1).values.tolist()
    bus = numel * 4 * 2 * (world - 1) / world / 1e9
    return [f"speed, for information only: {numel * 4 >> 20} MiB of float32 on {world} ranks, the "
            f"median of {rounds}. Your ring {bus / ring_s:.2f} GB/s busbw, dist.all_reduce "
            f"{bus / lib_s:.2f} GB/s, so {lib_s / ring_s:.2f}x the library. "
            "benchmarks/all_reduce.py measures every size"]


# --- rung 3: DistributedSampler (04_sampler.py) ---
def sampler_grid():
    """(dataset size, replicas, shuffle, seed, drop_last), the easy ones first."""
    sizes, replicas = [10, 11, 17, 5, 3, 64, 101, 2, 1, 0], [2, 3, 4, 7, 1]  # in the order tried
    grid = itertools.product(sizes, replicas, [True, False], [0, 42], [False, True])
    return sorted(grid, key=lambda c: (c[2], c[4], c[0] % c[1] != 0, c[3], sizes.index(c[0]),
                                       replicas.index(c[1])))


def check_sampler(DistributedSampler: type) -> list[str]:
    """Every rank's indices equal those of torch.utils.data.DistributedSampler.

    The grid covers many arguments, and three epochs each."""
    cases = 0
    for n, replicas, shuffle, seed, drop_last in sampler_grid():
        data = list(range(n))
        kw = dict(num_replicas=replicas, shuffle=shuffle, seed=seed, drop_last=drop_last)
        refs = [torch.utils.data.DistributedSampler(data, rank=r, **kw) for r in range(replicas)]
        with watching(f"DistributedSampler(range({n}), num_replicas={replicas}, ...)"):
            ours = [DistributedSampler(data, rank=r, **kw) for r in range(replicas)]
            first = [list(s) for s in ours]  # epoch 0, before any set_epoch
        for epoch in (0, 1, 5):
            for s, ref in zip(ours, refs):
                ref.set_epoch(epoch)
                with watching(f"set_epoch({epoch})"):
                    s.set_epoch(epoch)
            want = [list(ref) for ref in refs]
            with watching(f"iterating the samplers of range({n}) over {replicas} replicas, "
                          f"epoch {epoch}"):
                got, lengths = [list(s) for s in ours], [len(s) for s in ours]
            for r in range(replicas):
                call = (f"DistributedSampler(range({n}), num_replicas={replicas}, rank={r}, "
                        f"shuffle={shuffle}, seed={seed}, drop_last={drop_last}), epoch {epoch}")
                problem = _sampler_problem(got, want, first, r, n, kw, epoch, lengths[r])
                if problem:
                    raise Failed(f"{call}: {problem}")
                cases += 1
    return [f"{cases} cases of arguments, rank and epoch: every rank's indices equal those of "
            "torch's DistributedSampler"]


def _sampler_problem(got, want, first, r, n, kw, epoch, length):
    replicas, shuffle, drop_last = kw["num_replicas"], kw["shuffle"], kw["drop_last"]
    mine, ref = got[r], want[r]
    if mine == ref:
        if length != len(ref):
            return hinted(f"len() says {length}, but iterating gives {len(ref)} indices",
                          "__len__ must return num_samples, the number of indices this rank yields")
        return None
    said = f"this rank's indices are {brief(mine)}, and torch's are {brief(ref)}"
    if len(mine) != len(ref):
        if drop_last:
            return hinted(f"{said}. That is {len(mine)} indices, where torch gives {len(ref)}",
                          "with drop_last the tail is dropped. Every rank gets "
                          f"floor({n} / {replicas}) = {n // replicas} indices")
        return hinted(f"{said}. That is {len(mine)} indices, where torch gives {len(ref)}. Is the "
                      "padding missing?",
                      f"{n} samples do not split evenly over {replicas} ranks. Pad the index list "
                      f"with its own first indices, up to ceil(n / N) * N = {len(ref) * replicas}. "
                      "Then every rank gets as many batches. A rank with one batch fewer leaves "
                      "the others waiting in an all-reduce")
    if epoch > 0 and shuffle and n > 1 and mine == first[r] and ref != first[r]:
        return hinted(f"{said}. set_epoch({epoch}) changed nothing, so the order is epoch 0's",
                      "seed the shuffle with seed + epoch, where set_epoch stores the epoch. "
                      "Otherwise every epoch replays the same order")
    if not shuffle:
        block = list(range(r * len(ref), min(n, (r + 1) * len(ref))))
        hint = ("rank r takes every N-th index starting at r, not a block in one piece. That is "
                "indices[rank:total_size:num_replicas]" if mine[:len(block)] == block else
                "without shuffle the indices are 0 to n-1, padded with the first ones. Rank r "
                "takes indices[rank:total_size:num_replicas]")
        return hinted(said, hint)
    everyone = [i for g in got for i in g]
    if sorted(everyone) != sorted(i for w in want for i in w):
        return hinted(f"{said}. Across the ranks, some samples come twice and others never",
                      "every rank must shuffle with the same permutation, from a generator seeded "
                      "with seed + epoch, not with the rank. Then each rank takes its own "
                      "every-N-th slice")
    return hinted(f"{said}. Over all {replicas} ranks together, your samplers yield the same "
                  "samples as torch's, each as often. But the order differs, so the permutation "
                  "differs",
                  "shuffle as torch does. Write g = torch.Generator(), then "
                  "g.manual_seed(seed + epoch), then "
                  "indices = torch.randperm(n, generator=g).tolist()")


# --- rungs 4-6: DDP by hand, graded against PyTorch's DistributedDataParallel ---
class TinyNet(nn.Module):
    """The model the DDP rungs train. It has three layers, so three buckets of different sizes."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x, skip_fc2=False):
        h = torch.tanh(self.fc1(x))
        if not skip_fc2:  # rung 4 leaves fc2 out on one rank in one step, so no gradient there
            h = torch.tanh(self.fc2(h))
        return self.fc3(h)


BUCKET_CAP_MB = 512 / 2**20  # 512 bytes: one bucket per layer of TinyNet (fc3, then fc2, then fc1)
LR, MOMENTUM, STEPS = 0.1, 0.9, 4


class OrderNet(nn.Module):
    """Rung 6's second model. Its gradients arrive in another order than DDP's buckets.

    `early` is registered last, so it sits in bucket 0. But forward uses it first, so its
    gradients come last of all. `block` is used twice, in a skip connection. `frozen` sits between.
    It does not require a gradient, so it has no gradient, no hook and no place in a bucket."""

    def __init__(self):
        super().__init__()
        self.fc1, self.block = nn.Linear(8, 32), nn.Linear(32, 32)
        self.frozen, self.fc3, self.early = nn.Linear(32, 32), nn.Linear(32, 4), nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.fc1(self.early(x)))
        h = h + torch.tanh(self.block(torch.tanh(self.block(h))))
        return self.fc3(torch.tanh(self.frozen(h)))


def tiny_net(seed, net=TinyNet):
    torch.manual_seed(seed)
    return net()


def batch(step, rank, micro=0):
    """A different batch on every rank, step and micro-step. The participant's and DDP's match."""
    g = torch.Generator().manual_seed(10_000 + 100 * step + 10 * micro + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def expected_buckets(module, cap_bytes):
    """DDP's layout of the buckets.

    It takes the parameters that require a gradient in reverse registration order, since backward
    usually produces the last layer's gradients first. It closes a bucket once it holds cap_bytes or
    more. For TinyNet this is also the order backward produces. For OrderNet it is not."""
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return _fill(reversed(params), cap_bytes)


def _fill(named, cap_bytes):
    buckets, names, size = [], [], 0
    for name, p in named:
        names.append(name)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(names)
            names, size = [], 0
    return buckets + ([names] if names else [])


class _Run:
    """One rank of the comparison: the participant's model, and PyTorch's DDP on the same data.

    A plain copy also computes this rank's own gradients, before any averaging. They tell the usual
    mistakes apart."""

    def __init__(self, mine, seed, net=TinyNet, **ddp_kwargs):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mine = mine  # the module whose parameters the participant's code updates
        self.names = [n for n, _ in mine.named_parameters()]
        self.ref = DDP(tiny_net(seed, net), **ddp_kwargs)  # broadcasts rank 0's weights
        self.local = tiny_net(0, net)
        self.opt = torch.optim.SGD(mine.parameters(), lr=LR, momentum=MOMENTUM)
        self.ref_opt = torch.optim.SGD(self.ref.parameters(), lr=LR, momentum=MOMENTUM)
        # a/2 + b/2 has one rounding, whatever the order. More ranks add up in other orders.
        self.exact = self.world == 2
        self.hooks = True  # the rung syncs from gradient hooks (rung 4 syncs after backward)
        self.temporaries = 0  # rung 4: all-reduces of tensors that are neither a .grad nor a weight

    def reference_backward(self, step, micros=1, **forward_kwargs):
        """DDP's gradients, and this rank's own gradients of the same weights and data.

        They add up over `micros` micro-batches. All but the last run under no_sync."""
        self.local.load_state_dict(self.ref.module.state_dict())
        self.ref_opt.zero_grad()
        self.local.zero_grad()
        for m in range(micros):
            x, y = batch(step, self.rank, m)
            quiet = self.ref.no_sync() if m < micros - 1 else contextlib.nullcontext()
            with quiet:
                F.mse_loss(self.ref(x, **forward_kwargs), y).backward()
            F.mse_loss(self.local(x, **forward_kwargs), y).backward()

    def compare_start(self, what):
        """After construction, the participant's replicas must hold rank 0's weights, as DDP's."""
        self.compare(what, [p.detach() for p in self.mine.parameters()],
                     [p.detach() for p in self.ref.module.parameters()], "this rank's weights",
                     "rank 0's",
                     hint="replicas built with different seeds must start identical. Broadcast "
                          "rank 0's parameters in __init__, with dist.broadcast(p.data, src=0), as "
                          "DDP does")

    def compare_grads(self, label):
        grads = [p.grad for p in self.mine.parameters()]
        ref_grads = [p.grad for p in self.ref.module.parameters()]
        local = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in self.local.parameters()]
        problem = None
        for name, got, want, own in zip(self.names, grads, ref_grads, local):
            if want is None:  # a frozen parameter, without a gradient under DDP either
                problem = None if got is None else hinted(
                    f"{name} is frozen (requires_grad=False), but its .grad was set",
                    "leave frozen parameters alone, as DDP does")
            elif got is None:
                problem = hinted(f"{name}.grad is None",
                                 "every parameter must hold its averaged gradient")
            elif not self._equal(got, want):
                problem = _grad_problem(name, got, want, own, self.world, self.hooks,
                                        self.temporaries)
            if problem:
                break
        agree(problem, label)
        named = [(f"{n}.grad", g) for n, g in zip(self.names, grads) if g is not None]
        agree(differs_from_rank0(named, "after averaging, the gradients must be the same on every "
                                        "rank"), label)

    def step_and_compare(self, label):
        self.opt.step()
        self.ref_opt.step()
        self.compare(label, [p.detach() for p in self.mine.parameters()],
                     [p.detach() for p in self.ref.module.parameters()],
                     "weights after the optimizer step")

    def compare(self, label, tensors, refs, what, theirs="DDP's", hint=None):
        problem = None
        for name, got, want in zip(self.names, tensors, refs):
            if not self._equal(got, want):
                i = first_difference(got, want)
                problem = hinted(f"{what}: {name}[{index_of(got, i)}] is "
                                 f"{num(got.reshape(-1)[i])}, {theirs} "
                                 f"{num(want.reshape(-1)[i])}", hint)
                break
        agree(problem, label)

    def _equal(self, a, b):
        return torch.equal(a, b) if self.exact else torch.allclose(a, b, rtol=1e-5, atol=1e-7)

    def info(self, what):
        if self.exact:
            how = "bit for bit (on 2 ranks, a/2 + b/2 has one rounding whatever the order)"
        else:
            how = f"within rtol 1e-5 ({self.world} ranks add up in different orders)"
        return f"{what} equal to those of PyTorch's DistributedDataParallel, {how}, on every rank"


def _grad_problem(name, got, want, own, world, hooks, temporaries=0):
    def close(a, b):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-7)

    if torch.equal(got, own) and temporaries:
        return hinted(f"{name}.grad is this rank's own gradient, not the mean over the ranks. Your "
                      f"all-reduces summed temporary tensors ({temporaries} of them), never .grad "
                      "itself",
                      "an expression such as p.grad / world makes a new tensor. dist.all_reduce "
                      "sums it in place, and then it is thrown away. All-reduce p.grad itself, "
                      "then divide it with p.grad /= world")
    if torch.equal(got, own):
        where = ("put a hook on every parameter that requires a gradient, and each in a bucket"
                 if hooks else "loop over all of model.parameters() that require a gradient, not "
                 "only the weights")
        return hinted(f"{name}.grad is this rank's own gradient, not the mean over the ranks. It "
                      "was not all-reduced",
                      f"every parameter's gradient must be all-reduced, biases too. So {where}")
    if close(got, want * world):
        return hinted(f"{name}.grad is {world}x DDP's. The gradients were summed, not averaged",
                      f"divide by the world size, or multiply by 1/N as DDP does (N = {world})")
    if close(got, want / world):
        return hinted(f"{name}.grad is 1/{world} of DDP's. It was divided by N twice")
    if close(got, own / world):
        return hinted(f"{name}.grad is this rank's own gradient divided by N. The all-reduced "
                      "values never reached .grad",
                      "wait for each all-reduce before you read .grad. Reduce .grad itself, or "
                      "copy the result back, not a temporary copy")
    i = first_difference(got, want)
    return hinted(f"{name}.grad[{index_of(got, i)}] is {num(got.reshape(-1)[i])}, DDP's "
                  f"{num(want.reshape(-1)[i])}")


def _raced(launches, name_of, hint):
    """A problem when a tensor changed in place while its asynchronous all-reduce still ran.

    `name_of(tensor)` names the tensor in the message."""
    raced = [c for c in launches if c.raced]
    if not raced:
        return None
    return hinted(f"{name_of(raced[0].tensor)} changed (divided?) while its asynchronous "
                  "all-reduce still ran. That is a race, and its result changes from run to "
                  "run", hint)


def _grad_names(module):
    """A function that names a tensor after the parameter whose .grad it is ("fc2.weight.grad")."""
    def name_of(t):
        return next((f"{n}.grad" for n, p in module.named_parameters()
                     if p.grad is not None and p.grad.data_ptr() == t.data_ptr()),
                    "a temporary tensor")
    return name_of


def check_average_gradients(average_gradients: Callable[[nn.Module, int], object]) -> list[str]:
    """Rung 4, the naive one. After backward, average_gradients(model, world) leaves DDP's .grad.

    In the last step, rank 1 does not use fc2, so fc2 has no gradient there. The ranks compare each
    all-reduce before it runs. So an answer that skips the missing gradient fails in one line,
    never in a hang."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # One seed everywhere, since this rung has no wrapper to broadcast. DDP must find unused fc2.
    run = _Run(tiny_net(0), seed=0, find_unused_parameters=True)
    run.hooks = False
    for step in range(STEPS):
        uneven = step == STEPS - 1
        label = f"step {step + 1} of {STEPS}" + (" (fc2 unused on rank 1)" if uneven else "")
        x, y = batch(step, rank)
        run.opt.zero_grad()
        F.mse_loss(run.mine(x, skip_fc2=uneven and rank == 1), y).backward()
        before = [p.detach().clone() for p in run.mine.parameters()]
        missing = gather_objects([n for n, p in run.mine.named_parameters() if p.grad is None])
        out_of_step = functools.partial(_out_of_step, label=label, missing=missing)
        with recording(lockstep=out_of_step, name_of=_grad_names(run.mine)) as rec, \
                watching(label):
            average_gradients(run.mine, world)
            rec.in_step()  # returned: the others must return too, after as many all-reduces
        agree(_raced(rec.calls_of("all_reduce"), _grad_names(run.mine),
                     "wait for the all-reduce before you touch its tensor. Write "
                     "work = dist.all_reduce(p.grad, async_op=True), then work.wait(), then "
                     "p.grad /= world"), label)
        grads = {p.grad.data_ptr() for p in run.mine.parameters() if p.grad is not None}
        ours = grads | {p.data_ptr() for p in run.mine.parameters()}
        run.temporaries = sum(c.tensor.data_ptr() not in ours for c in rec.calls_of("all_reduce"))
        run.compare(label, [p.detach() for p in run.mine.parameters()], before,
                    "average_gradients changed the weights", "before the call",
                    hint="average_gradients must change .grad only. All-reduce p.grad, not p or "
                         "p.data")
        run.reference_backward(step, skip_fc2=uneven and rank == 1)
        run.compare_grads(label)
        run.step_and_compare(label)
    return [run.info(f"gradients and weights over {STEPS} SGD steps on {world} ranks:"),
            "in the last step fc2 had no gradient on rank 1, and every rank still joined every "
            "all-reduce"]


def _out_of_step(said, label, missing):
    """The words for ranks whose all-reduces no longer pair up (see harness.Recorder.in_step)."""
    k = said[0][0]
    doing = [f"rank {r} has returned" if op is None
             else f"rank {r} all-reduces {what} ({n} elements)"
             for r, (_, op, n, what) in enumerate(said)]
    gaps = [f"{', '.join(names)} had no gradient on rank {r}" for r, names in enumerate(missing)
            if names]
    return hinted(f"{label}: the ranks' all-reduces no longer pair up. At all-reduce {k}, "
                  + ", but ".join(doing) + "."
                  + (f" In this step {'; '.join(gaps)}." if gaps else ""),
                  "every rank must join every all-reduce, in the same order, since the ranks pair "
                  "them by their order. A parameter without a gradient on one rank joins there "
                  "with zeros. Write `if p.grad is None: p.grad = torch.zeros_like(p)` before its "
                  "all-reduce")


def check_overlap(wrapper_class: type) -> list[str]:
    """Rung 5. One asynchronous all-reduce per parameter, launched from its hook during backward.

    finish_gradient_synchronization() waits for them all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_net(rank)  # the replicas differ, so the wrapper must broadcast rank 0's
    ready = count_ready(base)
    with recording(), watching("the constructor"):
        model = wrapper_class(base)
    run = _Run(base, seed=rank)
    run.compare_start("after construction")
    n = len(run.names)
    for step in range(STEPS):
        label = f"step {step + 1} of {STEPS}"
        x, y = batch(step, rank)
        run.opt.zero_grad()
        with recording(ready) as rec, watching(label):
            loss = F.mse_loss(model(x), y)
            rec.phase = "backward"
            loss.backward()
            rec.phase = "finish_gradient_synchronization()"
            model.finish_gradient_synchronization()
        launches = rec.calls_of("all_reduce")
        agree(_overlap_problem(launches, n, per_parameter=True)
              or _raced(launches, _grad_names(base), "divide before the launch, as DDP does, or "
                        "after wait(), never between the two. Write p.grad.div_(world), then "
                        "launch its all-reduce"), label)
        run.reference_backward(step)
        run.compare_grads(label)
        run.step_and_compare(label)
    return [run.info(f"start, gradients and weights over {STEPS} SGD steps on {world} ranks:"),
            f"{n} asynchronous all-reduces a step, one per parameter, launched inside backward and "
            "waited for"]


def _overlap_problem(launches, n, per_parameter, overlap=True):
    if not launches:
        return hinted("no dist.all_reduce was called during the step",
                      "launch the gradients' all-reduces from hooks, with "
                      "p.register_post_accumulate_grad_hook")
    inside = [c for c in launches if c.phase == "backward"]
    if not inside:
        return hinted(f"all {len(launches)} all-reduces were launched after backward, in "
                      f"{launches[0].phase}. So nothing overlaps backward",
                      "launch each all-reduce from a hook as its gradient becomes ready, with "
                      "p.register_post_accumulate_grad_hook. Use async_op=True, and wait only at "
                      "the end")
    blocking = [c for c in inside if not c.async_op]
    if blocking:
        return hinted(f"{len(blocking)} of the all-reduces inside backward were blocking "
                      "(async_op=False). Backward stops at each one until it completes",
                      "launch with async_op=True, and keep the Work it returns. Wait for all of "
                      "them at the end")
    if per_parameter and len(launches) != n:
        return hinted(f"{len(launches)} all-reduces for {n} parameters. This rung sends one per "
                      "parameter, each from its own parameter's hook")
    late = [c for c in launches if c.phase != "backward"]
    if late:
        return hinted(f"{len(late)} of {len(launches)} all-reduces were launched after backward")
    if overlap and min(c.ready for c in inside) >= n:
        return hinted(f"the first all-reduce was launched only once all {n} gradients were ready. "
                      "So nothing overlapped backward",
                      "launch from the gradient hooks as soon as what you send is complete, not at "
                      "the end")
    unwaited = [c for c in launches if c.work is not None and not c.work.waited]
    if unwaited:
        return hinted(f"{len(unwaited)} of {len(launches)} all-reduces were never waited for "
                      "before the gradients were used",
                      "call .wait() on every Work before anyone reads backward's results. Do it in "
                      "finish_gradient_synchronization(), or in a callback at the end of backward")
    return None


def check_buckets(wrapper_class: type) -> list[str]:
    """Rung 6, the core of 05. Buckets in DDP's layout, each launched from the hooks once complete.

    They go out in bucket order, each multiplied by 1/N before the sum. Nothing goes out inside
    no_sync(). The check runs on TinyNet, whose gradients arrive in bucket order. Then it runs on
    OrderNet, whose gradients do not. There a bucket launched as soon as it is full goes out of
    turn."""
    info = _grade_buckets(wrapper_class, TinyNet, STEPS, accumulate=2)
    _grade_buckets(wrapper_class, OrderNet, 2, accumulate=None)
    return [info[0], info[1] + ". The same holds on a model whose gradients arrive in another "
            "order than its buckets (a layer used first, one used twice, a frozen one between)"]


def _grade_buckets(wrapper_class, net, steps, accumulate):
    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_net(rank, net)
    ready = count_ready(base)
    model_label = ("" if net is TinyNet
                   else f", {net.__name__} (gradients arrive in another order than the buckets)")
    with recording(), watching("the constructor" + model_label):
        model = wrapper_class(base, bucket_cap_mb=BUCKET_CAP_MB)
    run = _Run(base, seed=rank, net=net, bucket_cap_mb=BUCKET_CAP_MB)
    run.compare_start("after construction" + model_label)
    params = dict(base.named_parameters())
    layout = expected_buckets(base, int(BUCKET_CAP_MB * 2**20))
    sizes = [sum(params[name].numel() for name in b) for b in layout]
    # Optional, since DDP waits at the end of backward.
    finish = getattr(model, "finish_gradient_synchronization", None)
    rebuilt = None  # DDP's layout from the second step on, in the order the first backward produced
    for step in range(steps):
        label = f"step {step + 1} of {steps}" + (" (two micro-batches, the first under no_sync())"
                                                  if step == accumulate else "") + model_label
        run.opt.zero_grad()
        micros = 2 if step == accumulate else 1
        problem = None
        for m in range(micros):
            x, y = batch(step, rank, m)
            synced = m == micros - 1
            quiet = contextlib.nullcontext() if synced else model.no_sync()
            with recording(ready) as rec, watching(label):
                with quiet:
                    loss = F.mse_loss(model(x), y)
                    rec.phase = "backward"
                    loss.backward()
                    rec.phase = "finish_gradient_synchronization()"
                    if finish is not None:
                        finish()
            launches = rec.calls_of("all_reduce")
            if problem is not None:
                continue
            if not synced and launches:
                problem = hinted(f"{len(launches)} all-reduces were launched during a backward "
                                 "inside no_sync()",
                                 "inside no_sync() the gradients add up locally, with no "
                                 "communication at all. The next backward outside it averages the "
                                 "sum")
            elif synced:
                arrived = _completion_order(layout, ready)
                if rebuilt is None:
                    rebuilt = _fill([(n, params[n]) for n in ready[1]], int(BUCKET_CAP_MB * 2**20))
                got = [c.numel for c in launches]
                rebuilt_sizes = [sum(params[n].numel() for n in b) for b in rebuilt]
                if step > 0 and got != sizes and got == rebuilt_sizes:
                    used = rebuilt  # rebuilt as DDP does: another layout, still in bucket order
                    problem = _overlap_problem(launches, sum(map(len, rebuilt)),
                                               per_parameter=False, overlap=net is TinyNet)
                else:
                    used = layout
                    problem = _bucket_problem(launches, sizes, layout, arrived, first=step == 0,
                                              overlap=net is TinyNet)
                problem = problem or _raced(
                    launches, _launch_names(launches), "multiply the bucket by 1/N before you "
                    "launch its all-reduce, as DDP does. Leave the bucket alone between the launch "
                    "and wait()")
        run.reference_backward(step, micros)
        if problem is None and step not in (0, accumulate):
            problem = _undivided(launches, used, run)
        agree(problem, label)
        # Ranks that launch in different orders pair different buckets in one all-reduce. Say so,
        # before the comparison of the gradients reports only a wrong number.
        agree(_orders_differ([c.numel for c in launches], sizes), label)
        run.compare_grads(label)
        run.step_and_compare(label)
    return [run.info(f"start, gradients and weights over {steps} SGD steps (one with no_sync) on "
                     f"{world} ranks:"),
            f"{len(sizes)} buckets of {sizes} elements (bucket_cap_mb={BUCKET_CAP_MB * 2**20:g} "
            "bytes), launched asynchronously inside backward, in bucket order, each multiplied by "
            "1/N before the sum. Nothing went out inside no_sync()"]


def _launch_names(launches):
    """A function that names an all-reduced tensor by its place in the launch order ("bucket 1")."""
    return lambda t: next(f"bucket {k}" for k, c in enumerate(launches) if c.tensor is t)


def _completion_order(layout, ready):
    """The buckets in the order their last gradient arrived in this backward (from count_ready)."""
    arrival = {name: k for k, name in enumerate(ready[1])}
    done = [max((arrival.get(n, math.inf) for n in names), default=math.inf) for names in layout]
    return sorted(range(len(layout)), key=lambda k: done[k])


PAIRED_BY_ORDER = (
    "Collectives pair up by the order in which each rank issues them, not by what they carry. "
    "Suppose the gradients arrive in different orders on different ranks, after a branch taken on "
    "one rank's data, a layer used twice, or another CUDA stream. Then one rank's bucket {a} is "
    "summed with another rank's bucket {b}. When their sizes match, the gradients come out "
    "silently wrong. When they differ, gloo stops with 'Received data size doesn't match expected "
    "size', and the other rank with 'Connection reset by peer'. When one rank issues an all-reduce "
    "that the other never does, the run hangs")


def _bucket_problem(launches, sizes, layout, arrived, first, overlap=True):
    got = [c.numel for c in launches]
    if first and got == [sum(sizes)]:
        return None  # DDP's own first step: one bucket, rebuilt from the order backward produced
    if got != sizes:
        described = "; ".join(f"bucket {k}: {', '.join(b)} ({s} elements)" for k, (b, s) in
                              enumerate(zip(layout, sizes)))
        if sorted(got) == sorted(sizes):
            order = [sizes.index(n) for n in got]
            if order == arrived:
                return hinted(
                    "buckets launched in the order their gradients arrived, not in bucket order. "
                    f"The all-reduces carried buckets {order} ({got} elements). DDP's order is "
                    f"{list(range(len(sizes)))} ({described}). On this model the gradients arrive "
                    "in another order than the buckets. So each bucket launched the moment it was "
                    "full went out of turn. Here every rank's gradients arrived in the same order, "
                    "so the sums matched. " + PAIRED_BY_ORDER.format(a=order[0], b=0),
                    "launch strictly in bucket order. Keep the index of the next bucket to launch. "
                    "When a bucket is complete, launch it only if every bucket before it has gone "
                    "out, and then the complete ones after it. A bucket that waits for a parameter "
                    "used early holds back the ones after it")
            return hinted(f"buckets launched out of order. The all-reduces carried buckets {order} "
                          f"({got} elements), in this order. DDP's bucket order is "
                          f"{list(range(len(sizes)))} ({described})",
                          "launch strictly in bucket order. Bucket 0 holds the last registered "
                          "parameters, whose gradients usually come first. "
                          + PAIRED_BY_ORDER.format(a=order[0], b=0))
        return hinted(f"the all-reduces carried {got} elements, but DDP's buckets hold {sizes} "
                      f"({described})",
                      "walk the parameters that require a gradient in reverse order, since "
                      "gradients usually arrive back to front. Close a bucket once it holds "
                      "bucket_cap_mb MiB or more. Launch one all-reduce per bucket")
    return _overlap_problem(launches, sum(len(b) for b in layout), per_parameter=False,
                            overlap=overlap)


def _orders_differ(got, sizes):
    """A problem when the ranks launched their buckets in different orders, or different buckets."""
    orders = gather_objects(got)
    if all(o == orders[0] for o in orders):
        return None
    words = "; ".join(f"rank {k}: {o}" for k, o in enumerate(orders))
    k = next(i for i in range(max(map(len, orders)))
             if len({tuple(o[i:i + 1]) for o in orders}) > 1)
    return hinted(f"the ranks launched different all-reduces ({words} elements, in launch order). "
                  f"All-reduce number {k + 1} of one rank was paired with a different bucket on "
                  "another",
                  "every rank must launch the same buckets in the same order, the bucket order, "
                  "whatever order its gradients arrive in")


def _undivided(launches, layout, run):
    """Whether each bucket was multiplied by 1/N before the sum.

    It compares what each all-reduce carried with this rank's own gradients of that bucket."""
    own = dict(zip(run.names, (p.grad for p in run.local.parameters())))
    for k, (call, names) in enumerate(zip(launches, layout)):
        total = sum(own[n].double().abs().sum().item() for n in names)
        if total and call.abs_sum > 0.75 * total:
            return hinted(f"bucket {k} went out undivided. Its all-reduce carried this rank's "
                          "gradients, not 1/N of them",
                          "multiply each bucket by 1/N before its all-reduce, as DDP does. A sum "
                          "of N fp16 gradients can overflow where their mean would not")
    return None


# --- rung 7: ZeRO-1 (07_zero.py) ---
class CountingSGD(torch.optim.SGD):
    """The optimizer class that the checker hands to ZeroDDP. It notes what each step updates."""

    stepped = []

    def step(self, closure=None):
        CountingSGD.stepped.append(sum(p.numel() for g in self.param_groups for p in g["params"]))
        return super().step(closure)


def check_zero1(zero_class: type) -> list[str]:
    """Rung 7, ZeroDDP(module, optimizer_class, **defaults). The weights must equal DDP's.

    The gradients are averaged as under DDP. Each rank's optimizer steps its own shard, 1/N of the
    elements. Then the ranks gather the updated shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_net(rank)
    with recording(), watching("the constructor"):
        model = zero_class(base, CountingSGD, lr=LR, momentum=MOMENTUM)
    run = _Run(base, seed=rank)
    run.compare_start("after construction")
    total = sum(p.numel() for p in base.parameters())
    for step in range(STEPS):
        label = f"step {step + 1} of {STEPS}"
        x, y = batch(step, rank)
        before = [p.detach().clone() for p in base.parameters()]
        CountingSGD.stepped = []
        with recording() as rec, watching(label):
            F.mse_loss(model(x), y).backward()
            model.step()
            model.zero_grad()
        agree(_raced(rec.calls_of("all_reduce"), lambda t: "the tensor of an all-reduce",
                     "scale the gradients before you launch their all-reduce, or after wait()"),
              label)
        run.reference_backward(step)
        run.ref_opt.step()
        problem = None
        for name, p, q, old in zip(run.names, base.parameters(), run.ref.module.parameters(),
                                   before):
            if not run._equal(p.detach(), q.detach()):
                problem = _zero_problem(name, p.detach(), q.detach(), old, world)
                break
        agree(problem, label)
        mine = max(CountingSGD.stepped, default=0)
        shares = gather_objects(mine)
        problem = None
        if mine >= total:
            problem = hinted(f"this rank's optimizer stepped all {total} elements. ZeRO-1 steps "
                             f"only this rank's shard, about {total // world}",
                             "give the optimizer only this rank's 1/N of the parameters. 07 cuts "
                             "each flat bucket into N equal shards. Then each rank's state is 1/N "
                             "of the whole")
        elif sum(shares) != total:
            problem = hinted(f"the ranks' optimizers stepped {shares} elements, {sum(shares)} in "
                             f"all, for {total} parameters. The shards must cover every element "
                             "exactly once")
        agree(problem, label)
    shares = gather_objects(max(CountingSGD.stepped, default=0))
    return [run.info(f"start and weights over {STEPS} steps of SGD with momentum on {world} "
                     "ranks:"),
            f"each rank's optimizer steps {shares} of {total} elements, and keeps state for its "
            "shard only"]


def _zero_problem(name, got, want, old, world):
    stale = (got == old) & (want != old)
    if stale.any():
        i = int(stale.reshape(-1).nonzero()[0])
        return hinted(f"{name}: {int(stale.sum())} of {got.numel()} elements kept their old values "
                      f"where DDP's changed. The first is at [{index_of(got, i)}]",
                      "after it steps its own shard, each rank must all-gather the updated shards. "
                      "Then every rank ends with every parameter. And every element must belong to "
                      "some rank's shard")
    if torch.allclose(got - old, (want - old) * world, rtol=1e-4, atol=1e-7):
        return hinted(f"{name}: the update is {world}x DDP's. The gradients were summed, not "
                      "averaged",
                      f"divide by the world size (N = {world}) before the step")
    i = first_difference(got, want)
    return hinted(f"weights after the step: {name}[{index_of(got, i)}] is "
                  f"{num(got.reshape(-1)[i])}, DDP's {num(want.reshape(-1)[i])}")


# --- rung 8: find the bug (09_debugging.py) ---
def check_find_the_bug(train: Callable[[nn.Module, list], object]) -> list[str]:
    """Rung 8. After train(model, batches), every rank holds the same model, bit for bit.

    check_replicas says whether they do. The parameters must also be those of SGD on the gradient
    averaged over the ranks, clipped on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    debug_tools = lessons.load("debug_tools.py")
    torch.manual_seed(0)  # the same model on every rank, as the exercise's own run builds it
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    want = _bug_reference(model, world, lr=0.1, max_norm=0.5)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 6, generator=g) * 3, torch.randn(8, 1, generator=g))
               for _ in range(6)]
    with watching("train(model, batches)"):
        train(model, batches)
    try:
        debug_tools.check_replicas(model)
        problem = None
    except RuntimeError as e:
        problem = hinted(f"after train(), {e}",
                         "look for a step that only some ranks take, such as code under "
                         "`if rank == 0`. Look also for state that no gradient average touches. "
                         "BatchNorm's running statistics are buffers. Average them over the ranks, "
                         "or broadcast rank 0's")
    agree(problem, "the replicas")
    for name, p in model.named_parameters():
        if problem is None and not torch.allclose(p, want[name], rtol=1e-4, atol=1e-6):
            problem = hinted(f"{name} is not what SGD on the averaged, clipped gradient gives. It "
                             "is the same on every rank, but wrong",
                             "average every gradient, clip the average on every rank, then step")
    agree(problem, "the parameters")
    return [f"6 steps on {world} ranks: every parameter and buffer the same on every rank "
            "(check_replicas), and the parameters those of SGD on the averaged, clipped gradient"]


def _bug_reference(model, world, lr, max_norm):
    """The parameters that train() must reach, from every rank's batches in one process."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    data = [[(torch.randn(8, 6, generator=g) * 3, torch.randn(8, 1, generator=g))
             for _ in range(6)] for g in gens]
    for step in range(6):
        grads = []
        for r in range(world):
            opt.zero_grad()
            F.mse_loss(model(data[r][step][0]), data[r][step][1]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs) / world  # the mean gradient, then clipped as one
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return dict(model.named_parameters())


# --- the ladder: every rung, in order. check.py and the notebooks read it here ---
EXERCISES = {
    "tree_broadcast": Exercise(("tree_broadcast",), 4, check_tree_broadcast, "02_broadcast.py"),
    "ring_all_reduce": Exercise(("ring_all_reduce",), 3, check_ring_all_reduce, "03_all_reduce.py",
                                ring_speed),
    "sampler": Exercise(("DistributedSampler",), 1, check_sampler, "04_sampler.py"),
    "ddp_naive": Exercise(("average_gradients",), 2, check_average_gradients,
                          "05_manual_ddp_gpt2.py"),
    "ddp_overlap": Exercise(("OverlapDDP",), 2, check_overlap,
                            "exercises/solutions/ddp_overlap.py"),
    "ddp_buckets": Exercise(("DDPCore",), 2, check_buckets, "05_manual_ddp_gpt2.py"),
    "zero1": Exercise(("ZeroDDP",), 2, check_zero1, "07_zero.py"),
    "find_the_bug": Exercise(("train",), 2, check_find_the_bug,
                             "exercises/solutions/find_the_bug.py"),
}
