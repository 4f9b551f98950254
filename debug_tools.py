"""debug_tools.py - what to take to your own distributed job when it hangs or its replicas drift apart.

One file, no other file of this repository needed: copy it beside your script, or run it from here.

  In your training script:
    from debug_tools import check_replicas, flight_recorder
    check_replicas(model, optimizer)   # drift: raises on every rank, naming the tensors, the ranks and by how much;
                                       #   once after setup or a resume, then every N steps
    with flight_recorder("fr"):        # hangs: each rank's record of its collectives, written to fr/rank_<R>
        train(...)                     #   when the block ends, on an error, and when a collective waits too long
    DDP(model, process_group=group_for_ddp())   # DDP under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo (else a segfault)

  From a shell, while the job hangs (PID: torchrun's agent, mp.spawn's parent, any rank, or a worker of one):
    python debug_tools.py stacks PID            every rank's Python stack, labelled by rank, and where each waits
    python debug_tools.py stacks PID --native   ... with the C++ frames that say what it waits for (DDP's reducer)
    python debug_tools.py fr fr                 which collective each rank reached, and where the ranks part
  `stacks` needs py-spy (on PATH or beside this Python); without it, it says what faulthandler does instead.

The lesson that uses them, with a scenario for each: 09_debugging.py; the troubleshooting table: docs/debugging.md.
"""

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
from concurrent.futures import ThreadPoolExecutor

# torch is imported in the functions that use it: `stacks` and `fr` run without it, under any Python with py-spy,
# and do not pay torch's import (seconds) while you wait on a hung job.
NOT_SEEN = "not compared: RNG states, the data each rank reads, gradients"


# --- drift: are the replicas the same? ---
KINDS = ("optimizer state", "settings", "parameters", "buffers", "tensor attributes")  # listed in this order: a
# cause (one rank's optimizer state or lr) before what it makes drift a step later (the parameters)


class ReplicasDiffer(RuntimeError):
    """check_replicas' error, the same on every rank; .differences: every (kind, text), in the order listed."""

    def __init__(self, message, differences=()):  # a default: an unpickled copy is built from the message alone
        super().__init__(message)
        self.differences = list(differences)


def check_replicas(module, optimizer=None, group=None, ignore=()):
    """Compare, across the ranks of `group`, everything a replica holds: every parameter, buffer and plain tensor
    attribute (a tensor kept in `self.x`, or in a list or dict there) of every submodule, which submodules are in
    eval mode, and, given `optimizer`, its state (momentum, Adam's moments and step) and its hyperparameters (lr).
    Works on a plain module and on a DDP-style wrapper (its `.module` is compared), tensors on any device, any dtype,
    bit for bit. Returns a one-line summary when all agree; otherwise raises ReplicasDiffer (a RuntimeError) on
    every rank alike, listing every difference by kind, the optimizer's state and settings first (the cause comes
    before the parameters it made drift): the tensor, the ranks that differ from rank 0, the largest difference (a
    tensor whose shape or dtype differs between ranks, or that some ranks lack, is named, not compared).
    Buffers that a DDP-style wrapper built with broadcast_buffers=True (the default) overwrites with rank 0's at its
    next forward (BatchNorm's statistics after a step) are counted in the summary, not raised on. `ignore`: names or
    patterns (fnmatch: '*.running_var') of tensors and settings not to compare.
    It cannot see what is not a tensor of the model or optimizer: RNG states, the data each rank reads, gradients.
    Cost: one broadcast of the replica's bytes plus two small all-gathers. Call it on every rank, once right after
    setup or a resume (where a rank-only load shows as optimizer state, before any parameter drifts), then every N
    steps."""
    import torch
    import torch.distributed as dist
    group = group or dist.group.WORLD
    world, src = dist.get_world_size(group), dist.get_global_rank(group, 0)
    tensors, facts, kinds, sync = _replica_state(module, optimizer)
    ignored = [n for n in [*tensors, *facts] if any(fnmatch.fnmatchcase(n, p) for p in ignore)]
    for n in ignored:
        tensors.pop(n, None)
        facts.pop(n, None)
    # First what each rank holds (names, dtypes, shapes, eval modes, lr): tensors of different layouts cannot be
    # compared byte for byte, and a broadcast of one length paired with another's would fail or hang.
    mine = {"layout": {n: (str(t.dtype)[6:], tuple(t.shape)) for n, t in tensors.items()}, "facts": facts,
            "kinds": kinds, "sync": sync}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    kinds = {n: k for x in reversed(everyone) for n, k in x["kinds"].items()}  # rank 0's where ranks disagree
    broadcast, synced = everyone[0]["sync"]
    problems = [(kinds[n], text) for n, text in _layout_problems([x["layout"] for x in everyone])
                + _fact_problems([x["facts"] for x in everyone])]
    common = [n for n in everyone[0]["layout"] if all(x["layout"].get(n) == everyone[0]["layout"][n] for x in everyone)]
    # Then the bytes: rank 0's broadcast to all, every rank compares its own; one flat buffer per 64 MiB.
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
            if not torch.equal(flat[offset:offset + n], ref[offset:offset + n]):  # only a differing tensor pays more
                theirs = ref[offset:offset + n].clone().view(t.dtype).view(t.shape).to(t.device)  # clone: aligned
                worst = (_wide(t) - _wide(theirs)).abs().max().item() if t.numel() else 0.0
                diffs[i] = worst if worst > 0 else math.nan  # bits differ, values do not (NaN, -0.0): flag it
            offset += n
    # Every rank gathers every rank's differences: the same table everywhere, so every rank raises the same error.
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
            problems.append((kinds[common[i]], f"{common[i]} ({str(t.dtype)[6:]}, {tuple(t.shape)}) on rank(s) "
                             f"{ranks} differs from rank 0's {by}"))
    notes = []
    if overwritten:
        notes.append(f"{len(overwritten)} buffer(s) differ by design: DDP (broadcast_buffers=True) overwrites them "
                     f"with rank 0's as its next forward starts (BatchNorm's statistics after a step): "
                     f"{', '.join(overwritten[:4])}{', ...' if len(overwritten) > 4 else ''}")
    if ignored:
        notes.append(f"ignored: {', '.join(ignored[:4])}{', ...' if len(ignored) > 4 else ''}")
    if any(k == "buffers" and re.search(r"running_(mean|var)$", text.split(" (")[0]) for k, text in problems):
        copier = "nothing copies them" if broadcast is None else \
            "DDP with broadcast_buffers=False (or forward_sync_buffers=False) does not copy them"
        notes.append(f"BatchNorm's running statistics are each rank's own: {copier}. Average them over the ranks "
                     "(all_reduce, then divide) before you evaluate or save, or broadcast rank 0's; nn.SyncBatchNorm "
                     "averages them in every forward, on GPU modules only (on the CPU, DDP raises 'SyncBatchNorm "
                     "layers only work with GPU modules')")
    if problems:
        raise ReplicasDiffer(_differences_message(problems, notes), sorted(problems, key=lambda p: KINDS.index(p[0])))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    return (f"replicas identical on {world} ranks: {len(tensors)} tensors, {size / 2**20:.1f} MiB "
            f"({NOT_SEEN})" + "".join(f"; {note}" for note in notes))


def _differences_message(problems, notes, shown=3):
    """'replicas differ: X' for one difference; else a count by kind, then up to `shown` of each kind, causes first."""
    problems = sorted(problems, key=lambda p: KINDS.index(p[0]))  # stable: within a kind, the order found
    if len(problems) == 1:
        lines = [f"replicas differ: {problems[0][1]}"]
    else:
        counts = {k: sum(kind == k for kind, _ in problems) for k in KINDS}
        causes = counts["optimizer state"] + counts["settings"]
        lines = [f"replicas differ in {len(problems)} places (" + ", ".join(f"{k} {n}" for k, n in counts.items() if n)
                 + ")" + (", the optimizer's state and settings first: they make the parameters drift a step later"
                          if 0 < causes < len(problems) else "")]
        for k, n in counts.items():
            lines += [f"  {text}" for kind, text in problems if kind == k][:shown]
            if n > shown:
                lines.append(f"  ... {n - shown} more {k} (the exception's .differences lists all)")
    return "\n".join(lines + [f"  ({note})" for note in notes])


def _replica_state(module, optimizer):
    """What check_replicas compares: ({name: tensor}, {name: plain value}, {name: kind}, (broadcast_buffers: True,
    False or None without a wrapper, {names of the buffers the wrapper's forward overwrites}))."""
    import torch
    import torch.nn as nn
    prefix, broadcast, synced = "", None, set()
    # A DDP-style wrapper (PyTorch's DDP, or one written by hand) holds the replica in .module; its own tensors are
    # its machinery (gradient buckets, per-rank flags), which may rightly differ between ranks.
    while isinstance(getattr(module, "module", None), nn.Module) and \
            {id(p) for p in module.parameters()} == {id(p) for p in module.module.parameters()}:
        if broadcast is None and hasattr(module, "broadcast_buffers"):  # PyTorch's DDP (a property since 2.13)
            broadcast = bool(module.broadcast_buffers)
            skip = getattr(module, "parameters_to_ignore", set())  # _ddp_params_and_buffers_to_ignore
            synced = {prefix + "module." + n for n, _ in module.module.named_buffers() if n not in skip} \
                if broadcast else set()
        module, prefix = module.module, prefix + "module."
    tensors, seen, facts, kinds, evals = {}, set(), {}, {}, []

    def add(name, t, kind):
        if isinstance(t, torch.Tensor) and id(t) not in seen and t.layout == torch.strided and not t.is_quantized \
                and t.device.type != "meta":  # dense tensors with bytes to compare
            seen.add(id(t))  # a tensor shared by two names (tied weights) is compared once
            tensors[name], kinds[name] = t.detach(), kind

    for mname, m in module.named_modules():
        at = prefix + mname + "." if mname else prefix
        for n, p in m.named_parameters(recurse=False):
            add(at + n, p, "parameters")
        for n, b in m.named_buffers(recurse=False):
            add(at + n, b, "buffers")
        for n, v in vars(m).items():  # plain attributes: neither DDP's broadcast nor load_state_dict touches them
            if isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    add(f"{at}{n}[{i}]", x, "tensor attributes")
            elif isinstance(v, dict) and not n.startswith("_"):
                for k, x in v.items():
                    add(f"{at}{n}[{k!r}]", x, "tensor attributes")
            else:
                add(at + n, v, "tensor attributes")
        if not m.training and not any(mname.startswith(e) for e in evals):  # the outermost module in eval mode only
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
    for name in dict.fromkeys(n for layout in layouts for n in layout):  # every name, in first-seen order
        have = {r: layout.get(name) for r, layout in enumerate(layouts)}
        if None in have.values():
            problems.append((name, f"{name} exists on rank(s) {[r for r, x in have.items() if x]} only"))
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
                problems.append((name, f"{name} on rank(s) {[r for r, v in enumerate(values) if v]} only"))
            else:
                problems.append((name, f"{name} is " + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))))
    return problems


def _comm_device(group):
    """Where the group's collectives take tensors: the CPU for gloo, this rank's GPU for NCCL."""
    import torch
    import torch.distributed as dist
    backend = str(dist.get_backend(group))
    if "gloo" not in backend and "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes(t):  # compare bits, not values: bf16, ints and bool alike; NaN equals itself
    import torch
    return t.contiguous().view(-1).view(torch.uint8)


def _wide(t):
    import torch
    return t.to(torch.complex128) if t.is_complex() else t.double()


def _chunks(tensors, most):
    """(first, last) index ranges of `tensors` whose bytes add up to at most `most` (at least one tensor each)."""
    first, size = 0, 0
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if i > first and size + n > most:
            yield first, i
            first, size = i, 0
        size += n
    if first < len(tensors):
        yield first, len(tensors)


def group_for_ddp():
    """Every rank in a group that TORCH_DISTRIBUTED_DEBUG=DETAIL leaves unchecked, for DDP(model,
    process_group=group_for_ddp()): DETAIL wraps each group it sees created in a checker, and on gloo DDP's
    constructor segfaults on that wrapper (torch 2.14). DDP's own all-reduces go unchecked; your other collectives
    (metrics, evaluation, barriers) keep DETAIL's check. The price: DETAIL never compares DDP's all-reduces with yours,
    so a rank in DDP's backward against another in your barrier hangs until the timeout (then `stacks`, `fr`).
    Call it on every rank, after init_process_group."""
    import torch.distributed as dist
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)  # new_group wraps the group only when DETAIL is on as it is created
    try:
        return dist.new_group()
    finally:
        dist.set_debug_level(level)


# --- hangs: the Flight Recorder, on gloo and NCCL ---
@contextlib.contextmanager
def flight_recorder(dump_dir, hang_s=60.0):
    """Record this process's collectives (PyTorch's Flight Recorder) and write the record to `dump_dir`/rank_<R>
    when the block ends, normally or by an exception (a timeout, a peer that died), and whenever a collective has
    waited `hang_s` seconds: a hang leaves a record long before the group's timeout (10 or 30 minutes) ends it.
    Use it on every rank; then `python debug_tools.py fr DIR` says which collective each rank reached.

    PyTorch 2.14 records by default (2000 entries, TORCH_FR_BUFFER_SIZE), on gloo as on NCCL; it reads the variables
    below when the process group is created. Entered before init_process_group, this block also sets them for
    NCCL, whose watchdog then writes its own record (same file names) on a timeout, even from a rank stuck in a
    kernel; entered later, only this block's own records are written."""
    import torch.distributed as dist
    os.makedirs(dump_dir, exist_ok=True)
    if not dist.is_initialized():
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(os.path.abspath(dump_dir), "rank_")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    _RUN.clear()  # a new block: its run is the group's now (one process may hold several runs, a notebook's say)
    _RUN["started"] = time.time()
    if dist.is_initialized():
        _run_id()  # now, while every rank can still reach the store
    done = threading.Event()
    watchdog = threading.Thread(target=_watch, args=(dump_dir, hang_s, done), daemon=True)
    watchdog.start()  # a thread: the main thread may be blocked in C++, but gloo and NCCL waits release the GIL
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(Exception):  # the error that ended the block is the one to see, not a failed dump
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
                _run_id()  # as soon as the group is up: later, the store's host may be the rank that died
            pending = [e for e in _trace(stacks=False)["entries"] if not e.get("retired", True)]
        except Exception:  # no group yet, or one being torn down
            continue
        oldest = min(pending, key=lambda e: e["time_created_ns"], default=None)
        if oldest and time.time_ns() - oldest["time_created_ns"] > hang_s * 1e9 and oldest["record_id"] != dumped:
            dumped = oldest["record_id"]
            _dump(dump_dir, f"{oldest['profiling_name']} #{oldest['collective_seq_id']} waiting > {hang_s:g} s")


def _trace(stacks=True):
    """This process's Flight Recorder record (PyTorch has no public call for it in 2.14: the private one is here,
    not in your script). NCCL's collectives are in the CUDA recorder, gloo's in the generic one."""
    import torch
    import torch.distributed as dist
    c10d = torch._C._distributed_c10d
    nccl = dist.is_initialized() and "nccl" in str(dist.get_backend()) and hasattr(c10d, "_dump_nccl_trace")
    trace = pickle.loads((c10d._dump_nccl_trace if nccl else c10d._dump_fr_trace)(True, stacks, False))
    # gloo names its groups '' in pg_config where the entries say '0', '1', ...: torch's analyser needs them to agree.
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
    # Which run wrote it: a folder reused by a later run (fewer ranks, a rerun) keeps the older run's files.
    trace["debug_tools"] = {"run": _run_id(), "world_size": dist.get_world_size() if dist.is_initialized() else None,
                            "started": _RUN.get("started"), "written": time.time()}
    with open(path + ".part", "wb") as f:  # then renamed: the analyser never reads half a file
        pickle.dump(trace, f)
    os.replace(path + ".part", path)
    print(f"[flight_recorder] rank {rank}: wrote {path} ({why}); read it: python debug_tools.py fr {dump_dir}",
          file=sys.stderr, flush=True)


_RUN = {}


def _run_id():
    """One id for every rank of this run: the first rank to ask puts its own in the job's store (the one
    init_process_group made), the others read it there. Without a store, this process's own (a run of one)."""
    if "id" not in _RUN:
        import torch.distributed as dist
        mine = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        try:
            store = dist.distributed_c10d._get_default_store()  # private, like _dump_fr_trace: in this file only
            _RUN["id"] = store.compare_set("debug_tools/flight_recorder/run", "", mine).decode()
        except Exception:
            _RUN["id"] = mine
    return _RUN["id"]


def read_records(dump_dir, run=None):
    """({rank: record} of one run, the lines saying which run that is and which files were skipped) from the rank_<R>
    files in dump_dir: the newest run's, or run's. A record that names no run (NCCL's own dump, written by its
    watchdog under TORCH_FR_DUMP_TEMP_FILE) is read with the run when it was written after that run started."""
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
    if not runs:  # NCCL's own dumps only, or records from before runs were named: all of them
        return ({r: rec for r, (_, rec) in sorted(unnamed.items())},
                [f"read {len(unnamed)} record(s) that name no run (NCCL's own dumps, or an older debug_tools): if this "
                 "folder held an earlier run, its files are mixed in"] + ([f"skipped: {', '.join(skipped)}"]
                                                                           if skipped else []))

    def info(r):
        return next(iter(runs[r].values()))[1]["debug_tools"]

    def written(r):
        return max(rec["debug_tools"]["written"] for _, rec in runs[r].values())

    def when(r):
        return time.strftime("%H:%M:%S", time.localtime(written(r)))
    if run is not None and run not in runs:
        return {}, [f"no run {run} in {dump_dir}: " + ", ".join(runs)]
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
    head = [f"read run {chosen} ({world} ranks, written {when(chosen)}): "
            f"{', '.join(f'rank_{r}' for r in sorted(records))}"
            + (f"; missing: {', '.join(f'rank_{r}' for r in range(world) if r not in records)}"
               if world and len(records) < world else "")]
    return dict(sorted(records.items())), head + ([f"skipped: {'; '.join(skipped)}"] if skipped else [])


LIBRARY = re.compile(r"site-packages|dist-packages|/lib/python3|^<")  # torch and the standard library, not yours


def where(frames):
    """The innermost frame outside torch and the standard library: the line of your code that made the call."""
    for f in frames:
        if not LIBRARY.search(f["filename"]):
            return f"{f['name']} ({os.path.basename(f['filename'])}:{f['line']})"
    return "?"


def summarize_records(records):
    """Lines saying what each rank's last collectives were and the first collective on which the ranks part."""
    lines, by_seq = [], {}
    for rank, record in records.items():
        coll = [e for e in record["entries"] if not e.get("is_p2p")]
        if not coll:
            lines.append(f"rank {rank}: no collective recorded")
            continue
        last, status = coll[-1], record.get("pg_status", {}).get(coll[-1]["process_group"][0], {})
        done = last["collective_seq_id"] <= status.get("last_completed_collective", math.inf)
        lines.append(f"rank {rank}: {len(coll)} collectives; the last, #{last['collective_seq_id']}, {call(last)}, "
                     + ("completed" if done else "never completed"))
        for e in coll:
            by_seq.setdefault((e["process_group"][0], e["collective_seq_id"]), {})[rank] = e
    for (pg, seq), ranks in sorted(by_seq.items(), key=lambda kv: kv[0][1]):
        calls = {}
        for r in records:  # the ranks grouped by the call they made at this point
            calls.setdefault(call(ranks[r]) if r in ranks else "nothing: it never got there", []).append(r)
        if len(calls) > 1:
            lines.append(f"the ranks part at collective #{seq} of group {pg}:")
            lines += [f"  rank(s) {rs}: {c}" for c, rs in calls.items()]
            return lines
    return lines + ["every rank issued the same collectives, in the same order"]


def call(entry):
    """'gloo:all_gather [[8, 1]] from evaluate (train.py:47)': the collective and the line of your code."""
    return f"{entry['profiling_name']} {entry['input_sizes']} from {where(entry.get('frames', []))}"


# --- hangs: every rank's stack ---
MP_CHILD = re.compile(r"multiprocessing\.(spawn|forkserver) import|--multiprocessing-fork")  # its children's cmdline


def find_job(pid):
    """The processes of the job `pid` belongs to, on this machine: (ranks: {pid: its RANK, or None where its
    environment has none or one shared by several processes}, workers: {pid: its rank's pid} for the ranks' own
    child processes (DataLoader workers)). `pid` may be torchrun's agent, mp.spawn's parent, a rank or a worker.
    Empty where no rank is found: then `pid` is no training process, or one whose job cannot be seen from here."""
    env = _environ(pid)
    if "RANK" in env:  # torchrun's worker, or a process started with RANK set; or a child that inherited it
        rank_pid, port = pid, env.get("MASTER_PORT")
        while "RANK" in _environ(_ppid(rank_pid)) and _environ(_ppid(rank_pid)).get("MASTER_PORT") == port:
            rank_pid = _ppid(rank_pid)  # a DataLoader worker inherits its rank's environment: climb to the rank

        def is_rank(p):
            return "RANK" in _environ(p) and _environ(p).get("MASTER_PORT") == port  # the same job, not another
        root = _ppid(rank_pid)
    elif MP_CHILD.search(_cmdline(pid)):  # started by multiprocessing (spawn): a rank of mp.spawn, or its worker
        rank_pid = pid
        while MP_CHILD.search(_cmdline(_ppid(rank_pid))):
            rank_pid = _ppid(rank_pid)

        def is_rank(p):  # its children that run torch: not the resource tracker
            return bool(MP_CHILD.search(_cmdline(p))) and _runs_torch(p)
        root = _ppid(rank_pid)
    else:  # a launcher: torchrun's agent, mp.spawn's parent, a shell

        def is_rank(p):
            return "RANK" in _environ(p) or bool(MP_CHILD.search(_cmdline(p))) and _runs_torch(p)
        root = pid
    tree, ranks, workers = _children(), [], {}
    todo = list(tree.get(root, []))
    while todo:  # breadth first; everything under a rank is that rank's (DataLoader workers, compile workers)
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
    return {p: int(r) if r is not None and labels.count(r) == 1 else None for p, r in zip(ranks, labels)}, workers


def _environ(pid):  # the environment the process started with (what os.environ set later is not in it)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
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


def find_py_spy():
    """py-spy on PATH, else beside this Python (a virtual environment not activated), else in its user scripts."""
    places = [os.path.dirname(sys.executable), sysconfig.get_path("scripts"),
              sysconfig.get_path("scripts", f"{os.name}_user")]
    found = [os.path.join(d, "py-spy") for d in places if d and os.access(os.path.join(d, "py-spy"), os.X_OK)]
    return shutil.which("py-spy") or (found[0] if found else None)


NO_PY_SPY = ("py-spy not found (not on PATH, nor beside {python}): pip install py-spy. Without it: a job started "
             "with PYTHONFAULTHANDLER=1 prints a rank's Python stack to its stderr on `kill -ABRT PID`, which ends "
             "that rank; faulthandler.register(signal.SIGUSR1, all_threads=True) in your script prints it on `kill "
             "-USR1 PID`, and the rank goes on")
NATIVE_WAIT = re.compile(r" *(c10d::|gloo::|nccl|torch::distributed::)")  # a C++ frame of PyTorch's communication
PTRACE_HELP = ("py-spy reads another process's memory, which needs ptrace permission: run it as root (sudo), or allow "
               "it (sudo sysctl kernel.yama.ptrace_scope=0); in a container start it with --cap-add SYS_PTRACE "
               "(Kubernetes: securityContext.capabilities.add [SYS_PTRACE])")


def stacks(pid, native=False):
    """Every rank's stack (py-spy dump, all ranks at once), labelled by rank, then one line per rank: where it waits."""
    if _ppid(pid) is None:
        sys.exit(f"error: no process {pid}")
    ranks, workers = find_job(pid)
    name = os.path.basename(_cmdline(pid).split(" ")[0]) or "?"
    if not ranks and not _runs_torch(pid):
        sys.exit(f"error: pid {pid} ({name}) is no training process: it runs no torch, its environment has no RANK, "
                 "and no rank runs under it")
    py_spy = find_py_spy()
    if not py_spy:
        sys.exit("error: " + NO_PY_SPY.format(python=sys.executable))
    if not ranks:  # torch, but no job around it: a rank started some other way (its rank unknown), or no rank
        print(f"pid {pid} ({name}) runs torch, but no rank of a job was found around it (no RANK in its "
              "environment, not started by mp.spawn or torchrun): its own stack")
        ranks = {pid: None}
    elif pid in workers:
        what = "a DataLoader worker" if _comm(pid) == "pt_data_worker" else "a child process"  # torch names them
        print(f"pid {pid} is {what} of the rank with pid {workers[pid]}, not a rank: the ranks of its job follow")
    cmd = [py_spy, "dump", "--full-filenames", *(["--native"] if native else [])]
    with ThreadPoolExecutor(len(ranks)) as pool:  # at once: a picture of the same moment on every rank
        dumps = dict(zip(ranks, pool.map(
            lambda p: subprocess.run([*cmd, *(["--locals"] if ranks[p] is None else []), "--pid", str(p)],
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
        dump = "\n".join(ln for ln in res.stdout.splitlines() if not ln.startswith("        "))  # no locals
        lines, hidden = [], 0
        for line in dump.splitlines():
            python_frame = re.match(r" +\S.* \(\S+\.py:\d+\)$", line)
            if native and line.startswith("    ") and not python_frame and not NATIVE_WAIT.match(line):
                hidden += 1  # libc, pybind11, autograd's engine: what the rank waits for is in c10d's frames
                continue
            if not line.startswith("Python v"):
                lines.append(re.sub(r"\(/\S*/(site-packages/|lib/)", "(", line))  # torch/_tensor.py, libtorch_cpu.so
        print("\n".join(lines) + (f"\n    ({hidden} other native frames hidden)" if hidden else ""))
        summary.append(f"{label}: " + _waits(dump))
    print("\nwhere each rank is (its main thread: your line, the call it is in, the C++ wait with --native):")
    print("\n".join("  " + s for s in summary))


def _name(rank):
    return "rank unknown" if rank is None else f"rank {rank}"


def _label(ranks, dumps):
    """({pid: rank or None}, world size or '?', how the ranks were read): RANK from the environment; where there is
    none (mp.spawn's children), a `rank` argument or variable in the main thread's frames, yours first (the
    tutorial's demo_basic(rank, world_size)), as py-spy --locals shows it; where that is missing or not one per
    process either, None: no process is labelled with a rank it may not be."""
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
                    found.append((bool(LIBRARY.search(frame.group(2))), v.group(1), int(v.group(2)), frame.group(1)))
            found.sort(key=lambda f: f[0])  # your frames first, then torch's (init_process_group's rank)
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
    how = (f" (no RANK in their environment: ranks read from `rank` in {', '.join(sorted(set(seen.values())))})"
           if seen else "")
    if any(r is None for r in labels.values()):
        how += " (rank unknown: no RANK in the environment, no `rank` variable in its frames)"
    return labels, int(world) if world else "?", how


def _waits(dump):
    """'train (file.py:56) in Tensor.backward <- c10d::Reducer::finalize_backward' from one py-spy dump."""
    main = dump.split('"MainThread"')[1] if '"MainThread"' in dump else dump
    main = re.split(r"\nThread ", main)[0]
    frames = [ln.strip() for ln in main.splitlines() if ln.startswith("    ")]
    python = [(i, m) for i, f in enumerate(frames) if (m := re.match(r"(.+) \((\S+\.py):(\d+)\)$", f))]
    mine = next(((i, m) for i, m in python if not LIBRARY.search(m.group(2))), None)
    if mine is None:
        return python[0][1].group(0) if python else "(no Python frame)"
    i, m = mine
    calls = [c.group(1) for j, c in python if j < i and not re.search(r"wrapper|<locals>|_call_impl$", c.group(1))]
    text = f"{m.group(1)} ({os.path.basename(m.group(2))}:{m.group(3)})"
    text += f" in {calls[-1]}" if calls else ""  # the library call your line made: barrier, Tensor.backward, ...
    waits = [f.split(" (")[0] for f in frames[:i] if NATIVE_WAIT.match(f)]
    return text + (f" <- {waits[0]}" if waits else "")


# --- command line ---
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stacks", help="every rank's Python stack, labelled by rank (py-spy)")
    s.add_argument("pid", type=int, help="torchrun's agent, mp.spawn's parent, any rank of the job, or a worker of one")
    s.add_argument("--native", action="store_true", help="with the C++ frames of c10d, gloo, NCCL and DDP's reducer")
    f = sub.add_parser("fr", help="read the Flight Recorder's records (flight_recorder(DIR) or NCCL's own dumps)")
    f.add_argument("dir", help="the folder of rank_<R> files")
    f.add_argument("--torch", action="store_true", help="then run torch's analyser on them too (fr_trace)")
    f.add_argument("--run", help="the run to read (its id, as fr prints it); default: the newest")
    args = p.parse_args(argv)
    if args.command == "stacks":
        return stacks(args.pid, args.native)
    if not os.path.isdir(args.dir):
        sys.exit(f"error: no folder {args.dir}")
    records, said = read_records(args.dir, args.run)
    if not records:
        sys.exit(f"error: no rank_<R> files in {args.dir}" + (f" ({said[0]})" if said else ""))
    print("\n".join(said + summarize_records(records)))
    print("\ntorch's own analyser: python -m torch.distributed.flight_recorder.fr_trace DIR --allow-incomplete-ranks "
          "(or torchfrtrace; it reads every file in DIR, whatever run wrote it). In its output, 'Culprit rank R' "
          "means that R's call differs from that of the rank whose record it read first, which may be the rank at "
          "fault: read which call each rank made, above.")
    if args.torch:
        with tempfile.TemporaryDirectory() as d:  # this run's records only
            for r, record in records.items():
                with open(os.path.join(d, f"rank_{r}"), "wb") as fh:
                    pickle.dump(record, fh)
            cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", d, "--allow-incomplete-ranks"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        print(res.stdout + res.stderr)


if __name__ == "__main__":
    main()
