"""Run under torchrun (2 ranks): 05's --compile (each transformer block, and the loss, compiled on its own) for every
--impl.

Losses equal eager ones (within float tolerance: compiled kernels may fuse and round differently), replicas stay
identical, and with DDPCore (the default run's) and ManualDDP a bucket still goes out while backward runs: before
the first block's backward has produced the gradient of that block's input, which is the last backward compute
of the whole graph but the embedding's. The aot_eager backend compiles the same graphs as inductor (dynamo + AOT
autograd) without generating kernels, so this runs in seconds; inductor itself (a C++ compiler on CPU, minutes)
is left to the GPU tier and benchmarks/ddp_step.py --compile.
"""

import copy
import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import identical_across_ranks, load_script  # noqa: E402

lesson = load_script("05_manual_ddp_gpt2.py")
dropin = load_script("ddp_dropin.py")
TINY = ["--seq-len", "32", "--batch-size", "4", "--device", "cpu"]
BUCKET_MB = 0.05  # several buckets, so that some can go out early


def batch(step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randint(0, 257, (4, 33), generator=g)


def watch_input(events, module, inputs):
    """A forward pre-hook: note when backward has computed the gradient of this module's input."""
    inputs[0].register_hook(lambda grad: events.append("block 0 backward done"))


def manual_ddp_with_bf16_hook(model):
    ddp = dropin.ManualDDP(model, bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(None, dropin.bf16_compress_hook)
    return ddp


def train(base, impl, compiled, args, steps=2, events=None, wrap=None):
    model, loss_fn = copy.deepcopy(base), lesson.cross_entropy
    if compiled:  # as 05's --compile: each block, and the loss, a region of its own
        lesson.compile_blocks(model, backend="aot_eager")
        loss_fn = torch.compile(lesson.cross_entropy, backend="aot_eager")
    ddp = wrap(model) if wrap else lesson.wrap(model, impl, torch.device("cpu"), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        if events is not None and step == steps - 1:  # the last step: record what happens in which order
            model.transformer.h[0].register_forward_pre_hook(functools.partial(watch_input, events))
            events.clear()
        data = batch(step)
        loss = lesson.next_token_loss(ddp, data, args, loss_fn)
        loss.backward()
        if impl == "naive":
            lesson.average_gradients(model, dist.get_world_size())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert identical_across_ranks(list(model.parameters())), f"{impl}, compiled={compiled}: replicas differ"
    return losses


def main():
    dist.init_process_group("gloo")
    args = lesson.parse_args(TINY)
    _, base = lesson.build_model(args)
    for impl in ("manual", "naive", "torch"):
        eager, compiled = train(base, impl, False, args), train(base, impl, True, args)
        assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(eager, compiled)), (impl, eager, compiled)
    sent = {}
    # The default run's DDPCore, and ManualDDP with a communication hook: each keeps the overlap under compile.
    for cls, wrap in ((lesson.DDPCore, None), (dropin.ManualDDP, manual_ddp_with_bf16_hook)):
        events, launch = [], cls._launch

        def recorded_launch(self, bucket, events=events, launch=launch):
            events.append(f"bucket {self.buckets.index(bucket)} sent")
            return launch(self, bucket)
        cls._launch = recorded_launch
        try:
            train(base, "manual", True, args, events=events, wrap=wrap)
        finally:
            cls._launch = launch
        assert events.index("block 0 backward done") > 0, f"{cls.__name__}: no bucket out during backward: {events}"
        sent[cls.__name__] = events
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"OK --compile: losses as eager for manual, naive, torch; buckets sent during backward: {sent}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
