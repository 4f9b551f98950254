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
    cases = [("01_send_recv.py", ["--timeout-s", "0"], "both", "argument --timeout-s: must be >= 1"),
             ("01_send_recv.py", ["--bogus"], "both", "unrecognized arguments: --bogus"),
             ("01_send_recv.py", ["--device", "gpu"], "both", "argument --device: invalid choice"),
             ("01_send_recv.py", ["--backend", "nccl", "--device", "cpu"], "both", "nccl runs on CUDA GPUs only"),
             ("02_broadcast.py", ["--src", "5"], "both", "--src 5 is not a rank"),
             ("02_broadcast.py", ["--numel", "0"], "both", "argument --numel: must be >= 1"),
             ("03_all_reduce.py", ["--timeout-s", "-1"], "both", "argument --timeout-s: must be >= 1"),
             ("03_all_reduce.py", [], "rank0of1", "needs 2 or more ranks: launch with torchrun"),
             ("04_sampler.py", ["--dataset-size", "0"], "both", "argument --dataset-size: must be >= 1"),
             ("05_manual_ddp_gpt2.py", ["--lr", "0", "--out", out], "both", "argument --lr: must be > 0"),
             ("05_manual_ddp_gpt2.py", ["--weight-decay", "-0.1"], "both", "argument --weight-decay: must be >= 0"),
             ("05_manual_ddp_gpt2.py", ["--max-grad-norm", "nan"], "both", "argument --max-grad-norm: must be >= 0"),
             ("05_manual_ddp_gpt2.py", ["--bucket-cap-mb", "0"], "both", "argument --bucket-cap-mb: must be > 0"),
             ("05_manual_ddp_gpt2.py", ["--batch-size", "0"], "both", "argument --batch-size: must be >= 1"),
             ("05_manual_ddp_gpt2.py", ["--sample-tokens", "-5"], "both", "argument --sample-tokens: must be >= 0"),
             ("05_manual_ddp_gpt2.py", ["--n-embd", "65"], "both", "--n-embd 65 must be divisible by --n-head 4"),
             ("05_manual_ddp_gpt2.py", ["--out", afile], "both", "is a file, not a directory"),
             ("05_manual_ddp_gpt2.py", ["--out", afile / "ckpt"], "both", "is a file, not a directory"),
             ("05_manual_ddp_gpt2.py", ["--profile", afile], "both", "is a file, not a directory"),
             ("05_manual_ddp_gpt2.py", ["--impl", "fast"], "both", "argument --impl: invalid choice"),
             ("05_manual_ddp_gpt2.py", ["--impl", "naive", "--comm-hook", "bf16"], "both", "--comm-hook needs"),
             ("05_manual_ddp_gpt2.py", ["--dataset", "/no/such/*.txt"], "both", "--dataset '/no/such/*.txt': no such"),
             ("05_manual_ddp_gpt2.py", ["--model", "./no/such/model"], "both", "--model './no/such/model': no such"),
             ("06_torch_ddp_resnet.py", ["--epochs", "0", "--out", out], "both", "--epochs"),
             ("06_torch_ddp_resnet.py", ["--lr", "-1"], "both", "argument --lr: must be > 0"),
             ("06_torch_ddp_resnet.py", ["--out", afile], "both", "is a file, not a directory"),
             ("06_torch_ddp_resnet.py", ["--data-dir", afile], "both", "is a file, not a directory"),
             ("06_torch_ddp_resnet.py", ["--nproc", "2"], "both", "--nproc starts its own processes"),
             ("06_torch_ddp_resnet.py", ["--data-dir", mnist(tmp / "damaged", damaged=True)], "alone",
              "do not load"),
             ("06_torch_ddp_resnet.py", ["--data-dir", tmp / "empty"], "alone", "could not be downloaded"),  # offline
             ("06_torch_ddp_resnet.py", ["--data-dir", tmp / "none"], "alone", "smoke test with --dataset fake"),
             ("07_zero.py", ["--stage", "3"], "both", "argument --stage: invalid choice"),
             ("07_zero.py", ["--n-embd", "100"], "both", "multiple of 64"),
             ("08_fsdp.py", ["--clip", "-1"], "both", "argument --clip: must be >= 0"),
             ("08_fsdp.py", ["--out", afile], "both", "is a file, not a directory"),
             ("benchmarks/all_reduce.py", ["--min-bytes", "2"], "both", "--min-bytes"),
             ("benchmarks/all_reduce.py", ["--plot", tmp / "no" / "dir" / "x.png"], "both", "--plot"),
             ("benchmarks/ddp_step.py", ["--steps", "0"], "both", "--steps must be >= 1")]
    # Every number through one check: not finite, out of range, too large for its type (issue #26).
    huge = "99999999999999999999"
    cases += [(name, ["--timeout-s", value], "both", "argument --timeout-s: must be >= 1 and <= 2592000")
              for name, value in (("01_send_recv.py", "nan"), ("02_broadcast.py", "inf"), ("03_all_reduce.py", "1e30"),
                                  ("03_all_reduce.py", "0.001"), ("06_torch_ddp_resnet.py", "0.5"))]
    cases += [(name, ["--seed", huge], "both", "argument --seed: must be >= 0 and <= 4294967295")
              for name in ("04_sampler.py", "05_manual_ddp_gpt2.py", "06_torch_ddp_resnet.py", "07_zero.py",
                           "08_fsdp.py")]
    cases += [(name, [flag, value], "both", f"argument {flag}: must be")
              for name, flag, value in (("05_manual_ddp_gpt2.py", "--lr", "inf"), ("05_manual_ddp_gpt2.py",
                                        "--weight-decay", "inf"), ("05_manual_ddp_gpt2.py", "--bucket-cap-mb", "inf"),
                                        ("05_manual_ddp_gpt2.py", "--peak-tflops", "nan"),
                                        ("06_torch_ddp_resnet.py", "--lr", "inf"), ("07_zero.py", "--lr", "inf"),
                                        ("07_zero.py", "--bucket-cap-mb", "inf"), ("07_zero.py", "--n-embd", "0"),
                                        ("08_fsdp.py", "--lr", "nan"), ("08_fsdp.py", "--lr", "inf"),
                                        ("08_fsdp.py", "--clip", "inf"), ("06_torch_ddp_resnet.py", "--workers",
                                                                          "100000"))]
    cases += [(name, [flag, value], "both", f"argument {flag}: '{value}' is not an integer")
              for name, flag, value in (("02_broadcast.py", "--numel", "1e11"), ("05_manual_ddp_gpt2.py",
                                        "--seq-len", "1e8"), ("06_torch_ddp_resnet.py", "--fake-size", "1e12"))]
    # Directories are made when the flags are read: a place the kernel refuses is one line, found by trying.
    cases += [(name, [flag, "/proc/no/such/dir"], "both", f"{flag} /proc/no/such/dir: cannot write there")
              for name, flag in (("05_manual_ddp_gpt2.py", "--out"), ("05_manual_ddp_gpt2.py", "--profile"),
                                 ("06_torch_ddp_resnet.py", "--out"), ("08_fsdp.py", "--out"),
                                 ("08_fsdp.py", "--profile"))]
    # Sizes far beyond this machine: refused before the work, from what can be known (plain python: a group of one).
    cases += [("06_torch_ddp_resnet.py", ["--dataset", "fake", "--fake-size", "1000000000000"], "alone",
               "1,000,000,000,000 images would need at least"),
              ("07_zero.py", ["--seq-len", "10000000"], "alone", "would need at least"),
              ("08_fsdp.py", ["--batch-size", "100000000"], "alone", "would need at least"),
              ("08_fsdp.py", ["--seq-len", "100000000"], "alone", "is longer than the text")]
    cases += [(name, [], "alone", "launch with torchrun, e.g. torchrun --nproc_per_node=2")
              for name in ("01_send_recv.py", "02_broadcast.py", "03_all_reduce.py", "04_sampler.py")]
    return cases, out


@pytest.mark.parametrize("script, flag, value", [("02_broadcast.py", "--numel", "10000000000000"),
                                                  ("04_sampler.py", "--dataset-size", "10000000000000")])
def test_a_size_beyond_memory_is_refused_in_one_line_before_allocating(script, flag, value):
    # 02 and 04 need torchrun (a group of one is refused first), so these run on 2 real ranks: the check shares
    # the memory between the ranks of a node and agrees across ranks (every rank stops, none hangs).
    res = launch.ranks(script, 2, [flag, value])
    errors = [ln for r in res for ln in r.output.splitlines() if ln.startswith("error:")]
    assert [r.returncode for r in res] == [2, 2], [r.output for r in res]
    assert len(errors) == 1 and f"{flag} {int(value):,} would need at least" in errors[0], errors
    assert not any("Traceback" in r.output for r in res), [r.output for r in res]


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


def test_an_out_is_never_written_by_a_run_that_did_not_write_it(tmp_path, script):
    """One checkpoint contract for 05, 06 and 08 (issue #26): an --out holds the files of one script and one model,
    as its owner.json says, and one run at a time. A run of another script, of another model, into a directory of
    other files, or beside a live run, stops in one line (plain python, a group of one) and changes nothing."""
    import fcntl
    gpt2 = {"script": "05_manual_ddp_gpt2.py", "model": "GPT-2 from scratch", "n_layer": 4, "n_embd": 128,
            "n_head": 4, "seq_len": 128}
    fsdp = {"script": "08_fsdp.py", "n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32}
    dirs = {}
    for name, owner, files in (("by05", gpt2, ("model.safetensors", "tokenizer.json")),
                               ("by06", {"script": "06_torch_ddp_resnet.py"}, ("model.pt",)),
                               ("by08", fsdp, ("model.safetensors",)), ("busy08", fsdp, ()),
                               ("other", None, ("notes.txt", "data.csv"))):
        folder = dirs[name] = tmp_path / name
        folder.mkdir()
        if owner:
            script(owner["script"]).not_ours(folder, owner)  # owner.json, as that script's run writes it
        for f in files:
            (folder / f).write_bytes(b"someone's work")
    tiny08 = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "2"]
    cases = [("08_fsdp.py", tiny08 + ["--out", dirs["by05"]], "belongs to 05_manual_ddp_gpt2.py"),
             ("06_torch_ddp_resnet.py", ["--dataset", "fake", "--fake-size", "32", "--out", dirs["by05"]],
              "belongs to 05_manual_ddp_gpt2.py"),
             ("08_fsdp.py", tiny08 + ["--out", dirs["by06"]], "belongs to 06_torch_ddp_resnet.py"),
             ("05_manual_ddp_gpt2.py", ["--out", dirs["by08"]], "belongs to 08_fsdp.py"),
             ("08_fsdp.py", tiny08[2:] + ["--n-layer", "3", "--out", dirs["by08"]],
              "holds a model with n_layer 2, this run has 3"),
             ("05_manual_ddp_gpt2.py", ["--n-embd", "64", "--out", dirs["by05"]],
              "holds a model with n_embd 128, this run has 64"),
             ("08_fsdp.py", tiny08 + ["--out", dirs["other"]], "holds files that no run of 08_fsdp.py wrote"),
             ("06_torch_ddp_resnet.py", ["--dataset", "fake", "--out", dirs["other"]],
              "holds files that no run of 06_torch_ddp_resnet.py wrote (data.csv, notes.txt)"),
             ("08_fsdp.py", tiny08 + ["--out", dirs["busy08"]], "is in use by another run")]
    with open(dirs["busy08"] / ".lock", "w") as held:  # a live run of 08 holds this one
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = {name: tree(folder) for name, folder in dirs.items()}
        runs = [(name, [*map(str, argv), "--device", "cpu"], "alone", {}) for name, argv, _ in cases]
        results = launch.forked_cases(runs, tmp_path)
    for (name, argv, message), (code, said) in zip(cases, results):
        errors = [ln for ln in said.splitlines() if ln.startswith("error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (name, argv, code, said)
        assert "Traceback" not in said, said
    assert {name: tree(folder) for name, folder in dirs.items()} == before, "a refused run changed an --out"


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
