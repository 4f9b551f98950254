"""The GPU check: the GPU test tier, then 05's speed at GPT-2 124M's shape against what one GPU can do.

  bash benchmarks/gpu_check.sh [--out DIR] [--peak-tflops X]     (one GPU, no network, about 8 minutes)
  python benchmarks/gpu_check.py --tiny --out DIR                 (the same pipeline on the CPU, at a tiny shape)

1. `python -m pytest -m gpu` with PYTHONFAULTHANDLER=1: a rank that segfaults prints the Python line it died on.
2. 05 on one rank at GPT-2 124M's shape (GPT2Config's defaults, dropout 0 as nanoGPT's bench.py, random weights,
   saved with 05's byte tokenizer into DIR/gpt2-124m), --impl manual and torch, eager and --compile; tokens/s from
   05's own step line over steps 31-40. Then the ceiling: the same model with no DDP, compiled whole with its loss,
   in a plain loop (fused AdamW, clipping, bf16 autocast), timed over the same steps.
A markdown table of tokens/s, MFU and each row's ratio to the ceiling on stdout, the same as JSON (DIR/gpu_check.json;
its shape is what benchmarks/costmodel.py reads). Exit status: 0 when everything ran, the tier passed and 05's own
MFU agrees with ours; 1 when something failed; 2 when nothing ran (no CUDA GPU, or a bad flag).
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from common import flops_per_token, load_script  # noqa: E402

lesson = load_script("05_manual_ddp_gpt2.py")  # its byte tokenizer, its model builder, its table of GPU peaks
PEAK_TFLOPS = lesson.PEAK_TFLOPS  # dense bf16 TFLOPS by the GPU's name, as 05's step line counts MFU
GPT2_124M = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # GPT2Config's defaults otherwise
TINY = dict(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=257,  # 05's byte tokenizer: 256 bytes + end
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
RUNS = [("manual", False), ("torch", False), ("manual", True), ("torch", True)]
RUN_TIMEOUT_S = 600  # one 05 run: its compile takes a minute or two on a GPU, the steps seconds
TIER_TIMEOUT_S = 1200  # a guard only: each test of the tier kills its own launches at its timeout


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one `error:` line, not argparse's usage too
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="out/gpu_check", help="folder for the model, the logs and the JSON")
    p.add_argument("--json", default=None, help="where the JSON goes (default: OUT/gpu_check.json)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"the GPU's dense bf16 peak, for MFU; known by name: {PEAK_TFLOPS}")
    p.add_argument("--skip-tier", action="store_true", help="only the speed (the test tier ran already)")
    p.add_argument("--tiny", action="store_true",
                   help="the same pipeline on the CPU (gloo) at a 2-layer shape, 4 steps: checks the plumbing, "
                        "measures nothing; never runs the tier")
    args = p.parse_args(argv)
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        p.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    return args


def peak_for(gpu, flag):
    if flag is not None:
        return flag
    return next((tflops for name, tflops in PEAK_TFLOPS.items() if name in gpu), None)


def save_model(folder, shape, seq_len):
    """A GPT-2 with random weights and 05's byte tokenizer, saved where 05's --model loads it; its size and its
    training FLOPs a token at seq_len."""
    from transformers import GPT2Config, GPT2LMHeadModel
    tok = lesson.byte_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**shape, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = model.config  # parameters(): the tied head and embedding once
    size = dict(n_params=sum(p.numel() for p in model.parameters()), n_layer=cfg.n_layer, n_embd=cfg.n_embd)
    return size, flops_per_token(model, seq_len)


def run_logged(cmd, log, env, timeout):
    """Run cmd from the repository root, each output line to the terminal (indented) and to `log`; killed with its
    process group after `timeout` s. (exit status, output)."""
    lines = []
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its own process group, for the timeout to kill
        timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        for line in proc.stdout:
            f.write(line)
            lines.append(line)
            print("  " + line, end="", flush=True)
        timer.cancel()
        proc.wait()
    if proc.returncode == -signal.SIGKILL:
        lines.append(f"killed after {timeout} s\n")
    return proc.returncode, "".join(lines)


def run_05(impl, compile_, model_dir, shape_args, out, env):
    """05 on one rank (plain `python`: one process): (name, tokens/s, 05's own MFU or None, log) from its last
    step line; tokens/s is None if the run failed."""
    name = f"05 {impl} {'compile' if compile_ else 'eager'}"
    log = out / f"{name.replace(' ', '_')}.log"
    cmd = [sys.executable, "05_manual_ddp_gpt2.py", "--model", str(model_dir), "--impl", impl, *shape_args,
           "--sample-tokens", "0", "--eval-every", "0"] + (["--compile"] if compile_ else [])
    print(f"{name}: python {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    code, output = run_logged(cmd, log, env, RUN_TIMEOUT_S)
    print(f"{name}: exit {code} in {time.perf_counter() - t:.0f} s", flush=True)
    steps = [ln for ln in output.splitlines() if ln.startswith("step") and "tok/s" in ln]  # not the val loss lines
    speed = re.search(r"([\d,]+) tok/s", steps[-1]) if steps else None
    if code != 0 or not speed:
        return name, None, None, log
    mfu = re.search(r"MFU ([\d.]+)%", steps[-1])
    return name, float(speed.group(1).replace(",", "")), float(mfu.group(1)) if mfu else None, log


def ceiling(model_dir, device, bf16, batch_size, seq_len, steps, window):
    """The same model with no DDP, compiled whole with its loss (the logits never leave the compiled graph), in a
    plain loop: fused AdamW, clipping, bf16 autocast. Tokens/s over the last `window` steps."""
    # 05's build_model: the model exactly as 05 trains it
    _, model = lesson.build_model(lesson.parse_args(["--model", str(model_dir), "--seq-len", str(seq_len)]))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=lesson.ADAMW_BETAS, weight_decay=lesson.WEIGHT_DECAY,
                            fused=device.type == "cuda")  # 05's settings

    @torch.compile
    def loss_of(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x, use_cache=False).logits
        return lesson.cross_entropy(logits, y)  # 05's loss, traced into the same graph as the model

    torch.manual_seed(0)
    data = torch.randint(0, model.config.vocab_size, (steps, batch_size, seq_len + 1), device=device)
    model.train()
    for step in range(steps):
        if step == steps - window:  # compiling and warm-up are behind: the window starts
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        loss = loss_of(data[step, :, :-1], data[step, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), lesson.CLIP_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    loss.item()  # waits for the GPU
    return window * batch_size * seq_len / (time.perf_counter() - start)


def main(args):
    if not args.tiny and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU here (torch {torch.__version__}), so nothing was run (exit status 2); "
              "--tiny runs the same pipeline on the CPU at a tiny shape")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out / "gpu_check.json"
    device = torch.device("cpu" if args.tiny else "cuda")
    gpu = "cpu" if args.tiny else torch.cuda.get_device_name(device)
    peak = peak_for(gpu, args.peak_tflops)
    # 05's last step line averages the last --log-every steps: 31-40 on a GPU, after compiling and warm-up
    batch_size, seq_len, steps, window = (2, 64, 4, 2) if args.tiny else (16, 1024, 40, 10)
    shape_args = ["--seq-len", str(seq_len), "--batch-size", str(batch_size), "--max-steps", str(steps),
                  "--log-every", str(window), "--precision", "fp32" if args.tiny else "bf16"]
    if args.tiny:
        shape_args += ["--device", "cpu"]
    # 05 gets the same peak, so that its own MFU is checked against this count (--tiny: a nominal peak, for the check)
    peak_05 = 1e-3 if args.tiny else peak
    if peak_05:
        shape_args += ["--peak-tflops", str(peak_05)]
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    failures, started = [], time.perf_counter()
    print(f"gpu_check: {gpu}, torch {torch.__version__}, output in {out}", flush=True)

    if not (args.tiny or args.skip_tier):
        t = time.perf_counter()
        print("1. the GPU tier: python -m pytest -m gpu, with PYTHONFAULTHANDLER=1", flush=True)
        code, _ = run_logged([sys.executable, "-m", "pytest", "-m", "gpu", "-v"], out / "gpu_tier.log", env,
                             TIER_TIMEOUT_S)
        print(f"the GPU tier: exit {code} in {time.perf_counter() - t:.0f} s ({out / 'gpu_tier.log'})", flush=True)
        if code != 0:
            failures.append(f"the GPU tier (exit {code}): {out / 'gpu_tier.log'}")

    t = time.perf_counter()
    model_dir = out / ("gpt2-tiny" if args.tiny else "gpt2-124m")
    size, per_token = save_model(model_dir, TINY if args.tiny else GPT2_124M, seq_len)
    print(f"2. speed: GPT-2 of {size['n_params']:,} parameters ({model_dir}), --seq-len {seq_len} --batch-size "
          f"{batch_size}, tokens/s over steps {steps - window + 1}-{steps}", flush=True)
    measured, compared, agreed = [], 0, 0
    for impl, compile_ in RUNS:
        name, speed, their_mfu, log = run_05(impl, compile_, model_dir, shape_args, out, env)
        measured.append((name, impl, compile_, speed))
        if speed is None:
            failures.append(f"{name}: {log}")
        elif their_mfu is not None:  # the same peak, the same FLOPs count
            ours = speed * per_token / (peak_05 * 1e12) * 100
            compared += 1
            if abs(their_mfu - ours) > 0.06 + 1e-3 * ours:  # 05 prints one decimal, and tokens/s rounded
                failures.append(f"{name}: 05 says MFU {their_mfu}%, this check {ours:.2f}%: the counts differ")
            else:
                agreed += 1
    print("ceiling: the same model, no DDP, compiled whole with its loss, in a plain loop", flush=True)
    t_ceiling = time.perf_counter()
    try:
        speed = ceiling(model_dir, device, not args.tiny, batch_size, seq_len, steps, window)
    except Exception as e:  # the table still shows 05's rows
        speed = None
        failures.append(f"the ceiling: {type(e).__name__}: {e}")
    print(f"ceiling: {time.perf_counter() - t_ceiling:.0f} s", flush=True)
    measured.append(("ceiling: no DDP, compiled whole", "none", True, speed))
    print(f"speed: {time.perf_counter() - t:.0f} s", flush=True)

    rows = [dict(name=name, impl=impl, compile=compile_, world_size=1, tokens_per_s=speed,
                 mfu=speed * per_token / (peak * 1e12) if speed and peak else None, **size, seq_len=seq_len,
                 batch_size=batch_size) for name, impl, compile_, speed in measured]
    report = dict(gpu=gpu, torch=torch.__version__.split("+")[0], peak_tflops=peak, rows=rows)
    json_path.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"JSON: {json_path}; {time.perf_counter() - started:.0f} s in all")
    for failure in failures:
        print(f"FAIL {failure}")
    if failures:
        return 1
    mfu = f"05's own MFU agrees in {agreed} of {compared} runs" if compared else "05's own MFU not compared"
    print(f"OK gpu check: {'the tier not run (--tiny)' if args.tiny else 'the GPU tier passed'}, {len(rows)} rows "
          f"measured, {mfu}" + ("" if peak else ", MFU blank (no peak known)"))
    return 0


def table(report):
    """The report as markdown: tokens/s, MFU and the ratio to the ceiling (the last row), one line a run."""
    rows, peak, first = report["rows"], report["peak_tflops"], report["rows"][0]
    top = rows[-1]["tokens_per_s"]
    mfu = f"MFU against {peak:g} TFLOPS dense bf16" if peak else "MFU blank: no peak known for this GPU (--peak-tflops)"
    lines = [f"\n{report['gpu']}, torch {report['torch']}, GPT-2 of {first['n_params']:,} parameters "
             f"({first['n_layer']} x {first['n_embd']}), --seq-len {first['seq_len']} --batch-size "
             f"{first['batch_size']}, one rank; {mfu}\n",
             "| run | tokens/s | MFU | vs ceiling |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        speed = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "failed"
        share = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else ""
        ratio = f"{r['tokens_per_s'] / top:.2f}" if r["tokens_per_s"] and top else ""
        lines.append(f"| {r['name']} | {speed} | {share} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(parse_args()))
