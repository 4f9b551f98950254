"""06 - PyTorch's DistributedDataParallel on ResNet18 and MNIST, as in the ddp-tutorial-series.

It trains with PyTorch's own DDP, the class that DDPCore rebuilt by hand. Around it comes what a
real training job needs.
- A DistributedSampler gives each rank its own share of a new order every epoch.
- Validation counts every image once, whatever the number of ranks.
- SyncBatchNorm shares BatchNorm's statistics across GPUs.
- Global rank 0 writes checkpoints, and a new run resumes from them.
- The ranks start under torchrun, or from plain python with torch.multiprocessing.spawn.

MNIST is downloaded into --data-dir on first use. With --dataset fake the script draws its own
digits and needs no network.
  1 process:  python 06_torch_ddp_resnet.py
  spawn N:    python 06_torch_ddp_resnet.py --nproc 2               (no torchrun)
  CPU:        torchrun --nproc_per_node=2 06_torch_ddp_resnet.py --dataset fake --out ckpt
  N GPUs:     torchrun --nproc_per_node=N 06_torch_ddp_resnet.py --max-train-samples 0 \\
                  --max-val-samples 0 --epochs 5 --batch-size 128 --sync-bn
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST \\
                  --master_port=29500 06_torch_ddp_resnet.py --out ckpt
  restarts:   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
                  06_torch_ddp_resnet.py --dataset fake --out ckpt      (docs/checkpoints.md)
"""

import argparse
import glob
import math
import os
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
SGD_MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4  # the usual recipe for ResNets
WARMUP = 0.2  # The learning rate rises to --lr over this share of the steps, then decays to 0.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of MNIST's training pixels, to normalise the images


# --- the idea: one rank's training loop, the tutorial's Trainer, around PyTorch's DDP ---
class Trainer:
    """What every rank runs. Each rank holds a whole copy of the model and trains on its own share
    of the data. DDP sends rank 0's weights to all when it wraps the model. In backward() it
    averages the gradients over the ranks. So every copy takes the same step and stays the same."""

    def __init__(self, model, train_data, val_data, args, device):
        self.args, self.device, self.train_data, self.val_data = args, device, train_data, val_data
        # A GPU's convolutions run fastest on channels-last tensors. The inputs follow in batch().
        self.layout = torch.channels_last if device.type == "cuda" else torch.contiguous_format
        self.model = model.to(device, memory_format=self.layout)
        if args.sync_bn and device.type == "cuda":
            # BatchNorm uses the statistics of its own rank's batch. SyncBatchNorm averages them
            # over the ranks, at one more collective per layer. It helps when GPU batches are tiny.
            self.model = nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
        elif args.sync_bn:
            print0("note: --sync-bn works on GPUs only, so on the CPU each rank keeps its own "
                   "BatchNorm statistics")
        # device_ids names this rank's one GPU, which setup() picked from the local rank.
        self.ddp = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=SGD_MOMENTUM,
                                   weight_decay=WEIGHT_DECAY)
        total = args.epochs * len(train_data)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: one_cycle(s, total))
        self.amp = torch.bfloat16 if args.precision == "bf16" else None
        self.epochs_done = 0

    def resume(self, state):
        # The bare model's weights, with no "module." prefix, so build_model() loads them too.
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])  # SGD's momentum. An exact resume needs it.
        self.sched.load_state_dict(state["scheduler"])  # The step count. --epochs sets the rest.
        self.epochs_done = state["epoch"]

    def batch(self, x, y):  # Pinned memory (see main) lets the copy to a GPU run in the background.
        x = x.to(self.device, non_blocking=True, memory_format=self.layout)
        return x, y.to(self.device, non_blocking=True)

    def run_epoch(self, epoch):
        # The sampler seeds its shuffle with the epoch. Without set_epoch every epoch repeats
        # the first one's order.
        self.train_data.sampler.set_epoch(epoch)
        self.ddp.train()
        sums = torch.zeros(2, device=self.device)  # the loss summed over samples, and the samples
        bar = RANK == 0 and sys.stderr.isatty()  # Rank 0 alone shows a bar, on a terminal only.
        for x, y in tqdm(self.train_data, f"epoch {epoch + 1}", leave=False, disable=not bar):
            x, y = self.batch(x, y)
            with torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None):
                loss = F.cross_entropy(self.ddp(x).float(), y)
            loss.backward()  # DDP averages the gradients here, a bucket as soon as it fills.
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            n = torch.tensor(float(len(y)), device=self.device)
            sums += torch.stack([loss.detach() * n, n])
        dist.all_reduce(sums)  # The loss covers all ranks, not rank 0's alone.
        return (sums[0] / sums[1]).item(), sums[1].item()

    def evaluate(self):
        """Loss and accuracy over the whole validation set, whatever the number of ranks.

        The sampler pads the last round with repeated images, so that every rank gets as many
        batches. Slot k of rank r is place k*N + r in the padded order. Places past the end of the
        data set hold the repeats, and they are left out."""
        self.ddp.eval()
        sums = torch.zeros(3, device=self.device, dtype=torch.float64)  # loss sum, hits, images
        k, n_total = 0, len(self.val_data.dataset)
        with torch.no_grad():
            for x, y in self.val_data:
                x, y = self.batch(x, y)
                real = (torch.arange(k, k + len(y), device=self.device) * WORLD + RANK) < n_total
                k += len(y)
                logits = self.ddp(x)
                loss = F.cross_entropy(logits.float(), y, reduction="none")
                right = (logits.argmax(1) == y) & real
                sums += torch.stack([(loss * real).sum(), right.sum(), real.sum()]).double()
        dist.all_reduce(sums)  # Sums over ranks, then one division. A mean of means is wrong.
        return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item(), int(sums[2].item())

    def train(self):
        for epoch in range(self.epochs_done, self.args.epochs):
            t0 = time.perf_counter()
            train_loss, samples = self.run_epoch(epoch)
            if not math.isfinite(train_loss):  # Every rank has this loss, so all stop here.
                raise UsageError(f"training diverged in epoch {epoch + 1} with loss {train_loss}. "
                                 "Try a smaller --lr.")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # The GPU runs behind. Wait for it.
            elapsed = time.perf_counter() - t0
            val_loss, val_acc, n_val = self.evaluate()
            print0(f"epoch {epoch + 1:>3}/{self.args.epochs} | train loss {train_loss:.4f} "
                   f"| val loss {val_loss:.4f} | val acc {val_acc:.4f} ({n_val} samples) "
                   f"| {samples / elapsed:,.0f} samples/s")
            if self.args.out:
                if RANK == 0:  # Every copy holds the same state, so global rank 0 alone saves.
                    save_checkpoint(self.args.out, epoch + 1, {
                        "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                        "scheduler": self.sched.state_dict(), "epoch": epoch + 1})
                print0(f"saved {self.args.out}/checkpoint-{epoch + 1}.pt")

    def check_replicas(self):
        """The same gradients on the same weights keep the copies equal. Check it, bit for bit."""
        flat = torch.cat([p.detach().flatten() for p in self.model.parameters()])
        ref = flat.clone()
        dist.broadcast(ref, src=0)
        same = torch.tensor([float(torch.equal(ref, flat))], device=self.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if not same.item():
            raise RuntimeError("replicas diverged: weights differ across ranks")


def one_cycle(step, total):
    """The learning rate's factor at `step` of `total`. It rises in a straight line, then falls
    along a cosine to 0."""
    warm = max(1, round(WARMUP * total))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


# --- model and data ---
def build_model(num_classes=10):
    """torchvision's ResNet18 for 1x28x28 images. A 3x3 first layer and no max-pool keep the
    first residual block at 28x28, not 7x7."""
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def load_data(args):
    """The training and validation sets, MNIST or the offline digits, cut to the flags' sizes."""
    if args.dataset == "fake":  # Validation images use seeds that no training image used.
        train = SyntheticDigits(args.fake_size, offset=0)
        val = SyntheticDigits(args.fake_size // 4, offset=args.fake_size)
    else:
        # Local rank 0 of each node downloads what is missing, and the others wait. Two processes
        # writing the same files would spoil them. Offline, torchvision's error says what failed.
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            for is_train in (True, False):
                torchvision.datasets.MNIST(args.data_dir, train=is_train, download=True)
        dist.barrier()
        tf = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                             torchvision.transforms.Normalize((MNIST_MEAN,),
                                                                              (MNIST_STD,))])
        train = torchvision.datasets.MNIST(args.data_dir, train=True, transform=tf)
        val = torchvision.datasets.MNIST(args.data_dir, train=False, transform=tf)
    return first(train, args.max_train_samples), first(val, args.max_val_samples)


def first(dataset, n):
    """The first n samples, or all of them if n is 0. A quick run uses a slice of the data."""
    return Subset(dataset, range(min(n, len(dataset)))) if n else dataset


# Seven-segment digits. Each segment is a stroke from (x0, y0) to (x1, y1) in a unit box, y down.
SEGMENTS = {"a": (0, 0, 1, 0), "b": (1, 0, 1, .5), "c": (1, .5, 1, 1), "d": (0, 1, 1, 1),
            "e": (0, .5, 0, 1), "f": (0, 0, 0, .5), "g": (0, .5, 1, .5)}
DIGITS = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg")


class SyntheticDigits(torch.utils.data.Dataset):
    """The offline stand-in for MNIST (--dataset fake). Each image is a seven-segment digit of
    random size, place, stroke width and brightness, under pixel noise, normalised as MNIST is.
    There is something to learn, unlike with random labels. A guess from the mean image of each
    digit gets only about a third right, so the network has work to do.

    Sample i is drawn from its own seed, offset + i. So every rank sees the same data set, and
    nobody stores or sends it."""

    def __init__(self, size, offset):
        self.size, self.offset = size, offset

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + int(i))

        def uniform_int(low, high):
            return int(torch.randint(low, high + 1, (), generator=g))
        label, t = uniform_int(0, 9), uniform_int(2, 3)  # the digit, and the stroke's width
        w, h = uniform_int(8, 14), uniform_int(14, 20)
        left, top = uniform_int(0, 28 - w - t), uniform_int(0, 28 - h - t)
        image = torch.zeros(28, 28)
        for segment in DIGITS[label]:
            x0, y0, x1, y1 = SEGMENTS[segment]
            rows = slice(top + round(y0 * h), top + round(y1 * h) + t)
            image[rows, left + round(x0 * w):left + round(x1 * w) + t] = 1
        image = image * (0.6 + 0.4 * torch.rand((), generator=g))
        image = image + 0.2 * torch.randn(28, 28, generator=g)
        return ((image.clamp(0, 1) - MNIST_MEAN) / MNIST_STD).unsqueeze(0), label


# --- main ---
def main(args):
    if args.nproc:  # This process starts the ranks itself, as torchrun would.
        if "RANK" in os.environ:
            raise UsageError("--nproc starts its own processes. Use it with plain python, "
                             "not under torchrun.")
        spawn(args.nproc)
    device = setup(args)
    if args.precision == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        args.precision = "bf16" if bf16 else "fp32"
    if device.type == "cuda":  # TF32 has float32's range and runs at tensor-core speed.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} "
           f"precision={args.precision} torch={torch.__version__}")
    state = load_newest(args.out) if args.out else None
    if state and state["epoch"] >= args.epochs:
        print0(f"OK nothing to train: {args.out} holds epoch {state['epoch']} of --epochs "
               f"{args.epochs}. A larger --epochs trains on.")
        return

    train_set, val_set = load_data(args)
    # Every rank shuffles with the same seed, so all cut the same order into shares that do not
    # overlap. drop_last gives every rank as many steps. Validation is padded instead.
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    # Worker processes prepare batches ahead. Pinned memory lets the copy to a GPU run alongside.
    kw = dict(num_workers=args.workers, pin_memory=device.type == "cuda",
              persistent_workers=args.workers > 0)
    train_data = DataLoader(train_set, args.batch_size, sampler=train_sampler, drop_last=True, **kw)
    val_data = DataLoader(val_set, args.batch_size, sampler=val_sampler, **kw)
    if len(train_data) == 0:
        raise UsageError(f"{len(train_set)} training samples are too few for {WORLD} ranks "
                         f"x --batch-size {args.batch_size}")
    print0(f"data: {args.dataset}, {len(train_set):,} train / {len(val_set):,} val samples")
    print(f"[rank {RANK}/{WORLD}] device {device}: {len(train_sampler)} training samples per "
          f"epoch, {len(train_data)} steps of {args.batch_size}\n", end="", flush=True)

    torch.manual_seed(args.seed)  # The same first weights everywhere. DDP would copy rank 0's.
    trainer = Trainer(build_model(), train_data, val_data, args, device)
    if state:
        trainer.resume(state)
        done = state["epoch"]
        print0(f"resumed from {args.out}/checkpoint-{done}.pt after epoch {done}")
    trainer.train()
    trainer.check_replicas()
    print0(f"OK DDP ResNet18 on {WORLD} rank(s): replicas identical after {args.epochs} epoch(s)")


# --- --nproc: starting the ranks without torchrun, as the tutorial's multigpu.py does ---
def spawn(nproc):  # Start the ranks here, wait for them, and exit as they did.
    with socket.socket() as s:  # A free port on this machine is where the ranks meet.
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:  # When one rank fails, mp.spawn stops the others.
        mp.spawn(spawned, args=(nproc, port, sys.argv[1:]), nprocs=nproc)
    except mp.ProcessExitedException as e:  # That rank said why. A killed rank exits 1.
        sys.exit(max(e.exit_code, 1))
    sys.exit(0)  # Not back to run(). This process joined no group that needs closing.


def spawned(local_rank, nproc, port, argv):  # Each rank sets torchrun's variables, then runs.
    global RANK, WORLD
    RANK, WORLD = local_rank, nproc  # The setup block read them at import, before they were set.
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The last --nproc wins, so a rank starts no more ranks.
    run(main, lambda: parse_args(argv + ["--nproc", "0"]))


# --- checkpoints: the same block in 05, 06 and 08 ---
def load_newest(out):
    """The newest checkpoint in --out that loads, on every rank, or None. A run writes only into an
    --out that is new, empty or holds checkpoints, so never over files that no run wrote."""
    if os.path.isdir(out) and os.listdir(out) and not glob.glob("checkpoint-*", root_dir=out):
        raise UsageError(f"--out {out} holds files that no run wrote. Pick a new or empty folder.")
    os.makedirs(out, exist_ok=True)  # Now, so that a file of that name stops every rank here.
    found, me = [None, None], os.path.basename(__file__)  # the path, and the script that wrote it
    for path in reversed(checkpoints(out)) if RANK == 0 else []:  # Rank 0 picks one for all.
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            found = [path, state.get("script", "an older version")]
            break
        except Exception as e:  # A disk fault. Saving that step again writes over it.
            print0(f"warning: {path} does not load ({type(e).__name__}), so this run skips it")
    dist.broadcast_object_list(found, src=0)  # On several nodes, all must see the --out disk.
    if found[0] and found[1] != me:  # Another script's checkpoint holds other things.
        raise UsageError(f"{found[0]} was written by {found[1]}, not {me}. "
                         "Start this run in a new --out.")
    return found[0] and torch.load(found[0], map_location="cpu", weights_only=True, mmap=True)


def checkpoints(out):  # the checkpoint files in --out, oldest first
    names = [f for f in glob.glob("checkpoint-*.pt", root_dir=out) if f[11:-3].isdigit()]
    return [f"{out}/{f}" for f in sorted(names, key=lambda f: int(f[11:-3]))]  # f[11:-3] is a step


def save_checkpoint(out, step, state, keep=2):  # Global rank 0 alone calls it.
    # Written aside, then renamed into place, so that no checkpoint is ever half written.
    torch.save({**state, "script": os.path.basename(__file__)}, f"{out}/checkpoint-tmp")
    os.replace(f"{out}/checkpoint-tmp", f"{out}/checkpoint-{step}.pt")
    for old in checkpoints(out)[:-keep]:  # The newest `keep` stay.
        os.remove(old)


# --- command line ---
def parse_args(argv=None):
    p = Parser(__doc__, timeout_s=300)
    count = at_least(1)
    p.add_argument("--dataset", choices=["mnist", "fake"], default="mnist",
                   help="fake: digits drawn here, offline")
    p.add_argument("--data-dir", default="data", help="MNIST's folder (downloaded if missing)")
    p.add_argument("--max-train-samples", type=at_least(0), default=2000,
                   help="the first N training images (0: all)")
    p.add_argument("--max-val-samples", type=at_least(0), default=1000,
                   help="the first N test images (0: all)")
    p.add_argument("--fake-size", type=at_least(4), default=2000,
                   help="--dataset fake: training images (a quarter as many for validation)")
    p.add_argument("--epochs", type=count, default=2)
    p.add_argument("--batch-size", type=count, default=32, help="per rank")
    p.add_argument("--lr", type=at_least(1e-12, float), default=0.05, help="peak learning rate")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 on a GPU")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (GPU only)")
    p.add_argument("--workers", type=at_least(0), default=0, help="DataLoader processes per rank")
    p.add_argument("--seed", type=at_least(0, below=2**32), default=0,
                   help="first weights (the same on every rank) and shuffling")
    p.add_argument("--out", default=None, help="save a checkpoint here every epoch, resume from it")
    p.add_argument("--nproc", type=at_least(0), default=0,
                   help="start this many ranks here (plain python)")
    return p.parse_args(argv)


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
