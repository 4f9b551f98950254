"""A participant's DDPCore, as the stub asks. The tests plant mistakes in a copy of it."""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


class DDPCore(nn.Module):
    def __init__(self, module, process_group=None, bucket_cap_mb=None, broadcast_buffers=True):
        super().__init__()
        self.module, self.group = module, process_group
        self.world = dist.get_world_size(process_group)
        for t in list(module.parameters()) + (list(module.buffers()) if broadcast_buffers else []):
            src = dist.get_global_rank(process_group or dist.group.WORLD, 0)
            dist.broadcast(t.data, src=src, group=process_group)
        cap = (25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20
        # each bucket: [parameters, flat buffer, gradients still to come]
        self.buckets, names, size = [], [], 0
        params = [p for p in module.parameters() if p.requires_grad]
        for p in reversed(params):  # backward produces the last layer's gradients first
            names.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(names)
                names, size = [], 0
        if names:
            self.buckets.append(names)
        self.buckets = [[ps, torch.zeros(sum(p.numel() for p in ps)), len(ps)]
                        for ps in self.buckets]
        self.where = {p: k for k, (ps, _, _) in enumerate(self.buckets) for p in ps}
        self.sync, self.next, self.works, self.queued = True, 0, [], False
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

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
        if not self.sync:
            return
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self.buckets[self.where[p]][2] -= 1
        # strictly in bucket order
        while self.next < len(self.buckets) and self.buckets[self.next][2] == 0:
            ps, flat, _ = self.buckets[self.next]
            torch.cat([q.grad.reshape(-1) for q in ps], out=flat)
            flat.mul_(1 / self.world)  # 1/N before the sum, as DDP
            self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            self.next += 1

    def _finish(self):
        for work, (ps, flat, _) in zip(self.works, self.buckets):
            work.wait()
            for q, g in zip(ps, flat.split([q.numel() for q in ps])):
                q.grad.copy_(g.view_as(q))
        for bucket in self.buckets:
            bucket[2] = len(bucket[0])
        self.next, self.works, self.queued = 0, [], False
