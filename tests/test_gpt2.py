"""05: the training script end to end (offline, gloo, 1-2 ranks). DDPCore and ManualDDP: test_manual_ddp.py.

Each launch of 05 imports transformers (several seconds of CPU per rank), so each test tells a whole story with
as few launches as it can: train, crash, restart, ask again, damage a checkpoint, continue.
"""

import re
import signal
import sys

import pytest
import torch

import launch

SCRIPT = "05_manual_ddp_gpt2.py"
# A small, fast configuration: the same code paths as the default run, a fraction of the time.
TINY = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "64", "--batch-size", "4", "--stdlib-files", "5",
        "--log-every", "4"]


def weights(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def lines_with(res, text):
    return [ln for ln in res.output.splitlines() if text in ln]


@pytest.mark.slow
def test_default_run_is_offline_and_loss_falls(tmp_path):
    # The default model, tokenizer and data set, with fewer steps than the 200 of the real default; and --profile's
    # traces, which benchmarks/overlap.py reads (whether gloo finished a bucket inside backward is timing: not checked).
    res = launch.torchrun(SCRIPT, 2, ["--max-steps", "12", "--warmup-steps", "4", "--log-every", "4", "--profile",
                                      tmp_path / "prof"], timeout=300)
    assert not res.timed_out and res.returncode == 0, res.output
    ok = res.ok_line()
    assert ok and "replicas identical; loss fell" in ok, res.output
    first, last = (float(x) for x in ok.rsplit(" ", 3)[-3::2])
    assert last < first - 1.0, ok  # from ~5.5 (uniform over 257 bytes) to well below
    assert "sample:" in res.output
    read = launch.run([sys.executable, "benchmarks/overlap.py", tmp_path / "prof" / "trace_rank1.json"], timeout=60)
    assert read.returncode in (0, 1) and "ProfilerStep#" in read.output and "all-reduces launched" in read.output, \
        read.output


@pytest.mark.slow
def test_crash_restart_damage_and_continue(tiny_models, tmp_path):
    # A GPT-2 from save_pretrained files (with dropout: its masks must replay on resume) and local text,
    # accumulating over 2 micro-batches (no_sync).
    args = ["--model", tiny_models / "gpt2", "--dataset", tiny_models / "text", "--seq-len", "32", "--batch-size",
            "4", "--log-every", "4", "--grad-accum", "2", "--ckpt-every", "4"]
    whole = launch.torchrun(SCRIPT, 2, args + ["--max-steps", 12, "--sample-tokens", 0, "--out", tmp_path / "whole"],
                            timeout=180)
    assert whole.returncode == 0 and whole.ok_line(), whole.output
    # The last rank SIGKILLs itself at step 7 on the first attempt; torchrun restarts both workers, which
    # resume from checkpoint-4 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set by launch.make_env).
    crashed = launch.torchrun(SCRIPT, 2, args + ["--max-steps", 12, "--sample-tokens", 0, "--crash-at-step", 7,
                                                 "--out", tmp_path / "crashed"], torchrun_args=["--max-restarts=1"],
                              timeout=240)
    assert crashed.returncode == 0 and crashed.ok_line(), crashed.output
    assert lines_with(crashed, "SIGKILL to myself") and lines_with(crashed, "resumed from")[0].endswith("step 4")
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "crashed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed run != uninterrupted run"
    start = weights(tiny_models / "gpt2")  # the saved model is the pretrained one's architecture, trained
    assert a.keys() == start.keys() and any(not torch.equal(a[k], v) for k, v in start.items()), "nothing trained"
    # Checkpoints are complete directories, the newest two kept, no temporary left behind.
    out = tmp_path / "whole"
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-12", "checkpoint-8"]
    state = torch.load(out / "checkpoint-12" / "state.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "step"} <= state.keys() and state["step"] == 12
    assert not any(k.startswith("module.") for k in state["model"])

    # Asked again, the finished run says so in one line, exit 0, and trains nothing.
    again = launch.torchrun(SCRIPT, 2, args + ["--max-steps", 12, "--out", out], timeout=180)
    assert again.returncode == 0 and again.ok_line().startswith("OK nothing to train"), again.output
    # A disk fault cuts the newest checkpoint short. The next start skips it (and keeps it, renamed), resumes from
    # the one before, and continues past the old end (--max-steps 16), with the default 120-token sample on a
    # 64-position model kept within it.
    damaged = out / "checkpoint-12" / "state.pt"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    more = launch.torchrun(SCRIPT, 2, args + ["--max-steps", 16, "--out", out], timeout=180)
    assert more.returncode == 0 and more.ok_line() and "sample:" in more.output, more.output
    assert "checkpoint-12" in lines_with(more, "does not load")[0], more.output
    assert lines_with(more, "resumed from")[0].endswith("checkpoint-8 at step 8"), more.output
    assert (out / "checkpoint-12.damaged" / "state.pt").stat().st_size == 1000, "the damaged checkpoint was lost"
    assert torch.load(out / "checkpoint-16" / "state.pt", weights_only=True)["step"] == 16


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
    """Not only GPT-2: a Llama (rotary positions, grouped-query attention) under PyTorch's DDP, in bf16 autocast.
    (A pretrained GPT-2 under DDPCore: the crash story above.)"""
    args = ["--model", tiny_models / "llama", "--dataset", tiny_models / "text", "--seq-len", "32", "--batch-size",
            "4", "--max-steps", "4", "--log-every", "2", "--sample-tokens", "8", "--impl", "torch", "--grad-accum",
            "2", "--precision", "bf16", "--out", tmp_path / "out"]
    res = launch.torchrun(SCRIPT, 2, args, timeout=180)
    assert res.returncode == 0 and res.ok_line(), res.output
    w, start = weights(tmp_path / "out"), weights(tiny_models / "llama")
    assert w.keys() == start.keys() and any(not torch.equal(w[k], v) for k, v in start.items()), "nothing trained"


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
    --seq-len beyond the model's positions, a diverging run, and an --out holding files no run of 05 wrote (left
    as it was)."""
    foreign, empty_dir = tmp_path / "foreign", tmp_path / "empty_dir"
    foreign.mkdir()
    empty_dir.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (tmp_path / "empty.txt").write_text("")
    check_one_line_errors(tmp_path, [
        (["--dataset", tmp_path / "empty.txt"], f"--dataset {tmp_path / 'empty.txt'} is empty: no text to train on"),
        (["--dataset", empty_dir], f"--dataset {empty_dir} is empty: no text to train on"),
        (["--seq-len", "100000"], "too few for 1 ranks"),
        (["--model", tiny_models / "gpt2", "--seq-len", "65"], "--seq-len 65 exceeds the model's 64 positions"),
        (["--lr", "1e6", "--max-steps", "8"], "training diverged: loss nan at step"),
        (["--out", foreign], "holds files that no run of 05_manual_ddp_gpt2.py wrote")])
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_dead_peer_ends_the_survivor():
    """A rank SIGKILLed mid-training: the survivor's next all-reduce fails with gloo's own error, and it exits 1
    within --timeout-s instead of hanging (the setup block adds no handler of its own: the library's error speaks).

    Plain processes, no torchrun agent (which would stop the survivor before it notices). --impl naive: the
    tutorial's blocking all-reduce per tensor, the path no other script test trains with."""
    survivor, dead = launch.ranks(SCRIPT, 2, TINY + ["--max-steps", "8", "--crash-at-step", "3", "--timeout-s", "60",
                                                     "--impl", "naive"], timeout=120)
    assert not survivor.timed_out and not dead.timed_out, survivor.output + dead.output
    assert dead.returncode == -signal.SIGKILL, dead.output
    assert survivor.returncode == 1, survivor.output
    assert re.search(r"RuntimeError: .*(Connection (closed|reset) by peer|Timed out)", survivor.output), survivor.output


@pytest.mark.slow
def test_compile_keeps_losses_and_overlap():
    res = launch.run(launch.torchrun_cmd("tests/workers/compile_worker.py", 2), timeout=240)
    assert not res.timed_out and res.returncode == 0 and res.ok_line(), res.output
