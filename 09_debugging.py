"""09 - Debugging distributed training: the hangs and disagreements every learner meets, each reproduced,
diagnosed with the real tool, and fixed.

What it teaches: one scenario per --fault, its broken program run as a child job (torchrun, as many ranks, a short
--timeout-s; the command and its environment printed): the symptom as you meet it, the tool that finds the cause
(checked to name it), then the fix, run in this job; `OK` when all three happened, exit 1 when the diagnosis did not.
  mismatch    ranks all-reduce different shapes: one dies, one sums garbage; TORCH_DISTRIBUTED_DEBUG=DETAIL names both
  rank0-only  a barrier only rank 0 reaches: a hang; stacks, the Flight Recorder and monitored_barrier each name it
  uneven      PyTorch's DDP, one rank a batch more: hangs in backward (stacks --native, Flight Recorder); Join fixes it
  drift       replicas that silently diverge, the loss fine: check_replicas() names the tensor and the ranks
  crash       one rank raises: the log has its traceback, torchrun's summary the rank, @record the exception there too
  same-gpu    (CUDA) NCCL with no torch.cuda.set_device: every rank on cuda:0; NCCL_DEBUG=INFO shows it
The tools are debug_tools.py's, beside this file, for your own job too: check_replicas(model, optimizer), `fr DIR`,
flight_recorder(DIR), `debug_tools.py stacks PID` (py-spy; without it skipped, and said). More: docs/debugging.md.

  CPU:        torchrun --nproc_per_node=2 09_debugging.py --fault mismatch        (or 3 ranks; --fault all)
  GPUs:       torchrun --nproc_per_node=N 09_debugging.py --fault all      (fewer GPUs than ranks: add --device cuda)
  The broken program alone, to try the tools on it:
              torchrun --nproc_per_node=2 09_debugging.py --fault uneven --broken --timeout-s 300
"""

import argparse
import math
import os
import re
import shlex
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # debug_tools.py and ddp_dropin.py live beside this file
from debug_tools import check_replicas, find_py_spy, flight_recorder, group_for_ddp  # noqa: E402  (your job's tools)

FAULTS = ("mismatch", "rank0-only", "uneven", "drift", "crash", "same-gpu")
BATCH, STEPS = 8, 4
DEVICE = torch.device("cpu")  # main() sets it from setup(): the models and batches follow the chosen device


# --- the programs: a small model trained on every rank's own batches ---
def log(*msg):  # a line from this rank, tagged, in one write so that the ranks' lines never mix
    print(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)) + "\n", end="", flush=True)


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


def program(fault, fixed=False, monitored=False):
    """The program as a user writes it: the child job runs it broken (--broken), the scenario then fixed."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if fault == "mismatch":
        # DDP on a group of its own: under TORCH_DISTRIBUTED_DEBUG=DETAIL, DDP's constructor segfaults on gloo
        # (torch 2.14) on the checked group DETAIL makes; this one DETAIL leaves alone, and it checks the rest.
        model = DDP(model, process_group=group_for_ddp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        metrics = {"loss": step(model, opt, *batches(1)[0]).item(), "samples": BATCH}
        if RANK == 0 and not fixed:
            metrics["lr"] = 0.1  # BUG: logged by rank 0 only, its tensor has 3 values, the others' 2
        totals = torch.tensor(list(metrics.values()), device=DEVICE)
        dist.all_reduce(totals)  # fixed: the same keys everywhere, lr logged apart
        log(f"all-reduced {list(metrics)}: {[round(v, 3) for v in totals.tolist()]}")
    elif fault == "rank0-only":
        for i, (x, y) in enumerate(batches(STEPS)):
            step(model, opt, x, y)
            if not fixed:
                log(f"step {i}")  # the training log (and the moment `stacks` waits for)
            if i == 1 and RANK == 0:
                torch.save(model.state_dict(), os.devnull)  # the checkpoint
                if monitored:  # gloo's barrier that names the ranks that never came, after its own timeout
                    dist.monitored_barrier(timeout=timedelta(seconds=4), wait_all_ranks=True)
                elif not fixed:
                    dist.barrier()  # BUG: meant for every rank, indented into rank 0's branch
            if i == 1 and fixed:
                dist.barrier()  # fixed: every rank waits for the checkpoint
    elif fault == "uneven":  # fixed: scenario_uneven
        model = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        n = STEPS + 1 if RANK == WORLD - 1 else STEPS  # BUG: the last rank's share of the data has a batch more
        for x, y in batches(n):
            step(model, opt, x, y)
        log(f"{n} batches done")
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


# --- running the broken program as a child job, and the tools on it ---
def child(args, fault, timeout_s, env=None, flags=(), stacks_when=None, native=False, stop=None):
    """Run and print `torchrun --standalone` on WORLD ranks, `--fault fault --broken`, without our torchrun variables;
    returns (exit code, output, seconds, stacks). `stacks_when` (pattern, count): once `count` output lines match,
    `python debug_tools.py stacks <torchrun's pid>` runs; the job is stopped as soon as `stop()` says so."""
    ours = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_", "TORCHELASTIC_")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ours) and k != "TORCH_DISTRIBUTED_DEBUG"}
    argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", Path(__file__).name,
            "--fault", fault, "--broken", "--timeout-s", str(timeout_s), "--device", args.device, *flags]
    print0("   $ " + shlex.join([*(f"{k}={v}" for k, v in (env or {}).items()), "python", *argv]))
    t0, stacks = time.time(), ""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d, "out")
        with open(out, "w") as f:  # a file, not a pipe: nobody blocks on a full pipe while we wait
            proc = subprocess.Popen([sys.executable, *argv], cwd=HERE, env={**clean, **(env or {})}, stdout=f,
                                    stderr=subprocess.STDOUT)
        while proc.poll() is None and time.time() - t0 < timeout_s + 90:  # the group's timeout ends it first
            time.sleep(0.2)
            if stacks_when and not stacks and len(re.findall(stacks_when[0], out.read_text())) >= stacks_when[1]:
                time.sleep(1)  # they wait now
                stacks = tool("stacks", str(proc.pid), *(["--native"] if native else []))
            if stop and (stacks or not stacks_when) and stop():
                break
        if proc.poll() is None:
            proc.terminate()  # the agent passes it on to its workers
        return proc.wait(), out.read_text(), time.time() - t0, stacks


def tool(*argv):
    """`python debug_tools.py ARGV`, printed as run; returns what it printed."""
    print0("   $ " + shlex.join(["python", "debug_tools.py", *argv]))
    res = subprocess.run([sys.executable, str(HERE / "debug_tools.py"), *argv], capture_output=True, text=True,
                         timeout=300)
    return res.stdout + res.stderr


def show(lines, width=150):
    for line in lines:
        print0(f"   | {line.strip()[:width]}")


def grep(text, pattern, most=4):  # the first lines of `text` that match
    return [ln for ln in text.splitlines() if re.search(pattern, ln)][:most]


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
        rc, out, s, _ = child(args, "mismatch", 5)
        print0(f"-- the broken run: exit {rc} after {s:.0f} s; what each rank said (a rank that printed a sum got "
               "one made of the wrong values, and exited 0):")
        show(grep(out, r"^\[rank \d/\d\] all-reduced|^\[rank\d+\]: \w*Error", 2 * WORLD))
        env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_SHOW_CPP_STACKTRACES": "1"}
        rc, out, s, _ = child(args, "mismatch", 5, env=env)
        calls = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=\d+, "
                           r"OpType=(\w+), TensorShape=(\[\d*\])", out)
        print0(f"-- DETAIL: exit {rc} after {s:.0f} s; each rank's error names the call of every rank:")
        show(sorted({f"rank {r} runs {op} of shape {shape}" for r, op, shape in calls}))
        print0("-- TORCH_SHOW_CPP_STACKTRACES=1 adds the C++ frames under the error (here: DETAIL's check):")
        show(grep(out, r"Exception raised from|c10d::ProcessGroupWrapper::runCollectiveChecks", 2))
        ok = {"[3]", "[2]"} <= {shape for _, _, shape in calls}
    diagnosed(RANK != 0 or ok, "DETAIL's report of both shapes")
    program("mismatch", fixed=True)
    print0("OK mismatch: the broken run failed, DETAIL named both calls, the fix (the same keys on every rank) ran")


def where_lines(stacks):  # the last lines `debug_tools.py stacks` prints: one per rank, where it waits
    return [ln for ln in stacks.split("where each rank is")[-1].splitlines() if ln.strip().startswith("rank ")]


def hang(args, fault, timeout_s, stacks_when, native=False, analyser=False):
    """The broken program in flight_recorder(DIR) (2 s makes a hang): stacks once it hangs (where py-spy is found),
    then `fr DIR` (and torch's analyser). Returns (where each rank waits, None without py-spy; what fr said)."""
    with tempfile.TemporaryDirectory() as d:
        stacks_when = stacks_when if find_py_spy() else None
        rc, out, s, stacks = child(args, fault, timeout_s, flags=["--fr", d], stacks_when=stacks_when, native=native,
                                   stop=lambda: len(list(Path(d).glob("rank_*[0-9]"))) == WORLD)  # all written
        print0(f"-- the broken run hangs (no error for --timeout-s {timeout_s}; stopped after {s:.0f} s)"
               + ("; where each rank waits:" if stacks_when else ""))
        if stacks_when:
            show(where_lines(stacks), 200)
        else:  # the lesson goes on with the tools that need nothing installed
            print0("   (stacks skipped: py-spy not found; pip install py-spy to see every rank's stack)")
        fr = tool("fr", d, *(["--torch"] if analyser else []))
    print0("-- what each rank's flight_recorder() wrote once a collective had waited 2 s"
           + (", then torch's analyser:" if analyser else ":"))
    ours = fr.split("\ntorch's own")[0]
    show(ours[ours.find("the ranks part"):].splitlines() + grep(fr, r"error msg: Culprit", 1), 200)
    waits = {int(ln.split()[1][:-1]): ln for ln in where_lines(stacks)} if stacks_when else None
    return waits, fr


def scenario_rank0_only(args):
    print0("== rank0-only: rank 0 saves a checkpoint, then a barrier meant for every rank waits in rank 0's branch")
    if RANK == 0:
        waits, fr = hang(args, "rank0-only", 60, stacks_when=(r"\] step 1\b", WORLD), analyser=True)
        print0("   torch's 'Culprit rank R': R's call differs from that of the rank whose record it read first, "
               "which may be the one at fault: read which call each rank made (above: rank 0 alone in barrier)")
        rc, out, s, _ = child(args, "rank0-only", 30, flags=["--monitored", "--backend", "gloo"])
        print0("-- dist.monitored_barrier(timeout=4 s) in the barrier's place (gloo): rank 0 names who never came:")
        show(grep(out, r"failed to pass monitoredBarrier", 1))
        ok = "rank(s) [0]: gloo:barrier" in fr and "monitoredBarrier" in out and \
            (waits is None or " in barrier" in waits.get(0, ""))
    tools = "stacks, the Flight Recorder and monitored_barrier" if find_py_spy() else \
        "the Flight Recorder and monitored_barrier (stacks skipped: no py-spy)"
    diagnosed(RANK != 0 or ok, f"{tools}' naming of rank 0's barrier")
    program("rank0-only", fixed=True)
    print0(f"OK rank0-only: {tools} each named rank 0's lone barrier; the fix ran")


def scenario_uneven(args):
    last = WORLD - 1
    print0(f"== uneven: PyTorch's DDP; rank {last}'s share of the data has {STEPS + 1} batches, the others' {STEPS}")
    if RANK == 0:
        waits, fr = hang(args, "uneven", 60, stacks_when=(r"batches done", last), native=True)
        print0(f"   rank {last} waits inside loss.backward(): DDP's reducer all-reduces the gradients there, "
               "and the others, out of data, wait in the barrier after the loop")
        ok = f"rank(s) {list(range(last))}: gloo:barrier" in fr and f"rank(s) [{last}]: gloo:all_reduce" in fr and \
            (waits is None or "Tensor.backward <- c10d::Reducer" in waits.get(last, "")
             and all(" in barrier" in waits.get(r, "") for r in range(last)))
        rc, out, s, _ = child(args, "uneven", 10, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
        said = ": no segfault in DDP's constructor here (there is one on gloo in torch 2.14)"
        if re.search(r"exitcode: -11", out):
            said = (", a segfault (exit code -11) in DDP's constructor, nothing printed (torch 2.14 on gloo). What "
                    "works: stacks or the Flight Recorder, above, for DDP's own wait; DETAIL for your other "
                    "collectives, with DDP(model, process_group=debug_tools.group_for_ddp()) (mismatch runs so)")
        print0(f"-- TORCH_DISTRIBUTED_DEBUG=DETAIL on it: exit {rc} after {s:.0f} s{said}")
    tools = "stacks (DDP's reducer) and the Flight Recorder" if find_py_spy() else \
        "the Flight Recorder (stacks skipped: no py-spy)"
    diagnosed(RANK != 0 or ok, f"{tools} naming rank {last} in backward's all-reduce")
    from ddp_dropin import ManualDDP  # beside this file: 05's DDPCore plus DDP's surface, Join included
    for name, wrapper in [("PyTorch's DDP", DDP), ("ManualDDP", ManualDDP)]:
        model = wrapper(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Join([model]):  # a rank out of batches shadows the others' all-reduces (with zeros) until all are done
            for x, y in batches(STEPS + 1 if RANK == last else STEPS):
                step(model, opt, x, y)
        dist.barrier()
        check_replicas(model)
        print0(f"-- the fix, with {name}: `with Join([model]):` around the loop; all done, replicas identical")
    print0(f"OK uneven: {tools} found the hang in rank {last}'s backward, Join fixed it")


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
        print0(f"-- {bug}: loss {loss.item():.4f}, no error; check_replicas: {'' if found else 'quiet'}")
        show(found.splitlines()[:3], 200)
        named = re.search(rf"(: |\n  ){re.escape(expected)} \(.*\) on rank\(s\) {re.escape(str(ranks))} ", found)
        diagnosed(bool(named), f"check_replicas naming {expected}")
    print0("-- the fix (one seed, the running stats averaged, the clip on every rank): check_replicas says "
           + check_replicas(train_by_hand(0, True, everyone, sync_buffers=True)[0]))  # raises if it were not a fix
    print0("OK drift: nothing errored, check_replicas named each diverged tensor; after the fix it is quiet")


def scenario_crash(args):
    last = WORLD - 1
    print0(f"== crash: rank {last} meets a corrupt sample and raises; its peers wait in the next all-reduce")
    if RANK == 0:
        rc, out, s, _ = child(args, "crash", 10)
        print0(f"-- the broken run: exit {rc} after {s:.0f} s. Its log already holds rank {last}'s traceback, "
               "written as it died (torchrun tags each line with the rank):")
        show(grep(out, rf"^\[rank{last}\]:( +File .*, in program|\s*\w+Error: )", 2), 120)
        print0("-- torchrun's summary at the end names the failed ranks and exit codes, not the exception:")
        show(grep(out[out.rfind("Failures:"):], r"rank +:|exitcode|error_file|traceback", 2 * WORLD), 120)
        rc, out, s, _ = child(args, "crash", 10, flags=["--record"])
        mine = re.search(rf"rank +: {last} .*?(?=\n-{{9}}|\n\[\d+\]:|\Z)", out[out.rfind("Failures:"):], re.S)
        print0(f"-- with @record on the program (exit {rc}, {s:.0f} s): an error file per rank, which the summary "
               f"reads, so rank {last}'s block holds its exception too (where the ranks' logs are out of sight):")
        ok = mine and "FloatingPointError: loss is nan at step 2" in mine.group(0)
        show(grep(mine.group(0) if mine else out, r"rank:|error_file|FloatingPointError|09_debugging.py", 6), 120)
    diagnosed(RANK != 0 or ok, "@record's root cause")
    program("crash", fixed=True)  # the fix: non-finite samples dropped where the data is read
    print0(f"OK crash: the log and torchrun named rank {last}, @record put its FloatingPointError in the summary, "
           "the fix ran")


def scenario_same_gpu(args):
    print0("== same-gpu: NCCL, but no torch.cuda.set_device(local_rank): every rank's tensors land on cuda:0")
    if DEVICE.type != "cuda":
        return print0("-- skipped: the ranks are on the CPU (a GPU per rank, or --device cuda, runs it)")
    if RANK == 0:
        rc, out, s, _ = child(args, "same-gpu", 60, env={"NCCL_DEBUG": "INFO"})
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
    if args.broken and args.record:
        return record(program)(args.fault[0])  # what @record adds: the exception in an error file torchrun reads
    if args.broken and args.fr:
        with flight_recorder(args.fr, hang_s=2):  # each rank's record: after a 2 s wait, on an error, at the end
            return program(args.fault[0])
    if args.broken:
        return program(args.fault[0], monitored=args.monitored)
    for fault in args.fault:
        t0 = time.time()
        globals()["scenario_" + fault.replace("-", "_")](args)  # scenario_mismatch, scenario_rank0_only, ...
        print0(f"({fault}: {time.time() - t0:.0f} s)\n")


# --- command line ---
def parse_args():
    p = Parser(__doc__, timeout_s=600)  # the other ranks wait in a collective while rank 0 runs a child job
    p.add_argument("--fault", nargs="+", choices=FAULTS + ("all",), default=["all"], help="the scenarios to run")
    p.add_argument("--broken", action="store_true", help="one scenario's broken program alone: try the tools on it")
    p.add_argument("--record", action="store_true", help="with --broken: the program under torch's @record")
    p.add_argument("--fr", metavar="DIR", help="with --broken: the program in debug_tools.flight_recorder(DIR)")
    p.add_argument("--monitored", action="store_true", help="with --broken --fault rank0-only: monitored_barrier")
    args = p.parse_args()
    if args.broken and (len(args.fault) != 1 or args.fault == ["all"]):
        p.error("--broken runs one scenario's program: name it, e.g. --fault uneven")
    args.fault = list(FAULTS) if "all" in args.fault else args.fault
    return args


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
