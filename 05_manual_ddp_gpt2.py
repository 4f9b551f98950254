"""05 - A hand-written DDP (bucketed, overlapped with backward, no_sync) training a Hugging Face GPT-2.

What it teaches: ManualDDP below does what torch.nn.parallel.DistributedDataParallel does, in ~120 lines:
broadcast rank 0's weights at start; pack gradients into buckets in reverse registration order; start each
bucket's all-reduce from a backward hook as soon as its last gradient lands, so communication overlaps the
rest of backward; skip communication inside no_sync() for gradient accumulation. The tests check it equal to
one process on the whole batch and to PyTorch's DDP. The training loop around it is crash-safe: atomic
checkpoints from global rank 0, automatic resume, and survival of killed workers under torchrun --max-restarts.

Run it (the default trains a small GPT-2 offline on Python's own standard library sources):
  1 process:  python 05_manual_ddp_gpt2.py
  CPU:        torchrun --nproc_per_node=2 05_manual_ddp_gpt2.py
  N GPUs:     torchrun --nproc_per_node=N 05_manual_ddp_gpt2.py --model gpt2 --dataset wikitext \\
                  --dataset-config wikitext-2-raw-v1 --precision bf16 --seq-len 512
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 \\
                  05_manual_ddp_gpt2.py --out ckpt
  restarts:   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
                  05_manual_ddp_gpt2.py --out ckpt
  compare:    torchrun --nproc_per_node=2 05_manual_ddp_gpt2.py --impl torch   (or naive)
"""

import argparse
import contextlib
import copy
import functools
import glob
import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

# --- distributed setup (the same block in every script: copied, not imported, so each file runs alone) ---
RANK, WORLD = 0, 1


def print0(*msg):
    """The rank-0 narrative: printed once, not N times."""
    if RANK == 0:
        print(*msg, flush=True)


def log(*msg):
    """A per-rank line, tagged so interleaved output stays readable."""
    print(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)), flush=True)  # one write: no interleaving


def setup(args):
    """Join the process group. Global RANK names the process; LOCAL_RANK picks its GPU on this node."""
    global RANK, WORLD
    RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        sys.exit("error: --device cuda but CUDA is not available")
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(device)  # before init, so NCCL binds this rank to its own GPU
    # A timeout turns a dead peer into an error after --timeout-s instead of a silent 30-minute hang.
    kw = dict(timeout=timedelta(seconds=args.timeout_s), device_id=device if backend == "nccl" else None)
    if "RANK" in os.environ:
        dist.init_process_group(backend, **kw)
    else:  # plain `python`: a group of one, in memory, so the same code path runs without torchrun
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    return device, local_rank


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


# --- the idea: DDP by hand ---
class _Bucket:
    def __init__(self, params):
        self.params = params
        self.numels = [p.numel() for p in params]
        self.flat = torch.zeros(sum(self.numels), dtype=params[0].dtype, device=params[0].device)
        self.views = [v.view_as(p) for v, p in zip(self.flat.split(self.numels), params)]
        self.ready = [False] * len(params)
        self.pending = len(params)  # gradients still to come this backward; 0 = ready to all-reduce
        self.work = None


class ManualDDP(nn.Module):
    """Data parallelism from primitives: after ``loss.backward()`` every ``.grad`` is the mean over ranks."""

    def __init__(self, module, bucket_cap_mb=None, verify=False, naive=False):
        super().__init__()
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module, self.naive, self.world = module, naive, dist.get_world_size()
        state = list(module.parameters()) + list(module.buffers())
        if verify:
            self._check_identical(state)
        else:
            # Replicas must start identical: the same averaged gradient applied to different weights would
            # keep them different forever. Rank 0's values win.
            with torch.no_grad():
                for t in state:
                    dist.broadcast(t, src=0)
        # parameters() yields a shared (tied) tensor once, so GPT-2's embedding/head is reduced once.
        self.params = [p for p in module.parameters() if p.requires_grad]
        # Buckets in REVERSE registration order: backward produces gradients roughly from the last layer to
        # the first, so the first bucket fills first and its all-reduce can start while backward goes on.
        # PyTorch's sizes: by default (None) 25 MiB, but the first bucket only 1 MiB so that communication
        # starts early; an explicit bucket_cap_mb applies to every bucket. A bucket closes once it reaches its
        # cap, so it may exceed it by one tensor (and a tensor larger than the cap gets a bucket of its own).
        caps = [1, 25] if bucket_cap_mb is None else [bucket_cap_mb]
        self.buckets, cur, size = [], [], 0
        for p in reversed(self.params) if not naive else []:  # naive mode reduces .grad itself: no buckets
            if cur and (p.dtype != cur[0].dtype or p.device != cur[0].device):  # one dtype/device per bucket
                self.buckets.append(_Bucket(cur))
                cur, size = [], 0
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= caps[min(len(self.buckets), len(caps) - 1)] * 2**20:
                self.buckets.append(_Bucket(cur))
                cur, size = [], 0
        if cur:
            self.buckets.append(_Bucket(cur))
        self.require_sync, self._queued, self._next = True, False, 0
        # One hook per parameter, bound to its bucket and slot so that it needs no lookup (naive: no buckets).
        slots = [(None, None, p) for p in self.params] if naive else [
            (b, i, p) for b in self.buckets for i, p in enumerate(b.params)]
        for b, i, p in slots:
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, b, i))

    def _check_identical(self, state):
        differs = torch.zeros(1, device=state[0].device)
        for t in state:
            ref = t.detach().clone()
            dist.broadcast(ref, src=0)
            differs += 0 if torch.equal(ref, t.detach()) else 1
        # Agree on the verdict first: if only some ranks raised, the others would wait in the next collective.
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
        if differs.item():
            raise ValueError("ManualDDP(verify=True): model replicas differ across ranks; seed model creation "
                             "identically on every rank (torch.manual_seed before building it)")

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and not self.naive:
            self._grads_into_buckets()
        return self.module(*args, **kwargs)

    def _grads_into_buckets(self):
        """Make every missing .grad a zeroed view of its bucket, so that backward writes straight into it."""
        # Autograd adds a new gradient INTO an existing .grad, in place; only a missing one (None, as after
        # optimizer.zero_grad()) gets a fresh tensor. With .grad already a view of the bucket there is
        # nothing to copy in and nothing to copy back (PyTorch's DDP copies in, then out again by default).
        for b in self.buckets:
            missing = [i for i, p in enumerate(b.params) if p.grad is None]
            if len(missing) == len(b.params):
                b.flat.zero_()  # the usual case: one fill for the whole bucket
            else:  # only some were set to None: keep the gradients the others hold
                for i in missing:
                    b.views[i].zero_()
            for i in missing:
                b.params[i].grad = b.views[i]

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, with no communication; the next synced backward averages the sum."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def _on_grad_ready(self, bucket, i, p):
        """Runs inside backward, right after autograd added p's gradient into p.grad (slot i of bucket)."""
        if not self.require_sync:
            return
        if not self._queued:  # first gradient of this backward: run _finish once the whole backward is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if self.naive:
            return
        if p.grad is not bucket.views[i]:  # rare: backward did not write into the bucket (see _adopt)
            self._adopt(bucket, i)
        bucket.ready[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _adopt(self, bucket, i):
        """Put p's gradient into its bucket slot and make .grad that slot again."""
        # Only when forward did not run through this wrapper, a .grad was replaced (create_graph=True does)
        # or a parameter got no gradient on this rank: then it counts as zero in the mean.
        p, view = bucket.params[i], bucket.views[i]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def _launch_ready(self):
        # Launch strictly in bucket order, on every rank alike: collectives are matched by the order in which
        # ranks issue them, and gradients may arrive in a different order on different ranks.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            # Divide BEFORE the sum: N fp16/bf16 gradients added up could overflow where their mean would not.
            # One multiply per bucket (cheaper than a division); its data was just written, so it is in cache.
            if self.world > 1:
                b.flat.mul_(1 / self.world)
            b.work = dist.all_reduce(b.flat, async_op=True)  # SUM of grad/N = mean; returns at once
            self._next += 1

    def _finish(self):
        """End of backward: flush buckets whose gradients never came (unused parameters), then wait."""
        self._queued = False
        if self.naive:  # the classic tutorial: one blocking all-reduce per parameter, after backward
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)
            return
        for b in self.buckets[self._next:]:
            for i, ready in enumerate(b.ready):
                if not ready:
                    self._adopt(b, i)
                    b.ready[i], b.pending = True, b.pending - 1
        self._launch_ready()
        for b in self.buckets:
            b.work.wait()  # after this, every .grad (a view of its bucket) holds the mean over ranks
            b.ready, b.pending, b.work = [False] * len(b.params), len(b.params), None
        self._next = 0


# --- data: a tokenizer and a corpus that need no download ---
class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 2."""


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + end-of-text): nothing to download, any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def load_texts(args, local_rank):
    """A list of documents, through Hugging Face `datasets`."""
    import datasets
    datasets.disable_progress_bars()
    if args.dataset == "stdlib":  # Python's own standard library: real text present on every machine
        files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[: args.stdlib_files]
    elif os.path.isdir(args.dataset):
        files = sorted(f for f in glob.glob(os.path.join(args.dataset, "**", "*"), recursive=True) if os.path.isfile(f))
    else:
        files = sorted(glob.glob(args.dataset))
    # Local rank 0 of each node builds the datasets cache first; the others then read it instead of racing.
    if local_rank != 0:
        dist.barrier()
    try:
        if files:
            ds = datasets.load_dataset("text", data_files=files, split="train", sample_by="document")
        else:
            ds = datasets.load_dataset(args.dataset, args.dataset_config, split=args.split)
    except Exception as e:  # offline, misspelt, private...: say so in one line on every rank
        raise UsageError(f"--dataset {args.dataset!r}: no local files match, and loading it as a Hugging Face "
                         f"dataset failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:160]})") from None
    finally:
        if local_rank == 0:
            dist.barrier()
    if args.text_column not in ds.column_names:
        raise UsageError(f"--text-column {args.text_column!r} not in the dataset's columns {ds.column_names}")
    return [t for t in ds[args.text_column] if t]


def tokenize(texts, tok):
    """One long stream of token ids, documents separated by end-of-text."""
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids = []
    for row in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(row + eos)
    return torch.tensor(ids, dtype=torch.long)


class Blocks(torch.utils.data.Dataset):
    """Non-overlapping windows of seq_len+1 tokens: inputs are the first seq_len, targets shifted by one."""

    def __init__(self, ids, seq_len):
        self.ids, self.seq_len = ids, seq_len

    def __len__(self):
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i):
        return self.ids[i * self.seq_len : (i + 1) * self.seq_len + 1]


def batches_from(dataset, sampler_epoch_len, args, start_micro):
    """Yield this rank's micro-batches forever from micro-batch ``start_micro`` on, re-shuffling every epoch.

    The position is a plain counter, so a resumed run continues at exactly the batch it stopped at.
    torch's DistributedSampler yields exactly the indices of 04_sampler.py's hand-written one (see its tests).
    """
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    micro = start_micro
    while True:
        epoch, offset = divmod(micro, sampler_epoch_len)
        sampler.set_epoch(epoch)  # a new permutation each epoch, the same one on every rank
        idx = list(sampler)
        for k in range(offset, sampler_epoch_len):
            yield torch.stack([dataset[i] for i in idx[k * args.batch_size : (k + 1) * args.batch_size]])
            micro += 1


# --- model, checkpoints ---
def build_model(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel
    if args.model:
        try:
            tok = AutoTokenizer.from_pretrained(args.model)
            model = AutoModelForCausalLM.from_pretrained(args.model).float()  # fp32 master weights
        except OSError as e:
            raise UsageError(f"cannot load --model {args.model!r}: {str(e).splitlines()[0]}") from None
    else:
        tok = byte_tokenizer()
        # The same seed on every rank gives identical replicas before any broadcast; ManualDDP broadcasts
        # rank 0's weights anyway, and verify=True would check this instead.
        torch.manual_seed(args.seed)
        cfg = GPT2Config(vocab_size=len(tok), n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
                         n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
        model = GPT2LMHeadModel(cfg)
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit and args.seq_len > limit:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's {limit} positions")
    return tok, model


def checkpoints(out):
    """The checkpoint-STEP directories in ``out``, oldest first."""
    names = [d for d in os.listdir(out) if d.startswith("checkpoint-") and d.split("-")[1].isdigit()]
    return sorted(names, key=lambda d: int(d.split("-")[1]))


def newest_checkpoint(out):
    """Global rank 0 picks the newest complete checkpoint and tells everyone, so all ranks load the same one."""
    choice = [None]
    if RANK == 0 and out and os.path.isdir(out):
        done = [d for d in checkpoints(out) if os.path.isfile(os.path.join(out, d, "state.pt"))]
        if done:
            choice[0] = os.path.join(out, done[-1], "state.pt")
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def save_checkpoint(out, step, state, keep):
    """Global rank 0 only (all replicas are identical, and N writers to one path would corrupt it).

    Written into a temporary directory, fsynced, then renamed: a crash mid-write leaves the previous
    checkpoint intact and never a half-written one under a checkpoint-STEP name.
    """
    final, tmp = os.path.join(out, f"checkpoint-{step}"), os.path.join(out, f".tmp-checkpoint-{step}")
    if os.path.exists(final):
        return
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "state.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    # Prune: the newest `keep` checkpoints stay, and so does nothing a crash may have left half-written.
    for d in checkpoints(out)[:-keep] + [d for d in os.listdir(out) if d.startswith(".tmp-checkpoint-")]:
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)


def lr_factor(step, args):
    """Linear warm-up, then cosine decay to 10% of --lr."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def wrap(model, impl, args, device):
    if impl == "torch":  # PyTorch's own, for comparison: same bucket size, no unused-parameter search
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb)
    return ManualDDP(model, bucket_cap_mb=args.bucket_cap_mb, naive=impl == "naive")


# --- training ---
def train(args, device, local_rank):
    from tqdm import tqdm
    tok, model = build_model(args)
    ids = tokenize(load_texts(args, local_rank), tok)
    data = Blocks(ids, args.seq_len)
    per_epoch = (len(data) // WORLD) // args.batch_size  # micro-batches per rank per epoch
    if per_epoch < 1:
        raise UsageError(f"the dataset has {len(ids):,} tokens: too few for {WORLD} ranks x --batch-size "
                         f"{args.batch_size} x --seq-len {args.seq_len}")
    print0(f"data: {len(ids):,} tokens, {len(data):,} blocks of {args.seq_len}, {per_epoch} micro-batches "
           f"per rank per epoch | model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    model.to(device)
    ckpt_path = newest_checkpoint(args.out)
    ckpt = torch.load(ckpt_path, map_location=device) if ckpt_path else None  # every rank reads the same file
    if ckpt:
        model.load_state_dict(ckpt["model"])
    ddp = wrap(model, args.impl, args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # fp16 needs loss scaling
    start = 0
    if ckpt:
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start = ckpt["step"]
        if ckpt["world_size"] != WORLD:
            print0(f"warning: checkpoint was written by {ckpt['world_size']} ranks, now {WORLD}: the data order differs")
        print0(f"resumed from {ckpt_path} at step {start}")
    del ckpt
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    autocast = lambda: torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)  # noqa: E731
    batches = batches_from(data, per_epoch, args, start_micro=start * args.grad_accum)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * WORLD
    bar = tqdm(total=args.max_steps, initial=start, disable=RANK != 0 or not sys.stderr.isatty(), unit="step")
    say = tqdm.write if not bar.disable else print0  # print above the bar, not through it
    profiler = contextlib.ExitStack()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        prof = profiler.enter_context(torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(args.profile, f"trace_rank{RANK}.json"))))
    losses, first_loss, last_loss, t_log = [], None, None, time.perf_counter()
    model.train()
    with profiler:
        for step in range(start, args.max_steps):
            if step == args.crash_at_step and RANK == WORLD - 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                log(f"--crash-at-step {step}: SIGKILL to myself (first attempt only)")
                os.kill(os.getpid(), signal.SIGKILL)
            # Dropout (if the model has any) should differ across ranks like the data does, and a resumed run
            # must replay the same masks: so seed from (seed, step, rank) instead of saving RNG states.
            torch.manual_seed(args.seed + 7919 * step + RANK)
            step_loss = torch.zeros((), device=device)
            for micro in range(args.grad_accum):
                batch = next(batches).to(device, non_blocking=True)
                # Accumulate locally on all but the last micro-batch: one all-reduce per optimizer step.
                sync = contextlib.nullcontext() if micro == args.grad_accum - 1 else ddp.no_sync()
                with sync:
                    with autocast():
                        logits = ddp(input_ids=batch[:, :-1]).logits
                    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
                    scaler.scale(loss / args.grad_accum).backward()
                step_loss += loss.detach() / args.grad_accum
            # Here every .grad already holds the mean over ranks, so clipping sees the global gradient and
            # every rank clips by the same factor. Under fp16 the gradients must be unscaled first.
            if args.max_grad_norm > 0:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(step_loss)
            if args.profile:
                prof.step()
            bar.update(1)
            if args.out and (step + 1) % args.ckpt_every == 0:
                if RANK == 0:
                    save_checkpoint(args.out, step + 1, {
                        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "scaler": scaler.state_dict(), "step": step + 1, "world_size": WORLD,
                        "micro_batches_per_rank": (step + 1) * args.grad_accum}, args.keep_checkpoints)
                    say(f"saved {args.out}/checkpoint-{step + 1}")
            if (step + 1) % args.log_every == 0 or step in (start, args.max_steps - 1):
                # Loss of all ranks, not rank 0's alone: SUM of per-rank means, divided by N.
                mean = torch.stack(losses).mean()
                dist.all_reduce(mean)
                last_loss = mean.item() / WORLD
                first_loss = last_loss if first_loss is None else first_loss
                dt = (time.perf_counter() - t_log) / len(losses)
                line = (f"step {step + 1:>5}/{args.max_steps} | loss {last_loss:7.4f} | lr {sched.get_last_lr()[0]:.2e} "
                        f"| {dt * 1e3:7.1f} ms/step | {tokens_per_step / dt:9,.0f} tok/s")
                say(line)
                losses, t_log = [], time.perf_counter()
    bar.close()
    return tok, model, first_loss, last_loss


def finish(args, tok, model, device, first_loss, last_loss):
    # Identical gradients on identical weights keep the replicas identical: check it, bit for bit.
    flat = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor([float(torch.equal(ref, flat))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if args.out and RANK == 0:  # global rank 0 only: one writer
        model.save_pretrained(args.out)
        tok.save_pretrained(args.out)
        print0(f"saved model and tokenizer to {args.out} (AutoModelForCausalLM.from_pretrained loads it)")
    if RANK == 0 and args.sample_tokens > 0:
        model.eval()
        torch.manual_seed(args.seed)
        prompt = tok(args.prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=args.sample_tokens, do_sample=True, top_k=20, temperature=0.8,
                                 pad_token_id=tok.eos_token_id)
        print0("sample:\n" + tok.decode(out[0], skip_special_tokens=True) + "\n")
    if not same.item():
        raise RuntimeError("replicas diverged: weights differ across ranks")
    if first_loss is not None:
        trend = "fell" if last_loss < first_loss else "did NOT fall"
        print0(f"OK {args.impl} DDP on {WORLD} rank(s): replicas identical; loss {trend} {first_loss:.4f} -> {last_loss:.4f}")
    else:
        print0(f"OK {args.impl} DDP on {WORLD} rank(s): nothing left to train (resumed at --max-steps)")


# --- benchmark: the same model and data through each implementation, interleaved ---
def _peak_mb(fn, device):
    """Peak memory (MiB) that fn() adds: the most bytes its tensors held at any one time."""
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    # On CPU there are no allocator statistics, and the resident set cannot tell (glibc reuses freed memory and
    # keeps fragments: +-10 MiB between identical runs). The profiler records every tensor allocation and free
    # with the running total of bytes allocated; its highest point above where it started is the peak, exactly.
    from torch._C._profiler import _EventType
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # keep the profiler's start/stop notes out of the output
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo += node.children
        if node.tag == _EventType.Allocation:  # alloc_size > 0 for an allocation, < 0 for a free
            events.append((node.start_time_ns, node.extra_fields.total_allocated, node.extra_fields.alloc_size))
    if not events:
        return 0.0
    events.sort()
    start = events[0][1] - events[0][2]  # the running total just before fn's first allocation
    return (max(total for _, total, _ in events) - start) / 2**20


def quartiles(xs):
    """(p25, median, p75) of a list of timings or ratios."""
    return statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3


def benchmark(args, device, local_rank):
    tok, base = build_model(args)
    data = Blocks(tokenize(load_texts(args, local_rank), tok), args.seq_len)
    feed = batches_from(data, (len(data) // WORLD) // args.batch_size, args, 0)
    batches = [next(feed).to(device) for _ in range(4)]
    base.to(device)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    impls = ["manual", "naive", "torch", "none"]  # none: no DDP at all, each rank alone (no communication)

    def make(impl):
        model = copy.deepcopy(base)
        wrapped = model if impl == "none" else wrap(model, impl, args, device)
        return wrapped, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(wrapped, opt, batch, probe=None):
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = wrapped(input_ids=batch[:, :-1]).logits
        nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
        if probe:
            probe(wrapped, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def grad_buffers(wrapped, opt):
        """MiB of gradients plus communication buckets alive when the optimizer steps (distinct storages)."""
        live = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for group in opt.param_groups for p in group["params"] if p.grad is not None}
        live.update({b.flat.untyped_storage().data_ptr(): b.flat.untyped_storage().nbytes()
                     for b in getattr(wrapped, "buckets", [])})
        held = sum(live.values())
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):  # its buckets live in C++: ask it
            held += sum(int(b) for b in str(wrapped._get_ddp_logging_data()["bucket_sizes"]).split(",") if b)
        return held / 2**20

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # Time first, interleaved: noise hits all alike. The order changes every round (A B D C, B C A D, C D B A,
    # D A C B: a Williams square), so each runs first once in four rounds and follows each of the others once;
    # with a plain rotation A always followed D, whose leftovers (caches, gloo threads) could favour or
    # handicap A every time. Warm-up rounds are untimed.
    runs = {impl: make(impl) for impl in impls}
    # The same layout as PyTorch's DDP for the same bucket_cap_mb (tests/workers/ddp_worker.py checks it).
    bucket_mb = [b.flat.numel() * b.flat.element_size() / 2**20 for b in runs["manual"][0].buckets]
    times = {impl: [] for impl in impls}
    for i in range(args.bench_warmup + args.bench_steps):
        for impl in [impls[(j + i) % 4] for j in (0, 1, 3, 2)]:
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            step(*runs[impl], batches[i % len(batches)])
            sync()
            if i >= args.bench_warmup:
                times[impl].append(time.perf_counter() - t0)
    del runs
    # Then memory, one implementation at a time: what wrapping + optimizer + two steps add to the bare model,
    # and the gradient + bucket bytes alive at the optimizer step (exact: distinct storages).
    peak, buffers = {}, {}
    for k, impl in enumerate(["none"] + impls):
        def two_steps():
            wrapped, opt = make(impl)  # one model for both steps
            for b in batches[:2]:
                step(wrapped, opt, b, lambda w, o: buffers.__setitem__(impl, grad_buffers(w, o)))
        mb = _peak_mb(two_steps, device)
        if k:  # the very first measurement also pays one-time costs (thread pools, caches): discarded
            peak[impl] = mb
        dist.barrier()
    t = torch.tensor([times[i] for i in impls], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    t = dict(zip(impls, t.tolist()))
    res = {}
    for impl in impls:
        q1, med, q3 = quartiles(t[impl])
        # Ratios are taken per round (all four steps of a round ran within a second) and then the median over
        # rounds: a slow spell of the machine slows every step of its round and cancels out of the ratio.
        r1, ratio, r3 = quartiles([a / b for a, b in zip(t[impl], t["torch"])])
        res[impl] = {"step_ms": med * 1e3, "step_ms_p25": q1 * 1e3, "step_ms_p75": q3 * 1e3,
                     "ratio_to_torch": ratio, "ratio_to_torch_p25": r1, "ratio_to_torch_p75": r3,
                     # none does the same per-rank work without communicating
                     "scaling_efficiency": quartiles([a / b for a, b in zip(t["none"], t[impl])])[1],
                     "peak_mem_mb": peak[impl], "grad_buffers_mb": buffers[impl]}
    n_params = sum(p.numel() for p in base.parameters())
    print0(f"\nDDP step time, {WORLD} ranks, {dist.get_backend()}, {n_params / 1e6:.2f}M parameters, batch "
           f"{args.batch_size}x{args.seq_len} per rank, buckets of {' + '.join(f'{b:.2f}' for b in bucket_mb)} MiB "
           f"(bucket_cap_mb={args.bucket_cap_mb}), torch {torch.__version__}; "
           f"median of {args.bench_steps} interleaved steps (max over ranks)")
    print0("| impl | step ms (p25-p75) | vs torch DDP (p25-p75) | scaling efficiency | peak memory MiB | grads + buckets MiB |")
    print0("|---|---:|---:|---:|---:|---:|")
    for impl, r in res.items():
        print0(f"| {impl:<6} | {r['step_ms']:7.1f} ({r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f}) | "
               f"{r['ratio_to_torch']:5.2f} ({r['ratio_to_torch_p25']:.2f}-{r['ratio_to_torch_p75']:.2f}) | "
               f"{r['scaling_efficiency']:5.2f} | {r['peak_mem_mb']:7.1f} | "
               f"{r['grad_buffers_mb']:6.2f} |")
    if RANK == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": WORLD, "backend": dist.get_backend(), "device": device.type,
                       "torch": torch.__version__, "parameters": n_params, "bucket_cap_mb": args.bucket_cap_mb,
                       "buckets_mb": bucket_mb, "impls": res}, f, indent=1)
        print0(f"wrote {args.json}")
    if RANK == 0 and args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        med = [res[i]["step_ms"] for i in impls]
        err = [[m - res[i]["step_ms_p25"] for m, i in zip(med, impls)], [res[i]["step_ms_p75"] - m for m, i in zip(med, impls)]]
        ax.bar(impls, med, yerr=err, capsize=4, color=["tab:green", "tab:red", "tab:blue", "tab:gray"])
        ax.set(ylabel="step time (ms), median and p25-p75", title=f"GPT-2 step, {WORLD} ranks, {dist.get_backend()}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print0(f"wrote {args.plot}")
    print0(f"OK benchmark: manual/torch = {res['manual']['ratio_to_torch']:.2f}, naive/torch = {res['naive']['ratio_to_torch']:.2f}")


def main(args):
    device, local_rank = setup(args)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} impl={args.impl} "
           f"precision={args.precision} torch={torch.__version__}")
    import transformers
    transformers.logging.set_verbosity_error()  # long documents trigger a harmless length warning
    transformers.utils.logging.disable_progress_bar()
    if args.benchmark:
        benchmark(args, device, local_rank)
    else:
        tok, model, first, last = train(args, device, local_rank)
        finish(args, tok, model, device, first, last)
    # Leave together: rank 0 still writes files while the others would already be tearing down their
    # connections (one such benchmark run ended with a SIGABRT in a rank's shutdown).
    dist.barrier()
    teardown()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="HF causal LM name or local dir; default: a small GPT-2 from scratch")
    g.add_argument("--n-layer", type=int, default=4, help="default model only")
    g.add_argument("--n-embd", type=int, default=128, help="default model only")
    g.add_argument("--n-head", type=int, default=4, help="default model only")
    g.add_argument("--dataset", default="stdlib", help="'stdlib' (Python's sources), local files/dir/glob, or a HF dataset name")
    g.add_argument("--dataset-config", default=None, help="HF dataset config, e.g. wikitext-2-raw-v1")
    g.add_argument("--split", default="train", help="HF dataset split")
    g.add_argument("--text-column", default="text", help="column holding the text")
    g.add_argument("--stdlib-files", type=int, default=40, help="how many stdlib .py files --dataset stdlib reads")
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (no_sync between)")
    g.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    g.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    g.add_argument("--warmup-steps", type=int, default=30, help="linear warm-up steps before cosine decay")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the synced gradient norm (0: off)")
    g.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="autocast dtype")
    g.add_argument("--seed", type=int, default=0, help="model init (same on all ranks) and data order")
    g = p.add_argument_group("DDP")
    g.add_argument("--impl", choices=["manual", "naive", "torch"], default="manual", help="whose DDP")
    g.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="gradient bucket size (default: PyTorch's, 25 MiB with a 1 MiB first bucket)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if available")
    g.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl on cuda, gloo on cpu")
    g.add_argument("--timeout-s", type=float, default=300, help="process-group timeout: a dead peer fails, not hangs")
    g = p.add_argument_group("checkpoints, output")
    g.add_argument("--out", default=None, help="checkpoint dir: resume from it, save to it, final save_pretrained")
    g.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept")
    g.add_argument("--log-every", type=int, default=25, help="steps between loss lines")
    g.add_argument("--profile", default=None, help="write a torch.profiler trace of steps 3-5 per rank here")
    g.add_argument("--prompt", default="def ", help="start of the generated sample")
    g.add_argument("--sample-tokens", type=int, default=120, help="tokens generated at the end (0: none)")
    g = p.add_argument_group("benchmark")
    g.add_argument("--benchmark", action="store_true", help="time manual, naive, torch DDP and no DDP side by side")
    g.add_argument("--bench-steps", type=int, default=60, help="timed steps per implementation")
    g.add_argument("--bench-warmup", type=int, default=3, help="untimed steps per implementation first")
    g.add_argument("--json", default=None, help="with --benchmark: write the results here")
    g.add_argument("--plot", default=None, help="with --benchmark: write a PNG of step times here")
    g.add_argument("--crash-at-step", type=int, default=-1, help="demo: SIGKILL the last rank at this step, first attempt only")
    args = p.parse_args(argv)
    for name in ("batch_size", "grad_accum", "seq_len", "max_steps", "ckpt_every", "keep_checkpoints", "log_every",
                 "n_layer", "n_embd", "n_head", "stdlib_files", "bench_steps", "bench_warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    bad_cap = args.bucket_cap_mb is not None and args.bucket_cap_mb <= 0
    if bad_cap or args.lr <= 0 or args.timeout_s <= 0 or args.warmup_steps < 0:
        p.error("--bucket-cap-mb, --lr and --timeout-s must be > 0, --warmup-steps >= 0")
    if args.n_embd % args.n_head:
        p.error("--n-embd must be divisible by --n-head")
    return args


if __name__ == "__main__":
    cli = parse_args()
    try:
        main(cli)
    except UsageError as e:
        print0(f"error: {e}")
        teardown()
        sys.exit(2)
    except (dist.DistError, RuntimeError) as e:  # a peer died or timed out: one line, not N tracebacks
        if not isinstance(e, dist.DistError) and not any(k in str(e) for k in ("Connection", "gloo", "NCCL", "imed out")):
            raise
        log(f"error: lost a peer ({str(e).strip().splitlines()[0][:200]}); with --out and torchrun "
            f"--max-restarts the job resumes from the newest checkpoint")
        sys.exit(1)
