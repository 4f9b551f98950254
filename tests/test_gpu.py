"""The GPU tier (`pytest -m gpu`): every script on a real GPU, and ManualDDP against DDP on CUDA tensors.

Skipped, with its reason, where CUDA is absent; part of the README's test command everywhere. On one GPU: 05-08 as
one rank on NCCL, and every script as 2 ranks sharing the GPU over gloo (NCCL refuses two ranks on one GPU). 01-04
need 2 ranks, so they meet NCCL only where there are 2 GPUs or more, as does ManualDDP against DDP on NCCL.
"""

import re
import subprocess
import sys

import pytest
import torch

import launch

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(N_GPUS == 0, reason="needs a CUDA GPU (the GPU tier)")]
two_gpus = pytest.mark.skipif(N_GPUS < 2, reason="needs 2 or more GPUs")

ARGS = {
    "01_send_recv.py": [],
    "02_broadcast.py": ["--src", "1"],
    "03_all_reduce.py": [],
    "04_sampler.py": [],
    "05_manual_ddp_gpt2.py": ["--seq-len", "64", "--batch-size", "4", "--max-steps", "6", "--log-every", "3",
                              "--eval-every", "3", "--sample-tokens", "8"],
    "06_torch_ddp_resnet.py": ["--dataset", "fake", "--fake-size", "64", "--batch-size", "8", "--epochs", "1",
                               "--precision", "bf16", "--sync-bn"],
    "07_zero.py": ["--n-layer", "2", "--n-embd", "64", "--steps", "3"],
    "08_fsdp.py": ["--n-layer", "2", "--n-embd", "64", "--max-steps", "3"],
    "09_debugging.py": ["--fault", "all"],  # rank0-only and uneven (stacks, the Flight Recorder) untried on GPU
}
ENV = dict(CUBLAS_WORKSPACE_CONFIG=":4096:8")  # lets deterministic cuBLAS run, for the bit-for-bit workers


def scripts(names):
    return [n for n in names if (launch.REPO / n).exists()]


@pytest.mark.parametrize("name", scripts(["05_manual_ddp_gpt2.py", "06_torch_ddp_resnet.py", "07_zero.py",
                                          "08_fsdp.py"]))
def test_one_rank_on_nccl(name, script):
    res = launch.torchrun(name, 1, ARGS[name], timeout=600, device="cuda")
    assert res.returncode == 0 and res.ok_line(), res.output
    assert "backend=nccl" in res.output.replace(" ", "") or "nccl" in res.output, res.output
    if name == "05_manual_ddp_gpt2.py" and any(gpu in torch.cuda.get_device_name() for gpu in script(name).PEAK_TFLOPS):
        steps = [ln for ln in res.output.splitlines() if ln.startswith("step") and "tok/s" in ln]
        assert steps and all(" | MFU " in ln for ln in steps), res.output  # a GPU whose peak 05 knows: MFU shown


@pytest.mark.parametrize("name", scripts(ARGS))
def test_two_ranks_share_one_gpu_over_gloo(name):
    res = launch.torchrun(name, 2, ARGS[name] + ["--backend", "gloo"], timeout=600, device="cuda")
    assert res.returncode == 0 and res.ok_line(), res.output
    assert "device: cuda, gloo (--device cuda" in res.output, res.output  # with one GPU, both ranks share it


def test_compile_with_inductor():
    """05 --compile with its default backend, inductor (on CPU the suite compiles with aot_eager: compile_worker)."""
    res = launch.torchrun("05_manual_ddp_gpt2.py", 1, ARGS["05_manual_ddp_gpt2.py"] + ["--compile"], timeout=600,
                          device="cuda")
    assert res.returncode == 0 and res.ok_line() and "compiling 4 blocks" in res.output, res.output


def test_auto_with_fewer_gpus_than_ranks_runs_on_cpu_and_says_why():
    res = launch.torchrun("03_all_reduce.py", N_GPUS + 1, [], timeout=300, device="auto")
    assert res.returncode == 0 and res.ok_line(), res.output
    assert f"device: cpu, gloo (--device auto, {N_GPUS} GPU(s) for {N_GPUS + 1} ranks/node)" in res.output


def test_nccl_with_fewer_gpus_than_ranks_is_one_error_line():
    results = launch.ranks("03_all_reduce.py", N_GPUS + 1, ["--backend", "nccl"], device="cuda", timeout=120)
    assert all(r.returncode == 2 for r in results), [r.output for r in results]
    lines = [ln for r in results for ln in r.output.splitlines() if ln.strip()]
    expected = f"error: --backend nccl: {N_GPUS} CUDA GPU(s) for {N_GPUS + 1} ranks"
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_manual_ddp_bit_identical_to_ddp_on_cuda_over_gloo():
    res = launch.run(launch.torchrun_cmd("tests/workers/exact_worker.py", 2), timeout=600,
                     env=launch.make_env(TEST_DEVICE="cuda", **ENV))
    assert res.returncode == 0 and res.ok_line(), res.output


@two_gpus
@pytest.mark.parametrize("name", scripts(["01_send_recv.py", "02_broadcast.py", "03_all_reduce.py", "04_sampler.py",
                                          "09_debugging.py"]))
def test_two_ranks_on_nccl(name):
    res = launch.torchrun(name, 2, ARGS[name], timeout=300, device="cuda")
    assert res.returncode == 0 and res.ok_line() and "nccl" in res.output, res.output


def test_09_same_gpu_nccl_refuses_two_ranks_on_one_gpu_and_nccl_debug_shows_both_on_one_bus_id():
    """09's GPU lesson: NCCL with no torch.cuda.set_device puts every rank on cuda:0; the child job fails (NCCL's
    'Duplicate GPU detected'), NCCL_DEBUG=INFO's init lines show one bus id for both ranks, the fix runs."""
    res = launch.torchrun("09_debugging.py", 2, ["--fault", "same-gpu"], timeout=300, device="cuda")
    assert res.returncode == 0 and (res.ok_line() or "").startswith("OK same-gpu"), res.output
    ids = re.findall(r"rank (\d): busId (\w+)", res.output)
    assert len(ids) == 2 and ids[0][1] == ids[1][1], res.output
    assert "all-reduce on cuda" in res.output and "(expected 2)" in res.output, res.output


@two_gpus
def test_manual_ddp_bit_identical_to_ddp_on_nccl():
    res = launch.run(launch.torchrun_cmd("tests/workers/exact_worker.py", 2), timeout=600,
                     env=launch.make_env(TEST_DEVICE="cuda", TEST_BACKEND="nccl", **ENV))
    assert res.returncode == 0 and res.ok_line(), res.output


def test_gloo_point_to_point_on_cuda_goes_through_the_cpu():
    """gloo's send/recv move host memory only: 01-03 stage their messages on the CPU (01 says so), the ping-pong
    benchmark, which would measure the staging, refuses in one line."""
    res = launch.torchrun("01_send_recv.py", 2, ["--backend", "gloo"], timeout=300, device="cuda")
    assert res.returncode == 0 and res.ok_line() and "staged on the CPU" in res.output, res.output
    results = launch.ranks("benchmarks/send_recv.py", 2, ["--backend", "gloo"], device="cuda", timeout=120)
    errors = [ln for r in results for ln in r.output.splitlines() if ln.startswith("error:")]
    assert [r.returncode for r in results] == [2, 2] and len(errors) == 1 and "CPU tensors only" in errors[0], errors


def test_exact_checks_hold_at_longer_sequences_and_checkpoints_gather_on_the_cpu(tmp_path):
    """07 and 08 compare separate runs bit for bit: at --seq-len 256 attention's backward would add in a different
    order each run without deterministic mode. 08 --clip takes PyTorch's norm kernel; 08 --out gathers optimizer
    state as CPU copies and resumes."""
    res = launch.torchrun("07_zero.py", 1, ARGS["07_zero.py"] + ["--seq-len", "256"], timeout=600, device="cuda",
                          **ENV)
    assert res.returncode == 0 and "bit-identical" in (res.ok_line() or ""), res.output
    args = ARGS["08_fsdp.py"] + ["--seq-len", "256", "--clip", "0.5", "--out", tmp_path / "fsdp"]
    for steps in ("3", "5"):  # the second resumes from the first's checkpoint
        res = launch.torchrun("08_fsdp.py", 1, args + ["--max-steps", steps], timeout=600, device="cuda", **ENV)
        assert res.returncode == 0 and res.ok_line(), res.output
    assert "resumed" in res.output, res.output
    state = torch.load(tmp_path / "fsdp" / "checkpoint-5.pt")  # tensors come back where they were saved
    tensors, todo = [], [state]
    while todo:
        x = todo.pop()
        todo += list(x.values()) if isinstance(x, dict) else list(x) if isinstance(x, (list, tuple)) else []
        tensors += [x] if isinstance(x, torch.Tensor) else []
    assert tensors and all(t.device.type == "cpu" for t in tensors), {t.device for t in tensors}


def test_resnet_resumes_in_bf16_from_an_fp32_checkpoint(tmp_path):
    args = ARGS["06_torch_ddp_resnet.py"][:-3] + ["--out", tmp_path / "r"]  # without --precision bf16 --sync-bn
    first = launch.torchrun("06_torch_ddp_resnet.py", 1, args, timeout=600, device="cuda")
    assert first.returncode == 0 and first.ok_line(), first.output
    more = launch.torchrun("06_torch_ddp_resnet.py", 1, args + ["--epochs", "2", "--precision", "bf16"], timeout=600,
                           device="cuda")
    assert more.returncode == 0 and more.ok_line() and "resumed" in more.output, more.output


# --- debug_tools.py on a reader's own job (tests/workers/buggy_train.py), with CUDA tensors ---
READER = "tests/workers/buggy_train.py"


def test_check_replicas_compares_cuda_replicas_over_gloo():
    """Two ranks sharing the GPU(s) over gloo: check_replicas moves the bytes to the CPU that gloo works on, and
    names the plain tensor attribute that PyTorch's DDP never broadcasts."""
    res = launch.torchrun(READER, 2, ["--bug", "seed", "--ddp", "--check", "--epochs", "1"], timeout=300,
                          device="cuda", PYTHONPATH=launch.REPO)
    assert "replicas differ: module.proj (float32, (16, 16)) on rank(s) [1] " in res.output, res.output


@two_gpus
def test_nccl_dumps_its_flight_recorder_on_a_timeout_and_debug_tools_reads_it(tmp_path):
    """An evaluation that only rank 0 runs gathers on NCCL: NCCL's watchdog ends the job after --timeout and, with
    TORCH_NCCL_DUMP_ON_TIMEOUT=1 and TORCH_FR_DUMP_TEMP_FILE, writes each rank's record, which `debug_tools.py fr`
    reads; flight_recorder() writes the same from Python. check_replicas runs on NCCL."""
    args = ["--bug", "eval-gather", "--ddp", "--backend", "nccl", "--timeout", "20"]
    for how, extra, env in [("NCCL's own dump", [], dict(TORCH_NCCL_DUMP_ON_TIMEOUT=1,
                                                         TORCH_FR_DUMP_TEMP_FILE=f"{tmp_path}/nccl/rank_")),
                            ("flight_recorder()", ["--record", tmp_path / "py"], {})]:
        res = launch.torchrun(READER, 2, args + extra, timeout=300, device="cuda", PYTHONPATH=launch.REPO, **env)
        assert res.returncode != 0, res.output
        folder = tmp_path / ("nccl" if extra == [] else "py")
        fr = subprocess.run([sys.executable, "debug_tools.py", "fr", str(folder)], cwd=launch.REPO,
                            capture_output=True, text=True, timeout=300)
        assert re.search(r"rank\(s\) \[0\]: nccl:\S*gather.* from evaluate", fr.stdout), (how, fr.stdout + fr.stderr)
    res = launch.torchrun(READER, 2, ["--bug", "seed", "--ddp", "--check", "--backend", "nccl", "--epochs", "1"],
                          timeout=300, device="cuda", PYTHONPATH=launch.REPO)
    assert "replicas differ: module.proj (float32, (16, 16)) on rank(s) [1] " in res.output, res.output
