"""09's programs on every rank under torchrun, checked by their maths instead of their output.

- Each rank trains on its own batches.
- 09's naive average equals one process that trains on every rank's batch (a sum is not a mean).
- Drift's fix equals one process too, BatchNorm's running statistics and the clip included.
- Each of drift's bugs leaves replicas that differ.
- Each fixed program issues the same collectives, with the same shapes, on every rank. For uneven
  batches under Join, that is the same number of collectives, though one rank has a batch more.
- Each fixed program ends with identical replicas, and with the weights of one process.
- mismatch's fixed metrics are the sums over the ranks.
"""

import contextlib
import copy
import io
import re
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
import debug_tools  # noqa: E402
from ddp_dropin import ManualDDP  # noqa: E402
from lessons import load  # noqa: E402

dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a fix that hangs fails in a minute
lesson = load("09_debugging.py")  # it reads RANK and WORLD_SIZE from torchrun
rank, world, last = dist.get_rank(), dist.get_world_size(), dist.get_world_size() - 1
STEPS = lesson.STEPS
failures = []


def expect(ok, what):
    if not ok:
        failures.append(what)


def everyones(n):
    """[step][rank] (x, y): the batches every rank draws, gathered, so one process can use them all."""
    gathered = [None] * world
    dist.all_gather_object(gathered, lesson.batches(n))
    return [list(pairs) for pairs in zip(*gathered)]


def one_process(data, bn=False, clip=False):
    """One process, every rank's batch at every step: the mean of the ranks' gradients (a rank with no
    batch left counts as zeros, as under Join) and of their BatchNorm statistics."""
    model = lesson.make_model(0, bn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for pairs in data:
        copies = [copy.deepcopy(model) for _ in pairs]
        for c, (x, y) in zip(copies, pairs):  # each batch normalised by its own statistics
            nn.functional.mse_loss(c(x), y).backward()
        with torch.no_grad():
            for p, *ps in zip(model.parameters(), *(c.parameters() for c in copies)):
                p.grad = sum(q.grad for q in ps) / world
            for b, *bs in zip(model.buffers(), *(c.buffers() for c in copies)):
                b.copy_(sum(bs) / len(bs) if b.is_floating_point() else bs[0])
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
    return model


def state(model):
    model = getattr(model, "module", model)
    return [t.detach() for t in [*model.parameters(), *model.buffers()]]


def close(model, ref, what):
    gap = max((a.double() - b.double()).abs().max().item() for a, b in zip(state(model), state(ref)))
    expect(gap < 1e-5, f"{what}: up to {gap:.3g} from one process on every rank's batches")


def identical(model, what):
    try:
        debug_tools.check_replicas(model)
    except RuntimeError as e:
        failures.append(f"{what}: {e}")


def calls(fault, **kwargs):
    """(the fixed program's model, [(group, collective, shapes)] that this rank issued while it ran,
    from the Flight Recorder, which PyTorch 2.14 keeps on gloo too)."""
    before = max((e["record_id"] for e in debug_tools._trace(stacks=False)["entries"]), default=-1)
    out = lesson.program(fault, fixed=True, **kwargs)
    entries = [e for e in debug_tools._trace(stacks=False)["entries"] if e["record_id"] > before]
    return out, [(e["process_group"][0], e["profiling_name"], str(e["input_sizes"])) for e in entries]


def same_calls(mine, what):
    """The same collectives in the same order on every rank: what a fixed program must do."""
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    counts = [len(c) for c in everyone]
    expect(mine and all(c == everyone[0] for c in everyone),
           f"{what}: the ranks issued different collectives ({counts} of them)")


# Each rank its own data.
data = everyones(STEPS + 1)
expect(all(not torch.equal(data[0][r][0], data[0][0][0]) for r in range(1, world)),
       "every rank drew the same batch")

# The naive average in step(): the mean of every rank's gradient, as one process computes it.
model = lesson.make_model()
lesson.step(model, torch.optim.SGD(model.parameters(), lr=0.1), *lesson.batches(1)[0])
ref = lesson.make_model()
sum(nn.functional.mse_loss(ref(x), y) for x, y in data[0]).div(world).backward()
gap = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
expect(gap < 1e-6, f"step()'s average is up to {gap:.3g} from the mean of every rank's gradient")

# drift: each bug leaves replicas that differ; the fix equals one process.
for bug, how in {"no common seed": (rank, False, range(world)), "a buffer never synced":
                 (0, True, range(world)), "a rank-only clip": (0, False, [last])}.items():
    try:
        debug_tools.check_replicas(lesson.train_by_hand(*how)[0])
        failures.append(f"drift's {bug}: the replicas are identical")
    except RuntimeError:
        pass
fix = lesson.train_by_hand(0, True, range(world), sync_buffers=True)[0]
close(fix, one_process(data[:STEPS], bn=True, clip=True), "drift's fix")
close(lesson.train_by_hand(0, False, [])[0], one_process(data[:STEPS]), "drift's plain average")

# Each fixed program: the same collectives on every rank, identical replicas.
out = io.StringIO()
with contextlib.redirect_stdout(out):
    model, mine = calls("mismatch")
same_calls(mine, "mismatch's fix")
identical(model, "mismatch's fix")
close(model, one_process(data[:1]), "mismatch's fix")
said = re.search(r"all-reduced \['loss', 'samples'\]: \[([\d.]+), ([\d.]+)\]", out.getvalue())
losses = sum(nn.functional.mse_loss(lesson.make_model()(x), y).item() for x, y in data[0])
samples = lesson.BATCH * world
expect(said and abs(float(said.group(1)) - losses) < 2e-3 and float(said.group(2)) == samples,
       f"mismatch's fix said {out.getvalue()!r}, not the sums over the ranks: the loss {losses:.3f} "
       f"and {samples} samples")

model, mine = calls("rank0-only")
same_calls(mine, "rank0-only's fix")
identical(model, "rank0-only's fix")
close(model, one_process(data[:STEPS]), "rank0-only's fix")

for name, wrapper in [("DDP", lesson.DDP), ("ManualDDP", ManualDDP)]:
    model, mine = calls("uneven", wrapper=wrapper)
    same_calls(mine, f"uneven's fix with {name}")
    identical(model, f"uneven's fix with {name}")
    # The extra step: the last rank's gradient, the others' counted as zeros, divided by all ranks.
    close(model, one_process(data[:STEPS] + [data[STEPS][last:]]), f"uneven's fix with {name}")

model, mine = calls("crash")
same_calls(mine, "crash's fix")
identical(model, "crash's fix")
crashed = [list(pairs) for pairs in data[:STEPS]]
x, y = crashed[2][last]
crashed[2][last] = (torch.cat([x[:3], x[4:]]), torch.cat([y[:3], y[4:]]))  # the corrupt sample dropped
close(model, one_process(crashed), "crash's fix")

dist.destroy_process_group()
if rank == 0:
    print("\n".join(f"FAIL: {f}" for f in failures) or f"OK 09's programs on {world} ranks", flush=True)
sys.exit(1 if failures else 0)
