"""05 - DDP by hand: the naive all-reduce, then DDPCore (PyTorch's DDP, bit for bit), training a small GPT-2.

What it teaches, in reading order: average_gradients, the tutorial's version, and why it is slow; then DDPCore, what
torch.nn.parallel.DistributedDataParallel does, bit for bit, in the order a step runs; then a train.py as nanoGPT's
for any Hugging Face causal LM (--impl naive or torch trains with those): a held-out loss, MFU on a GPU, and
checkpoints that resume bit for bit. ddp_dropin.py builds ManualDDP, the drop-in for PyTorch's DDP, on DDPCore.

  CPU:     torchrun --nproc_per_node=4 05_manual_ddp_gpt2.py    (a 0.84M-parameter GPT-2 on Python's own sources)
  N GPUs:  torchrun --nproc_per_node=N 05_manual_ddp_gpt2.py --model gpt2 --dataset wikitext:wikitext-2-raw-v1 \\
               --seq-len 512 --compile
  2 nodes: torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 \\
               05_manual_ddp_gpt2.py --out ckpt      (ckpt on a disk both nodes see; restarts: docs/checkpoints.md)
"""

import argparse
import contextlib
import functools
import glob
import itertools
import math
import os
import pathlib
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

# --- settings beyond the flags ---
ADAMW_BETAS, WEIGHT_DECAY, CLIP_NORM = (0.9, 0.95), 0.1, 1.0  # GPT-3's, as nanoGPT's (PyTorch's betas: 0.9, 0.999)
LR_FLOOR = 0.1  # the cosine schedule ends at this fraction of --lr
SEED_STRIDE = 7919  # dropout seed = seed + stride * step + rank: one per (step, rank) below 7919 ranks
VAL_PART, VAL_BATCHES = 10, 8  # the corpus's last 1/10 is held out; each rank evaluates <= 8 batches of it
PEAK_TFLOPS = {"H100": 989, "H200": 989, "A100": 312}  # dense bf16 of SXM parts, for MFU (others: --peak-tflops)


# --- the idea, naive: what a tutorial writes ---
def average_gradients(model, world):
    """--impl naive. After backward, all ranks add up each gradient and divide by their number: every replica then
    takes the same step, so replicas that start identical stay identical. (SUM, then divide: gloo has no AVG.)"""
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:  # no gradient on this rank: it adds zero, but every rank must join each all-reduce
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(world)


# Why it is slow: one message per tensor (52 here, 148 for GPT-2 124M), each paying the network's fixed latency, and
# none before backward has ended: communication adds to the step. DDPCore sends a few large buckets instead, each one
# from inside backward as soon as it is full, while backward computes the layers before it.

# --- the idea, as PyTorch's DDP does it ---
class DDPCore(nn.Module):
    """DistributedDataParallel's idea: after loss.backward(), every .grad holds the mean of all ranks' gradients, and
    the all-reduces that made it ran while backward was still computing the rest. Every parameter that requires a
    gradient must get one in each synced backward, on ranks that run as many steps (ddp_dropin.ManualDDP lifts both)."""

    def __init__(self, module, process_group=None, bucket_cap_mb=None, broadcast_buffers=True):
        super().__init__()
        self.module, self.broadcast_buffers = module, broadcast_buffers
        self.process_group = process_group or dist.group.WORLD
        self.world = dist.get_world_size(self.process_group)
        self.require_backward_grad_sync = True  # False inside no_sync(): backward then stays local
        self.require_forward_param_sync = True  # broadcast the buffers before the next forward
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.device = next(module.parameters()).device  # for the rebuild's broadcast (NCCL: a CUDA tensor)
        # Replicas must start identical: the same mean gradient applied to different weights would keep them
        # different forever. So rank 0's parameters win (frozen ones too: they shape the output), and its buffers
        # (BatchNorm's running statistics) if buffers are synced.
        buffers = list(module.buffers()) if broadcast_buffers else []
        broadcast_coalesced(list(module.parameters()) + buffers, 0, self.process_group)
        # Buckets, DDP's way: the first backward runs with ONE bucket per dtype, the last parameters' first (gradients
        # arrive roughly back to front), a guess. That backward shows the real order, and the buckets are cut again
        # in it, once, before the next forward (_maybe_rebuild), with DDP's sizes: 25 MiB, the first 1 MiB so that
        # its all-reduce starts early in backward ("experiments showed 1MB is a reasonable value": DDP).
        self._caps = [1 << 20, 25 << 20] if bucket_cap_mb is None else [int(bucket_cap_mb * (1 << 20))]
        self._set_buckets(sorted(bucket_layout(self.params, range(len(self.params)), [math.inf]), key=min,
                                 reverse=True))
        self._rebuilt, self._order = False, []  # _order: parameter indices as the first backward made them ready
        self._next, self._queued = 0, False  # the next bucket to launch; _finish queued for this backward
        me = weakref.ref(self)  # the hooks must not keep a dropped wrapper alive, answering every backward

        def hook(i, p):
            core = me()
            if core is not None:
                core._on_grad_ready(i, p)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(hook, i))

    # -- one step, in the order it runs: forward, a hook per gradient, the end of backward --
    def forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled():
            if self.require_backward_grad_sync:  # never inside no_sync(): accumulating costs no communication
                self._maybe_rebuild()
            self._grads_into_buckets()
        if self.require_forward_param_sync and self.broadcast_buffers:  # rank 0's BatchNorm statistics, say
            broadcast_coalesced(list(self.module.buffers()), 0, self.process_group)
        output = self.module(*inputs, **kwargs)
        # Buffers are broadcast before the forward that follows a synced one (as DDP: not after no_sync forwards).
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        return output

    def _grads_into_buckets(self):
        """A missing .grad becomes its zeroed bucket slot: autograd then adds the gradient into the bucket itself."""
        for b in self.buckets:
            missing = [slot for slot, p in enumerate(b.params) if p.grad is None]
            if len(missing) == len(b.params):
                b.flat.zero_()  # the usual case: one fill for the whole bucket
            else:  # only some are None: keep what the others hold
                for slot in missing:
                    b.views[slot].zero_()
            for slot in missing:
                b.params[slot].grad = b.views[slot]

    def _on_grad_ready(self, i, p):
        """Runs inside backward, right after autograd added parameter i's gradient into p.grad."""
        if not self.require_backward_grad_sync:
            return  # accumulating locally: no communication at all
        if not self._queued:  # the first gradient of this backward: have _finish run once backward is done
            self._queued = True
            # The autograd engine's queue_callback is a private API; PyTorch's own DDP relies on it too.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if not self._rebuilt:
            self._order.append(i)  # the order in which backward really produces gradients
        bucket, slot = self._where[i]
        if p.grad.data_ptr() != bucket.views[slot].data_ptr():  # a new .grad (create_graph=True, or it was None)
            bucket.views[slot].copy_(p.grad)
            p.grad = bucket.views[slot]
        bucket.pending -= 1
        # Launch strictly in bucket order, on every rank alike: collectives are matched by the order in which ranks
        # issue them, and gradients may become ready in a different order on different ranks.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b):
        # Divide BEFORE the sum, as DDP does: N fp16 gradients added up could overflow where their mean would not.
        # A multiply by 1/N, as DDP's, for the same bits.
        b.flat.mul_(1 / self.world)
        b.work = dist.all_reduce(b.flat, group=self.process_group, async_op=True)  # returns at once: backward goes on

    def _finish(self):
        """End of backward: wait for every bucket's all-reduce. Then each .grad (a view of a bucket) is the mean."""
        self._queued = False
        if self._next < len(self.buckets):  # a bucket that never filled never left: the ranks would drift apart
            names = [self.names[i] for b in self.buckets[self._next:] for i in b.indices]
            raise RuntimeError(f"DDPCore: a parameter got no gradient in this backward (one of {names[:5]}); "
                               "ddp_dropin.ManualDDP(model, find_unused_parameters=True) takes such models")
        for b in self.buckets:
            b.work.wait()  # NCCL: the current CUDA stream waits, not the CPU
            b.pending = len(b.params)  # counted down again by the next backward
        self._next = 0

    # -- before the second forward: the buckets, cut again once in the order gradients really arrived --
    def _maybe_rebuild(self):
        if self._rebuilt or not self._order:
            return
        # The observed order, each parameter once, then any that never became ready, in parameter order. Every
        # rank takes the group's first rank's order: the buckets must be the same everywhere.
        order = torch.tensor(list(dict.fromkeys(self._order + list(range(len(self.params))))), device=self.device)
        dist.broadcast(order, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        self._set_buckets(bucket_layout(self.params, order.tolist(), self._caps))
        self._rebuilt = True

    def _set_buckets(self, layout):
        grads = [p.grad for p in self.params]
        self.buckets = [Bucket([self.params[i] for i in idx], list(idx)) for idx in layout]
        self._where = [None] * len(self.params)  # parameter index -> (its bucket, its slot there)
        for b in self.buckets:
            for slot, i in enumerate(b.indices):
                self._where[i] = (b, slot)
                if grads[i] is not None:  # gradients accumulated so far (no_sync) move into the new buckets
                    b.views[slot].copy_(grads[i])
                    self.params[i].grad = b.views[slot]

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulation: backward adds into .grad locally; the first backward after the block averages the sum."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before


class Bucket:
    """Several parameters' gradients in one flat tensor, each .grad a view of its slot: one all-reduce, no copies."""

    def __init__(self, params, indices):
        self.params, self.indices = params, indices  # indices: where these parameters sit in DDPCore.params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offsets = itertools.accumulate([p.numel() for p in params], initial=0)
        self.views = [self.flat[o:o + p.numel()].view_as(p) for o, p in zip(offsets, params)]
        self.pending = len(params)  # gradients this backward has still to produce
        self.work = None  # the last all-reduce: kept after its wait (if gloo's thread freed it at exit: SIGABRT)


def bucket_layout(params, order, caps):
    """Cut parameters (taken in `order`) into buckets as DDP does: a running bucket per dtype and device is closed
    once it holds caps[0] bytes; later buckets of that kind use the next cap in the list (the last one repeats)."""
    running, done = {}, []
    for i in order:
        kind = (params[i].dtype, params[i].device)  # one flat tensor holds one dtype on one device
        indices, size, k = running.get(kind, ([], 0, 0))
        indices.append(i)
        size += params[i].numel() * params[i].element_size()
        running[kind] = (indices, size, k)
        if size >= caps[min(k, len(caps) - 1)]:
            done.append(indices)
            running[kind] = ([], 0, k + 1)
    return done + [indices for indices, _, _ in running.values() if indices]


def broadcast_coalesced(tensors, src, group):
    """Broadcast from the group's rank src, packed as buckets are: few messages of about 250 MiB (as DDP)."""
    with torch.no_grad():
        for indices in bucket_layout(tensors, range(len(tensors)), [250 << 20]):
            batch = [tensors[i] for i in indices]
            flat = torch.cat([t.reshape(-1) for t in batch])
            dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
            for t, part in zip(batch, flat.split([t.numel() for t in batch])):
                t.copy_(part.view_as(t))


# --- data and model: any text, any Hugging Face causal LM ---
def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + end-of-text): nothing to download, any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|endoftext|>"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def load_tokens(args, tok):
    """(training, held-out) tokens, each document ended by end-of-text, the last tenth held out: Python's sources (40
    files), local files (a directory, a file or a glob) or a hub dataset (NAME or NAME:CONFIG)."""
    if args.dataset == "stdlib":
        files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:40]
    else:  # a directory (every file under it), a file or a glob; if none matches, a hub dataset's name
        pattern = os.path.join(args.dataset, "**", "*") if os.path.isdir(args.dataset) else args.dataset
        files = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
    if files or os.path.isdir(args.dataset):
        texts = [pathlib.Path(f).read_text(encoding="utf-8") for f in files]
    else:  # every rank asks at once: the datasets cache takes one download, under a file lock
        import datasets
        datasets.disable_progress_bars()
        name, _, config = args.dataset.partition(":")
        texts = datasets.load_dataset(name, config or None, split="train")["text"]
    if not any(texts):  # else an IndexError deep inside the tokenizer
        raise UsageError(f"--dataset {args.dataset} is empty: no text to train on")
    ids = [i for row in tok(texts, add_special_tokens=False)["input_ids"] for i in row + [tok.eos_token_id]]
    held = len(ids) // VAL_PART
    return torch.tensor(ids[: len(ids) - held]), torch.tensor(ids[len(ids) - held:])


def batches_from(data, args):
    """This rank's micro-batches, epoch after epoch: its share of a new permutation each epoch (04_sampler.py)."""
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=args.seed, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)  # without it, every epoch would replay the first one's order
        idx = list(sampler)  # (not a DataLoader: its iterator draws from the global RNG that dropout replays)
        for k in range(len(idx) // args.batch_size):
            yield data[idx[k * args.batch_size:(k + 1) * args.batch_size]]


def build_model(args):
    """(tokenizer, model) in float32 (the master weights): --model (hub or directory), else a small GPT-2."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, logging
    logging.set_verbosity_error()  # long documents trigger a harmless length warning
    logging.disable_progress_bar()  # no bar from each rank
    tok = AutoTokenizer.from_pretrained(args.model) if args.model else byte_tokenizer()
    config = AutoConfig.from_pretrained(args.model) if args.model else GPT2Config(
        vocab_size=len(tok), n_positions=args.seq_len, n_embd=128, n_layer=4, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    for key in ("activation_function", "hidden_act"):  # GPT-2's gelu_new: the same function in 1 kernel, not ~8
        if getattr(config, key, None) == "gelu_new":
            setattr(config, key, "gelu_pytorch_tanh")
    if args.seq_len > getattr(config, "max_position_embeddings", args.seq_len):  # GPT-2's n_positions too
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's {config.max_position_embeddings} positions")
    torch.manual_seed(args.seed)  # the same weights on every rank (DDPCore broadcasts rank 0's anyway)
    model = AutoModelForCausalLM.from_pretrained(args.model, config=config) if args.model else GPT2LMHeadModel(config)
    return tok, model.float()


def compile_blocks(model, backend="inductor"):
    """Each block and the head compiled on its own (as torchtitan): a block's buckets leave as its backward ends, not
    after the whole model's. (The final norm, one kernel, stays eager: each model names it differently.)"""
    blocks = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len)  # the stack of blocks
    for region in [*blocks, model.get_output_embeddings()]:
        region.compile(backend=backend)
    return len(blocks)


def cross_entropy(logits, targets):
    """The mean loss in float32. --compile compiles it as a region of its own, after the head's: the cast then
    fuses into the loss's kernels, and no float32 copy of the logits (50,257 columns for GPT-2) is written."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def next_token_loss(net, batch, args, loss=cross_entropy):
    """Each position predicts the next token: the loss of the logits of batch[:, :-1] against batch[:, 1:]."""
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        logits = net(input_ids=batch[:, :-1], use_cache=False).logits  # no KV cache to build while training
    return loss(logits, batch[:, 1:])


# --- training ---
def wrap(model, impl, device, bucket_cap_mb=None):
    """The model as each --impl trains it: DDPCore, PyTorch's DDP (the same buckets), or the naive tutorial's."""
    if impl == "manual":
        return DDPCore(model, bucket_cap_mb=bucket_cap_mb)
    if impl == "torch":
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
    broadcast_coalesced(list(model.parameters()) + list(model.buffers()), 0, dist.group.WORLD)
    return model  # naive: rank 0's weights (as DDPCore's constructor), average_gradients after each backward


def main(args):
    """Resume from --out's newest checkpoint (if any), train, check the replicas, save the model, sample from it."""
    device = setup(args)
    if args.precision == "auto":
        args.precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if device.type == "cuda":  # TF32 matmuls: float32's range, 10-bit mantissa, tensor-core speed
        torch.backends.cuda.matmul.allow_tf32 = True
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} impl={args.impl} "
           f"precision={args.precision} torch={torch.__version__}")
    state = load_newest(args.out) if args.out else None
    start = state["step"] if state else 0
    if start >= args.max_steps:
        print0(f"OK nothing to train: {args.out} holds step {start} of --max-steps {args.max_steps}")
        return
    tok, model = build_model(args)
    train_ids, val_ids = load_tokens(args, tok)
    per_epoch = (len(train_ids) - 1) // args.seq_len // WORLD // args.batch_size  # micro-batches per rank per epoch
    n_val = min(VAL_BATCHES, (len(val_ids) - 1) // args.seq_len // WORLD // args.batch_size) * WORLD * args.batch_size
    if min(per_epoch, n_val) < 1:
        raise UsageError(f"the dataset has {len(train_ids) + len(val_ids):,} tokens (a tenth held out): too few for "
                         f"{WORLD} ranks x --batch-size {args.batch_size} x --seq-len {args.seq_len}")
    data = train_ids.unfold(0, args.seq_len + 1, args.seq_len)  # seq_len inputs and the next token: targets one later
    val = val_ids.unfold(0, args.seq_len + 1, args.seq_len)[:n_val]
    n_params = sum(p.numel() for p in model.parameters())  # tied weights once
    print0(f"data: {len(train_ids):,} tokens, {per_epoch} micro-batches per rank per epoch, {n_val} held-out blocks "
           f"| model: {n_params / 1e6:.2f}M parameters")
    loss = cross_entropy
    if args.compile:  # regions, not the whole model: one backward for all would hold every bucket back to its end
        print0(f"compiling {compile_blocks(model)} blocks, the head and the loss, one by one (the first steps wait)")
        loss = torch.compile(loss)
    ddp = wrap(model.to(device), args.impl, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY,
                            fused=device.type == "cuda")  # on the CPU, the per-tensor loop the tests check

    def lr_factor(step):  # linear warm-up, then cosine decay to LR_FLOOR of --lr at --max-steps
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    if state:  # every rank loads the same checkpoint: the replicas stay identical
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        print0(f"resumed from {args.out}/checkpoint-{start}.pt at step {start}")
    batches = itertools.islice(batches_from(data, args), start * args.grad_accum, None)  # resumed: skip those done
    # MFU: 6 FLOPs a weight per token (forward, backward) plus attention's, over the GPU's peak (nanoGPT's, with wpe).
    flops = 6 * n_params + 12 * model.config.num_hidden_layers * model.config.hidden_size * args.seq_len
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    peak = args.peak_tflops or next((tflops for name, tflops in PEAK_TFLOPS.items() if name in gpu), None)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * WORLD
    losses, first_loss, t_log = [], None, time.perf_counter()
    model.train()  # from_pretrained returns a model in eval mode: dropout off
    for step in range(start, args.max_steps):
        # Dropout masks differ across ranks as the data does, and a resumed run replays them: no RNG state saved.
        torch.manual_seed(args.seed + SEED_STRIDE * step + RANK)
        for micro in range(args.grad_accum):
            # Sync on the last micro-batch only (the flag no_sync() sets; nanoGPT writes it directly too).
            if args.impl != "naive":
                ddp.require_backward_grad_sync = micro == args.grad_accum - 1
            micro_loss = next_token_loss(ddp, next(batches).to(device, non_blocking=True), args, loss)
            (micro_loss / args.grad_accum).backward()
            losses.append(micro_loss.detach())
        if args.impl == "naive":
            average_gradients(model, WORLD)
        # Every .grad already holds the mean over ranks: clipping sees the global gradient, alike on every rank.
        nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 or step in (start, args.max_steps - 1):
            mean = torch.stack(losses).mean()
            dist.all_reduce(mean)  # every rank's loss, not rank 0's alone: the SUM of the means, / N below
            last_loss = mean.item() / WORLD
            if not math.isfinite(last_loss):  # every rank holds the same mean: all stop here, together
                raise UsageError(f"training diverged: loss {last_loss} at step {step + 1} (try a smaller --lr)")
            first_loss = last_loss if first_loss is None else first_loss
            dt = (time.perf_counter() - t_log) / len(losses) * args.grad_accum
            mfu = f" | MFU {100 * tokens_per_step / dt * flops / WORLD / (peak * 1e12):.1f}%" if peak else ""
            print0(f"step {step + 1:>5}/{args.max_steps} | loss {last_loss:7.4f} | lr {args.lr * lr_factor(step):.2e} "
                   f"| {dt * 1e3:7.1f} ms/step | {tokens_per_step / dt:9,.0f} tok/s{mfu}")
            losses, t_log = [], time.perf_counter()
        # Every --eval-every steps (nanoGPT's eval_interval) and at the end: the held-out loss (unless 0), a checkpoint.
        if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.max_steps:
            paused = time.perf_counter()
            if args.eval_every:  # each rank its share, as many batches as the others: the mean of means is the mean
                model.eval()  # the bare model, no dropout: no gradients, nothing to sync
                with torch.no_grad():  # this rank's batch losses over every rank's batch count: a part of the mean
                    val_loss = sum(next_token_loss(model, b.to(device), args, loss)
                                   for b in val[RANK::WORLD].split(args.batch_size)) / (n_val // args.batch_size)
                dist.all_reduce(val_loss)  # each rank's part of the mean over all batches, summed
                model.train()
                print0(f"step {step + 1:>5}/{args.max_steps} | val loss {val_loss.item():7.4f}")
            if args.out and RANK == 0:  # every replica holds the same state: global rank 0 alone writes it
                save_checkpoint(args.out, step + 1, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                                     "scheduler": sched.state_dict(), "step": step + 1})
                print(f"saved {args.out}/checkpoint-{step + 1}.pt", flush=True)
            t_log += time.perf_counter() - paused  # not training time
    # Identical gradients on identical weights keep the replicas identical: check it, bit for bit.
    mine = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    differs = (rank0 != mine).any().float()
    dist.all_reduce(differs)  # the ranks whose weights differ from rank 0's
    if RANK == 0 and args.out:  # the model and tokenizer as AutoModelForCausalLM.from_pretrained loads them
        model.save_pretrained(args.out)
        tok.save_pretrained(args.out)
    if RANK == 0 and args.sample_tokens > 0:  # a sample: a new document, within the model's context
        torch.manual_seed(args.seed)
        n = min(args.sample_tokens, getattr(model.config, "max_position_embeddings", 1024) - 1)
        out = model.eval().generate(torch.tensor([[tok.eos_token_id]], device=device), do_sample=True, top_k=20,
                                    temperature=0.8, max_new_tokens=n, pad_token_id=tok.eos_token_id)
        print0("sample:\n" + tok.decode(out[0], skip_special_tokens=True) + "\n")
    if differs.item():
        raise RuntimeError(f"replicas diverged: {differs.item():.0f} rank(s)' weights differ from rank 0's")
    trend = "fell" if last_loss < first_loss else "did NOT fall"
    print0(f"OK {args.impl} DDP on {WORLD} ranks: replicas identical; loss {trend} {first_loss:.4f} -> {last_loss:.4f}")


# --- checkpoints: the same block in 05, 06 and 08 ---
def load_newest(out):
    """The newest checkpoint in --out that loads, on every rank, or None. A run writes only into an
    --out that is new, empty or holds checkpoints, so never over files that no run wrote."""
    if os.path.isdir(out) and os.listdir(out) and not glob.glob("checkpoint-*", root_dir=out):
        raise UsageError(f"--out {out} holds files that no run wrote. Pick a new or empty folder.")
    os.makedirs(out, exist_ok=True)  # Now, so that a file of that name stops every rank here.
    found, me = [None, None], os.path.basename(__file__)  # the path, and the script that wrote it
    for path in reversed(checkpoints(out)) if RANK == 0 else []:  # Rank 0 picks one for all.
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            found = [path, state.get("script", "another script")]
            break
        except Exception as e:  # A disk fault. Saving that step again writes over it.
            print0(f"warning: {path} does not load ({type(e).__name__}), so this run skips it")
    dist.broadcast_object_list(found, src=0)  # On several nodes, all must see the --out disk.
    if found[0] and found[1] != me:  # Another script's checkpoint holds other things.
        raise UsageError(f"{found[0]} was written by {found[1]}, not {me}. "
                         "Give each script its own --out.")
    return found[0] and torch.load(found[0], map_location="cpu", weights_only=True, mmap=True)


def checkpoints(out):  # the checkpoint files in --out, oldest first
    names = [f for f in glob.glob("checkpoint-*.pt", root_dir=out) if f[11:-3].isdigit()]
    return [f"{out}/{f}" for f in sorted(names, key=lambda f: int(f[11:-3]))]  # f[11:-3] is a step


def save_checkpoint(out, step, state, keep=2):  # Global rank 0 alone calls it.
    # Written aside, then renamed into place, so that no checkpoint is ever half written.
    torch.save({**state, "script": os.path.basename(__file__)}, f"{out}/checkpoint-tmp")
    os.replace(f"{out}/checkpoint-tmp", f"{out}/checkpoint-{step}.pt")
    for old in checkpoints(out)[:-keep]:  # The newest `keep` stay.
        os.remove(old)


# --- command line ---
def parse_args(argv=None):
    p = Parser(__doc__, timeout_s=300)
    count = at_least(1)
    g = p.add_argument_group("model, data, training, output")
    g.add_argument("--model", default=None, help="HF causal LM name or local dir; default: a small GPT-2 from scratch")
    g.add_argument("--dataset", default="stdlib", help="'stdlib' (Python's sources), local dir/file/glob, or HF name")
    g.add_argument("--impl", choices=["manual", "naive", "torch"], default="manual", help="DDPCore, naive, PyTorch's")
    g.add_argument("--compile", action="store_true", help="torch.compile each block, the head, the loss (overlap kept)")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 on a GPU with it")
    g.add_argument("--batch-size", type=count, default=4, help="sequences per rank per micro-batch")
    g.add_argument("--seq-len", type=count, default=128, help="tokens per sequence")
    g.add_argument("--grad-accum", type=count, default=1, help="micro-batches per optimizer step (no_sync between)")
    g.add_argument("--max-steps", type=count, default=200, help="optimizer steps")
    g.add_argument("--lr", type=at_least(1e-12, float), default=2e-3, help="peak learning rate")
    g.add_argument("--warmup-steps", type=at_least(0), default=30, help="linear warm-up steps before cosine decay")
    g.add_argument("--log-every", type=count, default=25, help="steps between loss lines")
    g.add_argument("--eval-every", type=at_least(0), default=50, help="steps between val loss + checkpoint (0: no val)")
    g.add_argument("--sample-tokens", type=at_least(0), default=120, help="tokens generated at the end (0: none)")
    g.add_argument("--peak-tflops", type=at_least(1e-9, float), help="GPU's bf16 peak, for MFU (H100/H200/A100 known)")
    g.add_argument("--out", default=None, help="checkpoint dir: resume from it, save to it, final save_pretrained")
    g.add_argument("--seed", type=at_least(0, below=2**32), default=0, help="model init (same on all ranks), data")
    return p.parse_args(argv)


# --- setup: the same block in every numbered script, copied so that each file runs alone ---
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # from torchrun


class UsageError(Exception): ...  # a bad flag or input: one `error:` line (run()), exit status 2


def print0(*msg):  # rank 0 tells the story, once. One write, so that lines from ranks never mix.
    if RANK == 0:
        print(" ".join(map(str, msg)) + "\n", end="", flush=True)


def at_least(low, kind=int, below=math.inf):  # a number flag's type: low <= value < below
    def parse(text):
        if not low <= kind(text) < below:
            raise argparse.ArgumentTypeError(f"must be >= {low} and < {below}, got {text}")
        return kind(text)
    return parse


class Parser(argparse.ArgumentParser):  # the flags every script shares
    def __init__(self, doc, timeout_s=120):
        super().__init__(description=doc.split("\n")[0],
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        self.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
        self.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl if GPUs")
        self.add_argument("--timeout-s", type=at_least(1, float), default=timeout_s,
                          help="how long a rank waits for a peer")

    def error(self, message): raise UsageError(message)  # one line from rank 0 (run())


def setup(args):  # pick this rank's device, then join the group
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never asks CUDA
    backend = args.backend or ("nccl" if gpus >= local_world else "gloo")  # NCCL: a GPU per rank
    if (args.device == "cuda" and gpus == 0) or (backend == "nccl" and gpus < local_world):
        raise UsageError(f"--backend {backend}: {gpus} CUDA GPU(s) for {local_world} ranks")
    on_gpu = gpus >= local_world or args.device == "cuda"  # gloo lets the ranks share GPUs
    device = torch.device(f"cuda:{local_rank % gpus}" if on_gpu else "cpu")
    if device.type == "cuda":  # before init, so that NCCL binds this rank to its GPU
        torch.cuda.set_device(device)
    print0(f"device: {device.type}, {backend} "
           f"(--device {args.device}, {gpus} GPU(s) for {local_world} ranks/node)")
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **alone)
    return device


def run(main, parse_args):  # a dead peer ends in the library's timeout error, never a hang
    try:
        main(parse_args())
    except UsageError as e:  # every rank stops alike, with exit status 2. Rank 0 says why.
        print0(f"error: {e}")
        os._exit(2)  # at once: tearing down a live group can abort in gloo's threads (SIGABRT)
    dist.destroy_process_group()  # main() always joins the group first
    time.sleep(0.05)  # gloo's threads drop their last tensors before exit, or it can abort


if __name__ == "__main__":
    run(main, parse_args)
