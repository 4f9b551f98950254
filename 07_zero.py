"""07 - ZeRO by hand: shard the optimizer state (stage 1) and the gradients (stage 2) over ranks.

Under DDP every rank holds all the parameters, gradients and optimizer state. With AdamW that is 16
bytes a parameter: 4 for the weight, 4 for its gradient and 8 for AdamW's state. ZeroDDP below keeps
DDP's buckets from 05, but cuts each bucket into N equal shards, like the chunks of 03's ring. Each
rank's optimizer steps its own shard only, so each rank holds 1/N of the state. 03 showed that an
all-reduce is a reduce-scatter followed by an all-gather. ZeRO steps the optimizer between the two.
  stage 1  All-reduce the gradients as DDP does, step my shard, then all-gather the parameters.
           It sends 1.5 times DDP's bytes.
  stage 2  Reduce-scatter instead, so each rank receives the mean of its own shard only. It keeps
           no gradient memory for the rest. Then step and all-gather. It sends exactly DDP's bytes.
The script builds a GPT-2 from a GPT2Config and trains it on random tokens, offline. It trains under
PyTorch's DDP, ZeRO-1 and ZeRO-2, and prints what each rank holds and sends. It checks that the
weights equal those of DDP + AdamW, bit for bit on gloo.

Run it:
  1 process:  python 07_zero.py
  CPU:        torchrun --nproc_per_node=2 07_zero.py
  N GPUs:     torchrun --nproc_per_node=N 07_zero.py --n-layer 12 --n-embd 768 --vocab-size 50257
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST \\
                  --master_port=29500 07_zero.py
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
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ADAMW_BETAS = (0.9, 0.95)  # GPT-3's, as in 05 and nanoGPT. PyTorch's default is (0.9, 0.999).
WEIGHT_DECAY = 0.1  # on matrices only, not on biases and LayerNorm gains
DATA_SEED_STRIDE = 7919  # seed + stride * step + rank: one per (step, rank) below 7919 ranks

# --- the idea: ZeRO stages 1 and 2 ---
# The two halves of 03's ring. torch 2.14 renamed them from *_tensor to *_single.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class _Bucket:
    """Parameters in one flat buffer, padded to a multiple of N, cut into N equal shards."""

    def __init__(self, params, world, rank, stage):
        self.params, self.numels, self.pending = params, [p.numel() for p in params], len(params)
        self.used = sum(self.numels)
        self.offsets = list(itertools.accumulate(self.numels, initial=0))  # where each one starts
        self.shard = -(-self.used // world)  # rounded up: fewer than N elements of padding
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard  # my shard, as in 03's ring
        self.flat = torch.zeros(world * self.shard, dtype=params[0].dtype, device=params[0].device)
        self.transient = None  # Stage 2 holds the full gradients only while they fill and travel.
        # The averaged gradient. Stage 1 keeps all of it, as DDP does. Stage 2 keeps my shard only.
        self.grad = torch.zeros_like(self.flat) if stage == 1 else self.flat.new_zeros(self.shard)
        # My piece of a parameter is the part inside my shard. Often that is none, sometimes all of
        # it. A piece is a 1-D view of the buffer, and its .grad a view of the averaged gradient.
        # The optimizer steps the pieces.
        self.pieces, start = [], 0  # (parameter, piece, offset of the piece in the parameter)
        for p, view in zip(params, self.flat[: self.used].split(self.numels)):
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)  # The all-gather after each step writes straight into it.
            lo, hi = max(start, self.lo), min(start + p.numel(), self.hi)
            if lo < hi:
                piece = self.flat[lo:hi]
                at = 0 if stage == 1 else self.lo  # stage 2's gradient holds my shard only
                piece.grad = self.grad[lo - at : hi - at]
                self.pieces.append((p, piece, lo - start))
            start += p.numel()


class ZeroDDP(nn.Module):
    """DDP and its optimizer in one, sharding the optimizer state (stage 1) and gradients (stage 2).

    ``optimizer_class(**defaults)`` steps this rank's shard only. It may be any elementwise
    torch.optim class. ``params`` takes what that class would take: the module's parameters, or
    dicts of parameter groups with their own options. It defaults to ``module.parameters()``, and
    checkpoints number the parameters in its order. Call it as the model, then ``loss.backward()``,
    ``step()`` and ``zero_grad()``. A scheduler takes ``.optim``, the shard's optimizer.
    Gradient accumulation works as under DDP. Backward calls before ``zero_grad()`` add up, each one
    reduced. Inside ``no_sync()``, autograd sums them locally at full size, and the next backward
    outside it reduces the sum. Buffers work as under DDP too. Every rank starts with rank 0's, and
    with ``broadcast_buffers`` (DDP's default) gets them again before each forward.
    """

    def __init__(self, module: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                 stage: int = 2, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None,
                 params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
                 broadcast_buffers: bool = True, **defaults: Any) -> None:
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"ZeroDDP: stage must be 1 or 2, got {stage!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"ZeroDDP: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        optimizer_class([torch.zeros(1)], **defaults)  # Bad options fail here, on all ranks alike.
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
        with torch.no_grad():  # Replicas start identical, as under DDP, with rank 0's values.
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=self.root, group=self.group)
        # DDP's buckets, by 05's rule, so that the layouts agree. They go in reverse registration
        # order, 1 MiB for the first and 25 MiB for the others, or bucket_cap_mb for all.
        # Frozen parameters stay out.
        caps = [1, 25] if bucket_cap_mb is None else [bucket_cap_mb]
        self.buckets, cur, size = [], [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad and p in number]):
            full = size >= caps[min(len(self.buckets), len(caps) - 1)] * 2**20
            if cur and (full or p.dtype != cur[0].dtype or p.device != cur[0].device):
                self.buckets.append(_Bucket(cur, self.world, self.rank, stage))
                cur, size = [], 0
            cur.append(p)
            size += p.numel() * p.element_size()
        if cur:
            self.buckets.append(_Bucket(cur, self.world, self.rank, stage))
        group_of = {p: k for k, g in enumerate(groups) for p in g["params"]}
        pieces = [[] for _ in groups]
        for b in self.buckets:
            for p, piece, off in b.pieces:
                pieces[group_of[p]].append((piece, number[p], off))
        self.pieces = [t for ps in pieces for t in ps]  # (piece, parameter number, offset)
        self.optim = optimizer_class(
            [dict(g, params=[t[0] for t in ps]) for g, ps in zip(groups, pieces)], **defaults)
        self._queued, self._next, self._inflight, self._accumulate = False, 0, [], False
        self.require_backward_grad_sync = True  # DDP's name for it. It is off inside no_sync().
        self.broadcast_buffers = broadcast_buffers  # DDP's names too
        self.require_forward_param_sync = True
        self.gloo = dist.get_backend(self.group) == "gloo"  # see _reduce_scatter
        # Stage 2's transients are full-size buckets of gradients, alive while they fill and travel.
        # Together they may take at most half of what sharding the gradients saves, or one bucket
        # where a bucket is larger. So stage 2 keeps most of its saving on any model.
        saved = sum((b.flat.numel() - b.grad.numel()) * b.flat.element_size() for b in self.buckets)
        self._budget = max([saved // 2] + [b.flat.nbytes for b in self.buckets])
        for b in self.buckets:
            for slot, p in enumerate(b.params):
                if stage == 2:
                    p.register_hook(functools.partial(self._grad_arriving, b, slot))
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # As under DDP, rank 0's buffers (BatchNorm's running statistics) reach every rank before a
        # forward. They do not after a forward that accumulated (no_sync) or ran without gradients.
        if self.broadcast_buffers and self.require_forward_param_sync:
            with torch.no_grad():
                for t in self.module.buffers():
                    dist.broadcast(t, src=self.root, group=self.group)
        out = self.module(*args, **kwargs)
        grads = torch.is_grad_enabled()
        self.require_forward_param_sync = grads and self.require_backward_grad_sync
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's. Backward reduces nothing inside it, and autograd sums the full gradients."""
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True

    def _grad_arriving(self, b, slot, grad):
        """Stage 2's hook, just before autograd adds a gradient. A missing .grad becomes its slot in
        the bucket's transient, so backward writes the full gradients there, with no copy."""
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
        if not self._queued:  # The first gradient of this backward. Finish once backward is done.
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self):
        # Strictly in bucket order on every rank, since collectives match by the order of issue.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            if self.stage == 1:
                self._all_reduce(self.buckets[self._next])
            else:
                self._reduce_scatter(self.buckets[self._next])
            self._next += 1

    def _all_reduce(self, b):
        """Stage 1, as DDP. All-reduce the whole bucket, and every rank receives the whole mean."""
        for p, view in zip(b.params, b.grad[: b.used].split(b.numels)):
            if self._accumulate:  # After a backward before zero_grad(), DDP adds the last mean.
                p.grad = view.view_as(p) if p.grad is None else p.grad.add_(view.view_as(p))
            if p.grad is None:  # No gradient on this rank counts as zero in the mean.
                view.zero_()
            else:  # Divide BEFORE the sum, with DDP's own multiply. No fp16 overflow, DDP's bits.
                torch.mul(p.grad, 1 / self.world, out=view.view_as(p))
            p.grad = None  # The bucket has it now, so autograd's copy is freed.
        b.grad[b.used :].zero_()
        # (Work, bucket, stage 2's transient, stage 2's shard, add it?), kept until _finish waits.
        self._inflight.append((dist.all_reduce(b.grad, group=self.group, async_op=True), b, None,
                               None, False))

    def _reduce_scatter(self, b):
        """Stage 2, the all-reduce's first half only. Each rank receives the mean of its own shard,
        into b.grad. After a backward before zero_grad(), it goes into a shard of its own, added to
        the last mean once it is there. The whole bucket exists only while it fills and travels."""
        full = self._transient_gradients(b)
        out = torch.empty_like(b.grad) if self._accumulate else b.grad
        if self.gloo:  # gloo's reduce_scatter_single all-reduces a copy of the whole buffer and
            # keeps one chunk. The same all-reduce in place gives the same bits, without the copy.
            work = dist.all_reduce(full, group=self.group, async_op=True)
        else:
            work = reduce_scatter(out, full, group=self.group, async_op=True)
        self._inflight.append((work, b, full, out, self._accumulate))

    def _transient_gradients(self, b):
        """Stage 2. The bucket's transient, times 1/N before the sum, as in _all_reduce. Gradients
        summed under no_sync did not come through the hook, so they are copied in."""
        if b.transient is None:  # No gradient came through the hook.
            self._make_room(b)
            b.transient = torch.zeros_like(b.flat)
        full, b.transient = b.transient, None
        for p, view in zip(b.params, full[: b.used].split(b.numels)):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            p.grad = None  # The bucket has it now.
        return full.mul_(1 / self.world)

    def _make_room(self, b):
        """Wait for the oldest transients in flight until b's fits in the budget beside the rest."""
        while self._inflight and sum(t[2].nbytes for t in self._inflight) + b.flat.nbytes \
                > self._budget:
            self._wait(self._inflight.pop(0))

    def _wait(self, inflight):
        work, b, full, out, add = inflight
        work.wait()
        if out is not None and self.gloo:  # Stage 2 on gloo keeps my shard of the all-reduce.
            out.copy_(full[b.lo : b.hi])
        if add:
            b.grad.add_(out)

    def _finish(self):
        """The end of backward. Send the buckets whose gradients never came, then wait for all."""
        self._queued = False
        for b in self.buckets[self._next :]:
            b.pending = 0
        self._launch_ready()
        for inflight in self._inflight:
            self._wait(inflight)
        for b in self.buckets:
            b.pending = len(b.params)
        self._inflight, self._next, self._accumulate = [], 0, True  # The next backward adds.

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step my shard, then all-gather the shards, so every rank holds every new parameter."""
        loss = self.optim.step(closure)
        # The Works are kept until the next step, for a clean exit on gloo (docs/zero.md).
        self._gathers = [all_gather(b.flat, b.flat[b.lo : b.hi], group=self.group, async_op=True)
                         for b in self.buckets]
        for work in self._gathers:
            work.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next backward overwrites the averaged gradients, instead of adding to them."""
        self._accumulate = False
        self.module.zero_grad(set_to_none)

    # Checkpoints hold the plain optimizer's state_dict, put together from the shards, and back.
    def state_dict(self) -> dict[str, Any] | None:
        """The plain optimizer's state_dict on the group's rank 0, with CPU tensors, and None
        elsewhere. Every rank must call it. State shaped like its piece is per element, and is put
        together from the shards. The rest, such as AdamW's step, is the same in every shard."""
        mine = []
        for piece, i, off in self.pieces:
            for k, v in self.optim.state.get(piece, {}).items():
                per_element = torch.is_tensor(v) and v.shape == piece.shape
                v = v.cpu() if torch.is_tensor(v) else v
                mine.append((i, k, off if per_element else None, v))
        everyone = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, everyone, dst=self.root, group=self.group)
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
        groups = [dict(g, params=ns) for g, ns in zip(self.optim.param_groups, self.numbers)]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain optimizer's state_dict on every rank. Each keeps the slices of its shard."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(numbers) for numbers in self.numbers]:
            raise ValueError("ZeroDDP.load_state_dict: its parameter groups differ from this one's")
        # The saved numbers and ours, matched by position within each group, as torch.optim does.
        by_number = {i: state_dict["state"].get(s, {}) for g, numbers in zip(saved, self.numbers)
                     for s, i in zip(g["params"], numbers)}
        state = {}
        for k, (piece, i, off) in enumerate(self.pieces):
            for key, v in by_number[i].items():
                if torch.is_tensor(v) and v.shape == self.params[i].shape:  # per element: my slice
                    v = v.reshape(-1)[off : off + piece.numel()]
                # A copy, or torch's load_state_dict keeps the caller's step tensor and steps it.
                state.setdefault(k, {})[key] = v.clone() if torch.is_tensor(v) else v
        ours = self.optim.state_dict()["param_groups"]  # our optimizer's own numbers for its pieces
        groups = [dict(g, params=mine["params"]) for g, mine in zip(saved, ours)]
        self.optim.load_state_dict({"state": state, "param_groups": groups})


# --- model, data, what a rank holds ---
NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2"}


def build_model(args, device):
    from transformers import GPT2Config, GPT2LMHeadModel, logging
    logging.set_verbosity_error()  # its notes on the config we set on purpose
    torch.manual_seed(args.seed)  # The same seed on every rank, though the wrappers broadcast too.
    cfg = GPT2Config(vocab_size=args.vocab_size, n_positions=args.seq_len, n_embd=args.n_embd,
                     n_layer=args.n_layer, n_head=args.n_embd // 64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).to(device)


def tokens(step, args, device):
    """Random tokens, a batch of its own for each rank and step, the same in every run."""
    g = torch.Generator().manual_seed(args.seed + DATA_SEED_STRIDE * step + RANK)
    shape = (args.batch_size, args.seq_len + 1)
    return torch.randint(0, args.vocab_size, shape, generator=g).to(device)


def loss_of(model, x):
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def held_bytes(*tensor_lists):
    """The bytes a rank really holds behind each list of tensors, padding included."""
    return [sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())
            for ts in tensor_lists]


def memory_status():
    """This process's memory counters from Linux (VmRSS, VmHWM, RssAnon, ...), in bytes."""
    with open("/proc/self/status") as f:
        rows = [line.split() for line in f if line.rstrip().endswith("kB")]
    return {row[0].rstrip(":"): int(row[1]) * 1024 for row in rows}


def peak_memory(fn, device):
    """(fn(), the most memory in use while it ran, beyond what was in use before). On CUDA it counts
    the allocator's tensor bytes. On the CPU (Linux) it counts the resident set less code pages.
    There glibc must free blocks of 64 KiB or more at once, which main() sets."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        return fn(), torch.cuda.max_memory_allocated(device) - before
    if not os.path.exists("/proc/self/clear_refs"):  # Not Linux, so no measure here.
        return fn(), float("nan")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Reset the resident set's high-water mark (VmHWM) to its current size.
    before = memory_status()["RssAnon"]
    out, now = fn(), memory_status()
    return out, now["VmHWM"] - (now["VmRSS"] - now["RssAnon"]) - before  # less the code pages


# --- training: one loop for DDP + AdamW and for ZeroDDP ---
def train(kind, base, args, device):
    """Train a copy of ``base`` with AdamW under PyTorch's DDP (kind 0) or ZeRO stage ``kind``."""
    model = copy.deepcopy(base)
    # Weight decay on matrices only, not on biases and LayerNorm gains, so two parameter groups.
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opts = dict(lr=args.lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY)
    if kind == 0:
        ids = [device.index] if device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                                      bucket_cap_mb=args.bucket_cap_mb)
        optimizer = inner = torch.optim.AdamW(groups, **opts)
        # An all-reduce sends twice the gradients' bytes, times (N-1)/N.
        sent = 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    else:  # One object is both the model to call and the optimizer to step.
        wrapped = optimizer = ZeroDDP(model, torch.optim.AdamW, kind, params=groups,
                                      bucket_cap_mb=args.bucket_cap_mb, **opts)
        inner = optimizer.optim
        # Stage 1 all-reduces (2x) and all-gathers (1x) the buckets. Stage 2 halves the first.
        sent = (3 if kind == 1 else 2) * sum(b.flat.numel() * b.flat.element_size()
                                             for b in optimizer.buckets)
    loss_of(wrapped, tokens(-1, args, device)).backward()  # A warm-up lets DDP settle its buckets.
    optimizer.zero_grad()
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        loss = loss_of(wrapped, tokens(step, args, device))
        loss.backward()
        optimizer.step()
        grads = [p.grad for g in inner.param_groups for p in g["params"] if p.grad is not None]
        state = [v for s in inner.state.values() for v in s.values()]
        held = held_bytes(model.parameters(), grads, state)  # at the step, when all three live
        optimizer.zero_grad()
        losses.append(loss.item())
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    return dict(model=model, optimizer=optimizer, held=held, sent=sent * (WORLD - 1) / WORLD,
                losses=losses, ms=ms)


def check(runs, kinds, device, atol):
    """Weights bit-identical across ranks, and equal to DDP + AdamW's. They are equal bit for bit
    where the gradient sums are (gloo, or 2 ranks; docs/zero.md), else within ``atol``. They must be
    finite, since too large an --lr diverges. One verdict for all ranks."""
    exact = dist.get_backend() == "gloo" or WORLD <= 2
    ref = torch.cat([p.detach().reshape(-1) for p in runs[0]["model"].parameters()])
    for kind in kinds[1:]:
        w = torch.cat([p.detach().reshape(-1) for p in runs[kind]["model"].parameters()])
        rank0 = w.clone()
        dist.broadcast(rank0, src=0)
        same = torch.equal(w, ref) if exact else torch.allclose(w, ref, rtol=0, atol=atol)
        losses = w.new_tensor(runs[0]["losses"] + runs[kind]["losses"])
        lost = not torch.cat([ref, w, losses]).isfinite().all()
        bad = torch.tensor([float(not torch.equal(rank0, w)), float(not same), float(lost)],
                           device=device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad[2]:  # NaN equals nothing, and "the weights differ" would send you hunting a bug.
            raise UsageError(f"{NAMES[kind]} or DDP: the loss or the weights went to inf or nan. "
                             "Try a smaller --lr.")
        if bad.any():
            raise RuntimeError(f"{NAMES[kind]}: weights differ across ranks ({bad[0].item():.0f}) "
                               f"or from DDP's ({bad[1].item():.0f}, by up to "
                               f"{(w - ref).abs().max():.3g})")
    return exact


def main(args):
    device = setup(args)
    if device.type == "cpu" and sys.platform == "linux":
        ctypes.CDLL(None).mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD (see peak_memory)
    if device.type == "cuda":
        # The runs compared below are separate runs. On a GPU, attention's backward and cuBLAS may
        # add in a different order each time. Deterministic mode picks kernels that do not.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS needs it
        torch.use_deterministic_algorithms(True)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} "
           f"torch={torch.__version__}")
    base = build_model(args, device)
    n = sum(p.numel() for p in base.parameters())
    print0(f"GPT-2: {n / 1e6:.2f}M parameters, {4 * n / 2**20:.1f} MiB in fp32, AdamW's state "
           f"{8 * n / 2**20:.1f} MiB | {args.steps} steps of {args.batch_size}x{args.seq_len} "
           "random tokens per rank")
    kinds = [0, args.stage] if args.stage else [0, 1, 2]  # DDP (kind 0) first, as the reference
    loss_of(base, tokens(0, args, device)).backward()  # Lazy set-up (threads, kernels) comes first.
    base.zero_grad(set_to_none=True)
    runs = {}
    for kind in kinds:
        result, peak = peak_memory(functools.partial(train, kind, base, args, device), device)
        runs[kind] = dict(result, peak=peak)
        first, last = result["losses"][0], result["losses"][-1]
        ms = result["ms"]
        print0(f"{NAMES[kind]:<6} | rank 0 loss {first:.4f} -> {last:.4f} | {ms:7.1f} ms/step")
    # Where sums differ in the last bit (NCCL's reduce-scatter on 3+ ranks), AdamW moves an element
    # by a small part of lr a step. Once that was 2.3e-6 in 5 steps at lr 1e-3, measured on gloo
    # with mismatched layouts. So allow 1% of lr a step.
    atol = 0.01 * args.lr * args.steps
    exact = check(runs, kinds, device, atol)
    table = [None] * WORLD
    mine = [(*runs[k]["held"], runs[k]["peak"], runs[k]["sent"]) for k in kinds]
    dist.all_gather_object(table, mine)
    print0("\n| rank | MiB | " + " | ".join(NAMES[k] for k in kinds) + " |\n|---:|---|"
           + "---:|" * len(kinds))
    for rank, cols in enumerate(table):
        for j, what in enumerate(["parameters", "gradients", "optimizer state", "peak memory",
                                  "sent per step"]):
            ratios = [f" ({c[j] / cols[0][j]:.2f}x)" if j == 4 and cols[0][j] else "" for c in cols]
            print0(f"| {rank} | {what} | "
                   + " | ".join(f"{c[j] / 2**20:.2f}{r}" for c, r in zip(cols, ratios)) + " |")
    print0("sent counts the bytes a ring sends per rank (the busbw factor). An all-reduce sends "
           "2(N-1)/N of the buffer, a reduce-scatter or all-gather (N-1)/N. gloo reduce-scatters "
           "by all-reducing a copy, NCCL sends half.")
    how = "bit-identical to" if exact else f"within {atol:.1e} of"
    print0(f"OK {' and '.join(NAMES[k] for k in kinds[1:])} on {WORLD} rank(s): weights {how} "
           "DDP + AdamW's, ranks identical")


# --- command line ---
def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--stage", type=int, choices=[1, 2], default=None,
                   help="one ZeRO stage (default both; DDP always)")
    p.add_argument("--steps", type=at_least(1), default=5, help="optimizer steps per run")
    p.add_argument("--n-layer", type=at_least(1), default=4, help="GPT-2 layers")
    p.add_argument("--n-embd", type=at_least(64), default=256,
                   help="GPT-2 width, a multiple of 64 (a head each)")
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


class UsageError(Exception): ...  # A bad flag or input. run() prints one line, and exits 2.


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


def run(main, parse_args):  # Runs main. setup()'s timeout ends a job whose peer died.
    try:
        main(parse_args())
    except UsageError as e:  # Every rank stops alike, with exit status 2. Rank 0 says why.
        print0(f"error: {e}")
        os._exit(2)  # Exit at once. Tearing down a live group can crash gloo's threads.
    dist.destroy_process_group()  # main() always joins the group first.
    time.sleep(0.05)  # Give gloo's threads a moment to let go of tensors, or exit can crash.


if __name__ == "__main__":
    run(main, parse_args)
