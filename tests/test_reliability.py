"""Every valid run finishes, every bad one stops in one line before any work, nothing is lost (issue #12).

The 05 stories that need a real job (a damaged checkpoint, a foreign one, a rank that cannot read it) are in
test_gpt2.py, 06's in test_resnet.py; here, the table of bad inputs for every script, and the --out lock.
"""

import os
import signal
import struct
import subprocess
import sys
import time

import pytest

import launch

TINY = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "64", "--batch-size", "4", "--stdlib-files", "5",
        "--log-every", "4"]
PROXY = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}  # a download fails at once


def mnist(root, damaged=False):
    """The four MNIST files in IDX format (optionally one cut short), as torchvision reads them."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 8), ("t10k", 8)):
        images = struct.pack(">BBBBIII", 0, 0, 8, 3, n, 28, 28) + bytes(n * 28 * 28)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(images[:100] if damaged else images)
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">BBBBI", 0, 0, 8, 1, n) + bytes(n))
    return root


def table(tmp):
    """(script, arguments, run as, what the one error line must say): "both" means rank 0 and rank 1 of 2."""
    afile = tmp / "a_file"
    afile.write_text("not a directory")
    out = tmp / "out"  # an existing --out with a checkpoint in it: a bad flag must leave it untouched
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "state.pt").write_bytes(b"\0" * 64)
    cases = [("01_send_recv.py", ["--timeout-s", "0"], "both", "--timeout-s must be > 0"),
             ("01_send_recv.py", ["--bogus"], "both", "unrecognized arguments: --bogus"),
             ("01_send_recv.py", ["--device", "gpu"], "both", "argument --device: invalid choice"),
             ("01_send_recv.py", ["--backend", "nccl", "--device", "cpu"], "both", "nccl runs on CUDA GPUs only"),
             ("02_broadcast.py", ["--src", "5"], "both", "--src 5 is not a rank"),
             ("02_broadcast.py", ["--numel", "0"], "both", "--numel must be >= 1"),
             ("03_all_reduce.py", ["--timeout-s", "-1"], "both", "--timeout-s must be > 0"),
             ("03_all_reduce.py", [], "rank0of1", "needs at least 2 ranks, got WORLD_SIZE=1"),
             ("04_sampler.py", ["--dataset-size", "0"], "both", "--dataset-size must be >= 1"),
             ("05_manual_ddp_gpt2.py", ["--lr", "0", "--out", out], "both", "--lr must be > 0"),
             ("05_manual_ddp_gpt2.py", ["--weight-decay", "-0.1"], "both", "--weight-decay must be >= 0"),
             ("05_manual_ddp_gpt2.py", ["--max-grad-norm", "nan"], "both", "--max-grad-norm must be >= 0"),
             ("05_manual_ddp_gpt2.py", ["--bucket-cap-mb", "0"], "both", "--bucket-cap-mb must be > 0"),
             ("05_manual_ddp_gpt2.py", ["--batch-size", "0"], "both", "--batch-size must be >= 1"),
             ("05_manual_ddp_gpt2.py", ["--sample-tokens", "-5"], "both", "--sample-tokens must be >= 0"),
             ("05_manual_ddp_gpt2.py", ["--n-embd", "65"], "both", "--n-embd 65 must be divisible by --n-head 4"),
             ("05_manual_ddp_gpt2.py", ["--out", afile], "both", "is a file, not a directory"),
             ("05_manual_ddp_gpt2.py", ["--out", afile / "ckpt"], "both", "is a file, not a directory"),
             ("05_manual_ddp_gpt2.py", ["--profile", afile], "both", "is a file, not a directory"),
             ("05_manual_ddp_gpt2.py", ["--impl", "fast"], "both", "argument --impl: invalid choice"),
             ("05_manual_ddp_gpt2.py", ["--impl", "naive", "--comm-hook", "bf16"], "both", "--comm-hook needs"),
             ("05_manual_ddp_gpt2.py", ["--dataset", "/no/such/*.txt"], "both", "--dataset '/no/such/*.txt': no such"),
             ("05_manual_ddp_gpt2.py", ["--model", "./no/such/model"], "both", "--model './no/such/model': no such"),
             ("06_torch_ddp_resnet.py", ["--epochs", "0", "--out", out], "both", "--epochs"),
             ("06_torch_ddp_resnet.py", ["--lr", "-1"], "both", "--lr must be > 0"),
             ("06_torch_ddp_resnet.py", ["--out", afile], "both", "is a file, not a directory"),
             ("06_torch_ddp_resnet.py", ["--data-dir", afile], "both", "is a file, not a directory"),
             ("06_torch_ddp_resnet.py", ["--nproc", "2"], "both", "--nproc starts its own processes"),
             ("06_torch_ddp_resnet.py", ["--data-dir", mnist(tmp / "damaged", damaged=True)], "alone",
              "do not load"),
             ("06_torch_ddp_resnet.py", ["--data-dir", tmp / "empty"], "alone", "could not be downloaded"),  # offline
             ("06_torch_ddp_resnet.py", ["--data-dir", tmp / "none"], "alone", "smoke test with --dataset fake"),
             ("07_zero.py", ["--stage", "3"], "both", "argument --stage: invalid choice"),
             ("07_zero.py", ["--n-embd", "100"], "both", "multiple of 64"),
             ("08_fsdp.py", ["--clip", "-1"], "both", "--clip >= 0"),
             ("08_fsdp.py", ["--out", afile], "both", "is a file, not a directory"),
             ("benchmarks/all_reduce.py", ["--min-bytes", "2"], "both", "--min-bytes"),
             ("benchmarks/all_reduce.py", ["--plot", tmp / "no" / "dir" / "x.png"], "both", "--plot"),
             ("benchmarks/ddp_step.py", ["--steps", "0"], "both", "--steps must be >= 1")]
    cases += [(name, [], "alone", "launch with torchrun, e.g. torchrun --nproc_per_node=2")
              for name in ("01_send_recv.py", "02_broadcast.py", "03_all_reduce.py", "04_sampler.py")]
    return cases, out


def tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


def test_bad_input_is_one_line_on_rank_0_exit_2_and_touches_nothing(tmp_path):
    cases, out = table(tmp_path)
    before = tree(out)
    runs = [(script, [*map(str, argv), "--device", "cpu"], rank, PROXY)
            for script, argv, how, _ in cases for rank in (["0", "1"] if how == "both" else [how])]
    results = dict(zip([(s, tuple(a), r) for s, a, r, _ in runs], launch.forked_cases(runs, tmp_path)))
    for script, argv, how, message in cases:
        argv = tuple([*map(str, argv), "--device", "cpu"])
        case = f"{script} {' '.join(argv)}"
        code, said = results[script, argv, "0" if how == "both" else how]
        errors = [ln for ln in said.splitlines() if ln.startswith("error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (case, code, said)
        assert "Traceback" not in said, (case, said)
        if how == "both":  # the other ranks stop silently: one line in all
            assert results[script, argv, "1"] == [2, ""], (case, results[script, argv, "1"])
    assert tree(out) == before, "a bad flag changed the existing --out"


def start(script, args, out):
    cmd = [sys.executable, str(launch.REPO / script), *map(str, args), "--device", "cpu", "--out", str(out)]
    return subprocess.Popen(cmd, cwd=launch.REPO, env=launch.make_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(proc, text, timeout=120):
    """Read proc's output until a line contains text; return what was read."""
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if text in line or (not line and proc.poll() is not None):
            return "".join(seen)
    launch.kill_tree(proc)
    pytest.fail(f"never saw {text!r}: {''.join(seen)}")


@pytest.mark.slow
def test_one_run_per_out_and_a_killed_run_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "out"
    # A plain `python` run (a group of one, small buckets), with a profiler trace of its steps 3-5 on the way.
    first = start("05_manual_ddp_gpt2.py", TINY + ["--max-steps", 400, "--ckpt-every", 4, "--bucket-cap-mb", 0.05,
                                                   "--profile", tmp_path / "prof"], out)
    try:
        # It holds the lock, has written checkpoints, and (at step 5, before checkpoint-8) its trace.
        assert "world_size=1" in wait_for(first, "checkpoint-8")
        second = launch.python("05_manual_ddp_gpt2.py", TINY + ["--max-steps", 8, "--out", out], timeout=120)
        errors = [ln for ln in second.output.splitlines() if ln.startswith("error:")]
        assert second.returncode == 2 and len(errors) == 1 and "is in use by another run" in errors[0], second.output
        assert first.poll() is None, "the first run must go on undisturbed"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a crash: no clean exit, no chance to release anything
        first.wait()
    # The trace shows buckets all-reduced while backward still had work to do (benchmarks/overlap.py reads it).
    seen = launch.run([sys.executable, "benchmarks/overlap.py", tmp_path / "prof" / "trace_rank0.json"], timeout=60)
    assert seen.returncode == 0 and "ran and finished while backward still had work to do" in seen.output, seen.output
    # It resumes (bf16 autocast and ManualDDP's hand-written bf16 hook from here on: their run to the end).
    restart = launch.python("05_manual_ddp_gpt2.py", TINY + ["--max-steps", 8, "--sample-tokens", 0, "--out", out,
                                                             "--precision", "bf16", "--comm-hook", "bf16"], timeout=120)
    assert restart.returncode == 0 and "resumed from" in restart.output and restart.ok_line(), restart.output
