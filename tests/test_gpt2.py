"""05: ManualDDP against PyTorch's DDP, and the training script end to end (offline, gloo, 2-3 ranks)."""

import signal

import pytest
import torch

import launch

SCRIPT = "05_manual_ddp_gpt2.py"
# A small, fast configuration: the same code paths as the default run, a fraction of the time.
TINY = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "64", "--batch-size", "4", "--stdlib-files", "5",
        "--sample-tokens", "0"]


def weights(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_default_run_is_offline_and_loss_falls():
    # The default model, tokenizer and data set, with fewer steps than the 300 of the real default.
    res = launch.torchrun(SCRIPT, 2, ["--max-steps", "80", "--warmup-steps", "10", "--log-every", "20"], timeout=300)
    assert not res.timed_out and res.returncode == 0, res.output
    ok = res.ok_line()
    assert ok and "replicas identical; loss fell" in ok, res.output
    first, last = (float(x) for x in ok.rsplit(" ", 3)[-3::2])
    assert last < first - 0.8, ok  # from ~5.5 (uniform over 257 bytes) to well below
    assert "sample:" in res.output


def test_kill_and_resume_equals_uninterrupted(tmp_path):
    args = TINY + ["--max-steps", "12", "--ckpt-every", "4", "--grad-accum", "2", "--log-every", "4"]
    whole = launch.torchrun(SCRIPT, 2, args + ["--out", tmp_path / "whole"], timeout=180)
    assert whole.returncode == 0 and whole.ok_line(), whole.output
    # The last rank SIGKILLs itself at step 7 on the first attempt; torchrun restarts both workers, which
    # resume from checkpoint-4 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set by launch.make_env).
    crashed = launch.torchrun(SCRIPT, 2, args + ["--out", tmp_path / "crashed", "--crash-at-step", "7"],
                              torchrun_args=["--max-restarts=1"], timeout=240)
    assert crashed.returncode == 0 and crashed.ok_line(), crashed.output
    assert "SIGKILL to myself" in crashed.output and "resumed from" in crashed.output, crashed.output
    assert "checkpoint-4" in crashed.output.split("resumed from", 1)[1].splitlines()[0]
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "crashed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed run != uninterrupted run"
    # Checkpoints are complete directories, the newest two kept, no temporary left behind.
    assert sorted(p.name for p in (tmp_path / "whole").glob("*checkpoint-*")) == ["checkpoint-12", "checkpoint-8"]
    state = torch.load(tmp_path / "whole" / "checkpoint-12" / "state.pt")
    assert {"model", "optimizer", "scheduler", "scaler", "step"} <= state.keys() and state["step"] == 12
    assert not any(k.startswith("module.") for k in state["model"])


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


@pytest.mark.parametrize("arch,impl,precision", [("gpt2", "manual", "bf16"), ("llama", "torch", "fp32"),
                                                 ("gpt2", "naive", "fp16")])
def test_pretrained_model_on_local_files(tiny_models, tmp_path, arch, impl, precision):
    args = ["--model", tiny_models / arch, "--dataset", tiny_models / "text", "--seq-len", "32",
            "--batch-size", "4", "--max-steps", "6", "--log-every", "3", "--sample-tokens", "8",
            "--impl", impl, "--precision", precision, "--out", tmp_path / "out"]
    res = launch.torchrun(SCRIPT, 2, args, timeout=180)
    assert res.returncode == 0 and res.ok_line(), res.output
    w = weights(tmp_path / "out")
    assert w.keys() == weights(tiny_models / arch).keys()
    assert any(not torch.equal(w[k], v) for k, v in weights(tiny_models / arch).items()), "nothing was trained"


def test_plain_python_runs_one_process(tmp_path):
    res = launch.python(SCRIPT, TINY + ["--max-steps", "3", "--log-every", "1", "--profile", tmp_path], timeout=120)
    assert res.returncode == 0 and res.ok_line() and "world_size=1" in res.output, res.output
    assert (tmp_path / "trace_rank0.json").stat().st_size > 0


@pytest.mark.parametrize("nproc,args,message", [
    (2, ["--dataset", "/no/such/dir/*.txt"], "--dataset '/no/such/dir/*.txt': no local files match"),
    (1, ["--model", "/no/such/model"], "cannot load --model '/no/such/model'"),
    (1, ["--seq-len", "100000"], "too few for 1 ranks"),
    (1, ["--model", "{models}/gpt2", "--seq-len", "65"], "--seq-len 65 exceeds the model's 64 positions"),
])
def test_bad_input_is_one_clear_line(tiny_models, nproc, args, message):
    """Every rank fails the same way and exits non-zero; rank 0 says why in one line. No hang."""
    args = TINY[:-2] + [a.format(models=tiny_models) for a in args]
    res = launch.torchrun(SCRIPT, nproc, args, timeout=120) if nproc > 1 else launch.python(SCRIPT, args, timeout=60)
    assert not res.timed_out and res.returncode != 0, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], res.output


def test_dead_peer_is_one_clear_line():
    """A rank SIGKILLed mid-training: the survivor's next all-reduce fails, and it says so in one line, exit 1.

    Plain processes, no torchrun agent (which would stop the survivor before it notices)."""
    survivor, dead = launch.ranks(SCRIPT, 2, TINY + ["--max-steps", "8", "--crash-at-step", "3", "--timeout-s", "60"],
                                  timeout=120)
    assert not survivor.timed_out and not dead.timed_out, survivor.output + dead.output
    assert dead.returncode == -signal.SIGKILL, dead.output
    errors = [ln for ln in survivor.output.splitlines() if "error:" in ln]
    assert survivor.returncode == 1 and len(errors) == 1, survivor.output
    assert errors[0].startswith("[rank 0/2] error: lost a peer") and "Traceback" not in survivor.output, survivor.output
