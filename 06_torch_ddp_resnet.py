"""06 - PyTorch's own DistributedDataParallel: ResNet18 on MNIST, as in PyTorch's ddp-tutorial-series.

What it teaches: the library's counterpart of 05's DDPCore, and what a training job adds around it:
DistributedSampler and set_epoch, validation whose numbers are global (sums all-reduced, the sampler's padded
duplicates not counted), SyncBatchNorm on GPUs, checkpoints written by global rank 0 and resumed, and the two ways
to start the processes: torchrun, or torch.multiprocessing.spawn from plain python (--nproc).

Run it (MNIST is downloaded into --data-dir on first use; --dataset fake draws its digits here, offline):
  1 process:  python 06_torch_ddp_resnet.py
  spawn N:    python 06_torch_ddp_resnet.py --nproc 2                 (torch.multiprocessing, no torchrun)
  CPU:        torchrun --nproc_per_node=2 06_torch_ddp_resnet.py --dataset fake --out ckpt
  N GPUs:     torchrun --nproc_per_node=N 06_torch_ddp_resnet.py --max-train-samples 0 --max-val-samples 0 \\
                  --epochs 5 --batch-size 128 --sync-bn
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 \\
                  06_torch_ddp_resnet.py --out ckpt
  restarts:   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
                  06_torch_ddp_resnet.py --dataset fake --out ckpt --crash-at-step 40   (pytorch#135712: the variable)
"""

import argparse
import glob
import math
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm

# --- settings beyond the flags ---
SGD_MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4  # the usual ResNet recipe
WARMUP = 0.2  # fraction of all steps spent raising the learning rate to --lr, before its cosine decay to 0
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of the training images' pixels, to normalise them


# --- the idea: one rank's training loop (the tutorial's Trainer), around PyTorch's DDP ---
class Trainer:
    """What every rank runs. Each holds a whole replica of the model and trains on its own shard of each epoch;
    DDP broadcasts rank 0's weights when it wraps the model and all-reduces the gradients during backward(), so
    every replica takes the same optimizer step and stays identical to the others."""

    def __init__(self, model, train_data, val_data, args, device):
        self.args, self.device, self.train_data, self.val_data = args, device, train_data, val_data
        # On a GPU, NHWC: the layout its convolution kernels prefer (the batches follow it in batch()).
        self.layout = torch.channels_last if device.type == "cuda" else torch.contiguous_format
        self.model = model.to(device, memory_format=self.layout)
        if args.sync_bn and device.type == "cuda":
            # BatchNorm normalises with the statistics of its own rank's batch. SyncBatchNorm all-reduces them
            # over ranks (one more collective per BN layer per step), which helps when per-GPU batches are tiny.
            self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
        elif args.sync_bn:
            print0("note: --sync-bn ignored: SyncBatchNorm runs on GPUs only; on CPU each rank keeps its BN stats")
        # device_ids: this rank's one GPU (the local rank picked it in setup()); on the CPU, none.
        self.ddp = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=SGD_MOMENTUM,
                                   weight_decay=WEIGHT_DECAY)
        total = args.epochs * len(train_data)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda step: one_cycle(step, total))
        self.amp = torch.bfloat16 if args.precision == "bf16" else None
        self.epochs_done = 0

    def resume(self, state):
        # The bare model's state (self.model, not self.ddp: no "module." prefix), so it loads into build_model().
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])  # SGD's momentum buffers: without them no bit-identity
        self.sched.load_state_dict(state["scheduler"])  # the step count; the schedule is recomputed from --epochs
        self.epochs_done = state["epoch"]

    def batch(self, x, y):  # pinned memory (see main) lets these copies to a GPU run behind the host
        return x.to(self.device, non_blocking=True, memory_format=self.layout), y.to(self.device, non_blocking=True)

    def run_epoch(self, epoch):
        # Without set_epoch every epoch would replay epoch 0's order: the sampler seeds its shuffle with it.
        self.train_data.sampler.set_epoch(epoch)
        self.ddp.train()
        sums = torch.zeros(2, device=self.device)  # loss sum, samples
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # torchrun counts its restarts
        bar = RANK == 0 and sys.stderr.isatty()  # one progress bar, rank 0's, and only on a terminal
        for x, y in tqdm(self.train_data, f"epoch {epoch + 1}", leave=False, disable=not bar):
            # --crash-at-step: a crash for torchrun --max-restarts to restart from (the scheduler counts the steps)
            if self.sched.last_epoch == self.args.crash_at_step and RANK == WORLD - 1 and first_attempt:
                print(f"[rank {RANK}/{WORLD}] --crash-at-step {self.args.crash_at_step}: SIGKILL to myself "
                      "(first attempt only)\n", end="", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = self.batch(x, y)
            with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                loss = F.cross_entropy(self.ddp(x).float(), y)
            loss.backward()  # DDP all-reduces gradient buckets during this call, as they fill up
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            sums += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=self.device)])
        dist.all_reduce(sums)  # the loss of all ranks, not rank 0's alone
        return (sums[0] / sums[1]).item(), sums[1].item()

    def evaluate(self):
        """Loss and accuracy over the whole validation set, whatever the number of ranks. DistributedSampler pads
        the last round with duplicates so that every rank gets as many batches: slot k of rank r is position
        k*N + r of the padded order, and positions past the end of the data set are those duplicates, masked."""
        self.ddp.eval()
        sums = torch.zeros(3, device=self.device, dtype=torch.float64)  # loss sum, correct, count
        k, n_total = 0, len(self.val_data.dataset)
        with torch.no_grad():
            for x, y in self.val_data:
                x, y = self.batch(x, y)
                real = (torch.arange(k, k + len(y), device=self.device) * WORLD + RANK) < n_total
                k += len(y)
                logits = self.ddp(x)
                loss = F.cross_entropy(logits.float(), y, reduction="none")
                sums += torch.stack([(loss * real).sum(), ((logits.argmax(1) == y) & real).sum(), real.sum()]).double()
        dist.all_reduce(sums)  # SUMs over ranks, then one division: a mean of per-rank means would be wrong
        return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item(), int(sums[2].item())

    def train(self):
        for epoch in range(self.epochs_done, self.args.epochs):
            t0 = time.perf_counter()
            train_loss, samples = self.run_epoch(epoch)
            if not math.isfinite(train_loss):  # the same all-reduced loss on every rank: all stop here, together
                raise UsageError(f"training diverged: loss {train_loss} in epoch {epoch + 1} (try a smaller --lr)")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the GPU runs behind the host: wait for it before the clock
            elapsed = time.perf_counter() - t0
            val_loss, val_acc, n_val = self.evaluate()
            print0(f"epoch {epoch + 1:>3}/{self.args.epochs} | train loss {train_loss:.4f} | val loss {val_loss:.4f} "
                   f"| val acc {val_acc:.4f} ({n_val} samples) | {samples / elapsed:,.0f} samples/s")
            if self.args.out:
                if RANK == 0:  # every replica holds the same state: global rank 0 alone writes, even on many nodes
                    save_checkpoint(self.args.out, epoch + 1, {
                        "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                        "scheduler": self.sched.state_dict(), "epoch": epoch + 1})
                print0(f"saved {self.args.out}/checkpoint-{epoch + 1}.pt")

    def check_replicas(self):
        """Identical gradients on identical weights keep the replicas identical: check it, bit for bit."""
        flat = torch.cat([p.detach().flatten() for p in self.model.parameters()])
        ref = flat.clone()
        dist.broadcast(ref, src=0)
        same = torch.tensor([float(torch.equal(ref, flat))], device=self.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            raise RuntimeError("replicas diverged: weights differ across ranks")


def one_cycle(step, total):
    """The learning rate's factor at `step` of `total`: a linear warm-up, then a cosine decay to 0."""
    warm = max(1, round(WARMUP * total))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


# --- model and data ---
def build_model(num_classes=10):
    """torchvision's ResNet18 for 1x28x28 input: a 3x3 stem and no max-pool, so 28x28 is not shrunk to 7x7
    before the first residual block."""
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def load_data(args):
    """(train, val): MNIST, or the offline digits, cut to --max-train-samples and --max-val-samples."""
    if args.dataset == "fake":  # validation images come from seeds that no training image used
        train, val = SyntheticDigits(args.fake_size, offset=0), SyntheticDigits(args.fake_size // 4, args.fake_size)
    else:
        # Local rank 0 of each node downloads what is missing while the others wait: two processes writing the same
        # files would spoil them. Offline, torchvision's own error says what failed, and the launcher stops the rest.
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            for is_train in (True, False):
                torchvision.datasets.MNIST(args.data_dir, train=is_train, download=True)
        dist.barrier()
        tf = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                             torchvision.transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
        train = torchvision.datasets.MNIST(args.data_dir, train=True, transform=tf)
        val = torchvision.datasets.MNIST(args.data_dir, train=False, transform=tf)
    return first(train, args.max_train_samples), first(val, args.max_val_samples)


def first(dataset, n):
    """The first n samples (all if n is 0): a quick run on a slice of the data."""
    return Subset(dataset, range(min(n, len(dataset)))) if n else dataset


# Seven-segment digits: each segment a stroke from (x0, y0) to (x1, y1) in a unit box, y pointing down.
SEGMENTS = {"a": (0, 0, 1, 0), "b": (1, 0, 1, .5), "c": (1, .5, 1, 1), "d": (0, 1, 1, 1), "e": (0, .5, 0, 1),
            "f": (0, 0, 0, .5), "g": (0, .5, 1, .5)}
DIGITS = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg")


class SyntheticDigits(torch.utils.data.Dataset):
    """The offline stand-in for MNIST (--dataset fake): seven-segment digits of random size, place, stroke width
    and brightness under pixel noise, normalised as MNIST is. There is something to learn (random labels would
    teach nothing), and a nearest-mean guess gets only about a third right, so the network has work to do.

    Sample i is drawn from its own seed, offset + i: every rank sees the same data set without anyone storing or
    sending it."""

    def __init__(self, size, offset):
        self.size, self.offset = size, offset

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + int(i))

        def uniform_int(low, high):
            return int(torch.randint(low, high + 1, (), generator=g))
        label, w, h, t = uniform_int(0, 9), uniform_int(8, 14), uniform_int(14, 20), uniform_int(2, 3)
        left, top = uniform_int(0, 28 - w - t), uniform_int(0, 28 - h - t)
        image = torch.zeros(28, 28)
        for segment in DIGITS[label]:
            x0, y0, x1, y1 = SEGMENTS[segment]
            image[top + round(y0 * h):top + round(y1 * h) + t, left + round(x0 * w):left + round(x1 * w) + t] = 1
        image = image * (0.6 + 0.4 * torch.rand((), generator=g)) + 0.2 * torch.randn(28, 28, generator=g)
        return ((image.clamp(0, 1) - MNIST_MEAN) / MNIST_STD).unsqueeze(0), label


# --- main ---
def main(args):
    if args.nproc:  # --nproc N: this process starts the N ranks itself, as torchrun would on one machine
        if "RANK" in os.environ:
            raise UsageError("--nproc starts its own processes: use it with plain python, not under torchrun")
        spawn(args.nproc)
    device = setup(args)
    if args.precision == "auto":
        args.precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if device.type == "cuda":  # TF32 matmuls and convolutions: float32's range, 10-bit mantissa, tensor-core speed
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} precision={args.precision} "
           f"torch={torch.__version__}")
    state = None
    if args.out:
        state = load_newest(args.out)
        if state and state["epoch"] >= args.epochs:
            print0(f"OK nothing to train: {args.out} holds epoch {state['epoch']} of --epochs {args.epochs} "
                   "(a larger --epochs continues it)")
            return

    train_set, val_set = load_data(args)
    # The same seed on every rank: one permutation of the indices, cut into disjoint shards, a new one each epoch
    # (set_epoch). drop_last keeps the steps equal across ranks; validation is not shuffled, it is padded.
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    # Worker processes decode batches ahead; pinned memory lets the copy to a GPU run asynchronously.
    kw = dict(num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    train_data = DataLoader(train_set, args.batch_size, sampler=train_sampler, drop_last=True, **kw)
    val_data = DataLoader(val_set, args.batch_size, sampler=val_sampler, **kw)
    if len(train_data) == 0:
        raise UsageError(f"{len(train_set)} training samples are too few for {WORLD} ranks x --batch-size "
                         f"{args.batch_size}")
    print0(f"data: {args.dataset}, {len(train_set):,} train / {len(val_set):,} val samples")
    print(f"[rank {RANK}/{WORLD}] device {device}: {len(train_sampler)} training samples per epoch, "
          f"{len(train_data)} steps of {args.batch_size}\n", end="", flush=True)

    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP would broadcast rank 0's anyway)
    trainer = Trainer(build_model(), train_data, val_data, args, device)
    if state:
        trainer.resume(state)
        print0(f"resumed from {args.out}/checkpoint-{state['epoch']}.pt after epoch {state['epoch']}")
    trainer.train()
    trainer.check_replicas()
    print0(f"OK DDP ResNet18 on {WORLD} rank(s): replicas identical after {args.epochs} epoch(s)")


# --- --nproc: starting the ranks without torchrun (the tutorial's multigpu.py) ---
def spawn(nproc):  # start nproc ranks here, wait for them, and exit as they did
    with socket.socket() as s:  # a free port on this machine, where the ranks meet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(spawned, args=(nproc, port, sys.argv[1:]), nprocs=nproc)  # one failing: it stops the others
    except mp.ProcessExitedException as e:  # that rank said why already; killed by a signal: exit 1
        sys.exit(max(e.exit_code, 1))
    sys.exit(0)  # not back to run(): this process joined no group to tear down


def spawned(local_rank, nproc, port, argv):  # each rank: the environment torchrun would set, then the same run
    global RANK, WORLD
    RANK, WORLD = local_rank, nproc  # the setup block read them when the module loaded, before they were set
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(main, lambda: parse_args(argv + ["--nproc", "0"]))  # the last --nproc wins: a rank starts no more ranks


# --- checkpoints: the same block in 05, 06 and 08 ---
def load_newest(out):
    """The newest checkpoint in --out that loads (None: none yet), on every rank. A run writes only into an --out that
    is new, empty or holds checkpoint-* files (a run's), so never over files it did not write."""
    if os.path.isdir(out) and os.listdir(out) and not any(f.startswith("checkpoint-") for f in os.listdir(out)):
        raise UsageError(f"--out {out} holds files that no run wrote: pick a new or empty directory")  # on every rank
    os.makedirs(out, exist_ok=True)  # now: a file of that name stops every rank here, not at the first save
    found = [None]  # global rank 0 alone picks, so that every rank resumes from the same step
    if RANK == 0:
        for step in reversed(checkpoints(out)):
            try:
                torch.load(f"{out}/checkpoint-{step}.pt", map_location="cpu", weights_only=True, mmap=True)
                found[0] = f"{out}/checkpoint-{step}.pt"
                break
            except Exception as e:  # a disk fault: skipped, and written over when its step is saved again
                print0(f"warning: {out}/checkpoint-{step}.pt does not load ({type(e).__name__}): skipped")
    dist.broadcast_object_list(found, src=0)  # several nodes: rank 0's --out on a disk they all see
    return torch.load(found[0], map_location="cpu", weights_only=True, mmap=True) if found[0] else None  # mmap: lazy


def checkpoints(out):  # the steps saved in --out, oldest first (f[11:-3]: the STEP of checkpoint-STEP.pt)
    return sorted(int(f[11:-3]) for f in glob.glob("checkpoint-*.pt", root_dir=out) if f[11:-3].isdigit())


def save_checkpoint(out, step, state, keep=2):
    """Global rank 0 only: written aside, then renamed into place (never half a checkpoint); the newest `keep` kept."""
    torch.save(state, f"{out}/checkpoint-tmp")  # a crash mid-write leaves only this, written over the next time
    os.replace(f"{out}/checkpoint-tmp", f"{out}/checkpoint-{step}.pt")
    for old in checkpoints(out)[:-keep]:
        os.remove(f"{out}/checkpoint-{old}.pt")


# --- command line ---
def parse_args(argv=None):
    p = Parser(__doc__, timeout_s=300)
    count = at_least(1)
    p.add_argument("--dataset", choices=["mnist", "fake"], default="mnist", help="fake: digits drawn here, offline")
    p.add_argument("--data-dir", default="data", help="torchvision's MNIST root (downloaded into it if missing)")
    p.add_argument("--max-train-samples", type=at_least(0), default=2000, help="the first N training images (0: all)")
    p.add_argument("--max-val-samples", type=at_least(0), default=1000, help="the first N test images (0: all)")
    p.add_argument("--fake-size", type=at_least(4), default=2000, help="--dataset fake: training images (val: 1/4)")
    p.add_argument("--epochs", type=count, default=2)
    p.add_argument("--batch-size", type=count, default=32, help="per rank")
    p.add_argument("--lr", type=at_least(1e-12, float), default=0.05, help="peak learning rate")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on a GPU")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (GPU only)")
    p.add_argument("--workers", type=at_least(0), default=0, help="DataLoader worker processes per rank")
    p.add_argument("--seed", type=at_least(0, below=2**32), default=0,
                   help="initial weights (the same on every rank), shuffling")
    p.add_argument("--out", default=None, help="checkpoint every epoch into this directory, resume from it")
    p.add_argument("--nproc", type=at_least(0), default=0, help="start this many ranks here (plain python)")
    p.add_argument("--crash-at-step", type=int, default=-1, help="SIGKILL the last rank at this step (1st attempt)")
    return p.parse_args(argv)


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
