"""benchmarks/: each runs under torchrun and writes the JSON and PNG it promises (their speed is not asserted).

The module's launches start together (two at a time, the GPU check's single process first) and each test reads its
own: a benchmark here measures nothing that is asserted, and the GPU check's pipeline keeps one core busy for most
of a minute while the other launches use the second."""

import json
import sys

import pytest

import launch

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """{test name: (its launch's Result(s), its output folder)}, launched ahead."""
    def job(name, run):
        def go():
            out = tmp_path_factory.mktemp(name.removeprefix("test_"))
            return run(out), out
        return name, go
    jobs = dict([
        job("test_gpu_check_pipeline_at_a_tiny_shape_on_the_cpu", lambda out: launch.run(
            [sys.executable, "benchmarks/gpu_check.py", "--tiny", "--out", out / "gc"], timeout=600)),
        job("test_ddp_step_benchmark", lambda out: launch.torchrun("benchmarks/ddp_step.py", 2, [
            "--seq-len", 64, "--batch-size", 4, "--steps", 2, "--warmup", 1, "--json", out / "ddp.json", "--plot",
            out / "ddp.png"], timeout=240)),
        job("test_gpu_check_without_cuda_is_one_line_and_runs_nothing", lambda out: [launch.run(
            ["bash", "benchmarks/gpu_check.sh", "--out", out / "gc", *flags], timeout=120,
            env=launch.make_env(CUDA_VISIBLE_DEVICES="")) for flags in ([], ["--peak-tflops", "0"])]),
        job("test_fsdp_memory_benchmark", lambda out: launch.run([
            sys.executable, "benchmarks/fsdp_memory.py", "--nproc", "1", "--rounds", "1", "--layers", "2", "--width",
            "64", "--steps", "2", "--impls", "fully_shard", "ours", "--json", out / "mem.json"], timeout=180)),
        job("test_overlap_profiles_05s_steps_and_reads_its_trace", lambda out: launch.torchrun(
            "benchmarks/overlap.py", 2, ["--out", out / "traces", "--json", out / "o.json"], timeout=240)),
        job("test_all_reduce_benchmark", lambda out: launch.torchrun("benchmarks/all_reduce.py", 3, [
            "--max-bytes", 64 << 10, "--iters", 2, "--json", out / "ar.json", "--plot", out / "ar.png"], timeout=120)),
        job("test_send_recv_benchmark", lambda out: launch.torchrun("benchmarks/send_recv.py", 2, [
            "--max-bytes", 4096, "--iters", 3, "--json", out / "p2p.json"], timeout=90))])
    with launch.ahead(request, jobs) as futures:
        yield futures


def result(launched, request):
    return launched[request.node.name].result()


@pytest.mark.slow
def test_all_reduce_benchmark(launched, request):
    res, folder = result(launched, request)
    out, png = folder / "ar.json", folder / "ar.png"
    assert res.returncode == 0 and res.ok_line(), res.output
    report = json.loads(out.read_text())
    assert (report["world_size"], report["backend"], report["device"]) == (3, "gloo", "cpu")
    rows = report["rows"]
    assert [r["bytes"] for r in rows] == [1024, 4096, 16384, 65536]
    for r in rows:
        for name in ("ring", "lesson_ring", "library"):  # ring: the pipelined one, the fastest hand-written ring
            assert 0 < r[f"{name}_ms_p25"] and r[f"{name}_ms"] > 0, r
            # busbw counts the bytes each rank sends: 2(N-1)/N = 4/3 of algbw on 3 ranks
            assert r[f"{name}_busbw_gbps"] == pytest.approx(r[f"{name}_algbw_gbps"] * 4 / 3)
            assert r[f"{name}_algbw_gbps"] == pytest.approx(r["bytes"] / (r[f"{name}_ms"] / 1e3) / 1e9)
        for name in ("ring", "lesson_ring"):
            assert r[f"{name}_over_library_busbw_p25"] <= r[f"{name}_over_library_busbw"] > 0, r
    assert png.read_bytes()[:8] == PNG


def test_send_recv_benchmark(launched, request):
    res, folder = result(launched, request)
    out = folder / "p2p.json"
    assert res.returncode == 0 and res.ok_line(), res.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [4, 16, 64, 256, 1024, 4096]
    assert all(r["latency_us"] > 0 and r["bandwidth_mbps"] == pytest.approx(r["bytes"] / r["latency_us"]) for r in rows)


@pytest.mark.slow
def test_ddp_step_benchmark(launched, request):
    res, folder = result(launched, request)
    out, png = folder / "ddp.json", folder / "ddp.png"
    assert res.returncode == 0 and res.ok_line(), res.output
    report = json.loads(out.read_text())
    assert (report["world_size"], report["backend"], report["model_size"]) == (2, "gloo", "small")
    impls = report["impls"]
    assert set(impls) == {"manual", "naive", "torch", "none"}
    # the shape the cost model needs to take a measurement as this model's (costmodel predict --measured)
    assert (report["seq_len"], report["batch_size"], report["n_layer"], report["n_embd"]) == (64, 4, 4, 128)
    assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in impls.values())
    # Exact, not timed: DDPCore's gradients are views of its buckets (one copy, like no DDP at all), PyTorch's
    # DDP (gradient_as_bucket_view=False) holds two; the buckets hold every gradient once; and the peak from
    # allocation records ranks no DDP below either DDP. The peak of either DDP moves by one set of gradients
    # between identical runs (whether gloo has finished a bucket before backward frees an activation: measured
    # 4.99 or 5.45 MiB for both here, at random), so DDPCore's is compared with PyTorch's within that.
    held = {k: v["grad_buffers_mb"] for k, v in impls.items()}
    assert held["manual"] == pytest.approx(held["none"]) and held["torch"] == pytest.approx(2 * held["none"])
    assert sum(report["buckets_mb"]) == pytest.approx(held["none"])
    assert impls["none"]["peak_mem_mb"] < min(impls["torch"]["peak_mem_mb"], impls["manual"]["peak_mem_mb"])
    assert impls["manual"]["peak_mem_mb"] <= impls["torch"]["peak_mem_mb"] + held["none"] + 0.01
    assert impls["none"]["allreduce_mb_per_step"] == 0 and impls["manual"]["allreduce_mb_per_step"] == held["none"]
    assert png.read_bytes()[:8] == PNG


@pytest.mark.slow
def test_overlap_profiles_05s_steps_and_reads_its_trace(launched, request):
    """Under torchrun, overlap.py trains 05's model with DDPCore under the profiler (each rank its trace) and reads
    rank 0's. Whether gloo finished a bucket inside backward is timing (exit 0 or 1): not checked."""
    res, folder = result(launched, request)
    assert res.returncode in (0, 1) and "ProfilerStep#" in res.output and "all-reduces launched" in res.output, \
        res.output
    assert sorted(p.name for p in (folder / "traces").iterdir()) == ["trace_rank0.json", "trace_rank1.json"]
    rows = json.loads((folder / "o.json").read_text())
    assert len(rows) == 3 and all(r["launched_inside_backward"] == 2 for r in rows), rows  # 05's two buckets


def test_overlap_reader_says_what_is_wrong_in_one_line(tmp_path):
    """benchmarks/overlap.py on a good trace: the test above. Here its errors on bad ones (no torch, fast)."""
    (tmp_path / "empty.json").write_text('{"traceEvents": []}')
    # A step with backward and an NCCL all-reduce, shaped as torch.profiler writes them: refused, not misread.
    step = {"ph": "X", "name": "ProfilerStep#3", "ts": 0, "dur": 100}
    bwd = {"ph": "X", "name": "autograd::engine::evaluate_function: AddmmBackward0", "ts": 10, "dur": 50}
    nccl = [{"ph": "X", "name": "nccl:all_reduce", "ts": 20, "dur": 1},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 21, "dur": 70}]
    (tmp_path / "nccl.json").write_text(json.dumps({"traceEvents": [step, bwd, *nccl]}))
    for path, says in ((tmp_path / "none.json", "not a readable profiler trace"),
                       (tmp_path / "empty.json", "no profiled step with a backward"),
                       (tmp_path / "nccl.json", "an NCCL trace")):
        res = launch.run([sys.executable, "benchmarks/overlap.py", path], timeout=60)
        lines = res.output.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {path}: "), res.output
        assert says in lines[0], res.output


@pytest.mark.slow
def test_fsdp_memory_benchmark(launched, request):
    """A launch each for fully_shard and ours (DDP's is the same code path, with DDP), each reporting its peak and
    the resident set it started from."""
    res, folder = result(launched, request)
    out = folder / "mem.json"
    assert res.returncode == 0 and "above base, ours' highest" in res.output, res.output
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["impl"] for r in rows) == ["fully_shard", "ours"]
    assert all(r["peak_mib"] > r["base_mib"] > 0 and r["ms"] > 0 for r in rows), rows


GPU_CHECK_ROW = {"name", "impl", "compile", "world_size", "tokens_per_s", "mfu", "n_params", "n_layer", "n_embd",
                 "seq_len", "batch_size"}  # the shape benchmarks/costmodel.py reads


def test_gpu_check_without_cuda_is_one_line_and_runs_nothing(launched, request, tmp_path, script):
    """benchmarks/gpu_check.sh with CUDA hidden (so the test means the same on a GPU machine): one line, exit 2,
    nothing written; a bad flag is one `error:` line. The GPU names torch reports map to their peaks."""
    runs, folder = result(launched, request)
    out = folder / "gc"
    for res, first in zip(runs, ("gpu_check: no CUDA GPU here", "error: --peak-tflops")):
        lines = res.output.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(first), res.output
        assert not out.exists()
    gpu_check = script("benchmarks/gpu_check.py")
    names = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA L4")
    assert [gpu_check.peak_for(name, None) for name in names] == [989, 989, 312, None]
    assert gpu_check.peak_for("NVIDIA L4", 121.0) == 121.0  # --peak-tflops wins
    # the FLOPs a token its MFU counts: 6N + 12 L d T of the model it saves, N as parameters() counts it (tied once)
    size, per_token = gpu_check.save_model(tmp_path / "tiny", gpu_check.TINY, 64)
    assert per_token == 6 * size["n_params"] + 12 * 2 * 64 * 64 and (size["n_layer"], size["n_embd"]) == (2, 64)


@pytest.mark.slow
def test_gpu_check_pipeline_at_a_tiny_shape_on_the_cpu(launched, request):
    """gpu_check.py --tiny: the GPU check's whole pipeline (a model saved for 05's --model, 05's four runs, the
    ceiling, the table, the JSON) at a 2-layer shape on the CPU over gloo. It measures nothing: it checks that what
    a GPU run prints and writes comes out whole, tokens/s as 05 itself printed them."""
    res, folder = result(launched, request)
    out = folder / "gc"
    assert res.returncode == 0 and res.ok_line(), res.output
    report = json.loads((out / "gpu_check.json").read_text())
    assert set(report) == {"gpu", "torch", "peak_tflops", "rows"}, report
    assert (report["gpu"], report["peak_tflops"]) == ("cpu", None) and "MFU blank" in res.output
    assert "05's own MFU agrees in 4 of 4 runs" in res.ok_line(), res.output  # given a nominal peak, on the CPU too
    rows = report["rows"]
    assert [(r["name"], r["impl"], r["compile"]) for r in rows] == [
        ("05 manual eager", "manual", False), ("05 torch eager", "torch", False),
        ("05 manual compile", "manual", True), ("05 torch compile", "torch", True),
        ("ceiling: no DDP, compiled whole", "none", True)]
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out / "gpt2-tiny")  # what 05 trained
    shape = (sum(p.numel() for p in model.parameters()), model.config.n_layer, model.config.n_embd, 64, 2)
    ceiling = rows[-1]["tokens_per_s"]
    for r in rows:
        assert set(r) == GPU_CHECK_ROW and r["world_size"] == 1 and r["mfu"] is None, r
        assert (r["n_params"], r["n_layer"], r["n_embd"], r["seq_len"], r["batch_size"]) == shape, r
        assert r["tokens_per_s"] > 0, r
        assert f"| {r['name']} | {r['tokens_per_s']:,.0f} |  | {r['tokens_per_s'] / ceiling:.2f} |" in res.output
    for r in rows[:4]:  # 05's own last step line, steps 3-4
        log = (out / f"{r['name'].replace(' ', '_')}.log").read_text()
        last = [ln for ln in log.splitlines() if ln.startswith("step") and "tok/s" in ln][-1]
        assert last.split("|")[0].split() == ["step", "4/4"] and f" {r['tokens_per_s']:,.0f} tok/s" in last, log
