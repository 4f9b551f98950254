"""debug_tools.py - what to take to your own distributed job when it hangs or its replicas drift.

It is one file, and it needs no other file of this repository. Copy it beside your script, or run
it from here.

  In your training script:
    from debug_tools import check_replicas, flight_recorder
    check_replicas(model, optimizer)  # Drift. Raises on every rank, naming the tensors and ranks.
                                      # Call it after setup or a resume, then every N steps.
    with flight_recorder("fr"):       # Hangs. Each rank writes its collectives to fr/rank_<R> when
        train(...)                    # the block ends, on an error, or after a long wait.
    DDP(model, process_group=group_for_ddp())  # DDP beside TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo

  From a shell, while the job hangs. PID may be torchrun's agent, mp.spawn's parent, any rank, or
  a worker of one.
    python debug_tools.py stacks PID            every rank's Python stack, and where each waits
    python debug_tools.py stacks PID --native   ... with the C++ frames that say what it waits for
    python debug_tools.py fr fr                 which collective each rank reached, where they part
  `stacks` needs py-spy, on PATH or beside this Python. Without it, it says what to do instead.

The lesson that uses them is 09_debugging.py. The troubleshooting table is in docs/debugging.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for the type hints only
    import torch
    import torch.distributed as dist

# The functions import torch where they need it. So `stacks` and `fr` run under any Python with
# py-spy, and do not wait seconds for torch to import while your job hangs.
NOT_SEEN = "not compared: RNG states, the data each rank reads, gradients"


# --- drift: are the replicas the same? ---
# The kinds of differences, listed in this order. A cause, such as one rank's optimizer state or
# lr, comes before what it makes drift a step later, the parameters.
KINDS = ("optimizer state", "settings", "parameters", "buffers", "tensor attributes")


class ReplicasDiffer(RuntimeError):
    """check_replicas' error, the same on every rank. Its .differences lists every (kind, text)."""

    def __init__(self, message: str, differences: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)  # The default lets pickle rebuild it from the message alone.
        self.differences = list(differences)


def check_replicas(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   group: dist.ProcessGroup | None = None, ignore: Iterable[str] = ()) -> str:
    """Compare everything a replica holds across the ranks of `group`, bit for bit.

    That is every parameter, buffer and plain tensor attribute (in `self.x`, or a list or dict
    there) of every submodule, and which submodules are in eval mode. Given `optimizer`, it is its
    state (momentum, Adam's moments) and settings (lr) too. It works on a plain module or a
    DDP-style wrapper's `.module`, with tensors of any dtype on any device.
    It returns a one-line summary when all agree. Otherwise it raises ReplicasDiffer on every rank
    alike. The error lists each difference by kind, causes (the optimizer's state and settings)
    first. It names the tensor, the ranks that differ from rank 0, and by how much. A tensor whose
    shape or dtype differs, or that some ranks lack, is named but not compared. Buffers that DDP's
    next forward overwrites with rank 0's (broadcast_buffers=True) are counted, not raised.
    `ignore` takes names or fnmatch patterns ('*.running_var') of what not to compare.
    It cannot see RNG states, the data each rank reads, or gradients. It costs one broadcast of the
    replica's bytes and two small all-gathers. Call it on every rank, right after setup or a
    resume, then every N steps. Right after a resume, a load on some ranks only shows as optimizer
    state, before any parameter drifts."""
    import torch
    import torch.distributed as dist
    group = group or dist.group.WORLD
    world, src = dist.get_world_size(group), dist.get_global_rank(group, 0)
    tensors, facts, kinds, sync = _replica_state(module, optimizer)
    ignored = [n for n in [*tensors, *facts] if any(fnmatch.fnmatchcase(n, p) for p in ignore)]
    for n in ignored:
        tensors.pop(n, None)
        facts.pop(n, None)
    # First what each rank holds: names, dtypes, shapes, eval modes, lr. Tensors of different
    # layouts cannot be compared byte for byte. A broadcast of one length met by another's would
    # fail or hang.
    mine = {"layout": {n: (str(t.dtype)[6:], tuple(t.shape)) for n, t in tensors.items()},
            "facts": facts, "kinds": kinds, "sync": sync}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    kinds = {n: k for x in reversed(everyone) for n, k in x["kinds"].items()}  # rank 0's wins
    broadcast, synced = everyone[0]["sync"]
    problems = [(kinds[n], text) for n, text in _layout_problems([x["layout"] for x in everyone])
                + _fact_problems([x["facts"] for x in everyone])]
    common = [n for n in everyone[0]["layout"]
              if all(x["layout"].get(n) == everyone[0]["layout"][n] for x in everyone)]
    # Then the bytes. Rank 0 broadcasts its own, and every rank compares its own with them, in one
    # flat buffer per 64 MiB.
    device = _comm_device(group)
    diffs = torch.zeros(len(common), dtype=torch.float64, device=device)
    for first, last in _chunks([tensors[n] for n in common], 64 << 20):
        flat = torch.cat([_bytes(tensors[n]).to(device) for n in common[first:last]])
        ref = flat.clone()
        dist.broadcast(ref, src=src, group=group)
        offset = 0
        for i in range(first, last):
            t = tensors[common[i]]
            n = t.numel() * t.element_size()
            if not torch.equal(flat[offset:offset + n], ref[offset:offset + n]):  # the rare case
                # The clone aligns the bytes before they are viewed as t's dtype.
                theirs = ref[offset:offset + n].clone().view(t.dtype).view(t.shape).to(t.device)
                worst = (_wide(t) - _wide(theirs)).abs().max().item() if t.numel() else 0.0
                diffs[i] = worst if worst > 0 else math.nan  # The bits differ, the values not.
            offset += n
    # Every rank gathers every rank's differences. With the same table everywhere, every rank
    # raises the same error.
    table = [torch.empty_like(diffs) for _ in range(world)]
    dist.all_gather(table, diffs, group=group)
    table = torch.stack(table).cpu()
    overwritten = []  # buffers the wrapper's next forward replaces with rank 0's: no drift
    for i in table.amax(0).nonzero().flatten().tolist():
        t, ranks = tensors[common[i]], table[:, i].nonzero().flatten().tolist()
        worst = table[:, i].nan_to_num(0).max().item()
        by = f"by up to {worst:.3g}" if worst > 0 else "in its bits only (NaN or -0.0)"
        if common[i] in synced:
            overwritten.append(common[i])
        else:
            what = f"{common[i]} ({str(t.dtype)[6:]}, {tuple(t.shape)})"
            text = f"{what} on rank(s) {ranks} differs from rank 0's {by}"
            problems.append((kinds[common[i]], text))
    notes = []
    if overwritten:
        notes.append(f"{len(overwritten)} buffer(s) differ by design, since DDP "
                     "(broadcast_buffers=True) overwrites them with rank 0's as its next forward "
                     f"starts: {_some(overwritten)}")
    if ignored:
        notes.append(f"ignored: {_some(ignored)}")
    if any(k == "buffers" and re.search(r"running_(mean|var)$", text.split(" (")[0])
           for k, text in problems):
        copier = "nothing copies them" if broadcast is None else \
            "DDP with broadcast_buffers=False (or forward_sync_buffers=False) does not copy them"
        notes.append(f"BatchNorm's running statistics are each rank's own, because {copier}. "
                     "Average them over the ranks (all_reduce, then divide) before you evaluate or "
                     "save, or broadcast rank 0's. nn.SyncBatchNorm averages them in every "
                     "forward, but on GPU modules only.")
    if problems:
        raise ReplicasDiffer(_differences_message(problems, notes),
                             sorted(problems, key=lambda p: KINDS.index(p[0])))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    return (f"replicas identical on {world} ranks: {len(tensors)} tensors, {size / 2**20:.1f} MiB "
            f"({NOT_SEEN})" + "".join(f"; {note}" for note in notes))


def _some(names):  # the first four names, and dots for the rest
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _differences_message(problems, notes, shown=3):
    """'replicas differ: X' for one difference. Else a count by kind, then up to `shown` of each
    kind, causes first."""
    problems = sorted(problems, key=lambda p: KINDS.index(p[0]))  # Stable: the order found, within.
    if len(problems) == 1:
        lines = [f"replicas differ: {problems[0][1]}"]
    else:
        counts = {k: sum(kind == k for kind, _ in problems) for k in KINDS}
        causes = counts["optimizer state"] + counts["settings"]
        lines = [f"replicas differ in {len(problems)} places ("
                 + ", ".join(f"{k} {n}" for k, n in counts.items() if n) + ")"
                 + (", the optimizer's state and settings first, as they make the parameters drift "
                    "a step later" if 0 < causes < len(problems) else "")]
        for k, n in counts.items():
            lines += [f"  {text}" for kind, text in problems if kind == k][:shown]
            if n > shown:
                lines.append(f"  ... {n - shown} more {k} (the exception's .differences lists all)")
    return "\n".join(lines + [f"  ({note})" for note in notes])


def _replica_state(module, optimizer):
    """What check_replicas compares: ({name: tensor}, {name: plain value}, {name: kind},
    (broadcast_buffers, {the buffers the wrapper's forward overwrites})). broadcast_buffers is
    True, False, or None without a wrapper."""
    import torch
    import torch.nn as nn
    prefix, broadcast, synced = "", None, set()
    # A DDP-style wrapper (PyTorch's, or one written by hand) holds the replica in .module. Its own
    # tensors are its machinery, such as gradient buckets and per-rank flags, which may differ.
    while isinstance(getattr(module, "module", None), nn.Module) and \
            {id(p) for p in module.parameters()} == {id(p) for p in module.module.parameters()}:
        if broadcast is None and hasattr(module, "broadcast_buffers"):  # a property since 2.13
            broadcast = bool(module.broadcast_buffers)
            skip = getattr(module, "parameters_to_ignore", set())  # DDP's names to ignore
            synced = {prefix + "module." + n for n, _ in module.module.named_buffers()
                      if n not in skip} if broadcast else set()
        module, prefix = module.module, prefix + "module."
    tensors, seen, facts, kinds, evals = {}, set(), {}, {}, []

    def add(name, t, kind):
        if isinstance(t, torch.Tensor) and id(t) not in seen and t.layout == torch.strided \
                and not t.is_quantized and t.device.type != "meta":  # dense, with bytes to compare
            seen.add(id(t))  # A tensor with two names (tied weights) is compared once.
            tensors[name], kinds[name] = t.detach(), kind

    for mname, m in module.named_modules():
        at = prefix + mname + "." if mname else prefix
        for n, p in m.named_parameters(recurse=False):
            add(at + n, p, "parameters")
        for n, b in m.named_buffers(recurse=False):
            add(at + n, b, "buffers")
        for n, v in vars(m).items():  # Neither DDP's broadcast nor load_state_dict touches these.
            if isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    add(f"{at}{n}[{i}]", x, "tensor attributes")
            elif isinstance(v, dict) and not n.startswith("_"):
                for k, x in v.items():
                    add(f"{at}{n}[{k!r}]", x, "tensor attributes")
            else:
                add(at + n, v, "tensor attributes")
        if not m.training and not any(mname.startswith(e) for e in evals):  # the outermost only
            evals.append(mname + "." if mname else "")
            name = f"{repr(mname) if mname else 'the model'} is in eval mode"
            facts[name], kinds[name] = True, "settings"
    if optimizer is not None:
        names = {id(p): n for n, p in module.named_parameters()}
        for g, params in enumerate(optimizer.param_groups):
            for k, v in params.items():
                if k != "params" and (v is None or isinstance(v, (bool, int, float, str, tuple))):
                    facts[f"optimizer param_groups[{g}][{k!r}]"] = v
                    kinds[f"optimizer param_groups[{g}][{k!r}]"] = "settings"
            for p in params["params"]:
                for k, v in optimizer.state.get(p, {}).items():
                    name = f"optimizer state[{prefix}{names.get(id(p), f'group {g} param')}][{k!r}]"
                    if isinstance(v, torch.Tensor):
                        add(name, v, "optimizer state")
                    else:
                        facts[name], kinds[name] = v, "optimizer state"
    return tensors, facts, kinds, (broadcast, synced)


def _layout_problems(layouts):  # [(name, text)]
    problems = []
    for name in dict.fromkeys(n for layout in layouts for n in layout):  # in first-seen order
        have = {r: layout.get(name) for r, layout in enumerate(layouts)}
        if None in have.values():
            ranks = [r for r, x in have.items() if x]
            problems.append((name, f"{name} exists on rank(s) {ranks} only"))
        elif len(set(have.values())) > 1:
            problems.append((name, f"{name} has a different dtype or shape: " +
                             ", ".join(f"rank {r} {d} {s}" for r, (d, s) in have.items())))
    return problems


def _fact_problems(facts):  # [(name, text)]
    problems = []
    for name in dict.fromkeys(n for f in facts for n in f):
        values = [f.get(name, "absent" if "eval mode" not in name else False) for f in facts]
        if any(v != values[0] for v in values):
            if "eval mode" in name:  # a rank that evaluated and never called model.train() again
                ranks = [r for r, v in enumerate(values) if v]
                problems.append((name, f"{name} on rank(s) {ranks} only"))
            else:
                problems.append((name, f"{name} is "
                                 + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))))
    return problems


def _comm_device(group):
    """Where the group's collectives take tensors: the CPU for gloo, this rank's GPU for NCCL."""
    import torch
    import torch.distributed as dist
    backend = str(dist.get_backend(group))
    if "gloo" not in backend and "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes(t):  # Compare bits, not values: bf16, ints and bool alike, and NaN equals itself.
    import torch
    return t.contiguous().view(-1).view(torch.uint8)


def _wide(t):
    import torch
    return t.to(torch.complex128) if t.is_complex() else t.double()


def _chunks(tensors, most):
    """(first, last) index ranges of `tensors` whose bytes add up to at most `most`, with at least
    one tensor each."""
    first, size = 0, 0
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if i > first and size + n > most:
            yield first, i
            first, size = i, 0
        size += n
    if first < len(tensors):
        yield first, len(tensors)


def group_for_ddp() -> dist.ProcessGroup:
    """A group of every rank that TORCH_DISTRIBUTED_DEBUG=DETAIL leaves unchecked, for
    DDP(model, process_group=group_for_ddp()).

    DETAIL wraps each group it sees created in a checker, and on gloo DDP's constructor segfaults on
    that wrapper (torch 2.14). With this group, DDP's own all-reduces go unchecked. Your other
    collectives (metrics, evaluation, barriers) keep DETAIL's check. The price is that DETAIL never
    compares DDP's all-reduces with yours. So a rank in DDP's backward against another in your
    barrier hangs until the timeout, and `stacks` or `fr` find it. Call it on every rank, after
    init_process_group."""
    import torch.distributed as dist
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)  # DETAIL wraps the groups created while it is on.
    try:
        return dist.new_group()
    finally:
        dist.set_debug_level(level)


# --- hangs: the Flight Recorder, on gloo and NCCL ---
@contextlib.contextmanager
def flight_recorder(dump_dir: str, hang_s: float = 60.0) -> Iterator[None]:
    """Record this process's collectives with PyTorch's Flight Recorder, and write the record to
    `dump_dir`/rank_<R>.

    It writes when the block ends, normally or by an exception, such as a timeout or a peer that
    died. It also writes whenever a collective has waited `hang_s` seconds. So a hang leaves a
    record long before the group's timeout (10 or 30 minutes) ends it. Use it on every rank. Then
    `python debug_tools.py fr DIR` says which collective each rank reached.

    PyTorch 2.14 records by default, on gloo as on NCCL. It reads the variables below when the
    process group is created. Entered before init_process_group, this block sets them for NCCL too.
    Then NCCL's watchdog writes its own record there on a timeout, even from a rank stuck in a
    kernel. Entered later, only this block's own records are written."""
    import torch.distributed as dist
    os.makedirs(dump_dir, exist_ok=True)
    if not dist.is_initialized():
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(os.path.abspath(dump_dir), "rank_")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    _RUN.clear()  # A new block starts a new run. One process may hold several, a notebook's say.
    _RUN["started"] = time.time()
    if dist.is_initialized():
        _run_id()  # now, while every rank can still reach the store
    done = threading.Event()
    watchdog = threading.Thread(target=_watch, args=(dump_dir, hang_s, done), daemon=True)
    # A thread, since the main thread may be blocked in C++. gloo and NCCL release the GIL to wait.
    watchdog.start()
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(Exception):  # The error that ended the block is the one to see.
            _dump(dump_dir, f"on {type(e).__name__}: {str(e).strip()[:120]}")
        raise
    finally:
        done.set()
        watchdog.join()
    _dump(dump_dir, "at the end of the block")


def _watch(dump_dir, hang_s, done):
    import torch.distributed as dist
    dumped = None
    while not done.wait(min(1.0, hang_s / 4)):
        try:
            if "id" not in _RUN and dist.is_initialized():
                _run_id()  # As soon as the group is up. Later, the store's host may have died.
            pending = [e for e in _trace(stacks=False)["entries"] if not e.get("retired", True)]
        except Exception:  # no group yet, or one being torn down
            continue
        oldest = min(pending, key=lambda e: e["time_created_ns"], default=None)
        if oldest and time.time_ns() - oldest["time_created_ns"] > hang_s * 1e9 \
                and oldest["record_id"] != dumped:
            dumped = oldest["record_id"]
            name = f"{oldest['profiling_name']} #{oldest['collective_seq_id']}"
            _dump(dump_dir, f"{name} waiting > {hang_s:g} s")


def _trace(stacks=True):
    """This process's Flight Recorder record. PyTorch 2.14 has no public call for it, so the
    private one is here, not in your script. NCCL's collectives are in the CUDA recorder, gloo's in
    the generic one."""
    import torch
    import torch.distributed as dist
    c10d = torch._C._distributed_c10d
    nccl = dist.is_initialized() and "nccl" in str(dist.get_backend()) and \
        hasattr(c10d, "_dump_nccl_trace")
    dump = c10d._dump_nccl_trace if nccl else c10d._dump_fr_trace
    trace = pickle.loads(dump(True, stacks, False))
    # gloo names its groups '' in pg_config but '0', '1' in the entries. The analyser needs a match.
    if "" in trace.get("pg_config", {}):
        config = trace["pg_config"].pop("")
        for name, desc in {e["process_group"] for e in trace["entries"]} - set(trace["pg_config"]):
            trace["pg_config"][name] = {**config, "name": name, "desc": desc}
    return trace


def _dump(dump_dir, why):
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    path = os.path.join(dump_dir, f"rank_{rank}")
    trace = _trace()
    # Which run wrote it. A later run in this folder (a rerun, fewer ranks) leaves older files.
    world = dist.get_world_size() if dist.is_initialized() else None
    trace["debug_tools"] = {"run": _run_id(), "world_size": world, "started": _RUN.get("started"),
                            "written": time.time()}
    with open(path + ".part", "wb") as f:  # then renamed, so the analyser never reads half a file
        pickle.dump(trace, f)
    os.replace(path + ".part", path)
    print(f"[flight_recorder] rank {rank}: wrote {path} ({why}). Read it with: "
          f"python debug_tools.py fr {dump_dir}", file=sys.stderr, flush=True)


_RUN = {}


def _run_id():
    """One id for every rank of this run. The first rank to ask puts its own in the job's store,
    the one init_process_group made, and the others read it there. Without a store, this process's
    own, for a run of one."""
    if "id" not in _RUN:
        import torch.distributed as dist
        mine = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        try:
            store = dist.distributed_c10d._get_default_store()  # private, like _dump_fr_trace
            _RUN["id"] = store.compare_set("debug_tools/flight_recorder/run", "", mine).decode()
        except Exception:
            _RUN["id"] = mine
    return _RUN["id"]


def read_records(dump_dir: str, run: str | None = None) -> tuple[dict[int, Any], list[str]]:
    """({rank: record} of one run, lines that say which run it is and which files were skipped),
    from the rank_<R> files in dump_dir. It reads the newest run, or `run`. A record that names no
    run is NCCL's own, written by its watchdog. It is read with the run when it was written after
    that run started."""
    runs, unnamed, skipped = {}, {}, []
    for f in sorted(os.listdir(dump_dir)):
        if not (m := re.fullmatch(r".*?(\d+)", f)):
            continue
        try:
            with open(os.path.join(dump_dir, f), "rb") as fh:
                record = pickle.load(fh)
            ours = record.get("debug_tools")
        except Exception as e:
            skipped.append(f"{f} (not a record: {type(e).__name__})")
            continue
        if ours:
            runs.setdefault(ours["run"], {})[int(m.group(1))] = (f, record)
        else:
            unnamed[int(m.group(1))] = (f, record)
    if not runs:  # NCCL's own records only, or records from before runs were named: all of them
        return ({r: rec for r, (_, rec) in sorted(unnamed.items())},
                [f"read {len(unnamed)} record(s) that name no run (NCCL's own, or an older "
                 "debug_tools). If this folder held an earlier run, its files are mixed in."]
                + ([f"skipped: {', '.join(skipped)}"] if skipped else []))

    def info(r):
        return next(iter(runs[r].values()))[1]["debug_tools"]

    def written(r):
        return max(rec["debug_tools"]["written"] for _, rec in runs[r].values())

    def when(r):
        return time.strftime("%H:%M:%S", time.localtime(written(r)))
    if run is not None and run not in runs:
        return {}, [f"no run {run} in {dump_dir}, only " + ", ".join(runs)]
    chosen = run if run is not None else max(runs, key=written)
    records = {r: rec for r, (_, rec) in runs[chosen].items()}
    world, started = info(chosen)["world_size"], info(chosen)["started"] or 0
    for r, (f, rec) in unnamed.items():
        newest = max((e["time_created_ns"] for e in rec.get("entries", [])), default=0) / 1e9
        if r not in records and (world is None or r < world) and newest >= started:
            records[r] = rec
        else:
            skipped.append(f"{f} (names no run; older than this run, or a rank it does not have)")
    for other in runs:
        if other != chosen:
            skipped.append(f"{', '.join(f for f, _ in runs[other].values())} (run {other}, "
                           f"{info(other)['world_size']} ranks, written {when(other)})")
    missing = [f"rank_{r}" for r in range(world or 0) if r not in records]
    head = [f"read run {chosen} ({world} ranks, written {when(chosen)}): "
            f"{', '.join(f'rank_{r}' for r in sorted(records))}"
            + (f"; missing: {', '.join(missing)}" if missing else "")]
    said = head + ([f"skipped: {'; '.join(skipped)}"] if skipped else [])
    return dict(sorted(records.items())), said


LIBRARY = re.compile(r"site-packages|dist-packages|/lib/python3|^<")  # torch and Python's own


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch and the standard library: your line that made the call."""
    for f in frames:
        if not LIBRARY.search(f["filename"]):
            return f"{f['name']} ({os.path.basename(f['filename'])}:{f['line']})"
    return "?"


def summarize_records(records: dict[int, Any]) -> list[str]:
    """Lines that say what each rank's last collectives were, and the first collective on which the
    ranks part."""
    lines, by_seq = [], {}
    for rank, record in records.items():
        coll = [e for e in record["entries"] if not e.get("is_p2p")]
        if not coll:
            lines.append(f"rank {rank}: no collective recorded")
            continue
        last = coll[-1]
        status = record.get("pg_status", {}).get(last["process_group"][0], {})
        done = last["collective_seq_id"] <= status.get("last_completed_collective", math.inf)
        lines.append(f"rank {rank}: {len(coll)} collectives; the last, "
                     f"#{last['collective_seq_id']}, {call(last)}, "
                     + ("completed" if done else "never completed"))
        for e in coll:
            by_seq.setdefault((e["process_group"][0], e["collective_seq_id"]), {})[rank] = e
    for (pg, seq), ranks in sorted(by_seq.items(), key=lambda kv: kv[0][1]):
        calls = {}
        for r in records:  # the ranks grouped by the call they made at this point
            calls.setdefault(call(ranks[r]) if r in ranks else "nothing: it never got there",
                             []).append(r)
        if len(calls) > 1:
            lines.append(f"the ranks part at collective #{seq} of group {pg}:")
            lines += [f"  rank(s) {rs}: {c}" for c, rs in calls.items()]
            return lines
    return lines + ["every rank issued the same collectives, in the same order"]


def call(entry: dict[str, Any]) -> str:
    """The collective and your line: 'gloo:all_gather [[8, 1]] from evaluate (train.py:47)'."""
    return f"{entry['profiling_name']} {entry['input_sizes']} from {where(entry.get('frames', []))}"


# --- hangs: every rank's stack ---
# What multiprocessing puts in its children's command line
MP_CHILD = re.compile(r"multiprocessing\.(spawn|forkserver) import|--multiprocessing-fork")


def find_job(pid: int) -> tuple[dict[int, int | None], dict[int, int]]:
    """The processes of the job that `pid` belongs to, on this machine: ranks {pid: its RANK} and
    workers {pid: its rank's pid}. RANK is None where the environment has none, or several
    processes share it. Workers are the ranks' own children, such as DataLoader workers. `pid` may
    be torchrun's agent, mp.spawn's parent, a rank or a worker. Where no rank is found, `pid` is no
    training process, or its job cannot be seen from here."""
    env = _environ(pid)
    if "RANK" in env:  # torchrun's worker, a process started with RANK set, or its child
        rank_pid, port = pid, env.get("MASTER_PORT")
        while "RANK" in (up := _environ(_ppid(rank_pid))) and up.get("MASTER_PORT") == port:
            rank_pid = _ppid(rank_pid)  # A DataLoader worker inherits its rank's environment.

        def is_rank(p):
            return "RANK" in _environ(p) and _environ(p).get("MASTER_PORT") == port  # this job's
        root = _ppid(rank_pid)
    elif MP_CHILD.search(_cmdline(pid)):  # a rank that mp.spawn started, or its worker
        rank_pid = pid
        while MP_CHILD.search(_cmdline(_ppid(rank_pid))):
            rank_pid = _ppid(rank_pid)

        def is_rank(p):  # its children that run torch, not the resource tracker
            return bool(MP_CHILD.search(_cmdline(p))) and _runs_torch(p)
        root = _ppid(rank_pid)
    else:  # a launcher: torchrun's agent, mp.spawn's parent, a shell

        def is_rank(p):
            return "RANK" in _environ(p) or bool(MP_CHILD.search(_cmdline(p))) and _runs_torch(p)
        root = pid
    tree, ranks, workers = _children(), [], {}
    todo = list(tree.get(root, []))
    while todo:  # Breadth first. Everything under a rank is that rank's.
        p = todo.pop(0)
        if not is_rank(p):
            todo += tree.get(p, [])
            continue
        ranks.append(p)
        under = list(tree.get(p, []))
        while under:
            w = under.pop()
            workers[w] = p
            under += tree.get(w, [])
    labels = [_environ(p).get("RANK") for p in ranks]
    return {p: int(r) if r is not None and labels.count(r) == 1 else None
            for p, r in zip(ranks, labels)}, workers


def _environ(pid):  # what the process started with, not what os.environ set later
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().decode(errors="replace").split("\0")
        return dict(kv.split("=", 1) for kv in pairs if "=" in kv)
    except (OSError, TypeError):
        return {}


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").replace("\0", " ").strip()
    except (OSError, TypeError):
        return ""


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _runs_torch(pid):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return True  # not ours to read: let py-spy say


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError, TypeError):
        return None


def _children():
    tree = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (ppid := _ppid(int(d))) is not None:
            tree.setdefault(ppid, []).append(int(d))
    return tree


def find_py_spy() -> str | None:
    """py-spy on PATH, else beside this Python (a virtual environment not activated), else in its
    user scripts."""
    places = [os.path.dirname(sys.executable), sysconfig.get_path("scripts"),
              sysconfig.get_path("scripts", f"{os.name}_user")]
    found = [os.path.join(d, "py-spy") for d in places
             if d and os.access(os.path.join(d, "py-spy"), os.X_OK)]
    return shutil.which("py-spy") or (found[0] if found else None)


NO_PY_SPY = ("py-spy not found (not on PATH, nor beside {python}). Install it with pip install "
             "py-spy. Without it, start the job with PYTHONFAULTHANDLER=1, and `kill -ABRT PID` "
             "prints a rank's Python stack to its stderr, but ends that rank. Or call "
             "faulthandler.register(signal.SIGUSR1, all_threads=True) in your script, and "
             "`kill -USR1 PID` prints it while the rank goes on.")
NATIVE_WAIT = re.compile(r" *(c10d::|gloo::|nccl|torch::distributed::)")  # PyTorch's comms in C++
PTRACE_HELP = ("py-spy reads another process's memory, which needs ptrace permission. Run it as "
               "root (sudo), or allow it with sudo sysctl kernel.yama.ptrace_scope=0. In a "
               "container, start it with --cap-add SYS_PTRACE (in Kubernetes, "
               "securityContext.capabilities.add [SYS_PTRACE]).")


def stacks(pid: int, native: bool = False) -> None:
    """Print every rank's stack (py-spy dump, all at once), labelled by rank, then one line per rank
    that says where it waits."""
    if _ppid(pid) is None:
        sys.exit(f"error: no process {pid}")
    ranks, workers = find_job(pid)
    name = os.path.basename(_cmdline(pid).split(" ")[0]) or "?"
    if not ranks and not _runs_torch(pid):
        sys.exit(f"error: pid {pid} ({name}) is not a training process. It runs no torch, has no "
                 "RANK in its environment, and no rank runs under it.")
    py_spy = find_py_spy()
    if not py_spy:
        sys.exit("error: " + NO_PY_SPY.format(python=sys.executable))
    if not ranks:  # torch, but no job around it: a rank started some other way, or no rank
        print(f"pid {pid} ({name}) runs torch, but no rank of a job was found around it. It has no "
              "RANK in its environment, and neither mp.spawn nor torchrun started it. Its own "
              "stack:")
        ranks = {pid: None}
    elif pid in workers:
        what = "a DataLoader worker" if _comm(pid) == "pt_data_worker" else "a child process"
        print(f"pid {pid} is {what} of the rank with pid {workers[pid]}, not a rank. The ranks of "
              "its job follow.")
    cmd = [py_spy, "dump", "--full-filenames", *(["--native"] if native else [])]
    with ThreadPoolExecutor(len(ranks)) as pool:  # all at once: the same moment on every rank
        dumps = dict(zip(ranks, pool.map(lambda p: subprocess.run(
            [*cmd, *(["--locals"] if ranks[p] is None else []), "--pid", str(p)],
            capture_output=True, text=True, timeout=120), ranks)))
    labels, world, how = _label(ranks, dumps)
    order = sorted(ranks, key=lambda p: (labels[p] is None, labels[p] or 0, p))
    listed = ", ".join(f"{_name(labels[p])} pid {p}" for p in order)
    every = isinstance(world, int) and len(ranks) < world
    print(f"{len(ranks)} rank(s) of {world} on this machine{how}: {listed}"
          + (" (run this on every node for the others)" if every else ""))
    if workers:
        print("their child processes (DataLoader workers, ...; not shown): " + "; ".join(
            f"{', '.join(str(w) for w in workers if workers[w] == p)} of {_name(labels[p])}"
            for p in order if p in workers.values()))
    summary = []
    for p in order:
        res, label = dumps[p], _name(labels[p])
        print(f"\n== {label} (pid {p}) ==")
        if res.returncode:
            denied = re.search(r"permission|not permitted|ptrace", res.stderr + res.stdout, re.I)
            print((res.stderr or res.stdout).strip() + ("\n" + PTRACE_HELP if denied else ""))
            summary.append(f"{label}: no stack (py-spy failed)")
            continue
        dump = "\n".join(ln for ln in res.stdout.splitlines() if not ln.startswith("        "))
        lines, hidden = [], 0
        for line in dump.splitlines():
            python_frame = re.match(r" +\S.* \(\S+\.py:\d+\)$", line)
            if native and line.startswith("    ") and not (python_frame or NATIVE_WAIT.match(line)):
                hidden += 1  # libc, pybind11, autograd's engine. The wait is in c10d's frames.
                continue
            if not line.startswith("Python v"):  # torch/_tensor.py, libtorch_cpu.so
                lines.append(re.sub(r"\(/\S*/(site-packages/|lib/)", "(", line))
        print("\n".join(lines) + (f"\n    ({hidden} other native frames hidden)" if hidden else ""))
        summary.append(f"{label}: " + _waits(dump))
    print("\nwhere each rank is (its main thread: your line, the call it is in, the C++ wait with "
          "--native):")
    print("\n".join("  " + s for s in summary))


def _name(rank):
    return "rank unknown" if rank is None else f"rank {rank}"


def _label(ranks, dumps):
    """({pid: rank or None}, world size or '?', how the ranks were read).

    A rank comes from RANK in the environment. Where there is none (mp.spawn's children), it comes
    from a `rank` argument or variable in the main thread's frames, as py-spy --locals shows it,
    yours first (the tutorial's demo_basic(rank, world_size)). Where that is missing too, or not
    one per process, it is None. So no process is labelled with a rank it may not be."""
    labels, world, seen = dict(ranks), None, {}
    for p, rank in ranks.items():
        world = world or _environ(p).get("WORLD_SIZE")
        if rank is None and dumps[p].returncode == 0:
            main = dumps[p].stdout.split('"MainThread"')[-1].split("\nThread ")[0]
            frame, found = None, []
            for line in main.splitlines():
                if (m := re.match(r" {4}(\S.*) \((\S+):\d+\)$", line)):
                    frame = m
                elif (v := re.match(r" {12}(rank|world_size): (\d+)$", line)) and frame:
                    library = bool(LIBRARY.search(frame.group(2)))
                    found.append((library, v.group(1), int(v.group(2)), frame.group(1)))
            found.sort(key=lambda f: f[0])  # yours first, then torch's (init_process_group's rank)
            rank = next((f for f in found if f[1] == "rank"), None)
            size = next((f[2] for f in found if f[1] == "world_size"), None)
            if rank:
                labels[p], seen[p] = rank[2], rank[3]
            world = world or size
    values = [labels[p] for p in seen]
    for p in list(seen):  # two processes that claim one rank: neither is labelled
        if values.count(labels[p]) > 1 or labels[p] in ranks.values():
            labels[p] = None
            del seen[p]
    names = ", ".join(sorted(set(seen.values())))
    how = f" (no RANK in their environment: ranks read from `rank` in {names})" if seen else ""
    if any(r is None for r in labels.values()):
        how += " (rank unknown: no RANK in the environment, no `rank` variable in its frames)"
    return labels, int(world) if world else "?", how


def _waits(dump):
    """Where one py-spy dump's main thread waits, as in
    'train (file.py:56) in Tensor.backward <- c10d::Reducer::finalize_backward'."""
    main = dump.split('"MainThread"')[1] if '"MainThread"' in dump else dump
    main = re.split(r"\nThread ", main)[0]
    frames = [ln.strip() for ln in main.splitlines() if ln.startswith("    ")]
    python = [(i, m) for i, f in enumerate(frames)
              if (m := re.match(r"(.+) \((\S+\.py):(\d+)\)$", f))]
    mine = next(((i, m) for i, m in python if not LIBRARY.search(m.group(2))), None)
    if mine is None:
        return python[0][1].group(0) if python else "(no Python frame)"
    i, m = mine
    calls = [c.group(1) for j, c in python
             if j < i and not re.search(r"wrapper|<locals>|_call_impl$", c.group(1))]
    text = f"{m.group(1)} ({os.path.basename(m.group(2))}:{m.group(3)})"
    text += f" in {calls[-1]}" if calls else ""  # the library call your line made: barrier, ...
    waits = [f.split(" (")[0] for f in frames[:i] if NATIVE_WAIT.match(f)]
    return text + (f" <- {waits[0]}" if waits else "")


# --- command line ---
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stacks", help="every rank's Python stack, labelled by rank (py-spy)")
    s.add_argument("pid", type=int,
                   help="torchrun's agent, mp.spawn's parent, any rank of the job, or its worker")
    s.add_argument("--native", action="store_true",
                   help="with the C++ frames of c10d, gloo, NCCL and DDP's reducer")
    f = sub.add_parser("fr", help="read the Flight Recorder's records (flight_recorder(DIR) or "
                       "NCCL's own)")
    f.add_argument("dir", help="the folder of rank_<R> files")
    f.add_argument("--torch", action="store_true", help="then run torch's analyser on them too")
    f.add_argument("--run", help="the run to read, its id as fr prints it (default: the newest)")
    args = p.parse_args(argv)
    if args.command == "stacks":
        return stacks(args.pid, args.native)
    if not os.path.isdir(args.dir):
        sys.exit(f"error: no folder {args.dir}")
    records, said = read_records(args.dir, args.run)
    if not records:
        sys.exit(f"error: no rank_<R> files in {args.dir}" + (f" ({said[0]})" if said else ""))
    print("\n".join(said + summarize_records(records)))
    print("\ntorch's own analyser: python -m torch.distributed.flight_recorder.fr_trace DIR "
          "--allow-incomplete-ranks (or torchfrtrace). It reads every file in DIR, whatever run "
          "wrote it. In its output, 'Culprit rank R' means that R's call differs from that of the "
          "rank whose record it read first. That may be the rank at fault, so read which call each "
          "rank made, above.")
    if args.torch:
        with tempfile.TemporaryDirectory() as d:  # this run's records only
            for r, record in records.items():
                with open(os.path.join(d, f"rank_{r}"), "wb") as fh:
                    pickle.dump(record, fh)
            cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", d,
                   "--allow-incomplete-ranks"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        print(res.stdout + res.stderr)


if __name__ == "__main__":
    main()
