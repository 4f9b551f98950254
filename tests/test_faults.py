"""When things go wrong outside the flags (issue #33): a full disk while saving, Ctrl-C and SIGTERM, a finished run
continued. Each ends in one line (or resumes, or continues), loses nothing and leaves nothing half-written.

The disk is real: a small tmpfs mounted for the test (root only; skipped elsewhere). The signals are sent as a
terminal sends Ctrl-C: to torchrun's process group, which torchrun passes on to its workers.
"""

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import launch

GPT2, RESNET = "05_manual_ddp_gpt2.py", "06_torch_ddp_resnet.py"
TINY = ["--n-layer", "2", "--n-embd", "64", "--seq-len", "64", "--batch-size", "4", "--stdlib-files", "5",
        "--log-every", "4", "--sample-tokens", "0"]


@contextlib.contextmanager
def tmpfs(path, size):
    """A filesystem of `size` at `path`, for a disk that really fills up; yields a function that resizes it."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path]).returncode:
        pytest.skip("a full disk is a tmpfs here, and mounting one needs root")
    try:
        yield lambda size: subprocess.run(["mount", "-o", f"remount,size={size}", path], check=True)
    finally:
        subprocess.run(["umount", "--lazy", path])


def errors(*results):
    return [ln for r in results for ln in r.output.splitlines() if "error" in ln]


def no_traceback_from_a_rank(output):
    # torchrun's agent reports the signal it got with a traceback of its own (SignalException): the launcher's,
    # which no script can silence. Every other traceback would be a rank's.
    assert "KeyboardInterrupt" not in output, output
    assert output.count("Traceback") == output.count("elastic.multiprocessing.api.SignalException: Process"), output


def interrupt(cmd, when, signum):
    """Start cmd in a session of its own, send signum to its process group once a line contains `when`."""
    proc = subprocess.Popen(cmd, cwd=launch.REPO, env=launch.make_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, deadline = [], time.time() + 180
    try:
        for line in proc.stdout:
            seen.append(line)
            if when in line:
                os.killpg(proc.pid, signum)
                break
            assert time.time() < deadline, "".join(seen)
        seen.append(proc.communicate(timeout=60)[0])
    finally:
        if proc.poll() is None:
            launch.kill_tree(proc)
    assert any(when in line for line in seen), "".join(seen)
    return proc.returncode, "".join(seen)


# --- quick: the pieces, in one process ---
def test_a_refused_write_is_one_line_and_leaves_no_partial_directory(script, tmp_path):
    """written_aside, the checkpoint block's: whatever stops a write removes its temporary directory; the system's
    refusal (as torch.save and safetensors report it) becomes one line naming the directory and the space needed;
    anything else (a bug, Ctrl-C) keeps its own exception."""
    lesson = script(GPT2)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    torch_save.__context__ = full  # torch.save fails while handling the OSError of its file's write
    safetensors = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    (tmp_path / "checkpoint-4").mkdir()
    for error in (full, torch_save, safetensors):
        with pytest.raises(lesson.UsageError) as said:
            with lesson.written_aside(tmp_path, "checkpoint-8", 3 * 2**20) as tmp:
                with open(os.path.join(tmp, "state.pt"), "wb") as f:
                    f.write(b"half")
                raise error
        assert str(said.value).startswith(f"cannot write checkpoint-8 to {tmp_path}: No space left on device: it "
                                          "needs about 3.0 MiB, "), said.value
        assert str(said.value).endswith(f"the newest checkpoint is {tmp_path / 'checkpoint-4'}; rerun the same "
                                        "command to resume"), said.value
        assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]
    cut_short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3918592 vs 3918488")
    cut_short.__context__ = lesson.Interrupted(signal.SIGTERM)  # torch.save's own error, once a signal cut its write
    for error, expected in ((ValueError("a bug"), ValueError), (lesson.Interrupted(signal.SIGINT), lesson.Interrupted),
                            (cut_short, lesson.Interrupted)):
        with pytest.raises(expected):
            with lesson.written_aside(tmp_path, "model", 10):
                raise error
        assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]
    # The space a checkpoint needs: each storage once (a tied embedding is one tensor under two names).
    tied = torch.zeros(256, 64)
    assert lesson.tensor_bytes({"model": {"wte": tied, "lm_head": tied}, "step": 4, "moments": [torch.ones(8)]}) \
        == tied.nbytes + 32


def test_the_final_models_on_a_full_disk_are_one_line_and_no_partial_file(script, tmp_path):
    """The final saves, 05's save_pretrained (safetensors) and 06's model.pt, on a disk too small for them."""
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2, resnet = script(GPT2), script(RESNET)
    tok = gpt2.byte_tokenizer()
    saves = [(gpt2.save_model, (GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=64,
                                                            n_layer=2, n_head=2)), tok), "model", "256k"),
             (resnet.save_model, (resnet.build_model(),), "model.pt", "8m")]
    for save, model, name, room in saves:
        with tmpfs(tmp_path / name, room):
            with pytest.raises(gpt2.UsageError if name == "model" else resnet.UsageError) as said:
                save(tmp_path / name, *model)
            assert str(said.value).startswith(f"cannot write {name} to {tmp_path / name}: No space left on device: "
                                              "it needs about "), said.value
            assert os.listdir(tmp_path / name) == [], "a partial file was left"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_run_in_one_line_by_that_signal(signum):
    """The setup block's run(): a signal is one line and the status a shell expects (128 + signal: 130, 143),
    with cleanup on the way out (the `finally` below, as written_aside's) and no traceback, even when the library
    it landed in reports it as an error of its own (as torch.save does)."""
    code = ("import os, sys; sys.path.insert(0, 'tests'); from conftest import load_script\n"
            "lesson = load_script('01_send_recv.py')\n"
            "def main(args):\n"
            "    try:\n"
            f"        os.kill(os.getpid(), {int(signum)})\n"
            "        import time; time.sleep(30)\n"
            "    except BaseException:\n"
            "        raise RuntimeError('unexpected pos 704 vs 598')\n"
            "    finally:\n"
            "        print('cleaned up', flush=True)\n"
            "lesson.run(main, lambda: None)\n")
    res = launch.run([sys.executable, "-c", code], timeout=60)
    assert res.returncode == -signum, res.output
    assert res.output == f"cleaned up\ninterrupted by {signal.Signals(signum).name}\n", res.output


# --- end to end: real launches, the slow tier ---
@pytest.mark.slow
def test_a_full_disk_stops_every_rank_in_one_line_and_the_same_command_finishes_later(tmp_path):
    """05 on a 2 MiB disk: checkpoint-4 fits, the last one does not. Then room for the checkpoint but not for the
    model after it; then room for everything: the same command saves the model, a larger --max-steps continues."""
    with tmpfs(tmp_path / "disk", "2m") as resize:
        out = tmp_path / "disk" / "out"
        args = TINY + ["--max-steps", "6", "--ckpt-every", "4", "--out", out]
        # Plain processes, no torchrun agent (it would stop the others itself): what each rank does is its own.
        ranks = launch.ranks(GPT2, 2, args)
        assert [r.returncode for r in ranks] == [2, 2], [r.output for r in ranks]
        said = errors(*ranks)
        assert len(said) == 1 and said[0] in ranks[0].output, said  # rank 1 stops alike, silently: no lost peer
        assert said[0].startswith(f"error: cannot write checkpoint-6 to {out}: No space left on device: it needs "
                                  "about 1.4 MiB, "), said
        assert f"the newest checkpoint is {out / 'checkpoint-4'}; rerun the same command to resume" in said[0]
        assert not any("Traceback" in r.output for r in ranks)
        assert sorted(os.listdir(out)) == [".lock", "checkpoint-4", "owner.json"]  # no .tmp-checkpoint-6
        assert torch.load(out / "checkpoint-4" / "state.pt", weights_only=True)["step"] == 4

        # Room for checkpoint-6 with 100 KiB to spare; the model (0.5 MiB) after it does not fit.
        ckpt = (out / "checkpoint-4" / "state.pt").stat().st_size
        resize(f"{(shutil.disk_usage(out).used + ckpt) // 1024 + 100}k")
        alone = launch.python(GPT2, args)
        assert alone.returncode == 2 and f"resumed from {out / 'checkpoint-4'} at step 4" in alone.output, alone.output
        said = errors(alone)
        assert len(said) == 1 and said[0].startswith(f"error: cannot write model to {out}: No space left on device: "
                                                     "it needs about "), said
        assert f"the newest checkpoint is {out / 'checkpoint-6'}" in said[0] and "Traceback" not in alone.output
        assert sorted(os.listdir(out)) == [".lock", "checkpoint-4", "checkpoint-6", "owner.json"]  # no .tmp-model

        # The end of training was a checkpoint: with room, the same command has nothing left to train, and saves
        # the model it could not save; a larger --max-steps continues from step 6.
        resize("16m")
        again = launch.python(GPT2, args)
        assert again.returncode == 0 and "nothing left to train" in again.ok_line(), again.output
        from transformers import AutoModelForCausalLM
        saved = AutoModelForCausalLM.from_pretrained(out).state_dict()
        final = torch.load(out / "checkpoint-6" / "state.pt", weights_only=True)["model"]
        assert all(torch.equal(saved[k], v) for k, v in final.items()), "the saved model is not the final one"
        more = launch.python(GPT2, args[:-4] + ["--max-steps", "8", "--out", out])
        assert more.returncode == 0 and more.ok_line(), more.output
        assert f"resumed from {out / 'checkpoint-6'} at step 6" in more.output, more.output


@pytest.mark.slow
def test_ctrl_c_under_torchrun_is_one_line_and_the_same_command_resumes(tmp_path):
    out = tmp_path / "out"
    args = launch.with_device(TINY + ["--max-steps", "42", "--ckpt-every", "4", "--out", out], "cpu")
    _, said = interrupt(launch.torchrun_cmd(GPT2, 2, args), f"saved {out}/checkpoint-4", signal.SIGINT)
    lines = [ln for ln in said.splitlines() if ln.startswith("interrupted")]
    assert len(lines) == 1 and lines[0].startswith("interrupted by SIGINT at step "), said
    assert lines[0].endswith("; rerun the same command to resume"), lines
    newest = lines[0].split("the newest checkpoint is ")[1].split(";")[0]
    assert os.path.isdir(newest) and not [n for n in os.listdir(out) if n.startswith(".tmp-")], os.listdir(out)
    no_traceback_from_a_rank(said)
    again = launch.torchrun(GPT2, 2, args, timeout=180)
    assert again.returncode == 0 and again.ok_line() and f"resumed from {newest} at step" in again.output, again.output
    # 42 is no multiple of --ckpt-every: the end of training is a checkpoint of its own.
    assert torch.load(out / "checkpoint-42" / "state.pt", weights_only=True)["step"] == 42


@pytest.mark.slow
def test_sigterm_under_torchrun_resumes_and_a_finished_run_continued_has_nothing_left_in_06(tmp_path):
    """06's neighbours of the above: SIGTERM (a scheduler's), the same command resumes, and once more (here as one
    process: any number of ranks resumes) has nothing left to train, exit 0."""
    out = tmp_path / "out"
    args = ["--dataset", "fake", "--fake-size", "32", "--batch-size", "8", "--epochs", "3", "--out", out]
    _, said = interrupt(launch.torchrun_cmd(RESNET, 2, launch.with_device(args, "cpu")), "epoch   2/3", signal.SIGTERM)
    lines = [ln for ln in said.splitlines() if ln.startswith("interrupted")]
    assert len(lines) == 1 and lines[0].startswith("interrupted by SIGTERM in epoch "), said
    newest = lines[0].split("the newest checkpoint is ")[1].split(";")[0]
    assert os.path.isdir(newest) and not [n for n in os.listdir(out) if n.startswith(".tmp-")], os.listdir(out)
    no_traceback_from_a_rank(said)
    again = launch.torchrun(RESNET, 2, args, timeout=180)
    assert again.returncode == 0 and again.ok_line() and f"resumed from {newest}" in again.output, again.output
    (out / "model.pt").unlink()  # as if stopped between the last checkpoint and the model
    done = launch.python(RESNET, args, timeout=180)
    assert done.returncode == 0 and "nothing left to train" in done.ok_line(), done.output
    assert torch.load(out / "model.pt").keys() == torch.load(out / "checkpoint-3" / "state.pt")["model"].keys()
