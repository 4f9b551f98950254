"""ManualDDP: 05's DDPCore with the rest of torch.nn.parallel.DistributedDataParallel's surface, a drop-in for it.

05_manual_ddp_gpt2.py teaches DDP's idea in DDPCore (buckets, hooks, overlap, no_sync), bit-identical to PyTorch's
DDP. Code written for PyTorch's class needs more than the idea: DDP's arguments and defaults, parameters that get
no gradient (find_unused_parameters, static_graph), uneven inputs (join), communication hooks, delayed parameters,
pickling, _get_ddp_logging_data() and DDP's wording of its errors. This file adds them, as a subclass that replaces
the core's methods where they need more (a few of the core's lines repeated: the lesson stays free of hooks for
this file). Use it wherever DistributedDataParallel is constructed:

  from ddp_dropin import ManualDDP
  model = ManualDDP(model, device_ids=[local_rank])   # as DistributedDataParallel(model, device_ids=[local_rank])

It passes every one of PyTorch's own DDP tests that passes on PyTorch's DDP and uses only its public API
(tests/ddp_conformance.py), and trains Hugging Face's and Lightning's Trainers and Fabric bit for bit as PyTorch's
DDP does (tests/test_clients.py). Why each piece matches DDP the way it does: docs/manual_ddp.md.
"""

import atexit
import functools
import itertools
import math
import os
import sys
import time
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # lessons.py and 05 lie beside this file
from lessons import load  # noqa: E402

lesson = load("05_manual_ddp_gpt2.py")  # once per process, so DDPCore is one class everywhere
Bucket, DDPCore, bucket_layout, broadcast_coalesced = lesson.Bucket, lesson.DDPCore, lesson.bucket_layout, \
    lesson.broadcast_coalesced
# DDP's own words for a model with nothing to train (PyTorch's tests match on them)
NOTHING_TO_AVERAGE = ("DistributedDataParallel is not needed when a module doesn't have any parameter that requires "
                      "a gradient.")


def _call(wrapper, method, *args):
    """Call a method of the wrapper behind a weak reference, if the wrapper still exists (a hook must not keep a
    dropped wrapper alive)."""
    target = wrapper()
    if target is not None:
        return getattr(target, method)(*args)


def _let_gloo_threads_finish():
    """At exit, while the interpreter is still whole: give up the GIL a moment, so that a gloo worker thread that
    still has to free a Work (its destructor takes the GIL) does it now, not during finalisation (SIGABRT)."""
    time.sleep(0.05)


class _GradBucket(Bucket):
    """A core bucket that also answers what a DDP communication hook asks of torch.distributed.GradBucket."""

    def __init__(self, params, indices):
        super().__init__(params, indices)
        self._buffer, self._index, self._count = self.flat, -1, 0  # index and count: ManualDDP._set_buckets
        self.ready = [False] * len(params)  # slots done in this backward (unused ones are flushed at its end)
        self.zeroed = set()  # slots zeroed in forward for a gradient still to come (ManualDDP._grad_arriving)
        self.future = None  # what _finish waits for: the all-reduce's future, or the communication hook's

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
        offsets = itertools.accumulate([p.numel() for p in self.params], initial=0)
        return [self._buffer[o:o + p.numel()].view_as(p) for o, p in zip(offsets, self.params)]


class ManualDDP(DDPCore, Joinable):
    """torch.nn.parallel.DistributedDataParallel by hand: DDPCore plus what code written for PyTorch's class uses.

    Takes DDP's arguments, with DDP's defaults and meanings. Where the design makes one moot, it says so here:
    gradients always live in the buckets, so gradient_as_bucket_view and batched_grad_copy change nothing
    (the mean is taken as DDP's default path takes it: times 1/N); dim and check_reduction are unused, as in DDP
    for one device per process; mixed_precision (DDP's experimental, private _MixedPrecision) is not
    implemented: use torch.autocast. Ours: verify=True checks the replicas are identical instead of broadcasting.
    The constructor and the step's methods are the core's, each with DDP's options added; _maybe_rebuild and
    no_sync are the core's own. Why each matches DDP the way it does: docs/manual_ddp.md.
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None, init_sync=True,
                 process_group=None, bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False, delay_all_reduce_named_params=None,
                 param_to_hook_all_reduce=None, mixed_precision=None, device_mesh=None,
                 skip_all_reduce_unused_params=False, bucket_cap_mb_list=None, batched_grad_copy=False,
                 forward_sync_buffers=None, *, verify=False):
        if mixed_precision is not None:
            raise NotImplementedError("ManualDDP has no mixed_precision=: use torch.autocast around forward")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None and device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set together.")
        for cap in [bucket_cap_mb] + list(bucket_cap_mb_list or []):
            if cap is not None and not cap > 0:
                raise ValueError(f"bucket sizes must be positive, got {cap}")
        if broadcast_buffers is not None:  # deprecated in DDP 2.14, which warns the same way
            warnings.warn("broadcast_buffers is deprecated: use forward_sync_buffers"
                          + (" (broadcast_buffers is ignored when both are given)" if forward_sync_buffers is not None
                             else "; note that forward_sync_buffers=False still broadcasts buffers at construction"),
                          FutureWarning, stacklevel=2)
        nn.Module.__init__(self)  # DDPCore's constructor is not called: its steps are below, with DDP's options
        Joinable.__init__(self)
        atexit.unregister(_let_gloo_threads_finish)  # once per process, however many wrappers
        atexit.register(_let_gloo_threads_finish)
        self.static_graph, self.find_unused_parameters = static_graph, find_unused_parameters
        self._init_sync, self._verify = init_sync, verify
        # As in DDP 2.14: forward_sync_buffers, if given, wins (and buffers are broadcast at construction); else
        # broadcast_buffers (default True) rules both the broadcast at construction and the one before every forward.
        self._init_sync_buffers = forward_sync_buffers is not None or broadcast_buffers is not False
        if forward_sync_buffers is None:
            forward_sync_buffers = broadcast_buffers is not False
        self.forward_sync_buffers = forward_sync_buffers
        # Names DDP leaves alone: those the model lists (DDP._set_params_and_buffers_to_ignore_for_model), and the
        # delayed parameters, which travel on their own: one bucket, sent when param_to_hook_all_reduce's gradient
        # is computed (for parameters another parallelism treats first). The trigger is kept in a tuple: as an
        # attribute of its own it would join the wrapper's parameters (and its state_dict), which DDP's does not.
        delayed = dict(delay_all_reduce_named_params or [])
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | set(delayed)
        self._delayed = [_GradBucket(list(delayed.values()), [])] if delayed else []  # zero or one bucket
        self._delay_trigger = (param_to_hook_all_reduce,) if delayed else ()
        named = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        self.names, self.params = [n for n, p in named if p.requires_grad], [p for _, p in named if p.requires_grad]
        devices = {p.device for p in self.params + list(delayed.values())}
        self.device_ids, self.output_device = self._check_device_ids(device_ids, output_device, devices)
        if not self._delayed and not self.params:
            raise RuntimeError(NOTHING_TO_AVERAGE)
        # DDPCore's constructor from here, with the options above.
        self.module, self.process_group = module, process_group or dist.group.WORLD
        if device_mesh is not None:
            self.process_group = device_mesh.get_group(0)
            self.device_mesh = device_mesh  # as DDP: set only when given
        self.world = self._divisor = dist.get_world_size(self.process_group)  # join() may change the divisor
        self.require_backward_grad_sync = self.require_forward_param_sync = True
        self.device = next(module.parameters()).device
        self._sync_module_states([p for _, p in named])
        self._caps = [1 << 20, 25 << 20] if bucket_cap_mb is None else [int(bucket_cap_mb * (1 << 20))]
        if bucket_cap_mb_list:
            self._caps = [int(c * (1 << 20)) for c in bucket_cap_mb_list]
        # bucket_cap_mb_list caps each bucket in turn from the start. With find_unused_parameters the graph may
        # change from one iteration to the next, so DDP cuts the buckets by size at once and never rebuilds them.
        never_rebuilt = find_unused_parameters and not static_graph
        first_caps = self._caps if bucket_cap_mb_list or never_rebuilt else [math.inf]
        self._set_buckets(sorted(bucket_layout(self.params, range(len(self.params)), first_caps), key=min,
                                 reverse=True))
        self._rebuilt, self._order = never_rebuilt, []
        self._next, self._queued = 0, False
        self._register_hooks()
        self.dim, self.gradient_as_bucket_view = dim, gradient_as_bucket_view
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self._first_sizes = ", ".join(str(b.flat.numel() * b.flat.element_size()) for b in self.buckets)
        self._syncs, self._hook = 0, None  # synced backwards so far; the communication hook
        self._used = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        self._unused, self._graph_static = [], True  # find_unused_parameters: for _get_ddp_logging_data
        self._hook_counts = [0] * len(self.params)  # static_graph: hooks per parameter seen in the first backward
        self._divide_by_initial, self._fresh, self._joining = True, set(), False
        # A synced backward that never reached _finish (it raised), or parameters left without a gradient: DDP's
        # errors at the next forward, and the last one for _get_ddp_logging_data.
        self._expect_finish, self._unreduced, self._error = False, [], None

    # -- construction: DDP's options --
    @property
    def buffers_to_sync(self):
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def _sync_module_states(self, params):
        state = params + (self.buffers_to_sync if self._init_sync_buffers else [])
        delayed = self._delayed[0].params if self._delayed else []
        if self._init_sync or self._verify:
            self._check_shapes(state)
        if self._verify:
            self._check_identical(state + delayed)
            return
        if delayed:  # sent even without init_sync, as DDP does
            self._broadcast(delayed, src=0)
        if self._init_sync and self.params:  # DDP skips it when every trained parameter is delayed
            self._broadcast(state, src=0)

    def _broadcast(self, tensors, src):
        broadcast_coalesced(tensors, src, self.process_group)

    def _set_buckets(self, layout):
        """The core's, with buckets that answer what a communication hook asks (index(), is_last(), ...)."""
        grads = [p.grad for p in self.params]
        self.buckets = [_GradBucket([self.params[i] for i in idx], list(idx)) for idx in layout]
        self._where = [None] * len(self.params)
        for k, b in enumerate(self.buckets):
            b._index, b._count = k, len(self.buckets)
            for slot, i in enumerate(b.indices):
                self._where[i] = (b, slot)
                if grads[i] is not None:  # gradients accumulated so far (no_sync) move into the new buckets
                    b.views[slot].copy_(grads[i])
                    self.params[i].grad = b.views[slot]
        self._index_slots()

    def _index_slots(self):
        # id(parameter) -> (bucket, slot), for the tensor hooks, which get the parameter, not its index
        self._slot = {id(p): (b, slot) for b in self.buckets + self._delayed for slot, p in enumerate(b.params)}

    def _register_hooks(self):
        me = weakref.ref(self)
        for i, p in enumerate(self.params):  # the core's
            p.register_post_accumulate_grad_hook(functools.partial(_call, me, "_on_grad_ready", i))
        for p in self.params + (self._delayed[0].params if self._delayed else []):
            p.register_hook(functools.partial(_call, me, "_grad_arriving", p))
        for p in self._delay_trigger:
            p.register_hook(functools.partial(_call, me, "_launch_delayed"))

    def forward(self, *inputs, **kwargs):
        notified = Join.notify_join_context(self)  # inside join(): an all-reduce counting the ranks still training
        if notified is not None:  # as DDP, each iteration: the initial world size, or the ranks still training
            self._divisor = self.world if self._divide_by_initial else int(notified.get_future().wait()[0].item())
        if self._joining:  # tell ranks that have joined whether this backward will communicate
            dist.all_reduce(torch.tensor([float(self.require_backward_grad_sync)], device=self.device),
                            group=self.process_group, async_op=True)
        if torch.is_grad_enabled():
            self._check_prior_reduction()
        if self.device_ids:  # as DDP: inputs move to this process's GPU
            inputs, kwargs = _to_device((inputs, kwargs), torch.device(self.device.type, self.device_ids[0]))
        # The core's forward from here; the buffers DDP syncs, under join() from a rank still training.
        if torch.is_grad_enabled():
            if self.require_backward_grad_sync:
                self._maybe_rebuild()
            self._grads_into_buckets()
        if self.will_sync_module_buffers():
            self._broadcast(self.buffers_to_sync, self._common_rank(True) if self._joining else 0)
        output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        return output

    def _grads_into_buckets(self):
        """Unlike the core, a missing .grad becomes its (zeroed) slot only when its gradient arrives
        (_grad_arriving): a parameter that backward never reaches keeps .grad None, as under DDP."""
        for b in self.buckets + self._delayed:
            missing = [slot for slot, p in enumerate(b.params) if p.grad is None]
            if len(missing) == len(b.params):
                b.flat.zero_()
            else:
                for slot in missing:
                    b.views[slot].zero_()
            b.zeroed = set(missing)
        # The parameters whose .grad this forward created (find_unused_parameters: None again if no rank used them)
        self._fresh = {b.indices[slot] for b in self.buckets for slot in b.zeroed}

    def _grad_arriving(self, p, grad):
        """A tensor hook: runs just before autograd adds p's gradient into p.grad."""
        if p.grad is None and grad is not None:  # an undefined gradient adds nothing: .grad stays None
            bucket, slot = self._slot[id(p)]
            if slot not in bucket.zeroed:  # forward did not zero it (it bypassed the wrapper)
                bucket.views[slot].zero_()
            bucket.zeroed.discard(slot)
            p.grad = bucket.views[slot]
        return grad

    def _on_grad_ready(self, i, p):
        if self.find_unused_parameters and p.grad is not None:  # None: autograd's gradient was undefined
            self._used[i] = 1  # used since the last sync (no_sync micro-steps count too)
        if self.static_graph and self.require_backward_grad_sync:
            self._queue_finish()
            if self._syncs == 0:
                self._hook_counts[i] += 1  # the first backward only counts (reentrant checkpointing fires twice)
                return
            if self._hook_counts[i] == 0:  # worded as DDP's error, which tools and PyTorch's tests match on
                raise self._record(RuntimeError(
                    f"Your training graph has changed in this iteration: {self.names[i]} got a gradient, but none "
                    "in the first iteration, which static_graph=True takes as the graph of every iteration. Use "
                    "static_graph=False (with find_unused_parameters=True if parameters go unused)."))
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
            raise RuntimeError(f"ManualDDP: the gradient of {self.names[i]} became ready twice in one backward "
                               "(reentrant activation checkpointing of a module also used outside it?). Use "
                               "torch.utils.checkpoint(..., use_reentrant=False), or static_graph=True.")
        view = bucket.views[slot]
        if p.grad is None:  # no gradient on this rank (an unused parameter): it counts as zero in the mean
            self._fresh.add(i)
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():  # backward replaced .grad instead of adding into it
            view.copy_(p.grad)
        p.grad = view
        bucket.ready[slot] = True
        bucket.pending -= 1

    def _launch_ready(self):
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b):
        # skip_all_reduce_unused_params: a bucket no parameter of which was used here is not sent (every rank must
        # then skip the same buckets, as DDP requires too).
        if self.skip_all_reduce_unused_params and not self._used[b.indices].any():
            return
        b.set_buffer(b.flat)
        if self._hook is not None:  # a communication hook decides how to average (it divides, not us)
            b.future = self._hook[1](self._hook[0], b)
            return
        b.flat.mul_(1 / self._divisor)  # the core's, with join()'s divisor
        b.work = dist.all_reduce(b.flat, group=self.process_group, async_op=True)
        b.future = b.work.get_future()

    def _finish(self):
        self._unreduced = self._missing()
        for b in self.buckets[self._next:]:  # a gradient that never came (unused here, or static_graph's first
            for slot, ready in enumerate(b.ready):  # backward) counts as zero: every bucket leaves, on every rank
                if not ready:
                    self._mark_ready(b, slot)
        self._launch_ready()
        if self.find_unused_parameters:
            # As DDP, for its logging data: is the set of parameters this rank leaves unused the same every time?
            unused = (self._used == 0).nonzero().flatten().tolist()
            self._graph_static &= self._syncs == 0 or self.static_graph or unused == self._unused
            self._unused = unused
            self._used_work = dist.all_reduce(self._used, group=self.process_group, async_op=True)  # kept: Bucket
            self._used_work.wait()  # which parameters some rank used
        self._queued, self._next = False, 0
        for b in self.buckets + self._delayed:
            self._wait(b)
            b.pending = len(b.params)
        if self.find_unused_parameters:  # as DDP: a parameter no rank used keeps .grad untouched (None)
            for i in (self._used == 0).nonzero().flatten().tolist():
                if i in self._fresh:
                    self.params[i].grad = None
            self._used.zero_()
        for b in self.buckets + self._delayed:
            b.ready, b.zeroed = [False] * len(b.params), set()
        self._syncs, self._expect_finish = self._syncs + 1, False

    def _wait(self, b):
        if b.future is None:
            return  # not sent (skip_all_reduce_unused_params)
        result = b.future.wait()
        result = result[0] if isinstance(result, list) else result
        if result.data_ptr() != b.flat.data_ptr():  # a hook may return another tensor: take its values
            b.flat.copy_(result)
        b.future = None

    # -- DDP's errors for a parameter without a gradient --
    def _missing(self):
        """The parameters that DDP would call unreduced at the end of this backward: without
        find_unused_parameters every one must get a gradient; with static_graph, every one the first backward saw."""
        if self.find_unused_parameters or (self.static_graph and self._syncs == 0):
            return []
        return [i for b in self.buckets for slot, i in enumerate(b.indices)
                if not b.ready[slot] and (not self.static_graph or self._hook_counts[i] > 0)]

    def _check_prior_reduction(self):
        """DDP's check before a forward: the last synced backward must have finished, every gradient reduced."""
        if self._expect_finish:  # that backward raised before its end: its buckets are half done
            self._unreduced, self._expect_finish, self._queued, self._next = self._missing(), False, False, 0
            for b in self.buckets + self._delayed:
                if b.future is not None:
                    b.future.wait()  # the all-reduces already launched, on every rank alike
                b.ready, b.pending, b.future = [False] * len(b.params), len(b.params), None
        if not self._unreduced:
            return
        names = ", ".join(self.names[i] for i in self._unreduced)
        indices = ", ".join(map(str, self._unreduced))
        rank, self._unreduced = dist.get_rank(self.process_group), []
        # Worded as DDP's message (tools and PyTorch's own tests match on its phrases), with the names always.
        if self.static_graph:
            why = ("This error indicates that your training graph has changed in this iteration, e.g., one parameter "
                   "is used in first iteration, but then got unused in the second iteration. this is not compatible "
                   "with static_graph set to True.")
        else:
            why = ("Some parameters got no gradient in the last backward that synchronised: enable unused parameter "
                   "detection by passing the keyword argument `find_unused_parameters=True` to ManualDDP, and make "
                   "sure all `forward` function outputs participate in calculating loss. (PyTorch's DDP names "
                   "them only if you set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or "
                   "DETAIL; ManualDDP always does.)")
        raise self._record(RuntimeError(
            f"Expected to have finished reduction in the prior iteration before starting a new one. {why}\n"
            f"Parameter indices which did not receive grad for rank {rank}: {indices}\n"
            f"Parameters which did not receive grad for rank {rank}: {names}"))

    def _record(self, error):
        self._error = str(error)  # for _get_ddp_logging_data, as DDP logs its errors
        return error

    # -- DDP's constructor checks, buffers, communication hooks, join --
    def _check_device_ids(self, device_ids, output_device, devices):
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        kind = next(iter(devices)).type if len(devices) == 1 else None  # one device: "cuda", say, or "cpu"
        if not device_ids or kind in (None, "cpu"):
            if device_ids or output_device is not None:
                raise ValueError("DistributedDataParallel device_ids and output_device arguments only work with "
                                 "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                                 f"{device_ids}, output_device {output_device}, and module parameters {devices}.")
            return None, None
        index = [torch.device(kind, d).index if isinstance(d, int) else torch.device(d).index for d in device_ids]
        out = index[0] if output_device is None else torch.device(kind, output_device).index
        return index, out

    @property
    def broadcast_buffers(self):
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value):
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self):
        return self.require_forward_param_sync and self.forward_sync_buffers and len(self.buffers_to_sync) > 0

    def _common_rank(self, candidate):
        rank = torch.tensor([dist.get_rank(self.process_group) if candidate else -1], device=self.device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(rank.item())

    def _launch_delayed(self, grad):
        if not self.require_backward_grad_sync:
            return grad
        self._queue_finish()
        bucket = self._delayed[0]
        bucket.flat.mul_(1 / self._divisor)
        bucket.work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)  # kept: see Bucket.work
        bucket.future = bucket.work.get_future()
        return grad

    def register_comm_hook(self, state, hook):
        """DDP's contract: hook(state, bucket) -> torch.futures.Future[Tensor] with the bucket's averaged values."""
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        if self._hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._hook = (state, hook)

    # -- pickling (torch.save(ddp_model), copy.deepcopy), as DDP allows it --
    def __getstate__(self):
        """As DDP: only with the default group (a process group cannot be pickled: the copy gets the default group
        back when loaded); the communication hook is not kept (DDP's lives in its C++ reducer and is lost too)."""
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError("ManualDDP can be pickled only with the default process group (as DDP): a process "
                               "group cannot be pickled")
        state = dict(self.__dict__)
        del state["process_group"]
        state.pop("_used_work", None)
        state["_hook"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        # The copy's parameters are new objects: index them again, and give them hooks (tensors are pickled without)
        self._index_slots()
        self._register_hooks()

    def _get_ddp_logging_data(self):
        """DDP's summary of itself (private, but Lightning's teardown reads it): the keys DDP fills from its
        arguments and buckets, from this wrapper's real state. DDP's timings are not measured here, so absent."""
        data = {
            "module_name": type(self.module).__name__, "backend_name": dist.get_backend(self.process_group),
            "world_size": self.world, "rank": dist.get_rank(self.process_group),
            "device_ids": ", ".join(map(str, self.device_ids or [])),
            "output_device": -1 if self.output_device is None else self.output_device,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())),
            "is_multi_device_module": 0,
            "num_parameter_tensors": len(self.params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in self.params),
            "dtypes": ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in self.params})),
            "bucket_cap_bytes": self._caps[-1],
            "bucket_sizes": self._first_sizes,
            "has_rebuilt_buckets": int(self._rebuilt and not (self.find_unused_parameters and not self.static_graph)),
        }
        if data["has_rebuilt_buckets"]:
            data["rebuilt_bucket_sizes"] = ", ".join(str(b.flat.numel() * b.flat.element_size()) for b in self.buckets)
        if self.static_graph:  # these three, as DDP, only once they apply
            data["static_graph"] = 1
        if self._joining:
            data["join_uneven_inputs"] = 1
        if self._hook is not None:
            data["comm_hook"] = getattr(self._hook[1], "__qualname__", repr(self._hook[1]))
        # DDP writes this key while training only once the graph proved dynamic (the set of unused parameters
        # changed between iterations); a static graph is reported when DDP is destroyed.
        if not self._graph_static:
            data["can_set_static_graph"] = 0
        if self._error is not None:  # as DDP after it raised
            data.update(iteration=self._syncs, has_error=1, error=self._error)
        return data

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """Uneven inputs: a rank out of data shadows the others' collectives with zeros until all are done."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def _check_shapes(self, state):
        """As DDP: every rank must hold the same tensors (count, shapes, dtypes) before anything is broadcast."""
        mine = [(tuple(t.shape), str(t.dtype)) for t in state]
        theirs = [mine]
        dist.broadcast_object_list(theirs, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        differs = torch.tensor([float(theirs[0] != mine)], device=self.device)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=self.process_group)  # all raise, or none
        if differs.item():
            raise RuntimeError("DistributedDataParallel: the model differs across ranks (number, shapes or dtypes of "
                               "its parameters and buffers): build the same model on every rank")

    def _check_identical(self, state):
        differs = torch.zeros(1, device=self.device)
        for t in state:
            ref = t.detach().clone()
            dist.broadcast(ref, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
            differs += 0 if torch.equal(ref, t.detach()) else 1
        # Agree on the verdict first: if only some ranks raised, the others would wait in the next collective.
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=self.process_group)
        if differs.item():
            raise ValueError("ManualDDP(verify=True): model replicas differ across ranks; seed model creation "
                             "identically on every rank (torch.manual_seed before building it)")


class _JoinHook(JoinHook):
    """A rank that ran out of data mirrors every collective the others still issue, with zeros for gradients."""

    def __init__(self, ddp, divide_by_initial_world_size):
        self.ddp = ddp
        ddp._divide_by_initial, ddp._joining = divide_by_initial_world_size, True  # from here on, as in DDP

    def main_hook(self):
        ddp = self.ddp
        flag = torch.zeros(1, device=ddp.device)  # will the others synchronize this backward?
        dist.all_reduce(flag, group=ddp.process_group)
        if flag.item():
            ddp._maybe_rebuild()
        if ddp.require_forward_param_sync and ddp.forward_sync_buffers and ddp.buffers_to_sync:
            ddp._broadcast(ddp.buffers_to_sync, ddp._common_rank(False))  # the ranks training take the same
        ddp.require_forward_param_sync = bool(flag.item())
        if not flag.item():
            return
        for b in ddp.buckets:
            b.flat.zero_()
            ddp._launch(b)
        for b in ddp.buckets:
            if b.future is not None:
                b.future.wait()
                b.future = None
        if ddp.find_unused_parameters:
            dist.all_reduce(torch.zeros_like(ddp._used), group=ddp.process_group)
        if not ddp._rebuilt and not ddp._order:
            ddp._order = list(range(len(ddp.params)))  # as DDP: a joined rank offers parameter order

    def post_hook(self, is_last_joiner):
        """Everyone ends with the model of a rank that trained last."""
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


def bf16_compress_hook(process_group, bucket):
    """A DDP communication hook, by hand: each bucket travels as bfloat16, half the bytes of float32.

    Divide first (in float32: a sum of fp16/bf16 gradients could overflow where their mean would not), cast,
    all-reduce the sum, and cast back into the bucket. Runs on ManualDDP and on PyTorch's DDP alike.
    """
    group = process_group or dist.group.WORLD
    compressed = bucket.buffer().div(group.size()).to(torch.bfloat16)
    sent = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        return bucket.buffer().copy_(fut.value()[0])
    return sent.then(decompress)
