"""Run under torchrun (2 ranks): 06's own main() trains as one process would, on the same data.

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
"""

import contextlib
import io
import os
import re
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import load_script  # noqa: E402

ARGS = ["--dataset", "fake", "--fake-size", "29", "--max-train-samples", "8", "--batch-size", "2", "--epochs", "2",
        "--seed", "1", "--lr", "0.02", "--device", "cpu"]
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


def main():
    args = lesson.parse_args(ARGS)
    lesson.SyntheticDigits, lesson.Trainer = Watched, Kept
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        lesson.main(args)  # joins the group (torchrun's variables), trains, checks its replicas
    said = said.getvalue()
    print(said, end="", flush=True)
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
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
