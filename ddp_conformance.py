"""PyTorch's own DDP tests, run on ManualDDP: is ddp_dropin.ManualDDP a drop-in for PyTorch's DDP?

The torch wheel ships PyTorch's distributed tests, in
torch/testing/_internal/distributed/distributed_test.py. PyTorch runs them through
test/distributed/test_distributed_spawn.py, with BACKEND, WORLD_SIZE and TEMP_DIR set. Each test
method of DistributedTest._DistTestBase then gets one spawned process per rank. This script does the
same, on gloo and the CPU, twice. The first run is as PyTorch's (--impl torch). The second replaces
DistributedDataParallel with ManualDDP in every rank (--impl manual). Then it compares the two.

Which tests run? A method `test_*` of DistributedTest._DistTestBase runs if its name mentions `ddp`
or `DistributedDataParallel`, in any case. It also runs if its body names `DistributedDataParallel`,
or a `self.<helper>` that it calls does, followed through the class. Parametrized copies are traced
back to their source function. Nothing else in that file involves DDP.

How is ManualDDP swapped in? distributed_test.py reaches DDP by three names. One is its own
module-level `DistributedDataParallel`. The other two, `nn.parallel.DistributedDataParallel` and
`torch.nn.parallel.DistributedDataParallel`, are one attribute of the torch.nn.parallel package.
Each rank sets both to ManualDDP in `_run`, the classmethod a spawned rank starts with. Spawn
imports everything again, so the patch must be made there. torch's own code that imports
DistributedDataParallel from torch.nn.parallel.distributed is left alone.

--gpu-tests-on-cpu: without GPUs, 91 of the 103 chosen tests skip, most for want of a GPU per rank
(`skip_if_lt_x_gpu(2)`). That leaves 12 to compare. This option runs the others on the CPU anyway.
It drops the GPU skips. A TorchFunctionMode in each rank turns every device a test names (cuda:N,
or a rank number) into the CPU. torch.cuda.set_device, synchronize and current_device do nothing,
and DDP (either impl) gets no device_ids. This adapts PyTorch's tests, so it has its own result
files. What really needs CUDA (SyncBatchNorm, mixed precision, streams) then fails on PyTorch's
DDP too, and is left out of the comparison.

Verdicts are pass, fail, error, skip and timeout. A skip is the test's own decision, say for want of
CUDA or NCCL, or for the world size. A timeout is a test killed after --timeout seconds, or one
whose worker hung and was restarted. A test that passes on PyTorch's DDP and not on ManualDDP is
sorted into one of two kinds. It is `private` when it needs an internal of PyTorch's DDP that a
drop-in need not have. Those are names that start with `_`, `reducer` and `logger` (the C++ Reducer
and Logger), and the cases in REVIEWED. Anything else is a `gap`, a real difference of behaviour,
shown with its error. The sorting is automatic, so read the error in the JSON results before fixing
anything.

Usage. Run one at a time on 2 cores. A full run takes 15 to 20 minutes a mode, so run it in the
background.
  python ddp_conformance.py --out /tmp/conf --markdown                  # both impls, 2 ranks
  python ddp_conformance.py --out /tmp/conf --gpu-tests-on-cpu --markdown
  python ddp_conformance.py --impl manual --out /tmp/conf --markdown    # vs the saved torch results
  python ddp_conformance.py --impl manual -k 'no_sync|join' --out /tmp/conf  # names by a regex
  python ddp_conformance.py --impl manual --fork -k ...  # ranks forked: 0.3 s a test, not 4
  python ddp_conformance.py --report --markdown --out /tmp/conf         # the saved results' table
  python ddp_conformance.py --impl manual --source /tmp/patched ...   # the files in /tmp/patched
Files in --out: results_<impl>_ws<N>[_gpu_tests_on_cpu].jsonl (a JSON line per test: its status, its
seconds and the whole error), report_*.md, worker_*.log (all the ranks printed), and the snapshot of
ddp_dropin.py and 05 tested. PyTorch's test helpers import `expecttest`: pip install expecttest.
The results, and the tests that need an internal, are in docs/manual_ddp.md.
"""

import argparse
import ast
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent

SOURCE_ENV = "DDP_CONFORMANCE_SOURCE"  # the folder whose ddp_dropin.py the ranks load: a snapshot
ADAPT_ENV = "DDP_CONFORMANCE_GPU_TESTS_ON_CPU"  # --gpu-tests-on-cpu: see adapt_gpu_tests_to_cpu
IMPL_ENV = "DDP_CONFORMANCE_IMPL"  # set for the worker, and so for the ranks it spawns
SKIPS_ENV = "DDP_CONFORMANCE_SKIPS"  # folder where a rank writes why it skipped a test
FORK_ENV = "DDP_CONFORMANCE_FORK"  # --fork: see main()'s help
IMPLS = ("torch", "manual")
PRIVATE_NAMES = {"reducer", "logger"}  # public-looking names of DDP's C++ internals
WORKER_RESTARTS = 20


def make_env(**extra):
    """The environment of the worker and its ranks: loopback, a thread a rank, no buffering."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **{k: str(v) for k, v in extra.items()}}


def kill_group(proc):
    """Kill the worker and every rank it started. They share the process group of its session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# --- in the ranks: swap the class ---
def load_manual_ddp():
    """ManualDDP from the snapshot's ddp_dropin.py, imported as `ddp_dropin`, so that torch.save can
    pickle it. ddp_dropin.py loads the 05_manual_ddp_gpt2.py beside it."""
    from lessons import load
    return load(Path(os.environ.get(SOURCE_ENV) or REPO) / "ddp_dropin.py").ManualDDP


def install_impl(impl):
    """Make every name distributed_test.py uses for DDP mean the class under test."""
    import torch.nn.parallel
    import torch.testing._internal.distributed.distributed_test as dt
    cls = load_manual_ddp() if impl == "manual" else torch.nn.parallel.DistributedDataParallel
    if os.environ.get(ADAPT_ENV):
        cls = on_cpu(cls)
    torch.nn.parallel.DistributedDataParallel = cls  # the tests' nn.parallel.X, torch.nn.parallel.X
    dt.DistributedDataParallel = cls  # its `from torch.nn.parallel import DistributedDataParallel`


# --- --gpu-tests-on-cpu: most DDP tests ask for a GPU per rank. Run them on the CPU anyway ---
def adapt_gpu_tests_to_cpu():
    """Drop the 'needs N GPUs' skips, unlike PyTorch's own runs. The worker and each rank call it
    before distributed_test is imported, which applies its decorators. Both impls get the same
    treatment. Only the tests that then pass on PyTorch's DDP count. Those that really need CUDA
    fail on both, and are left out."""
    import torch.testing._internal.common_distributed as cd

    cd.skip_if_lt_x_gpu = lambda x, **kwargs: (lambda func: func)
    cd.skip_if_no_gpu = lambda func: func


def keep_on_cpu():
    """In a rank, for --gpu-tests-on-cpu: each device a test names (cuda:N, a rank) is the CPU."""
    import torch
    from torch.overrides import TorchFunctionMode

    def cpu(device):
        if isinstance(device, int) and not isinstance(device, bool):
            return torch.device("cpu")
        if isinstance(device, str | torch.device) and str(device).startswith("cuda"):
            return torch.device("cpu")
        return device

    class OnCPU(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            if func is torch.Tensor.to:
                kept = torch.dtype | torch.Tensor
                args = (args[0], *[a if isinstance(a, kept) else cpu(a) for a in args[1:]])
            return func(*args, **kwargs)

    OnCPU().__enter__()  # for the rest of this process
    compile_ = torch.compile

    def compile_outside_the_mode(model=None, **kwargs):
        """Dynamo would trace OnCPU too, and fail. So run the compiled code with OnCPU aside."""
        if model is None:
            return lambda m: compile_outside_the_mode(m, **kwargs)
        compiled = compile_(model, **kwargs)
        if isinstance(compiled, torch.nn.Module):
            forward = compiled.forward

            def run(*args, **kw):
                with torch.overrides._pop_mode_temporarily():
                    return forward(*args, **kw)
            compiled.forward = run
        return compiled

    torch.compile = compile_outside_the_mode
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: 0  # a device number, which means the CPU above


def on_cpu(cls):
    """cls without device_ids and output_device, as the module is on the CPU now. Pickle finds its
    name."""
    name = f"{cls.__name__}OnCPU"

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        cls.__init__(self, module, None, None, *args, **kwargs)

    body = {"__init__": __init__, "__module__": __name__, "__qualname__": name}
    adapted = type(name, (cls,), body)
    setattr(sys.modules[__name__], name, adapted)
    return adapted


def record_skip_reasons(test_name):
    """A rank that skips exits with a code that only says 'skipped'. Keep the reason it logs."""
    import logging
    folder = os.environ.get(SKIPS_ENV)
    if not folder:
        return

    class Keep(logging.Handler):
        def emit(self, record):
            if "skipping test" in str(record.msg) and len(record.args or ()) == 3:
                Path(folder, test_name).write_text(str(record.args[2]))

    logging.getLogger("torch.testing._internal.common_distributed").addHandler(Keep())


if os.environ.get(IMPL_ENV):  # the worker and its ranks: the class of test_distributed_spawn.py
    import torch
    import torch.testing._internal.common_distributed as common_distributed

    if os.environ.get(ADAPT_ENV):
        adapt_gpu_tests_to_cpu()
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    torch.backends.cuda.matmul.allow_tf32 = False

    class TestDDPConformance(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            if os.environ.get(FORK_ENV):
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

        def tearDown(self):
            super().tearDown()
            try:
                os.remove(self.file_name)  # the FileStore's file, one per test
            except OSError:
                pass

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            install_impl(os.environ[IMPL_ENV])  # in the rank, before the test builds any DDP
            if os.environ.get(ADAPT_ENV):
                keep_on_cpu()
            record_skip_reasons(test_name)
            super()._run(rank, test_name, file_name, pipe, **kwargs)


# --- which tests ---
def select_tests(pattern=None):
    """The DDP tests of DistributedTest._DistTestBase (see the module docstring), in file order."""
    import torch.testing._internal.distributed.distributed_test as dt
    base = dt.DistributedTest._DistTestBase
    source = Path(dt.__file__).read_text()
    cls_node = next(n for n in ast.walk(ast.parse(source))
                    if isinstance(n, ast.ClassDef) and n.name == "_DistTestBase")
    mentions, calls, line, lines = {}, {}, {}, source.splitlines()
    for f in cls_node.body:
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
            # The function's lines. ast.get_source_segment would split the whole file at each call.
            body = "\n".join(lines[f.lineno - 1:f.end_lineno])
            mentions[f.name] = re.search(r"\bDistributedDataParallel\b", body) is not None
            calls[f.name] = {a.attr for a in ast.walk(f) if isinstance(a, ast.Attribute)
                             and isinstance(a.value, ast.Name) and a.value.id == "self"}
            line[f.name] = f.lineno

    def uses_ddp(name, seen):
        if name in seen or name not in mentions:
            return False
        seen.add(name)
        return mentions[name] or any(uses_ddp(c, seen) for c in calls[name])

    chosen = []
    for name in dir(base):
        if not name.startswith("test_"):
            continue
        src_name = inspect.unwrap(getattr(base, name)).__name__
        by_name = re.search("ddp|distributeddataparallel", name, re.I) is not None
        if (by_name or uses_ddp(src_name, set())) and (not pattern or re.search(pattern, name)):
            chosen.append((line.get(src_name, 0), name))
    return [name for _, name in sorted(chosen)]


# --- the worker: runs the tests of one impl, one line of JSON per event ---
def worker(args):
    import unittest
    skips = Path(os.environ[SKIPS_ENV])
    out = Path(args.results)
    done = set()
    if out.exists():
        for ln in out.read_text().splitlines():
            ev = json.loads(ln)
            if ev["event"] == "result":
                done.add(ev["test"])
    common_distributed.TIMEOUT_DEFAULT = args.timeout  # then MultiProcessTestCase kills the ranks
    common_distributed.TIMEOUT_OVERRIDE.clear()
    names = [n for n in select_tests(args.k) if n not in done]

    def write(**ev):
        with out.open("a") as f:
            f.write(json.dumps(ev) + "\n")

    for name in names:
        write(event="start", test=name, time=time.time())
        print(f"[worker] {name}", flush=True)
        result, t0 = unittest.TestResult(), time.time()
        TestDDPConformance(name).run(result)
        if result.errors or result.failures:
            (_, text), = (result.errors + result.failures)[:1]
            status = "timeout" if re.search(r"terminated or timed out after", text) else (
                "fail" if result.failures else "error")
        elif result.skipped:
            text, status = result.skipped[0][1], "skip"
            why = skips / name
            if why.exists():
                text = why.read_text()
        else:
            status, text = "pass", ""
        seconds = round(time.time() - t0, 1)
        write(event="result", test=name, status=status, seconds=seconds, detail=text)
        print(f"[worker] {name}: {status} ({time.time() - t0:.1f}s)", flush=True)


# --- the driver: a worker per impl, restarted past a hang or a crash ---
def tag(args):
    return f"ws{args.world_size}" + ("_gpu_tests_on_cpu" if args.gpu_tests_on_cpu else "")


def results_path(args, impl):
    return Path(args.out) / f"results_{impl}_{tag(args)}.jsonl"


def load_results(path):
    """{test: result event}. A test started but never finished counts as a timeout: the worker died
    or hung in it."""
    res, started = {}, None
    if path.exists():
        for ln in path.read_text().splitlines():
            ev = json.loads(ln)
            if ev["event"] == "start":
                started = ev
            else:
                res[ev["test"]] = ev
                started = None
    return res, started


def run_impl(args, impl):
    out = results_path(args, impl)
    if not args.resume and out.exists():  # forget the results of the tests about to run
        kept = [ln for ln in out.read_text().splitlines()
                if args.k and not re.search(args.k, json.loads(ln)["test"])]  # all, without -k
        out.write_text("".join(ln + "\n" for ln in kept))
    skips = Path(args.out) / f"skips_{impl}_{tag(args)}"
    skips.mkdir(parents=True, exist_ok=True)
    log = Path(args.out) / f"worker_{impl}_{tag(args)}.log"
    # The file under test may change during a long run. So every rank loads the same snapshot.
    source = Path(args.out) / f"snapshot_{tag(args)}"
    source.mkdir(exist_ok=True)
    for name in ("ddp_dropin.py", "05_manual_ddp_gpt2.py"):
        (source / name).write_bytes((Path(args.source) / name).read_bytes())
    env = make_env(BACKEND="gloo", WORLD_SIZE=args.world_size, INIT_METHOD="env://",
                   TEMP_DIR=tempfile.mkdtemp(prefix="ddp_conformance_"),
                   **{IMPL_ENV: impl, SKIPS_ENV: skips, SOURCE_ENV: source},
                   **({ADAPT_ENV: 1} if args.gpu_tests_on_cpu else {}),
                   **({FORK_ENV: 1} if args.fork else {}))
    Path(env["TEMP_DIR"], "barrier").mkdir()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--results", str(out),
           "--timeout", str(args.timeout), *(["-k", args.k] if args.k else [])]
    for _ in range(WORKER_RESTARTS):
        with log.open("a") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        seen = out.stat().st_size if out.exists() else 0
        last, shown = time.time(), len(load_results(out)[0])
        while proc.poll() is None:
            time.sleep(0.2)
            size = out.stat().st_size if out.exists() else 0
            if size != seen:
                last, seen = time.time(), size
                res = list(load_results(out)[0].values())
                for ev in res[shown:]:
                    print(f"  {impl} {res.index(ev) + 1}: {ev['test']}: {ev['status']} "
                          f"({ev['seconds']}s)", flush=True)
                shown = len(res)
            elif time.time() - last > args.timeout + 120:  # the worker hangs: kill it, and go on
                kill_group(proc)
        res, started = load_results(out)
        if started is None:
            if proc.returncode == 0:
                return
            print(f"  {impl}: worker exited {proc.returncode} outside a test. See {log}",
                  flush=True)
            return
        with out.open("a") as f:  # the worker died in this test: record it, restart past it
            why = f"worker hung or died in this test (exit {proc.returncode}). See {log}"
            f.write(json.dumps({"event": "result", "test": started["test"], "status": "timeout",
                                "seconds": round(time.time() - started["time"], 1), "detail": why})
                    + "\n")
    print(f"  {impl}: gave up after {WORKER_RESTARTS} worker restarts", flush=True)


# --- the verdict ---
# Failures on ManualDDP whose error does not name the internal they need, read by hand (torch 2.14).
# Each applies only while the error still matches. A test that fails differently after a change is
# sorted afresh.
REVIEWED = {
    "test_ddp_profiling_torch_profiler": (
        r"Expected 1 but got 0", "profiler range `search_unused_parameters` (DDP's C++ reducer)"),
    "test_ddp_python_error_logged": (
        r"Expected 'iteration' in ddp_logging_data",
        "`_get_ddp_logging_data()['iteration']` (DDP's C++ logger)"),
    "test_skip_all_reduce_unused_parameters": (
        r"None is not 2", "`_get_ddp_logging_data()['num_buckets_reduced']`"),
    "test_ddp_bucket_cap_mb_list": (
        r"attribute 'bucket_bytes_cap_list'",
        "`bucket_bytes_cap_list` (undocumented, kept 'for backward compatibility')"),
    "test_ddp_sync_module_states": (
        r"attribute 'broadcast_bucket_size'",
        "`broadcast_bucket_size` (undocumented), fed to the private `_sync_module_states`"),
}


def classify(detail, test=""):
    """('private', NAME) for a missing internal of PyTorch's DDP, or ('gap', text) for the rest."""
    pattern, need = REVIEWED.get(test, (None, None))
    if pattern and re.search(pattern, detail):
        return "private", need
    if re.search(r"in verify_ddp_error_logged\n", detail):
        return "private", "`_get_ddp_logging_data()` error fields (DDP's C++ logger)"
    owner = r"(?:'ManualDDP(?:OnCPU)?' object|type object 'ManualDDP(?:OnCPU)?')"
    m = re.findall(owner + r" has no attribute '(\w+)'", detail)
    if m:
        name = m[-1]
        if name.startswith("_") or name in PRIVATE_NAMES:
            return "private", name
        return "gap", f"missing public attribute `{name}`"
    return "gap", last_error(detail)


def last_error(detail):
    """The most telling line of a failure: the last exception line of the first failing rank."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    first_rank = [i for i, ln in enumerate(lines)
                  if ln.startswith("Process ") and "exited with error code" in ln]
    if first_rank:
        end = next((i for i in first_rank[1:]), len(lines))
        lines = lines[first_rank[0]:end]
    for ln in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b|AssertionError", ln):
            return ln[:300]
    return (lines[-1] if lines else "")[:300]


def report(args, markdown):
    import torch
    world = args.world_size
    res = {impl: load_results(results_path(args, impl))[0] for impl in IMPLS}
    names = list(dict.fromkeys([*res["torch"], *res["manual"]]))

    def status(impl, name):
        return res[impl].get(name, {}).get("status", "-")
    adapted = ", GPU tests adapted to CPU" if args.gpu_tests_on_cpu else ""
    lines = [f"## ManualDDP vs PyTorch DDP on PyTorch's DDP tests (torch {torch.__version__}, "
             f"gloo/CPU, {world} ranks{adapted})", ""]
    statuses = ("pass", "fail", "error", "timeout", "skip")
    lines += ["| impl | tests | " + " | ".join(statuses) + " |",
              "|---|---|" + "---|" * len(statuses)]
    for impl in IMPLS:
        counts = [sum(1 for r in res[impl].values() if r["status"] == s) for s in statuses]
        lines.append(f"| {impl} | {len(res[impl])} | " + " | ".join(map(str, counts)) + " |")
    both = [n for n in names if n in res["torch"] and n in res["manual"]]
    regress = [n for n in both if status("torch", n) == "pass" and status("manual", n) != "pass"]
    private = [(n, classify(res["manual"][n]["detail"], n)) for n in regress]
    gaps = [(n, c[1]) for n, c in private if c[0] == "gap"]
    private = [(n, c[1]) for n, c in private if c[0] == "private"]
    ok = sum(1 for n in both if status("torch", n) == "pass" and status("manual", n) == "pass")
    torch_pass = sum(1 for n in both if status("torch", n) == "pass")
    lines += ["", f"Of {torch_pass} tests that pass on PyTorch's DDP, {ok} pass on ManualDDP. "
              f"{len(private)} need a private internal, {len(gaps)} show a behavioural gap.", ""]
    if gaps:
        lines += ["### Behavioural gaps (pass on torch DDP, not on ManualDDP)", "",
                  "| test | result | error |", "|---|---|---|"]
        lines += [f"| {n} | {status('manual', n)} | {cell(e)} |" for n, e in gaps] + [""]
    if private:
        lines += ["### Need a private internal of PyTorch's DDP", "", "| test | result | needs |",
                  "|---|---|---|"]
        lines += [f"| {n} | {status('manual', n)} | {a if '`' in a else f'`{a}`'} |"
                  for n, a in private] + [""]
    extra = [n for n in both if status("torch", n) != "pass" and status("manual", n) == "pass"]
    bad_torch = [n for n in res["torch"] if status("torch", n) not in ("pass", "skip")]
    if bad_torch:
        lines += ["### Not passing on PyTorch's own DDP here (out of the comparison)", "",
                  "| test | torch | manual | error on torch |", "|---|---|---|---|"]
        lines += [f"| {n} | {status('torch', n)} | {status('manual', n)} | "
                  f"{cell(last_error(res['torch'][n]['detail']))} |" for n in bad_torch] + [""]
    if extra:
        lines += [f"Pass on ManualDDP only: {', '.join(extra)}", ""]
    missing = [n for n in names if n not in res["torch"] or n not in res["manual"]]
    if missing:
        lines += [f"Run on one impl only: {len(missing)} tests", ""]
    text = "\n".join(lines)
    if not markdown:
        text = re.sub(r"^#+ ", "", text, flags=re.M)
    Path(args.out, f"report_{tag(args)}.md").write_text("\n".join(lines) + "\n")
    print(text)
    return not gaps


def cell(text):
    return text.replace("|", "\\|").replace("\n", " ")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impl", choices=[*IMPLS, "both"], default="both")
    p.add_argument("-k", help="only tests whose name matches this regular expression")
    p.add_argument("--world-size", type=int, choices=[2, 3], default=2)
    p.add_argument("--timeout", type=int, default=240,
                   help="seconds a test may take before its ranks are killed")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "ddp_conformance"),
                   help="folder for the raw results (JSON lines per impl), logs and report")
    p.add_argument("--resume", action="store_true",
                   help="keep finished results and run only the rest. By default every chosen "
                        "test runs again, and with -k the results of other tests are kept")
    p.add_argument("--report", action="store_true",
                   help="run nothing, and print the table from saved results")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--list", action="store_true", help="print the selected tests and exit")
    p.add_argument("--gpu-tests-on-cpu", action="store_true",
                   help="also run the tests that ask for GPUs, moved to the CPU. This is an "
                        "adaptation: see the docstring")
    p.add_argument("--fork", action="store_true",
                   help="fork each test's ranks from the worker, which imported torch and the "
                        "tests once. PyTorch spawns them, to import both again: seconds a test")
    p.add_argument("--source", default=str(REPO),
                   help="the folder whose ddp_dropin.py is tested, with the 05 beside it")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.list:
        env = make_env(BACKEND="gloo", WORLD_SIZE=args.world_size, TEMP_DIR=tempfile.gettempdir())
        code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import ddp_conformance as c; " \
               f"print(*c.select_tests({args.k!r}), sep='\\n')"
        return subprocess.run([sys.executable, "-c", code], env=env).returncode
    if not args.report:
        t0 = time.time()
        for impl in (IMPLS if args.impl == "both" else [args.impl]):
            t1 = time.time()
            log = Path(args.out) / f"worker_{impl}_{tag(args)}.log"
            print(f"{impl}: running (log: {log})", flush=True)
            run_impl(args, impl)
            print(f"{impl}: done in {time.time() - t1:.0f}s", flush=True)
        print(f"total {time.time() - t0:.0f}s\n", flush=True)
    return 0 if report(args, args.markdown) else 1


if __name__ == "__main__":
    sys.exit(main())
