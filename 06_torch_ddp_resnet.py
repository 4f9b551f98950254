"""06 - PyTorch's own DistributedDataParallel: ResNet18 on MNIST, from one laptop to many nodes.

What it teaches: the native counterpart of 05's hand-written wrapper, with everything a real job needs:
DistributedSampler + set_epoch, validation whose loss and accuracy are correct globally (sums all-reduced,
padded duplicates not counted), SyncBatchNorm on GPUs, mixed precision, atomic per-epoch checkpoints
written by global rank 0 and resumed automatically, and three ways to start the processes.

Run it (MNIST is downloaded into --data-dir on first use; --dataset fake draws its digits here, offline):
  1 process:     python 06_torch_ddp_resnet.py
  spawn N:       python 06_torch_ddp_resnet.py --nproc 2          (torch.multiprocessing, no torchrun)
  CPU:           torchrun --nproc_per_node=2 06_torch_ddp_resnet.py
  N GPUs:        torchrun --nproc_per_node=N 06_torch_ddp_resnet.py --max-train-samples 0 --epochs 5 \\
                     --batch-size 128 --precision bf16 --sync-bn
  2 nodes:       ./launch_multinode.sh --nodes 2 --nproc-per-node G --master-addr HOST --script 06_torch_ddp_resnet.py
  restarts:      TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
                     06_torch_ddp_resnet.py --out ckpt
"""

import argparse
import contextlib
import fcntl
import functools
import json
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

# --- settings beyond the flags ---
SGD_MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4  # the usual ResNet recipe
ONE_CYCLE_WARMUP = 0.2  # fraction of all steps spent raising the learning rate to --lr
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of the training images' pixels, to normalise them
KEEP_CHECKPOINTS = 2  # the newest two: if the last one is damaged, the one before it costs an epoch, not the run

# --- model and data ---
def build_model(num_classes=10):
    """torchvision's ResNet18 for 1x28x28 input: a 3x3 stem and no max-pool, so 28x28 is not shrunk to 7x7
    before the first residual block."""
    import torchvision
    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def load_data(args, local_rank):
    if args.dataset == "fake":  # validation images come from seeds that no training image used
        return SyntheticDigits(args.fake_size, offset=0), SyntheticDigits(args.fake_size // 4, offset=args.fake_size)
    import torchvision.datasets as D
    import torchvision.transforms as T
    tf = T.Compose([T.ToTensor(), T.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    # Local rank 0 of each node downloads (if needed) while the others wait, so no two processes write the
    # same files. Then every rank learns whether it worked: a rank left waiting in a collective would hang.
    raw = os.path.join(args.data_dir, "MNIST", "raw")
    error = ""
    if local_rank == 0:
        try:
            error = mnist_problem(raw) or ""  # files there but wrong: name the file, download nothing over it
            if not error:
                D.MNIST(args.data_dir, train=True, download=True)
                D.MNIST(args.data_dir, train=False, download=True)
        except Exception as e:  # offline, proxy, disk full, damaged files...
            error = (str(e).strip().splitlines() or [type(e).__name__])[0]
    errors = [None] * WORLD
    dist.all_gather_object(errors, error)
    if any(errors) and os.path.isdir(raw) and os.listdir(raw):  # there, but damaged or incomplete
        raise UsageError(f"the MNIST files in {raw} do not load ({next(e for e in errors if e)}): delete them to "
                         "download them again")
    if any(errors):
        raise UsageError(f"MNIST is not in --data-dir {args.data_dir} and could not be downloaded "
                         f"({next(e for e in errors if e)}). Put the four MNIST files in {raw}, or run a smoke "
                         "test with --dataset fake")
    try:  # on other nodes the files may be damaged too (a copy cut short): every rank finds out, one says it
        error = mnist_problem(raw) or ""
        if not error:
            train = D.MNIST(args.data_dir, train=True, transform=tf)
            val = D.MNIST(args.data_dir, train=False, transform=tf)
    except Exception as e:
        error = f"{type(e).__name__} {str(e).strip()[:120]}".strip()
    dist.all_gather_object(errors, error)
    if any(errors):
        raise UsageError(f"the MNIST files in {raw} do not load ({next(e for e in errors if e)}): delete them to "
                         "download them again")
    return first(train, args.max_train_samples), first(val, args.max_val_samples)


def mnist_problem(raw):
    """What is wrong with the MNIST files in `raw`, in a line naming the file, or None (also when one is missing:
    torchvision downloads them). torchvision reads each IDX file alone: images and labels that disagree in count
    load, and training stops with an IndexError at the first missing label; a label past 9, in the loss."""
    for split in ("train", "t10k"):
        count = {}
        for kind, magic, shape in (("images", 0x803, (28, 28)), ("labels", 0x801, ())):
            name = f"{split}-{kind}-idx{1 + len(shape)}-ubyte"
            path = os.path.join(raw, name)
            if not os.path.isfile(path):
                return None
            header = 8 + 4 * len(shape)  # big-endian uint32s: the magic number, the count, each further dimension
            with open(path, "rb") as f:
                data = f.read(header) if shape else f.read()  # the labels whole (60 kB), to check each one
            if len(data) < header:
                return f"{name} is cut short: {len(data)} bytes, less than its header"
            found, n, *dims = (int.from_bytes(data[k:k + 4], "big") for k in range(0, header, 4))
            if found != magic:
                return f"{name} is not an IDX file of {kind}: its magic number is 0x{found:08x}, not 0x{magic:08x}"
            if tuple(dims) != shape:
                return f"{name} holds {' x '.join(map(str, dims))} images, not MNIST's 28 x 28"
            size, expected = os.path.getsize(path), header + n * math.prod(shape)
            if size != expected:
                return f"{name} has {size:,} bytes, but its header promises {expected:,} ({n:,} {kind})"
            if not shape and max(data[header:], default=0) > 9:
                at = next(i for i, label in enumerate(data[header:]) if label > 9)
                return f"{name} holds label {data[header + at]} at index {at:,}, outside MNIST's 0-9"
            count[kind] = n
        if count["images"] != count["labels"]:
            return (f"{split}-images-idx3-ubyte holds {count['images']:,} images but {split}-labels-idx1-ubyte "
                    f"{count['labels']:,} labels")
    return None


# Seven-segment digits: each segment a stroke from (x0, y0) to (x1, y1) in a unit box, y pointing down.
SEGMENTS = {"a": (0, 0, 1, 0), "b": (1, 0, 1, .5), "c": (1, .5, 1, 1), "d": (0, 1, 1, 1), "e": (0, .5, 0, 1),
            "f": (0, 0, 0, .5), "g": (0, .5, 1, .5)}
DIGITS = ("abcdef", "bc", "abdeg", "abcdg", "bcfg", "acdfg", "acdefg", "abc", "abcdefg", "abcdfg")


class SyntheticDigits(torch.utils.data.Dataset):
    """The offline stand-in for MNIST (--dataset fake): seven-segment digits of random size, place, stroke width
    and brightness under pixel noise, normalised as MNIST is. There is something to learn (random labels would
    teach nothing), and a nearest-mean guess gets only about a third right, so the network has work to do.

    Sample i is drawn from its own seed, offset + i: every rank sees the same data set without anyone storing or
    sending it, and a huge --fake-size costs nothing until read (the memory check refuses it first)."""

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


class InMemory:
    """The data set decoded once into two tensors on the training device (all of MNIST is 47 MB as bytes), and
    batches indexed out of them through the same DistributedSampler: the same samples per rank and epoch as the
    DataLoader, without per-sample Python work between the GPU and its next batch."""

    def __init__(self, dataset, sampler, batch_size, device, drop_last=False):
        images, labels = zip(*(dataset[i] for i in range(len(dataset))))  # decoded (and normalised) once
        self.x, self.y = torch.stack(images).to(device), torch.tensor(labels, device=device)
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __len__(self):
        return len(self.sampler) // self.batch_size if self.drop_last else -(-len(self.sampler) // self.batch_size)

    def __iter__(self):
        order = torch.tensor(list(self.sampler), device=self.x.device)  # this rank's indices for this epoch
        for k in range(len(self)):
            take = order[k * self.batch_size:(k + 1) * self.batch_size]
            yield self.x[take], self.y[take]


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


def first(dataset, n):
    """The first n samples (all if n is 0): a quick run on a slice of the data."""
    return torch.utils.data.Subset(dataset, range(min(n, len(dataset)))) if n else dataset


# --- training and validation ---
def evaluate(model, loader, device, n_total, layout):
    """Loss and accuracy over the whole validation set, whatever the number of ranks.

    DistributedSampler pads the last round with duplicates so all ranks get equal batches. Slot k of rank r is
    position k*N + r of the padded order; positions >= len(dataset) are those duplicates, so we mask them.
    """
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)  # loss sum, correct, count
    k = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, memory_format=layout), y.to(device)
            real = (torch.arange(k, k + len(y), device=device) * WORLD + RANK) < n_total
            k += len(y)
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.float(), y, reduction="none")
            sums += torch.stack([(loss * real).sum(), ((logits.argmax(1) == y) & real).sum(), real.sum()]).double()
    dist.all_reduce(sums)  # SUMs over ranks, then one division: a mean of per-rank means would be wrong
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item(), int(sums[2].item())


def main(args):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler
    from tqdm import tqdm
    device = setup(args, min_world=1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} precision={args.precision} "
           f"torch={torch.__version__}")
    train_set, val_set = load_data(args, local_rank)
    # At least: DistributedSampler's permutation of the indices (a tensor, then a list: ~44 bytes an index), and
    # with the data in memory each 28x28 image as floats.
    in_memory = args.input == "memory" or (args.input == "auto" and device.type == "cuda")
    check_memory((44 + 3136 * in_memory) * (len(train_set) + len(val_set)), f"{len(train_set):,} images", device)
    # Same seed everywhere: one permutation, cut into disjoint shards. Validation is not shuffled; it is padded.
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    if in_memory:
        train_loader = InMemory(train_set, train_sampler, args.batch_size, device, drop_last=True)
        val_loader = InMemory(val_set, val_sampler, args.batch_size, device)
    else:  # worker processes decode batches ahead; pinned memory lets the copy to a GPU run asynchronously
        kw = dict(num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
        train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, drop_last=True, **kw)
        val_loader = DataLoader(val_set, args.batch_size, sampler=val_sampler, **kw)
    if len(train_loader) == 0:
        raise UsageError(f"{len(train_set)} training samples are too few for {WORLD} ranks "
                         f"x --batch-size {args.batch_size}")
    print0(f"data: {args.dataset}, {len(train_set):,} train / {len(val_set):,} val samples, "
           f"{len(train_loader)} steps per epoch per rank, {type(train_loader).__name__}")

    torch.manual_seed(args.seed)  # identical init everywhere (DDP also broadcasts rank 0's weights)
    model = build_model().to(device)
    layout = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    model = model.to(memory_format=layout)  # on a GPU, NHWC: the layout its convolution kernels prefer
    if args.sync_bn and device.type == "cuda":
        # BatchNorm normalises with the statistics of its own rank's batch. SyncBatchNorm all-reduces them
        # over ranks (one extra collective per BN layer per step), which helps when per-GPU batches are tiny.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif args.sync_bn:
        print0("note: --sync-bn ignored: SyncBatchNorm's kernels are CUDA-only; on CPU each rank keeps its BN stats")
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=SGD_MOMENTUM, weight_decay=WEIGHT_DECAY)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=ONE_CYCLE_WARMUP)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    if args.precision == "fp16" and device.type == "cpu":
        print0("note: fp16 convolutions have no fast CPU kernels (minutes per step here): use bf16 on CPU")

    lock = claim(args.out, {"script": os.path.basename(__file__)}) if args.out else None  # held till the end
    ckpt_path, ckpt = resume_state(args.out)
    start_epoch = 0
    if ckpt:
        try:
            model.load_state_dict(ckpt["model"])
        except (KeyError, RuntimeError) as e:
            raise UsageError(f"{ckpt_path} is not a checkpoint of this script's ResNet18 "
                             f"({str(e).strip().splitlines()[0][:150]}): use another --out") from None
        opt.load_state_dict(ckpt["optimizer"])
        if ckpt["scaler"] or not scaler.is_enabled():  # an fp32 or bf16 run saved none: fp16 starts a new scale
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]
        step = start_epoch * len(train_loader)
        if ckpt["scheduler"]["total_steps"] == total or start_epoch >= args.epochs:  # the same plan, or nothing left
            sched.load_state_dict(ckpt["scheduler"])
        else:  # more --epochs (or another world size): the one-cycle schedule, rebuilt for the new total
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total,
                                                        pct_start=ONE_CYCLE_WARMUP, last_epoch=step - 1)
            print0(f"note: {ckpt['scheduler']['total_steps']} -> {total} steps: the one-cycle schedule is rebuilt "
                   f"for the new total, so the learning rate rises again to {sched.get_last_lr()[0]:.2e}")
        print0(f"resumed from {ckpt_path} after epoch {start_epoch}")

    step, epoch = start_epoch * len(train_loader), start_epoch
    try:
        for epoch in range(start_epoch, args.epochs):
            train_sampler.set_epoch(epoch)  # without it every epoch would replay epoch 0's order
            ddp.train()
            t0, loss_sum, seen = time.perf_counter(), torch.zeros((), device=device), 0
            bar = tqdm(train_loader, desc=f"epoch {epoch + 1}", disable=RANK != 0 or not sys.stderr.isatty(),
                       leave=False)
            for x, y in bar:
                first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                if step == args.crash_at_step and RANK == WORLD - 1 and first_attempt:
                    log(f"--crash-at-step {step}: SIGKILL to myself (first attempt only)")
                    os.kill(os.getpid(), signal.SIGKILL)
                x, y = x.to(device, non_blocking=True, memory_format=layout), y.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = nn.functional.cross_entropy(ddp(x).float(), y)
                scaler.scale(loss).backward()  # DDP all-reduces gradient buckets during this call
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad(set_to_none=True)
                loss_sum += loss.detach() * len(y)
                seen += len(y)
                step += 1
            train = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
            dist.all_reduce(train)
            if not train[0].isfinite():  # the same sum on every rank: all stop here, together
                raise UsageError(f"training diverged: loss {train[0].item()} in epoch {epoch + 1} (try a smaller --lr)")
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the GPU runs behind the host: wait for it before reading the clock
            elapsed = time.perf_counter() - t0
            val_loss, val_acc, n_val = evaluate(ddp, val_loader, device, len(val_set), layout)
            print0(f"epoch {epoch + 1:>3}/{args.epochs} | train loss {(train[0] / train[1]).item():.4f} | val loss "
                   f"{val_loss:.4f} | val acc {val_acc:.4f} ({n_val} samples) "
                   f"| {train[1].item() / elapsed:,.0f} samples/s")
            if args.out:  # global rank 0 writes (one writer, even on many nodes); every rank learns if it could
                on_rank_0(save_checkpoint, args.out, epoch + 1, {
                    "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "scaler": scaler.state_dict(), "epoch": epoch + 1}, KEEP_CHECKPOINTS)
    except Interrupted as stop:  # Ctrl-C or SIGTERM: run() prints where, once, and what is on disk
        stop.where = f"in epoch {epoch + 1} after step {step}; {newest_checkpoint(args.out)}"
        raise
    if args.out:
        on_rank_0(save_model, args.out, model)
        print0(f"saved {os.path.join(args.out, 'model.pt')}")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor([float(torch.equal(ref, flat)), float(flat.isfinite().all())], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if not same[1].item():  # NaN equals nothing, itself included: say what really happened
        raise UsageError("training diverged: the weights are not finite (try a smaller --lr)")
    if not same[0].item():
        raise RuntimeError("replicas diverged: weights differ across ranks")
    if start_epoch >= args.epochs:
        print0(f"OK DDP ResNet18 on {WORLD} rank(s): nothing left to train (resumed after epoch {start_epoch}, "
               f"--epochs {args.epochs})")
    else:
        print0(f"OK DDP ResNet18 on {WORLD} rank(s): replicas identical after {args.epochs} epoch(s)")
    if lock:
        lock.close()


def save_model(out, model):
    """Global rank 0: the bare model's state dict (model, not ddp: no "module." prefix, it loads into
    build_model()) as out/model.pt, written aside and then moved in, so a crash never leaves half a file."""
    state = model.state_dict()
    with written_aside(out, "model.pt", tensor_bytes(state)) as tmp:
        with open(os.path.join(tmp, "model.pt"), "wb") as f:  # a Python file: its OSError tells a full disk apart
            torch.save(state, f)
    os.replace(os.path.join(tmp, "model.pt"), os.path.join(out, "model.pt"))
    os.rmdir(tmp)


def spawned(local_rank, argv, port):
    """Entry point of each process started by --nproc: the environment torchrun would have set, then as usual."""
    # spawn left this process on its own start method; a torchrun worker has the platform's default (fork on Linux)
    # for its DataLoader workers, and for tqdm's lock (under spawn a named semaphore, which a rank ended by Ctrl-C
    # would leave for the resource tracker to warn about).
    torch.multiprocessing.set_start_method(torch.multiprocessing.get_all_start_methods()[0], force=True)
    nproc = parse_args(argv).nproc
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run(main, functools.partial(parse_args, argv))


def main_or_spawn(args):
    """--nproc N starts N processes here with torch.multiprocessing, as torchrun would; otherwise this one runs."""
    if not args.nproc:
        return main(args)
    if "RANK" in os.environ:
        raise UsageError("--nproc starts its own processes: use it with plain python, not under torchrun")
    with socket.socket() as s:  # a free port for the rendezvous on this machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children = torch.multiprocessing.spawn(spawned, args=(sys.argv[1:], port), nprocs=args.nproc, join=False)

    def pass_on(signum, frame):  # Ctrl-C reaches every process of the terminal, a SIGTERM perhaps this one alone
        for child in children.processes:
            if child.is_alive():
                os.kill(child.pid, signum)
    signal.signal(signal.SIGINT, pass_on)
    signal.signal(signal.SIGTERM, pass_on)
    try:
        while not children.join(grace_period=30):  # when one ends in failure, the others get 30 s to stop alike
            pass
    except torch.multiprocessing.ProcessExitedException as e:  # the worker already said why
        if e.signal_name:  # it ended by a signal (Ctrl-C): so does this process, as a shell expects
            end_by_signal(-e.exit_code)
        sys.exit(e.exit_code)


# --- checkpoints: the same block in 05, 06 and 08, one contract for every --out ---
def claim(out, owner):
    """Global rank 0 takes --out for this run, or every rank stops with one line. Two runs into one --out would
    overwrite each other: an flock keeps the second out (the kernel drops it when its process dies, even by
    SIGKILL, so a crash leaves no stale lock). And a run never writes over what another script or another model
    left: owner.json says who writes here. Returns the open lock file: keep it for the whole run."""
    lock, error = None, [None]
    if RANK == 0:
        path = os.path.join(out, ".lock")
        try:
            os.makedirs(out, exist_ok=True)
            existed, lock = os.path.exists(path), open(path, "a")
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            error[0] = not_ours(out, owner)
            if error[0] and not existed:  # leave a directory that is not ours as we found it
                os.remove(path)
        except BlockingIOError:
            error[0] = f"--out {out} is in use by another run (it holds {out}/.lock): wait for it or pick another"
        except UsageError as e:  # owner.json did not fit on the disk
            error[0] = str(e)
        except OSError as e:  # a read-only or full disk: one line for every rank, not a traceback on rank 0
            error[0] = f"cannot write to --out {out}: {e.strerror}"
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise UsageError(error[0])
    return lock


def not_ours(out, owner):
    """Why this run must not write into `out` (the files of another script, or of another model), or None."""
    path = os.path.join(out, "owner.json")
    if not os.path.exists(path):
        theirs = sorted(set(os.listdir(out)) - {".lock"})
        if theirs:
            return (f"--out {out} holds files that no run of {owner['script']} wrote ({', '.join(theirs[:3])}"
                    f"{', ...' if len(theirs) > 3 else ''}): pick a new or empty directory")
        text = json.dumps(owner, indent=1)
        with written_aside(out, "owner.json", len(text)) as tmp:
            with open(os.path.join(tmp, "owner.json"), "w") as f:
                f.write(text)
        os.replace(os.path.join(tmp, "owner.json"), path)
        os.rmdir(tmp)
        return None
    try:
        with open(path) as f:
            theirs = json.load(f)
    except (OSError, ValueError) as e:
        return f"{path} does not load ({type(e).__name__}): pick another --out"
    if theirs.get("script") != owner["script"]:
        return f"--out {out} belongs to {theirs.get('script')} (its {path}): pick another --out"
    for key, value in owner.items():
        if theirs.get(key) != value:
            return (f"--out {out} holds a model with {key} {theirs.get(key)}, this run has {value}: use the "
                    "flags that wrote it, or another --out")
    return None


def checkpoints(out):
    """The checkpoint-STEP directories in ``out``, oldest first."""
    names = [d for d in os.listdir(out) if d.startswith("checkpoint-") and d.split("-")[1].isdigit()]
    return sorted(names, key=lambda d: int(d.split("-")[1]))


def resume_state(out):
    """(path, state) of the newest checkpoint in --out that loads, on every rank; (None, None) if there is none.

    Global rank 0 chooses and tells the others, so that all resume from the same step. A checkpoint that does not
    load (a disk fault, a copy cut short) is skipped with a warning and kept, renamed out of the way of the saves
    and their pruning. Mapped, not read: a rank reads only the pages of what it uses. Called before the model and
    data are built, so that a rank that cannot read it stops the run at once, not minutes later.
    """
    state, choice = None, [None]
    names = checkpoints(out) if RANK == 0 and out and os.path.isdir(out) else []
    for name in reversed(names):
        try:
            state = torch.load(os.path.join(out, name, "state.pt"), map_location="cpu", weights_only=True, mmap=True)
            choice[0] = os.path.join(out, name)
            break
        except Exception as e:
            kept = f"{os.path.join(out, name)}.damaged-{int(time.time())}"
            os.replace(os.path.join(out, name), kept)
            print0(f"warning: skipped {os.path.join(out, name)}: it does not load ({type(e).__name__}); kept as {kept}")
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None, None
    error = None
    if RANK != 0:  # on several nodes every rank must see rank 0's --out (a shared filesystem)
        try:
            state = torch.load(os.path.join(choice[0], "state.pt"), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            error = f"rank {RANK} cannot read {choice[0]} ({type(e).__name__}): every node must see rank 0's --out"
    errors = [None] * WORLD
    dist.all_gather_object(errors, error)  # all stop together, none left waiting in a collective
    if any(errors):
        raise UsageError(next(e for e in errors if e))
    return choice[0], state


def save_checkpoint(out, step, state, keep):
    """Global rank 0 only (all replicas are identical, and N writers to one path would corrupt it): call it
    through on_rank_0, so that every rank learns whether it could.

    Written into a temporary directory, fsynced, then renamed: a crash mid-write leaves the previous
    checkpoint intact and never a half-written one under a checkpoint-STEP name.
    """
    with written_aside(out, f"checkpoint-{step}", tensor_bytes(state)) as tmp:
        with open(os.path.join(tmp, "state.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, f"checkpoint-{step}"))
    # Prune: the newest `keep` checkpoints stay, and so does nothing a crash may have left half-written.
    for d in checkpoints(out)[:-keep] + [d for d in os.listdir(out) if d.startswith(".tmp-")]:
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)


def on_rank_0(write, *args):
    """Every rank calls it; global rank 0 runs write(*args). If that fails in one line (a full disk), every rank
    stops with that line: alone, rank 0 would stop and the others report a lost peer at their next collective."""
    error = [None]
    if RANK == 0:
        try:
            write(*args)
        except UsageError as e:
            error[0] = str(e)
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise UsageError(error[0])


@contextlib.contextmanager
def written_aside(out, name, needed):
    """A new temporary directory in `out` to write `name` into, which the caller then moves into place. Whatever
    stops the write (a full disk, Ctrl-C) removes it, so nothing half-written is left; a write the system refused
    becomes one line naming the directory and the space it needs (`needed`, in bytes)."""
    tmp = os.path.join(out, f".tmp-{name}")
    try:
        os.makedirs(tmp, exist_ok=True)
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if signalled(e):  # Ctrl-C mid-write, which torch.save may report as an error of its own
            raise signalled(e) from None
        reason = refused_write(e)
        if reason is None:
            raise  # not the disk's doing: a bug keeps its traceback
        free = shutil.disk_usage(out).free if os.path.isdir(out) else 0
        raise UsageError(f"cannot write {name} to {out}: {reason}: it needs about {size(needed)}, {size(free)} is "
                         f"free there. Make room; {newest_checkpoint(out)}") from None


def refused_write(e):
    """Why the system refused a write (no space, a quota, an I/O error), from the exception or its causes, or None.
    torch.save raises a RuntimeError in the course of handling the OSError; safetensors' writer (save_pretrained)
    gives only the text of it ("I/O error: No space left on device (os error 28)")."""
    while e is not None:
        if isinstance(e, OSError):
            return e.strerror or str(e)
        if "(os error " in str(e):
            return str(e).rsplit(": ", 1)[-1].split(" (os error ")[0]
        e = e.__cause__ or e.__context__
    return None


def tensor_bytes(state):
    """About what torch.save writes for `state`: every tensor's storage once (tied weights share one)."""
    storages, todo = {}, [state]
    while todo:
        x = todo.pop()
        if torch.is_tensor(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return sum(storages.values())


def size(n):
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def newest_checkpoint(out):
    """What a run that stops early leaves behind, and how to go on: the end of its one line."""
    names = checkpoints(out) if out and os.path.isdir(out) else []
    if names:
        return f"the newest checkpoint is {os.path.join(out, names[-1])}; rerun the same command to resume"
    if out:
        return f"{out} holds no checkpoint yet; rerun the same command to start again"
    return "nothing was saved (no --out)"


# --- command line ---
def parse_args(argv=None):
    p = parser(__doc__, timeout_s=300)
    count, at_least_0 = number(int, 1), number(int, 0)
    p.add_argument("--dataset", choices=["mnist", "fake"], default="mnist",
                   help="fake: synthetic seven-segment digits, made here, offline")
    p.add_argument("--data-dir", default="data", help="torchvision's MNIST root")
    p.add_argument("--max-train-samples", type=at_least_0, default=2000, help="first N training images (0: all 60,000)")
    p.add_argument("--max-val-samples", type=at_least_0, default=1000, help="first N test images (0: all 10,000)")
    p.add_argument("--fake-size", type=count, default=2000,
                   help="training images with --dataset fake (and a quarter as many for validation)")
    p.add_argument("--epochs", type=count, default=2)
    p.add_argument("--batch-size", type=count, default=32, help="per rank")
    p.add_argument("--lr", type=number(float, 0, above=True), default=0.05,
                   help="peak learning rate (one-cycle schedule)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="autocast dtype")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (GPU only)")
    p.add_argument("--input", choices=["auto", "loader", "memory"], default="auto",
                   help="memory: decode the data once, batches indexed on the device; auto: memory on a GPU")
    p.add_argument("--workers", type=number(int, 0, 256), default=0,
                   help="DataLoader worker processes per rank (--input loader)")
    p.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0)
    p.add_argument("--out", default=None, help="checkpoint every epoch, resume from it, final model.pt")
    p.add_argument("--nproc", type=number(int, 0, 1024), default=0,
                   help="start this many local processes yourself (no torchrun)")
    p.add_argument("--crash-at-step", type=int, default=-1,
                   help="demo: SIGKILL the last rank at this step, first attempt only")
    a = p.parse_args(argv)
    if a.dataset == "mnist" and a_file_on_the_way(a.data_dir):
        p.error(f"--data-dir {a.data_dir}: {a_file_on_the_way(a.data_dir)} is a file, not a directory")
    if a.out and not_a_directory(a.out):  # last: it makes the directory
        p.error(f"--out {a.out}: {not_a_directory(a.out)}")
    return a


def a_file_on_the_way(path):
    """The file that stands where directory `path` or one of its parents should be, or None."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return None if os.path.isdir(existing) else existing


def not_a_directory(path):
    """Why this run cannot write into directory `path`, or None. Decided by trying: it makes the directory (and
    writes nothing in it); permission bits can say yes where the kernel says no (a path under /proc as root)."""
    if a_file_on_the_way(path):
        return f"{a_file_on_the_way(path)} is a file, not a directory"
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        return f"cannot write there ({e.strerror or type(e).__name__})"
    return None


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
    run(main_or_spawn, parse_args)
