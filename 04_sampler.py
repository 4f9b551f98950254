"""04 - DistributedSampler by hand: which samples each rank sees, and the padding that fools your metrics.

What it teaches, in order:
  1. DistributedSampler: shuffle with one seed shared by all ranks (so they agree on the permutation), pad it
     to a multiple of N, and give rank r every N-th index starting at r. Ours yields exactly the indices of
     torch.utils.data.DistributedSampler, checked on every rank;
  2. the padding: the first few samples are repeated so every rank gets the same number of batches (or,
     with drop_last, the tail is dropped);
  3. set_epoch: without it every epoch replays the same order (break it: --no-set-epoch shows that, then stops
     with the one-line error that explains it);
  4. the evaluation pitfall: the padded duplicates are counted twice in a distributed accuracy, and the fix.

Run it (any N >= 2):
  CPU:      torchrun --nproc_per_node=3 04_sampler.py [--no-set-epoch]
  N GPUs:   torchrun --nproc_per_node=N 04_sampler.py        (nccl, one GPU per rank)
  2 nodes:  torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 04_sampler.py
"""

import argparse
import collections
import math
import os
import signal
import sys
import time
import traceback
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
        # Every rank must get the same number of samples, or the ranks would run different numbers of
        # steps and the gradient all-reduce of the extra step would wait forever. So either drop the tail
        # (round down) or pad with repeats (round up).
        if drop_last and n % num_replicas:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        """Call before each epoch: the shuffle seed is seed + epoch, so forgetting this repeats the order."""
        self.epoch = epoch

    def __iter__(self):
        n = len(self.dataset)
        if self.shuffle:
            # A generator seeded identically on every rank gives every rank the same permutation; the ranks
            # then take disjoint slices of it. (A per-rank seed here would overlap and miss samples.)
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            # Pad by cycling through the (shuffled) list from its start: these are the duplicates.
            indices += [indices[i % n] for i in range(self.total_size - n)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])  # every N-th, from our rank

    def __len__(self):
        return self.num_samples


# --- the demo ---
def gather(obj):
    out = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


def check_memory(nbytes, what, device):
    """One line before the work if `what` cannot fit: `nbytes`, a lower bound of what it needs, against this rank's
    share of its device's free memory (a node's RAM and a shared GPU are split between their ranks)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device.type == "cuda":
        free, sharing = torch.cuda.mem_get_info(device)[0], -(-local_world // torch.cuda.device_count())
    else:
        free, sharing = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), local_world
        if os.path.exists("/proc/meminfo"):  # Linux says what is available: free, and cache it can drop
            with open("/proc/meminfo") as f:
                free = next((int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:")), free)
    share = torch.tensor([free / sharing], dtype=torch.float64, device=device)
    dist.all_reduce(share, op=dist.ReduceOp.MIN)  # the smallest share decides, so every rank decides alike
    if nbytes > share.item():
        raise UsageError(f"{what} would need at least {nbytes / 2**30:,.1f} GiB, more than this rank's share of "
                         f"{device.type} memory ({share.item() / 2**30:,.1f} GiB)")


def brief(indices, shown=16):
    """A list of indices for a log line: the first `shown`, and how many in all."""
    indices = list(indices)
    return str(indices) if len(indices) <= shown else str(indices[:shown])[:-1] + f", ... ({len(indices):,} in all)]"


def main(args):
    device = setup(args)  # RANK and WORLD come from torchrun's environment, read there as 01 shows
    # A Python list of ints costs ~36 bytes an element (pointer + int object); the samplers make a few of them.
    check_memory(36 * 4 * args.dataset_size, f"--dataset-size {args.dataset_size:,}", device)
    data = list(range(args.dataset_size))
    print0(f"world_size={WORLD}, dataset of {len(data)} samples, seed={args.seed}")

    # 1. Ours against torch's, for both drop_last settings and two epochs, on every rank.
    for drop_last in (False, True):
        ours = DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=drop_last)
        ref = torch.utils.data.DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref) and len(ours) == len(ref), (drop_last, epoch)
    log_in_rank_order(f"epoch 0 indices: {brief(DistributedSampler(data, seed=args.seed))}  "
                      f"(== torch's, drop_last both ways)")

    # 2. Padding: all ranks together see total_size samples, some twice (or, with drop_last, some never).
    sampler = DistributedSampler(data, seed=args.seed)
    seen = collections.Counter(sum(gather(list(sampler)), []))
    dupes = sorted(i for i, times in seen.items() if times > 1)
    print0(f"padding: {sampler.total_size} slots for {len(data)} samples -> seen twice: {dupes}")
    dropped = sorted(set(data) - set(sum(gather(list(DistributedSampler(data, seed=args.seed, drop_last=True))), [])))
    print0(f"drop_last=True instead: {len(data) - len(dropped)} samples used, never seen this epoch: {dropped}")

    # 3. set_epoch: the shuffle is seeded with seed + epoch, so the training loop must tell the sampler which
    # epoch it is, on every rank alike. Forgetting it replays epoch 0's order every epoch.
    print0("three epochs, " + ("WITHOUT set_epoch (--no-set-epoch):" if args.no_set_epoch else
                               "each starting with sampler.set_epoch(epoch):"))
    orders = []
    for epoch in range(3):
        if not args.no_set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
        log_in_rank_order(f"epoch {epoch}: {brief(orders[-1])}")
    if args.no_set_epoch:
        assert orders[1] == orders[2] == orders[0]
        raise UsageError("every epoch replayed epoch 0's order, on every rank: the sampler shuffles with seed + "
                         "epoch, and without set_epoch its epoch stays 0; call sampler.set_epoch(epoch) at the start "
                         "of each epoch")

    # 4. Evaluation. Pretend the model is right on every sample whose index is not a multiple of 3.
    sampler.set_epoch(0)
    correct = torch.tensor([float(i % 3 != 0) for i in sampler], device=device)
    exact = sum(i % 3 != 0 for i in data) / len(data)
    # Naive: sum correct and counted over ranks. Padded duplicates are counted twice.
    naive = torch.stack([correct.sum(), torch.tensor(float(len(correct)), device=device)])
    # Fix: slot k of rank r is global position k*N + r of the padded list; positions >= len(data) are padding.
    real = torch.tensor([k * WORLD + RANK < len(data) for k in range(len(correct))], dtype=torch.float32, device=device)
    fixed = torch.stack([(correct * real).sum(), real.sum()])
    for t in (naive, fixed):
        dist.all_reduce(t)  # SUM of counts, then one division: a mean of per-rank accuracies would be wrong too
    naive_acc, fixed_acc = (naive[0] / naive[1]).item(), (fixed[0] / fixed[1]).item()
    assert abs(fixed_acc - exact) < 1e-6, (fixed_acc, exact)
    print0(f"accuracy: exact {exact:.4f} | naive distributed {naive_acc:.4f} over {naive[1]:.0f} samples "
           f"| padding masked {fixed_acc:.4f} over {fixed[1]:.0f} samples")
    print0(f"OK DistributedSampler equals torch's on {WORLD} ranks; padded evaluation fixed")


# --- plumbing the lesson calls: ordered output, flags ---
def log_in_rank_order(line):
    """Every rank's line, printed by rank 0 in rank order: lines that each rank prints itself race each other."""
    lines = [None] * WORLD
    dist.all_gather_object(lines, line)
    for r, text in enumerate(lines):
        print0(f"[rank {r}/{WORLD}] {text}")


def parse_args():
    p = parser(__doc__)
    p.add_argument("--dataset-size", type=number(int, 1), default=11, help="samples in the toy dataset (try N+1)")
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0, help="shuffle seed, shared by all ranks")
    p.add_argument("--no-set-epoch", action="store_true",
                   help="break it: never call set_epoch, and watch every epoch replay the same order")
    return p.parse_args()


# --- distributed setup: the same block in every numbered script, copied (not imported) so each file runs alone ---
RANK, WORLD = 0, 1


class UsageError(Exception):
    """Bad input: one line on rank 0 (`error: ...`), exit status 2, no traceback."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM, raised in the main thread, so the run unwinds through its own cleanup (nothing is
    left half-written). Code that knows where the run stopped sets `where` for run()'s one line."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.where = signum, ""


def print0(*msg):  # the rank-0 narrative: printed once, not N times
    if RANK == 0:
        print(*msg, flush=True)


def log(*msg):  # a per-rank line, tagged, in one write so that lines of different ranks never mix
    sys.stdout.write(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)) + "\n")
    sys.stdout.flush()


def number(kind, low, high=math.inf, above=False):
    """The argparse type of every numeric flag: a finite int or float from `low` (or above it) to `high`."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            bound = f"{'>' if above else '>='} {low}" + (f" and <= {high}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


def parser(doc, timeout_s=120):
    """argparse with the flags every script shares; a bad flag is one line on rank 0, not a usage text per rank."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def error(message):
        raise UsageError(message)
    p.error = error
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if GPUs >= ranks")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl if every rank has a GPU")
    p.add_argument("--timeout-s", type=number(float, 1, 30 * 86400), default=timeout_s,
                   help="how long a rank waits for a dead or stuck peer")
    return p


def choose_device(device, backend, n_gpus, local_rank, local_world):
    """(device, backend, note) from the flags and this node's GPUs. NCCL needs a GPU per rank; gloo shares."""
    if device == "cpu" or (device == "auto" and n_gpus == 0):
        if backend == "nccl":
            raise UsageError("--backend nccl runs on CUDA GPUs only: use gloo on the CPU")
        return torch.device("cpu"), "gloo", None
    if n_gpus == 0:
        raise UsageError("--device cuda, but this node has no CUDA GPU: use --device cpu")
    if n_gpus >= local_world:  # the usual GPU setup: local rank r takes cuda:r
        return torch.device("cuda", local_rank), backend or "nccl", None
    fix = f"start --nproc_per_node={n_gpus}, or share the GPU(s) over gloo with --device cuda --backend gloo"
    if backend == "nccl":
        raise UsageError(f"nccl needs one GPU per rank, but this node has {n_gpus} for {local_world} ranks: {fix}")
    if device == "auto":
        return torch.device("cpu"), "gloo", f"{n_gpus} GPU(s) for {local_world} ranks here, so CPU and gloo; {fix}"
    return torch.device("cuda", local_rank % n_gpus), "gloo", f"{local_world} ranks share {n_gpus} GPU(s) over gloo"


def setup(args, min_world=2):
    """Choose the device, then join the process group. Global RANK names a process; LOCAL_RANK picks its GPU."""
    global RANK, WORLD
    RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if WORLD < min_world:
        raise UsageError(f"needs {min_world} or more ranks: launch with torchrun, e.g. torchrun "
                         f"--nproc_per_node={min_world} {sys.argv[0]}")
    n_gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never touches CUDA
    device, backend, note = choose_device(args.device, args.backend, n_gpus, int(os.environ.get("LOCAL_RANK", 0)),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if note:
        print0(f"note: {note}")
    if device.type == "cuda":  # before init, so NCCL binds this rank to its GPU (not device_id=: pytorch#153960)
        torch.cuda.set_device(device)
    # Plain `python` (no torchrun): a group of one, in memory, so the same code runs. The timeout turns a dead peer
    # into an error after --timeout-s instead of a silent 30-minute hang.
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **alone)
    return device


def run(main, parse_args):
    """Bad input: one line on rank 0, exit 2. A peer that died or timed out: one line per survivor, exit 1.
    Ctrl-C or SIGTERM: one line on rank 0, and the process ends by that signal, as a shell expects (130, 143)."""
    # SIGTERM (a scheduler's, or torchrun passing on the Ctrl-C it got) stops a run the way Ctrl-C does.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    code = 0
    try:  # the outer try: a signal may land anywhere, even while the inner one reports a lost peer
        try:
            main(parse_args())
        except UsageError as e:
            if os.environ.get("RANK", "0") == "0":  # every rank stops alike; one says why
                print(f"error: {e}", file=sys.stderr, flush=True)
            code = 2
        except RuntimeError as e:  # NCCL raises DistError; gloo, RuntimeErrors from torch.distributed or its transport
            where, text = traceback.extract_tb(e.__traceback__)[-1].filename, str(e)
            if signalled(e) or not (isinstance(e, dist.DistError) or f"torch{os.sep}distributed" in where
                                    or "gloo/" in text):
                raise  # a bug in this rank's own code keeps its traceback; a signal goes to the outer try
            what = "timed out waiting for a peer" if "timed out" in text.lower() else "lost a peer"
            log(f"error: {what} ({text.strip().splitlines()[0][:160]})")
            os._exit(1)  # no teardown: it would wait for the dead peer
        if dist.is_initialized():
            dist.destroy_process_group()
            # gloo's threads may still hold the last reference to a finished collective; freeing it takes the GIL,
            # which no thread gets once the interpreter is finalising ("terminate called without an active
            # exception", SIGABRT). A moment here lets them finish first.
            time.sleep(0.05)
    except BaseException as e:
        stop = signalled(e)
        if stop is None:
            raise
        if os.environ.get("RANK", "0") == "0":  # every rank got the signal (torchrun passes it on); one says where
            where = f" {stop.where}" if stop.where else ""
            print(f"interrupted by {stop}{where}", file=sys.stderr, flush=True)
        end_by_signal(stop.signum)  # no teardown: the peers are stopping too
    sys.exit(code)


def signalled(e):
    """The Interrupted behind exception `e`, or None. A signal that lands inside a library can come back as that
    library's own error, raised while handling it (torch.save's "unexpected pos" when its write was cut short)."""
    while e is not None and not isinstance(e, Interrupted):
        e = e.__context__
    return e


def interrupt(signum, frame):
    # Only the first signal: a second Ctrl-C must not cut the way out (cleanup, the one line) short with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def end_by_signal(signum):
    """End this process as the signal would have: its parent (a shell, torchrun) sees an interrupt, not a failure."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


if __name__ == "__main__":
    run(main, parse_args)
