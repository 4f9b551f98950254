"""PyTorch's own DDP tests, run on ManualDDP: is ddp_dropin.ManualDDP a drop-in for PyTorch's DDP?

The torch wheel ships PyTorch's distributed test suite (torch/testing/_internal/distributed/distributed_test.py);
PyTorch runs it through test/distributed/test_distributed_spawn.py with BACKEND, WORLD_SIZE and TEMP_DIR in the
environment: one spawned process per rank for each test method of DistributedTest._DistTestBase. This script does
the same, on gloo/CPU, twice: once as it is (--impl torch) and once with DistributedDataParallel replaced by
ManualDDP in every spawned rank (--impl manual), then compares the two.

Which tests: a test method `test_*` of DistributedTest._DistTestBase is selected if its name mentions `ddp` or
`DistributedDataParallel` (any case), or if its body - or a `self.<helper>` it calls, followed transitively through
the class - names `DistributedDataParallel` (that is, it builds or uses a DDP). Parametrized copies are traced back
to their source function. Everything else in the file (collectives, barriers, ...) does not involve DDP.

How ManualDDP is swapped in: distributed_test.py reaches DDP as `DistributedDataParallel` (its own module-level
import), `nn.parallel.DistributedDataParallel` and `torch.nn.parallel.DistributedDataParallel`; the last two are
the attribute of the torch.nn.parallel package. Both attributes are set to ManualDDP in each rank's process, in the
`_run` classmethod that the spawned rank starts with (spawn re-imports everything, so the patch must be made there;
the test class is defined at import time of this file, in the worker and in the ranks alike). torch's own code that
imports DistributedDataParallel from torch.nn.parallel.distributed is left alone.

--gpu-tests-on-cpu: on a machine without GPUs, 91 of the 103 selected tests skip, most of them for want of a GPU
per rank (`skip_if_lt_x_gpu(2)`), which leaves 12 to compare. This option runs them anyway, on the CPU: the GPU
skips are dropped, a TorchFunctionMode in each rank turns every device the test names (cuda:N, a rank number) into
the CPU, torch.cuda.set_device/synchronize/current_device become no-ops, and DDP (either impl) gets no device_ids.
That is an adaptation, not PyTorch's suite as PyTorch runs it, so it has its own result files; what really needs
CUDA (SyncBatchNorm, mixed precision, streams) then fails on PyTorch's DDP too and is out of the comparison.

Verdicts: pass, fail, error, skip (skip: the test's own decision, e.g. no CUDA/NCCL, or world size), timeout
(killed after --timeout seconds, or a worker that hung and was restarted). For a test that passes on torch's DDP
and not on ManualDDP, the failure is classified: `private` when it needs an internal of PyTorch's DDP that a
drop-in need not have (an attribute whose name starts with `_`, `reducer`/`logger`: the C++ Reducer and Logger, or
one of the cases in REVIEWED), else `gap` with the error (a real behavioural difference). The classification is
automatic: read the error text in the JSON results before fixing.

Usage (2 cores: one run at a time; a full run takes 20 minutes a mode, run it in the background):
  python tests/ddp_conformance.py --out /tmp/conf --markdown                  # both impls, 2 ranks
  python tests/ddp_conformance.py --out /tmp/conf --gpu-tests-on-cpu --markdown
  python tests/ddp_conformance.py --impl manual --out /tmp/conf --markdown    # ManualDDP again, vs the saved torch
  python tests/ddp_conformance.py --impl manual -k 'no_sync|join' --out /tmp/conf  # a subset (regex on names)
  python tests/ddp_conformance.py --impl manual --fork -k ...  # ranks forked, not spawned: 0.3 s a test, not 4
  python tests/ddp_conformance.py --report --markdown --out /tmp/conf         # the table from saved results
  python tests/ddp_conformance.py --impl manual --source /tmp/patched ...   # ddp_dropin.py and 05 from /tmp/patched
Files in --out: results_<impl>_ws<N>[_gpu_tests_on_cpu].jsonl (one JSON line per test: status, seconds, the full
error), report_*.md, worker_*.log (everything the ranks printed), the snapshot of ddp_dropin.py and 05 tested.
It needs `expecttest` (PyTorch's test helpers import it): pip install expecttest.

Results (torch 2.14.1+cu130, gloo, CPU, 2 ranks; ManualDDP as of 2026-11-24):
  | run                          | impl   | pass | fail+error | timeout | skip |
  |------------------------------|--------|------|------------|---------|------|
  | as PyTorch runs it           | torch  |   12 |          0 |       0 |   91 |
  |                              | manual |    8 |          4 |       0 |   91 |
  | as PyTorch runs it, 3 ranks  | torch  |   12 |          0 |       0 |   91 |
  |                              | manual |    8 |          4 |       0 |   91 |
  | --gpu-tests-on-cpu           | torch  |   71 |         22 |       1 |    9 |
  |                              | manual |   52 |         42 |       0 |    9 |
Of the 71 that pass on PyTorch's DDP (--gpu-tests-on-cpu; it includes the 12), ManualDDP passes all 50 that use
only DDP's public API (and 2 that PyTorch's DDP refuses: SyncBatchNorm on CPU). 21 need an internal: reducer (3),
_set_params_and_buffers_to_ignore_for_model (3), _register_buffer_comm_hook (3), _build_params_for_reducer (2),
_register_builtin_comm_hook, _set_ddp_runtime_logging_sample_rate, _set_static_graph, _set_ddp_sink_clone,
_remove_autograd_hooks, _get_ddp_logging_data() fields (2), bucket_bytes_cap_list, broadcast_bucket_size, the
reducer's profiler range. (The "as PyTorch runs it" rows above are from before the 2026-11-24 fixes.)
"""

import argparse
import ast
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))
import launch  # noqa: E402  (tests/launch.py: the project's environment and process-tree killing)

SOURCE_ENV = "DDP_CONFORMANCE_SOURCE"  # the folder whose ddp_dropin.py the ranks load (one snapshot per run)
ADAPT_ENV = "DDP_CONFORMANCE_GPU_TESTS_ON_CPU"  # --gpu-tests-on-cpu: see adapt_gpu_tests_to_cpu
IMPL_ENV = "DDP_CONFORMANCE_IMPL"  # set for the worker, so also for the ranks it spawns (spawn copies os.environ)
SKIPS_ENV = "DDP_CONFORMANCE_SKIPS"  # folder where a rank writes why it skipped a test
FORK_ENV = "DDP_CONFORMANCE_FORK"  # --fork: see main()'s help
IMPLS = ("torch", "manual")
PRIVATE_NAMES = {"reducer", "logger"}  # public-looking names of DDP's C++ internals
WORKER_RESTARTS = 20


# --- in the ranks: swap the class ---
def load_manual_ddp():
    """ddp_dropin.ManualDDP, imported under its module's name (so that torch.save can pickle it); ddp_dropin.py
    loads DDPCore from the 05_manual_ddp_gpt2.py beside it."""
    import importlib.util
    name = "ddp_dropin"
    if name not in sys.modules:
        path = Path(os.environ.get(SOURCE_ENV) or REPO) / "ddp_dropin.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].ManualDDP


def install_impl(impl):
    """Make every name distributed_test.py uses for DDP mean the class under test."""
    import torch.nn.parallel
    import torch.testing._internal.distributed.distributed_test as dt
    cls = load_manual_ddp() if impl == "manual" else torch.nn.parallel.DistributedDataParallel
    if os.environ.get(ADAPT_ENV):
        cls = on_cpu(cls)
    torch.nn.parallel.DistributedDataParallel = cls  # nn.parallel.X and torch.nn.parallel.X in the tests
    dt.DistributedDataParallel = cls  # its `from torch.nn.parallel import DistributedDataParallel`


# --- --gpu-tests-on-cpu: most of the suite's DDP tests ask for a GPU per rank; run them on CPU anyway ---
def adapt_gpu_tests_to_cpu():
    """Not PyTorch's suite as PyTorch runs it: drop the 'needs N GPUs' skips. Called in the worker and in each rank
    before distributed_test is imported (its decorators are applied then). Both impls get the same treatment; only
    the tests that then pass on PyTorch's DDP count: those that really need CUDA fail on both and are left out."""
    import torch.testing._internal.common_distributed as cd

    cd.skip_if_lt_x_gpu = lambda x, **kwargs: (lambda func: func)
    cd.skip_if_no_gpu = lambda func: func


def keep_on_cpu():
    """In a rank, for --gpu-tests-on-cpu: every device the test names (cuda:N, or a rank number) means the CPU."""
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
                args = (args[0], *[a if isinstance(a, torch.dtype | torch.Tensor) else cpu(a) for a in args[1:]])
            return func(*args, **kwargs)

    OnCPU().__enter__()  # for the rest of this process
    compile_ = torch.compile

    def compile_outside_the_mode(model=None, **kwargs):
        """Dynamo would trace OnCPU too, and fails on it: run what torch.compile made with OnCPU set aside."""
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
    """cls without device_ids/output_device (the module is on the CPU now), under a name pickle can find."""
    name = f"{cls.__name__}OnCPU"

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        cls.__init__(self, module, None, None, *args, **kwargs)

    adapted = type(name, (cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})
    setattr(sys.modules[__name__], name, adapted)
    return adapted


def record_skip_reasons(test_name):
    """A rank that skips exits with a code that only says 'skipped'; keep the reason it logs."""
    import logging
    folder = os.environ.get(SKIPS_ENV)
    if not folder:
        return

    class Keep(logging.Handler):
        def emit(self, record):
            if "skipping test" in str(record.msg) and len(record.args or ()) == 3:
                Path(folder, test_name).write_text(str(record.args[2]))

    logging.getLogger("torch.testing._internal.common_distributed").addHandler(Keep())


if os.environ.get(IMPL_ENV):  # the worker and its ranks: define the test class as test_distributed_spawn.py does
    import torch
    import torch.testing._internal.common_distributed as common_distributed

    if os.environ.get(ADAPT_ENV):
        adapt_gpu_tests_to_cpu()
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

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
                os.remove(self.file_name)  # the FileStore's file, made per test by MultiProcessTestCase
            except OSError:
                pass

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            install_impl(os.environ[IMPL_ENV])  # here, in the spawned rank, before the test builds any DDP
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
    cls_node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "_DistTestBase")
    mentions, calls, line, lines = {}, {}, {}, source.splitlines()
    for f in cls_node.body:
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
            # the function's lines (ast.get_source_segment splits the whole file again at each call: 20 s here)
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
    common_distributed.TIMEOUT_DEFAULT = args.timeout  # MultiProcessTestCase kills the ranks after this
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
        write(event="result", test=name, status=status, seconds=round(time.time() - t0, 1), detail=text)
        print(f"[worker] {name}: {status} ({time.time() - t0:.1f}s)", flush=True)


# --- the driver: a worker per impl, restarted past a hang or a crash ---
def tag(args):
    return f"ws{args.world_size}" + ("_gpu_tests_on_cpu" if args.gpu_tests_on_cpu else "")


def results_path(args, impl):
    return Path(args.out) / f"results_{impl}_{tag(args)}.jsonl"


def load_results(path):
    """{test: result event}; a test started but never finished (the worker died or hung in it) counts as timeout."""
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
    if not args.resume and out.exists():  # forget the results of the tests about to run (all of them without -k)
        kept = [ln for ln in out.read_text().splitlines() if args.k and not re.search(args.k, json.loads(ln)["test"])]
        out.write_text("".join(ln + "\n" for ln in kept))
    skips = Path(args.out) / f"skips_{impl}_{tag(args)}"
    skips.mkdir(parents=True, exist_ok=True)
    log = Path(args.out) / f"worker_{impl}_{tag(args)}.log"
    # The file under test may change while a long run goes on: every rank loads the same snapshot of it.
    source = Path(args.out) / f"snapshot_{tag(args)}"
    source.mkdir(exist_ok=True)
    for name in ("ddp_dropin.py", "05_manual_ddp_gpt2.py"):
        (source / name).write_bytes((Path(args.source) / name).read_bytes())
    env = launch.make_env(BACKEND="gloo", WORLD_SIZE=args.world_size, INIT_METHOD="env://",
                          TEMP_DIR=tempfile.mkdtemp(prefix="ddp_conformance_"),
                          **{IMPL_ENV: impl, SKIPS_ENV: skips, SOURCE_ENV: source},
                          **({ADAPT_ENV: 1} if args.gpu_tests_on_cpu else {}),
                          **({FORK_ENV: 1} if args.fork else {}))
    Path(env["TEMP_DIR"], "barrier").mkdir()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--results", str(out), "--timeout",
           str(args.timeout), *(["-k", args.k] if args.k else [])]
    for _ in range(WORKER_RESTARTS):
        with log.open("a") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        last, seen, shown = time.time(), out.stat().st_size if out.exists() else 0, len(load_results(out)[0])
        while proc.poll() is None:
            time.sleep(0.2)
            size = out.stat().st_size if out.exists() else 0
            if size != seen:
                last, seen = time.time(), size
                res = list(load_results(out)[0].values())
                for ev in res[shown:]:
                    print(f"  {impl} {res.index(ev) + 1}: {ev['test']}: {ev['status']} ({ev['seconds']}s)", flush=True)
                shown = len(res)
            elif time.time() - last > args.timeout + 120:  # the worker itself hangs: kill it, go on with the rest
                launch.kill_tree(proc)
        res, started = load_results(out)
        if started is None:
            if proc.returncode == 0:
                return
            print(f"  {impl}: worker exited {proc.returncode} outside a test; see {log}", flush=True)
            return
        with out.open("a") as f:  # the worker died in this test: record it, restart past it
            f.write(json.dumps({"event": "result", "test": started["test"], "status": "timeout",
                                "seconds": round(time.time() - started["time"], 1),
                                "detail": f"worker hung or died in this test (exit {proc.returncode}); see {log}"})
                    + "\n")
    print(f"  {impl}: gave up after {WORKER_RESTARTS} worker restarts", flush=True)


# --- the verdict ---
# Failures on ManualDDP whose error does not name the internal they need, read by hand (torch 2.14). Each applies only
# while the error still matches, so a test that fails differently after a change is classified afresh.
REVIEWED = {
    "test_ddp_profiling_torch_profiler": (r"Expected 1 but got 0",
                                          "profiler range `search_unused_parameters` (DDP's C++ reducer)"),
    "test_ddp_python_error_logged": (r"Expected 'iteration' in ddp_logging_data",
                                     "`_get_ddp_logging_data()['iteration']` (DDP's C++ logger)"),
    "test_skip_all_reduce_unused_parameters": (r"None is not 2", "`_get_ddp_logging_data()['num_buckets_reduced']`"),
    "test_ddp_bucket_cap_mb_list": (r"attribute 'bucket_bytes_cap_list'",
                                    "`bucket_bytes_cap_list` (undocumented, kept 'for backward compatibility')"),
    "test_ddp_sync_module_states": (r"attribute 'broadcast_bucket_size'",
                                    "`broadcast_bucket_size` (undocumented), fed to the private `_sync_module_states`"),
}


def classify(detail, test=""):
    """('private', NAME) for a missing internal of PyTorch's DDP, ('gap', text) for anything else."""
    pattern, need = REVIEWED.get(test, (None, None))
    if pattern and re.search(pattern, detail):
        return "private", need
    if re.search(r"in verify_ddp_error_logged\n", detail):
        return "private", "`_get_ddp_logging_data()` error fields (DDP's C++ logger)"
    m = re.findall(r"(?:'ManualDDP(?:OnCPU)?' object|type object 'ManualDDP(?:OnCPU)?') has no attribute '(\w+)'",
                   detail)
    if m:
        name = m[-1]
        if name.startswith("_") or name in PRIVATE_NAMES:
            return "private", name
        return "gap", f"missing public attribute `{name}`"
    return "gap", last_error(detail)


def last_error(detail):
    """The most telling line of a failure: the last exception line of the first failing rank's traceback."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    first_rank = [i for i, ln in enumerate(lines) if ln.startswith("Process ") and "exited with error code" in ln]
    if first_rank:
        end = next((i for i in first_rank[1:]), len(lines))
        lines = lines[first_rank[0]:end]
    for ln in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", ln) or ln.startswith("AssertionError"):
            return ln[:300]
    return (lines[-1] if lines else "")[:300]


def report(args, markdown):
    import torch
    world = args.world_size
    res = {impl: load_results(results_path(args, impl))[0] for impl in IMPLS}
    names = list(dict.fromkeys([*res["torch"], *res["manual"]]))
    lines = [f"## ManualDDP vs PyTorch DDP on PyTorch's DDP tests (torch {torch.__version__}, gloo/CPU, "
             f"{world} ranks{', GPU tests adapted to CPU' if args.gpu_tests_on_cpu else ''})", ""]
    statuses = ("pass", "fail", "error", "timeout", "skip")
    lines += ["| impl | tests | " + " | ".join(statuses) + " |", "|---|---|" + "---|" * len(statuses)]
    for impl in IMPLS:
        counts = [sum(1 for r in res[impl].values() if r["status"] == s) for s in statuses]
        lines.append(f"| {impl} | {len(res[impl])} | " + " | ".join(map(str, counts)) + " |")
    both = [n for n in names if n in res["torch"] and n in res["manual"]]
    regress = [n for n in both if res["torch"][n]["status"] == "pass" and res["manual"][n]["status"] != "pass"]
    private = [(n, classify(res["manual"][n]["detail"], n)) for n in regress]
    gaps = [(n, c[1]) for n, c in private if c[0] == "gap"]
    private = [(n, c[1]) for n, c in private if c[0] == "private"]
    ok = sum(1 for n in both if res["torch"][n]["status"] == "pass" and res["manual"][n]["status"] == "pass")
    torch_pass = sum(1 for n in both if res["torch"][n]["status"] == "pass")
    lines += ["", f"Of {torch_pass} tests that pass on PyTorch's DDP, {ok} pass on ManualDDP; {len(private)} need a "
              f"private internal, {len(gaps)} show a behavioural gap.", ""]
    if gaps:
        lines += ["### Behavioural gaps (pass on torch DDP, not on ManualDDP)", "", "| test | result | error |",
                  "|---|---|---|"]
        lines += [f"| {n} | {res['manual'][n]['status']} | {cell(e)} |" for n, e in gaps] + [""]
    if private:
        lines += ["### Need a private internal of PyTorch's DDP", "", "| test | result | needs |", "|---|---|---|"]
        lines += [f"| {n} | {res['manual'][n]['status']} | {a if '`' in a else f'`{a}`'} |" for n, a in private]
        lines += [""]
    extra = [n for n in both if res["torch"][n]["status"] != "pass" and res["manual"][n]["status"] == "pass"]
    bad_torch = [n for n in names if n in res["torch"] and res["torch"][n]["status"] not in ("pass", "skip")]
    if bad_torch:
        lines += ["### Not passing on PyTorch's own DDP here (out of the comparison)", "", "| test | torch | manual |"
                  " error on torch |", "|---|---|---|---|"]
        lines += [f"| {n} | {res['torch'][n]['status']} | {res['manual'].get(n, {}).get('status', '-')} | "
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
    p.add_argument("--timeout", type=int, default=240, help="seconds a test may take before its ranks are killed")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "ddp_conformance"),
                   help="folder for the raw results (JSON lines per impl), logs and report")
    p.add_argument("--resume", action="store_true", help="keep finished results, run only the rest (default: "
                   "run again every selected test; with -k the results of other tests are kept)")
    p.add_argument("--report", action="store_true", help="run nothing: print the table from saved results")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--list", action="store_true", help="print the selected tests and exit")
    p.add_argument("--gpu-tests-on-cpu", action="store_true",
                   help="also run the tests that ask for GPUs, moved to the CPU (an adaptation: see the docstring)")
    p.add_argument("--fork", action="store_true",
                   help="fork each test's ranks from the worker, which imported torch and the suite once, instead "
                        "of spawning them to import both again (as PyTorch runs its suite): seconds less a test")
    p.add_argument("--source", default=str(REPO),
                   help="the folder whose ddp_dropin.py (and the 05_manual_ddp_gpt2.py beside it) is tested")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.list:
        env = launch.make_env(BACKEND="gloo", WORLD_SIZE=args.world_size, TEMP_DIR=tempfile.gettempdir())
        code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import ddp_conformance as c; " \
               f"print(*c.select_tests({args.k!r}), sep='\\n')"
        return subprocess.run([sys.executable, "-c", code], env=env).returncode
    if not args.report:
        t0 = time.time()
        for impl in (IMPLS if args.impl == "both" else [args.impl]):
            t1 = time.time()
            print(f"{impl}: running (log: {Path(args.out) / f'worker_{impl}_{tag(args)}.log'})", flush=True)
            run_impl(args, impl)
            print(f"{impl}: done in {time.time() - t1:.0f}s", flush=True)
        print(f"total {time.time() - t0:.0f}s\n", flush=True)
    return 0 if report(args, args.markdown) else 1


if __name__ == "__main__":
    sys.exit(main())
