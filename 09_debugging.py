"""09 - Debugging distributed training: the hangs and disagreements every learner meets, each reproduced,
diagnosed with the real tool, and fixed.

What it teaches: one scenario per --fault, its broken program run as a child job (torchrun, as many ranks, a short
--timeout-s): the symptom as you meet it, the tool that finds the cause (checked to name it), then the fix, run in
this job; `OK` when all three happened, exit 1 when the diagnosis did not.
  mismatch    ranks all-reduce different shapes: a timeout or a crash; TORCH_DISTRIBUTED_DEBUG=DETAIL names both
  rank0-only  a barrier only rank 0 reaches: a timeout; the Flight Recorder names the collective, py-spy the line
  uneven      ranks with different numbers of batches: the last step hangs; Join fixes it (DDP and ManualDDP)
  drift       replicas that silently diverge, the loss fine: check_replicas() names the tensor and the ranks
  crash       one rank raises: torchrun names the rank, @record's error file the exception
  same-gpu    (CUDA) NCCL with no torch.cuda.set_device: every rank on cuda:0; NCCL_DEBUG=INFO shows it
check_replicas(module, group=None), importable, is the drift check to drop into your own loop every N steps.

  CPU:        torchrun --nproc_per_node=2 09_debugging.py --fault mismatch        (or 3 ranks; --fault all)
  GPUs:       torchrun --nproc_per_node=N 09_debugging.py --fault all      (fewer GPUs than ranks: add --device cuda)
"""

import argparse
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

FAULTS = ("mismatch", "rank0-only", "uneven", "drift", "crash", "same-gpu")
BATCH, STEPS = 8, 4
DEVICE = torch.device("cpu")  # main() sets it from setup(): the models and batches follow the chosen device


# --- the idea: a replica check you can drop into any loop ---
def check_replicas(module, group=None):
    """Return quietly when every rank of `group` holds the same parameters and buffers as its rank 0, bit for bit
    (frozen ones too); otherwise raise RuntimeError on every rank alike, naming the first tensor that differs, the
    ranks that differ from rank 0 and the largest absolute difference. Any dtype, any device the group uses.
    Cost: one broadcast of the model's bytes and two small all-gathers (README 09 measures it)."""
    group = group or dist.group.WORLD
    named = [(n, t.detach()) for n, t in [*module.named_parameters(), *module.named_buffers()]]
    if not named:
        return
    device = named[0][1].device
    # Compare bits, not values: a byte view of every tensor (bf16, ints and bool alike) in one flat buffer.
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in named]).to(device)
    world, src = dist.get_world_size(group), dist.get_global_rank(group, 0)
    # First the layout: replicas of different sizes would pair a broadcast of one length with another's.
    layouts = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(layouts, torch.tensor([len(named), flat.numel()], device=device), group=group)
    if any(not torch.equal(x, layouts[0]) for x in layouts):
        raise RuntimeError(f"replicas differ in layout: (tensors, bytes) per rank {[x.tolist() for x in layouts]}")
    ref = flat.clone()
    dist.broadcast(ref, src=src, group=group)  # rank 0's bytes on every rank
    diffs, offset = torch.zeros(len(named), dtype=torch.float64, device=device), 0
    for i, (_, t) in enumerate(named):
        n = t.numel() * t.element_size()
        if not torch.equal(flat[offset:offset + n], ref[offset:offset + n]):  # only differing tensors pay for this
            theirs = ref[offset:offset + n].view(t.dtype).view(t.shape)
            diffs[i] = (t.double() - theirs.double()).abs().max() if t.numel() else 0
            diffs[i] = diffs[i] if diffs[i] > 0 else math.nan  # bits differ, values do not (NaN, -0.0): flag it
        offset += n
    # Every rank gathers every rank's differences: the same table everywhere, so all raise the same error.
    table = [torch.empty_like(diffs) for _ in range(world)]
    dist.all_gather(table, diffs, group=group)
    table = torch.stack(table).cpu()
    differing = table.amax(0).nonzero()
    if len(differing):
        i = differing[0].item()
        name, t = named[i]
        ranks = table[:, i].nonzero().flatten().tolist()
        worst = table[:, i].nan_to_num(0).max().item()
        by = f"by up to {worst:.3g}" if worst > 0 else "in its bits only (NaN or -0.0)"
        raise RuntimeError(f"replicas differ: {name} ({str(t.dtype)[6:]}, {tuple(t.shape)}) on rank(s) {ranks} "
                           f"differs from rank 0's {by} ({len(differing)} tensor(s) differ in all)")


# --- the programs: a small model trained on every rank's own batches ---
def make_model(seed=0, bn=False):
    torch.manual_seed(seed)  # the same seed on every rank: identical replicas (drift plants a per-rank one)
    layers = [nn.Linear(8, 16), *([nn.BatchNorm1d(16)] if bn else []), nn.ReLU(), nn.Linear(16, 1)]
    return nn.Sequential(*layers).to(DEVICE)


def batches(n):
    g = torch.Generator().manual_seed(RANK)  # each rank its own data
    return [(torch.randn(BATCH, 8, generator=g).to(DEVICE), torch.randn(BATCH, 1, generator=g).to(DEVICE))
            for _ in range(n)]


def step(model, opt, x, y, clip=False):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)  # BatchNorm's running stats: this rank's batch only
    loss.backward()
    if not isinstance(model, Joinable):  # DDP and ManualDDP (both Joinable) average in backward; a plain model here
        for p in model.parameters():  # 05's naive average: one all-reduce per parameter, after backward
            dist.all_reduce(p.grad)
            p.grad /= WORLD
    if clip:  # drift's planted bug: a clip that only some ranks apply
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    opt.step()
    return loss


def program(fault, fixed=False):
    """The program as a user writes it: the child job runs it broken (--broken), the scenario then fixed."""
    model = make_model()  # averaged by hand (PyTorch's DDP segfaults under DETAIL on gloo in torch 2.14)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if fault == "mismatch":
        metrics = {"loss": step(model, opt, *batches(1)[0]).item(), "samples": BATCH}
        if RANK == 0 and not fixed:
            metrics["lr"] = 0.1  # BUG: logged by rank 0 only, its tensor has 3 values, the others' 2
        dist.all_reduce(torch.tensor(list(metrics.values())))  # fixed: the same keys everywhere, lr logged apart
    elif fault == "rank0-only":
        for i, (x, y) in enumerate(batches(STEPS)):
            step(model, opt, x, y)
            if not fixed:
                log(f"step {i}")  # the training log (and the moment py-spy waits for)
            if i == 1 and RANK == 0:
                torch.save(model.state_dict(), os.devnull)  # the checkpoint
                if not fixed:
                    dist.barrier()  # BUG: meant for every rank, indented into rank 0's branch
            if i == 1 and fixed:
                dist.barrier()  # fixed: every rank waits for the checkpoint
    elif fault == "uneven":  # fixed: scenario_uneven
        for x, y in batches(STEPS + RANK):  # BUG: rank r has STEPS + r batches
            step(model, opt, x, y)
        log(f"{STEPS + RANK} batches done")
        dist.barrier()  # everyone done before the checkpoint
    elif fault == "crash":
        data = batches(STEPS)
        if RANK == WORLD - 1:
            data[2][0][3] = math.nan  # BUG: a corrupt sample in the last rank's data
        for i, (x, y) in enumerate(data):
            keep = x.isfinite().all(1) if fixed else slice(None)  # fixed: non-finite samples dropped on reading
            if not torch.isfinite(loss := step(model, opt, x[keep], y[keep])):
                raise FloatingPointError(f"loss is {loss.item()} at step {i}")
    elif fault == "same-gpu":  # DEVICE: cuda:0 on every rank when broken (main), each rank's own when fixed (setup)
        x = torch.ones(1, device=DEVICE)
        dist.all_reduce(x)
        log(f"all-reduce on {x.device} over {dist.get_backend()}: {x.item():.0f} (expected {WORLD})")


# --- running the broken program as a child job, and reading what it printed ---
def child(args, fault, timeout_s, env=None, flags=(), stacks=None):
    """torchrun --standalone, WORLD ranks, `--fault fault --broken`, none of our own job's torchrun variables;
    returns (exit code, output, seconds). `stacks` receives py-spy's dump of every rank once all logged 'step 1'."""
    ours = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ours) and k != "TORCH_DISTRIBUTED_DEBUG"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", __file__,
           "--fault", fault, "--broken", "--timeout-s", str(timeout_s), "--device", args.device, *flags]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        out = Path(d, "out")
        with open(out, "w") as f:  # a file, not a pipe: nobody blocks on a full pipe while we wait
            proc = subprocess.Popen(cmd, env={**clean, **(env or {})}, stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None and time.time() - t0 < timeout_s + 90:  # the group's timeout ends it first
            time.sleep(0.2)
            if stacks is not None and not stacks and out.read_text().count("step 1") == WORLD:
                time.sleep(1)  # every rank has reached the bad step: they wait now
                pids = dict(re.findall(r"\[rank (\d+)/\d+\] pid (\d+)", out.read_text()))
                stacks += [subprocess.run(["py-spy", "dump", "--pid", pids[str(r)]], capture_output=True, text=True,
                                          timeout=30).stdout for r in range(WORLD)]
        if proc.poll() is None:
            proc.terminate()  # the agent passes it on to its workers
        return proc.wait(), out.read_text(), time.time() - t0


def show(lines, width=150):
    for line in lines:
        print0(f"   | {line.strip()[:width]}")


def grep(text, pattern, most=4):  # the first lines of `text` that match
    return [ln for ln in text.splitlines() if re.search(pattern, ln)][:most]


def dump_flight_recorder():
    """Write this rank's Flight Recorder entries to $TORCH_FR_DUMP_TEMP_FILE<rank>, as NCCL does on a timeout:
    gloo records (torch 2.14) but does not dump, and names its group '' where the entries say '0' (renamed)."""
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    if "" in trace["pg_config"]:
        trace["pg_config"] = {"0": {**trace["pg_config"].pop(""), "name": "0", "desc": "default_pg"}}
    with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(RANK), "wb") as f:
        pickle.dump(trace, f)


def child_recorded(args, fault, timeout_s, stacks=None):
    """child() with the Flight Recorder on (each rank dumps its entries on the error), plus what torchfrtrace,
    PyTorch's analyser of those dumps, printed."""
    with tempfile.TemporaryDirectory() as d:
        rc, out, s = child(args, fault, timeout_s, stacks=stacks,
                           env={"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": f"{d}/trace_"})
        res = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", d,
                              "--allow-incomplete-ranks"], capture_output=True, text=True, cwd=d, timeout=120)
        return rc, out, s, res.stdout + res.stderr


def diagnosed(ok, what):
    """One verdict for all ranks, rank 0's (it read the child's output): every rank exits 1 alike without it."""
    verdict = [ok]
    dist.broadcast_object_list(verdict, src=0)
    if not verdict[0]:
        print0(f"FAIL: {what} did not appear")
        sys.exit(1)


# --- the scenarios: symptom, tool, fix ---
def scenario_mismatch(args):
    print0("== mismatch: rank 0 all-reduces its metrics with an extra value (lr), the others without it")
    if RANK == 0:
        rc, out, s = child(args, "mismatch", 5)
        print0(f"-- the broken run: exit {rc} after {s:.0f} s; what the ranks said:")
        show(grep(out, r"Timed out|Connection closed|^\[rank \d/\d\] (done|error)") or ["(nothing)"])
        rc, out, s = child(args, "mismatch", 5, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
        calls = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, "
                           r"OpType=(\w+), TensorShape=(\[\d*\])", out)
        print0(f"-- TORCH_DISTRIBUTED_DEBUG=DETAIL: exit {rc} after {s:.0f} s, and each rank says what differs:")
        show(sorted({f"rank {r} runs {op} of shape {shape}" for r, op, shape in calls})
             + re.findall(r"Collectives differ in the following aspects: *(.*)", out)[:1])
        ok = {"[3]", "[2]"} <= {shape for _, _, shape in calls}
    diagnosed(RANK != 0 or ok, "DETAIL's report of both shapes")
    program("mismatch", fixed=True)
    print0("OK mismatch: the broken run failed, DETAIL named both calls, the fix (the same keys on every rank) ran")


def scenario_rank0_only(args):
    print0("== rank0-only: rank 0 saves a checkpoint, then a barrier meant for every rank waits in rank 0's branch")
    if RANK == 0:
        stacks = [] if shutil.which("py-spy") else None
        rc, out, s, fr = child_recorded(args, "rank0-only", 8, stacks=stacks)
        print0(f"-- the broken run: it hangs; --timeout-s 8 turns it into an error, exit {rc} after {s:.0f} s:")
        show(grep(out, r"error: a peer died"))
        for r, dump in enumerate(stacks or []):
            frames = [m.group(1) for m in re.finditer(r"^ +(\w+ \(.*?:\d+\))", dump, re.M)]
            print0(f"-- py-spy dump --pid <rank {r}>: " + " <- ".join(frames[:3]))
        if stacks is None:
            print0("-- py-spy is not installed (pip install py-spy): the Flight Recorder's frames name the line")
        ok = stacks is None or all("barrier" in dump or "all_reduce" in dump for dump in stacks)
        print0("-- torchfrtrace on the Flight Recorder's dumps (one per rank):")
        show(grep(fr, r"Collective sequence number|^collective:|error msg|^program at", 4), 200)
        ok = ok and "Culprit rank" in fr and "barrier" in fr
    diagnosed(RANK != 0 or ok, "the Flight Recorder's culprit (or py-spy's stacks)")
    program("rank0-only", fixed=True)
    print0("OK rank0-only: the hang timed out, the Flight Recorder named rank 0's lone barrier, the fix ran")


def scenario_uneven(args):
    print0(f"== uneven: rank r has {STEPS} + r batches, so the ranks issue different numbers of all-reduces")
    if RANK == 0:
        rc, out, s, fr = child_recorded(args, "uneven", 6)
        print0(f"-- the broken run: the last step hangs; after --timeout-s 6, exit {rc} after {s:.0f} s:")
        show(grep(out, r"batches done|error: a peer died", 2 * WORLD))
        print0("-- torchfrtrace on the Flight Recorder's dumps: the first collective the ranks disagree on")
        show(grep(fr, r"Collective sequence number|error msg|^program at", 3), 200)
        ok = "COLLECTIVE_TYPE_MISMATCH" in fr and "'barrier'" in fr
    diagnosed(RANK != 0 or ok, "the Flight Recorder's per-rank collectives")
    from ddp_dropin import ManualDDP  # beside this file: 05's DDPCore plus DDP's surface, Join included
    for name, wrapper in [("PyTorch's DDP", DDP), ("ManualDDP", ManualDDP)]:
        model = wrapper(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Join([model]):  # a rank out of batches shadows the others' all-reduces (with zeros) until all are done
            for x, y in batches(STEPS + RANK):
                step(model, opt, x, y)
        dist.barrier()
        check_replicas(model)
        print0(f"-- the fix, with {name}: `with Join([model]):` around the loop; all done, replicas identical")
    print0("OK uneven: the last step hung, the Flight Recorder showed a barrier against all-reduces, Join fixed it")


def train_by_hand(seed, bn, clip_ranks, sync_buffers=False):
    """STEPS steps with 05's naive gradient average; returns the model and the last loss."""
    model = make_model(seed, bn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(STEPS):
        loss = step(model, opt, x, y, clip=RANK in clip_ranks)
        for b in model.buffers() if sync_buffers else []:
            if b.is_floating_point():  # running stats: the mean over ranks (the step counter agrees already)
                dist.all_reduce(b)
                b /= WORLD
    return model, loss


def scenario_drift(args):
    print0("== drift: gradients averaged by hand (05's naive way); three planted bugs, none of which errors")
    others, everyone = list(range(1, WORLD)), range(WORLD)
    bugs = {  # the bug: (train_by_hand's arguments, the tensor check_replicas must name, the ranks it must name)
        "no common seed": ((RANK, False, everyone), "0.weight", others),  # each rank its own init, no broadcast
        "a buffer never synced": ((0, True, everyone), "1.running_mean", others),  # each rank's own batch stats
        "a rank-only clip": ((0, False, [WORLD - 1]), "0.weight", [WORLD - 1])}  # a clip only one rank applies
    for bug, (how, expected, ranks) in bugs.items():
        model, loss = train_by_hand(*how)
        try:
            check_replicas(model)
            found = ""
        except RuntimeError as e:
            found = str(e)
        print0(f"-- {bug}: loss {loss.item():.4f}, no error; check_replicas: {found or 'quiet'}")
        diagnosed(f"differ: {expected} " in found and f"rank(s) {ranks} " in found, f"check_replicas naming {expected}")
    check_replicas(train_by_hand(0, True, everyone, sync_buffers=True)[0])  # raises if the fix were not one
    print0("OK drift: nothing errored, check_replicas named each diverged tensor; the fix (one seed, the running "
           "stats averaged, the clip on every rank): check_replicas is quiet")


def scenario_crash(args):
    print0(f"== crash: rank {WORLD - 1} meets a corrupt sample and raises; its peers wait in the next all-reduce")
    if RANK == 0:
        rc, out, s = child(args, "crash", 10)
        print0(f"-- the broken run, exit {rc} after {s:.0f} s; torchrun's summary names a rank, not the error:")
        show(grep(out[out.rfind("Root Cause"):], r"Root Cause|rank:|exitcode|error_file|traceback"), 120)
        rc, out, s = child(args, "crash", 10, flags=["--record"])
        mine = re.search(rf"rank +: {WORLD - 1} .*?(?=\n-{{9}}|\n\[\d+\]:|\Z)", out[out.rfind("Failures:"):], re.S)
        print0(f"-- with @record (exit {rc}, {s:.0f} s): rank {WORLD - 1}'s exception, from its error file:")
        ok = mine and "FloatingPointError: loss is nan at step 2" in mine.group(0)
        show(grep(mine.group(0) if mine else out, r"rank:|error_file|FloatingPointError|09_debugging.py", 6), 120)
    diagnosed(RANK != 0 or ok, "@record's root cause")
    program("crash", fixed=True)  # the fix: non-finite samples dropped where the data is read
    print0(f"OK crash: torchrun named rank {WORLD - 1}, @record put its FloatingPointError first, the fix ran")


def scenario_same_gpu(args):
    print0("== same-gpu: NCCL, but no torch.cuda.set_device(local_rank): every rank's tensors land on cuda:0")
    if DEVICE.type != "cuda":
        return print0("-- skipped: the ranks are on the CPU (a GPU per rank, or --device cuda, runs it)")
    if RANK == 0:
        rc, out, s = child(args, "same-gpu", 60, env={"NCCL_DEBUG": "INFO"})
        gpus = dict(re.findall(r" rank (\d+) nranks \d+ cudaDev \d+ nvmlDev \d+ busId (\w+)", out))
        print0(f"-- the broken run: exit {rc} after {s:.0f} s; NCCL_DEBUG=INFO names each rank's GPU by bus id:")
        show(grep(out, r"error: |Duplicate GPU", 2) + [f"rank {r}: busId {b}" for r, b in sorted(gpus.items())])
        ok = len(gpus) == WORLD and len(set(gpus.values())) < WORLD
    diagnosed(RANK != 0 or ok, "NCCL_DEBUG=INFO's bus ids, one GPU for two ranks")
    program("same-gpu", fixed=True)  # setup(): torch.cuda.set_device(local_rank) first; fewer GPUs: gloo
    print0("OK same-gpu: NCCL refused two ranks on one GPU, NCCL_DEBUG=INFO showed one bus id, set_device fixed it")


def main(args):
    if WORLD < 2:
        raise UsageError("09 needs 2 or more ranks: torchrun --nproc_per_node=2 09_debugging.py --fault all")
    global DEVICE
    if args.broken and args.fault == ["same-gpu"]:  # the bug is in the setup itself
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout_s))
        DEVICE = torch.device("cuda")  # BUG: no torch.cuda.set_device(LOCAL_RANK): the current device, cuda:0
    else:
        DEVICE = setup(args)
    if args.broken:
        log(f"pid {os.getpid()}")  # what py-spy needs
        if args.record:
            return record(program)(args.fault[0])  # what @record adds: the exception in an error file torchrun reads
        try:
            return program(args.fault[0])
        except RuntimeError:
            if "TORCH_FR_DUMP_TEMP_FILE" in os.environ:
                dump_flight_recorder()
            raise
    for fault in args.fault:
        t0 = time.time()
        globals()["scenario_" + fault.replace("-", "_")](args)  # scenario_mismatch, scenario_rank0_only, ...
        print0(f"({fault}: {time.time() - t0:.0f} s)\n")


# --- command line ---
def parse_args():
    p = Parser(__doc__)
    p.add_argument("--fault", nargs="+", choices=FAULTS + ("all",), default=["all"], help="the scenarios to run")
    p.add_argument("--broken", action="store_true", help=argparse.SUPPRESS)  # the child job: the broken program
    p.add_argument("--record", action="store_true", help=argparse.SUPPRESS)  # ... with @record on it
    args = p.parse_args()
    args.fault = list(FAULTS) if "all" in args.fault else args.fault
    return args


# --- setup: the same block in every numbered script, copied (not imported) so that each file runs on its own ---
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # torchrun sets them per process


class UsageError(Exception): ...  # a bad flag or input: one `error:` line from rank 0 (run()), exit status 2


def print0(*msg):  # the rank-0 narrative: printed once, not N times
    if RANK == 0:
        print(*msg, flush=True)


def log(*msg):  # a per-rank line, tagged, in one write so that the ranks' lines never mix
    print(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)) + "\n", end="", flush=True)


def at_least(low, kind=int, below=math.inf):  # the argparse type of a numeric flag: low <= value < below
    def parse(text):
        if not low <= kind(text) < below:
            raise argparse.ArgumentTypeError(f"must be >= {low} and < {below}, got {text}")
        return kind(text)
    return parse


class Parser(argparse.ArgumentParser):  # the flags every script shares; a bad flag raises UsageError
    def __init__(self, doc, timeout_s=120):
        super().__init__(description=doc.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        self.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: a GPU per rank")
        self.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with a GPU per rank, else gloo")
        self.add_argument("--timeout-s", type=at_least(1, float), default=timeout_s, help="how long to wait for a peer")

    def error(self, message):
        raise UsageError(message)


def setup(args):  # choose the device, then join the group; returns the device
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never asks CUDA
    per_rank = gpus >= local_world  # a GPU for every rank on this node: CUDA and NCCL (the local rank picks it)
    on_gpu = per_rank or args.device == "cuda"  # fewer GPUs: the CPU, or with --device cuda the ranks share them
    backend = args.backend or ("nccl" if per_rank else "gloo")  # NCCL cannot share a GPU between ranks; gloo can
    if (on_gpu and gpus == 0) or (backend == "nccl" and not per_rank):
        raise UsageError(f"--device {args.device} --backend {backend}: {gpus} CUDA GPU(s) for {local_world} ranks")
    device = torch.device("cuda", local_rank % gpus) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)  # before init, so that NCCL binds this rank to its GPU
    print0(f"device: {device.type}, {backend} (--device {args.device}, {gpus} GPU(s) for {local_world} ranks/node)")
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)  # plain `python`
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **alone)
    return device


def run(main, parse_args):
    try:
        main(parse_args())
    except UsageError as e:  # every rank stops alike, exit 2; rank 0 says why
        print0(f"error: {e}")
        os._exit(2)  # at once: tearing down a group that is up can abort in gloo's threads at exit (SIGABRT)
    except RuntimeError as e:  # a peer died, or a collective outlived --timeout-s: one line per rank, exit 1
        if not (isinstance(e, dist.DistError) or "gloo" in str(e)):
            raise  # a bug in the script keeps its traceback
        log(f"error: a peer died or timed out: {str(e).strip().splitlines()[0][:200]}")
        os._exit(1)  # no teardown: it would wait for the dead peer
    dist.destroy_process_group()  # main() always joins the group first (setup)
    time.sleep(0.05)  # gloo's threads drop their last tensors before the interpreter ends (else SIGABRT)


if __name__ == "__main__":
    run(main, parse_args)
