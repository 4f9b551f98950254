"""08: FSDP by hand against PyTorch's fully_shard (gloo, 2-3 ranks, same data), and the script end to end.
07's ZeroDDP checks share this file's 3-rank launch (test_zero.py has the 07 script itself)."""

import shutil

import pytest
import torch

import launch

SCRIPT = "08_fsdp.py"
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "2"]


def test_fsdp_and_zero_equal_pytorch_on_3_ranks():
    """fsdp_worker's checks and zero_worker's (07 against DDP and ZeroRedundancyOptimizer) in one 3-rank launch:
    3 ranks make uneven shards and sums whose order shows in the last bit. 2 ranks: the script test below."""
    res = launch.torchrun("tests/workers/fsdp_worker.py", 3, timeout=300, device=None, ALSO_ZERO="1")
    assert not res.timed_out and res.returncode == 0, res.output
    oks = [ln for ln in res.output.splitlines() if ln.startswith("OK ")]
    assert [ok.split()[1] for ok in oks] == ["ZeroDDP", "08"] and all("on 3 ranks" in ok for ok in oks), res.output


@pytest.mark.slow
def test_script_resumes_on_3_ranks_then_2_and_saves_a_plain_model(tmp_path):
    """Four launches with clipping: 2 steps on 2 ranks beside 07 (so with a ZeRO-2 column), on to 4 on 3 ranks
    from that checkpoint with a copy that has no 07 beside it (both in bf16), then to 6 on 2 ranks again in fp32,
    then the same command again.
    Each run's own check holds: ours, resharded from the checkpoint by hand, == fully_shard resharded by PyTorch's
    DCP, bit for bit after the same steps (and in fp32 DDP, from the same checkpoint, within rounding). The saved
    model loads with from_pretrained. (Accumulation, for which 07 has no column, is the worker's; so is resume ==
    uninterrupted.) A finished run asked again trains nothing and saves the model."""
    from transformers import AutoModelForCausalLM
    alone, out = tmp_path / "alone", tmp_path / "out"
    alone.mkdir()
    shutil.copy(launch.REPO / SCRIPT, alone / SCRIPT)
    args = TINY + ["--param-dtype", "bf16", "--clip", "1.0", "--ckpt-every", "2", "--out", out]
    first = launch.torchrun(SCRIPT, 2, args + ["--max-steps", "2"], timeout=240)
    assert first.returncode == 0 and first.ok_line(), first.output
    for rank in (0, 1):  # every rank's row of the side-by-side table, 07's ZeRO-2 among them
        for impl in ("DDP", "ZeRO-2", "ours", "fully_shard"):
            row = next(ln for ln in first.output.splitlines() if ln.startswith(f"| {rank} | {impl} | "))
            assert "n/a" not in row, row
    # Newer checkpoints that do not load, both cut short: a copy of checkpoint-2.pt and a file hardly begun. Both
    # are skipped with a warning, newest first, and the run resumes from checkpoint-2.pt. Its step 4 is written
    # over the damaged checkpoint-4.pt; the damaged checkpoint-3.pt stays until it is pruned as an old one.
    (out / "checkpoint-4.pt").write_bytes((out / "checkpoint-2.pt").read_bytes()[:1000])
    (out / "checkpoint-3.pt").write_bytes(b"PK\x03\x04 cut short")
    second = launch.torchrun(alone / SCRIPT, 3, args + ["--max-steps", "4"], timeout=240)
    assert second.returncode == 0, second.output
    warnings = [ln.split()[1] for ln in second.output.splitlines() if ln.startswith("warning: ")]
    assert warnings == [f"{out}/checkpoint-{step}.pt" for step in (4, 3)], second.output
    assert (f"resumed from {out}/checkpoint-2.pt at step 2, written by 2 ranks: every implementation reshards it "
            "onto 3") in second.output, second.output
    assert second.ok_line().startswith(f"OK ours == fully_shard bit for bit after 2 AdamW steps from "
                                       f"{out}/checkpoint-2.pt (bf16, world size 3)"), second.output
    assert torch.load(out / "checkpoint-4.pt")["world_size"] == 3  # written over the damaged one
    assert "| 2 | ZeRO-2 | n/a (07_zero.py not beside this file)" in second.output
    fp32 = [a for a in args if a not in ("--param-dtype", "bf16")]  # where the run checks DDP's weights too
    third = launch.torchrun(SCRIPT, 2, fp32 + ["--max-steps", "6"], timeout=240)
    assert "warning: " not in third.output, third.output
    assert f"resumed from {out}/checkpoint-4.pt at step 4, written by 3 ranks" in third.output, third.output
    assert third.ok_line().startswith(f"OK ours == fully_shard bit for bit after 2 AdamW steps from "
                                      f"{out}/checkpoint-4.pt (fp32, world size 2), DDP within"), third.output
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4.pt", "checkpoint-6.pt"]  # 3 pruned
    state = torch.load(out / "checkpoint-6.pt")
    assert state["step"] == 6 and state["world_size"] == 2 and state["script"] == SCRIPT
    assert {s["step"].item() for s in state["optimizer"]["state"].values()} == {6}  # AdamW's count went through
    model = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert state["model"].keys() == model.keys() and all(torch.equal(model[k], v) for k, v in state["model"].items())
    # The last step is a checkpoint too. A run stopped after it, before the model was saved (killed, or the
    # same command again), has nothing to train: it says so, saves the model from the checkpoint and exits 0.
    saved = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").unlink()
    again = launch.torchrun(SCRIPT, 2, fp32 + ["--max-steps", "6"], timeout=240)
    assert again.returncode == 0, again.output
    assert again.ok_line() == f"OK nothing to train: {out} holds step 6 of --max-steps 6. A larger --max-steps " \
                              "trains on.", again.output
    assert (out / "model.safetensors").read_bytes() == saved and "| loss " not in again.output, again.output


def test_clip_grad_norm_uses_pytorchs_norm_kernel(script, monkeypatch, group_of_one):
    # On a GPU, _foreach_norm and one vector_norm per tensor add in different orders, so 08's clip_grad_norm_ must
    # take the kernel PyTorch's takes for fully_shard's DTensor gradients. On the CPU both give the same bits, so
    # the kernel is checked here by name: both must call _foreach_norm, and agree.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    calls, real = [], torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a, **k))
    mesh = init_device_mesh("cpu", (1,))
    shapes = [(7, 5), (5,), (3, 3)]
    params = [distribute_tensor(torch.randn(s), mesh, [Shard(0)]) for s in shapes]
    grads = [torch.randn(s) * 10 for s in shapes]
    theirs, ours = [torch.nn.Parameter(p) for p in params], [torch.nn.Parameter(p.to_local()) for p in params]
    for t, o, g in zip(theirs, ours, grads):
        t.grad, o.grad = distribute_tensor(g, mesh, [Shard(0)]), g.clone()
    norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0).full_tensor()
    assert calls, "clip_grad_norm_ no longer uses _foreach_norm for DTensors: 08 must follow it"
    calls.clear()
    assert torch.equal(script("08_fsdp.py").clip_grad_norm_(ours, 1.0), norm) and calls == [3]
    assert all(torch.equal(t.grad.full_tensor(), o.grad) for t, o in zip(theirs, ours))


def test_fully_shard_gets_a_mesh_on_the_chosen_device(script, monkeypatch, group_of_one):
    # Without a mesh, fully_shard builds one on torch._C._get_accelerator(): CUDA wherever a GPU exists, even when
    # the script chose the CPU (more ranks than GPUs, --device cpu). Here the machine pretends to have CUDA: 08's
    # PyTorch column must not ask, and its parameters must live on a CPU mesh.
    from torch.distributed.tensor import DTensor
    asked = []
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: asked.append(1) or torch.device("cuda"))
    fsdp = script(SCRIPT)
    model, _, _ = fsdp.build("fully_shard", fsdp.parse_args(TINY), torch.device("cpu"), None)
    meshes = {p.device_mesh.device_type for p in model.parameters() if isinstance(p, DTensor)}
    assert meshes == {"cpu"} and not asked, (meshes, asked)


def test_each_rank_step_and_micro_batch_draws_its_own_windows(script, monkeypatch):
    """08's batches with --grad-accum 2, as ranks 0 and 1 draw them at steps 0 and 1: eight different batches (a
    seed without the rank, or one that confuses (step 0, micro 1) with (step 1, micro 0), repeats data)."""
    fsdp = script(SCRIPT)
    args = fsdp.parse_args(TINY + ["--grad-accum", "2"])
    text = torch.arange(5000) % 256
    drawn = []
    for rank in (0, 1):
        monkeypatch.setattr(fsdp, "RANK", rank)
        drawn += [fsdp.batch(text, step, micro, args, torch.device("cpu")) for step in (0, 1) for micro in (0, 1)]
    assert all(not torch.equal(a, b) for i, a in enumerate(drawn) for b in drawn[i + 1:])


def test_accumulating_one_batch_twice_gives_its_gradient(script, monkeypatch, group_of_one):
    """08's loop with --grad-accum 2 fed the same micro-batch twice: the global gradient norm (before clipping) is
    the one that batch gives in a step without accumulation: each micro-batch's loss halved, and the sum reduced on
    the last micro-batch. One process, a group of one."""
    fsdp = script(SCRIPT)
    batch = fsdp.batch
    monkeypatch.setattr(fsdp, "batch", lambda text, step, micro, args, device: batch(text, step, 0, args, device))
    text = torch.arange(5000) % 256
    norms = {}
    for accum in (1, 2):
        args = fsdp.parse_args(TINY + ["--max-steps", "1", "--grad-accum", str(accum), "--clip", "1e9"])
        norms[accum] = fsdp.train("ours", args, torch.device("cpu"), text, None)[1]["norms"][0]
    assert torch.allclose(norms[1], norms[2], rtol=1e-5), norms


def test_the_nccl_path_asks_for_the_mean_of_the_rows_and_keeps_its_own(script, monkeypatch, group_of_one):
    """08's reduce on NCCL (which the CPU never runs, and the GPU tier runs on one rank, where nothing is reduced): a
    unit of 2 ranks asks for one reduce-scatter of the whole packed buffer, AVG, into a row of its own size.
    One process, a group of one, the unit told it has 2 ranks on NCCL; the call recorded, not run."""
    import torch.distributed as dist
    fsdp = script(SCRIPT)
    unit = fsdp.fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4))).fsdp_unit
    unit.world, unit.gloo = 2, False
    calls = []

    def recorded(out, inp, **kw):
        calls.append((out, inp, kw))
        return "handle"
    monkeypatch.setattr(fsdp, "reduce_scatter", recorded)
    rows = torch.randn(2, 10)
    out, handle = unit.start_reduce(rows)
    (got, inp, kw), = calls
    assert handle == "handle" and got is out and out.shape == (10,) and out.dtype == rows.dtype
    assert inp.data_ptr() == rows.data_ptr() and inp.shape == (20,) and kw["op"] == dist.ReduceOp.AVG, kw
