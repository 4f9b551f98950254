"""04 - DistributedSampler by hand. Which samples each rank sees, and padding that fools metrics.

It teaches four things, in this order.
  1. How the sampler shards the data. All ranks shuffle with one shared seed, so they agree on the
     order. Rank r then takes every N-th index, from index r. The indices equal torch's.
  2. Padding. The first samples repeat so that every rank gets as many, or drop_last cuts the tail.
  3. set_epoch. Without it, every epoch replays the same order. Break it with --no-set-epoch.
  4. A pitfall. The repeats count twice in an accuracy summed over the ranks. Then the fix.

Run it on the CPU with 2 ranks or more, or on N GPUs:
  torchrun --nproc_per_node=2 04_sampler.py [--no-set-epoch]
  torchrun --nproc_per_node=N 04_sampler.py   # on N GPUs, one per rank, with NCCL
On 2 nodes of G processes each, run this on node K = 0 and on node K = 1:
  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST 04_sampler.py
"""

import argparse
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.utils.data


# --- the idea: a distributed sampler ---
class DistributedSampler(torch.utils.data.Sampler):
    """Shard a dataset's indices across num_replicas ranks, as torch's sampler does."""
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
                 drop_last=False):
        # The defaults come from the process group, so a torchrun job needs no arguments.
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {num_replicas - 1}]")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        n = len(dataset)
        # Every rank must get as many samples. Otherwise one rank runs an extra step, and its
        # all-reduce waits for peers that never come. So drop the tail, or pad with repeats.
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        """Call it before each epoch. The seed is seed + epoch, so without it the order repeats."""
        self.epoch = epoch

    def __iter__(self):
        n = len(self.dataset)
        indices = list(range(n))
        if self.shuffle:
            # One seed on every rank gives every rank the same order, and each takes its own slice.
            # A seed per rank would make the slices overlap and miss samples.
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        # Pad by cycling through the shuffled list from its start. These are the repeats. With
        # drop_last there is nothing to pad, and the slice below leaves out the tail.
        indices += [indices[i % n] for i in range(self.total_size - n)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])  # Every N-th.

    def __len__(self):
        return self.num_samples


# --- the demo ---
def gather(obj):  # Every rank's obj, on every rank, in rank order.
    out = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


def log_in_rank_order(line):  # Rank 0 prints every rank's line, in rank order, so none race.
    for r, text in enumerate(gather(line)):
        print0(f"[rank {r}/{WORLD}] {text}")


def main(args):
    if WORLD < 2:  # One rank takes the whole dataset. There is nothing to shard and nothing to pad.
        raise UsageError("this lesson needs 2 or more ranks, so launch with torchrun, "
                         "e.g. torchrun --nproc_per_node=2 04_sampler.py")
    device = setup(args)  # RANK and WORLD come from torchrun's environment, as 01 shows.
    data = list(range(args.dataset_size))

    # 1. Ours against torch's, shuffled or in order, with drop_last or not, in two epochs.
    for drop_last, shuffle in [(False, True), (True, True), (False, False), (True, False)]:
        ours = DistributedSampler(data, shuffle=shuffle, seed=args.seed, drop_last=drop_last)
        ref = torch.utils.data.DistributedSampler(data, shuffle=shuffle, seed=args.seed,
                                                  drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref) and len(ours) == len(ref), (drop_last, epoch)
    sampler = DistributedSampler(data, seed=args.seed)
    log_in_rank_order(f"epoch 0 indices: {list(sampler)}  (== torch's)")

    # 2. The padding. All ranks together see total_size samples, so some come twice.
    everyone = sum(gather(list(sampler)), [])
    dupes = sorted({i for i in everyone if everyone.count(i) > 1})
    print0(f"padding: {sampler.total_size} slots for {len(data)} samples -> seen twice: {dupes}")
    used = sum(gather(list(DistributedSampler(data, seed=args.seed, drop_last=True))), [])
    print0(f"drop_last=True instead: {len(set(used))} samples used, never seen this epoch: "
           f"{sorted(set(data) - set(used))}")

    # 3. set_epoch. The seed is seed + epoch, so the loop tells the sampler the epoch.
    orders = []
    for epoch in range(3):
        if not args.no_set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
        log_in_rank_order(f"epoch {epoch}: {orders[-1]}")
    if args.no_set_epoch:  # Break it. Every rank checks that each epoch replayed epoch 0's order.
        assert all(gather(orders == [orders[0]] * 3)), "an epoch changed the order"
        print0("without set_epoch the epoch stays 0, so seed + epoch and the order never change")
        print0("OK --no-set-epoch showed the bug. Call sampler.set_epoch(epoch) before each epoch.")
        return

    # 4. Evaluation reads in order, padded alike. Say the model is right unless 3 divides the index.
    evaluation = DistributedSampler(data, shuffle=False)
    correct = torch.tensor([float(i % 3 != 0) for i in evaluation], device=device)
    # The fix. Slot k of rank r is position k*N + r of the padded list. Mask from len(data) on.
    real = (torch.arange(len(correct), device=device) * WORLD + RANK < len(data)).float()
    # Count naively, with repeats twice, then with the padding masked. SUM over the ranks, then
    # divide once. A mean of the ranks' means would be wrong too.
    counts = torch.stack([correct.sum(), torch.ones_like(correct).sum(), (correct * real).sum(),
                          real.sum()])
    dist.all_reduce(counts)
    naive, fixed = counts[0] / counts[1], counts[2] / counts[3]
    exact = sum(i % 3 != 0 for i in data) / len(data)
    assert abs(fixed.item() - exact) < 1e-6, (fixed, exact)
    seen = sum(gather(list(evaluation)), [])
    print0(f"evaluation in order: seen twice: {sorted({i for i in seen if seen.count(i) > 1})}")
    print0(f"accuracy: exact {exact:.4f} | naive distributed {naive:.4f} over {counts[1]:.0f} "
           f"samples | padding masked {fixed:.4f} over {counts[3]:.0f} samples")
    print0(f"OK DistributedSampler equals torch's on {WORLD} ranks; padded evaluation fixed")


# --- plumbing the lesson calls: flags ---
def parse_args():
    p = Parser(__doc__)
    p.add_argument("--dataset-size", type=at_least(1), default=11, help="samples (try N+1)")
    p.add_argument("--seed", type=at_least(0, below=2**32), default=0, help="the shuffle's seed")
    p.add_argument("--no-set-epoch", action="store_true", help="break it: never call set_epoch")
    return p.parse_args()


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
