"""04 - DistributedSampler by hand: which samples each rank sees, and the padding that fools your metrics.

What it teaches, in order:
  1. DistributedSampler: shuffle with one seed shared by all ranks (so they agree on the permutation), pad it to a
     multiple of N, and give rank r every N-th index from r: the indices of torch's, checked on every rank;
  2. the padding: the first samples repeat so every rank gets as many batches (drop_last drops the tail instead);
  3. set_epoch: without it every epoch replays the same order (break it: --no-set-epoch);
  4. the evaluation pitfall: the padded duplicates are counted twice in a distributed accuracy, and the fix.

Run it (any N >= 2):
  CPU:      torchrun --nproc_per_node=3 04_sampler.py [--no-set-epoch]
  N GPUs:   torchrun --nproc_per_node=N 04_sampler.py        (nccl, one GPU per rank)
  2 nodes:  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 04_sampler.py
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
    """Shard ``dataset``'s indices across ``num_replicas`` ranks; the same indices as torch's sampler."""
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        # Defaults come from the process group, so inside a torchrun job no arguments are needed.
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        n = len(dataset)
        # Every rank must get the same number of samples, or the ranks would run different numbers of steps and
        # the gradient all-reduce of the extra step would wait forever: drop the tail, or pad with repeats.
        self.num_samples = n // num_replicas if drop_last else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        """Call before each epoch: the shuffle seed is seed + epoch, so forgetting this repeats the order."""
        self.epoch = epoch

    def __iter__(self):
        n = len(self.dataset)
        indices = list(range(n))
        if self.shuffle:
            # A generator seeded identically on every rank gives every rank the same permutation; the ranks
            # then take disjoint slices of it. (A per-rank seed here would overlap and miss samples.)
            indices = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        # Pad by cycling through the (shuffled) list from its start: these are the duplicates. With drop_last
        # there is nothing to pad (total_size <= n), and the slice below leaves out the tail.
        indices += [indices[i % n] for i in range(self.total_size - n)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])  # every N-th, from our rank

    def __len__(self):
        return self.num_samples


# --- the demo ---
def gather(obj):  # every rank's obj, on every rank, in rank order
    out = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


def log_in_rank_order(line):  # rank 0 prints every rank's line, in rank order: lines each rank printed would race
    for r, text in enumerate(gather(line)):
        print0(f"[rank {r}/{WORLD}] {text}")


def main(args):
    if WORLD < 2:  # one rank takes the whole dataset: nothing to shard, no padding to see
        raise UsageError("needs 2 or more ranks: launch with torchrun, e.g. torchrun --nproc_per_node=2 04_sampler.py")
    device = setup(args)  # RANK and WORLD come from torchrun's environment (01 shows them)
    data = list(range(args.dataset_size))

    # 1. Ours against torch's, for both drop_last settings and two epochs, on every rank.
    for drop_last in (False, True):
        ours = DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=drop_last)
        ref = torch.utils.data.DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref) and len(ours) == len(ref), (drop_last, epoch)
    log_in_rank_order(f"epoch 0 indices: {list(DistributedSampler(data, seed=args.seed))}  (== torch's)")

    # 2. Padding: all ranks together see total_size samples, some twice (or, with drop_last, some never).
    sampler = DistributedSampler(data, seed=args.seed)
    everyone = sum(gather(list(sampler)), [])
    dupes = sorted({i for i in everyone if everyone.count(i) > 1})
    print0(f"padding: {sampler.total_size} slots for {len(data)} samples -> seen twice: {dupes}")
    dropped = sorted(set(data) - set(sum(gather(list(DistributedSampler(data, seed=args.seed, drop_last=True))), [])))
    print0(f"drop_last=True instead: {len(data) - len(dropped)} samples used, never seen this epoch: {dropped}")

    # 3. set_epoch: the shuffle seed is seed + epoch, so the loop tells the sampler the epoch, on every rank alike.
    for epoch in range(3):
        if not args.no_set_epoch:
            sampler.set_epoch(epoch)
        log_in_rank_order(f"epoch {epoch}: {list(sampler)}")
    if args.no_set_epoch:
        raise UsageError("every epoch replayed epoch 0's order, on every rank: the sampler shuffles with seed + epoch, "
                         "and without set_epoch its epoch stays 0; call sampler.set_epoch(epoch) before each epoch")

    # 4. Evaluation (of any epoch's order). Pretend the model is right on every index that is not a multiple of 3.
    correct = torch.tensor([float(i % 3 != 0) for i in sampler], device=device)
    # The fix: slot k of rank r is position k*N + r of the padded list; positions >= len(data) are padding.
    real = torch.tensor([k * WORLD + RANK < len(data) for k in range(len(correct))], dtype=torch.float32, device=device)
    # Naive (duplicates count twice), then masked: SUM the counts, divide once (a mean of per-rank means is wrong too).
    counts = torch.stack([correct.sum(), torch.ones_like(correct).sum(), (correct * real).sum(), real.sum()])
    dist.all_reduce(counts)
    naive, fixed, exact = counts[0] / counts[1], counts[2] / counts[3], sum(i % 3 != 0 for i in data) / len(data)
    assert abs(fixed.item() - exact) < 1e-6, (fixed, exact)
    print0(f"accuracy: exact {exact:.4f} | naive distributed {naive:.4f} over {counts[1]:.0f} samples "
           f"| padding masked {fixed:.4f} over {counts[3]:.0f} samples")
    print0(f"OK DistributedSampler equals torch's on {WORLD} ranks; padded evaluation fixed")


# --- plumbing the lesson calls: flags ---
def parse_args():
    p = Parser(__doc__)
    p.add_argument("--dataset-size", type=at_least(1), default=11, help="samples in the toy dataset (try N+1)")
    p.add_argument("--seed", type=at_least(0, below=2**32), default=0, help="shuffle seed, shared by all ranks")
    p.add_argument("--no-set-epoch", action="store_true", help="break it: never call set_epoch, see what repeats")
    return p.parse_args()


# --- setup: the same block in every numbered script, copied so that each file runs alone ---
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # from torchrun


class UsageError(Exception): ...  # a bad flag or input: one `error:` line (run()), exit status 2


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


def run(main, parse_args):  # a dead peer ends in the library's timeout error, never a hang
    try:
        main(parse_args())
    except UsageError as e:  # every rank stops alike, with exit status 2. Rank 0 says why.
        print0(f"error: {e}")
        os._exit(2)  # at once: tearing down a live group can abort in gloo's threads (SIGABRT)
    dist.destroy_process_group()  # main() always joins the group first
    time.sleep(0.05)  # gloo's threads drop their last tensors before exit, or it can abort


if __name__ == "__main__":
    run(main, parse_args)
