"""09 - Debugging distributed training, when it hangs or the replicas disagree.

Each scenario plants one fault, finds it with the real tool, and fixes it. The broken program runs
first, as a child job with a short timeout, and you see the symptom. Then the tool runs, and the
script checks that it named the cause. Last, the fixed program runs in this job, and the script
checks that it works. It prints `OK` when all three happened, and exits 1 when a diagnosis fails.
  mismatch    Ranks all-reduce different shapes. TORCH_DISTRIBUTED_DEBUG=DETAIL names both.
  rank0-only  A barrier that only rank 0 reaches hangs. stacks, fr and monitored_barrier find it.
  uneven      Under PyTorch's DDP, one rank has a batch more and hangs in backward. Join fixes it.
  drift       The replicas drift apart, and nothing errors. check_replicas names the tensors.
  crash       One rank raises. The log has its traceback, and @record puts it in torchrun's summary.
  same-gpu    (CUDA only) NCCL without torch.cuda.set_device puts every rank on cuda:0.
The tools are in debug_tools.py, beside this file, and they work on your own job too. The `stacks`
tool needs py-spy; without it the scenarios skip it and say so. More is in docs/debugging.md.

  CPU:   torchrun --nproc_per_node=2 09_debugging.py --fault mismatch    (or 3 ranks; --fault all)
  GPUs:  torchrun --nproc_per_node=N 09_debugging.py --fault all   (fewer GPUs: add --device cuda)
  One broken program alone, to try the tools on it by hand:
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
from debug_tools import check_replicas, find_py_spy, flight_recorder, group_for_ddp  # noqa: E402

FAULTS = ("mismatch", "rank0-only", "uneven", "drift", "crash", "same-gpu")
BATCH, STEPS = 8, 4
DEVICE = torch.device("cpu")  # main() sets it from setup(), and the models and batches follow it


# --- the programs: a small model trained on every rank's own batches ---
def log(*msg):  # a line from this rank, tagged and written in one piece, so ranks never mix lines
    print(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)) + "\n", end="", flush=True)


def make_model(seed=0, bn=False):
    torch.manual_seed(seed)  # one seed on every rank makes identical replicas
    layers = [nn.Linear(8, 16), *([nn.BatchNorm1d(16)] if bn else []), nn.ReLU(), nn.Linear(16, 1)]
    return nn.Sequential(*layers).to(DEVICE)


def batches(n, rank=None):
    g = torch.Generator().manual_seed(RANK if rank is None else rank)  # each rank its own data
    return [(torch.randn(BATCH, 8, generator=g).to(DEVICE),
             torch.randn(BATCH, 1, generator=g).to(DEVICE)) for _ in range(n)]


def step(model, opt, x, y, clip=False):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)  # BatchNorm's running stats see this rank's batch
    loss.backward()
    if not isinstance(model, Joinable):  # DDP and ManualDDP average in backward, a plain model here
        for p in model.parameters():  # 05's naive average, one all-reduce per parameter
            dist.all_reduce(p.grad)  # the sum over the ranks
            p.grad /= WORLD  # and the sum divided, to make the mean
    if clip:  # drift's planted bug clips on some ranks only
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    opt.step()
    return loss


def program(fault, fixed=False, monitored=False, wrapper=DDP):
    """The program as a user writes it. The child job runs it broken (--broken). The scenario then
    runs it fixed, in this job, and checks the model it returns."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if fault == "mismatch":
        # Under TORCH_DISTRIBUTED_DEBUG=DETAIL, DDP's constructor segfaults on gloo (torch 2.14).
        # DDP on a group that DETAIL leaves alone avoids it, and DETAIL still checks the rest.
        model = DDP(model, process_group=group_for_ddp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        metrics = {"loss": step(model, opt, *batches(1)[0]).item(), "samples": BATCH}
        if RANK == 0 and not fixed:
            metrics["lr"] = 0.1  # BUG. Rank 0 alone logs lr, so it sends 3 values and the others 2.
        totals = torch.tensor(list(metrics.values()), device=DEVICE)
        dist.all_reduce(totals)  # The fix logs the same keys on every rank.
        log(f"all-reduced {list(metrics)}: {[round(v, 3) for v in totals.tolist()]}")
    elif fault == "rank0-only":
        for i, (x, y) in enumerate(batches(STEPS)):
            step(model, opt, x, y)
            if not fixed:
                log(f"step {i}")  # the training log, which also tells `stacks` when to look
            if i == 1 and RANK == 0:
                torch.save(model.state_dict(), os.devnull)  # the checkpoint
                if monitored:  # gloo's barrier that names the ranks that never came
                    dist.monitored_barrier(timeout=timedelta(seconds=4), wait_all_ranks=True)
                elif not fixed:
                    dist.barrier()  # BUG. A barrier meant for every rank sits in rank 0's branch.
            if i == 1 and fixed:
                dist.barrier()  # The fix. Every rank waits for the checkpoint.
    elif fault == "uneven":
        model = wrapper(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        n = STEPS + 1 if RANK == WORLD - 1 else STEPS  # BUG. The last rank has a batch more.
        with Join([model], enable=fixed):  # The fix. A rank out of data joins the others' calls.
            for x, y in batches(n):
                step(model, opt, x, y)
        if not fixed:
            log(f"{n} batches done")
        dist.barrier()  # everyone is done before the checkpoint
    elif fault == "crash":
        data = batches(STEPS)
        if RANK == WORLD - 1:
            data[2][0][3] = math.nan  # BUG. A corrupt sample in the last rank's data.
        for i, (x, y) in enumerate(data):
            keep = x.isfinite().all(1) if fixed else slice(None)  # The fix drops bad samples.
            if not torch.isfinite(loss := step(model, opt, x[keep], y[keep])):
                raise FloatingPointError(f"loss is {loss.item()} at step {i}")
    elif fault == "same-gpu":  # main() puts every rank on cuda:0 when broken. setup() fixes it.
        x = torch.ones(1, device=DEVICE)
        dist.all_reduce(x)
        log(f"all-reduce on {x.device} over {dist.get_backend()}: {x.item():.0f}, expected {WORLD}")
    return model


# --- running the broken program as a child job, and the tools on it ---
def child(args, fault, timeout_s, env=None, flags=(), stacks_when=None, native=False, stop=None):
    """Run `--fault FAULT --broken` under `torchrun --standalone` on WORLD ranks, and print the
    command. Return (exit code, output, seconds, stacks). With stacks_when=(pattern, count), run
    `debug_tools.py stacks` once that many output lines match. Stop the job once stop() is true."""
    ours = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_",
            "TORCHELASTIC_", "TORCH_DISTRIBUTED_DEBUG")  # this job's, not for the child
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
            Path(__file__).name, "--fault", fault, "--broken", "--timeout-s", str(timeout_s),
            "--device", args.device, *flags]
    print0("   $ " + shlex.join([*(f"{k}={v}" for k, v in (env or {}).items()), "python", *argv]))
    t0, stacks = time.time(), ""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d, "out")
        with open(out, "w") as f:  # a file, not a pipe, so that no rank blocks on a full pipe
            proc = subprocess.Popen([sys.executable, *argv], cwd=HERE, env={**clean, **(env or {})},
                                    stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None and time.time() - t0 < timeout_s + 90:  # its own timeout ends it
            time.sleep(0.2)
            if stacks_when and not stacks and \
                    len(re.findall(stacks_when[0], out.read_text())) >= stacks_when[1]:
                time.sleep(1)  # they wait now
                stacks = tool("stacks", str(proc.pid), *(["--native"] if native else []))
            if stop and (stacks or not stacks_when) and stop():
                break
        if proc.poll() is None:
            proc.terminate()  # the agent passes it on to its workers
        return proc.wait(), out.read_text(), time.time() - t0, stacks


def tool(*argv):
    """Run `python debug_tools.py ARGV`, print the command, and return what it printed."""
    print0("   $ " + shlex.join(["python", "debug_tools.py", *argv]))
    res = subprocess.run([sys.executable, str(HERE / "debug_tools.py"), *argv], capture_output=True,
                         text=True, timeout=300)
    return res.stdout + res.stderr


def show(lines, width=150):
    for line in lines:
        print0(f"   | {line.strip()[:width]}")


def grep(text, pattern, most=4):  # the first lines of `text` that match
    return [ln for ln in text.splitlines() if re.search(pattern, ln)][:most]


def diagnosed(ok, failure):
    """Rank 0 read the child's output, so its verdict counts. Every rank receives it, so that all
    ranks exit 1 alike when the diagnosis is missing."""
    verdict = [ok]
    dist.broadcast_object_list(verdict, src=0)
    if not verdict[0]:
        print0(f"FAIL: {failure}")
        sys.exit(1)


# --- the scenarios: symptom, tool, fix ---
def scenario_mismatch(args):
    print0("== mismatch: rank 0 all-reduces its metrics with an extra value (lr), the others not")
    if RANK == 0:
        rc, out, s, _ = child(args, "mismatch", 5)
        print0(f"-- the broken run: exit {rc} after {s:.0f} s. What each rank said (a rank that "
               "printed a sum got one made of the wrong values, and exited 0):")
        show(grep(out, r"^\[rank \d/\d\] all-reduced|^\[rank\d+\]: \w*Error", 2 * WORLD))
        env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_SHOW_CPP_STACKTRACES": "1"}
        rc, out, s, _ = child(args, "mismatch", 5, env=env)
        calls = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(Sequence"
                           r"Number=\d+, OpType=(\w+), TensorShape=(\[\d*\])", out)
        print0(f"-- DETAIL: exit {rc} after {s:.0f} s. Each rank's error names every rank's call:")
        show(sorted({f"rank {r} runs {op} of shape {shape}" for r, op, shape in calls}))
        print0("-- TORCH_SHOW_CPP_STACKTRACES=1 adds the C++ frames under the error (DETAIL's):")
        show(grep(out, r"Exception raised from|c10d::ProcessGroupWrapper::runCollectiveChecks", 2))
        ok = {"[3]", "[2]"} <= {shape for _, _, shape in calls}
    diagnosed(RANK != 0 or ok, "DETAIL did not report both shapes")
    check_replicas(program("mismatch", fixed=True))  # the fix must leave identical replicas
    print0("OK mismatch: the broken run failed, DETAIL named both calls, the fix (the same keys on "
           "every rank) ran, replicas identical")


def where_lines(stacks):  # the last lines `debug_tools.py stacks` prints, where each rank waits
    return [ln for ln in stacks.split("where each rank is")[-1].splitlines()
            if ln.strip().startswith("rank ")]


def hang(args, fault, timeout_s, stacks_when, native=False, analyser=False):
    """Run the broken program inside flight_recorder(DIR), where a 2 s wait counts as a hang. Run
    `stacks` once it hangs (with py-spy only), then `fr DIR`, and torch's analyser if asked.
    Returns ({rank: where it waits}, or None without py-spy; what `fr` said)."""
    with tempfile.TemporaryDirectory() as d:
        stacks_when = stacks_when if find_py_spy() else None
        rc, out, s, stacks = child(args, fault, timeout_s, flags=["--fr", d], native=native,
                                   stacks_when=stacks_when,
                                   stop=lambda: len(list(Path(d).glob("rank_*[0-9]"))) == WORLD)
        print0(f"-- the broken run hangs (no error for --timeout-s {timeout_s}; stopped after "
               f"{s:.0f} s)" + (". Where each rank waits:" if stacks_when else ""))
        if stacks_when:
            show(where_lines(stacks), 200)
        else:  # the lesson goes on with the tools that need nothing installed
            print0("   (stacks skipped: py-spy not found. pip install py-spy to see every rank's "
                   "stack.)")
        fr = tool("fr", d, *(["--torch"] if analyser else []))
    print0("-- what each rank's flight_recorder() wrote once a collective had waited 2 s"
           + (", then torch's analyser:" if analyser else ":"))
    ours = fr.split("\ntorch's own")[0]
    show(ours[ours.find("the ranks part"):].splitlines() + grep(fr, r"error msg: Culprit", 1), 200)
    waits = {int(ln.split()[1][:-1]): ln for ln in where_lines(stacks)} if stacks_when else None
    return waits, fr


def scenario_rank0_only(args):
    print0("== rank0-only: rank 0 saves a checkpoint, then waits in a barrier meant for every rank")
    if RANK == 0:
        waits, fr = hang(args, "rank0-only", 60, stacks_when=(r"\] step 1\b", WORLD), analyser=True)
        print0("   torch's 'Culprit rank R' means that R's call differs from that of the rank it "
               "read first. Read which call each rank made instead (above: rank 0 in barrier).")
        rc, out, s, _ = child(args, "rank0-only", 30, flags=["--monitored", "--backend", "gloo"])
        print0("-- dist.monitored_barrier(timeout=4 s) in the barrier's place (gloo). Rank 0 names "
               "the ranks that never came:")
        show(grep(out, r"failed to pass monitoredBarrier", 1))
        ok = "rank(s) [0]: gloo:barrier" in fr and "monitoredBarrier" in out and \
            (waits is None or " in barrier" in waits.get(0, ""))
    tools = "stacks, the Flight Recorder and monitored_barrier" if find_py_spy() else \
        "the Flight Recorder and monitored_barrier (stacks skipped: no py-spy)"
    diagnosed(RANK != 0 or ok, f"{tools} did not name rank 0's barrier")
    check_replicas(program("rank0-only", fixed=True))
    print0(f"OK rank0-only: {tools} each named rank 0's lone barrier; fixed, replicas identical")


def scenario_uneven(args):
    last = WORLD - 1
    print0(f"== uneven: PyTorch's DDP. Rank {last} has {STEPS + 1} batches, the others {STEPS}.")
    if RANK == 0:
        waits, fr = hang(args, "uneven", 60, stacks_when=(r"batches done", last), native=True)
        print0(f"   Rank {last} waits inside loss.backward(), where DDP's reducer all-reduces the "
               "gradients. The others, out of data, wait in the barrier after the loop.")
        ok = f"rank(s) {list(range(last))}: gloo:barrier" in fr and \
            f"rank(s) [{last}]: gloo:all_reduce" in fr and \
            (waits is None or "Tensor.backward <- c10d::Reducer" in waits.get(last, "")
             and all(" in barrier" in waits.get(r, "") for r in range(last)))
        rc, out, s, _ = child(args, "uneven", 10, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
        said = ". No segfault in DDP's constructor here (there is one on gloo in torch 2.14)."
        if re.search(r"exitcode: -11", out):
            said = (", a segfault (exit code -11) in DDP's constructor, nothing printed (torch "
                    "2.14 on gloo). Use stacks or the Flight Recorder for DDP's own wait. For your "
                    "other calls, DETAIL works with DDP(model, process_group=group_for_ddp()).")
        print0(f"-- TORCH_DISTRIBUTED_DEBUG=DETAIL on it: exit {rc} after {s:.0f} s{said}")
    tools = "stacks (DDP's reducer) and the Flight Recorder" if find_py_spy() else \
        "the Flight Recorder (stacks skipped: no py-spy)"
    diagnosed(RANK != 0 or ok, f"{tools} did not name rank {last} in backward")
    from ddp_dropin import ManualDDP  # 05's DDPCore plus DDP's interface, Join included
    for name, wrapper in [("PyTorch's DDP", DDP), ("ManualDDP", ManualDDP)]:
        check_replicas(program("uneven", fixed=True, wrapper=wrapper))
        print0(f"-- the fix with {name}: `with Join([model]):` around the loop; replicas identical")
    print0(f"OK uneven: {tools} found the hang in rank {last}'s backward, Join fixed it")


def train_by_hand(seed, bn, clip_ranks, sync_buffers=False):
    """STEPS steps with 05's naive gradient average. Returns the model and the last loss."""
    model = make_model(seed, bn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(STEPS):
        loss = step(model, opt, x, y, clip=RANK in clip_ranks)
        for b in model.buffers() if sync_buffers else []:
            if b.is_floating_point():  # the running stats, averaged. The step counts agree already.
                dist.all_reduce(b)
                b /= WORLD
    return model, loss


def one_process():
    """One process that trains on every rank's batches, with the mean of their losses."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for pairs in zip(*(batches(STEPS, rank=r) for r in range(WORLD))):
        opt.zero_grad()
        (sum(nn.functional.mse_loss(model(x), y) for x, y in pairs) / WORLD).backward()
        opt.step()
    return model


def scenario_drift(args):
    print0("== drift: gradients averaged by hand (05's naive way). Three bugs, and none errors.")
    others, everyone = list(range(1, WORLD)), range(WORLD)
    bugs = {  # the bug: (train_by_hand's arguments, the tensor and the ranks check_replicas names)
        "no common seed": ((RANK, False, everyone), "0.weight", others),  # each rank its own init
        "a buffer never synced": ((0, True, everyone), "1.running_mean", others),  # BatchNorm's
        "a rank-only clip": ((0, False, [WORLD - 1]), "0.weight", [WORLD - 1])}  # one rank clips
    for bug, (how, expected, ranks) in bugs.items():
        model, loss = train_by_hand(*how)
        try:
            check_replicas(model)
            found = ""
        except RuntimeError as e:
            found = str(e)
        print0(f"-- {bug}: loss {loss.item():.4f}, no error; check_replicas: "
               + ("" if found else "quiet"))
        show(found.splitlines()[:3], 200)
        named = re.search(rf"(: |\n  ){re.escape(expected)} \(.*\) on rank\(s\) "
                          rf"{re.escape(str(ranks))} ", found)
        diagnosed(bool(named), f"check_replicas did not name {expected}")
    print0("-- the fix (one seed, the running stats averaged, the clip on every rank). "
           "check_replicas says " + check_replicas(train_by_hand(0, True, everyone, True)[0]))
    # Identical replicas can still be wrong. A sum in place of the mean is the same on every rank.
    pairs = zip(train_by_hand(0, False, [])[0].parameters(), one_process().parameters())
    gap = max((a - b).abs().max().item() for a, b in pairs)
    print0(f"-- Identical replicas can still be wrong. One process trained on all {WORLD} ranks' "
           f"batches reaches the same weights, within {gap:.1e}.")
    diagnosed(gap < 1e-5, "the average is not the mean of every rank's gradient")
    print0("OK drift: nothing errored, check_replicas named each diverged tensor, the fix is quiet "
           "and equals one process")


def scenario_crash(args):
    last = WORLD - 1
    print0(f"== crash: rank {last} meets a corrupt sample and raises. Its peers wait in the next "
           "all-reduce.")
    if RANK == 0:
        rc, out, s, _ = child(args, "crash", 10)
        print0(f"-- the broken run: exit {rc} after {s:.0f} s. Its log already holds rank {last}'s "
               "traceback, written as it died (torchrun tags each line with the rank):")
        show(grep(out, rf"^\[rank{last}\]:( +File .*, in program|\s*\w+Error: )", 2), 120)
        print0("-- torchrun's summary at the end names the failed ranks and exit codes, not the "
               "error:")
        summary = out[out.rfind("Failures:"):]
        show(grep(summary, r"rank +:|exitcode|error_file|traceback", 2 * WORLD), 120)
        rc, out, s, _ = child(args, "crash", 10, flags=["--record"])
        summary = out[out.rfind("Failures:"):]
        mine = re.search(rf"rank +: {last} .*?(?=\n-{{9}}|\n\[\d+\]:|\Z)", summary, re.S)
        print0(f"-- with @record on the program (exit {rc}, {s:.0f} s). Each rank writes an error "
               f"file, which the summary reads. So rank {last}'s block holds its exception too:")
        ok = mine and "FloatingPointError: loss is nan at step 2" in mine.group(0)
        show(grep(mine.group(0) if mine else out,
                  r"rank:|error_file|FloatingPointError|09_debugging.py", 6), 120)
    diagnosed(RANK != 0 or ok, "@record did not put the error in the summary")
    check_replicas(program("crash", fixed=True))  # it drops non-finite samples as it reads them
    print0(f"OK crash: the log and torchrun named rank {last}, @record put its FloatingPointError "
           "in the summary, the fix ran, replicas identical")


def scenario_same_gpu(args):
    print0("== same-gpu: NCCL, but no torch.cuda.set_device(local_rank). All ranks use cuda:0.")
    if DEVICE.type != "cuda":
        return print0("-- skipped: the ranks are on the CPU (a GPU per rank, or --device cuda, "
                      "runs it)")
    if RANK == 0:
        rc, out, s, _ = child(args, "same-gpu", 60, env={"NCCL_DEBUG": "INFO"})
        gpus = dict(re.findall(r" rank (\d+) nranks \d+ cudaDev \d+ nvmlDev \d+ busId (\w+)", out))
        print0(f"-- the broken run: exit {rc} after {s:.0f} s. NCCL_DEBUG=INFO names each rank's "
               "GPU by bus id:")
        show(grep(out, r"error: |Duplicate GPU", 2)
             + [f"rank {r}: busId {b}" for r, b in sorted(gpus.items())])
        ok = len(gpus) == WORLD and len(set(gpus.values())) < WORLD
    diagnosed(RANK != 0 or ok, "NCCL_DEBUG=INFO did not show two ranks on one GPU")
    check_replicas(program("same-gpu", fixed=True))  # setup() calls torch.cuda.set_device first
    print0("OK same-gpu: NCCL refused two ranks on one GPU, NCCL_DEBUG=INFO showed one bus id, "
           "set_device fixed it")


def main(args):
    if WORLD < 2:
        raise UsageError("09 needs 2 or more ranks: torchrun --nproc_per_node=2 09_debugging.py")
    global DEVICE
    if args.broken and args.fault == ["same-gpu"]:  # the bug is in the setup itself
        dist.init_process_group("nccl", timeout=timedelta(seconds=args.timeout_s))
        DEVICE = torch.device("cuda")  # BUG. No torch.cuda.set_device(LOCAL_RANK), so cuda:0.
    else:
        DEVICE = setup(args)
    if args.broken and args.record:
        return record(program)(args.fault[0])  # @record writes the error where torchrun reads it
    if args.broken and args.fr:
        with flight_recorder(args.fr, hang_s=2):  # each rank's record, when a collective waits 2 s
            return program(args.fault[0])
    if args.broken:
        return program(args.fault[0], monitored=args.monitored)
    for fault in args.fault:
        t0 = time.time()
        globals()["scenario_" + fault.replace("-", "_")](args)  # scenario_mismatch, ...
        print0(f"({fault}: {time.time() - t0:.0f} s)\n")


# --- command line ---
def parse_args():
    p = Parser(__doc__, timeout_s=600)  # the other ranks wait while rank 0 runs a child job
    p.add_argument("--fault", nargs="+", choices=FAULTS + ("all",), default=["all"],
                   help="the scenarios to run")
    p.add_argument("--broken", action="store_true", help="run one scenario's broken program alone")
    p.add_argument("--record", action="store_true", help="with --broken: run it under @record")
    p.add_argument("--fr", metavar="DIR", help="with --broken: run it in flight_recorder(DIR)")
    p.add_argument("--monitored", action="store_true", help="rank0-only's, with monitored_barrier")
    args = p.parse_args()
    if args.broken and (len(args.fault) != 1 or args.fault == ["all"]):
        p.error("--broken runs one scenario's program. Name it, for example --fault uneven")
    args.fault = list(FAULTS) if "all" in args.fault else args.fault
    return args


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
