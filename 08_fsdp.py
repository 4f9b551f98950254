"""08 - Fully sharded data parallel (FSDP, ZeRO-3) by hand, bit for bit equal to PyTorch's fully_shard.

What it teaches: after ZeRO-2 (07) every rank still holds all parameters; FSDP shards them too. fully_shard()
keeps chunk r of every parameter (torch.chunk on dim 0) on rank r AS the parameter; around each unit (each GPT-2
block, then the root) one all-gather rebuilds the unit's weights just before they compute and frees them after,
and once its backward is done one reduce-scatter leaves each rank the mean gradient of its chunk: 03's two ring
halves are the whole algorithm. The next unit's all-gather starts before the current one computes. A Hugging
Face GPT-2 (random weights, Python's sources as text: offline) trains with it, then with DDP, ZeRO-2 (07, when
beside this file) and PyTorch's fully_shard: held and sent bytes, peak memory, speed, and ours == fully_shard.

  1 process:  python 08_fsdp.py
  CPU:        torchrun --nproc_per_node=2 08_fsdp.py              (or 3: uneven chunks, padded)
  N GPUs:     torchrun --nproc_per_node=N 08_fsdp.py --param-dtype bf16 --n-layer 12 --n-embd 768 --n-head 12
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 08_fsdp.py
  options:    --grad-accum 4 --clip 1.0 --no-reshard-after-forward --out ckpt (resumes from it, on any number of
              ranks) --profile traces
"""

import argparse
import contextlib
import copy
import ctypes
import fcntl
import gc
import glob
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

WEIGHT_DECAY = 0.1  # AdamW's, the same for all four implementations
DATA_SEED_STRIDE = 1009  # batch seed = seed + stride * micro-batch + rank: a prime, so no two pairs share one
KEEP_CHECKPOINTS = 2  # the newest two: a damaged last one costs --ckpt-every steps, not the run
MMAP_THRESHOLD = 128 * 1024  # glibc: a tensor over this gets its own mmap, so freeing it shrinks the resident set

# --- the idea: fully sharded data parallel by hand ---
# The two halves of 03's ring. torch 2.14 renamed reduce_scatter_tensor and all_gather_into_tensor to *_single.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
def _tensors(x):
    """The tensors in forward inputs or outputs: a tensor, or tuples, lists and dicts of them."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return [x] if isinstance(x, torch.Tensor) else []


def _copy_chunks(rows, tensors, sizes, into_rows):
    """rows[r] = rank r's chunk of each tensor (the r-th `size` elements: torch.chunk's r-th block of rows), each
    zero-padded to its size, one after the other: PyTorch's layout. into_rows packs, else unpacks."""
    off = 0
    for t, size in zip(tensors, sizes):
        for row, piece in zip(rows[:, off:off + size], t.view(-1).split(size)):
            if into_rows:
                row[:len(piece)].copy_(piece)
            else:
                piece.copy_(row[:len(piece)])
        off += size


def _units(module):
    return [m.fsdp_unit for m in module.modules() if hasattr(m, "fsdp_unit")]


class Unit:
    """What one fully_shard() call makes: its parameters sharded, gathered and reduced as one flat buffer each."""

    def __init__(self, module, params, group, param_dtype, reduce_dtype, reshard_after_forward):
        self.module, self.group, self.world, self.rank = module, group, group.size(), group.rank()
        self.gloo = dist.get_backend(group) == "gloo"  # see unshard and post_backward
        self.dtype, self.device = (params[0].dtype, params[0].device) if params else (None, None)  # None: a root
        self.root, self.name = None, type(module).__name__  # with no parameters of its own still runs the step
        self.param_dtype = param_dtype or self.dtype  # of the gathered parameters: all-gather and compute
        self.reduce_dtype = reduce_dtype or self.param_dtype  # of the gradients while reduce-scattered
        self.reshard_after_forward = reshard_after_forward  # None: all but the root (known at its 1st forward)
        self.sync, self.state, self.gather, self.acc = True, "sharded", None, [None] * len(params)
        # torch.chunk(p, N) gives each rank ceil(rows / N) rows, the last ranks fewer or none. Padded to that
        # size, every rank's part of the flat buffers the collectives need is equally long.
        self.sizes = [-(-len(p) // self.world) * p[0].numel() for p in params]
        self.flat = torch.zeros(sum(self.sizes), dtype=self.dtype, device=self.device)  # this rank's chunks
        mine = [p.detach().reshape(-1)[self.rank * s:][:s] for p, s in zip(params, self.sizes)]
        _copy_chunks(self.flat.view(1, -1), mine, self.sizes, into_rows=True)
        # Each chunk IS the parameter from now on, a plain tensor: an optimizer built after fully_shard updates
        # this rank's chunks only, exactly as it would the full tensors since AdamW is elementwise (ZeRO-1).
        self.shards = [nn.Parameter(c[:len(m)].view(-1, *p.shape[1:]), p.requires_grad)
                       for c, m, p in zip(self.flat.split(self.sizes), mine, params)]
        self.full = [nn.Parameter(torch.empty_like(p, dtype=self.param_dtype), p.requires_grad) for p in params]
        self.owners = [[(m, k) for m in module.modules() for k, q in m.named_parameters(
            recurse=False, remove_duplicate=False) if q is p] for p in params]  # a tied parameter: all its places
        self.reshard()

    def reshard(self):
        """Free the full parameters: their storage, so that what autograd saved of them costs nothing either."""
        for f, owners, s in zip(self.full, self.owners, self.shards):
            f.untyped_storage().resize_(0)
            for m, k in owners:
                setattr(m, k, s)
        self.state = "sharded"

    def unshard(self, wait=True):
        """Launch the all-gather of this unit's parameters (async) unless under way; with wait, install them."""
        if self.state == "sharded" and self.gather is None and self.full:
            self.gather = self.start_gather()
        if wait and self.gather is not None:
            buf, works = self.gather
            for work in works:
                work.wait()
            for f, owners in zip(self.full, self.owners):
                f.untyped_storage().resize_(f.numel() * f.element_size())
                for m, k in owners:
                    setattr(m, k, f)
            # Through .data: forward saved these tensors for backward, and refilling them must not bump the
            # version counter autograd checks there (PyTorch's FSDP uses a private guard for the same).
            _copy_chunks(buf.view(self.world, -1), [f.data for f in self.full], self.sizes, into_rows=False)
            self.state, self.gather = "full", None

    def start_gather(self):
        """The all-gather, launched: (its output to be, the handles to wait on)."""
        buf = torch.empty(self.world * len(self.flat), dtype=self.param_dtype, device=self.device)
        if self.gloo:  # gloo's all-gather works through a temporary copy of its output, alive while the next unit
            # computes: N broadcasts, one from each rank into its row, send the same bytes in place.
            rows = buf.view(self.world, -1)
            rows[self.rank].copy_(self.flat)
            return buf, [dist.broadcast(row, src=dist.get_global_rank(self.group, r), group=self.group,
                                        async_op=True) for r, row in enumerate(rows)]
        return buf, [all_gather(buf, self.flat.to(self.param_dtype), group=self.group, async_op=True)]

    # The hooks, in the order they run in a training step.
    def pre_forward(self, module, args, kwargs):
        if self.root is None:  # the first unit to run forward is the root (PyTorch's rule)
            self.init_root()
        self.unshard()
        if self.next is not None:  # its all-gather runs while this unit computes
            self.next.unshard(wait=False)
        if self.param_dtype != self.dtype:  # MixedPrecisionPolicy's cast_forward_inputs (one level deep here)
            args = tuple(self.cast(a) for a in args)
            kwargs = {k: self.cast(v) for k, v in kwargs.items()}
        inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if torch.is_grad_enabled() and inputs:  # runs when autograd is through the whole unit
            torch.autograd.graph.register_multi_grad_hook(inputs, self.post_backward)
        return args, kwargs

    def cast(self, x):
        return x.to(self.param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def post_forward(self, module, args, output):
        if self.reshard_after_forward or not torch.is_grad_enabled():  # no backward to come: free even the root
            self.reshard()
        for t in _tensors(output):  # a node hook runs after tensor hooks: the next unit's post_backward first
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(self.pre_backward)
        return output

    def pre_backward(self, grad):
        if self.state == "backward":  # started by another of its outputs
            return
        if not self.root.queued:  # at the end of this backward, the root waits for every reduce-scatter
            self.root.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.root.finish_backward)
        self.unshard()
        self.prev.unshard(wait=False)  # backward runs through the units in reverse
        self.state = "backward"

    def post_backward(self, *unused):
        # Once per forward call (its graph's backward) and again from finish_backward: no "done" state, so that a
        # second graph through this unit (two forwards, one backward) gathers the weights again and reduces.
        self.reshard()
        for i, f in enumerate(self.full):  # with sync off, PyTorch sums full gradients in reduce_dtype
            if f.grad is not None and (self.acc[i] is not None or not self.sync and f.grad.dtype != self.reduce_dtype):
                self.acc[i] = f.grad.to(self.reduce_dtype) if self.acc[i] is None else self.acc[i] + f.grad
                f.grad = None
        if not self.sync:  # gradient accumulation: nothing is sent
            return
        grads = [(i, f.grad if a is None else a) for i, (f, a) in enumerate(zip(self.full, self.acc))]
        grads = [(i, g) for i, g in grads if g is not None]
        for f in self.full:
            f.grad = None
        self.acc = [None] * len(self.full)
        while self.root.pending:  # the previous unit's reduce-scatter, done by now: one buffer in flight at most
            self.root.finish_reduce()
        if grads:
            idx, sizes = [i for i, _ in grads], [self.sizes[i] for i, _ in grads]
            rows = torch.zeros(self.world, sum(sizes), dtype=self.reduce_dtype, device=self.device)
            _copy_chunks(rows, [g for _, g in grads], sizes, into_rows=True)
            grads = None  # the full gradients are freed: their packed copy is all that is left
            out, work = self.start_reduce(rows)
            self.root.pending.append((self, work, rows, out, idx))

    def start_reduce(self, rows):
        """The reduce-scatter of the packed gradients, launched: (this rank's mean to be, or None, the handle)."""
        # The mean, as fully_shard asks for it (AVG). NCCL reduce-scatters and divides in one go. gloo has no
        # reduce-scatter: its reduce_scatter_single all-reduces a copy of the whole buffer, keeps this rank's row
        # and divides it. The same all-reduce in place gives the same bits without the copy.
        if self.world == 1:  # nothing to reduce (as fully_shard: NCCL before 2.29.7 botches a one-rank AVG)
            return rows[0], None
        if self.gloo:
            return None, dist.all_reduce(rows, group=self.group, async_op=True)
        out = torch.empty(rows.shape[1], dtype=self.reduce_dtype, device=self.device)
        return out, reduce_scatter(out, rows.view(-1), op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    def set_requires_gradient_sync(self, requires_gradient_sync):
        """Off: backward sends nothing and each rank keeps summing full gradients (gradient accumulation)."""
        for unit in _units(self.module):
            unit.sync = requires_gradient_sync

    # The root's share: what one training step needs across its units.
    def init_root(self):
        units = _units(self.module)  # prefetched in this order (GPT-2 runs its blocks in it), backward reversed
        names = [name or "root" for name, m in self.module.named_modules() if hasattr(m, "fsdp_unit")]
        for i, (name, u) in enumerate(zip(names, units)):
            u.root, u.name, u.prev = self, name, units[i - 1]
            u.next = units[i + 1] if i + 1 < len(units) else None
            if u.reshard_after_forward is None:
                u.reshard_after_forward = u is not self
        self.pending, self.queued = [], False

    def finish_reduce(self):
        unit, work, rows, out, idx = self.pending.pop(0)
        if work is not None:
            work.wait()
        if out is None:  # gloo
            out = rows[unit.rank] / unit.world
        out, off = out.to(unit.dtype), 0  # the mean of this rank's chunks, in the shards' dtype
        for i in idx:  # each shard's .grad is a view of out; accumulated into when there is one already
            s, g = unit.shards[i], out[off:off + unit.shards[i].numel()].view_as(unit.shards[i])
            s.grad = g if s.grad is None else s.grad.add_(g)
            off += unit.sizes[i]

    def finish_backward(self):
        for u in _units(self.module):  # units whose inputs needed no gradient (the root: token ids) reduce now
            u.post_backward()
        while self.pending:
            self.finish_reduce()
        for u in _units(self.module):
            if u.gather is not None:  # a prefetch nobody used holds the weights from before the step: drop it
                for work in u.gather[1]:
                    work.wait()
            u.gather, u.state = None, "sharded"
        self.queued = False


def _unsharded_params(module, top=True):
    """PyTorch's order: a module's children before itself, skipping submodules that are units already."""
    if top or not hasattr(module, "fsdp_unit"):
        for child in module.children():
            yield from _unsharded_params(child, False)
        yield from module.parameters(recurse=False)


def fully_shard(module, *, process_group=None, param_dtype=None, reduce_dtype=None, reshard_after_forward=None,
                unit_class=Unit):
    """torch.distributed.fsdp.fully_shard by hand: one unit of module's parameters not in a unit yet. Call it on
    each block, then on the root; param_dtype and reduce_dtype mean what MixedPrecisionPolicy's fields mean.
    unit_class: 08's training passes TracedUnit, a Unit that also records what the script prints."""
    if hasattr(module, "fsdp_unit"):
        raise ValueError(f"{type(module).__name__} is sharded already: call fully_shard once per module")
    params = list(dict.fromkeys(_unsharded_params(module)))  # a tied parameter once
    for p in params:
        if hasattr(p, "sharded_by"):
            raise ValueError(f"a parameter of {type(module).__name__} is shared with {p.sharded_by}, sharded "
                             "before: shard the modules that share it as one unit")
        if p.dim() == 0 or p.dtype != params[0].dtype:
            raise ValueError("fully_shard needs parameters of one dtype, each with a dim 0 to shard")
        p.sharded_by = type(module).__name__
    unit = unit_class(module, params, process_group or dist.group.WORLD, param_dtype, reduce_dtype,
                      reshard_after_forward)
    module.fsdp_unit = unit
    module.register_forward_pre_hook(unit.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(unit.post_forward)
    module.set_requires_gradient_sync = unit.set_requires_gradient_sync  # called as on PyTorch's
    return module


def _gather_full(unit, chunks, which):
    """Full tensors on every rank from every rank's chunks: chunks[j] is this rank's chunk (shaped like its shard)
    of the unit's parameter which[j], or of a tensor shaped like it. One all-gather of their padded concatenation,
    unpacked as unshard unpacks the weights."""
    sizes = [unit.sizes[i] for i in which]
    mine = torch.zeros(sum(sizes), dtype=chunks[0].dtype, device=unit.device)
    _copy_chunks(mine.view(1, -1), chunks, sizes, into_rows=True)
    buf = torch.empty(unit.world * len(mine), dtype=mine.dtype, device=unit.device)
    all_gather(buf, mine, group=unit.group)
    fulls = [torch.empty(unit.full[i].shape, dtype=mine.dtype, device=unit.device) for i in which]
    _copy_chunks(buf.view(unit.world, -1), fulls, sizes, into_rows=False)
    return fulls


def full_state_dict(module):
    """{name: full tensor} on every rank, with the plain module's state_dict() names: a plain checkpoint."""
    fulls = {}
    for unit in _units(module):
        unit.reshard()
        if unit.full:
            everything = range(len(unit.shards))
            fulls.update(zip(unit.shards, _gather_full(unit, [s.detach() for s in unit.shards], everything)))
    return {k: fulls[v] if v in fulls else v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}


def load_full_state_dict(module, state):
    """The reverse: every rank copies in its own chunk of each sharded parameter, whatever number of ranks wrote
    the full tensors: chunk r of N is the same slice of a full tensor for any N."""
    starts, mine = {}, dict(state)
    for unit in _units(module):
        unit.reshard()
        starts.update((s, unit.rank * size) for s, size in zip(unit.shards, unit.sizes))
    for k, t in module.state_dict(keep_vars=True).items():
        if t in starts and k in state:
            mine[k] = state[k].reshape(-1)[starts[t]:starts[t] + t.numel()].view_as(t)
    module.load_state_dict(mine)


def full_optim_state_dict(module, optimizer):
    """The optimizer's state as an unsharded run holds it, on every rank, in the layout of PyTorch's distributed
    checkpoint (get_optimizer_state_dict with full_state_dict=True): keyed by parameter name (a tied parameter
    by its first), full tensors. State shaped like its shard (AdamW's two moments) is per element and gathered
    like the weights; the rest (AdamW's step) is one value per parameter, the same on every rank."""
    names = {p: n for n, p in module.named_parameters()}  # a tied parameter once, by its first name
    state = {}
    for unit in _units(module):
        unit.reshard()
        held = [i for i, s in enumerate(unit.shards) if optimizer.state.get(s)]  # the same on every rank
        for key in dict.fromkeys(k for i in held for k in optimizer.state[unit.shards[i]]):
            values = [optimizer.state[unit.shards[i]][key] for i in held]
            if all(torch.is_tensor(v) and v.shape == unit.shards[i].shape for i, v in zip(held, values)):
                values = _gather_full(unit, values, held)
            else:  # a copy, not the optimizer's own tensor, which its next step changes
                values = [v.clone() if torch.is_tensor(v) else v for v in values]
            for i, v in zip(held, values):
                state.setdefault(unit.shards[i], {})[key] = v
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": {names[p]: state[p] for g in optimizer.param_groups for p in g["params"] if p in state},
            "param_groups": groups}


def load_full_optim_state_dict(module, optimizer, state):
    """The reverse: every rank keeps its own chunk of each per-element state, whatever number of ranks wrote it."""
    names = {p: n for n, p in module.named_parameters()}
    starts, shapes = {}, {}
    for unit in _units(module):
        unit.reshard()
        starts.update((s, unit.rank * size) for s, size in zip(unit.shards, unit.sizes))
        shapes.update((s, f.shape) for s, f in zip(unit.shards, unit.full))
    mine = {}
    for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for k, v in state["state"].get(names[p], {}).items():
            if torch.is_tensor(v) and v.shape == shapes[p]:  # per element: this rank's chunk of it
                v = v.reshape(-1)[starts[p]:starts[p] + p.numel()].view_as(p)
            # A copy: torch.optim keeps the tensors it is given as its state and updates them in place.
            mine.setdefault(i, {})[k] = v.clone() if torch.is_tensor(v) else v
    numbers = optimizer.state_dict()["param_groups"]  # torch.optim's own numbering of its parameters
    optimizer.load_state_dict({"state": mine, "param_groups": [
        dict(saved, params=ours["params"]) for saved, ours in zip(state["param_groups"], numbers)]})


def clip_grad_norm_(parameters, max_norm, group=None):
    """clip_grad_norm_ over shards: every parameter's squared norm summed over ranks (one all-reduce for all),
    then the norm of their roots, as PyTorch computes it over fully_shard's sharded gradients. Each shard's norm
    comes from the fused _foreach_norm, as in PyTorch's (DTensors take its foreach path): on a GPU its kernel adds
    in another order than one vector_norm per tensor would, and the result must be PyTorch's to the bit."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = torch.stack(torch._foreach_norm(grads)) ** 2
    dist.all_reduce(squares, group=group)
    total = torch.linalg.vector_norm(squares ** 0.5)
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


# --- GPT-2 trained four ways: DDP, ZeRO-2 (07), ours, PyTorch's fully_shard ---
class TracedUnit(Unit):
    """Our Unit, also recording what the script prints of a step: forwards, backwards and launches in the order
    they happen (events), and the bytes a ring sends for them (sent). Every override calls Unit's own."""

    sent = 0  # on the root: every step's bytes so far

    def pre_forward(self, module, args, kwargs):
        if self.root is None or self.root is self:  # the root, starting a forward: a new step's record
            self.events = []
        args, kwargs = super().pre_forward(module, args, kwargs)
        self.root.events.append(f"forward {self.name}")
        return args, kwargs

    def pre_backward(self, grad):
        starts = self.state != "backward"  # not when another of its outputs started it
        super().pre_backward(grad)
        if starts:
            self.root.events.append(f"backward {self.name}")

    def start_gather(self):
        buf, works = super().start_gather()
        self.record("all-gather", buf)
        return buf, works

    def start_reduce(self, rows):
        out, work = super().start_reduce(rows)
        self.record("reduce-scatter", rows)
        return out, work

    def record(self, what, buf):
        # A ring all-gather or reduce-scatter of buf sends (N - 1) / N of it from every rank (see 03).
        self.root.sent += buf.numel() * buf.element_size() * (self.world - 1) // self.world
        self.root.events.append(f"{what} {self.name}")


def gpt2(args, device):
    import transformers
    transformers.logging.set_verbosity_error()  # its notes on the config we set on purpose
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)  # the same seed on every rank: identical weights before they are sharded
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.n_embd, n_head=args.n_head,
                                  n_layer=args.n_layer, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(cfg).to(device)


def build(impl, args, device, zero):
    """A fresh GPT-2, the module to call for impl, and its optimizer (the same AdamW for all four)."""
    model, adamw = gpt2(args, device), dict(lr=args.lr, weight_decay=WEIGHT_DECAY)
    if impl == "ZeRO-2":
        net = zero.ZeroDDP(model, torch.optim.AdamW, stage=2, **adamw)
        return model, net, net
    if impl == "DDP":
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        return model, net, torch.optim.AdamW(model.parameters(), **adamw)
    dtype = {"fp32": None, "bf16": torch.bfloat16}[args.param_dtype]
    reshard = False if args.no_reshard_after_forward else None  # None: True, but False for the root
    # A mesh on OUR device: without one, fully_shard builds it on the machine's accelerator (CUDA whenever a GPU
    # exists, even under --device cpu) and moves the module there.
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    for m in [*model.transformer.h, model]:  # each block a unit, then the root
        if impl == "ours":
            fully_shard(m, param_dtype=dtype, reshard_after_forward=reshard, unit_class=TracedUnit)
        else:
            torch_fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype),
                              reshard_after_forward=reshard)
    return model, model, torch.optim.AdamW(model.parameters(), **adamw)


def batch(text, step, micro, args, device):
    """Windows of Python's sources (bytes as tokens) drawn from (seed, step, micro, rank) alone: every rank sees
    other data, and a resumed run the same data as an uninterrupted one."""
    g = torch.Generator().manual_seed(args.seed + DATA_SEED_STRIDE * (step * args.grad_accum + micro) + RANK)
    starts = torch.randint(len(text) - args.seq_len, (args.batch_size,), generator=g).tolist()
    return torch.stack([text[s:s + args.seq_len] for s in starts]).to(device)


def held_mib(params, optimizer):
    """MiB of parameters, gradients and optimizer state this rank holds, from its tensors (each storage once)."""
    def mib(tensors):
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values()) / 2**20
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    stepped = [p for group in optimizer.param_groups for p in group["params"]]  # ZeRO-2: its shards' pieces
    return mib(params), mib(p.grad for p in stepped), mib(state)


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: the resident set's high-water mark starts again from here


def peak_mib(device):
    """Peak memory since reset_peak(): CUDA's allocator statistics, or on CPU the peak resident set (Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if not os.path.exists("/proc/self/status"):
        return float("nan")
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def check_memory(nbytes, what, device):
    """One line before the work if `what` cannot fit: `nbytes`, a lower bound of what it needs, against this rank's
    share of its device's free memory (a node's RAM and a shared GPU are split between their ranks)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device.type == "cuda":
        free, sharing = torch.cuda.mem_get_info(device)[0], -(-local_world // torch.cuda.device_count())
    else:
        free, sharing = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), local_world
        if os.path.exists("/proc/meminfo"):  # Linux says what is available: free, and cache it can drop
            with open("/proc/meminfo") as f:
                free = next((int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:")), free)
    share = torch.tensor([free / sharing], dtype=torch.float64, device=device)
    dist.all_reduce(share, op=dist.ReduceOp.MIN)  # the smallest share decides, so every rank decides alike
    if nbytes > share.item():
        raise UsageError(f"{what} would need at least {nbytes / 2**30:,.1f} GiB, more than this rank's share of "
                         f"{device.type} memory ({share.item() / 2**30:,.1f} GiB)")


# --- training ---
def train(impl, args, device, text, zero, ckpt=None):
    """A GPT-2 trained by impl to --max-steps, fresh or from ckpt: its full weights and what it took."""
    gc.collect()  # the models trained before are gone before this one's peak is measured
    reset_peak(device)
    model, net, opt = build(impl, args, device, zero)
    fsdp, start, norms, seconds = impl in ("ours", "fully_shard"), 0, [], []
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if ckpt:
        resume(impl, model, opt, ckpt)
        start = ckpt["step"]
    with contextlib.ExitStack() as stack:
        prof = stack.enter_context(torch.profiler.profile()) if args.profile and impl == "ours" else None
        for step in range(start, args.max_steps):
            t0 = time.perf_counter()
            for micro in range(args.grad_accum):
                last = micro == args.grad_accum - 1
                if fsdp:  # gradient accumulation: the last micro-batch reduces the sum of all
                    net.set_requires_gradient_sync(last)
                with contextlib.nullcontext() if fsdp or last else net.no_sync():
                    x = batch(text, step, micro, args, device)
                    loss = net(input_ids=x, labels=x, use_cache=False).loss
                    (loss / args.grad_accum).backward()
            if args.clip > 0:
                norm = (clip_grad_norm_ if impl == "ours" else nn.utils.clip_grad_norm_)(model.parameters(), args.clip)
                norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            opt.step()
            held = held_mib(list(model.parameters()), getattr(opt, "optim", opt))  # ZeroDDP's optimizer: .optim
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the GPU runs behind the host: wait for it before reading the clock
            seconds.append(time.perf_counter() - t0)
            if impl == "ours" and ((step + 1) % args.log_every == 0 or step + 1 == args.max_steps):
                print0(f"step {step + 1:4d}/{args.max_steps} | loss {loss.item():.4f} (rank 0's last micro-batch)")
            # The last step too: the end of training is a checkpoint, so a run stopped before it saved the model
            # (or the same command again) has nothing to train twice.
            if impl == "ours" and args.out and ((step + 1) % args.ckpt_every == 0 or step + 1 == args.max_steps):
                # Full tensors, as an unsharded run holds them: every rank gathers, global rank 0 writes. Any number
                # of ranks resumes from them, each taking its own chunks.
                state = {"model": full_state_dict(model), "optimizer": full_optim_state_dict(model, opt),
                         "step": step + 1, "world_size": WORLD}
                state = on_cpu(state) if RANK == 0 else None
                on_rank_0(save_checkpoint, args.out, step + 1, state, KEEP_CHECKPOINTS)
            if impl == "ours" and step + 1 == args.crash_at_step and first_attempt:
                dist.barrier()  # after rank 0 has written this step's checkpoint, if there is one
                if RANK == WORLD - 1:
                    log(f"--crash-at-step {step + 1}: SIGKILL to myself (first attempt only)")
                    os.kill(os.getpid(), signal.SIGKILL)
    if prof:
        prof.export_chrome_trace(os.path.join(args.profile, f"trace_rank{RANK}.json"))
    full = full_state_dict(model) if impl == "ours" else model.state_dict()
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in full.items()}
    sent = model.fsdp_unit.sent / len(seconds) if impl == "ours" else 0  # per step
    ms = statistics.median(seconds[1:] or seconds) * 1e3  # the first step warms up
    return full, dict(held=held, peak=peak_mib(device), ms=ms, norms=norms, sent=sent,
                      events=model.fsdp_unit.events if impl == "ours" else [])


def resume(impl, model, opt, ckpt):
    """impl starts where the checkpoint's run stopped, resharded onto this run's ranks (any number of them)."""
    if impl == "ours":
        load_full_state_dict(model, ckpt["model"])
        load_full_optim_state_dict(model, opt, ckpt["optimizer"])
    elif impl == "ZeRO-2":  # 07 loads a plain optimizer's state_dict (numbered, not named) and keeps its shard
        number = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict({"state": {number[k]: v for k, v in ckpt["optimizer"]["state"].items()},
                             "param_groups": [dict(g, params=[number[k] for k in g["params"]])
                                              for g in ckpt["optimizer"]["param_groups"]]})
    else:  # PyTorch's distributed checkpoint (DCP) reshards full tensors onto fully_shard's DTensors, and loads
        # DDP's replicas. It writes its DTensors into the model's dict it is given, and keeps the optimizer's tensors
        # as the state it then steps: so copies, the checkpoint stays as read for the next implementation.
        set_state_dict(model, opt, model_state_dict=dict(ckpt["model"]), optim_state_dict=copy.deepcopy(
            ckpt["optimizer"]), options=StateDictOptions(full_state_dict=True))


def on_cpu(state):
    """The state with every tensor copied to the CPU: a checkpoint that loads where its GPUs are not."""
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [on_cpu(v) for v in state]
    return state.cpu() if torch.is_tensor(state) else state


def main(args):
    device = setup(args, min_world=1)
    if device.type == "cpu" and sys.platform == "linux":  # the resident set then measures what is held (see above)
        ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD)  # -3: M_MMAP_THRESHOLD
    if device.type == "cuda":
        # The runs compared below are separate runs: on a GPU, attention's backward (memory-efficient and flash
        # SDPA) and cuBLAS may add in a different order each time. Deterministic mode picks kernels that do not.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS needs
        torch.use_deterministic_algorithms(True)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device} param_dtype={args.param_dtype} "
           f"torch={torch.__version__}")
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    text = torch.frombuffer(bytearray(b"".join(Path(f).read_bytes() for f in files)), dtype=torch.uint8).long()
    if args.seq_len >= len(text):
        raise UsageError(f"--seq-len {args.seq_len} is longer than the text ({len(text):,} bytes)")
    # A lower bound of what a rank holds at once: the embeddings (weights, gradients, AdamW's moments: 16 bytes an
    # element) and one micro-batch's logits in float32.
    check_memory(16 * (256 + args.seq_len) * args.n_embd + 4 * args.batch_size * args.seq_len * 256,
                 f"--batch-size {args.batch_size} x --seq-len {args.seq_len}", device)
    owner = {"script": os.path.basename(__file__), "n_layer": args.n_layer, "n_embd": args.n_embd,
             "n_head": args.n_head, "seq_len": args.seq_len}
    lock = claim(args.out, owner) if args.out else None  # held until this run ends
    path, ckpt = resume_state(args.out)
    if ckpt and "world_size" not in ckpt:  # before, each rank's optimizer shard was saved apart
        raise UsageError(f"{path} was written by an older 08_fsdp.py: resume it with that one, or pick a new --out")
    if ckpt:
        writers = ckpt["world_size"]
        print0(f"resumed from {path} at step {ckpt['step']}" + ("" if writers == WORLD else
               f", written by {writers} ranks: every implementation reshards it onto {WORLD}"))
    if ckpt and ckpt["step"] >= args.max_steps:  # the same command again, or a restart after the last step
        nothing_left(args, device, path, ckpt)
        return
    zero, here = None, os.path.join(os.path.dirname(os.path.abspath(__file__)), "07_zero.py")
    if os.path.exists(here):  # the lesson imports its predecessor only to compare with it
        spec = importlib.util.spec_from_file_location("zero", here)
        zero = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(zero)
    impl = "ours"
    try:
        runs = {"ours": train("ours", args, device, text, zero, ckpt)}
        for impl in ["fully_shard", "DDP", "ZeRO-2"]:  # the same steps from the same start
            if impl != "ZeRO-2" or zero:
                runs[impl] = train(impl, args, device, text, zero, ckpt)
    except Interrupted as stop:  # Ctrl-C or SIGTERM: run() prints where, once, and what is on disk
        stop.where = f"during the {impl} run; {newest_checkpoint(args.out)}"
        raise
    missing = "" if zero else "07_zero.py not beside this file"
    (ours, o), (theirs, t), (ddp, d) = runs["ours"], runs["fully_shard"], runs["DDP"]
    forward = max(i for i, e in enumerate(o["events"]) if e.startswith("forward")) + 1
    print0("launches against compute in the last step (rank 0):\n  forward:  " + " > ".join(o["events"][:forward])
           + "\n  backward: " + " > ".join(o["events"][forward:]))
    # Sent per step: ours counted (fully_shard issues the same collectives on the same buffers: see the tests).
    # DDP: one ring all-reduce of the gradients; ZeRO-2 a reduce-scatter and an all-gather: both 2(N-1)/N of them.
    params = {v.data_ptr(): v.nbytes for v in ddp.values()}  # the tied embedding once, as DDP reduces it
    o_sent, d_sent = o["sent"], 2 * (WORLD - 1) / WORLD * sum(params.values())
    rows = []
    for impl in ["DDP", "ZeRO-2", "ours", "fully_shard"]:
        if impl not in runs:
            rows.append(f"| {RANK} | {impl} | n/a ({missing}) |||||||")
            continue
        (p, g, opt), s = runs[impl][1]["held"], runs[impl][1]
        sent = o_sent if impl in ("ours", "fully_shard") else d_sent
        rows.append(f"| {RANK} | {impl} | {p:.3f} | {g:.3f} | {opt:.3f} | {s['peak']:,.0f} | {sent / 2**20:.3f} | "
                    f"{sent / max(d_sent, 1):.2f} | {s['ms']:.1f} |")
    table = [None] * WORLD
    dist.all_gather_object(table, rows)
    print0("| rank | | params MiB | grads MiB | optimizer MiB | peak MiB | sent MiB/step | x DDP | ms/step |\n"
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(r for rank_rows in table for r in rank_rows))
    if args.clip > 0:
        print0(f"clip, last step: global norm over shards {o['norms'][-1]:.7f} | fully_shard's {t['norms'][-1]:.7f} "
               f"| clip_grad_norm_ over DDP's full gradients {d['norms'][-1]:.7f}")
    # The checks: ours == fully_shard bit for bit, == DDP within float tolerance (fp32). Every rank holds the same
    # weights by construction: each element lives on one rank only, and every rank gathers it from there.
    if not all(v.isfinite().all() for v in ours.values()):  # the same weights on every rank: all stop here
        raise UsageError("training diverged: the weights are not finite (try a smaller --lr)")
    differ = [k for k in ours if not torch.equal(ours[k].view(torch.uint8), theirs[k].view(torch.uint8))]
    gap = max((ours[k].float() - ddp[k].float()).abs().max().item() for k in ours)
    if args.out:  # global rank 0 writes (one writer); every rank learns whether it could
        on_rank_0(save_model, args, ours)
        print0(f"saved the trained model to {args.out} (transformers' from_pretrained loads it)")
    if differ:
        raise RuntimeError(f"ours != fully_shard in {differ[:3]}")
    if args.param_dtype == "fp32" and gap > 1e-4:
        raise RuntimeError(f"ours is {gap:.1e} away from DDP")
    if sum(o["held"]) > sum(d["held"]) / WORLD * 1.05 + 0.01:
        raise RuntimeError(f"ours holds {sum(o['held']):.2f} MiB, not 1/{WORLD} of DDP's {sum(d['held']):.2f}")
    start = ckpt["step"] if ckpt else 0
    since = f" from {path}" if ckpt else ""
    print0(f"OK ours == fully_shard bit for bit after {args.max_steps - start} AdamW steps{since} "
           f"({args.param_dtype}, world size {WORLD}), DDP within {gap:.1e}; each rank holds 1/{WORLD} of DDP's bytes")
    if lock:
        lock.close()


def save_model(args, full):
    """Global rank 0: the weights as a plain GPT-2, which from_pretrained loads, with or without FSDP; written aside
    and then moved in, so that a full disk or Ctrl-C never leaves half a model (the final checkpoint holds it)."""
    plain = gpt2(args, "cpu")
    plain.load_state_dict({k: v.cpu() for k, v in full.items()})
    with written_aside(args.out, "model", tensor_bytes(full)) as tmp:
        plain.save_pretrained(tmp)
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(args.out, name))
    os.rmdir(tmp)


def nothing_left(args, device, path, ckpt):
    """A finished run asked again, or restarted after its last checkpoint: there is no step to train, and saving
    the model is all that may be left. The checkpoint goes through ours on this run's ranks first, resharded and
    gathered back: it must come back bit for bit, whatever number of ranks wrote it."""
    model, _, opt = build("ours", args, device, None)
    resume("ours", model, opt, ckpt)
    back = {"model": full_state_dict(model), "optimizer": full_optim_state_dict(model, opt)}
    if not same_bits(back, {"model": ckpt["model"], "optimizer": ckpt["optimizer"]}):
        raise RuntimeError(f"{path} does not come back bit for bit from {WORLD} ranks")
    on_rank_0(save_model, args, back["model"])
    print0(f"OK nothing left to train: {path} is step {ckpt['step']} of --max-steps {args.max_steps}; written by "
           f"{ckpt['world_size']} ranks, sharded onto {WORLD} and gathered back bit for bit; the model saved to "
           f"{args.out} (a larger --max-steps trains on)")


def same_bits(a, b):
    """Equal, tensors bit for bit, through the dicts and lists of a state dict."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_bits, a, b))
    if torch.is_tensor(a):
        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)))
    return a == b


# --- checkpoints: the same block in 05, 06 and 08, one contract for every --out ---
def claim(out, owner):
    """Global rank 0 takes --out for this run, or every rank stops with one line. Two runs into one --out would
    overwrite each other: an flock keeps the second out (the kernel drops it when its process dies, even by
    SIGKILL, so a crash leaves no stale lock). And a run never writes over what another script or another model
    left: owner.json says who writes here. Returns the open lock file: keep it for the whole run."""
    lock, error = None, [None]
    if RANK == 0:
        path = os.path.join(out, ".lock")
        try:
            os.makedirs(out, exist_ok=True)
            existed, lock = os.path.exists(path), open(path, "a")
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            error[0] = not_ours(out, owner)
            if error[0] and not existed:  # leave a directory that is not ours as we found it
                os.remove(path)
        except BlockingIOError:
            error[0] = f"--out {out} is in use by another run (it holds {out}/.lock): wait for it or pick another"
        except UsageError as e:  # owner.json did not fit on the disk
            error[0] = str(e)
        except OSError as e:  # a read-only or full disk: one line for every rank, not a traceback on rank 0
            error[0] = f"cannot write to --out {out}: {e.strerror}"
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise UsageError(error[0])
    return lock


def not_ours(out, owner):
    """Why this run must not write into `out` (the files of another script, or of another model), or None."""
    path = os.path.join(out, "owner.json")
    if not os.path.exists(path):
        theirs = sorted(set(os.listdir(out)) - {".lock"})
        if theirs:
            return (f"--out {out} holds files that no run of {owner['script']} wrote ({', '.join(theirs[:3])}"
                    f"{', ...' if len(theirs) > 3 else ''}): pick a new or empty directory")
        text = json.dumps(owner, indent=1)
        with written_aside(out, "owner.json", len(text)) as tmp:
            with open(os.path.join(tmp, "owner.json"), "w") as f:
                f.write(text)
        os.replace(os.path.join(tmp, "owner.json"), path)
        os.rmdir(tmp)
        return None
    try:
        with open(path) as f:
            theirs = json.load(f)
    except (OSError, ValueError) as e:
        return f"{path} does not load ({type(e).__name__}): pick another --out"
    if theirs.get("script") != owner["script"]:
        return f"--out {out} belongs to {theirs.get('script')} (its {path}): pick another --out"
    for key, value in owner.items():
        if theirs.get(key) != value:
            return (f"--out {out} holds a model with {key} {theirs.get(key)}, this run has {value}: use the "
                    "flags that wrote it, or another --out")
    return None


def checkpoints(out):
    """The checkpoint-STEP directories in ``out``, oldest first."""
    names = [d for d in os.listdir(out) if d.startswith("checkpoint-") and d.split("-")[1].isdigit()]
    return sorted(names, key=lambda d: int(d.split("-")[1]))


def resume_state(out):
    """(path, state) of the newest checkpoint in --out that loads, on every rank; (None, None) if there is none.

    Global rank 0 chooses and tells the others, so that all resume from the same step. A checkpoint that does not
    load (a disk fault, a copy cut short) is skipped with a warning and kept, renamed out of the way of the saves
    and their pruning. Mapped, not read: a rank reads only the pages of what it uses. Called before the model and
    data are built, so that a rank that cannot read it stops the run at once, not minutes later.
    """
    state, choice = None, [None]
    names = checkpoints(out) if RANK == 0 and out and os.path.isdir(out) else []
    for name in reversed(names):
        try:
            state = torch.load(os.path.join(out, name, "state.pt"), map_location="cpu", weights_only=True, mmap=True)
            choice[0] = os.path.join(out, name)
            break
        except Exception as e:
            kept = f"{os.path.join(out, name)}.damaged-{int(time.time())}"
            os.replace(os.path.join(out, name), kept)
            print0(f"warning: skipped {os.path.join(out, name)}: it does not load ({type(e).__name__}); kept as {kept}")
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None, None
    error = None
    if RANK != 0:  # on several nodes every rank must see rank 0's --out (a shared filesystem)
        try:
            state = torch.load(os.path.join(choice[0], "state.pt"), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            error = f"rank {RANK} cannot read {choice[0]} ({type(e).__name__}): every node must see rank 0's --out"
    errors = [None] * WORLD
    dist.all_gather_object(errors, error)  # all stop together, none left waiting in a collective
    if any(errors):
        raise UsageError(next(e for e in errors if e))
    return choice[0], state


def save_checkpoint(out, step, state, keep):
    """Global rank 0 only (all replicas are identical, and N writers to one path would corrupt it): call it
    through on_rank_0, so that every rank learns whether it could.

    Written into a temporary directory, fsynced, then renamed: a crash mid-write leaves the previous
    checkpoint intact and never a half-written one under a checkpoint-STEP name.
    """
    with written_aside(out, f"checkpoint-{step}", tensor_bytes(state)) as tmp:
        with open(os.path.join(tmp, "state.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, f"checkpoint-{step}"))
    # Prune: the newest `keep` checkpoints stay, and so does nothing a crash may have left half-written.
    for d in checkpoints(out)[:-keep] + [d for d in os.listdir(out) if d.startswith(".tmp-")]:
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)


def on_rank_0(write, *args):
    """Every rank calls it; global rank 0 runs write(*args). If that fails in one line (a full disk), every rank
    stops with that line: alone, rank 0 would stop and the others report a lost peer at their next collective."""
    error = [None]
    if RANK == 0:
        try:
            write(*args)
        except UsageError as e:
            error[0] = str(e)
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise UsageError(error[0])


@contextlib.contextmanager
def written_aside(out, name, needed):
    """A new temporary directory in `out` to write `name` into, which the caller then moves into place. Whatever
    stops the write (a full disk, Ctrl-C) removes it, so nothing half-written is left; a write the system refused
    becomes one line naming the directory and the space it needs (`needed`, in bytes)."""
    tmp = os.path.join(out, f".tmp-{name}")
    try:
        os.makedirs(tmp, exist_ok=True)
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if signalled(e):  # Ctrl-C mid-write, which torch.save may report as an error of its own
            raise signalled(e) from None
        reason = refused_write(e)
        if reason is None:
            raise  # not the disk's doing: a bug keeps its traceback
        free = shutil.disk_usage(out).free if os.path.isdir(out) else 0
        raise UsageError(f"cannot write {name} to {out}: {reason}: it needs about {size(needed)}, {size(free)} is "
                         f"free there. Make room; {newest_checkpoint(out)}") from None


def refused_write(e):
    """Why the system refused a write (no space, a quota, an I/O error), from the exception or its causes, or None.
    torch.save raises a RuntimeError in the course of handling the OSError; safetensors' writer (save_pretrained)
    gives only the text of it ("I/O error: No space left on device (os error 28)")."""
    while e is not None:
        if isinstance(e, OSError):
            return e.strerror or str(e)
        if "(os error " in str(e):
            return str(e).rsplit(": ", 1)[-1].split(" (os error ")[0]
        e = e.__cause__ or e.__context__
    return None


def tensor_bytes(state):
    """About what torch.save writes for `state`: every tensor's storage once (tied weights share one)."""
    storages, todo = {}, [state]
    while todo:
        x = todo.pop()
        if torch.is_tensor(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return sum(storages.values())


def size(n):
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def newest_checkpoint(out):
    """What a run that stops early leaves behind, and how to go on: the end of its one line."""
    names = checkpoints(out) if out and os.path.isdir(out) else []
    if names:
        return f"the newest checkpoint is {os.path.join(out, names[-1])}; rerun the same command to resume"
    if out:
        return f"{out} holds no checkpoint yet; rerun the same command to start again"
    return "nothing was saved (no --out)"


# --- command line ---
def parse_args(argv=None):
    p = parser(__doc__, timeout_s=300)
    count = number(int, 1)
    g = p.add_argument_group("model and data")
    g.add_argument("--n-layer", type=count, default=4, help="GPT-2 blocks, one FSDP unit each")
    g.add_argument("--n-embd", type=count, default=128, help="width")
    g.add_argument("--n-head", type=count, default=4, help="attention heads")
    g.add_argument("--seq-len", type=count, default=128, help="tokens (bytes) per sequence")
    g.add_argument("--batch-size", type=count, default=8, help="sequences per rank per micro-batch")
    g = p.add_argument_group("training")
    g.add_argument("--max-steps", type=count, default=30, help="optimizer steps")
    g.add_argument("--grad-accum", type=count, default=1, help="micro-batches per step: only the last one reduces")
    g.add_argument("--lr", type=number(float, 0, above=True), default=3e-3,
                   help=f"AdamW's learning rate (weight decay {WEIGHT_DECAY})")
    g.add_argument("--clip", type=number(float, 0), default=0.0, help="clip the global gradient norm to this (0: off)")
    g.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32", help="compute in this (master: fp32)")
    g.add_argument("--no-reshard-after-forward", action="store_true", help="keep gathered weights for backward")
    g.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0,
                   help="model init (same on all ranks); the data differs by rank")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="directory: resume from its checkpoints, write one every --ckpt-every")
    g.add_argument("--ckpt-every", type=count, default=10, help="steps between checkpoints")
    g.add_argument("--log-every", type=count, default=10, help="steps between loss lines")
    g.add_argument("--profile", default=None, help="directory for a torch.profiler trace of our run, per rank")
    g.add_argument("--crash-at-step", type=count, default=None,
                   help="demo: the last rank SIGKILLs itself once our run has done this many steps (first attempt)")
    args = p.parse_args(argv)
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    for flag, path in (("--out", args.out), ("--profile", args.profile)):  # last: they make the directories
        if path and not_a_directory(path):
            p.error(f"{flag} {path}: {not_a_directory(path)}")
    return args


def a_file_on_the_way(path):
    """The file that stands where directory `path` or one of its parents should be, or None."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return None if os.path.isdir(existing) else existing


def not_a_directory(path):
    """Why this run cannot write into directory `path`, or None. Decided by trying: it makes the directory (and
    writes nothing in it); permission bits can say yes where the kernel says no (a path under /proc as root)."""
    if a_file_on_the_way(path):
        return f"{a_file_on_the_way(path)} is a file, not a directory"
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        return f"cannot write there ({e.strerror or type(e).__name__})"
    return None


# --- distributed setup: the same block in every numbered script, copied (not imported) so each file runs alone ---
RANK, WORLD = 0, 1


class UsageError(Exception):
    """Bad input: one line on rank 0 (`error: ...`), exit status 2, no traceback."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM, raised in the main thread, so the run unwinds through its own cleanup (nothing is
    left half-written). Code that knows where the run stopped sets `where` for run()'s one line."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.where = signum, ""


def print0(*msg):  # the rank-0 narrative: printed once, not N times
    if RANK == 0:
        print(*msg, flush=True)


def log(*msg):  # a per-rank line, tagged, in one write so that lines of different ranks never mix
    sys.stdout.write(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)) + "\n")
    sys.stdout.flush()


def number(kind, low, high=math.inf, above=False):
    """The argparse type of every numeric flag: a finite int or float from `low` (or above it) to `high`."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            bound = f"{'>' if above else '>='} {low}" + (f" and <= {high}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


def parser(doc, timeout_s=120):
    """argparse with the flags every script shares; a bad flag is one line on rank 0, not a usage text per rank."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def error(message):
        raise UsageError(message)
    p.error = error
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if GPUs >= ranks")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl if every rank has a GPU")
    p.add_argument("--timeout-s", type=number(float, 1, 30 * 86400), default=timeout_s,
                   help="how long a rank waits for a dead or stuck peer")
    return p


def choose_device(device, backend, n_gpus, local_rank, local_world):
    """(device, backend, note) from the flags and this node's GPUs. NCCL needs a GPU per rank; gloo shares."""
    if device == "cpu" or (device == "auto" and n_gpus == 0):
        if backend == "nccl":
            raise UsageError("--backend nccl runs on CUDA GPUs only: use gloo on the CPU")
        return torch.device("cpu"), "gloo", None
    if n_gpus == 0:
        raise UsageError("--device cuda, but this node has no CUDA GPU: use --device cpu")
    if n_gpus >= local_world:  # the usual GPU setup: local rank r takes cuda:r
        return torch.device("cuda", local_rank), backend or "nccl", None
    fix = f"start --nproc_per_node={n_gpus}, or share the GPU(s) over gloo with --device cuda --backend gloo"
    if backend == "nccl":
        raise UsageError(f"nccl needs one GPU per rank, but this node has {n_gpus} for {local_world} ranks: {fix}")
    if device == "auto":
        return torch.device("cpu"), "gloo", f"{n_gpus} GPU(s) for {local_world} ranks here, so CPU and gloo; {fix}"
    return torch.device("cuda", local_rank % n_gpus), "gloo", f"{local_world} ranks share {n_gpus} GPU(s) over gloo"


def setup(args, min_world=2):
    """Choose the device, then join the process group. Global RANK names a process; LOCAL_RANK picks its GPU."""
    global RANK, WORLD
    RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if WORLD < min_world:
        raise UsageError(f"needs {min_world} or more ranks: launch with torchrun, e.g. torchrun "
                         f"--nproc_per_node={min_world} {sys.argv[0]}")
    n_gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never touches CUDA
    device, backend, note = choose_device(args.device, args.backend, n_gpus, int(os.environ.get("LOCAL_RANK", 0)),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if note:
        print0(f"note: {note}")
    if device.type == "cuda":  # before init, so NCCL binds this rank to its GPU (not device_id=: pytorch#153960)
        torch.cuda.set_device(device)
    # Plain `python` (no torchrun): a group of one, in memory, so the same code runs. The timeout turns a dead peer
    # into an error after --timeout-s instead of a silent 30-minute hang.
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **alone)
    return device


def run(main, parse_args):
    """Bad input: one line on rank 0, exit 2. A peer that died or timed out: one line per survivor, exit 1.
    Ctrl-C or SIGTERM: one line on rank 0, and the process ends by that signal, as a shell expects (130, 143)."""
    # SIGTERM (a scheduler's, or torchrun passing on the Ctrl-C it got) stops a run the way Ctrl-C does.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    code = 0
    try:  # the outer try: a signal may land anywhere, even while the inner one reports a lost peer
        try:
            main(parse_args())
        except UsageError as e:
            if os.environ.get("RANK", "0") == "0":  # every rank stops alike; one says why
                print(f"error: {e}", file=sys.stderr, flush=True)
            code = 2
        except RuntimeError as e:  # NCCL raises DistError; gloo, RuntimeErrors from torch.distributed or its transport
            where, text = traceback.extract_tb(e.__traceback__)[-1].filename, str(e)
            if signalled(e) or not (isinstance(e, dist.DistError) or f"torch{os.sep}distributed" in where
                                    or "gloo/" in text):
                raise  # a bug in this rank's own code keeps its traceback; a signal goes to the outer try
            what = "timed out waiting for a peer" if "timed out" in text.lower() else "lost a peer"
            log(f"error: {what} ({text.strip().splitlines()[0][:160]})")
            os._exit(1)  # no teardown: it would wait for the dead peer
        if dist.is_initialized():
            dist.destroy_process_group()
            # gloo's threads may still hold the last reference to a finished collective; freeing it takes the GIL,
            # which no thread gets once the interpreter is finalising ("terminate called without an active
            # exception", SIGABRT). A moment here lets them finish first.
            time.sleep(0.05)
    except BaseException as e:
        stop = signalled(e)
        if stop is None:
            raise
        if os.environ.get("RANK", "0") == "0":  # every rank got the signal (torchrun passes it on); one says where
            where = f" {stop.where}" if stop.where else ""
            print(f"interrupted by {stop}{where}", file=sys.stderr, flush=True)
        end_by_signal(stop.signum)  # no teardown: the peers are stopping too
    sys.exit(code)


def signalled(e):
    """The Interrupted behind exception `e`, or None. A signal that lands inside a library can come back as that
    library's own error, raised while handling it (torch.save's "unexpected pos" when its write was cut short)."""
    while e is not None and not isinstance(e, Interrupted):
        e = e.__context__
    return e


def interrupt(signum, frame):
    # Only the first signal: a second Ctrl-C must not cut the way out (cleanup, the one line) short with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def end_by_signal(signum):
    """End this process as the signal would have: its parent (a shell, torchrun) sees an interrupt, not a failure."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


if __name__ == "__main__":
    run(main, parse_args)
