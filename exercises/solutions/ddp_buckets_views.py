"""Another correct DDPCore. Each .grad is a view into its bucket's flat buffer: no copies.

The hook points .grad back into the buffer after zero_grad() set it to None. Each all-reduce's
future is waited for at the end of backward."""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


class DDPCore(nn.Module):
    def __init__(self, module, process_group=None, bucket_cap_mb=None, broadcast_buffers=True):
        super().__init__()
        self.module, self.world = module, dist.get_world_size()
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)
        cap, size, self.buckets = (bucket_cap_mb or 25) * 2**20, 0, [[]]
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            if size >= cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.flats = [torch.zeros(sum(p.numel() for p in ps)) for ps in self.buckets]
        self.views = {}
        for ps, flat in zip(self.buckets, self.flats):
            for p, v in zip(ps, flat.split([p.numel() for p in ps])):
                self.views[p] = v.view_as(p)
                p.register_post_accumulate_grad_hook(self._ready)
        self.bucket_of = {p: k for k, ps in enumerate(self.buckets) for p in ps}
        self.sync, self.pending, self.next, self.futures = True, None, 0, []

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _ready(self, p):
        view = self.views[p]
        if p.grad.data_ptr() != view.data_ptr():  # a new .grad, after zero_grad(): point it back
            view.copy_(p.grad)
            p.grad = view
        if not self.sync:
            return
        if self.pending is None:
            self.pending = [len(ps) for ps in self.buckets]
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self.pending[self.bucket_of[p]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            flat = self.flats[self.next]
            flat.mul_(1 / self.world)
            self.futures.append(dist.all_reduce(flat, async_op=True).get_future())
            self.next += 1

    def _finish(self):
        torch.futures.wait_all(self.futures)
        self.pending, self.next, self.futures = None, 0, []
