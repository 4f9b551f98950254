"""Run under torchrun (2 ranks), with a folder to write in: 06's own main() trains as one process would, on
the same data, and resumes bit for bit.

06 runs here as a user runs it (its flags, its sampler, its Trainer), with two things watched: which training
images each rank fetches, and what rank 0 prints. Then every rank checks four properties against a reference
that does not use 06's loop:
- each rank reads, every epoch, its own share of DistributedSampler's order for that epoch (set_epoch);
- the weights after training equal one process's SGD on the mean of the per-rank gradients. BatchNorm
  normalises with the statistics of each rank's own batch, so the mean of per-rank gradients, not one big
  batch, is the right reference (checked to differ, so that the test cannot pass by accident);
- each printed training loss is the mean over every rank's samples, not rank 0's alone (checked to differ);
- the printed validation loss, accuracy and count are one process's over the whole set, each image once: 7
  images on 2 ranks, which the sampler pads to 8 by repeating image 0, which the model gets right.
Then 06 runs again as a user would run it again: resumed from epoch 1's checkpoint alone, it ends with the
uninterrupted run's checkpoint, bit for bit; asked again, the finished run trains nothing.

  torchrun --nproc_per_node=2 tests/workers/resnet_worker.py FOLDER
"""

import contextlib
import io
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_script  # noqa: E402

ARGS = ["--dataset", "fake", "--fake-size", "29", "--max-train-samples", "8", "--batch-size", "2", "--epochs", "2",
        "--seed", "1", "--lr", "0.02", "--device", "cpu", "--timeout-s", "60"]  # a planted hang fails in a minute
lesson = load_script("06_torch_ddp_resnet.py")
Digits = lesson.SyntheticDigits
fetched, trainers = [], []


class Watched(Digits):
    def __getitem__(self, i):
        fetched.append((self.offset, int(i)))  # offset 0: a training image
        return super().__getitem__(i)


class Kept(lesson.Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        trainers.append(self)


def shares(n, world, args, epoch):
    """Each rank's training indices in this epoch, as DistributedSampler with set_epoch deals them, cut to
    whole batches."""
    out = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
                                     drop_last=True)
        sampler.set_epoch(epoch)
        idx = list(sampler)
        out.append(idx[:len(idx) // args.batch_size * args.batch_size])
    return out


def batch_of(data, idx):
    images, labels = zip(*(data[i] for i in idx))
    return torch.stack(images), torch.tensor(labels)


def reference(args, world, data, n, val, whole_batch=False):
    """One process: SGD with 06's settings on the mean of each rank's gradient (or on one batch of all ranks'
    samples), on the first n images. BatchNorm's running statistics follow rank 0's batches alone, as DDP's
    do: it hands every rank rank 0's before each forward. Returns the model and, per epoch, the mean training
    loss over all ranks and over rank 0 alone, and the loss and accuracy over all of val."""
    torch.manual_seed(args.seed)
    model = lesson.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=lesson.SGD_MOMENTUM,
                          weight_decay=lesson.WEIGHT_DECAY)
    steps = len(shares(n, world, args, 0)[0]) // args.batch_size
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lesson.one_cycle(s, args.epochs * steps))
    vx, vy = batch_of(val, range(len(val)))
    epochs = []
    for epoch in range(args.epochs):
        order, sums = shares(n, world, args, epoch), torch.zeros(world)
        model.train()
        for step in range(steps):
            parts = [order[r][step * args.batch_size:(step + 1) * args.batch_size] for r in range(world)]
            for rank, idx in enumerate([sum(parts, [])] if whole_batch else parts):
                rank0s = [b.clone() for b in model.buffers()]
                x, y = batch_of(data, idx)
                loss = F.cross_entropy(model(x), y)
                (loss if whole_batch else loss / world).backward()
                sums[rank] += loss.item()
                if rank:
                    torch._foreach_copy_(list(model.buffers()), rank0s)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            logits = model.eval()(vx)
        epochs.append(((sums.sum() / (world * steps)).item(), (sums[0] / steps).item(),
                       F.cross_entropy(logits, vy).item(), (logits.argmax(1) == vy).float().mean().item(),
                       logits.argmax(1)))
    return model, epochs


def run(args, out):
    """06's main() on --out `out`, as a user runs it; what rank 0 printed, echoed. A second run keeps the group
    the first one joined (joining again under one torchrun would meet the first join's stale addresses)."""
    if dist.is_initialized():
        lesson.setup = lambda args: torch.device("cpu")
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        lesson.main(lesson.parse_args([*ARGS, "--out", str(out)]))
    print(said.getvalue(), end="", flush=True)
    return said.getvalue()


def same(a, b):
    """Equal through the dicts and lists of a checkpoint, tensors bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def main():
    folder = Path(sys.argv[1])
    args = lesson.parse_args(ARGS)
    lesson.SyntheticDigits, lesson.Trainer = Watched, Kept
    said = run(args, folder / "whole")  # joins the group (torchrun's variables), trains, checks its replicas
    rank, world = dist.get_rank(), dist.get_world_size()
    train, val = Digits(args.fake_size, 0), Digits(args.fake_size // 4, args.fake_size)

    # 1. The order: this rank's share of DistributedSampler's permutation for each epoch, a new one each epoch.
    read = [i for offset, i in fetched if offset == 0]
    wanted = [shares(args.max_train_samples, world, args, epoch)[rank] for epoch in range(args.epochs)]
    assert read == sum(wanted, []), f"rank {rank} read {read}, DistributedSampler deals {wanted}"
    assert wanted[0] != wanted[1], "set_epoch must change the order (the check above could not fail)"

    # 2. The weights and BatchNorm's statistics: one process's SGD on the mean of the per-rank gradients.
    ours = trainers[0].model.state_dict()
    ref, epochs = reference(args, world, train, args.max_train_samples, val)
    gap = max((ours[k].double() - v.double()).abs().max().item() for k, v in ref.state_dict().items())
    assert gap < 1e-5, f"06's weights are {gap:.1e} from the reference"
    whole, _ = reference(args, world, train, args.max_train_samples, val, whole_batch=True)
    apart = max((a - b).abs().max().item() for a, b in zip(whole.parameters(), ref.parameters()))
    assert apart > 100 * gap, "one big batch should differ from the mean of per-rank gradients"

    if rank == 0:
        printed = [[float(v) for v in found] for found in re.findall(
            r"^epoch +\d+/\d+ \| train loss ([\d.]+) \| val loss ([\d.]+) \| val acc ([\d.]+) \((\d+) samples\)",
            said, re.M)]
        assert len(printed) == args.epochs, said
        for (train_loss, val_loss, val_acc, count), (everyone, _, loss, acc, _) in zip(printed, epochs):
            # 3. The training loss of every rank's samples, not rank 0's alone.
            assert abs(train_loss - everyone) < 2e-4, (train_loss, everyone)
            # 4. Validation over all 7 images, each once.
            assert count == len(val) == 7 and abs(val_loss - loss) < 2e-4 and abs(val_acc - acc) < 1e-4, \
                (val_loss, val_acc, count, loss, acc)
        # The checks above could fail: rank 0's loss differs, and image 0, the repeat, is right once.
        assert max(abs(everyone - rank0) for everyone, rank0, *_ in epochs) > 1e-3, "rank 0's loss is no test"
        assert epochs[-1][4][0] == val[0][1] and epochs[-1][3] > 0, "counting the repeat twice would not show"
        print(f"OK 06 on {world} ranks: DistributedSampler's order each epoch, weights within {gap:.0e} of one "
              "process, the loss of all ranks, validation over the whole set once", flush=True)

    # 5. Resumed on 2 ranks from epoch 1's checkpoint alone, the run ends where the uninterrupted one ended: the
    # weights, BatchNorm's statistics, SGD's momentum, the schedule's step, bit for bit. Rank 0 picks the
    # checkpoint, and every rank must resume from it.
    whole, resumed = folder / "whole", folder / "resumed"
    if rank == 0:
        resumed.mkdir()
        shutil.copy(whole / "checkpoint-1.pt", resumed)
    dist.barrier()
    said = run(args, resumed)
    if rank == 0:
        assert f"resumed from {resumed}/checkpoint-1.pt after epoch 1" in said and "epoch   1/2" not in said, said
        a, b = (torch.load(f / "checkpoint-2.pt") for f in (whole, resumed))
        assert set(a) == {"model", "optimizer", "scheduler", "epoch", "script"} and a["epoch"] == 2, a.keys()
        assert same(a, b), "the resumed run ended elsewhere than the uninterrupted one"
        lesson.build_model().load_state_dict(a["model"])  # no "module." prefix: the bare model loads it
    # 6. Asked again, the finished run says so, trains nothing and changes no file.
    before = sorted((p.name, p.stat().st_mtime_ns) for p in whole.iterdir())
    said = run(args, whole)
    if rank == 0:
        assert said.splitlines()[-1].startswith(f"OK nothing to train: {whole} holds epoch 2 of --epochs 2"), said
        assert "train loss" not in said and sorted((p.name, p.stat().st_mtime_ns) for p in whole.iterdir()) == before
        print(f"OK 06 on {world} ranks resumes bit for bit, and a finished run trains nothing", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
