"""Every bad flag stops in one line before any work, and no run writes over what it did not write (issues #12, #36).

The stories that need a real job (kill and resume, a damaged checkpoint, a finished run asked again) are in each
script's own test file; here, the table of bad flags for every script, and the --out contract of 05, 06 and 08.
"""

import re

import pytest
import torch

import launch
from conftest import load_script

PROXY = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}  # a download fails at once
HUGE = "99999999999999999999"


def table(tmp):
    """(script, arguments, run as, what the one error line must say): "both" means rank 0 and rank 1 of 2."""
    out = tmp / "out"  # an existing --out with a checkpoint in it: a bad flag must leave it untouched
    out.mkdir()
    (out / "checkpoint-4.pt").write_bytes(b"\0" * 64)
    cases = [("01_send_recv.py", ["--timeout-s", "0"], "both", "argument --timeout-s: must be >= 1 and < inf, got 0"),
             ("01_send_recv.py", ["--bogus"], "both", "unrecognized arguments: --bogus"),
             ("01_send_recv.py", ["--device", "gpu"], "both", "argument --device: invalid choice"),
             ("01_send_recv.py", ["--backend", "nccl", "--device", "cpu"], "both", "nccl"),
             ("02_broadcast.py", ["--src", "5"], "both", "--src 5 is not a rank"),
             ("02_broadcast.py", ["--numel", "0"], "both", "argument --numel: must be >= 1"),
             ("02_broadcast.py", ["--numel", "1e11"], "both", "argument --numel"),
             ("03_all_reduce.py", ["--timeout-s", "-1"], "both", "argument --timeout-s: must be >= 1"),
             ("04_sampler.py", ["--dataset-size", "0"], "both", "argument --dataset-size: must be >= 1"),
             ("05_manual_ddp_gpt2.py", ["--lr", "0", "--out", out], "both", "argument --lr: must be >="),
             ("05_manual_ddp_gpt2.py", ["--eval-every", "-1"], "both", "argument --eval-every: must be >= 0"),
             ("05_manual_ddp_gpt2.py", ["--grad-accum", "nan"], "both", "argument --grad-accum"),
             ("05_manual_ddp_gpt2.py", ["--warmup-steps", "-1"], "both", "argument --warmup-steps: must be >="),
             ("05_manual_ddp_gpt2.py", ["--batch-size", "0"], "both", "argument --batch-size: must be >= 1"),
             ("05_manual_ddp_gpt2.py", ["--sample-tokens", "-5"], "both", "argument --sample-tokens: must be >= 0"),
             ("05_manual_ddp_gpt2.py", ["--impl", "fast"], "both", "argument --impl: invalid choice"),
             ("05_manual_ddp_gpt2.py", ["--seq-len", "1e8"], "both", "argument --seq-len"),
             ("06_torch_ddp_resnet.py", ["--epochs", "0", "--out", out], "both", "argument --epochs: must be >= 1"),
             ("06_torch_ddp_resnet.py", ["--lr", "-1"], "both", "argument --lr: must be >="),
             ("06_torch_ddp_resnet.py", ["--nproc", "2"], "both", "--nproc starts its own processes"),
             ("06_torch_ddp_resnet.py", ["--timeout-s", "0.5"], "both", "argument --timeout-s: must be >= 1"),
             ("06_torch_ddp_resnet.py", ["--fake-size", "1e12"], "both", "argument --fake-size"),
             ("07_zero.py", ["--stage", "3"], "both", "argument --stage: invalid choice"),
             ("07_zero.py", ["--n-embd", "100"], "both", "multiple of 64"),
             ("08_fsdp.py", ["--clip", "-1", "--out", out], "both", "argument --clip: must be >= 0"),
             ("08_fsdp.py", ["--lr", "nan"], "both", "argument --lr: must be >="),
             ("benchmarks/all_reduce.py", ["--min-bytes", "2"], "both", "--min-bytes"),
             ("benchmarks/ddp_step.py", ["--steps", "0"], "both", "--steps")]
    # Not finite, or too large for what takes it: the same one line.
    cases += [(name, ["--timeout-s", value], "both", f"argument --timeout-s: must be >= 1 and < inf, got {value}")
              for name, value in (("01_send_recv.py", "nan"), ("02_broadcast.py", "inf"),
                                  ("03_all_reduce.py", "0.001"))]
    cases += [(name, ["--seed", HUGE], "both", "argument --seed: must be")
              for name in ("04_sampler.py", "05_manual_ddp_gpt2.py", "06_torch_ddp_resnet.py", "07_zero.py",
                           "08_fsdp.py")]
    cases += [(name, [flag, value], "both", f"argument {flag}: must be")
              for name, flag, value in (("05_manual_ddp_gpt2.py", "--lr", "inf"), ("05_manual_ddp_gpt2.py",
                                        "--lr", "nan"),
                                        ("06_torch_ddp_resnet.py", "--lr", "inf"), ("07_zero.py", "--lr", "inf"),
                                        ("07_zero.py", "--bucket-cap-mb", "inf"), ("07_zero.py", "--n-embd", "0"),
                                        ("08_fsdp.py", "--lr", "inf"), ("08_fsdp.py", "--clip", "inf"))]
    # Input that only the run reveals: 07 at --lr 1e30 diverges (loss nan), and says that, not "the weights differ".
    tiny07 = ["--n-layer", "1", "--n-embd", "64", "--seq-len", "16", "--vocab-size", "256", "--steps", "2"]
    cases += [("07_zero.py", tiny07 + ["--stage", "1", "--lr", "1e30"], "alone",
               "ZeRO-1 or DDP: the loss or the weights went to inf or nan. Try a smaller --lr.")]
    # 01-04 teach a job of several ranks: alone, they say how to start one.
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


CHECKPOINTING = ("05_manual_ddp_gpt2.py", "06_torch_ddp_resnet.py", "08_fsdp.py")


def test_each_script_refuses_another_scripts_checkpoints_and_changes_nothing(tmp_path, group_of_one):
    """05, 06 and 08 share one checkpoint block, and each checkpoint names the script that wrote it (#60). Each
    script's load_newest, pointed at an --out of another script or of a version that did not name its writer,
    stops with a UsageError that names both (run() makes it one `error:` line, exit 2: the slow test below) and
    changes no file. Pointed at its own --out, it loads. One process, small fake checkpoints, every pair."""
    scripts = {name: load_script(name) for name in CHECKPOINTING}
    folders = {name: tmp_path / name[:2] for name in [*CHECKPOINTING, "older"]}
    for name, folder in folders.items():
        folder.mkdir()
        if name == "older":  # written before checkpoints named their writer
            torch.save({"step": 3, "w": torch.ones(2)}, folder / "checkpoint-3.pt")
        else:
            scripts[name].save_checkpoint(str(folder), 3, {"step": 3, "w": torch.ones(2)})
    before = {name: tree(folder) for name, folder in folders.items()}
    for reader, lesson in scripts.items():
        for writer, folder in folders.items():
            if writer == reader:
                assert torch.equal(lesson.load_newest(str(folder))["w"], torch.ones(2)), reader
                continue
            said = "an older version" if writer == "older" else writer
            wanted = f"{folder}/checkpoint-3.pt was written by {said}, not {reader}. Start this run in a new --out."
            with pytest.raises(lesson.UsageError, match=f"^{re.escape(wanted)}$"):
                lesson.load_newest(str(folder))
    assert {name: tree(folder) for name, folder in folders.items()} == before, "a refused run changed an --out"


@pytest.mark.slow  # real runs of 05, 06 and 08 write the --out folders first (about 30 s)
def test_an_out_is_never_written_by_a_run_that_did_not_write_it(tmp_path):
    """One checkpoint contract for 05, 06 and 08, end to end: a run writes only into a new or empty --out, or one
    that holds a run's checkpoint-* files. A directory of other files, or another script's --out (written here by
    a short real run of it), stops the run with one `error:` line, exit 2, and changes no file. (Plain python: a
    group of one.)"""
    tiny = {"05_manual_ddp_gpt2.py": ["--seq-len", "32", "--batch-size", "2", "--eval-every", "0", "--sample-tokens",
                                      "0", "--max-steps"],
            "06_torch_ddp_resnet.py": ["--dataset", "fake", "--fake-size", "32", "--batch-size", "8", "--epochs"],
            "08_fsdp.py": ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "2",
                           "--max-steps"]}  # each ends on the run's length: 1 writes an --out, 2 trains on from one
    dirs = {script: tmp_path / script[:2] for script in tiny}
    made = launch.forked_cases([(s, [*tiny[s], "1", "--out", dirs[s], "--device", "cpu"], "alone", {}) for s in tiny],
                               tmp_path)
    assert [code for code, _ in made] == [0, 0, 0], made
    dirs["other"] = tmp_path / "other"
    dirs["other"].mkdir()
    for f in ("notes.txt", "data.csv"):
        (dirs["other"] / f).write_bytes(b"someone's work")
    before = {name: tree(folder) for name, folder in dirs.items()}
    cases = [(s, writer) for s in tiny for writer in dirs if writer != s]
    runs = [(s, [*tiny[s], "2", "--out", dirs[writer], "--device", "cpu"], "alone", {}) for s, writer in cases]
    for (script, writer), (code, said) in zip(cases, launch.forked_cases(runs, tmp_path)):
        errors = [ln for ln in said.splitlines() if ln.startswith("error:")]
        if writer == "other":
            message = f"--out {dirs['other']} holds files that no run wrote. Pick a new or empty folder."
        else:
            message = f"was written by {writer}, not {script}. Start this run in a new --out."
        assert code == 2 and len(errors) == 1 and message in errors[0], (script, writer, code, said)
        assert "Traceback" not in said, said
    assert {name: tree(folder) for name, folder in dirs.items()} == before, "a refused run changed an --out"
