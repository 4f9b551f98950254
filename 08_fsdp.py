"""08 - Fully sharded data parallel (FSDP, ZeRO-3) by hand, equal to PyTorch's fully_shard.

After ZeRO-2 every rank still holds all the parameters. FSDP shards them too. fully_shard() keeps
chunk r of every parameter on rank r, and that chunk IS the parameter. Each unit is one GPT-2
block, or the root. Just before a unit computes, one all-gather rebuilds its weights. Right after,
they are freed again. Once the unit's backward is done, one reduce-scatter leaves each rank the
mean gradient of its own chunk. So the two halves of the ring all-reduce are the whole algorithm.
The next unit's all-gather starts before the current unit computes.

The script trains a Hugging Face GPT-2 with it, from random weights on Python's own sources, so
nothing is downloaded. Then it trains the same steps with DDP, with ZeRO-2 (when 07_zero.py sits
beside this file) and with PyTorch's fully_shard. It prints the bytes each rank holds and sends,
and the speed. It checks that ours equals fully_shard, bit for bit. Peak memory is measured apart,
by benchmarks/fsdp_memory.py.

  1 process:  python 08_fsdp.py
  CPU:        torchrun --nproc_per_node=2 08_fsdp.py              (or 3, for uneven chunks)
  N GPUs:     torchrun --nproc_per_node=N 08_fsdp.py --param-dtype bf16 --n-layer 12 --n-embd 768 \\
                  --n-head 12
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST \\
                  --master_port=29500 08_fsdp.py
  options:    --grad-accum 4 --clip 1.0 --no-reshard-after-forward --out ckpt
              (--out resumes on any number of ranks)
"""

import argparse
import contextlib
import copy
import glob
import importlib.util
import math
import os
import statistics
import time
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
# A batch's seed is seed + stride * micro-batch + rank. With fewer ranks than the stride, no two
# (micro-batch, rank) pairs share a seed.
DATA_SEED_STRIDE = 1009

# --- the idea: fully sharded data parallel by hand ---
# The two halves of the ring all-reduce. torch 2.14 gave them new names that end in _single.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
def _tensors(x):
    """The tensors in a forward's inputs or outputs. They come alone, or in tuples, lists and
    dicts."""
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    return [x] if isinstance(x, torch.Tensor) else []


def _copy_chunks(rows, tensors, sizes, into_rows):
    """Packs each tensor's chunks into rows, or unpacks them. This is PyTorch's layout.

    Row r holds rank r's chunk of each tensor, one after the other. A chunk is the r-th `size`
    elements, which is torch.chunk's r-th block of rows, padded with zeros to `size`."""
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
    """What one fully_shard() call makes. Its parameters are sharded, gathered and reduced as one
    flat buffer each."""

    def __init__(self, module, params, group, param_dtype, reduce_dtype, reshard_after_forward):
        self.module, self.group, self.world, self.rank = module, group, group.size(), group.rank()
        self.gloo = dist.get_backend(group) == "gloo"  # see unshard and post_backward
        # A root with no parameters of its own has no dtype, but it still runs the step.
        self.dtype, self.device = (params[0].dtype, params[0].device) if params else (None, None)
        self.root, self.name = None, type(module).__name__
        self.param_dtype = param_dtype or self.dtype  # for the all-gather and the compute
        self.reduce_dtype = reduce_dtype or self.param_dtype  # for the reduce-scatter
        # None means every unit but the root. The root is known at the first forward.
        self.reshard_after_forward = reshard_after_forward
        self.sync, self.state, self.gather, self.acc = True, "sharded", None, [None] * len(params)
        # torch.chunk(p, N) gives each rank ceil(rows / N) rows, and the last ranks fewer or none.
        # Padded to that size, every rank's part of the flat buffers is equally long.
        self.sizes = [-(-len(p) // self.world) * p[0].numel() for p in params]
        self.flat = torch.zeros(sum(self.sizes), dtype=self.dtype, device=self.device)  # my chunks
        mine = [p.detach().reshape(-1)[self.rank * s:][:s] for p, s in zip(params, self.sizes)]
        _copy_chunks(self.flat.view(1, -1), mine, self.sizes, into_rows=True)
        # From now on each chunk IS the parameter, a plain tensor. An optimizer built after
        # fully_shard updates this rank's chunks only. AdamW works element by element, so that
        # step is exactly its step on the full tensors (ZeRO-1).
        self.shards = [nn.Parameter(c[:len(m)].view(-1, *p.shape[1:]), p.requires_grad)
                       for c, m, p in zip(self.flat.split(self.sizes), mine, params)]
        self.full = [nn.Parameter(torch.empty_like(p, dtype=self.param_dtype), p.requires_grad)
                     for p in params]
        # A tied parameter has several places, and each one is listed.
        self.owners = [[(m, k) for m in module.modules() for k, q in m.named_parameters(
            recurse=False, remove_duplicate=False) if q is p] for p in params]
        self.reshard()

    def reshard(self):
        """Free the full parameters' storage. Then what autograd saved of them costs nothing too."""
        for f, owners, s in zip(self.full, self.owners, self.shards):
            f.untyped_storage().resize_(0)
            for m, k in owners:
                setattr(m, k, s)
        self.state = "sharded"

    def unshard(self, wait=True):
        """Launch the all-gather of this unit's parameters, unless it is under way. With wait,
        install the gathered parameters."""
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
            # Forward saved these tensors for backward. Refilling them through .data leaves the
            # version counter alone, which autograd checks. PyTorch's FSDP uses a private guard.
            _copy_chunks(buf.view(self.world, -1), [f.data for f in self.full], self.sizes,
                         into_rows=False)
            self.state, self.gather = "full", None

    def start_gather(self):
        """Launch the all-gather. It returns the output to be, and the handles to wait on."""
        buf = torch.empty(self.world * len(self.flat), dtype=self.param_dtype, device=self.device)
        if self.gloo:
            # gloo's all-gather works through a temporary copy of its output, which stays alive
            # while the next unit computes. N broadcasts, one from each rank into its own row,
            # send the same bytes in place.
            rows = buf.view(self.world, -1)
            rows[self.rank].copy_(self.flat)
            return buf, [dist.broadcast(row, src=dist.get_global_rank(self.group, r),
                                        group=self.group, async_op=True)
                         for r, row in enumerate(rows)]
        return buf, [all_gather(buf, self.flat.to(self.param_dtype), group=self.group,
                                async_op=True)]

    # The hooks, in the order they run in a training step.
    def pre_forward(self, module, args, kwargs):
        if self.root is None:  # The first unit to run forward is the root, as in PyTorch.
            self.init_root()
        self.unshard()
        if self.next is not None:  # Its all-gather runs while this unit computes.
            self.next.unshard(wait=False)
        if self.param_dtype != self.dtype:  # cast_forward_inputs of MixedPrecisionPolicy
            args = tuple(self.cast(a) for a in args)
            kwargs = {k: self.cast(v) for k, v in kwargs.items()}
        inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if torch.is_grad_enabled() and inputs:  # It runs when autograd is through the whole unit.
            torch.autograd.graph.register_multi_grad_hook(inputs, self.post_backward)
        return args, kwargs

    def cast(self, x):
        floating = isinstance(x, torch.Tensor) and x.is_floating_point()
        return x.to(self.param_dtype) if floating else x

    def post_forward(self, module, args, output):
        if self.reshard_after_forward or not torch.is_grad_enabled():  # No backward will come.
            self.reshard()
        # A hook on a node runs after the hooks on tensors. So the next unit's post_backward
        # runs first.
        for t in _tensors(output):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(self.pre_backward)
        return output

    def pre_backward(self, grad):
        if self.state == "backward":  # Another of its outputs started it.
            return
        if not self.root.queued:  # At the end of backward, the root waits for each reduce-scatter.
            self.root.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.root.finish_backward)
        self.unshard()
        self.prev.unshard(wait=False)  # Backward runs through the units in reverse.
        self.state = "backward"

    def post_backward(self, *unused):
        # It runs once per forward call, and again from finish_backward. There is no "done"
        # state, because a second graph through this unit (two forwards, one backward) must
        # gather the weights again and reduce.
        self.reshard()
        for i, f in enumerate(self.full):  # With sync off, PyTorch sums full gradients.
            if f.grad is not None and (self.acc[i] is not None
                                       or not self.sync and f.grad.dtype != self.reduce_dtype):
                a = self.acc[i]
                self.acc[i] = f.grad.to(self.reduce_dtype) if a is None else a + f.grad
                f.grad = None
        if not self.sync:  # Gradient accumulation sends nothing.
            return
        grads = [f.grad if a is None else a for f, a in zip(self.full, self.acc)]
        grads = [(i, g) for i, g in enumerate(grads) if g is not None]
        for f in self.full:
            f.grad = None
        self.acc = [None] * len(self.full)
        # The previous unit's reduce-scatter is done by now. So one buffer at most is in flight.
        while self.root.pending:
            self.root.finish_reduce()
        if grads:
            idx, sizes = [i for i, _ in grads], [self.sizes[i] for i, _ in grads]
            rows = torch.zeros(self.world, sum(sizes), dtype=self.reduce_dtype, device=self.device)
            _copy_chunks(rows, [g for _, g in grads], sizes, into_rows=True)
            grads = None  # The full gradients are freed. Their packed copy is all that is left.
            out, work = self.start_reduce(rows)
            self.root.pending.append((self, work, rows, out, idx))

    def start_reduce(self, rows):
        """Launch the reduce-scatter of the packed gradients. It returns this rank's mean to be
        (or None), and the handle."""
        # fully_shard asks for the mean (AVG). NCCL reduce-scatters and divides in one go.
        # gloo has no reduce-scatter. Its reduce_scatter_single all-reduces a copy of the whole
        # buffer, keeps this rank's row and divides it. The same all-reduce in place gives the
        # same bits, without the copy.
        if self.world == 1:  # Nothing to reduce. NCCL before 2.29.7 botches a one-rank AVG.
            return rows[0], None
        if self.gloo:
            return None, dist.all_reduce(rows, group=self.group, async_op=True)
        out = torch.empty(rows.shape[1], dtype=self.reduce_dtype, device=self.device)
        return out, reduce_scatter(out, rows.view(-1), op=dist.ReduceOp.AVG, group=self.group,
                                   async_op=True)

    def set_requires_gradient_sync(self, requires_gradient_sync):
        """Turned off, backward sends nothing, and each rank keeps summing full gradients. That is
        gradient accumulation."""
        for unit in _units(self.module):
            unit.sync = requires_gradient_sync

    # The root's share is what one training step needs across its units.
    def init_root(self):
        # The prefetch follows this order, as GPT-2 runs its blocks. Backward runs it reversed.
        units = _units(self.module)
        names = [name or "root" for name, m in self.module.named_modules()
                 if hasattr(m, "fsdp_unit")]
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
        for i in idx:  # Each shard's .grad is a view of out, or is added to if it has one.
            s, g = unit.shards[i], out[off:off + unit.shards[i].numel()].view_as(unit.shards[i])
            s.grad = g if s.grad is None else s.grad.add_(g)
            off += unit.sizes[i]

    def finish_backward(self):
        # Units whose inputs needed no gradient reduce now. The root is one, with token ids in.
        for u in _units(self.module):
            u.post_backward()
        while self.pending:
            self.finish_reduce()
        for u in _units(self.module):
            if u.gather is not None:  # A prefetch nobody used holds old weights. Drop it.
                for work in u.gather[1]:
                    work.wait()
            u.gather, u.state = None, "sharded"
        self.queued = False


def _unsharded_params(module, top=True):
    """PyTorch's order: a module's children before itself, skipping submodules that are units."""
    if top or not hasattr(module, "fsdp_unit"):
        for child in module.children():
            yield from _unsharded_params(child, False)
        yield from module.parameters(recurse=False)


def fully_shard(module, *, process_group=None, param_dtype=None, reduce_dtype=None,
                reshard_after_forward=None, unit_class=Unit):
    """torch.distributed.fsdp.fully_shard by hand. It makes one unit of the module's parameters
    that are not in a unit yet. Call it on each block, then on the root. param_dtype and
    reduce_dtype mean what the fields of MixedPrecisionPolicy mean. The training below passes
    CountingUnit as unit_class, a Unit that also counts the bytes it sends."""
    if hasattr(module, "fsdp_unit"):
        raise ValueError(f"{type(module).__name__} is sharded already. Call fully_shard once per "
                         "module.")
    params = list(dict.fromkeys(_unsharded_params(module)))  # a tied parameter once
    for p in params:
        if hasattr(p, "sharded_by"):
            raise ValueError(f"a parameter of {type(module).__name__} is shared with "
                             f"{p.sharded_by}, sharded before. Shard the modules that share it "
                             "as one unit.")
        if p.dim() == 0 or p.dtype != params[0].dtype:
            raise ValueError("fully_shard needs parameters of one dtype, each with a dim 0 to "
                             "shard")
        p.sharded_by = type(module).__name__
    unit = unit_class(module, params, process_group or dist.group.WORLD, param_dtype, reduce_dtype,
                      reshard_after_forward)
    module.fsdp_unit = unit
    module.register_forward_pre_hook(unit.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(unit.post_forward)
    module.set_requires_gradient_sync = unit.set_requires_gradient_sync  # as on PyTorch's
    return module


def _gather_full(unit, chunks, which):
    """Full tensors on every rank, from every rank's chunks, by one all-gather unpacked as
    unshard does. chunks[j] is this rank's chunk of the unit's parameter which[j], or of a tensor
    shaped like it."""
    sizes = [unit.sizes[i] for i in which]
    mine = torch.zeros(sum(sizes), dtype=chunks[0].dtype, device=unit.device)
    _copy_chunks(mine.view(1, -1), chunks, sizes, into_rows=True)
    buf = torch.empty(unit.world * len(mine), dtype=mine.dtype, device=unit.device)
    all_gather(buf, mine, group=unit.group)
    fulls = [torch.empty(unit.full[i].shape, dtype=mine.dtype, device=unit.device) for i in which]
    _copy_chunks(buf.view(unit.world, -1), fulls, sizes, into_rows=False)
    return fulls


def full_state_dict(module):
    """{name: full tensor} on every rank, with the names of the plain module's state_dict(). It
    is a plain checkpoint."""
    fulls = {}
    for unit in _units(module):
        unit.reshard()
        if unit.full:
            everything = range(len(unit.shards))
            chunks = [s.detach() for s in unit.shards]
            fulls.update(zip(unit.shards, _gather_full(unit, chunks, everything)))
    return {k: fulls[v] if v in fulls else v.detach().clone()
            for k, v in module.state_dict(keep_vars=True).items()}


def load_full_state_dict(module, state):
    """The reverse. Every rank copies in its own chunk of each sharded parameter. Chunk r of N is
    the same slice of a full tensor for any N, so any number of ranks may have written it."""
    starts, mine = {}, dict(state)
    for unit in _units(module):
        unit.reshard()
        starts.update((s, unit.rank * size) for s, size in zip(unit.shards, unit.sizes))
    for k, t in module.state_dict(keep_vars=True).items():
        if t in starts and k in state:
            mine[k] = state[k].reshape(-1)[starts[t]:starts[t] + t.numel()].view_as(t)
    module.load_state_dict(mine)


def full_optim_state_dict(module, optimizer):
    """The optimizer's state as an unsharded run holds it, on every rank. The layout is that of
    PyTorch's distributed checkpoint (get_optimizer_state_dict with full_state_dict=True). It is
    keyed by parameter name, a tied parameter by its first, and holds full tensors.

    AdamW's two moments are shaped like the shard, one value per element. They are gathered like
    the weights. The rest, such as AdamW's step, is one value per parameter, the same on every
    rank."""
    names = {p: n for n, p in module.named_parameters()}  # a tied parameter once, by its first name
    state = {}
    for unit in _units(module):
        unit.reshard()
        # The parameters with optimizer state, the same ones on every rank.
        held = [i for i, s in enumerate(unit.shards) if optimizer.state.get(s)]
        for key in dict.fromkeys(k for i in held for k in optimizer.state[unit.shards[i]]):
            values = [optimizer.state[unit.shards[i]][key] for i in held]
            shards = [unit.shards[i] for i in held]
            if all(torch.is_tensor(v) and v.shape == s.shape for s, v in zip(shards, values)):
                values = _gather_full(unit, values, held)
            else:  # A copy: the optimizer's next step changes its own tensor.
                values = [v.clone() if torch.is_tensor(v) else v for v in values]
            for i, v in zip(held, values):
                state.setdefault(unit.shards[i], {})[key] = v
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [names[p] for p in g["params"]]} for g in optimizer.param_groups]
    order = [p for g in optimizer.param_groups for p in g["params"] if p in state]
    return {"state": {names[p]: state[p] for p in order}, "param_groups": groups}


def load_full_optim_state_dict(module, optimizer, state):
    """The reverse. Every rank keeps its own chunk of each per-element state, whatever number of
    ranks wrote it."""
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
            # A copy, because torch.optim keeps the tensors it is given and updates them in place.
            mine.setdefault(i, {})[k] = v.clone() if torch.is_tensor(v) else v
    numbers = optimizer.state_dict()["param_groups"]  # torch.optim's own numbers for its parameters
    optimizer.load_state_dict({"state": mine, "param_groups": [
        dict(saved, params=ours["params"]) for saved, ours in zip(state["param_groups"], numbers)]})


def clip_grad_norm_(parameters, max_norm, group=None):
    """clip_grad_norm_ over shards, as PyTorch computes it over fully_shard's sharded gradients.
    Each parameter's squared norm is summed over the ranks, in one all-reduce for all. The total
    is the norm of their roots.

    Each shard's norm comes from the fused _foreach_norm, as in PyTorch, since DTensors take its
    foreach path. On a GPU that kernel adds in another order than one vector_norm per tensor. The
    result must be PyTorch's to the bit."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = torch.stack(torch._foreach_norm(grads)) ** 2
    dist.all_reduce(squares, group=group)
    total = torch.linalg.vector_norm(squares ** 0.5)
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


# --- GPT-2 trained four ways: DDP, ZeRO-2 (07), ours, PyTorch's fully_shard ---
class CountingUnit(Unit):
    """Our Unit, which also counts the bytes it sends, for the table's column. The root holds the
    count of every step so far. A ring all-gather or reduce-scatter of a buffer sends (N - 1) / N
    of it from every rank."""

    sent = 0

    def start_gather(self):
        buf, works = super().start_gather()
        self.root.sent += buf.nbytes * (self.world - 1) // self.world
        return buf, works

    def start_reduce(self, rows):
        self.root.sent += rows.nbytes * (self.world - 1) // self.world
        return super().start_reduce(rows)


def gpt2(args, device):
    import transformers
    transformers.logging.set_verbosity_error()  # Its notes are on settings we chose on purpose.
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)  # The same seed everywhere gives the same weights to shard.
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.n_embd,
                                  n_head=args.n_head, n_layer=args.n_layer, resid_pdrop=0,
                                  embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(cfg).to(device)


def build(impl, args, device, zero):
    """A fresh GPT-2, the module to call for impl, and its optimizer. All four use one AdamW."""
    model, adamw = gpt2(args, device), dict(lr=args.lr, weight_decay=WEIGHT_DECAY)
    if impl == "ZeRO-2":
        net = zero.ZeroDDP(model, torch.optim.AdamW, stage=2, **adamw)
        return model, net, net
    if impl == "DDP":
        ids = [device.index] if device.type == "cuda" else None
        net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model, net, torch.optim.AdamW(model.parameters(), **adamw)
    dtype = {"fp32": None, "bf16": torch.bfloat16}[args.param_dtype]
    reshard = False if args.no_reshard_after_forward else None  # None: True, but False for the root
    # Give it a mesh on OUR device. Without one, fully_shard builds a mesh on the machine's
    # accelerator and moves the module there. That is CUDA whenever a GPU exists, even under
    # --device cpu. A 2-D mesh of nodes x GPUs, from init_device_mesh, would shard within each
    # node and copy across nodes. That is HSDP.
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    for m in [*model.transformer.h, model]:  # each block a unit, then the root
        if impl == "ours":
            fully_shard(m, param_dtype=dtype, reshard_after_forward=reshard,
                        unit_class=CountingUnit)
        else:
            torch_fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype),
                              reshard_after_forward=reshard)
    return model, model, torch.optim.AdamW(model.parameters(), **adamw)


def batch(text, step, micro, args, device):
    """Windows of Python's sources, bytes as tokens. They are drawn from (seed, step, micro, rank)
    alone. So every rank sees other data, and a resumed run sees what an uninterrupted one sees."""
    micro_batch = step * args.grad_accum + micro
    g = torch.Generator().manual_seed(args.seed + DATA_SEED_STRIDE * micro_batch + RANK)
    starts = torch.randint(len(text) - args.seq_len, (args.batch_size,), generator=g).tolist()
    return torch.stack([text[s:s + args.seq_len] for s in starts]).to(device)


def held_mib(params, optimizer):
    """MiB of parameters, gradients and optimizer state that this rank holds. It counts tensors,
    each storage once."""
    def mib(tensors):
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}
        return sum(storages.values()) / 2**20
    state = [v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim()]
    # What the optimizer steps. Under ZeRO-2 those are pieces of the shards.
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    return mib(params), mib(p.grad for p in stepped), mib(state)


# --- training ---
def train(impl, args, device, text, zero, ckpt=None):
    """A GPT-2 trained by impl to --max-steps, fresh or from ckpt. It returns the full weights and
    what the training took."""
    model, net, opt = build(impl, args, device, zero)
    fsdp, start, norms, seconds = impl in ("ours", "fully_shard"), 0, [], []
    if ckpt:
        resume(impl, model, opt, ckpt)
        start = ckpt["step"]
    for step in range(start, args.max_steps):
        t0 = time.perf_counter()
        for micro in range(args.grad_accum):
            last = micro == args.grad_accum - 1
            if fsdp:  # Gradient accumulation: the last micro-batch reduces the sum of all.
                net.set_requires_gradient_sync(last)
            with contextlib.nullcontext() if fsdp or last else net.no_sync():
                x = batch(text, step, micro, args, device)
                loss = net(input_ids=x, labels=x, use_cache=False).loss
                (loss / args.grad_accum).backward()
        if args.clip > 0:
            clip = clip_grad_norm_ if impl == "ours" else nn.utils.clip_grad_norm_
            norm = clip(model.parameters(), args.clip)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        opt.step()
        held = held_mib(list(model.parameters()), getattr(opt, "optim", opt))  # ZeroDDP has .optim
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # The GPU runs behind. Wait for it before the clock.
        seconds.append(time.perf_counter() - t0)
        if impl == "ours" and ((step + 1) % args.log_every == 0 or step + 1 == args.max_steps):
            print0(f"step {step + 1:4d}/{args.max_steps} | loss {loss.item():.4f} "
                   "(rank 0's last micro-batch)")
        # The last step is saved too. A run stopped after it, or the same command again, then
        # has nothing to train twice.
        if impl == "ours" and args.out and ((step + 1) % args.ckpt_every == 0
                                            or step + 1 == args.max_steps):
            # Full tensors, as an unsharded run holds them. Every rank gathers, and global rank 0
            # writes. Any number of ranks can resume from them, each taking its own chunks.
            state = {"model": full_state_dict(model),
                     "optimizer": full_optim_state_dict(model, opt),
                     "step": step + 1, "world_size": WORLD}
            if RANK == 0:
                save_checkpoint(args.out, step + 1, on_cpu(state))
    full = full_state_dict(model) if impl == "ours" else model.state_dict()
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in full.items()}
    sent = model.fsdp_unit.sent / len(seconds) if impl == "ours" else 0  # per step
    ms = statistics.median(seconds[1:] or seconds) * 1e3  # The first step warms up.
    return full, dict(held=held, ms=ms, norms=norms, sent=sent)


def resume(impl, model, opt, ckpt):
    """impl starts where the checkpoint's run stopped, resharded onto this run's ranks. Their
    number may differ."""
    if impl == "ours":
        load_full_state_dict(model, ckpt["model"])
        load_full_optim_state_dict(model, opt, ckpt["optimizer"])
    elif impl == "ZeRO-2":
        # ZeroDDP loads a plain optimizer's state_dict, numbered, not named, and keeps its shard.
        number = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict({"state": {number[k]: v for k, v in ckpt["optimizer"]["state"].items()},
                             "param_groups": [dict(g, params=[number[k] for k in g["params"]])
                                              for g in ckpt["optimizer"]["param_groups"]]})
    else:
        # PyTorch's distributed checkpoint (DCP) reshards full tensors onto fully_shard's
        # DTensors, and loads DDP's copies too. It writes its DTensors into the model's dict it is
        # given, and steps the optimizer's tensors it is given. So it gets copies, and the
        # checkpoint stays as it was read, for the next implementation.
        set_state_dict(model, opt, model_state_dict=dict(ckpt["model"]),
                       optim_state_dict=copy.deepcopy(ckpt["optimizer"]),
                       options=StateDictOptions(full_state_dict=True))


def on_cpu(state):  # Every tensor is copied to the CPU, so the file loads where no GPU is.
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [on_cpu(v) for v in state]
    return state.cpu() if torch.is_tensor(state) else state


def main(args):
    device = setup(args)
    if device.type == "cuda":
        # The runs compared below are separate runs. On a GPU, attention's backward and cuBLAS
        # may add in another order each time. Deterministic mode picks kernels that do not.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS needs it
        torch.use_deterministic_algorithms(True)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device} "
           f"param_dtype={args.param_dtype} torch={torch.__version__}")
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    text = b"".join(Path(f).read_bytes() for f in files)
    text = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    if args.seq_len >= len(text):
        raise UsageError(f"--seq-len {args.seq_len} is longer than the text ({len(text):,} bytes)")
    ckpt = load_newest(args.out) if args.out else None  # any number of ranks may have written it
    if ckpt and ckpt["step"] >= args.max_steps:  # the same command again, or a restart at the end
        save_model(args, ckpt["model"])  # in case the run stopped before it saved the model
        print0(f"OK nothing to train: {args.out} holds step {ckpt['step']} of --max-steps "
               f"{args.max_steps}. A larger --max-steps trains on.")
        return
    if ckpt:
        path, writers = f"{args.out}/checkpoint-{ckpt['step']}.pt", ckpt["world_size"]
        print0(f"resumed from {path} at step {ckpt['step']}" + ("" if writers == WORLD else
               f", written by {writers} ranks: every implementation reshards it onto {WORLD}"))
    zero, here = None, os.path.join(os.path.dirname(os.path.abspath(__file__)), "07_zero.py")
    if os.path.exists(here):  # The lesson imports the one before it only to compare with it.
        spec = importlib.util.spec_from_file_location("zero", here)
        zero = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(zero)
    runs = {"ours": train("ours", args, device, text, zero, ckpt)}
    for impl in ["fully_shard", "DDP", "ZeRO-2"]:  # the same steps from the same start
        if impl != "ZeRO-2" or zero:
            runs[impl] = train(impl, args, device, text, zero, ckpt)
    (ours, o), (theirs, t), (ddp, d) = runs["ours"], runs["fully_shard"], runs["DDP"]
    # Bytes sent per step. Ours are counted, and fully_shard sends the same (the tests check it).
    # DDP sends one ring all-reduce of the gradients. ZeRO-2 sends a reduce-scatter and an
    # all-gather. Both come to 2(N-1)/N of the gradients' bytes.
    params = {v.data_ptr(): v.nbytes for v in ddp.values()}  # the tied embedding once, as in DDP
    o_sent, d_sent = o["sent"], 2 * (WORLD - 1) / WORLD * sum(params.values())
    rows = []
    for impl in ["DDP", "ZeRO-2", "ours", "fully_shard"]:
        if impl not in runs:
            rows.append(f"| {RANK} | {impl} | n/a (07_zero.py not beside this file) ||||||")
            continue
        (p, g, opt), s = runs[impl][1]["held"], runs[impl][1]
        sent = o_sent if impl in ("ours", "fully_shard") else d_sent
        rows.append(f"| {RANK} | {impl} | {p:.3f} | {g:.3f} | {opt:.3f} | {sent / 2**20:.3f} | "
                    f"{sent / max(d_sent, 1):.2f} | {s['ms']:.1f} |")
    table = [None] * WORLD
    dist.all_gather_object(table, rows)
    print0("| rank | | params MiB | grads MiB | optimizer MiB | sent MiB/step | x DDP | ms/step |\n"
           "|---:|---|---:|---:|---:|---:|---:|---:|\n"
           + "\n".join(r for rank_rows in table for r in rank_rows))
    if args.clip > 0:
        print0(f"clip, last step: global norm over shards {o['norms'][-1]:.7f} "
               f"| fully_shard's {t['norms'][-1]:.7f} "
               f"| clip_grad_norm_ over DDP's full gradients {d['norms'][-1]:.7f}")
    # The checks. Ours must equal fully_shard bit for bit, and DDP within float rounding in fp32.
    # Every rank holds the same weights by construction. Each element lives on one rank only,
    # and every rank gathers it from there.
    if not all(v.isfinite().all() for v in ours.values()):  # Every rank has them, so all stop.
        raise UsageError("training diverged: the weights are not finite. Try a smaller --lr.")
    gap = max((ours[k].float() - ddp[k].float()).abs().max().item() for k in ours)
    if args.out:
        save_model(args, ours)
    if not same_bits(ours, theirs):
        raise RuntimeError("ours != fully_shard")
    if args.param_dtype == "fp32" and gap > 1e-4:
        raise RuntimeError(f"ours is {gap:.1e} away from DDP")
    if sum(o["held"]) > sum(d["held"]) / WORLD * 1.05 + 0.01:
        raise RuntimeError(f"ours holds {sum(o['held']):.2f} MiB, not 1/{WORLD} of DDP's "
                           f"{sum(d['held']):.2f}")
    start, since = (ckpt["step"], f" from {path}") if ckpt else (0, "")
    print0(f"OK ours == fully_shard bit for bit after {args.max_steps - start} AdamW steps{since} "
           f"({args.param_dtype}, world size {WORLD}), DDP within {gap:.1e}; "
           f"each rank holds 1/{WORLD} of DDP's bytes")


def save_model(args, full):
    """The weights as a plain GPT-2, which from_pretrained loads, with or without FSDP. Every rank
    holds the same full weights, and global rank 0 writes them. The last checkpoint holds them
    too, in case this write is cut short."""
    if RANK == 0:
        plain = gpt2(args, "cpu")
        plain.load_state_dict({k: v.cpu() for k, v in full.items()})
        plain.save_pretrained(args.out)
    print0(f"saved the trained model to {args.out} (transformers' from_pretrained loads it)")


def same_bits(a, b):
    """Equal, tensors bit for bit, through the dicts and lists of a state dict."""
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(same_bits(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_bits, a, b))
    if torch.is_tensor(a):
        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.cpu().reshape(-1).view(torch.uint8),
                                b.cpu().reshape(-1).view(torch.uint8)))
    return a == b


# --- checkpoints: the same block in 05, 06 and 08 ---
def load_newest(out):
    """The newest checkpoint in --out that loads, on every rank, or None. A run writes only into an
    --out that is new, empty or holds checkpoints, so never over files that no run wrote."""
    if os.path.isdir(out) and os.listdir(out) and not glob.glob("checkpoint-*", root_dir=out):
        raise UsageError(f"--out {out} holds files that no run wrote. Pick a new or empty folder.")
    os.makedirs(out, exist_ok=True)  # Now, so that a file of that name stops every rank here.
    found, me = [None, None], os.path.basename(__file__)  # the path, and the script that wrote it
    for path in reversed(checkpoints(out)) if RANK == 0 else []:  # Rank 0 picks one for all.
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            found = [path, state.get("script", "an older version")]
            break
        except Exception as e:  # A disk fault. Saving that step again writes over it.
            print0(f"warning: {path} does not load ({type(e).__name__}), so this run skips it")
    dist.broadcast_object_list(found, src=0)  # On several nodes, all must see the --out disk.
    if found[0] and found[1] != me:  # Another script's checkpoint holds other things.
        raise UsageError(f"{found[0]} was written by {found[1]}, not {me}. "
                         "Start this run in a new --out.")
    return found[0] and torch.load(found[0], map_location="cpu", weights_only=True, mmap=True)


def checkpoints(out):  # the checkpoint files in --out, oldest first
    names = [f for f in glob.glob("checkpoint-*.pt", root_dir=out) if f[11:-3].isdigit()]
    return [f"{out}/{f}" for f in sorted(names, key=lambda f: int(f[11:-3]))]  # f[11:-3] is a step


def save_checkpoint(out, step, state, keep=2):  # Global rank 0 alone calls it.
    # Written aside, then renamed into place, so that no checkpoint is ever half written.
    torch.save({**state, "script": os.path.basename(__file__)}, f"{out}/checkpoint-tmp")
    os.replace(f"{out}/checkpoint-tmp", f"{out}/checkpoint-{step}.pt")
    for old in checkpoints(out)[:-keep]:  # The newest `keep` stay.
        os.remove(old)


# --- command line ---
def parse_args(argv=None):
    p = Parser(__doc__, timeout_s=300)
    count = at_least(1)
    g = p.add_argument_group("model and data")
    g.add_argument("--n-layer", type=count, default=4, help="GPT-2 blocks, one FSDP unit each")
    g.add_argument("--n-embd", type=count, default=128, help="width")
    g.add_argument("--n-head", type=count, default=4, help="attention heads")
    g.add_argument("--seq-len", type=count, default=128, help="tokens (bytes) per sequence")
    g.add_argument("--batch-size", type=count, default=8, help="sequences per rank per micro-batch")
    g = p.add_argument_group("training")
    g.add_argument("--max-steps", type=count, default=30, help="optimizer steps")
    g.add_argument("--grad-accum", type=count, default=1,
                   help="micro-batches per step (only the last one reduces)")
    g.add_argument("--lr", type=at_least(1e-12, float), default=3e-3,
                   help=f"AdamW's learning rate (weight decay {WEIGHT_DECAY})")
    g.add_argument("--clip", type=at_least(0.0, float), default=0.0,
                   help="clip the global gradient norm (0: off)")
    g.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="compute in this (the master weights stay fp32)")
    g.add_argument("--no-reshard-after-forward", action="store_true",
                   help="keep gathered weights for backward")
    g.add_argument("--seed", type=at_least(0, below=2**32), default=0,
                   help="model init (the same on all ranks); the data differs by rank")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None,
                   help="folder: resume from its checkpoints, write one every --ckpt-every")
    g.add_argument("--ckpt-every", type=count, default=10, help="steps between checkpoints")
    g.add_argument("--log-every", type=count, default=10, help="steps between loss lines")
    args = p.parse_args(argv)
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
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
