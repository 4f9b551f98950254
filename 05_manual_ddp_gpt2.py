"""05 - DDP by hand: a drop-in for torch.nn.parallel.DistributedDataParallel, training a Hugging Face GPT-2.

What it teaches: DDPCore, right below, is what PyTorch's DDP does, bit for bit, in about 200 lines: broadcast
rank 0's weights at start; pack gradients into buckets, first in parameter order, then rebuilt once in the order
the first backward really produced them; start each bucket's all-reduce from a backward hook as soon as its last
gradient lands, so communication overlaps the rest of backward; no communication at all while accumulating
(no_sync). The default run trains with it. ManualDDP, after the training code, is the core plus the drop-in
surface that code written for PyTorch's class uses: unused parameters, communication hooks, uneven inputs (join),
DDP's other arguments and errors. The training loop is crash-safe: atomic checkpoints from global rank 0, resume
from the newest one that loads, one run per --out, and survival of killed workers under torchrun --max-restarts.

Run it (the default trains a small GPT-2 offline on Python's own standard library sources):
  1 process:  python 05_manual_ddp_gpt2.py
  CPU:        torchrun --nproc_per_node=2 05_manual_ddp_gpt2.py
  N GPUs:     torchrun --nproc_per_node=N 05_manual_ddp_gpt2.py --model gpt2 --dataset wikitext \\
                  --dataset-config wikitext-2-raw-v1 --seq-len 512 --compile
  2 nodes:    torchrun --nnodes=2 --node_rank=K --nproc_per_node=G --master_addr=HOST --master_port=29500 \\
                  05_manual_ddp_gpt2.py --out ckpt
  restarts:   TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 \\
                  05_manual_ddp_gpt2.py --out ckpt
  compare:    torchrun --nproc_per_node=2 05_manual_ddp_gpt2.py --impl torch   (or naive)
"""

import argparse
import atexit
import contextlib
import fcntl
import functools
import glob
import itertools
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

# --- settings beyond the flags ---
ADAMW_BETAS = (0.9, 0.95)  # GPT-2's (and nanoGPT's); PyTorch's default 0.999 reacts slower to a changing loss
LR_FLOOR = 0.1  # the cosine schedule ends at this fraction of --lr
SEED_STRIDE = 7919  # dropout seed = seed + stride * step + rank: a prime, so no two (step, rank) pairs share one
SAMPLE_TOP_K, SAMPLE_TEMPERATURE = 20, 0.8  # the generated sample at the end
# Dense bf16 peak for MFU, by the exact name torch.cuda.get_device_name() gives: a substring would give an L40 the
# L4's figure and a PCIe H100 the SXM one's. Any other GPU: --peak-tflops.
PEAK_TFLOPS = {"NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H100 NVL": 835, "NVIDIA H200": 989,
               "NVIDIA A100-SXM4-80GB": 312, "NVIDIA A100-SXM4-40GB": 312, "NVIDIA A100 80GB PCIe": 312,
               "NVIDIA A100-PCIE-40GB": 312, "NVIDIA L40S": 362, "NVIDIA L40": 181, "NVIDIA L4": 121}
# DDP's own words for a model with nothing to train, which PyTorch's tests match on
NOTHING_TO_AVERAGE = ("DistributedDataParallel is not needed when a module doesn't have any parameter that requires "
                      "a gradient.")

# --- the idea: DDP by hand ---
class Bucket:
    """The gradients of several parameters in one flat tensor. Each parameter's .grad is a view of its slot, so
    backward writes straight into the bucket and the whole bucket leaves in one all-reduce: nothing is copied."""

    def __init__(self, params, indices):
        self.params, self.indices = params, indices  # indices: where these parameters sit in DDPCore.params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offsets = itertools.accumulate([p.numel() for p in params], initial=0)
        self.views = [self.flat[o:o + p.numel()].view_as(p) for o, p in zip(offsets, params)]
        self.pending = len(params)  # gradients this backward has still to produce
        self.work = None  # the last all-reduce, kept until the next (why: docs/manual_ddp.md, "A clean exit")


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


def _call(wrapper, method, *args):
    """Call a method of the wrapper behind a weak reference, if the wrapper still exists."""
    target = wrapper()
    if target is not None:
        return getattr(target, method)(*args)


class DDPCore(nn.Module):
    """DistributedDataParallel's idea: after loss.backward(), every .grad holds the mean of all ranks' gradients,
    and the all-reduces that made it ran while backward was still computing the rest.

    What it leaves out, each an error or a wrong result here, each handled by ManualDDP (further down):
      - a parameter that gets no gradient in some backward: find_unused_parameters=True, or static_graph=True;
      - ranks with different numbers of batches: join(); other reductions than the mean: register_comm_hook();
      - DDP's other arguments (device_ids, init_sync, delay_all_reduce_named_params, bucket_cap_mb_list, ...),
        pickling the wrapper, _get_ddp_logging_data(), and DDP's own wording of its errors.
    """

    bucket_class = Bucket  # ManualDDP's buckets also answer what a communication hook asks of one

    def __init__(self, module, process_group=None, bucket_cap_mb=None, broadcast_buffers=True):
        super().__init__()
        self.module, self.broadcast_buffers = module, broadcast_buffers
        self.process_group = process_group or dist.group.WORLD
        self.world = dist.get_world_size(self.process_group)
        self._divisor = self.world  # the mean divides by this
        self.require_backward_grad_sync = True  # False inside no_sync(): backward then stays local
        self.require_forward_param_sync = True  # broadcast the buffers before the next forward
        named = self._parameters_to_sync()
        self.names = [n for n, p in named if p.requires_grad]
        self.params = [p for _, p in named if p.requires_grad]
        self.device = next(module.parameters()).device  # where the buckets live
        # Replicas must start identical: the same mean gradient applied to different weights would keep them
        # different forever. So rank 0's value of every parameter wins (frozen ones too: they shape the output),
        # and of every buffer (BatchNorm's running statistics) if buffers are synced.
        self._sync_module_states([p for _, p in named])
        # Buckets, DDP's way: the first backward runs with ONE bucket in parameter order, only a guess at the order
        # gradients arrive in. That backward shows the real order, and the buckets are cut again in it, once,
        # before the next forward (_maybe_rebuild). Reversed: backward produces the last layers' gradients first.
        first_caps, self._caps = self._bucket_caps(bucket_cap_mb)
        self._set_buckets(sorted(bucket_layout(self.params, range(len(self.params)), first_caps), key=min,
                                 reverse=True))
        self._rebuilt, self._order = False, []  # _order: parameter indices as the first backward made them ready
        self._next, self._queued = 0, False  # the next bucket to launch; _finish queued for this backward
        self._register_hooks()

    def _parameters_to_sync(self):
        """(name, parameter) pairs, broadcast at construction; those that require a gradient are averaged."""
        named = list(self.module.named_parameters())
        if not any(p.requires_grad for _, p in named):
            raise RuntimeError(NOTHING_TO_AVERAGE)
        return named

    @property
    def buffers_to_sync(self):
        return list(self.module.buffers())  # looked up each time: a module may replace a buffer

    def _sync_module_states(self, params):
        self._broadcast(params + (self.buffers_to_sync if self.broadcast_buffers else []), src=0)

    def _bucket_caps(self, bucket_cap_mb):
        """(caps before the rebuild, caps after), in bytes. DDP's default: 25 MiB, the first bucket 1 MiB so that
        its all-reduce starts early in backward ("experiments showed 1MB is a reasonable value", says DDP)."""
        if bucket_cap_mb is None:
            return [sys.maxsize], [1 << 20, 25 << 20]
        return [sys.maxsize], [int(bucket_cap_mb * (1 << 20))]

    def _set_buckets(self, layout):
        grads = [p.grad for p in self.params]
        self.buckets = [self.bucket_class([self.params[i] for i in idx], list(idx)) for idx in layout]
        self._where = [None] * len(self.params)  # parameter index -> (its bucket, its slot there)
        for b in self.buckets:
            for slot, i in enumerate(b.indices):
                self._where[i] = (b, slot)
                if grads[i] is not None:  # gradients accumulated so far (no_sync) move into the new buckets
                    b.views[slot].copy_(grads[i])
                    self.params[i].grad = b.views[slot]

    def _register_hooks(self):
        # Through a weak reference: a dropped wrapper must be freed, not kept alive by hooks on the parameters
        # of a module that lives on (and answering its every backward).
        me = weakref.ref(self)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(_call, me, "_on_grad_ready", i))

    # -- one step: forward, a hook per parameter, the end of backward --
    def forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled():
            if self.require_backward_grad_sync:  # never inside no_sync(): accumulating costs no communication
                self._maybe_rebuild()
            self._grads_into_buckets()
        if self.require_forward_param_sync and self.broadcast_buffers and self.buffers_to_sync:
            self._sync_buffers()
        output = self.module(*inputs, **kwargs)
        # Buffers are broadcast before the forward that follows a synced one (as DDP: not after no_sync forwards).
        self.require_forward_param_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        return output

    def _grads_into_buckets(self):
        """A missing .grad (None after optimizer.zero_grad()) becomes its zeroed bucket slot. Autograd then adds the
        gradient into .grad in place, that is into the bucket: nothing to copy in, nothing to copy back out."""
        for b in self.buckets:
            for slot in self._zero_missing(b):
                b.params[slot].grad = b.views[slot]

    def _zero_missing(self, b):
        missing = [slot for slot, p in enumerate(b.params) if p.grad is None]
        if len(missing) == len(b.params):
            b.flat.zero_()  # the usual case: one fill for the whole bucket
        else:  # only some are None: keep what the others hold
            for slot in missing:
                b.views[slot].zero_()
        return missing

    def _on_grad_ready(self, i, p):
        """Runs inside backward, right after autograd added parameter i's gradient into p.grad."""
        if not self.require_backward_grad_sync:
            return  # accumulating locally: no communication at all
        self._queue_finish()
        if not self._rebuilt:
            self._order.append(i)  # the order in which backward really produces gradients
        bucket, slot = self._where[i]
        self._mark_ready(bucket, slot)
        self._launch_ready()

    def _queue_finish(self):
        if not self._queued:  # the first gradient of this backward: run _finish once backward is done
            self._queued = True
            # The autograd engine's queue_callback is a private API; PyTorch's own DDP relies on it too.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _mark_ready(self, bucket, slot):
        p, view = bucket.params[slot], bucket.views[slot]
        if p.grad.data_ptr() != view.data_ptr():  # backward did not write into the slot (.grad was replaced)
            view.copy_(p.grad)
        p.grad = view
        bucket.pending -= 1

    def _launch_ready(self):
        # Strictly in bucket order, on every rank alike: collectives are matched by the order in which ranks issue
        # them, and gradients may become ready in a different order on different ranks.
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b):
        # Divide BEFORE the sum, as DDP does: N fp16/bf16 gradients added up could overflow where their mean would
        # not. One multiply per bucket by 1/N, on data just written (still in cache).
        if self._divisor > 1:
            b.flat.mul_(1 / self._divisor)
        b.work = dist.all_reduce(b.flat, group=self.process_group, async_op=True)

    def _finish(self):
        """End of backward: wait for every bucket's all-reduce. Then each .grad (a view of a bucket) is the mean."""
        self._queued = False
        if self._next < len(self.buckets):
            names = [self.names[i] for b in self.buckets[self._next:] for i in b.indices]
            raise RuntimeError(f"DDPCore: a parameter got no gradient in this backward (one of {names[:5]}), so "
                               "its bucket never left. Use ManualDDP(find_unused_parameters=True) for such a model.")
        for b in self.buckets:
            self._wait(b)
            b.pending = len(b.params)
        self._next = 0

    def _wait(self, b):
        b.work.wait()

    # -- the buckets, cut again once in the order gradients really arrived --
    def _maybe_rebuild(self):
        if self._rebuilt or not self._order:
            return
        # The observed order, each parameter once, then any that never became ready, in parameter order. Every
        # rank takes the group's first rank's order: the buckets must be the same everywhere.
        order = list(dict.fromkeys(self._order))
        seen = set(order)
        order += [i for i in range(len(self.params)) if i not in seen]
        order = torch.tensor(order, dtype=torch.int64, device=self.device)
        dist.broadcast(order, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        self._set_buckets(bucket_layout(self.params, order.tolist(), self._caps))
        self._rebuilt = True

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward adds into .grad locally, with no communication; the first backward after
        the block averages the whole sum."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def _sync_buffers(self, src=0):
        """Rank src's buffers to every rank before forward: BatchNorm's statistics, say, stay the same everywhere."""
        self._broadcast(self.buffers_to_sync, src)

    def _broadcast(self, tensors, src):
        """Broadcast from the group's rank src in few messages: the tensors of one dtype and device packed into one
        flat buffer, up to 250 MiB a message (as DDP: a large model needs no second full copy of itself)."""
        messages = {}
        for t in tensors:
            kind = (t.dtype, t.device)
            if kind not in messages or sum(x.numel() * x.element_size() for x in messages[kind][-1]) >= 250 << 20:
                messages.setdefault(kind, []).append([])
            messages[kind][-1].append(t)
        with torch.no_grad():
            for group in [g for kind in messages.values() for g in kind]:
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                dist.broadcast(flat, src=dist.get_global_rank(self.process_group, src), group=self.process_group)
                for t, part in zip(group, flat.split([t.numel() for t in group])):
                    t.copy_(part.view_as(t))



def average_gradients(model, world):
    """--impl naive, the classic tutorial: after backward, one blocking all-reduce per parameter. Correct, but each
    message pays the full latency and nothing overlaps backward (benchmarks/ddp_step.py measures the cost)."""
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(world)


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
    if files:  # every rank reads its own: nodes may hold different copies
        files, binary, problem = text_files(files)
        if not files and binary and not problem:
            problem = (f"no text: {binary[0][0]} is binary (a NUL byte at offset {binary[0][1]:,})"
                       + (f", and {len(binary) - 1} more" if len(binary) > 1 else ""))
        stop_together(f"--dataset {args.dataset!r}: {problem}" if problem else None)
        if binary:  # a picture or a .DS_Store beside the text: what a user means is the text
            print0(f"note: --dataset {args.dataset!r}: skipped {len(binary)} binary file(s): "
                   + ", ".join(path for path, _ in binary[:3]) + (" ..." if len(binary) > 3 else ""))
    # Local rank 0 of each node builds the datasets cache first; the others then read it instead of racing.
    if local_rank != 0:
        dist.barrier()
    try:
        if files:
            ds = datasets.load_dataset("text", data_files=files, split="train", sample_by="document")
        else:
            ds = datasets.load_dataset(args.dataset, args.dataset_config, split=args.split)
    except Exception as e:  # offline, misspelt, private...: say so in one line on every rank
        while files and e.__cause__ is not None:  # datasets wraps what went wrong in a file: name that
            e = e.__cause__
        reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
        failed = ("datasets could not read its files" if files else
                  "no local files match, and loading it as a Hugging Face dataset failed")
        raise UsageError(f"--dataset {args.dataset!r}: {failed} ({reason})") from None
    finally:
        if local_rank == 0:
            dist.barrier()
    if args.text_column not in ds.column_names:
        raise UsageError(f"--text-column {args.text_column!r} not in the dataset's columns {ds.column_names}")
    texts = [t for t in ds[args.text_column] if t]
    if not texts:
        raise UsageError(f"--dataset {args.dataset!r} holds no text")
    return texts


def stop_together(problem):
    """Every rank raises the first problem (a line, or None) that any rank found. A rank that stopped alone would
    leave the others waiting in their next collective, and under torchrun the first rank out gets the others
    killed, maybe before rank 0 has said why."""
    problems = [None] * WORLD
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise UsageError(next(p for p in problems if p))


def text_files(files):
    """(the files to read as text, [(binary file, offset of its first NUL byte)], the first problem or None).

    A NUL byte in the first 8000 bytes marks a binary file, as git decides. Any other file must be UTF-8 throughout:
    read in another encoding it would teach the model wrong characters, and datasets would stop on it without
    naming it. Archives and compressed files (gzip, zip, ...) are left to datasets, which opens them."""
    from datasets.utils.extract import Extractor
    text, binary = [], []
    for path in files:
        try:
            if Extractor.infer_extractor_format(path):
                text.append(path)
                continue
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            return text, binary, f"cannot read {path} ({e.strerror or type(e).__name__})"
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):  # its byte-order mark; its ASCII holds NUL bytes
            return text, binary, f"{path} is UTF-16 text, not UTF-8: convert it (iconv -f UTF-16 -t UTF-8)"
        if b"\0" in data[:8000]:
            binary.append((path, data.index(b"\0")))
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            return text, binary, (f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start:,}, "
                                  f"line {line:,}): convert it, e.g. iconv -f LATIN1 -t UTF-8")
        text.append(path)
    return text, binary, None


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


# --- model ---
def build_model(args, device):
    """(tokenizer, model), the model in float32 on the CPU. What cannot fit or cannot run is refused first."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel
    if args.model:
        try:
            tok, cfg = AutoTokenizer.from_pretrained(args.model), AutoConfig.from_pretrained(args.model)
        except Exception as e:  # missing, empty, a broken config
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            problem = f"cannot load --model {args.model!r}: {reason}"
        else:
            problem = tokenizer_problem(args.model, tok, cfg)
        stop_together(problem)  # before the weights load
    else:
        tok = byte_tokenizer()
        # gelu_pytorch_tanh: the same function as GPT-2's gelu_new, as one fused kernel instead of ~8 on a GPU.
        cfg = GPT2Config(vocab_size=len(tok), n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
                         n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         activation_function="gelu_pytorch_tanh",
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if limit and args.seq_len > limit:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's {limit} positions")
    # A lower bound of the memory a rank needs: the embeddings (weights, gradients, AdamW's two moments: 16 bytes
    # an element) and one micro-batch's logits in float32.
    embeddings = (cfg.vocab_size + (limit or 0)) * cfg.hidden_size
    check_memory(16 * embeddings + 4 * args.batch_size * args.seq_len * cfg.vocab_size,
               f"--batch-size {args.batch_size} x --seq-len {args.seq_len}", device)
    if args.model:
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model).float()  # fp32 master weights
        except Exception as e:  # missing or corrupt weights
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise UsageError(f"cannot load --model {args.model!r}: {reason}") from None
    else:
        # The same seed on every rank gives identical replicas before any broadcast; ManualDDP broadcasts
        # rank 0's weights anyway, and verify=True would check this instead.
        torch.manual_seed(args.seed)
        model = GPT2LMHeadModel(cfg)
    return tok, model


def tokenizer_problem(name, tok, cfg):
    """Why --model's own tokenizer cannot feed its model, or None. Every id the tokenizer gives needs a row in the
    embedding: one beyond it fails only when a batch first holds it (an IndexError, maybe hundreds of steps in).
    An embedding larger than the tokenizer is common (rounded up for speed) and fine."""
    if len(tok) < 2 or not tok("a b").input_ids:  # transformers returns an empty one when there is none
        return f"--model {name!r} has no tokenizer: save one beside the model (tokenizer.json)"
    beyond = sorted((i, t) for t, i in tok.get_vocab().items() if i >= cfg.vocab_size)
    if not beyond:
        return None
    named = ", ".join(f"{t!r} (id {i})" for i, t in beyond[:3]) + (" ..." if len(beyond) > 3 else "")
    return (f"--model {name!r}: its tokenizer has {len(tok):,} tokens, its embedding {cfg.vocab_size:,} rows, so "
            f"{named} would index past it: save the model's own tokenizer beside it, or grow the embedding "
            "(model.resize_token_embeddings)")


def check_memory(nbytes, what, device):
    """One line before the work if `what` cannot fit: `nbytes`, a lower bound of what it needs, against this rank's
    share of its device's free memory (a node's RAM and a shared GPU are split between their ranks)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device.type == "cuda":
        free, sharing = torch.cuda.mem_get_info(device)[0], -(-local_world // torch.cuda.device_count())
    else:
        free, sharing = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), local_world
        if os.path.exists("/proc/meminfo"):  # Linux says what is available: free, and cache it can drop
            with open("/proc/meminfo") as f:
                free = next((int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:")), free)
    share = torch.tensor([free / sharing], dtype=torch.float64, device=device)
    dist.all_reduce(share, op=dist.ReduceOp.MIN)  # the smallest share decides, so every rank decides alike
    if nbytes > share.item():
        raise UsageError(f"{what} would need at least {nbytes / 2**30:,.1f} GiB, more than this rank's share of "
                         f"{device.type} memory ({share.item() / 2**30:,.1f} GiB)")


def check_fits(path, state, model):
    """A checkpoint of another model configuration: one line naming the first tensor whose shape differs."""
    mine = model.state_dict()
    for key in sorted(mine.keys() | state["model"].keys()):
        theirs = tuple(state["model"][key].shape) if key in state["model"] else "nothing"
        if theirs != (tuple(mine[key].shape) if key in mine else "nothing"):
            ours = tuple(mine[key].shape) if key in mine else "nothing"
            raise UsageError(f"{path} was written for another model: it holds {theirs} for {key}, this run's "
                             f"model {ours}. Use the flags that wrote it, or another --out")


def lr_factor(step, args):
    """Linear warm-up, then cosine decay to LR_FLOOR of --lr, over --max-steps."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def compile_blocks(model, backend="inductor"):
    """Regional compilation, as torchtitan does: each transformer block compiled on its own. A block's gradients
    are then ready, and their buckets sent, as soon as its backward ends, while earlier blocks still run theirs.
    torch.compile(model) would hand over every gradient only after the whole compiled backward: no overlap left
    (PyTorch's DDP avoids that by splitting the graph at its buckets, which only works for its own class)."""
    blocks = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len)  # the stack of blocks
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


def flops_per_token(model, seq_len):
    """Training FLOPs a token, as nanoGPT counts them: 6 per weight (forward and backward) plus attention."""
    cfg = model.config
    weights = sum(p.numel() for n, p in model.named_parameters() if "wpe" not in n and "position" not in n)
    return 6 * weights + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def peak_tflops(args, device):
    """The GPUs' peak for MFU: --peak-tflops, else PEAK_TFLOPS' entry for this GPU in bf16/fp16, else None."""
    if args.peak_tflops or device.type != "cuda" or args.precision not in ("bf16", "fp16"):
        return args.peak_tflops
    name = torch.cuda.get_device_name(device)
    if name not in PEAK_TFLOPS:
        print0(f"note: no MFU: the peak of {name!r} is not in PEAK_TFLOPS; give it with --peak-tflops")
    return PEAK_TFLOPS.get(name)


def ddp_class(args):
    """--impl manual trains with the core, the class above; a flag that needs DDP's wider surface, with ManualDDP."""
    return ManualDDP if args.comm_hook != "none" else DDPCore


def wrap(model, impl, args, device):
    """The model as each --impl trains it: ours, PyTorch's (same bucket size) or the naive tutorial's."""
    if impl == "torch":
        device_ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb)
        if args.comm_hook == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook as library_hook
            try:
                ddp.register_comm_hook(None, library_hook)
            except TypeError as e:  # PyTorch's DDP accepts its bf16 hook only in CUDA builds
                raise UsageError(f"--impl torch --comm-hook bf16: PyTorch refuses it here ({e})") from None
        return ddp
    if impl == "manual":
        ddp = ddp_class(args)(model, bucket_cap_mb=args.bucket_cap_mb)  # the batches are on our device already
        if args.comm_hook == "bf16":
            ddp.register_comm_hook(None, bf16_compress_hook)  # the hand-written one, below ManualDDP
        return ddp
    with torch.no_grad():  # naive: start from rank 0's weights, then average after every backward (see train)
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=0)
    return model


# --- training ---
def train(args, device, local_rank):
    from tqdm import tqdm
    # Read before the model and data are built: a rank that cannot read it stops the run at once.
    ckpt_path, ckpt = resume_state(args.out)
    tok, model = build_model(args, device)
    ids = tokenize(load_texts(args, local_rank), tok)
    data = Blocks(ids, args.seq_len)
    per_epoch = (len(data) // WORLD) // args.batch_size  # micro-batches per rank per epoch
    if per_epoch < 1:
        raise UsageError(f"the dataset has {len(ids):,} tokens: too few for {WORLD} ranks x --batch-size "
                         f"{args.batch_size} x --seq-len {args.seq_len}")
    print0(f"data: {len(ids):,} tokens, {len(data):,} blocks of {args.seq_len}, {per_epoch} micro-batches "
           f"per rank per epoch | model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    model.to(device)
    if args.compile:
        print0(f"compiling {compile_blocks(model)} blocks one by one (the first steps wait for it)")
    if ckpt:
        check_fits(ckpt_path, ckpt, model)
        model.load_state_dict(ckpt["model"])
    ddp = wrap(model, args.impl, args, device)
    # The fused kernel on a GPU; the CPU keeps the per-tensor loop, which the tests check bit for bit.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=ADAMW_BETAS, weight_decay=args.weight_decay,
                            fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # fp16 needs loss scaling
    start = 0
    if ckpt:
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        if ckpt["scaler"] or not scaler.is_enabled():  # an fp32 or bf16 run saved none: fp16 starts a new scale
            scaler.load_state_dict(ckpt["scaler"])
        start = ckpt["step"]
        if ckpt["world_size"] != WORLD:
            print0(f"warning: checkpoint written by {ckpt['world_size']} ranks, now {WORLD}: the data order differs")
        print0(f"resumed from {ckpt_path} at step {start}")
        if start < args.max_steps and ckpt.get("max_steps", args.max_steps) != args.max_steps:
            # The schedule is a function of --max-steps: the cosine now stretches over the new total.
            print0(f"note: --max-steps {ckpt['max_steps']} -> {args.max_steps}: the learning rate follows the "
                   f"longer schedule from step {start} on (lr {lr_factor(start, args) * args.lr:.2e})")
    del ckpt
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    batches = batches_from(data, per_epoch, args, start_micro=start * args.grad_accum)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * WORLD
    flops_per_step = flops_per_token(model, args.seq_len) * tokens_per_step
    peak = peak_tflops(args, device)
    bar = tqdm(total=args.max_steps, initial=start, disable=RANK != 0 or not sys.stderr.isatty(), unit="step")
    say = tqdm.write if not bar.disable else print0  # print above the bar, not through it
    profiler = contextlib.ExitStack()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)  # each rank writes its own trace there
        prof = profiler.enter_context(torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(args.profile, f"trace_rank{RANK}.json"))))
    losses, first_loss, last_loss, t_log = [], None, None, time.perf_counter()
    model.train()
    step = start
    try:
        with profiler:
            for step in range(start, args.max_steps):
                first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
                if step == args.crash_at_step and RANK == WORLD - 1 and first_attempt:
                    log(f"--crash-at-step {step}: SIGKILL to myself (first attempt only)")
                    os.kill(os.getpid(), signal.SIGKILL)
                # Dropout (if the model has any) should differ across ranks like the data does, and a resumed run
                # must replay the same masks: so seed from (seed, step, rank) instead of saving RNG states.
                torch.manual_seed(args.seed + SEED_STRIDE * step + RANK)
                step_loss = torch.zeros((), device=device)
                for micro in range(args.grad_accum):
                    batch = next(batches).to(device, non_blocking=True)
                    # Accumulate locally on all but the last micro-batch: one all-reduce per optimizer step. (The
                    # attribute no_sync() sets; written directly, as nanoGPT does, it reads as the schedule it is.)
                    if args.impl != "naive":
                        ddp.require_backward_grad_sync = micro == args.grad_accum - 1
                    # use_cache=False: training reads no KV cache; Hugging Face would build one every forward (and
                    # under --compile, each block would recompile on the state of its own cache layer).
                    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                        logits = ddp(input_ids=batch[:, :-1], use_cache=False).logits
                    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
                    scaler.scale(loss / args.grad_accum).backward()
                    step_loss += loss.detach() / args.grad_accum
                if args.impl == "naive":
                    average_gradients(model, WORLD)
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
                # The end of training is a checkpoint too: a larger --max-steps continues from it.
                if args.out and ((step + 1) % args.ckpt_every == 0 or step + 1 == args.max_steps):
                    on_rank_0(save_checkpoint, args.out, step + 1, {
                        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "scaler": scaler.state_dict(), "step": step + 1, "world_size": WORLD,
                        "max_steps": args.max_steps}, args.keep_checkpoints)
                    say(f"saved {args.out}/checkpoint-{step + 1}")
                if (step + 1) % args.log_every == 0 or step in (start, args.max_steps - 1):
                    # Loss of all ranks, not rank 0's alone: SUM of per-rank means, divided by N.
                    mean = torch.stack(losses).mean()
                    dist.all_reduce(mean)
                    last_loss = mean.item() / WORLD
                    if not math.isfinite(last_loss):  # every rank holds the same mean: all stop here, together
                        raise UsageError(f"training diverged: loss {last_loss} at step {step + 1} (try a smaller --lr)")
                    first_loss = last_loss if first_loss is None else first_loss
                    dt = (time.perf_counter() - t_log) / len(losses)
                    line = (f"step {step + 1:>5}/{args.max_steps} | loss {last_loss:7.4f} "
                            f"| lr {sched.get_last_lr()[0]:.2e} | {dt * 1e3:7.1f} ms/step "
                            f"| {tokens_per_step / dt:9,.0f} tok/s | {flops_per_step / dt / 1e12:6.2f} TFLOP/s")
                    if peak:  # model FLOP utilisation: the share of the GPUs' peak the model's own work reaches
                        line += f" | MFU {flops_per_step / dt / 1e12 / (peak * WORLD):.1%}"
                    say(line)
                    losses, t_log = [], time.perf_counter()
    except Interrupted as stop:  # Ctrl-C or SIGTERM: run() prints where, once, and what is on disk
        stop.where = f"at step {step + 1}; {newest_checkpoint(args.out)}"
        raise
    bar.close()
    return tok, model, first_loss, last_loss


def finish(args, tok, model, device, first_loss, last_loss):
    # Identical gradients on identical weights keep the replicas identical: check it, bit for bit.
    flat = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor([float(torch.equal(ref, flat)), float(flat.isfinite().all())], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if not same[1].item():  # NaN equals nothing, itself included: say what really happened
        raise UsageError("training diverged: the weights are not finite (try a smaller --lr)")
    if args.out:  # global rank 0 writes (one writer); every rank learns whether it could
        on_rank_0(save_model, args.out, model, tok)
        print0(f"saved model and tokenizer to {args.out} (AutoModelForCausalLM.from_pretrained loads it)")
    if RANK == 0 and args.sample_tokens > 0:
        sample(args, tok, model, device)
    if not same[0].item():
        raise RuntimeError("replicas diverged: weights differ across ranks")
    if first_loss is not None:
        trend = "fell" if last_loss < first_loss else "did NOT fall"
        print0(f"OK {args.impl} DDP on {WORLD} rank(s): replicas identical; "
               f"loss {trend} {first_loss:.4f} -> {last_loss:.4f}")
    else:
        print0(f"OK {args.impl} DDP on {WORLD} rank(s): nothing left to train (resumed at --max-steps "
               f"{args.max_steps} or past it)")


def save_model(out, model, tok):
    """Global rank 0: the model and tokenizer as from_pretrained loads them, written aside and then moved in, so
    that a full disk or Ctrl-C never leaves half a model (the final checkpoint holds it: rerun to save it)."""
    with written_aside(out, "model", tensor_bytes(model.state_dict())) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    os.rmdir(tmp)


def sample(args, tok, model, device):
    """Rank 0 writes a sample, kept within the model's context (prompt + new tokens <= its positions)."""
    model.eval()
    torch.manual_seed(args.seed)
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 1024)
    prompt = tok(args.prompt).input_ids[-(context - 1):] or [tok.eos_token_id]
    new = min(args.sample_tokens, context - len(prompt))
    if new < args.sample_tokens:
        print0(f"note: sample shortened to {new} tokens: prompt + sample must fit the model's {context} positions")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=new, do_sample=True,
                             top_k=SAMPLE_TOP_K, temperature=SAMPLE_TEMPERATURE, pad_token_id=tok.eos_token_id)
    print0("sample:\n" + tok.decode(out[0], skip_special_tokens=True) + "\n")


def main(args):
    device = setup(args, min_world=1)
    if args.precision == "auto":
        args.precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if device.type == "cuda":  # TF32 matmuls: float32's range, 10-bit mantissa, tensor-core speed
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    wrapper = {"manual": ddp_class(args).__name__, "torch": "DistributedDataParallel", "naive": "average_gradients"}
    print0(f"world_size={WORLD} backend={dist.get_backend()} device={device.type} "
           f"impl={args.impl} ({wrapper[args.impl]}) precision={args.precision} torch={torch.__version__}")
    # What makes a checkpoint in --out fit this run: the model, and the shape of the default one.
    owner = {"script": os.path.basename(__file__), "model": args.model or "GPT-2 from scratch"}
    if not args.model:
        owner.update(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len)
    lock = claim(args.out, owner) if args.out else None  # held until this run ends
    import transformers
    transformers.logging.set_verbosity_error()  # long documents trigger a harmless length warning
    transformers.utils.logging.disable_progress_bar()
    tok, model, first, last = train(args, device, int(os.environ.get("LOCAL_RANK", 0)))
    finish(args, tok, model, device, first, last)
    if lock:
        lock.close()



# --- the drop-in surface: ManualDDP, the core with PyTorch's DDP arguments and API ---
def _let_gloo_threads_finish():
    """At exit, while the interpreter is still whole: give up the GIL a moment, so that a gloo worker thread that
    still has to free a Work (its destructor takes the GIL) does it now, not during finalisation (SIGABRT)."""
    time.sleep(0.05)


class _GradBucket(Bucket):
    """A core bucket that also answers what a DDP communication hook asks of torch.distributed.GradBucket."""

    def __init__(self, params, indices):
        super().__init__(params, indices)
        self._buffer, self._index, self._count = self.flat, -1, 0  # index and count: ManualDDP._set_buckets
        self.ready = [False] * len(params)  # slots done in this backward (unused ones are flushed at its end)
        self.zeroed = set()  # slots zeroed in forward for a gradient still to come (ManualDDP._grad_arriving)
        self.future = None  # what _finish waits for: the all-reduce's future, or the communication hook's

    def __getstate__(self):  # a copy of the wrapper has no message in flight
        return {**self.__dict__, "work": None, "future": None}

    def buffer(self):
        return self._buffer

    def set_buffer(self, tensor):
        self._buffer = tensor

    def index(self):
        return self._index

    def is_last(self):
        return self._index == self._count - 1

    def parameters(self):
        return self.params

    def gradients(self):
        offsets = itertools.accumulate([p.numel() for p in self.params], initial=0)
        return [self._buffer[o:o + p.numel()].view_as(p) for o, p in zip(offsets, self.params)]


class ManualDDP(DDPCore, Joinable):
    """torch.nn.parallel.DistributedDataParallel by hand: DDPCore plus what code written for PyTorch's class uses.

    Takes DDP's arguments, with DDP's defaults and meanings. Where the design makes one moot, it says so here:
    gradients always live in the buckets, so gradient_as_bucket_view and batched_grad_copy change nothing
    (the mean is taken as DDP's default path takes it: times 1/N); dim and check_reduction are unused, as in DDP
    for one device per process; mixed_precision (DDP's experimental, private _MixedPrecision) is not
    implemented: use torch.autocast. Ours: verify=True checks the replicas are identical instead of broadcasting.
    Everything here extends the core through the methods it calls: each override adds its part and calls the
    core's, but for four that replace a piece outright: buffers_to_sync (less the names DDP ignores),
    _sync_module_states (init_sync, verify), _grads_into_buckets (a .grad given only when its gradient comes)
    and _wait (a communication hook's future). Why each matches DDP the way it does: docs/manual_ddp.md.
    """

    bucket_class = _GradBucket

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None, init_sync=True,
                 process_group=None, bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                 gradient_as_bucket_view=False, static_graph=False, delay_all_reduce_named_params=None,
                 param_to_hook_all_reduce=None, mixed_precision=None, device_mesh=None,
                 skip_all_reduce_unused_params=False, bucket_cap_mb_list=None, batched_grad_copy=False,
                 forward_sync_buffers=None, *, verify=False):
        if mixed_precision is not None:
            raise NotImplementedError("ManualDDP has no mixed_precision=: use torch.autocast around forward")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None and device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set together.")
        for cap in [bucket_cap_mb] + list(bucket_cap_mb_list or []):
            if cap is not None and not cap > 0:
                raise ValueError(f"bucket sizes must be positive, got {cap}")
        if broadcast_buffers is not None:  # deprecated in DDP 2.14, which warns the same way
            warnings.warn("broadcast_buffers is deprecated: use forward_sync_buffers"
                          + (" (broadcast_buffers is ignored when both are given)" if forward_sync_buffers is not None
                             else "; note that forward_sync_buffers=False still broadcasts buffers at construction"),
                          FutureWarning, stacklevel=2)
        Joinable.__init__(self)
        atexit.unregister(_let_gloo_threads_finish)  # once per process, however many wrappers
        atexit.register(_let_gloo_threads_finish)
        # The options first: the core's constructor calls the methods below that read them (all plain values,
        # which an nn.Module accepts before its __init__).
        self.static_graph, self.find_unused_parameters = static_graph, find_unused_parameters
        self._init_sync, self._verify, self._cap_list = init_sync, verify, bucket_cap_mb_list
        # As in DDP 2.14: forward_sync_buffers, if given, wins (and buffers are broadcast at construction); else
        # broadcast_buffers (default True) rules both the broadcast at construction and the one before every forward.
        self._init_sync_buffers = forward_sync_buffers is not None or broadcast_buffers is not False
        if forward_sync_buffers is None:
            forward_sync_buffers = broadcast_buffers is not False
        # Names DDP leaves alone: those the model lists (DDP._set_params_and_buffers_to_ignore_for_model), and the
        # delayed parameters, which travel on their own: one bucket, sent when param_to_hook_all_reduce's gradient
        # is computed (for parameters another parallelism treats first). The trigger is kept in a tuple: as an
        # attribute of its own it would join the wrapper's parameters (and its state_dict), which DDP's does not.
        delayed = dict(delay_all_reduce_named_params or [])
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | set(delayed)
        self._delayed = [_GradBucket(list(delayed.values()), [])] if delayed else []  # zero or one bucket
        self._delay_trigger = (param_to_hook_all_reduce,) if delayed else ()
        trained = [p for n, p in module.named_parameters() if p.requires_grad and n not in self.parameters_to_ignore]
        devices = {p.device for p in trained + list(delayed.values())}
        self.device_ids, self.output_device = self._check_device_ids(device_ids, output_device, devices)
        group = device_mesh.get_group(0) if device_mesh is not None else process_group
        super().__init__(module, group, bucket_cap_mb, forward_sync_buffers)
        if device_mesh is not None:
            self.device_mesh = device_mesh  # as DDP: set only when given
        self.dim, self.gradient_as_bucket_view = dim, gradient_as_bucket_view
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self._first_sizes = ", ".join(str(b.flat.numel() * b.flat.element_size()) for b in self.buckets)
        self._rebuilt = find_unused_parameters and not static_graph  # never rebuilt then
        self._syncs, self._hook = 0, None  # synced backwards so far; the communication hook
        self._used = torch.zeros(len(self.params), dtype=torch.int32, device=self.device)
        self._unused, self._graph_static = [], True  # find_unused_parameters: for _get_ddp_logging_data
        self._hook_counts = [0] * len(self.params)  # static_graph: hooks per parameter seen in the first backward
        self._divide_by_initial, self._fresh, self._joining = True, set(), False
        # A synced backward that never reached _finish (it raised), or parameters left without a gradient: DDP's
        # errors at the next forward, and the last one for _get_ddp_logging_data.
        self._expect_finish, self._unreduced, self._error = False, [], None

    # -- the core's extension points --
    def _parameters_to_sync(self):
        named = [(n, p) for n, p in super()._parameters_to_sync() if n not in self.parameters_to_ignore]
        if not self._delayed and not any(p.requires_grad for _, p in named):
            raise RuntimeError(NOTHING_TO_AVERAGE)
        return named

    @property
    def buffers_to_sync(self):
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def _sync_module_states(self, params):
        state = params + (self.buffers_to_sync if self._init_sync_buffers else [])
        delayed = self._delayed[0].params if self._delayed else []
        if self._init_sync or self._verify:
            self._check_shapes(state)
        if self._verify:
            self._check_identical(state + delayed)
            return
        if delayed:  # sent even without init_sync, as DDP does
            self._broadcast(delayed, src=0)
        if self._init_sync and self.params:  # DDP skips it when every trained parameter is delayed
            self._broadcast(state, src=0)

    def _bucket_caps(self, bucket_cap_mb):
        """bucket_cap_mb_list caps each bucket in turn. With find_unused_parameters the graph may change from one
        iteration to the next, so DDP cuts the buckets by size at once (small first one included) and keeps them."""
        first, caps = super()._bucket_caps(bucket_cap_mb)
        if self._cap_list:
            caps = [int(c * (1 << 20)) for c in self._cap_list]
            return caps, caps
        if self.find_unused_parameters and not self.static_graph:
            return caps, caps
        return first, caps

    def _set_buckets(self, layout):
        super()._set_buckets(layout)
        for k, b in enumerate(self.buckets):  # what a communication hook reads: bucket.index(), is_last()
            b._index, b._count = k, len(self.buckets)
        self._index_slots()

    def _index_slots(self):
        # id(parameter) -> (bucket, slot), for the tensor hooks, which get the parameter, not its index
        self._slot = {id(p): (b, slot) for b in self.buckets + self._delayed for slot, p in enumerate(b.params)}

    def _register_hooks(self):
        super()._register_hooks()
        me = weakref.ref(self)
        for p in self.params + (self._delayed[0].params if self._delayed else []):
            p.register_hook(functools.partial(_call, me, "_grad_arriving", p))
        for p in self._delay_trigger:
            p.register_hook(functools.partial(_call, me, "_launch_delayed"))

    def forward(self, *inputs, **kwargs):
        notified = Join.notify_join_context(self)  # inside join(): an all-reduce counting the ranks still training
        if notified is not None:  # as DDP, each iteration: the initial world size, or the ranks still training
            self._divisor = self.world if self._divide_by_initial else int(notified.get_future().wait()[0].item())
        if self._joining:  # tell ranks that have joined whether this backward will communicate
            dist.all_reduce(torch.tensor([float(self.require_backward_grad_sync)], device=self.device),
                            group=self.process_group, async_op=True)
        if torch.is_grad_enabled():
            self._check_prior_reduction()
        if self.device_ids:  # as DDP: inputs move to this process's GPU
            inputs, kwargs = _to_device((inputs, kwargs), torch.device(self.device.type, self.device_ids[0]))
        return super().forward(*inputs, **kwargs)

    def _grads_into_buckets(self):
        """Unlike the core, a missing .grad becomes its (zeroed) slot only when its gradient arrives
        (_grad_arriving): a parameter that backward never reaches keeps .grad None, as under DDP."""
        for b in self.buckets + self._delayed:
            b.zeroed = set(self._zero_missing(b))
        # The parameters whose .grad this forward created (find_unused_parameters: None again if no rank used them)
        self._fresh = {b.indices[slot] for b in self.buckets for slot in b.zeroed}

    def _grad_arriving(self, p, grad):
        """A tensor hook: runs just before autograd adds p's gradient into p.grad."""
        if p.grad is None and grad is not None:  # an undefined gradient adds nothing: .grad stays None
            bucket, slot = self._slot[id(p)]
            if slot not in bucket.zeroed:  # forward did not zero it (it bypassed the wrapper)
                bucket.views[slot].zero_()
            bucket.zeroed.discard(slot)
            p.grad = bucket.views[slot]
        return grad

    def _on_grad_ready(self, i, p):
        if self.find_unused_parameters and p.grad is not None:  # None: autograd's gradient was undefined
            self._used[i] = 1  # used since the last sync (no_sync micro-steps count too)
        if self.static_graph and self.require_backward_grad_sync:
            self._queue_finish()
            if self._syncs == 0:
                self._hook_counts[i] += 1  # the first backward only counts (reentrant checkpointing fires twice)
                return
            if self._hook_counts[i] == 0:  # worded as DDP's error, which tools and PyTorch's tests match on
                raise self._record(RuntimeError(
                    f"Your training graph has changed in this iteration: {self.names[i]} got a gradient, but none "
                    "in the first iteration, which static_graph=True takes as the graph of every iteration. Use "
                    "static_graph=False (with find_unused_parameters=True if parameters go unused)."))
            self._left[i] -= 1
            if self._left[i] > 0:
                return  # this gradient is not complete yet
        super()._on_grad_ready(i, p)

    def _queue_finish(self):
        if not self._queued:
            self._expect_finish = True
            self._left = list(self._hook_counts)
        super()._queue_finish()

    def _mark_ready(self, bucket, slot):
        p, i = bucket.params[slot], bucket.indices[slot]
        if bucket.ready[slot]:
            raise RuntimeError(f"ManualDDP: the gradient of {self.names[i]} became ready twice in one backward "
                               "(reentrant activation checkpointing of a module also used outside it?). Use "
                               "torch.utils.checkpoint(..., use_reentrant=False), or static_graph=True.")
        if p.grad is None:  # no gradient on this rank (an unused parameter): it counts as zero in the mean
            self._fresh.add(i)
            bucket.views[slot].zero_()
            p.grad = bucket.views[slot]
        bucket.ready[slot] = True
        super()._mark_ready(bucket, slot)

    def _launch(self, b):
        # skip_all_reduce_unused_params: a bucket no parameter of which was used here is not sent (every rank must
        # then skip the same buckets, as DDP requires too).
        if self.skip_all_reduce_unused_params and not self._used[b.indices].any():
            return
        b.set_buffer(b.flat)
        if self._hook is not None:  # a communication hook decides how to average (it divides, not us)
            b.future = self._hook[1](self._hook[0], b)
            return
        super()._launch(b)
        b.future = b.work.get_future()

    def _finish(self):
        self._unreduced = self._missing()
        for b in self.buckets[self._next:]:  # a gradient that never came (unused here, or static_graph's first
            for slot, ready in enumerate(b.ready):  # backward) counts as zero: every bucket leaves, on every rank
                if not ready:
                    self._mark_ready(b, slot)
        self._launch_ready()
        if self.find_unused_parameters:
            # As DDP, for its logging data: is the set of parameters this rank leaves unused the same every time?
            unused = (self._used == 0).nonzero().flatten().tolist()
            self._graph_static &= self._syncs == 0 or self.static_graph or unused == self._unused
            self._unused = unused
            self._used_work = dist.all_reduce(self._used, group=self.process_group, async_op=True)  # kept: Bucket
            self._used_work.wait()  # which parameters some rank used
        super()._finish()
        for b in self._delayed:
            self._wait(b)
        if self.find_unused_parameters:  # as DDP: a parameter no rank used keeps .grad untouched (None)
            for i in (self._used == 0).nonzero().flatten().tolist():
                if i in self._fresh:
                    self.params[i].grad = None
            self._used.zero_()
        for b in self.buckets + self._delayed:
            b.ready, b.zeroed = [False] * len(b.params), set()
        self._syncs, self._expect_finish = self._syncs + 1, False

    def _wait(self, b):
        if b.future is None:
            return  # not sent (skip_all_reduce_unused_params)
        result = b.future.wait()
        result = result[0] if isinstance(result, list) else result
        if result.data_ptr() != b.flat.data_ptr():  # a hook may return another tensor: take its values
            b.flat.copy_(result)
        b.future = None

    def _sync_buffers(self, src=0):
        if self._joining:  # rank 0 may have joined and hold stale buffers: take a rank still training
            src = self._common_rank(True)
        super()._sync_buffers(src)

    # -- DDP's errors for a parameter without a gradient --
    def _missing(self):
        """The parameters that DDP would call unreduced at the end of this backward: without
        find_unused_parameters every one must get a gradient; with static_graph, every one the first backward saw."""
        if self.find_unused_parameters or (self.static_graph and self._syncs == 0):
            return []
        return [i for b in self.buckets for slot, i in enumerate(b.indices)
                if not b.ready[slot] and (not self.static_graph or self._hook_counts[i] > 0)]

    def _check_prior_reduction(self):
        """DDP's check before a forward: the last synced backward must have finished, every gradient reduced."""
        if self._expect_finish:  # that backward raised before its end: its buckets are half done
            self._unreduced, self._expect_finish, self._queued, self._next = self._missing(), False, False, 0
            for b in self.buckets + self._delayed:
                if b.future is not None:
                    b.future.wait()  # the all-reduces already launched, on every rank alike
                b.ready, b.pending, b.future = [False] * len(b.params), len(b.params), None
        if not self._unreduced:
            return
        names = ", ".join(self.names[i] for i in self._unreduced)
        indices = ", ".join(map(str, self._unreduced))
        rank, self._unreduced = dist.get_rank(self.process_group), []
        # Worded as DDP's message (tools and PyTorch's own tests match on its phrases), with the names always.
        if self.static_graph:
            why = ("This error indicates that your training graph has changed in this iteration, e.g., one parameter "
                   "is used in first iteration, but then got unused in the second iteration. this is not compatible "
                   "with static_graph set to True.")
        else:
            why = ("Some parameters got no gradient in the last backward that synchronised: enable unused parameter "
                   "detection by passing the keyword argument `find_unused_parameters=True` to ManualDDP, and make "
                   "sure all `forward` function outputs participate in calculating loss. (PyTorch's DDP names "
                   "them only if you set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or "
                   "DETAIL; ManualDDP always does.)")
        raise self._record(RuntimeError(
            f"Expected to have finished reduction in the prior iteration before starting a new one. {why}\n"
            f"Parameter indices which did not receive grad for rank {rank}: {indices}\n"
            f"Parameters which did not receive grad for rank {rank}: {names}"))

    def _record(self, error):
        self._error = str(error)  # for _get_ddp_logging_data, as DDP logs its errors
        return error

    # -- DDP's constructor checks, buffers, communication hooks, join --
    def _check_device_ids(self, device_ids, output_device, devices):
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        kind = next(iter(devices)).type if len(devices) == 1 else None  # one device: "cuda", say, or "cpu"
        if not device_ids or kind in (None, "cpu"):
            if device_ids or output_device is not None:
                raise ValueError("DistributedDataParallel device_ids and output_device arguments only work with "
                                 "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                                 f"{device_ids}, output_device {output_device}, and module parameters {devices}.")
            return None, None
        index = [torch.device(kind, d).index if isinstance(d, int) else torch.device(d).index for d in device_ids]
        out = index[0] if output_device is None else torch.device(kind, output_device).index
        return index, out

    @property
    def broadcast_buffers(self):
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value):
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self):
        return self.require_forward_param_sync and self.forward_sync_buffers and len(self.buffers_to_sync) > 0

    def _common_rank(self, candidate):
        rank = torch.tensor([dist.get_rank(self.process_group) if candidate else -1], device=self.device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(rank.item())

    def _launch_delayed(self, grad):
        if not self.require_backward_grad_sync:
            return grad
        self._queue_finish()
        bucket = self._delayed[0]
        bucket.flat.mul_(1 / self._divisor)
        bucket.work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)  # kept: see Bucket.work
        bucket.future = bucket.work.get_future()
        return grad

    def register_comm_hook(self, state, hook):
        """DDP's contract: hook(state, bucket) -> torch.futures.Future[Tensor] with the bucket's averaged values."""
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        if self._hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._hook = (state, hook)

    # -- pickling (torch.save(ddp_model), copy.deepcopy), as DDP allows it --
    def __getstate__(self):
        """As DDP: only with the default group (a process group cannot be pickled: the copy gets the default group
        back when loaded); the communication hook is not kept (DDP's lives in its C++ reducer and is lost too)."""
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError("ManualDDP can be pickled only with the default process group (as DDP): a process "
                               "group cannot be pickled")
        state = dict(self.__dict__)
        del state["process_group"]
        state.pop("_used_work", None)
        state["_hook"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        # The copy's parameters are new objects: index them again, and give them hooks (tensors are pickled without)
        self._index_slots()
        self._register_hooks()

    def _get_ddp_logging_data(self):
        """DDP's summary of itself (private, but Lightning's teardown reads it): the keys DDP fills from its
        arguments and buckets, from this wrapper's real state. DDP's timings are not measured here, so absent."""
        data = {
            "module_name": type(self.module).__name__, "backend_name": dist.get_backend(self.process_group),
            "world_size": self.world, "rank": dist.get_rank(self.process_group),
            "device_ids": ", ".join(map(str, self.device_ids or [])),
            "output_device": -1 if self.output_device is None else self.output_device,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())),
            "is_multi_device_module": 0,
            "num_parameter_tensors": len(self.params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in self.params),
            "dtypes": ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in self.params})),
            "bucket_cap_bytes": self._caps[-1],
            "bucket_sizes": self._first_sizes,
            "has_rebuilt_buckets": int(self._rebuilt and not (self.find_unused_parameters and not self.static_graph)),
        }
        if data["has_rebuilt_buckets"]:
            data["rebuilt_bucket_sizes"] = ", ".join(str(b.flat.numel() * b.flat.element_size()) for b in self.buckets)
        if self.static_graph:  # these three, as DDP, only once they apply
            data["static_graph"] = 1
        if self._joining:
            data["join_uneven_inputs"] = 1
        if self._hook is not None:
            data["comm_hook"] = getattr(self._hook[1], "__qualname__", repr(self._hook[1]))
        # DDP writes this key while training only once the graph proved dynamic (the set of unused parameters
        # changed between iterations); a static graph is reported when DDP is destroyed.
        if not self._graph_static:
            data["can_set_static_graph"] = 0
        if self._error is not None:  # as DDP after it raised
            data.update(iteration=self._syncs, has_error=1, error=self._error)
        return data

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """Uneven inputs: a rank out of data shadows the others' collectives with zeros until all are done."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def _check_shapes(self, state):
        """As DDP: every rank must hold the same tensors (count, shapes, dtypes) before anything is broadcast."""
        mine = [(tuple(t.shape), str(t.dtype)) for t in state]
        theirs = [mine]
        dist.broadcast_object_list(theirs, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        differs = torch.tensor([float(theirs[0] != mine)], device=self.device)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=self.process_group)  # all raise, or none
        if differs.item():
            raise RuntimeError("DistributedDataParallel: the model differs across ranks (number, shapes or dtypes of "
                               "its parameters and buffers): build the same model on every rank")

    def _check_identical(self, state):
        differs = torch.zeros(1, device=self.device)
        for t in state:
            ref = t.detach().clone()
            dist.broadcast(ref, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
            differs += 0 if torch.equal(ref, t.detach()) else 1
        # Agree on the verdict first: if only some ranks raised, the others would wait in the next collective.
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=self.process_group)
        if differs.item():
            raise ValueError("ManualDDP(verify=True): model replicas differ across ranks; seed model creation "
                             "identically on every rank (torch.manual_seed before building it)")


class _JoinHook(JoinHook):
    """A rank that ran out of data mirrors every collective the others still issue, with zeros for gradients."""

    def __init__(self, ddp, divide_by_initial_world_size):
        self.ddp = ddp
        ddp._divide_by_initial, ddp._joining = divide_by_initial_world_size, True  # from here on, as in DDP

    def main_hook(self):
        ddp = self.ddp
        flag = torch.zeros(1, device=ddp.device)  # will the others synchronize this backward?
        dist.all_reduce(flag, group=ddp.process_group)
        if flag.item():
            ddp._maybe_rebuild()
        if ddp.require_forward_param_sync and ddp.forward_sync_buffers and ddp.buffers_to_sync:
            ddp._broadcast(ddp.buffers_to_sync, ddp._common_rank(False))  # the ranks training take the same
        ddp.require_forward_param_sync = bool(flag.item())
        if not flag.item():
            return
        for b in ddp.buckets:
            b.flat.zero_()
            ddp._launch(b)
        for b in ddp.buckets:
            if b.future is not None:
                b.future.wait()
                b.future = None
        if ddp.find_unused_parameters:
            dist.all_reduce(torch.zeros_like(ddp._used), group=ddp.process_group)
        if not ddp._rebuilt and not ddp._order:
            ddp._order = list(range(len(ddp.params)))  # as DDP: a joined rank offers parameter order

    def post_hook(self, is_last_joiner):
        """Everyone ends with the model of a rank that trained last."""
        ddp = self.ddp
        src = ddp._common_rank(is_last_joiner)
        params = [p for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
        ddp._broadcast(params + (ddp.buffers_to_sync if ddp.forward_sync_buffers else []), src)



def _to_device(obj, device):
    """The tensors in nested tuples, lists and dicts, moved to device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def bf16_compress_hook(process_group, bucket):
    """A DDP communication hook, by hand: each bucket travels as bfloat16, half the bytes of float32.

    Divide first (in float32: a sum of fp16/bf16 gradients could overflow where their mean would not), cast,
    all-reduce the sum, and cast back into the bucket. Runs on ManualDDP and on PyTorch's DDP alike.
    """
    group = process_group or dist.group.WORLD
    compressed = bucket.buffer().div(group.size()).to(torch.bfloat16)
    sent = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        return bucket.buffer().copy_(fut.value()[0])
    return sent.then(decompress)




# --- checkpoints: the same block in 05, 06 and 08, one contract for every --out ---
def claim(out, owner):
    """Global rank 0 takes --out for this run, or every rank stops with one line. Two runs into one --out would
    overwrite each other: an flock keeps the second out (the kernel drops it when its process dies, even by
    SIGKILL, so a crash leaves no stale lock). And a run never writes over what another script or another model
    left: owner.json says who writes here. Returns the open lock file: keep it for the whole run."""
    lock, error = None, [None]
    if RANK == 0:
        path = os.path.join(out, ".lock")
        try:
            os.makedirs(out, exist_ok=True)
            existed, lock = os.path.exists(path), open(path, "a")
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            error[0] = not_ours(out, owner)
            if error[0] and not existed:  # leave a directory that is not ours as we found it
                os.remove(path)
        except BlockingIOError:
            error[0] = f"--out {out} is in use by another run (it holds {out}/.lock): wait for it or pick another"
        except UsageError as e:  # owner.json did not fit on the disk
            error[0] = str(e)
        except OSError as e:  # a read-only or full disk: one line for every rank, not a traceback on rank 0
            error[0] = f"cannot write to --out {out}: {e.strerror}"
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise UsageError(error[0])
    return lock


def not_ours(out, owner):
    """Why this run must not write into `out` (the files of another script, or of another model), or None."""
    path = os.path.join(out, "owner.json")
    if not os.path.exists(path):
        theirs = sorted(set(os.listdir(out)) - {".lock"})
        if theirs:
            return (f"--out {out} holds files that no run of {owner['script']} wrote ({', '.join(theirs[:3])}"
                    f"{', ...' if len(theirs) > 3 else ''}): pick a new or empty directory")
        text = json.dumps(owner, indent=1)
        with written_aside(out, "owner.json", len(text)) as tmp:
            with open(os.path.join(tmp, "owner.json"), "w") as f:
                f.write(text)
        os.replace(os.path.join(tmp, "owner.json"), path)
        os.rmdir(tmp)
        return None
    try:
        with open(path) as f:
            theirs = json.load(f)
    except (OSError, ValueError) as e:
        return f"{path} does not load ({type(e).__name__}): pick another --out"
    if theirs.get("script") != owner["script"]:
        return f"--out {out} belongs to {theirs.get('script')} (its {path}): pick another --out"
    for key, value in owner.items():
        if theirs.get(key) != value:
            return (f"--out {out} holds a model with {key} {theirs.get(key)}, this run has {value}: use the "
                    "flags that wrote it, or another --out")
    return None


def checkpoints(out):
    """The checkpoint-STEP directories in ``out``, oldest first."""
    names = [d for d in os.listdir(out) if d.startswith("checkpoint-") and d.split("-")[1].isdigit()]
    return sorted(names, key=lambda d: int(d.split("-")[1]))


def resume_state(out):
    """(path, state) of the newest checkpoint in --out that loads, on every rank; (None, None) if there is none.

    Global rank 0 chooses and tells the others, so that all resume from the same step. A checkpoint that does not
    load (a disk fault, a copy cut short) is skipped with a warning and kept, renamed out of the way of the saves
    and their pruning. Mapped, not read: a rank reads only the pages of what it uses. Called before the model and
    data are built, so that a rank that cannot read it stops the run at once, not minutes later.
    """
    state, choice = None, [None]
    names = checkpoints(out) if RANK == 0 and out and os.path.isdir(out) else []
    for name in reversed(names):
        try:
            state = torch.load(os.path.join(out, name, "state.pt"), map_location="cpu", weights_only=True, mmap=True)
            choice[0] = os.path.join(out, name)
            break
        except Exception as e:
            kept = f"{os.path.join(out, name)}.damaged-{int(time.time())}"
            os.replace(os.path.join(out, name), kept)
            print0(f"warning: skipped {os.path.join(out, name)}: it does not load ({type(e).__name__}); kept as {kept}")
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None, None
    error = None
    if RANK != 0:  # on several nodes every rank must see rank 0's --out (a shared filesystem)
        try:
            state = torch.load(os.path.join(choice[0], "state.pt"), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            error = f"rank {RANK} cannot read {choice[0]} ({type(e).__name__}): every node must see rank 0's --out"
    errors = [None] * WORLD
    dist.all_gather_object(errors, error)  # all stop together, none left waiting in a collective
    if any(errors):
        raise UsageError(next(e for e in errors if e))
    return choice[0], state


def save_checkpoint(out, step, state, keep):
    """Global rank 0 only (all replicas are identical, and N writers to one path would corrupt it): call it
    through on_rank_0, so that every rank learns whether it could.

    Written into a temporary directory, fsynced, then renamed: a crash mid-write leaves the previous
    checkpoint intact and never a half-written one under a checkpoint-STEP name.
    """
    with written_aside(out, f"checkpoint-{step}", tensor_bytes(state)) as tmp:
        with open(os.path.join(tmp, "state.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, f"checkpoint-{step}"))
    # Prune: the newest `keep` checkpoints stay, and so does nothing a crash may have left half-written.
    for d in checkpoints(out)[:-keep] + [d for d in os.listdir(out) if d.startswith(".tmp-")]:
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)


def on_rank_0(write, *args):
    """Every rank calls it; global rank 0 runs write(*args). If that fails in one line (a full disk), every rank
    stops with that line: alone, rank 0 would stop and the others report a lost peer at their next collective."""
    error = [None]
    if RANK == 0:
        try:
            write(*args)
        except UsageError as e:
            error[0] = str(e)
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise UsageError(error[0])


@contextlib.contextmanager
def written_aside(out, name, needed):
    """A new temporary directory in `out` to write `name` into, which the caller then moves into place. Whatever
    stops the write (a full disk, Ctrl-C) removes it, so nothing half-written is left; a write the system refused
    becomes one line naming the directory and the space it needs (`needed`, in bytes)."""
    tmp = os.path.join(out, f".tmp-{name}")
    try:
        os.makedirs(tmp, exist_ok=True)
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if signalled(e):  # Ctrl-C mid-write, which torch.save may report as an error of its own
            raise signalled(e) from None
        reason = refused_write(e)
        if reason is None:
            raise  # not the disk's doing: a bug keeps its traceback
        free = shutil.disk_usage(out).free if os.path.isdir(out) else 0
        raise UsageError(f"cannot write {name} to {out}: {reason}: it needs about {size(needed)}, {size(free)} is "
                         f"free there. Make room; {newest_checkpoint(out)}") from None


def refused_write(e):
    """Why the system refused a write (no space, a quota, an I/O error), from the exception or its causes, or None.
    torch.save raises a RuntimeError in the course of handling the OSError; safetensors' writer (save_pretrained)
    gives only the text of it ("I/O error: No space left on device (os error 28)")."""
    while e is not None:
        if isinstance(e, OSError):
            return e.strerror or str(e)
        if "(os error " in str(e):
            return str(e).rsplit(": ", 1)[-1].split(" (os error ")[0]
        e = e.__cause__ or e.__context__
    return None


def tensor_bytes(state):
    """About what torch.save writes for `state`: every tensor's storage once (tied weights share one)."""
    storages, todo = {}, [state]
    while todo:
        x = todo.pop()
        if torch.is_tensor(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return sum(storages.values())


def size(n):
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def newest_checkpoint(out):
    """What a run that stops early leaves behind, and how to go on: the end of its one line."""
    names = checkpoints(out) if out and os.path.isdir(out) else []
    if names:
        return f"the newest checkpoint is {os.path.join(out, names[-1])}; rerun the same command to resume"
    if out:
        return f"{out} holds no checkpoint yet; rerun the same command to start again"
    return "nothing was saved (no --out)"


# --- command line ---
def parse_args(argv=None):
    p = parser(__doc__, timeout_s=300)
    count, positive, at_least_0 = number(int, 1), number(float, 0, above=True), number(float, 0)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="HF causal LM name or local dir; default: a small GPT-2 from scratch")
    g.add_argument("--n-layer", type=count, default=4, help="default model only")
    g.add_argument("--n-embd", type=count, default=128, help="default model only")
    g.add_argument("--n-head", type=count, default=4, help="default model only")
    g.add_argument("--dataset", default="stdlib",
                   help="'stdlib' (Python's sources), local files/dir/glob, or a HF dataset name")
    g.add_argument("--dataset-config", default=None, help="HF dataset config, e.g. wikitext-2-raw-v1")
    g.add_argument("--split", default="train", help="HF dataset split")
    g.add_argument("--text-column", default="text", help="column holding the text")
    g.add_argument("--stdlib-files", type=count, default=40, help="how many stdlib .py files --dataset stdlib reads")
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=count, default=8, help="sequences per rank per micro-batch")
    g.add_argument("--grad-accum", type=count, default=1, help="micro-batches per optimizer step (no_sync between)")
    g.add_argument("--seq-len", type=count, default=128, help="tokens per sequence")
    g.add_argument("--max-steps", type=count, default=300, help="optimizer steps")
    g.add_argument("--lr", type=positive, default=2e-3, help="peak learning rate")
    g.add_argument("--warmup-steps", type=number(int, 0), default=30, help="linear warm-up steps before cosine decay")
    g.add_argument("--weight-decay", type=at_least_0, default=0.1, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=at_least_0, default=1.0, help="clip the synced gradient norm (0: off)")
    g.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="autocast dtype; auto: bf16 on a GPU that has it, fp32 on the CPU (exact, as the tests check)")
    g.add_argument("--compile", action="store_true", help="torch.compile each transformer block (overlap kept)")
    g.add_argument("--peak-tflops", type=positive, default=None,
                   help="the GPU's peak TFLOP/s at --precision, for MFU (known for some GPUs in bf16)")
    g.add_argument("--seed", type=number(int, 0, 2**32 - 1), default=0,
                   help="model init (same on all ranks) and data order")
    g = p.add_argument_group("DDP")
    g.add_argument("--impl", choices=["manual", "naive", "torch"], default="manual", help="whose DDP")
    g.add_argument("--bucket-cap-mb", type=number(float, 0, 2**20, above=True), default=None,
                   help="gradient bucket size (default: PyTorch's, 25 MiB with a 1 MiB first bucket)")
    g.add_argument("--comm-hook", choices=["none", "bf16"], default="none",
                   help="bf16: gradients travel as bfloat16 (half the bytes), via a DDP communication hook")
    g = p.add_argument_group("checkpoints, output")
    g.add_argument("--out", default=None, help="checkpoint dir: resume from it, save to it, final save_pretrained")
    g.add_argument("--ckpt-every", type=count, default=50, help="steps between checkpoints")
    g.add_argument("--keep-checkpoints", type=count, default=2, help="newest checkpoints kept")
    g.add_argument("--log-every", type=count, default=25, help="steps between loss lines")
    g.add_argument("--profile", default=None, help="write a torch.profiler trace of steps 3-5 per rank here")
    g.add_argument("--prompt", default="def ", help="start of the generated sample")
    g.add_argument("--sample-tokens", type=number(int, 0), default=120, help="tokens generated at the end (0: none)")
    g.add_argument("--crash-at-step", type=int, default=-1,
                   help="demo: SIGKILL the last rank at this step, first attempt only")
    args = p.parse_args(argv)
    # Every value is checked here, before any process group or file: a bad one costs one line, not a run.
    if args.comm_hook != "none" and args.impl == "naive":
        p.error("--comm-hook needs a DDP to hook into: --impl manual or torch")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} must be divisible by --n-head {args.n_head}")
    for name in ("model", "dataset"):  # a local path (not a Hugging Face name) that is not there
        path = getattr(args, name) or ""
        if path.startswith(("/", ".", "~")) and not glob.glob(os.path.expanduser(path)):
            p.error(f"--{name} {path!r}: no such file or directory")
    for flag, path in (("--out", args.out), ("--profile", args.profile)):  # last: they make the directories
        if path and not_a_directory(path):
            p.error(f"{flag} {path}: {not_a_directory(path)}")
    return args


def a_file_on_the_way(path):
    """The file that stands where directory `path` or one of its parents should be, or None."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return None if os.path.isdir(existing) else existing


def not_a_directory(path):
    """Why this run cannot write into directory `path`, or None. Decided by trying: it makes the directory (and
    writes nothing in it); permission bits can say yes where the kernel says no (a path under /proc as root)."""
    if a_file_on_the_way(path):
        return f"{a_file_on_the_way(path)} is a file, not a directory"
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        return f"cannot write there ({e.strerror or type(e).__name__})"
    return None


# --- distributed setup: the same block in every numbered script, copied (not imported) so each file runs alone ---
RANK, WORLD = 0, 1


class UsageError(Exception):
    """Bad input: one line on rank 0 (`error: ...`), exit status 2, no traceback."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM, raised in the main thread, so the run unwinds through its own cleanup (nothing is
    left half-written). Code that knows where the run stopped sets `where` for run()'s one line."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.where = signum, ""


def print0(*msg):  # the rank-0 narrative: printed once, not N times
    if RANK == 0:
        print(*msg, flush=True)


def log(*msg):  # a per-rank line, tagged, in one write so that lines of different ranks never mix
    sys.stdout.write(f"[rank {RANK}/{WORLD}] " + " ".join(map(str, msg)) + "\n")
    sys.stdout.flush()


def number(kind, low, high=math.inf, above=False):
    """The argparse type of every numeric flag: a finite int or float from `low` (or above it) to `high`."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            bound = f"{'>' if above else '>='} {low}" + (f" and <= {high}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


def parser(doc, timeout_s=120):
    """argparse with the flags every script shares; a bad flag is one line on rank 0, not a usage text per rank."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def error(message):
        raise UsageError(message)
    p.error = error
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if GPUs >= ranks")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl if every rank has a GPU")
    p.add_argument("--timeout-s", type=number(float, 1, 30 * 86400), default=timeout_s,
                   help="how long a rank waits for a dead or stuck peer")
    return p


def choose_device(device, backend, n_gpus, local_rank, local_world):
    """(device, backend, note) from the flags and this node's GPUs. NCCL needs a GPU per rank; gloo shares."""
    if device == "cpu" or (device == "auto" and n_gpus == 0):
        if backend == "nccl":
            raise UsageError("--backend nccl runs on CUDA GPUs only: use gloo on the CPU")
        return torch.device("cpu"), "gloo", None
    if n_gpus == 0:
        raise UsageError("--device cuda, but this node has no CUDA GPU: use --device cpu")
    if n_gpus >= local_world:  # the usual GPU setup: local rank r takes cuda:r
        return torch.device("cuda", local_rank), backend or "nccl", None
    fix = f"start --nproc_per_node={n_gpus}, or share the GPU(s) over gloo with --device cuda --backend gloo"
    if backend == "nccl":
        raise UsageError(f"nccl needs one GPU per rank, but this node has {n_gpus} for {local_world} ranks: {fix}")
    if device == "auto":
        return torch.device("cpu"), "gloo", f"{n_gpus} GPU(s) for {local_world} ranks here, so CPU and gloo; {fix}"
    return torch.device("cuda", local_rank % n_gpus), "gloo", f"{local_world} ranks share {n_gpus} GPU(s) over gloo"


def setup(args, min_world=2):
    """Choose the device, then join the process group. Global RANK names a process; LOCAL_RANK picks its GPU."""
    global RANK, WORLD
    RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if WORLD < min_world:
        raise UsageError(f"needs {min_world} or more ranks: launch with torchrun, e.g. torchrun "
                         f"--nproc_per_node={min_world} {sys.argv[0]}")
    n_gpus = 0 if args.device == "cpu" else torch.cuda.device_count()  # --device cpu never touches CUDA
    device, backend, note = choose_device(args.device, args.backend, n_gpus, int(os.environ.get("LOCAL_RANK", 0)),
                                          int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if note:
        print0(f"note: {note}")
    if device.type == "cuda":  # before init, so NCCL binds this rank to its GPU (not device_id=: pytorch#153960)
        torch.cuda.set_device(device)
    # Plain `python` (no torchrun): a group of one, in memory, so the same code runs. The timeout turns a dead peer
    # into an error after --timeout-s instead of a silent 30-minute hang.
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s), **alone)
    return device


def run(main, parse_args):
    """Bad input: one line on rank 0, exit 2. A peer that died or timed out: one line per survivor, exit 1.
    Ctrl-C or SIGTERM: one line on rank 0, and the process ends by that signal, as a shell expects (130, 143)."""
    # SIGTERM (a scheduler's, or torchrun passing on the Ctrl-C it got) stops a run the way Ctrl-C does.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    code = 0
    try:  # the outer try: a signal may land anywhere, even while the inner one reports a lost peer
        try:
            main(parse_args())
        except UsageError as e:
            if os.environ.get("RANK", "0") == "0":  # every rank stops alike; one says why
                print(f"error: {e}", file=sys.stderr, flush=True)
            code = 2
        except RuntimeError as e:  # NCCL raises DistError; gloo, RuntimeErrors from torch.distributed or its transport
            where, text = traceback.extract_tb(e.__traceback__)[-1].filename, str(e)
            if signalled(e) or not (isinstance(e, dist.DistError) or f"torch{os.sep}distributed" in where
                                    or "gloo/" in text):
                raise  # a bug in this rank's own code keeps its traceback; a signal goes to the outer try
            what = "timed out waiting for a peer" if "timed out" in text.lower() else "lost a peer"
            log(f"error: {what} ({text.strip().splitlines()[0][:160]})")
            os._exit(1)  # no teardown: it would wait for the dead peer
        if dist.is_initialized():
            dist.destroy_process_group()
            # gloo's threads may still hold the last reference to a finished collective; freeing it takes the GIL,
            # which no thread gets once the interpreter is finalising ("terminate called without an active
            # exception", SIGABRT). A moment here lets them finish first.
            time.sleep(0.05)
    except BaseException as e:
        stop = signalled(e)
        if stop is None:
            raise
        if os.environ.get("RANK", "0") == "0":  # every rank got the signal (torchrun passes it on); one says where
            where = f" {stop.where}" if stop.where else ""
            print(f"interrupted by {stop}{where}", file=sys.stderr, flush=True)
        end_by_signal(stop.signum)  # no teardown: the peers are stopping too
    sys.exit(code)


def signalled(e):
    """The Interrupted behind exception `e`, or None. A signal that lands inside a library can come back as that
    library's own error, raised while handling it (torch.save's "unexpected pos" when its write was cut short)."""
    while e is not None and not isinstance(e, Interrupted):
        e = e.__context__
    return e


def interrupt(signum, frame):
    # Only the first signal: a second Ctrl-C must not cut the way out (cleanup, the one line) short with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def end_by_signal(signum):
    """End this process as the signal would have: its parent (a shell, torchrun) sees an interrupt, not a failure."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


if __name__ == "__main__":
    run(main, parse_args)
