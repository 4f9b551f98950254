"""ManualDDP: PyTorch's DistributedDataParallel written by hand, a drop-in for it.

05_manual_ddp_gpt2.py teaches the idea of DDP in DDPCore. Real training code needs more. It passes
DDP's arguments. Its model may have parameters that get no gradient. Its ranks may run out of data
at different times. ManualDDP handles all that. It follows DDPCore method by method, and adds what
DDP does on top. Use it wherever you would build DistributedDataParallel:

  from ddp_dropin import ManualDDP
  model = ManualDDP(model, device_ids=[local_rank])  # as DistributedDataParallel(model, ...)

Of PyTorch's own DDP tests, it passes all that pass on PyTorch's DDP and use only its public API
(ddp_conformance.py). It trains Hugging Face's and Lightning's Trainers bit for bit as PyTorch's
DDP does (tests/test_clients.py). docs/manual_ddp.md explains each choice.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # lessons.py lies beside this file
from lessons import load  # noqa: E402

# The 05 beside this file, loaded once per process. ManualDDP reuses its buckets and their layout.
lesson = load(os.path.join(HERE, "05_manual_ddp_gpt2.py"))


def _call(wrapper, method, *args):
    """Call a method of the wrapper, unless it was dropped. Hooks hold it weakly, so it can be."""
    target = wrapper()
    if target is not None:
        return getattr(target, method)(*args)


def _let_gloo_threads_finish():
    """At exit, let a gloo thread free its last Work now. During shutdown it would abort."""
    time.sleep(0.05)


class _GradBucket(lesson.Bucket):
    """A core bucket with the methods a communication hook calls on torch.distributed.GradBucket."""

    def __init__(self, params, indices):
        super().__init__(params, indices)
        self._buffer, self._index, self._count = self.flat, -1, 0  # set by ManualDDP._set_buckets
        self.ready = [False] * len(params)  # the slots done in this backward
        self.zeroed = set()  # slots zeroed in forward, for a gradient still to come
        self.future = None  # what _finish waits for: the all-reduce, or the communication hook

    def __getstate__(self):  # a copy of the wrapper has no message in flight
        return {**self.__dict__, "work": None, "future": None}

    def buffer(self):
        return self._buffer

    def set_buffer(self, tensor):
        self._buffer = tensor

    def index(self):
        return self._index

    def is_last(self):
        return self._index == self._count - 1

    def parameters(self):
        return self.params

    def gradients(self):
        parts = self._buffer.split([p.numel() for p in self.params])
        return [part.view_as(p) for part, p in zip(parts, self.params)]


class ManualDDP(nn.Module, Joinable):
    """PyTorch's DistributedDataParallel by hand: DDPCore's steps, with DDP's options.

    It takes DDP's arguments, with DDP's defaults and meanings. Gradients always live in the
    buckets, so gradient_as_bucket_view and batched_grad_copy change nothing. Nor do dim and
    check_reduction, as in DDP with one device per process. Use torch.autocast in place of
    mixed_precision, DDP's experimental private option. verify=True is ours. It checks that the
    replicas are identical, instead of broadcasting. ManualDDP stands beside DDPCore rather than
    subclassing it, because DDP's options reach into every step of the core.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: dist.ProcessGroup | None = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
                 param_to_hook_all_reduce: nn.Parameter | None = None,
                 mixed_precision: Any = None, device_mesh: dist.DeviceMesh | None = None,
                 skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Sequence[float] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None, *, verify: bool = False) -> None:
        if mixed_precision is not None:
            raise NotImplementedError("ManualDDP has no mixed_precision. Use torch.autocast.")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None and device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to "
                             "be set together.")
        for cap in [bucket_cap_mb] + list(bucket_cap_mb_list or []):
            if cap is not None and not cap > 0:
                raise ValueError(f"bucket sizes must be positive, got {cap}")
        if broadcast_buffers is not None:  # DDP 2.14 deprecates it and warns the same way
            why = ("broadcast_buffers is ignored when both are given." if forward_sync_buffers
                   is not None else "forward_sync_buffers=False still broadcasts at construction.")
            warnings.warn(f"broadcast_buffers is deprecated. Use forward_sync_buffers. {why}",
                          FutureWarning, stacklevel=2)
        super().__init__()
        Joinable.__init__(self)
        atexit.unregister(_let_gloo_threads_finish)  # once per process, however many wrappers
        atexit.register(_let_gloo_threads_finish)
        self.static_graph, self.find_unused_parameters = static_graph, find_unused_parameters
        self._init_sync, self._verify = init_sync, verify
        # DDP 2.14's rule for buffers. If forward_sync_buffers is given, it rules the broadcast
        # before each forward, and the constructor always broadcasts. Otherwise broadcast_buffers
        # rules both, and it defaults to True.
        self._init_sync_buffers = forward_sync_buffers is not None or broadcast_buffers is not False
        self.forward_sync_buffers = (broadcast_buffers is not False if forward_sync_buffers is None
                                     else forward_sync_buffers)
        # DDP leaves alone the names in the model's _ddp_params_and_buffers_to_ignore, and the
        # delayed parameters. Those travel in a bucket of their own, once param_to_hook_all_reduce
        # has its gradient. A tuple keeps that trigger out of the wrapper's parameters, as in DDP.
        delayed = dict(delay_all_reduce_named_params or [])
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameters_to_ignore = ignore | set(delayed)
        self._delayed = [_GradBucket(list(delayed.values()), [])] if delayed else []  # 0 or 1
        self._delay_trigger = (param_to_hook_all_reduce,) if delayed else ()
        named = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        self.names = [n for n, p in named if p.requires_grad]
        self.params = [p for _, p in named if p.requires_grad]
        devices = {p.device for p in self.params + list(delayed.values())}
        self.device_ids, self.output_device = self._device_ids(device_ids, output_device, devices)
        if not self._delayed and not self.params:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't "
                               "have any parameter that requires a gradient.")  # DDP's words
        # From here on, the core's constructor, with the options above.
        self.module, self.process_group = module, process_group or dist.group.WORLD
        if device_mesh is not None:
            self.process_group = device_mesh.get_group(0)
            self.device_mesh = device_mesh  # set only when given, as in DDP
        self.world = self._divisor = dist.get_world_size(self.process_group)  # join() changes it
        self.require_backward_grad_sync = self.require_forward_param_sync = True
        self.device = next(module.parameters()).device
        self._sync_module_states([p for _, p in named])
        caps = bucket_cap_mb_list or ([1, 25] if bucket_cap_mb is None else [bucket_cap_mb])
        self._caps = [int(c * (1 << 20)) for c in caps]
        # With bucket_cap_mb_list, each bucket has its own cap from the start. With
        # find_unused_parameters the graph may change from one step to the next. So DDP then cuts
        # the buckets by size at once, and never rebuilds them.
        never_rebuilt = find_unused_parameters and not static_graph
        first_caps = self._caps if bucket_cap_mb_list or never_rebuilt else [float("inf")]
        first = lesson.bucket_layout(self.params, range(len(self.params)), first_caps)
        self._set_buckets(sorted(first, key=min, reverse=True))
        self._rebuilt, self._order = never_rebuilt, []
        self._next, self._queued = 0, False
        self._register_hooks()
        self.dim, self.gradient_as_bucket_view = dim, gradient_as_bucket_view
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self._first_sizes = self._bucket_sizes()
        self._syncs, self._hook = 0, None  # the synced backwards so far, the communication hook
        # Which parameters got a gradient since the last sync (see _tracks_use), and which ones
        # this rank left unused in the last one, for _get_ddp_logging_data.
        self._used = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        self._unused, self._graph_static = [], True
        self._hook_counts = [0] * len(self.params)  # static_graph: each one's hooks, first backward
        self._divide_by_initial, self._fresh, self._joining = True, set(), False
        # For DDP's errors at the next forward: a synced backward that raised before its end, or
        # parameters left without a gradient. The last error is kept for _get_ddp_logging_data.
        self._expect_finish, self._unreduced, self._error = False, [], None

    # -- construction: DDP's options --
    @property
    def buffers_to_sync(self) -> list[torch.Tensor]:
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def _sync_module_states(self, params):
        state = params + (self.buffers_to_sync if self._init_sync_buffers else [])
        delayed = self._delayed[0].params if self._delayed else []
        if self._init_sync or self._verify:
            self._check_shapes(state)
        if self._verify:
            self._check_identical(state + delayed)
            return
        if delayed:  # DDP sends them even without init_sync
            self._broadcast(delayed, src=0)
        if self._init_sync and self.params:  # DDP skips it when every trained parameter is delayed
            self._broadcast(state, src=0)

    def _broadcast(self, tensors, src):
        lesson.broadcast_coalesced(tensors, src, self.process_group)

    def _bucket_sizes(self):
        return ", ".join(str(b.flat.numel() * b.flat.element_size()) for b in self.buckets)

    @property
    def _first_rank(self):  # the global rank of the group's rank 0
        return dist.get_global_rank(self.process_group, 0)

    def _set_buckets(self, layout):
        """The core's, with buckets that answer what a communication hook asks."""
        grads = [p.grad for p in self.params]
        self.buckets = [_GradBucket([self.params[i] for i in idx], list(idx)) for idx in layout]
        self._where = [None] * len(self.params)
        for k, b in enumerate(self.buckets):
            b._index, b._count = k, len(self.buckets)
            for slot, i in enumerate(b.indices):
                self._where[i] = (b, slot)
                if grads[i] is not None:  # gradients summed so far move into the new buckets
                    b.views[slot].copy_(grads[i])
                    self.params[i].grad = b.views[slot]
        self._index_slots()

    def _index_slots(self):
        # The tensor hooks get the parameter, not its index: id(parameter) -> (bucket, slot).
        buckets = self.buckets + self._delayed
        self._slot = {id(p): (b, slot) for b in buckets for slot, p in enumerate(b.params)}

    def _register_hooks(self):
        me = weakref.ref(self)
        for i, p in enumerate(self.params):  # the core's
            p.register_post_accumulate_grad_hook(functools.partial(_call, me, "_on_grad_ready", i))
        for p in self.params + (self._delayed[0].params if self._delayed else []):
            p.register_hook(functools.partial(_call, me, "_grad_arriving", p))
        for p in self._delay_trigger:
            p.register_hook(functools.partial(_call, me, "_launch_delayed"))

    # -- one step, in the order it runs: forward, a hook per gradient, the end of backward --
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        training, sync = torch.is_grad_enabled(), self.require_backward_grad_sync
        # Inside join(), an all-reduce counts the ranks still training, in every step, as in DDP.
        notified = Join.notify_join_context(self)
        if notified is not None:  # divide by the initial world size, or by the ranks still training
            still = notified.get_future().wait()[0].item()
            self._divisor = self.world if self._divide_by_initial else int(still)
        if self._joining:  # tell the ranks that have joined whether this backward communicates
            flag = torch.tensor([float(sync)], device=self.device)
            dist.all_reduce(flag, group=self.process_group, async_op=True)
        if training:
            self._check_prior_reduction()
        if self.device_ids:  # as in DDP, inputs move to this process's GPU
            device = torch.device(self.device.type, self.device_ids[0])
            inputs, kwargs = _to_device((inputs, kwargs), device)
        # The core's forward from here. Under join(), the buffers come from a rank still training.
        if training:
            if sync:
                self._maybe_rebuild()
            self._grads_into_buckets()
        if self.will_sync_module_buffers():
            self._broadcast(self.buffers_to_sync, self._common_rank(True) if self._joining else 0)
        output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = training and sync
        return output

    def _grads_into_buckets(self):
        """Unlike the core, a missing .grad becomes its zeroed slot only once its gradient arrives
        (_grad_arriving). So a parameter that backward never reaches keeps .grad None, as in DDP."""
        for b in self.buckets + self._delayed:
            missing = [slot for slot, p in enumerate(b.params) if p.grad is None]
            if len(missing) == len(b.params):
                b.flat.zero_()
            else:
                for slot in missing:
                    b.views[slot].zero_()
            b.zeroed = set(missing)
        # The parameters whose .grad this forward created. With find_unused_parameters, their
        # .grad goes back to None if no rank used them.
        self._fresh = {b.indices[slot] for b in self.buckets for slot in b.zeroed}

    def _grad_arriving(self, p, grad):
        """A tensor hook. It runs just before autograd adds p's gradient into p.grad."""
        if p.grad is None and grad is not None:  # an undefined gradient adds nothing
            bucket, slot = self._slot[id(p)]
            if slot not in bucket.zeroed:  # forward did not zero it: it bypassed the wrapper
                bucket.views[slot].zero_()
            bucket.zeroed.discard(slot)
            p.grad = bucket.views[slot]
        return grad

    def _on_grad_ready(self, i, p):
        if self._tracks_use() and p.grad is not None:  # None: an undefined gradient
            self._used[i] = 1  # used since the last sync, no_sync steps included
        if self.static_graph and self.require_backward_grad_sync:
            self._queue_finish()
            if self._syncs == 0:
                # The first backward only counts. Reentrant checkpointing fires a hook twice.
                self._hook_counts[i] += 1
                return
            if self._hook_counts[i] == 0:  # worded as DDP's error, which tools look for
                raise self._record(RuntimeError(
                    f"Your training graph has changed in this iteration. {self.names[i]} got a "
                    "gradient, but none in the first iteration. static_graph=True takes the first "
                    "iteration's graph as the graph of every iteration. Use static_graph=False, "
                    "with find_unused_parameters=True if parameters go unused."))
            self._left[i] -= 1
            if self._left[i] > 0:
                return  # this gradient is not complete yet
        if not self.require_backward_grad_sync:  # the core's, from here
            return
        self._queue_finish()
        if not self._rebuilt:
            self._order.append(i)
        bucket, slot = self._where[i]
        self._mark_ready(bucket, slot)
        self._launch_ready()

    def _queue_finish(self):
        if not self._queued:
            self._queued, self._expect_finish, self._left = True, True, list(self._hook_counts)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _mark_ready(self, bucket, slot):
        p, i = bucket.params[slot], bucket.indices[slot]
        if bucket.ready[slot]:
            raise RuntimeError(
                f"ManualDDP: the gradient of {self.names[i]} became ready twice in one backward. "
                "Is a module inside a reentrant activation checkpoint also used outside it? Use "
                "torch.utils.checkpoint(..., use_reentrant=False), or static_graph=True.")
        view = bucket.views[slot]
        if p.grad is None:  # no gradient on this rank: it counts as zero in the mean
            self._fresh.add(i)
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():  # backward replaced .grad, it did not add
            view.copy_(p.grad)
        p.grad = view
        bucket.ready[slot] = True
        bucket.pending -= 1

    def _launch_ready(self):
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b):
        b.set_buffer(b.flat)
        if self._hook is not None:  # a communication hook decides how to average: it divides
            b.future = self._hook[1](self._hook[0], b)
            return
        b.flat.mul_(1 / self._divisor)  # the core's, with join()'s divisor
        b.work = dist.all_reduce(b.flat, group=self.process_group, async_op=True)
        b.future = b.work.get_future()

    def _finish(self):
        self._unreduced = self._missing()
        # A gradient that never came counts as zero, so that every bucket leaves, on every rank.
        # It was unused on this rank, or this is static_graph's first backward.
        for b in self.buckets[self._next:]:
            skip = self.skip_all_reduce_unused_params and self._all_unused(b)
            for slot, ready in enumerate(b.ready):
                if not ready:
                    self._mark_ready(b, slot)
            if not skip:
                self._launch(b)
        if self._tracks_use():
            # For DDP's logging data: does this rank leave the same parameters unused each time?
            unused = (self._used == 0).nonzero().flatten().tolist()
            self._graph_static &= self._syncs == 0 or self.static_graph or unused == self._unused
            self._unused = unused
            # Which parameters some rank used. The Work is kept, as Bucket.work is.
            self._used_work = dist.all_reduce(self._used, group=self.process_group, async_op=True)
            self._used_work.wait()
        self._queued, self._next = False, 0
        for b in self.buckets + self._delayed:
            self._wait(b)
            b.pending = len(b.params)
        if self.find_unused_parameters or self.static_graph:
            # As in DDP, .grad stays None where no rank used the parameter.
            for i in (self._used == 0).nonzero().flatten().tolist():
                if i in self._fresh:
                    self.params[i].grad = None
            if self.find_unused_parameters:
                self._used.zero_()
        for b in self.buckets + self._delayed:
            b.ready, b.zeroed = [False] * len(b.params), set()
        self._syncs, self._expect_finish = self._syncs + 1, False

    def _tracks_use(self):
        """Does DDP note which parameters get a gradient? With static_graph, only at first."""
        return self.find_unused_parameters or (self.static_graph and self._syncs == 0)

    def _all_unused(self, b):
        """Does DDP know that no parameter of this bucket was used, so it may skip it? It reads
        that from each forward's graph with find_unused_parameters. With static_graph it reads it
        once, from the first backward. Without either, DDP counts every parameter as used."""
        if self.static_graph:
            return self._syncs > 0 and not any(self._hook_counts[i] for i in b.indices)
        return self.find_unused_parameters and not any(b.ready)

    def _wait(self, b):
        if b.future is None:
            return  # not sent: skip_all_reduce_unused_params
        result = b.future.wait()
        result = result[0] if isinstance(result, list) else result
        if result.data_ptr() != b.flat.data_ptr():  # a hook may return another tensor
            b.flat.copy_(result)
        b.future = None

    # -- before the second forward, and accumulation: the core's own --
    def _maybe_rebuild(self):
        """The core's: cut the buckets again once, in the order the first backward filled them."""
        if self._rebuilt or not self._order:
            return
        order = list(dict.fromkeys(self._order + list(range(len(self.params)))))
        order = torch.tensor(order, device=self.device)
        dist.broadcast(order, src=self._first_rank, group=self.process_group)
        self._set_buckets(lesson.bucket_layout(self.params, order.tolist(), self._caps))
        self._rebuilt = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """The core's: backward sums into .grad on each rank alone, until the block ends."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    # -- DDP's errors for a parameter without a gradient --
    def _missing(self):
        """The parameters DDP would call unreduced now. Without find_unused_parameters, each must
        get a gradient. With static_graph, each one the first backward saw must get one."""
        if self.find_unused_parameters or (self.static_graph and self._syncs == 0):
            return []
        return [i for b in self.buckets for slot, i in enumerate(b.indices)
                if not b.ready[slot] and (not self.static_graph or self._hook_counts[i] > 0)]

    def _check_prior_reduction(self):
        """DDP's check before a forward: did the last synced backward reduce every gradient?"""
        if self._expect_finish:  # that backward raised before its end: its buckets are half done
            self._unreduced, self._expect_finish = self._missing(), False
            self._queued, self._next = False, 0
            for b in self.buckets + self._delayed:
                if b.future is not None:
                    b.future.wait()  # the all-reduces already launched, alike on every rank
                b.ready, b.pending, b.future = [False] * len(b.params), len(b.params), None
        if not self._unreduced:
            return
        names = ", ".join(self.names[i] for i in self._unreduced)
        indices = ", ".join(map(str, self._unreduced))
        rank, self._unreduced = dist.get_rank(self.process_group), []
        # Worded as DDP's message, because tools and PyTorch's own tests look for its phrases.
        if self.static_graph:
            why = ("This error indicates that your training graph has changed in this iteration, "
                   "e.g., one parameter is used in first iteration, but then got unused in the "
                   "second iteration. this is not compatible with static_graph set to True.")
        else:
            why = ("Some parameters got no gradient in the last backward that synchronised. "
                   "Enable unused parameter detection by passing the keyword argument "
                   "`find_unused_parameters=True` to ManualDDP, and make sure all `forward` "
                   "function outputs participate in calculating loss. PyTorch's DDP names the "
                   "parameters only if you set the environment variable TORCH_DISTRIBUTED_DEBUG "
                   "to either INFO or DETAIL. ManualDDP always names them.")
        raise self._record(RuntimeError(
            f"Expected to have finished reduction in the prior iteration before starting a new "
            f"one. {why}\n"
            f"Parameter indices which did not receive grad for rank {rank}: {indices}\n"
            f"Parameters which did not receive grad for rank {rank}: {names}"))

    def _record(self, error):
        self._error = str(error)  # for _get_ddp_logging_data, as DDP logs its errors
        return error

    # -- DDP's constructor checks, buffers, communication hooks, join --
    def _device_ids(self, device_ids, output_device, devices):
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        kind = next(iter(devices)).type if len(devices) == 1 else None  # "cuda" or "cpu", say
        if not device_ids or kind in (None, "cpu"):
            if device_ids or output_device is not None:
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work "
                    "with single-device/multiple-device GPU modules or CPU modules, but got "
                    f"device_ids {device_ids}, output_device {output_device}, and module "
                    f"parameters {devices}.")
            return None, None
        index = [torch.device(kind, d).index if isinstance(d, int) else torch.device(d).index
                 for d in device_ids]
        out = index[0] if output_device is None else torch.device(kind, output_device).index
        return index, out

    @property
    def broadcast_buffers(self) -> bool:
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        return bool(self.require_forward_param_sync and self.forward_sync_buffers
                    and self.buffers_to_sync)

    def _common_rank(self, candidate):
        rank = dist.get_rank(self.process_group) if candidate else -1
        rank = torch.tensor([rank], device=self.device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(rank.item())

    def _launch_delayed(self, grad):
        if not self.require_backward_grad_sync:
            return grad
        self._queue_finish()
        bucket = self._delayed[0]
        bucket.flat.mul_(1 / self._divisor)
        bucket.work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)
        bucket.future = bucket.work.get_future()
        return grad

    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future]) -> None:
        """As in DDP, hook(state, bucket) returns a Future that holds the bucket's mean."""
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        if self._hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                               "called once.")
        self._hook = (state, hook)

    # -- pickling: torch.save(ddp_model) and copy.deepcopy, as DDP allows them --
    def __getstate__(self):
        """As in DDP, only with the default group, which the copy gets back when it is loaded. The
        communication hook is not kept. DDP's lives in its C++ reducer, and is lost too."""
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError("ManualDDP can be pickled only with the default process group, "
                               "as DDP. A process group cannot be pickled.")
        dropped = ("process_group", "_used_work")
        return {**{k: v for k, v in self.__dict__.items() if k not in dropped}, "_hook": None}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        # The copy's parameters are new objects, pickled without hooks. Index and hook them again.
        self._index_slots()
        self._register_hooks()

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """DDP's summary of itself. It is private, but Lightning's teardown reads it. ManualDDP
        fills DDP's keys from its own state, less DDP's timings, which it does not measure."""
        group, params, dynamic = self.process_group, self.params, self.find_unused_parameters
        data = {
            "module_name": type(self.module).__name__, "backend_name": dist.get_backend(group),
            "world_size": self.world, "rank": dist.get_rank(group),
            "device_ids": ", ".join(map(str, self.device_ids or [])),
            "output_device": -1 if self.output_device is None else self.output_device,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "find_unused_parameters": int(dynamic),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())),
            "is_multi_device_module": 0, "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in params})),
            "bucket_cap_bytes": self._caps[-1], "bucket_sizes": self._first_sizes,
            "has_rebuilt_buckets": int(self._rebuilt and not (dynamic and not self.static_graph)),
        }
        if data["has_rebuilt_buckets"]:
            data["rebuilt_bucket_sizes"] = self._bucket_sizes()
        if self.static_graph:  # these three only once they apply, as in DDP
            data["static_graph"] = 1
        if self._joining:
            data["join_uneven_inputs"] = 1
        if self._hook is not None:
            data["comm_hook"] = getattr(self._hook[1], "__qualname__", repr(self._hook[1]))
        # While training, DDP writes this key only once the set of unused parameters has changed
        # between steps. DDP reports a static graph only when it is destroyed.
        if not self._graph_static:
            data["can_set_static_graph"] = 0
        if self._error is not None:  # as DDP after it raised
            data.update(iteration=self._syncs, has_error=1, error=self._error)
        return data

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Uneven inputs. A rank out of data mirrors the others' collectives until all are done."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _check_shapes(self, state):
        """As in DDP, every rank must hold as many tensors, of the same shapes and dtypes."""
        mine = [(tuple(t.shape), str(t.dtype)) for t in state]
        theirs = [mine]
        dist.broadcast_object_list(theirs, src=self._first_rank, group=self.process_group)
        differs = torch.tensor([float(theirs[0] != mine)], device=self.device)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=self.process_group)  # all or none
        if differs.item():
            raise RuntimeError("DistributedDataParallel: the model's tensors differ across ranks. "
                               "Build the same model on every rank.")

    def _check_identical(self, state):
        differs = torch.zeros(1, device=self.device)
        for t in state:
            ref = t.detach().clone()
            dist.broadcast(ref, src=self._first_rank, group=self.process_group)
            differs += 0 if torch.equal(ref, t.detach()) else 1
        # Agree on the verdict first. Else the ranks that did not raise would wait forever.
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=self.process_group)
        if differs.item():
            raise ValueError("ManualDDP(verify=True): the replicas differ across ranks. Seed every "
                             "rank alike with torch.manual_seed before building the model.")


class _JoinHook(JoinHook):
    """A rank out of data mirrors every collective the others still issue, with zero gradients."""

    def __init__(self, ddp, divide_by_initial_world_size):
        self.ddp = ddp
        ddp._divide_by_initial, ddp._joining = divide_by_initial_world_size, True  # as DDP does

    def main_hook(self):
        ddp = self.ddp
        flag = torch.zeros(1, device=ddp.device)  # will the others synchronize this backward?
        dist.all_reduce(flag, group=ddp.process_group)
        if flag.item():
            ddp._maybe_rebuild()
        if ddp.will_sync_module_buffers():
            ddp._broadcast(ddp.buffers_to_sync, ddp._common_rank(False))  # from a rank training
        ddp.require_forward_param_sync = bool(flag.item())
        if not flag.item():
            return
        for b in ddp.buckets:  # every bucket, as DDP's joined rank: it skips none
            b.flat.zero_()
            ddp._launch(b)
        for b in ddp.buckets:
            ddp._wait(b)
        if ddp._tracks_use():
            dist.all_reduce(torch.zeros_like(ddp._used), group=ddp.process_group)
        ddp._syncs += 1  # as the ranks still training count
        if not ddp._rebuilt and not ddp._order:
            ddp._order = list(range(len(ddp.params)))  # as in DDP, a joined rank offers its order

    def post_hook(self, is_last_joiner):
        """Every rank ends with the model of a rank that trained last."""
        ddp = self.ddp
        src = ddp._common_rank(is_last_joiner)
        params = [p for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
        ddp._broadcast(params + (ddp.buffers_to_sync if ddp.forward_sync_buffers else []), src)


def _to_device(obj, device):
    """The tensors in nested tuples, lists and dicts, moved to device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def bf16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook, by hand. Buckets travel as bfloat16, half the bytes of float32.

    It divides first, in float32, because a sum of 16-bit gradients could overflow where their
    mean would not. Then it casts, sums and casts back. It runs on ManualDDP and on DDP alike."""
    group = process_group or dist.group.WORLD
    compressed = bucket.buffer().div(group.size()).to(torch.bfloat16)
    sent = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    return sent.then(lambda fut: bucket.buffer().copy_(fut.value()[0]))
