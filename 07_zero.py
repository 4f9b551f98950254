"""07 - ZeRO by hand: shard the optimizer state (stage 1) and the gradients (stage 2) over the data-parallel ranks.

What it teaches: under DDP every rank holds all parameters, gradients and optimizer state, 16 bytes a parameter
with AdamW (4 + 4 + 8 of state). ZeroDDP below keeps DDP's buckets (05) but cuts each into N equal contiguous
shards, like 03's ring chunks; each rank's optimizer steps its own shard only, so it holds 1/N of the state.
03 showed that an all-reduce is a reduce-scatter followed by an all-gather: ZeRO steps between the two halves.
  stage 1: all-reduce the gradients (as DDP), step my shard, all-gather the parameters: 1.5x DDP's bytes;
  stage 2: reduce-scatter instead (each rank receives the mean of its own shard and keeps no gradient memory
           for the rest), step, all-gather: exactly DDP's bytes.
The script trains a GPT-2 built from a GPT2Config on random tokens (offline) under PyTorch's DDP, ZeRO-1 and
ZeRO-2, prints what each rank holds and sends, and checks the weights equal DDP + AdamW's (bit for bit on gloo).

Run it:
  1 process:  python 07_zero.py
  CPU:        torchrun --nproc_per_node=2 07_zero.py
  N GPUs:     torchrun --nproc_per_node=N 07_zero.py --n-layer 12 --n-embd 768 --vocab-size 50257
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 07_zero.py
"""

import argparse
import contextlib
import copy
import ctypes
import functools
import itertools
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ADAMW_BETAS = (0.9, 0.95)  # GPT-2's, as in 05; PyTorch's default 0.999 reacts slower to a changing loss
WEIGHT_DECAY = 0.1  # on matrices only: biases and LayerNorm gains are not decayed
DATA_SEED_STRIDE = 7919  # batch seed = seed + stride * step + rank: a prime, so no two (step, rank) share a seed

# --- the idea: ZeRO stages 1 and 2 ---
# The two halves of 03's ring. torch 2.14 renamed reduce_scatter_tensor and all_gather_into_tensor to *_single.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class _Bucket:
    """Parameters flattened into one buffer, padded at the end to a multiple of N, cut into N equal shards."""

    def __init__(self, params, world, rank, stage):
        self.params, self.numels, self.pending = params, [p.numel() for p in params], len(params)
        self.used = sum(self.numels)
        self.offsets = list(itertools.accumulate(self.numels, initial=0))  # where each parameter starts in flat
        self.shard = -(-self.used // world)  # ceil: fewer than N elements of padding
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard  # my shard, as a chunk of 03's ring
        self.flat = torch.zeros(world * self.shard, dtype=params[0].dtype, device=params[0].device)
        self.transient = None  # stage 2: the bucket's full gradients, only while they are filled and sent
        # The averaged gradient: stage 1 keeps all of it (as DDP), stage 2 only this rank's shard.
        self.grad = torch.zeros_like(self.flat) if stage == 1 else self.flat.new_zeros(self.shard)
        # My piece of each parameter is the part inside my shard (often none, sometimes all of it): a 1-D view of
        # the buffer, with a view of the averaged gradient as its .grad. The optimizer steps the pieces.
        self.pieces, start = [], 0  # (parameter, piece, offset of the piece in the parameter)
        for p, view in zip(params, self.flat[: self.used].split(self.numels)):
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)  # a view of the buffer: the all-gather after each step writes straight into it
            lo, hi = max(start, self.lo), min(start + p.numel(), self.hi)
            if lo < hi:
                piece = self.flat[lo:hi]
                piece.grad = self.grad[lo:hi] if stage == 1 else self.grad[lo - self.lo : hi - self.lo]
                self.pieces.append((p, piece, lo - start))
            start += p.numel()


class ZeroDDP(nn.Module):
    """DDP and its optimizer in one; the optimizer state (stage 1) and the gradients too (stage 2) are sharded.

    ``optimizer_class(**defaults)``, any elementwise torch.optim class, steps this rank's shard only. ``params``
    takes what it would: the module's parameters, or dicts of parameter groups with their own options (default
    ``module.parameters()``); checkpoints number parameters in that order. Call it as the model, then
    ``loss.backward()``, ``step()``, ``zero_grad()``. Gradient accumulation as under DDP: backward calls before
    ``zero_grad()`` add up (each reduced), or inside ``no_sync()`` autograd sums them locally (full size) until
    a backward outside it reduces the sum. A scheduler takes ``.optim``, the shard's optimizer. Buffers as under
    DDP: rank 0's everywhere at the start and, with ``broadcast_buffers`` (DDP's default), before each forward.
    """

    def __init__(self, module, optimizer_class, stage=2, process_group=None, bucket_cap_mb=None, params=None,
                 broadcast_buffers=True, **defaults):
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"ZeroDDP: stage must be 1 or 2, got {stage!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"ZeroDDP: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        optimizer_class([torch.zeros(1)], **defaults)  # bad options fail here, on all ranks, before any collective
        self.module, self.stage, self.group = module, stage, process_group or dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.root = dist.get_global_rank(self.group, 0)
        groups = list(module.parameters() if params is None else params)
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [dict(g, params=list(g["params"])) for g in groups]
        self.params = [p for g in groups for p in g["params"]]  # the plain optimizer's numbering
        number = {p: i for i, p in enumerate(self.params)}
        self.numbers = [[number[p] for p in g["params"]] for g in groups]
        with torch.no_grad():  # replicas start identical, as under DDP: rank 0's values win
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=self.root, group=self.group)
        # DDP's buckets, by 05's rule, so the layouts agree: reverse registration order, 1 MiB for the first and
        # 25 MiB for the others, or bucket_cap_mb for all. Frozen parameters stay out.
        caps = [1, 25] if bucket_cap_mb is None else [bucket_cap_mb]
        self.buckets, cur, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad and p in number]):
            full = size >= caps[min(len(self.buckets), len(caps) - 1)] * 2**20
            if cur and (full or p.dtype != cur[0].dtype or p.device != cur[0].device):  # one dtype, one device
                self.buckets.append(_Bucket(cur, self.world, self.rank, stage))
                cur, size = [], 0
            cur.append(p)
            size += p.numel() * p.element_size()
        if cur:
            self.buckets.append(_Bucket(cur, self.world, self.rank, stage))
        group_of, pieces = {p: k for k, g in enumerate(groups) for p in g["params"]}, [[] for _ in groups]
        for b in self.buckets:
            for p, piece, off in b.pieces:
                pieces[group_of[p]].append((piece, number[p], off))
        self.pieces = [t for ps in pieces for t in ps]  # (piece, parameter number, offset), in the optimizer's order
        self.optim = optimizer_class([dict(g, params=[t[0] for t in ps]) for g, ps in zip(groups, pieces)],
                                     **defaults)
        self._queued, self._next, self._inflight, self._accumulate = False, 0, [], False
        self.require_backward_grad_sync = True  # DDP's name for it: off inside no_sync()
        self.broadcast_buffers, self.require_forward_param_sync = broadcast_buffers, True  # DDP's names too
        self.gloo = dist.get_backend(self.group) == "gloo"  # see _reduce_scatter
        # Stage 2's transients (full-size buckets of gradients, alive while they fill and travel) may take at most
        # half of what sharding the gradients saves, or one bucket where a bucket is larger: so stage 2 keeps most
        # of its saving on any model, overlapping as much communication with backward as that allows.
        saved = sum((b.flat.numel() - b.grad.numel()) * b.flat.element_size() for b in self.buckets)
        self._budget = max([saved // 2] + [b.flat.nbytes for b in self.buckets])
        for b in self.buckets:
            for slot, p in enumerate(b.params):
                if stage == 2:
                    p.register_hook(functools.partial(self._grad_arriving, b, slot))
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b))

    @property
    def param_groups(self):
        return self.optim.param_groups

    def forward(self, *args, **kwargs):
        # As DDP: rank 0's buffers (BatchNorm's running statistics) reach every rank before a forward, unless the
        # forward before it accumulated (no_sync) or ran without gradients.
        if self.broadcast_buffers and self.require_forward_param_sync:
            with torch.no_grad():
                for t in self.module.buffers():
                    dist.broadcast(t, src=self.root, group=self.group)
        out = self.module(*args, **kwargs)
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """As DDP's: backward reduces nothing inside it; autograd sums the full gradients on each rank."""
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True

    def _grad_arriving(self, b, slot, grad):
        """Stage 2, a tensor hook, just before autograd adds a parameter's gradient: a missing .grad becomes its
        slot in the bucket's transient, so that backward writes the full gradients there, nothing copied."""
        p = b.params[slot]
        if self.require_backward_grad_sync and p.grad is None and grad is not None:
            if b.transient is None:  # the bucket's first gradient
                self._make_room(b)
                b.transient = torch.zeros_like(b.flat)
            p.grad = b.transient[b.offsets[slot] : b.offsets[slot] + p.numel()].view_as(p)
        return grad

    def _on_grad_ready(self, bucket, p):
        """Runs inside backward, right after autograd accumulated p's gradient into p.grad."""
        if not self.require_backward_grad_sync:
            return
        if not self._queued:  # first gradient of this backward: finish once the whole backward is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self):
        # Strictly in bucket order on every rank: collectives are matched by the order ranks issue them.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            if self.stage == 1:
                self._all_reduce(self.buckets[self._next])
            else:
                self._reduce_scatter(self.buckets[self._next])
            self._next += 1

    def _all_reduce(self, b):
        """Stage 1, as DDP: all-reduce the whole bucket; every rank receives the whole mean, into b.grad."""
        for p, view in zip(b.params, b.grad[: b.used].split(b.numels)):
            if self._accumulate:  # a backward before zero_grad(): DDP's .grad is the last mean plus the new gradient
                p.grad = view.view_as(p) if p.grad is None else p.grad.add_(view.view_as(p))
            if p.grad is None:  # no gradient on this rank: it counts as zero in the mean
                view.zero_()
            else:  # divide BEFORE the sum, with DDP's own multiply: no fp16 overflow, and DDP's bits
                torch.mul(p.grad, 1 / self.world, out=view.view_as(p))
            p.grad = None  # the bucket has it now: autograd's copy is freed
        b.grad[b.used :].zero_()
        # (Work, bucket, stage 2's transient, stage 2's shard, add it?): kept until waited for in _finish.
        self._inflight.append((dist.all_reduce(b.grad, group=self.group, async_op=True), b, None, None, False))

    def _reduce_scatter(self, b):
        """Stage 2: the all-reduce's first half only. Each rank receives the mean of its own shard, into b.grad
        (after a backward before zero_grad(), into a shard of its own, added to the last mean once it is there);
        the whole bucket exists only while it fills and travels (its transient, freed once it is sent)."""
        full = self._transient_gradients(b)
        out = torch.empty_like(b.grad) if self._accumulate else b.grad
        if self.gloo:  # gloo has no reduce-scatter: its reduce_scatter_single all-reduces a copy of the whole
            # buffer and keeps one chunk. The same all-reduce in place gives the same bits without the copy.
            work = dist.all_reduce(full, group=self.group, async_op=True)
        else:
            work = reduce_scatter(out, full, group=self.group, async_op=True)
        self._inflight.append((work, b, full, out, self._accumulate))

    def _transient_gradients(self, b):
        """Stage 2: the bucket's transient, times 1/N (before the sum, DDP's own multiply: no fp16 overflow, and DDP's
        bits). Gradients that did not come through _grad_arriving (summed under no_sync) are copied in."""
        if b.transient is None:  # no gradient came through the hook
            self._make_room(b)
            b.transient = torch.zeros_like(b.flat)
        full, b.transient = b.transient, None
        for p, view in zip(b.params, full[: b.used].split(b.numels)):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            p.grad = None  # the bucket has it now
        return full.mul_(1 / self.world)

    def _make_room(self, b):
        """Wait for the oldest transients in flight until b's fits in the budget beside the others."""
        while self._inflight and sum(t[2].nbytes for t in self._inflight) + b.flat.nbytes > self._budget:
            self._wait(self._inflight.pop(0))

    def _wait(self, inflight):
        work, b, full, out, add = inflight
        work.wait()
        if out is not None and self.gloo:  # stage 2 on gloo: my shard of the all-reduced bucket
            out.copy_(full[b.lo : b.hi])
        if add:
            b.grad.add_(out)

    def _finish(self):
        """End of backward: send the buckets whose gradients never came (unused parameters), then wait."""
        self._queued = False
        for b in self.buckets[self._next :]:
            b.pending = 0
        self._launch_ready()
        for inflight in self._inflight:
            self._wait(inflight)
        for b in self.buckets:
            b.pending = len(b.params)
        self._inflight, self._next, self._accumulate = [], 0, True  # until zero_grad(): the next backward adds

    def step(self, closure=None):
        """Step this rank's shard, then all-gather the shards: every rank ends with every updated parameter."""
        loss = self.optim.step(closure)
        # The Works are kept until the next step, for a clean exit on gloo (docs/zero.md, "A clean exit").
        self._gathers = [all_gather(b.flat, b.flat[b.lo : b.hi], group=self.group, async_op=True)
                         for b in self.buckets]
        for work in self._gathers:
            work.wait()
        return loss

    def zero_grad(self, set_to_none=True):
        """The next backward overwrites the averaged gradients instead of adding to them."""
        self._accumulate = False
        self.module.zero_grad(set_to_none)

    # Checkpoints: the plain optimizer's state_dict, put together from the shards, and back.
    def state_dict(self):
        """The plain optimizer's state_dict on the group's rank 0 (CPU tensors; None elsewhere): state shaped like
        its piece is per element, put together from the shards; the rest (AdamW's step) is the same in every shard."""
        mine = []
        for piece, i, off in self.pieces:
            for k, v in self.optim.state.get(piece, {}).items():
                per_element = torch.is_tensor(v) and v.shape == piece.shape
                mine.append((i, k, off if per_element else None, v.cpu() if torch.is_tensor(v) else v))
        everyone = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, everyone, dst=self.root, group=self.group)  # every rank must call state_dict()
        if self.rank != 0:
            return None
        state = {}
        for i, k, off, v in [t for rank_state in everyone for t in rank_state]:
            whole = state.setdefault(i, {})
            if off is None:
                whole[k] = v
                continue
            if k not in whole:
                whole[k] = torch.zeros(self.params[i].shape, dtype=v.dtype)
            whole[k].view(-1)[off : off + len(v)] = v
        groups = [dict(g, params=numbers) for g, numbers in zip(self.optim.param_groups, self.numbers)]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Load a plain optimizer's state_dict (ZeRO's or not) on every rank: each keeps the slices of its shard."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(numbers) for numbers in self.numbers]:
            raise ValueError("ZeroDDP.load_state_dict: the parameter groups differ from this optimizer's")
        # Saved and our parameter numbers, matched position by position within each group (as torch.optim does).
        by_number = {i: state_dict["state"].get(s, {}) for g, numbers in zip(saved, self.numbers)
                     for s, i in zip(g["params"], numbers)}
        state = {}
        for k, (piece, i, off) in enumerate(self.pieces):
            for key, v in by_number[i].items():
                if torch.is_tensor(v) and v.shape == self.params[i].shape:  # per element: my slice of it
                    v = v.reshape(-1)[off : off + piece.numel()]
                # A copy: torch's load_state_dict would keep the caller's tensor (always the step) and step it.
                state.setdefault(k, {})[key] = v.clone() if torch.is_tensor(v) else v
        ours = self.optim.state_dict()["param_groups"]  # our optimizer's own numbers for its pieces
        groups = [dict(g, params=mine["params"]) for g, mine in zip(saved, ours)]
        self.optim.load_state_dict({"state": state, "param_groups": groups})


# --- model, data, what a rank holds ---
NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2"}


def build_model(args, device):
    from transformers import GPT2Config, GPT2LMHeadModel, logging
    logging.set_verbosity_error()  # its notes on the config we set on purpose
    torch.manual_seed(args.seed)  # the same seed on every rank: identical replicas (the wrappers broadcast anyway)
    cfg = GPT2Config(vocab_size=args.vocab_size, n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
                     n_head=args.n_embd // 64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).to(device)


def tokens(step, args, device):
    """Random tokens: a different batch on every rank (the seed adds the rank) and step, the same in every run."""
    g = torch.Generator().manual_seed(args.seed + DATA_SEED_STRIDE * step + RANK)
    return torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=g).to(device)


def loss_of(model, x):
    return F.cross_entropy(model(input_ids=x[:, :-1], use_cache=False).logits.flatten(0, 1), x[:, 1:].flatten())


def held_bytes(*tensor_lists):
    """Bytes of the distinct storages behind each list of tensors: what a rank really holds, padding included."""
    return [sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())
            for ts in tensor_lists]


def memory_status():
    """This process's memory counters from Linux (VmRSS, VmHWM, RssAnon, ...), in bytes."""
    with open("/proc/self/status") as f:
        rows = [line.split() for line in f if line.rstrip().endswith("kB")]
    return {row[0].rstrip(":"): int(row[1]) * 1024 for row in rows}


def peak_memory(fn, device):
    """(fn(), the most memory in use while it ran, beyond what was in use before). CUDA: the allocator's tensor bytes.
    CPU (Linux): the resident set less code pages; glibc frees blocks of 64 KiB or more at once (main sets it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        return fn(), torch.cuda.max_memory_allocated(device) - before
    if not os.path.exists("/proc/self/clear_refs"):  # not Linux: no measure here
        return fn(), float("nan")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the resident set's high-water mark (VmHWM) to its current size
    before = memory_status()["RssAnon"]
    out, now = fn(), memory_status()
    return out, now["VmHWM"] - (now["VmRSS"] - now["RssAnon"]) - before  # the code pages are still resident now


# --- training: one loop for DDP + AdamW and for ZeroDDP ---
def train(kind, base, args, device):
    """Train a copy of ``base`` with AdamW under PyTorch's DDP (kind 0) or ZeRO stage ``kind``."""
    model = copy.deepcopy(base)
    # Weight decay on matrices only, not on biases and LayerNorm gains: two parameter groups.
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opts = dict(lr=args.lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY)
    if kind == 0:
        ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb)
        optimizer = inner = torch.optim.AdamW(groups, **opts)
        sent = 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)  # x (N-1)/N
    else:  # one object is both the model to call and the optimizer to step
        wrapped = optimizer = ZeroDDP(model, torch.optim.AdamW, kind, bucket_cap_mb=args.bucket_cap_mb, params=groups,
                                      **opts)
        inner = optimizer.optim
        # x (N-1)/N of the buckets' bytes: stage 1 all-reduces (2) and all-gathers (1); stage 2 halves the first.
        sent = (3 if kind == 1 else 2) * sum(b.flat.numel() * b.flat.element_size() for b in optimizer.buckets)
    loss_of(wrapped, tokens(-1, args, device)).backward()  # warm-up, no step: DDP settles its buckets (docs/zero.md)
    optimizer.zero_grad()
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        loss = loss_of(wrapped, tokens(step, args, device))
        loss.backward()
        optimizer.step()
        grads = [p.grad for g in inner.param_groups for p in g["params"] if p.grad is not None]
        state = [v for s in inner.state.values() for v in s.values()]
        held = held_bytes(model.parameters(), grads, state)  # at the step, when all three are alive
        optimizer.zero_grad()
        losses.append(loss.item())
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    return dict(model=model, optimizer=optimizer, held=held, sent=sent * (WORLD - 1) / WORLD, losses=losses, ms=ms)


def check(runs, kinds, device, atol):
    """Weights bit-identical across ranks and equal to DDP + AdamW's: bit for bit where the gradient sums are (gloo,
    or 2 ranks; docs/zero.md), else to ``atol``; finite (too large an --lr diverges). One verdict for all ranks."""
    exact = dist.get_backend() == "gloo" or WORLD <= 2
    ref = torch.cat([p.detach().reshape(-1) for p in runs[0]["model"].parameters()])
    for kind in kinds[1:]:
        w = torch.cat([p.detach().reshape(-1) for p in runs[kind]["model"].parameters()])
        rank0 = w.clone()
        dist.broadcast(rank0, src=0)
        same = torch.equal(w, ref) if exact else torch.allclose(w, ref, rtol=0, atol=atol)
        lost = not torch.cat([ref, w, w.new_tensor(runs[0]["losses"] + runs[kind]["losses"])]).isfinite().all()
        bad = torch.tensor([float(not torch.equal(rank0, w)), float(not same), float(lost)], device=device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad[2]:  # nan equals nothing: "the weights differ" would send the reader hunting for a bug
            raise UsageError(f"{NAMES[kind]} or DDP: the loss or the weights went to inf or nan: try a smaller --lr")
        if bad.any():
            raise RuntimeError(f"{NAMES[kind]}: weights differ across ranks ({bad[0].item():.0f}) or from DDP's "
                               f"({bad[1].item():.0f}, by up to {(w - ref).abs().max():.3g})")
    return exact


def main(args):
    device = setup(args)
    if device.type == "cpu" and sys.platform == "linux":
        ctypes.CDLL(None).mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD (see peak_memory)
    if device.type == "cuda":
        # The runs compared below are separate runs: on a GPU, attention's backward (memory-efficient and flash
        # SDPA) and cuBLAS may add in a different order each time. Deterministic mode picks kernels that do not.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS needs
        torch.use_deterministic_algorithms(True)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} torch={torch.__version__}")
    base = build_model(args, device)
    n = sum(p.numel() for p in base.parameters())
    print0(f"GPT-2: {n / 1e6:.2f}M parameters, {4 * n / 2**20:.1f} MiB in fp32, AdamW's state {8 * n / 2**20:.1f} MiB "
           f"| {args.steps} steps of {args.batch_size}x{args.seq_len} random tokens per rank")
    kinds = [0, args.stage] if args.stage else [0, 1, 2]  # DDP (kind 0) first: the reference
    loss_of(base, tokens(0, args, device)).backward()  # lazy initialisation (thread pools, kernels) before measuring
    base.zero_grad(set_to_none=True)
    runs = {}
    for kind in kinds:
        result, peak = peak_memory(functools.partial(train, kind, base, args, device), device)
        runs[kind] = dict(result, peak=peak)
        first, last = result["losses"][0], result["losses"][-1]
        print0(f"{NAMES[kind]:<6} | rank 0 loss {first:.4f} -> {last:.4f} | {result['ms']:7.1f} ms/step")
    # Where sums differ in the last bit (NCCL's reduce-scatter on 3+ ranks), AdamW moves an element by a small part
    # of lr a step (2.3e-6 in 5 steps at lr 1e-3, once measured on gloo with mismatched layouts): allow 1% of lr a step.
    atol = 0.01 * args.lr * args.steps
    exact = check(runs, kinds, device, atol)
    table = [None] * WORLD
    dist.all_gather_object(table, [(*runs[k]["held"], runs[k]["peak"], runs[k]["sent"]) for k in kinds])
    print0("\n| rank | MiB | " + " | ".join(NAMES[k] for k in kinds) + " |\n|---:|---|" + "---:|" * len(kinds))
    for rank, cols in enumerate(table):
        for j, what in enumerate(["parameters", "gradients", "optimizer state", "peak memory", "sent per step"]):
            ratios = [f" ({c[j] / cols[0][j]:.2f}x)" if j == 4 and cols[0][j] else "" for c in cols]
            print0(f"| {rank} | {what} | " + " | ".join(f"{c[j] / 2**20:.2f}{r}" for c, r in zip(cols, ratios)) + " |")
    print0("sent: the bytes a ring sends per rank (the busbw factor): all-reduce 2(N-1)/N of the buffer, "
           "reduce-scatter and all-gather (N-1)/N each; gloo reduce-scatters by all-reducing a copy, NCCL halves it")
    print0(f"OK {' and '.join(NAMES[k] for k in kinds[1:])} on {WORLD} rank(s): weights "
           f"{'bit-identical to' if exact else f'within {atol:.1e} of'} DDP + AdamW's, ranks identical")


# --- command line ---
def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--stage", type=int, choices=[1, 2], default=None, help="one ZeRO stage (default both; DDP always)")
    p.add_argument("--steps", type=at_least(1), default=5, help="optimizer steps per run")
    p.add_argument("--n-layer", type=at_least(1), default=4, help="GPT-2 layers")
    p.add_argument("--n-embd", type=at_least(64), default=256, help="GPT-2 width, a multiple of 64 (a head each)")
    p.add_argument("--vocab-size", type=at_least(1), default=4096, help="tokens in the vocabulary")
    p.add_argument("--seq-len", type=at_least(1), default=128, help="tokens per sequence")
    p.add_argument("--batch-size", type=at_least(1), default=4, help="sequences per rank per step")
    p.add_argument("--bucket-cap-mb", type=at_least(0.001, float), default=1.0,
                   help="gradient bucket size, for DDP and ZeRO alike")
    p.add_argument("--lr", type=at_least(0.0, float), default=1e-3,
                   help=f"AdamW learning rate (weight decay {WEIGHT_DECAY} on matrices)")
    p.add_argument("--seed", type=at_least(0, below=2**32), default=0,
                   help="model init (same on all ranks); the data adds the rank")
    args = p.parse_args(argv)
    if args.n_embd % 64:
        p.error(f"--n-embd must be a multiple of 64 (one attention head per 64), got {args.n_embd}")
    return args


# --- setup: the same block in every numbered script, copied so that each file runs alone ---
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # from torchrun


class UsageError(Exception): ...  # a bad flag or input: one `error:` line (run()), exit status 2


def print0(*msg):  # rank 0 tells the story, once. One write, so that lines from ranks never mix.
    if RANK == 0:
        print(" ".join(map(str, msg)) + "\n", end="", flush=True)


def at_least(low, kind=int, below=math.inf):  # a number flag's type: low <= value < below
    def parse(text):
        if not low <= kind(text) < below:
            raise argparse.ArgumentTypeError(f"must be >= {low} and < {below}, got {text}")
        return kind(text)
    return parse


class Parser(argparse.ArgumentParser):  # the flags every script shares
    def __init__(self, doc, timeout_s=120):
        super().__init__(description=doc.split("\n")[0],
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        self.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        self.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl if GPUs")
        self.add_argument("--timeout-s", type=at_least(1, float), default=timeout_s,
                          help="how long a rank waits for a peer")

    def error(self, message): raise UsageError(message)  # one line from rank 0 (run())


def setup(args):  # pick this rank's device, then join the group
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never asks CUDA
    backend = args.backend or ("nccl" if gpus >= local_world else "gloo")  # NCCL: a GPU per rank
    if (args.device == "cuda" and gpus == 0) or (backend == "nccl" and gpus < local_world):
        raise UsageError(f"--backend {backend}: {gpus} CUDA GPU(s) for {local_world} ranks")
    on_gpu = gpus >= local_world or args.device == "cuda"  # gloo lets the ranks share GPUs
    device = torch.device(f"cuda:{local_rank % gpus}" if on_gpu else "cpu")
    if device.type == "cuda":  # before init, so that NCCL binds this rank to its GPU
        torch.cuda.set_device(device)
    print0(f"device: {device.type}, {backend} "
           f"(--device {args.device}, {gpus} GPU(s) for {local_world} ranks/node)")
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **alone)
    return device


def run(main, parse_args):  # a dead peer ends in the library's timeout error, never a hang
    try:
        main(parse_args())
    except UsageError as e:  # every rank stops alike, with exit status 2. Rank 0 says why.
        print0(f"error: {e}")
        os._exit(2)  # at once: tearing down a live group can abort in gloo's threads (SIGABRT)
    dist.destroy_process_group()  # main() always joins the group first
    time.sleep(0.05)  # gloo's threads drop their last tensors before exit, or it can abort


if __name__ == "__main__":
    run(main, parse_args)
