"""Every valid run finishes, every bad one stops in one line before any work, nothing is lost (issue #12)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import launch

TINY = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "64", "--batch-size", "4", "--stdlib-files", "5",
        "--log-every", "4"]


def bad_inputs(tmp):
    """(script, arguments, what the one error line must say) for each script."""
    afile = tmp / "a_file"
    afile.write_text("not a directory")
    out = tmp / "out"  # an existing --out with a checkpoint in it: a bad flag must leave it untouched
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "state.pt").write_bytes(b"\0" * 64)
    table = [
        ("01_send_recv.py", ["--timeout-s", "0"], "--timeout-s must be > 0"),
        ("01_send_recv.py", ["--bogus"], "unrecognized arguments: --bogus"),
        ("01_send_recv.py", ["--device", "gpu"], "argument --device: invalid choice"),
        ("01_send_recv.py", ["--backend", "nccl", "--device", "cpu"], "nccl runs on CUDA GPUs only"),
        ("02_broadcast.py", ["--src", "5"], "--src 5 is not a rank"),
        ("02_broadcast.py", ["--numel", "0"], "--numel must be >= 1"),
        ("03_all_reduce.py", ["--timeout-s", "-1"], "--timeout-s must be > 0"),
        ("04_sampler.py", ["--dataset-size", "0"], "--dataset-size must be >= 1"),
        ("05_manual_ddp_gpt2.py", ["--lr", "0", "--out", out], "--lr must be > 0"),
        ("05_manual_ddp_gpt2.py", ["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
        ("05_manual_ddp_gpt2.py", ["--max-grad-norm", "nan"], "--max-grad-norm must be >= 0"),
        ("05_manual_ddp_gpt2.py", ["--bucket-cap-mb", "0"], "--bucket-cap-mb must be > 0"),
        ("05_manual_ddp_gpt2.py", ["--batch-size", "0"], "--batch-size must be >= 1"),
        ("05_manual_ddp_gpt2.py", ["--sample-tokens", "-5"], "--sample-tokens must be >= 0"),
        ("05_manual_ddp_gpt2.py", ["--n-embd", "65"], "--n-embd 65 must be divisible by --n-head 4"),
        ("05_manual_ddp_gpt2.py", ["--out", afile], "is a file, not a directory"),
        ("05_manual_ddp_gpt2.py", ["--out", afile / "ckpt"], "is a file, not a directory"),
        ("05_manual_ddp_gpt2.py", ["--profile", afile], "is a file, not a directory"),
        ("05_manual_ddp_gpt2.py", ["--impl", "fast"], "argument --impl: invalid choice"),
        ("05_manual_ddp_gpt2.py", ["--dataset", "/no/such/dir/*.txt"], "--dataset '/no/such/dir/*.txt': no such"),
        ("05_manual_ddp_gpt2.py", ["--model", "./no/such/model"], "--model './no/such/model': no such"),
        ("06_torch_ddp_resnet.py", ["--epochs", "0", "--out", out], "--epochs"),
        ("06_torch_ddp_resnet.py", ["--lr", "-1"], "--lr must be > 0"),
        ("06_torch_ddp_resnet.py", ["--out", afile], "is a file, not a directory"),
        ("06_torch_ddp_resnet.py", ["--data-dir", afile], "is a file, not a directory"),
        ("benchmarks/all_reduce.py", ["--min-bytes", "2"], "--min-bytes"),
        ("benchmarks/all_reduce.py", ["--plot", tmp / "no" / "dir" / "x.png"], "--plot"),
    ]
    return table, out


def tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*"))


def test_bad_input_is_one_line_on_rank_0_exit_2_and_touches_nothing(tmp_path):
    table, out = bad_inputs(tmp_path)
    before = tree(out)
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([(script, [*map(str, argv), "--device", "cpu"]) for script, argv, _ in table]))
    reports = []
    for rank in (0, 1):
        result = tmp_path / f"rank{rank}.json"
        res = launch.run([sys.executable, "tests/workers/usage_worker.py", str(rank), str(cases), str(result)],
                         timeout=240)
        assert res.returncode == 0 and result.exists(), res.output
        reports.append(json.loads(result.read_text()))
    for (script, argv, message), (code0, out0), (code1, out1) in zip(table, *reports):
        case = f"{script} {' '.join(map(str, argv))}"
        assert code0 == 2 and code1 == 2, (case, code0, out0, code1, out1)
        assert out0.startswith("error: ") and out0.count("\n") == 1 and message in out0, (case, out0)
        assert out1 == "", (case, out1)  # the other ranks stop silently: one line in all
    assert tree(out) == before, "a bad flag changed the existing --out"


def test_05_resumes_past_a_damaged_checkpoint_and_trains_on_with_more_steps(tmp_path):
    out = tmp_path / "out"
    first = launch.torchrun("05_manual_ddp_gpt2.py", 2, TINY + ["--max-steps", 8, "--ckpt-every", 4, "--out", out,
                                                                 "--sample-tokens", 0], timeout=180)
    assert first.returncode == 0 and first.ok_line(), first.output
    damaged = out / "checkpoint-8" / "state.pt"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # a copy cut short
    # Also the old default trap: --seq-len 64 with the default 120-token sample, now clamped to the context.
    more = launch.torchrun("05_manual_ddp_gpt2.py", 2, TINY + ["--max-steps", 12, "--ckpt-every", 4, "--out", out],
                           timeout=180)
    assert more.returncode == 0 and more.ok_line(), more.output
    lines = more.output.splitlines()
    assert any(ln.startswith("warning: skipped") and "checkpoint-8" in ln for ln in lines), more.output
    assert any(ln.startswith("resumed from") and ln.split()[2].endswith("checkpoint-4") for ln in lines)
    assert "--max-steps 8 -> 12" in more.output and "sample shortened to" in more.output
    kept = list(out.glob("checkpoint-8.damaged-*"))
    assert len(kept) == 1 and (kept[0] / "state.pt").stat().st_size == 1000, "the damaged checkpoint was lost"
    state = torch.load(out / "checkpoint-12" / "state.pt", weights_only=True)
    assert state["step"] == 12 and state["max_steps"] == 12
    # A checkpoint of another model configuration: one line naming both shapes, on every rank together.
    other = launch.ranks("05_manual_ddp_gpt2.py", 2, TINY + ["--n-embd", 32, "--max-steps", 16, "--out", out])
    assert [r.returncode for r in other] == [2, 2], [r.output for r in other]
    errors = [ln for r in other for ln in r.output.splitlines() if "error" in ln]
    assert len(errors) == 1 and "(257, 64)" in errors[0] and "(257, 32)" in errors[0], errors


def test_05_rank_that_cannot_read_the_chosen_checkpoint_stops_everyone(tmp_path):
    """Two 'nodes' without a shared filesystem: --out is relative, and only rank 0's directory holds it."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node1.mkdir()
    first = launch.python("05_manual_ddp_gpt2.py", TINY + ["--max-steps", 4, "--ckpt-every", 4, "--sample-tokens", 0,
                                                           "--out", node0 / "ckpt"], timeout=120)
    assert first.returncode == 0, first.output
    results = launch.ranks("05_manual_ddp_gpt2.py", 2, TINY + ["--max-steps", 8, "--out", "ckpt"],
                           cwds=[node0, node1], timeout=120)
    assert [r.returncode for r in results] == [2, 2] and not any(r.timed_out for r in results)
    errors = [ln for r in results for ln in r.output.splitlines() if "error" in ln]
    assert len(errors) == 1 and "rank 1 cannot read" in errors[0] and "every node" in errors[0], errors


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


def test_one_run_per_out_and_a_killed_run_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "out"
    first = start("05_manual_ddp_gpt2.py", TINY + ["--max-steps", 400, "--ckpt-every", 4], out)
    try:
        wait_for(first, "saved")  # it holds the lock and has written a checkpoint
        second = launch.python("05_manual_ddp_gpt2.py", TINY + ["--max-steps", 8, "--out", out], timeout=120)
        errors = [ln for ln in second.output.splitlines() if ln.startswith("error:")]
        assert second.returncode == 2 and len(errors) == 1 and "is in use by another run" in errors[0], second.output
        assert first.poll() is None, "the first run must go on undisturbed"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a crash: no clean exit, no chance to release anything
        first.wait()
    restart = launch.python("05_manual_ddp_gpt2.py", TINY + ["--max-steps", 8, "--sample-tokens", 0, "--out", out],
                            timeout=120)
    assert restart.returncode == 0 and "resumed from" in restart.output and restart.ok_line(), restart.output
