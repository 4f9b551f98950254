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
import functools
import glob
import math
import os
import shutil
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

# --- distributed setup: the same block in every numbered script, copied (not imported) so each file runs alone ---
RANK, WORLD = 0, 1


class UsageError(Exception):
    """Bad input: one line on rank 0 (`error: ...`), exit status 2, no traceback."""


def print0(*msg):
    """The rank-0 narrative: printed once, not N times."""
    if RANK == 0:
        print(*msg, flush=True)


def log(*msg):
    """A per-rank line, tagged so interleaved output stays readable."""
    print(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)), flush=True)


def parser(doc, timeout_s=120):
    """argparse with the flags every script shares; a bad flag is one line on rank 0, not a usage text per rank."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def error(message):
        raise UsageError(message)
    p.error = error
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if GPUs >= ranks")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl if every rank has a GPU")
    p.add_argument("--timeout-s", type=float, default=timeout_s, help="how long a rank waits for a dead or stuck peer")
    return p


def choose_device(device, backend, n_gpus, local_rank, local_world):
    """(device, backend, note) for this rank, from the flags and this node's GPUs, before any process group.
    NCCL needs a GPU of its own for every rank; gloo runs on the CPU and can also share GPUs between ranks."""
    if device == "cpu" or (device == "auto" and n_gpus == 0):
        if backend == "nccl":
            raise UsageError("--backend nccl runs on CUDA GPUs only: use gloo on the CPU")
        return torch.device("cpu"), "gloo", None
    if n_gpus == 0:
        raise UsageError("--device cuda, but this node has no CUDA GPU: use --device cpu")
    if n_gpus >= local_world:  # the usual GPU setup: local rank r takes cuda:r
        return torch.device("cuda", local_rank), backend or "nccl", None
    fix = f"start --nproc_per_node={n_gpus}, or share the GPU(s) over gloo with --device cuda --backend gloo"
    if backend == "nccl":  # NCCL refuses two ranks on one GPU
        raise UsageError(f"nccl needs one GPU per rank, but this node has {n_gpus} for {local_world} ranks: {fix}")
    if device == "auto":
        return torch.device("cpu"), "gloo", f"{n_gpus} GPU(s) for {local_world} ranks here, so CPU and gloo; {fix}"
    return torch.device("cuda", local_rank % n_gpus), "gloo", f"{local_world} ranks share {n_gpus} GPU(s) over gloo"


def setup(args, min_world=2):
    """Choose the device, then join the process group. Global RANK names a process; LOCAL_RANK picks its GPU."""
    global RANK, WORLD
    if "RANK" not in os.environ and min_world > 1:
        raise UsageError(f"launch with torchrun, e.g. torchrun --nproc_per_node={min_world} {sys.argv[0]}")
    RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if WORLD < min_world:
        raise UsageError(f"needs at least {min_world} ranks, got WORLD_SIZE={WORLD} (use --nproc_per_node={min_world})")
    if args.timeout_s <= 0:
        raise UsageError(f"--timeout-s must be > 0, got {args.timeout_s}")
    n_gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never touches CUDA
    device, backend, note = choose_device(args.device, args.backend, n_gpus, int(os.environ.get("LOCAL_RANK", 0)),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if note:
        print0(f"note: {note}")
    if device.type == "cuda":  # before init, so NCCL binds this rank to its GPU (not device_id=: pytorch#153960)
        torch.cuda.set_device(device)
    # A timeout turns a dead peer into an error after --timeout-s instead of a silent 30-minute hang.
    kw = dict(backend=backend, timeout=timedelta(seconds=args.timeout_s))
    if "RANK" not in os.environ:  # plain `python`: a group of one, in memory, so the same code runs
        kw.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(**kw)
    return device


def run(main, parse_args):
    """Bad input: one line on rank 0, exit 2. A peer that died or timed out: one line per survivor, exit 1."""
    code = 0
    try:
        main(parse_args())
    except UsageError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank stops alike; one says why
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except RuntimeError as e:  # NCCL raises DistError; gloo, RuntimeErrors from torch.distributed or its transport
        where, text = traceback.extract_tb(e.__traceback__)[-1].filename, str(e)
        if not (isinstance(e, dist.DistError) or f"torch{os.sep}distributed" in where or "gloo/" in text):
            raise  # a bug in this rank's own code keeps its traceback
        log(f"error: lost a peer ({text.strip().splitlines()[0][:160]})")
        os._exit(1)  # no teardown: it would wait for the dead peer
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)


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
            print0(f"warning: checkpoint written by {ckpt['world_size']} ranks, now {WORLD}: the data order differs")
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
            first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if step == args.crash_at_step and RANK == WORLD - 1 and first_attempt:
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
                line = (f"step {step + 1:>5}/{args.max_steps} | loss {last_loss:7.4f} "
                        f"| lr {sched.get_last_lr()[0]:.2e} | {dt * 1e3:7.1f} ms/step "
                        f"| {tokens_per_step / dt:9,.0f} tok/s")
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
        print0(f"OK {args.impl} DDP on {WORLD} rank(s): replicas identical; "
               f"loss {trend} {first_loss:.4f} -> {last_loss:.4f}")
    else:
        print0(f"OK {args.impl} DDP on {WORLD} rank(s): nothing left to train (resumed at --max-steps)")


def main(args):
    device = setup(args, min_world=1)
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} impl={args.impl} "
           f"precision={args.precision} torch={torch.__version__}")
    import transformers
    transformers.logging.set_verbosity_error()  # long documents trigger a harmless length warning
    transformers.utils.logging.disable_progress_bar()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    tok, model, first, last = train(args, device, local_rank)
    finish(args, tok, model, device, first, last)


def parse_args(argv=None):
    p = parser(__doc__, timeout_s=300)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="HF causal LM name or local dir; default: a small GPT-2 from scratch")
    g.add_argument("--n-layer", type=int, default=4, help="default model only")
    g.add_argument("--n-embd", type=int, default=128, help="default model only")
    g.add_argument("--n-head", type=int, default=4, help="default model only")
    g.add_argument("--dataset", default="stdlib",
                   help="'stdlib' (Python's sources), local files/dir/glob, or a HF dataset name")
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
    g = p.add_argument_group("checkpoints, output")
    g.add_argument("--out", default=None, help="checkpoint dir: resume from it, save to it, final save_pretrained")
    g.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept")
    g.add_argument("--log-every", type=int, default=25, help="steps between loss lines")
    g.add_argument("--profile", default=None, help="write a torch.profiler trace of steps 3-5 per rank here")
    g.add_argument("--prompt", default="def ", help="start of the generated sample")
    g.add_argument("--sample-tokens", type=int, default=120, help="tokens generated at the end (0: none)")
    g.add_argument("--crash-at-step", type=int, default=-1,
                   help="demo: SIGKILL the last rank at this step, first attempt only")
    args = p.parse_args(argv)
    for name in ("batch_size", "grad_accum", "seq_len", "max_steps", "ckpt_every", "keep_checkpoints", "log_every",
                 "n_layer", "n_embd", "n_head", "stdlib_files"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    bad_cap = args.bucket_cap_mb is not None and args.bucket_cap_mb <= 0
    if bad_cap or args.lr <= 0 or args.warmup_steps < 0:
        p.error("--bucket-cap-mb and --lr must be > 0, --warmup-steps >= 0")
    if args.n_embd % args.n_head:
        p.error("--n-embd must be divisible by --n-head")
    return args


if __name__ == "__main__":
    run(main, parse_args)
