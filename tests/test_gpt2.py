"""05: the training script end to end (offline, gloo, 1-2 ranks). DDPCore and ManualDDP: test_manual_ddp.py.

Each launch of 05 imports transformers (several seconds of CPU per rank), so each test tells a whole story with
as few launches as it can: train, get killed from outside, restart, ask again, damage a checkpoint, continue.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import launch
from conftest import load_script

SCRIPT = "05_manual_ddp_gpt2.py"
TINY = ["--seq-len", "64", "--batch-size", "4", "--log-every", "4"]  # the default model, shorter sequences


def weights(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def lines_with(res, text):
    return [ln for ln in res.output.splitlines() if text in ln]


def kill_a_worker_after(text, args, timeout):
    """05 under torchrun (2 ranks, one restart allowed): once a line holds `text`, one worker is SIGKILLed from
    outside, as a machine fault would; torchrun then stops the other and starts both again."""
    cmd = launch.torchrun_cmd(SCRIPT, 2, launch.with_device(args, "cpu"), ["--max-restarts=1"])
    proc = subprocess.Popen(cmd, cwd=launch.REPO, env=launch.make_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timer = threading.Timer(timeout, launch.kill_tree, [proc])  # a hang ends the test, not the suite
    timer.start()
    output, killed = [], None
    for line in proc.stdout:
        output.append(line)
        if killed is None and text in line:
            for pid in launch.descendants(proc.pid):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read()
                if SCRIPT.encode() in argv and b"torch.distributed.run" not in argv:  # a worker, not the agent
                    killed = pid
            os.kill(killed, signal.SIGKILL)
            output.append(f"[test] SIGKILL to worker {killed}\n")
    proc.wait()
    timer.cancel()
    return launch.Result(proc.returncode, "".join(output), not timer.is_alive() and proc.returncode == -9), killed


@pytest.mark.slow
def test_default_run_is_offline_and_loss_falls():
    # The default model, tokenizer and data set, with fewer steps than the 200 of the real default.
    res = launch.torchrun(SCRIPT, 2, ["--max-steps", "12", "--warmup-steps", "4", "--log-every", "4", "--eval-every",
                                      "6"], timeout=300)
    assert not res.timed_out and res.returncode == 0, res.output
    ok = res.ok_line()
    assert ok and "replicas identical; loss fell" in ok, res.output
    first, last = (float(x) for x in ok.rsplit(" ", 3)[-3::2])
    assert last < first - 1.0, ok  # from ~5.5 (uniform over 257 bytes) to well below
    val = [float(v) for v in re.findall(r"step +(?:6|12)/12 \| val loss +([\d.]+)", res.output)]
    assert len(val) == 2 and val[1] < val[0], res.output  # held-out text: the model learned, not memorised
    assert "sample:" in res.output and "MFU" not in res.output  # no MFU on the CPU: no peak to compare with


@pytest.mark.slow
def test_killed_restarted_damaged_and_continued(tiny_models, tmp_path):
    # A GPT-2 from save_pretrained files (with dropout: its masks must replay on resume; gelu_new, run as its
    # one-kernel twin) and local text, accumulating over 2 micro-batches (no_sync).
    args = ["--model", tiny_models / "gpt2", "--dataset", tiny_models / "text", "--seq-len", "32", "--batch-size",
            "4", "--log-every", "4", "--grad-accum", "2", "--eval-every", "4", "--max-steps", 16]
    whole = launch.torchrun(SCRIPT, 2, args + ["--sample-tokens", 0, "--out", tmp_path / "whole"], timeout=180)
    assert whole.returncode == 0 and whole.ok_line(), whole.output
    # Killed from outside after checkpoint-4 (12 steps before the end): torchrun restarts both workers, which
    # resume from the newest checkpoint (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set by launch.make_env).
    crashed, killed = kill_a_worker_after("saved " + str(tmp_path / "crashed" / "checkpoint-4"),
                                          args + ["--sample-tokens", 0, "--out", tmp_path / "crashed"], 240)
    assert killed and crashed.returncode == 0 and crashed.ok_line(), crashed.output
    assert re.search(r"resumed from .*checkpoint-(4|8|12)\.pt at step (4|8|12)$", crashed.output, re.M), crashed.output
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "crashed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed run != uninterrupted run"
    start = weights(tiny_models / "gpt2")  # the saved model is the pretrained one's architecture, trained
    assert a.keys() == start.keys() and any(not torch.equal(a[k], v) for k, v in start.items()), "nothing trained"
    # The held-out loss of the last step, from 2 ranks' shares, is one process's loss of the saved weights on every
    # held-out block (the same blocks: the script's own split, as many as the run said).
    from transformers import AutoModelForCausalLM, AutoTokenizer
    lesson = load_script(SCRIPT)
    tok = AutoTokenizer.from_pretrained(tmp_path / "whole")
    _, held_out = lesson.load_tokens(lesson.parse_args([*map(str, args)]), tok)
    n = int(re.search(r"(\d+) held-out blocks", whole.output).group(1))
    blocks = held_out.unfold(0, 33, 32)[:n]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "whole").eval()
    with torch.no_grad():
        ours = torch.nn.functional.cross_entropy(model(input_ids=blocks[:, :-1]).logits.flatten(0, 1),
                                                 blocks[:, 1:].flatten()).item()
    said = float(re.search(r"step +16/16 \| val loss +([\d.]+)", whole.output).group(1))
    assert n == 64 and abs(said - ours) < 1e-4, (said, ours)  # 2 ranks x 8 batches of 4
    # Step 1's loss is the mean over both ranks' 2 micro-batches, each rank on its own share of the data and with its
    # own dropout masks (seed + rank): one process recomputes it from the starting weights, as the script built them.
    from torch.utils.data import DistributedSampler
    parsed = lesson.parse_args([*map(str, args)])
    tok, start_model = lesson.build_model(parsed)
    data = lesson.load_tokens(parsed, tok)[0].unfold(0, 33, 32)
    losses = []
    with torch.no_grad():
        for rank in (0, 1):
            idx = list(DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0, drop_last=True))
            torch.manual_seed(rank)  # step 0's dropout seed on this rank
            losses += [lesson.next_token_loss(start_model.train(), data[idx[4 * m:4 * m + 4]], parsed) for m in (0, 1)]
    said = float(re.search(r"^step +1/16 \| loss +([\d.]+)", whole.output, re.M).group(1))
    assert abs(said - torch.stack(losses).mean().item()) < 1e-4, (said, losses)
    # Checkpoints are complete files, the newest two kept, no temporary left behind.
    out = tmp_path / "whole"
    assert sorted(p.name for p in out.glob("*checkpoint*")) == ["checkpoint-12.pt", "checkpoint-16.pt"]
    state = torch.load(out / "checkpoint-16.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "step"} <= state.keys() and state["step"] == 16
    assert not any(k.startswith("module.") for k in state["model"])

    # Asked again, the finished run says so in one line, exit 0, and trains nothing.
    again = launch.torchrun(SCRIPT, 2, args + ["--out", out], timeout=180)
    assert again.returncode == 0 and again.ok_line().startswith("OK nothing to train"), again.output
    # A disk fault cuts the newest checkpoint short. The next start skips it, resumes from the one before, writes
    # step 16 again over the damaged file, and continues past the old end (--max-steps 20), with the default
    # 120-token sample on a 64-position model kept within it.
    damaged = out / "checkpoint-16.pt"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    more = launch.torchrun(SCRIPT, 2, args[:-1] + [20, "--out", out], timeout=180)
    assert more.returncode == 0 and more.ok_line() and "sample:" in more.output, more.output
    assert str(damaged) in lines_with(more, "does not load")[0], more.output
    assert lines_with(more, "resumed from")[0].endswith("checkpoint-12.pt at step 12"), more.output
    assert torch.load(damaged, weights_only=True)["step"] == 16  # trained again from step 12, written over it
    assert torch.load(out / "checkpoint-20.pt", weights_only=True)["step"] == 20


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A GPT-2 and a Llama saved with save_pretrained, with the script's byte tokenizer, and local text."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from conftest import load_script
    root = tmp_path_factory.mktemp("models")
    tok = load_script(SCRIPT).byte_tokenizer()
    cfgs = {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2)),
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64, tie_word_embeddings=True)),
    }
    for name, model in cfgs.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    text = root / "text"
    text.mkdir()
    for i in range(3):
        lines = (f"line {j} of document {i}: the quick brown fox.\n" for j in range(200))
        (text / f"doc{i}.txt").write_text("".join(lines))
    return root


@pytest.mark.slow
def test_pretrained_llama_on_local_files(tiny_models, tmp_path):
    """Not only GPT-2: a Llama (rotary positions, grouped-query attention) under PyTorch's DDP, in bf16 autocast,
    with MFU in each step line from the peak given (--peak-tflops: on the CPU too). (A pretrained GPT-2 under
    DDPCore: the crash story above.)"""
    args = ["--model", tiny_models / "llama", "--dataset", tiny_models / "text", "--seq-len", "32", "--batch-size",
            "4", "--max-steps", "4", "--log-every", "2", "--sample-tokens", "8", "--impl", "torch", "--grad-accum",
            "2", "--precision", "bf16", "--peak-tflops", "1e-3", "--out", tmp_path / "out"]
    res = launch.torchrun(SCRIPT, 2, args, timeout=180)
    assert res.returncode == 0 and res.ok_line(), res.output
    w, start = weights(tmp_path / "out"), weights(tiny_models / "llama")
    assert w.keys() == start.keys() and any(not torch.equal(w[k], v) for k, v in start.items()), "nothing trained"
    # The tutorial's average through 05's own loop (accumulate, average, clip, step) gives DDP's bits on 2 ranks:
    # (a + b) / 2 and a / 2 + b / 2 are the same float when the divisor is a power of two.
    naive = launch.torchrun(SCRIPT, 2, args[:-1] + [tmp_path / "naive", "--impl", "naive"], timeout=180)
    assert naive.returncode == 0 and naive.ok_line(), naive.output
    n = weights(tmp_path / "naive")
    assert all(torch.equal(w[k], n[k]) for k in w), [k for k in w if not torch.equal(w[k], n[k])]
    # MFU: the FLOPs of a token (6N + 12 L d T, N as parameters() counts it, tied once: the GPU check's count) times
    # tokens/s per rank, over the peak
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    flops = 6 * sum(p.numel() for p in model.parameters()) + 12 * 2 * 32 * 32
    steps = re.findall(r"^step .*\| +([\d,]+) tok/s \| MFU ([\d.]+)%$", res.output, re.M)
    assert len(steps) == 3, res.output  # steps 1, 2 and 4
    for tokens, mfu in steps:
        expected = 100 * int(tokens.replace(",", "")) * flops / 2 / 1e9
        assert abs(float(mfu) - expected) <= 0.05 + 1e-3 * expected, (tokens, mfu, expected)


def check_one_line_errors(tmp_path, cases):
    """Run 05 as one process per case (forked after one import, tests/workers/usage_worker.py): each must stop with
    exit 2 and one error line that contains the given text, no traceback. Returns the error lines."""
    runs = [(SCRIPT, [*TINY, *argv, "--device", "cpu"], "alone", {}) for argv, _ in cases]
    found = []
    for (argv, message), (code, output) in zip(cases, launch.forked_cases(runs, tmp_path, timeout=240)):
        errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (argv, code, output)
        assert "Traceback" not in output, output
        found.append(errors[0])
    return found


def test_inputs_only_the_model_or_data_reveal_are_one_line(tiny_models, tmp_path):
    """Found after loading, as one line and exit 2: an empty --dataset file or directory, too little data, a
    --seq-len beyond the model's positions, a diverging run, and an --out holding files no run wrote (left
    as it was)."""
    foreign, empty_dir = tmp_path / "foreign", tmp_path / "empty_dir"
    foreign.mkdir()
    empty_dir.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (tmp_path / "empty.txt").write_text("")
    check_one_line_errors(tmp_path, [
        (["--dataset", tmp_path / "empty.txt"], f"--dataset {tmp_path / 'empty.txt'} holds no text to train on"),
        (["--dataset", empty_dir], f"--dataset {empty_dir} holds no text to train on"),
        (["--seq-len", "100000"], "tokens are too few for 1 ranks x --batch-size 4 x --seq-len 100000"),
        (["--model", tiny_models / "gpt2", "--seq-len", "65"], "--seq-len 65 exceeds the model's 64 positions"),
        (["--lr", "1e6", "--max-steps", "8"], "training diverged: loss nan at step"),
        (["--out", foreign], f"--out {foreign} holds files that no run wrote")])
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_dead_peer_ends_the_survivor(tmp_path):
    """A rank SIGKILLed from outside mid-training: the survivor's next all-reduce fails with gloo's own error, and it
    exits 1 within --timeout-s instead of hanging (the setup block adds no handler of its own: the library's error
    speaks).

    Plain processes, no torchrun agent (which would stop the survivor before it notices). --impl naive: the
    tutorial's blocking all-reduce per tensor, the path no other script test trains with."""
    port, procs = launch.free_port(), []
    for rank in range(2):
        env = launch.make_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=port)
        log = open(tmp_path / f"rank{rank}.log", "w+")
        argv = [sys.executable, SCRIPT, *TINY, "--log-every", "1", "--max-steps", "1000", "--timeout-s", "60",
                "--impl", "naive", "--device", "cpu"]
        procs.append((subprocess.Popen(argv, cwd=launch.REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    (survivor, log0), (dead, log1) = procs
    try:
        deadline = time.time() + 120
        while "step     2/" not in (tmp_path / "rank0.log").read_text() and time.time() < deadline:
            time.sleep(0.2)  # training, both ranks in step
        dead.kill()
        survivor.wait(timeout=max(1, deadline - time.time()))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                launch.kill_tree(proc)
            log.close()
    said = (tmp_path / "rank0.log").read_text()
    assert dead.wait() == -signal.SIGKILL and survivor.returncode == 1, said
    assert re.search(r"RuntimeError: .*(Connection (closed|reset) by peer|Timed out)", said), said


@pytest.mark.slow
def test_compile_keeps_losses_and_overlap():
    res = launch.torchrun("tests/workers/compile_worker.py", 2, timeout=240, device=None)
    assert not res.timed_out and res.returncode == 0 and res.ok_line(), res.output


def test_each_rank_reads_its_share_of_a_new_permutation_every_epoch(monkeypatch):
    """batches_from on each of 2 ranks (the group faked: DistributedSampler asks it for the rank and the size), over
    three epochs: the batches DistributedSampler's indices give after set_epoch(epoch), a new order each epoch, the
    ranks' shares disjoint."""
    from torch.utils.data import DistributedSampler
    lesson = load_script(SCRIPT)
    data = torch.arange(21 * 3).view(21, 3)  # 21 blocks: 10 a rank an epoch (drop_last), 3 batches of 3
    args = lesson.parse_args(["--seed", "5", "--batch-size", "3"])
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    seen = {}
    for rank in (0, 1):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, rank=rank: rank)
        batches = lesson.batches_from(data, args)
        for epoch in range(3):
            sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=5, drop_last=True)
            sampler.set_epoch(epoch)
            idx = list(sampler)
            got = [next(batches) for _ in range(3)]
            assert all(torch.equal(g, data[idx[3 * k:3 * k + 3]]) for k, g in enumerate(got)), (rank, epoch)
            seen[rank, epoch] = [row[0].item() // 3 for g in got for row in g]
    for epoch in range(3):
        assert not set(seen[0, epoch]) & set(seen[1, epoch]), seen
    assert seen[0, 0] != seen[0, 1] != seen[0, 2], seen
