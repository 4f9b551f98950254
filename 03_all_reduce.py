"""03 - All-reduce: every rank ends with the sum of everyone's tensor. DDP is this, applied to gradients.

What it teaches, in order:
  1. the reduce ops (SUM, PRODUCT, MIN, MAX, and BOR where the backend has it) checked against closed forms;
  2. ring_all_reduce(): the bandwidth-optimal ring by hand. A reduce-scatter (N-1 steps: each rank ends
     owning the full sum of one chunk) then an all-gather (N-1 steps: the owned chunks go round). Each rank
     sends 2(N-1)/N of the data whatever N is, which is why rings scale. Checked against dist.all_reduce;
  3. gradient averaging with it: SUM then divide by N equals one process on the whole batch.
--trace first prints the ring step by step on a small tensor: which chunk each rank sends to whom, and what each
rank holds after every step.
Its speed against dist.all_reduce, size by size: benchmarks/all_reduce.py.

Run it (any N >= 2):
  CPU:        torchrun --nproc_per_node=2 03_all_reduce.py
              torchrun --nproc_per_node=3 03_all_reduce.py --trace        (the ring step by step)
  N GPUs:     torchrun --nproc_per_node=N 03_all_reduce.py        (nccl, one GPU per rank)
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 \\
                  03_all_reduce.py
"""

import argparse
import math
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


# --- the idea: a ring all-reduce on point-to-point messages ---
def ring_all_reduce(tensor, trace=None):
    """Sum ``tensor`` over all ranks, in place, with a ring of point-to-point messages. Returns it.

    Any shape, any number of elements, float or integer dtypes. Every rank ends bit-identical: each chunk is
    summed by exactly one rank (its owner) and then copied, never re-added, to the others. ``trace``, if given, is
    called after every step with (phase, step, chunk sent, chunk received, chunks): what --trace prints.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return tensor
    if tensor.is_cuda and dist.get_backend() == "gloo":
        # gloo's send/recv move host memory only (its CUDA support covers collectives): ring a CPU copy.
        return tensor.copy_(ring_all_reduce(tensor.cpu(), trace))
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = flat.tensor_split(world)  # N views; sizes differ by at most one element, chunk 0 the largest
    right, left, nccl = (rank + 1) % world, (rank - 1) % world, dist.get_backend() == "nccl"
    sending = []  # sends still draining
    # Reduce-scatter. In step s, rank r sends chunk r-s and receives chunk r-s-1, adding it to its own.
    # After N-1 steps rank r holds the complete sum of chunk r+1: it is that chunk's owner.
    # No step writes to a chunk an earlier step sent, so the sends need not finish before the next step.
    for s in range(world - 1):
        i_send, i_recv = (rank - s) % world, (rank - s - 1) % world
        inbox = _inbox(flat, chunks[i_recv].numel())
        sending += _exchange(chunks[i_send], inbox, right, left, nccl)
        chunks[i_recv].add_(inbox)
        if trace:
            trace("reduce-scatter", s, i_send, i_recv, chunks)
    _wait(sending)  # the all-gather overwrites the very chunks the reduce-scatter sent
    # All-gather. The owners pass finished chunks on; receivers overwrite (no addition), so the bits match.
    for s in range(world - 1):
        i_send, i_recv = (rank + 1 - s) % world, (rank - s) % world
        sending += _exchange(chunks[i_send], chunks[i_recv], right, left, nccl)
        if trace:
            trace("all-gather", s, i_send, i_recv, chunks)
    _wait(sending)  # the caller may write to the tensor as soon as we return
    if flat.data_ptr() != tensor.data_ptr():  # we worked on a contiguous copy: write it back
        tensor.copy_(flat.view_as(tensor))
    return tensor


# --- what the ring calls: one exchange with the neighbours, and a receive buffer kept between calls ---
def _exchange(send, recv, right, left, nccl):
    """Send to the right neighbour while receiving from the left one; return once the receive has landed.

    Returns the send still in flight: its buffer must stay untouched until it completes, but nothing else has
    to wait for it, so the caller adds the received chunk while the last bytes of its own go out.
    On NCCL both directions must be posted together as one group (batch_isend_irecv): a rank alone in a
    blocking send would wait for a receive its neighbour has not posted yet, and so on around the ring.
    gloo runs each isend/irecv in the background by itself; there the batching wrapper only adds overhead.
    """
    if nccl:
        ops = []  # with fewer elements than ranks some chunks are empty: both neighbours skip them
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, right))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, left))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()  # on a GPU this only orders streams; the host does not block
        return []
    # Which to post first was measured (benchmarks/README.md): with 2 ranks, whose two neighbours are one peer,
    # the send first for chunks under 4 MiB; otherwise the receive first.
    receiving = None
    if recv.numel() and (left != right or recv.numel() * recv.element_size() >= 4 << 20):
        receiving = dist.irecv(recv, left)
    sending = [dist.isend(send, right)] if send.numel() else []
    if recv.numel():
        if receiving is None:
            receiving = dist.irecv(recv, left)
        receiving.wait()
    return sending


def _wait(reqs):
    for req in reqs:
        req.wait()
    reqs.clear()


_inboxes = {}  # (dtype, device) -> receive buffer kept between calls: fresh memory costs page faults


def _inbox(like, numel):
    buf = _inboxes.get((like.dtype, like.device))
    if buf is None or buf.numel() < numel:
        buf = _inboxes[(like.dtype, like.device)] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


# --- the ring step by step (--trace), 1. reduce ops, 2. ring check, 3. gradient averaging ---
# RANK and WORLD (this process's rank, the number of ranks) are read from torchrun's environment by setup(), as 01
# shows.
def trace_ring(device):
    """Print every step of ring_all_reduce: which chunk each rank sends to whom, and what each rank then holds."""
    # One element per chunk, and rank r starts with (c+1) * 10**r in chunk c: each digit of a sum names the
    # ranks it holds (303 = rank 0's 3 + rank 2's 300). int64, so that the sums are exact.
    start = torch.tensor([(c + 1) * 10**RANK for c in range(WORLD)], device=device)
    width = len(str(WORLD * 10 ** (WORLD - 1)))
    right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD

    def holds(chunks):
        return "[" + " | ".join(f"{c.item():>{width}}" for c in chunks) + "]"

    def step(phase, s, sent, received, chunks):
        if phase == "reduce-scatter":
            print0(f"reduce-scatter, step {s + 1} of {WORLD - 1}: each rank sends a chunk right and adds the one "
                   f"it gets from its left")
            log_in_rank_order(f"holds {holds(chunks)}  sent chunk {sent} to rank {right}, added chunk {received} "
                              f"from rank {left}")
        else:
            print0(f"all-gather, step {s + 1} of {WORLD - 1}: each rank passes a finished chunk right; the receiver "
                   f"overwrites its own copy")
            log_in_rank_order(f"holds {holds(chunks)}  sent chunk {sent} to rank {right}, copied chunk {received} "
                              f"from rank {left}")
        if phase == "reduce-scatter" and s == WORLD - 2:
            print0("after the reduce-scatter, rank r owns the complete sum of chunk (r+1) mod N")

    print0(f"--trace: ring_all_reduce on {WORLD} ranks, a tensor of {WORLD} chunks of one element each; rank r "
           f"starts with (c+1)*10^r in chunk c")
    log_in_rank_order(f"holds {holds(start.tensor_split(WORLD))}")
    result = ring_all_reduce(start.clone(), trace=step)
    library = start.clone()
    dist.all_reduce(library)
    assert torch.equal(result, library), (result, library)
    print0(f"every rank holds {holds(result.tensor_split(WORLD))} == dist.all_reduce")


def check_reduce_ops(device):
    n = WORLD
    x = torch.full((3,), float(RANK + 1), device=device)  # rank r holds r+1
    expected = {dist.ReduceOp.SUM: n * (n + 1) / 2, dist.ReduceOp.PRODUCT: math.factorial(n),
                dist.ReduceOp.MIN: 1, dist.ReduceOp.MAX: n}
    for op, want in expected.items():
        y = x.clone()
        dist.all_reduce(y, op=op)
        assert torch.all(y == want), (op, y, want)
        print0(f"  {str(op).split('.')[-1]:<8} of (rank+1) = {y[0].item():g}  (closed form {want:g})")
    if dist.get_backend() == "nccl":  # NCCL has no bitwise reductions (gloo and MPI do)
        print0("  BOR      skipped: not supported by nccl")
        return
    bits = torch.tensor([1 << RANK], device=device)  # bitwise ops need integers
    dist.all_reduce(bits, op=dist.ReduceOp.BOR)
    assert bits.item() == (1 << n) - 1
    print0(f"  BOR      of 1<<rank  = {bits.item()}  (closed form 2^{n}-1)")


def check_ring(device):
    for shape, dtype in [((1000, 37), torch.float32), ((3,), torch.int64), ((WORLD - 1,), torch.float64)]:
        g = torch.Generator().manual_seed(RANK)
        x = (torch.randn(shape, generator=g) * 10).to(dtype).to(device)
        ours, lib = ring_all_reduce(x.clone()), x.clone()
        dist.all_reduce(lib)
        # Sums in a different order can differ in the last float bit; integers must match exactly.
        ok = torch.equal(ours, lib) if not dtype.is_floating_point else torch.allclose(ours, lib, rtol=1e-5, atol=1e-5)
        assert ok, f"ring_all_reduce != dist.all_reduce for {shape} {dtype}"
        print0(f"  ring_all_reduce == dist.all_reduce  shape={tuple(shape)} dtype={dtype}")


def check_grad_averaging(device):
    torch.manual_seed(0)  # same seed on every rank: same model and same global batch
    model = torch.nn.Linear(10, 1).to(device)
    x, y = torch.randn(8 * WORLD, 10, device=device), torch.randn(8 * WORLD, 1, device=device)
    torch.nn.functional.mse_loss(model(x), y).backward()
    reference = model.weight.grad.clone()  # one process, whole batch
    model.zero_grad()
    shard = slice(8 * RANK, 8 * (RANK + 1))  # each rank sees only its 8 samples
    torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    # Each rank's loss is a mean over its shard, so the SUM of N gradients is N times the global mean:
    # divide by N. (Dividing before the sum, as DDP does, keeps fp16 from overflowing.)
    grad = ring_all_reduce(model.weight.grad) / WORLD
    assert torch.allclose(grad, reference, atol=1e-6), (grad, reference)
    print0(f"  ring_all_reduce(grad) / {WORLD} == single-process gradient on the whole batch of {8 * WORLD}")


def main(args):
    device = setup(args)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} torch={torch.__version__}")
    if args.trace:
        trace_ring(device)
    print0("1. reduce ops")
    check_reduce_ops(device)
    print0("2. hand-written ring")
    check_ring(device)
    print0("3. gradient averaging")
    check_grad_averaging(device)
    done = torch.ones(1, device=device)
    dist.all_reduce(done)  # every rank reports in, so the OK below speaks for all of them
    assert done.item() == WORLD
    print0(f"OK reduce ops, ring_all_reduce and gradient averaging checked on {WORLD} ranks")


# --- plumbing the lesson calls: ordered output, flags ---
def log_in_rank_order(line):
    """Every rank's line, printed by rank 0 in rank order: lines that each rank prints itself race each other."""
    lines = [None] * WORLD
    dist.all_gather_object(lines, line)
    for r, text in enumerate(lines):
        print0(f"[rank {r}/{WORLD}] {text}")


def parse_args():
    p = parser(__doc__)
    p.add_argument("--trace", action="store_true",
                   help="first, print every step of the ring on a small tensor (best on 3 or 4 ranks)")
    args = p.parse_args()
    if args.trace and int(os.environ.get("WORLD_SIZE", 1)) > 8:  # checked before any process group starts
        p.error(f"--trace prints every step of every rank: run it on 2 to 8 ranks, not {os.environ['WORLD_SIZE']}")
    return args


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
