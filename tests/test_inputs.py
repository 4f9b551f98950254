"""Inputs nobody here made (issue #33): a model whose tokenizer has more tokens than its embedding has rows, text
that is not UTF-8, MNIST files that are each valid but disagree. Each stops before any work, in one line from
rank 0, on 2 ranks that exit alike and never hang; the neighbours that must still run (an embedding larger than
the tokenizer, a picture beside the text) run.
"""

import json
import struct

import pytest

import launch
from conftest import load_script

GPT2, RESNET = "05_manual_ddp_gpt2.py", "06_torch_ddp_resnet.py"
TINY = ["--seq-len", "32", "--batch-size", "4", "--max-steps", "2", "--log-every", "1", "--sample-tokens", "0"]


def idx(path, magic, dims, payload):
    """A file in the IDX format MNIST ships in: big-endian magic number and dimensions, then the bytes."""
    path.write_bytes(struct.pack(f">{1 + len(dims)}I", magic, *dims) + payload)


def mnist(root, images=8, labels=8, side=28, label=None, magic=0x803, cut=None):
    """torchvision's four MNIST files; the training pair as asked (a count, a size, one label, a magic number),
    and the test images cut to `cut` bytes if given."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split in ("train", "t10k"):
        n, m, s = (images, labels, side) if split == "train" else (8, 8, 28)
        ys = bytearray(i % 10 for i in range(m))
        if label is not None and split == "train":
            ys[5] = label
        idx(raw / f"{split}-images-idx3-ubyte", magic if split == "train" else 0x803, (n, s, s), bytes(n * s * s))
        idx(raw / f"{split}-labels-idx1-ubyte", 0x801, (m,), bytes(ys))
    if cut is not None:
        path = raw / "t10k-images-idx3-ubyte"
        path.write_bytes(path.read_bytes()[:cut])
    return root


def text(folder, n=3):
    folder.mkdir()
    for i in range(n):
        (folder / f"doc{i}.txt").write_text("".join(f"line {j} of document {i}: the quick brown fox.\n"
                                                    for j in range(200)))
    return folder


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64)  # a PNG's first bytes: a NUL at offset 8


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Local models saved with save_pretrained (offline), text files, MNIST directories."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("inputs")
    tok = load_script(GPT2).byte_tokenizer()  # 257 tokens: 256 bytes, then <|endoftext|>

    def llama(rows):
        return LlamaForCausalLM(LlamaConfig(vocab_size=rows, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, tie_word_embeddings=True))
    for name, model in (("llama256", llama(256)), ("llama200", llama(200)), ("llama320", llama(320))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    # A GPT-2 of exactly the byte tokenizer's 257 rows, saved with a pad token added after them (as a fine-tuning
    # recipe does) but without resize_token_embeddings.
    gpt2 = GPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=256,
                      eos_token_id=256)
    GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2pad")
    padded = load_script(GPT2).byte_tokenizer()
    padded.add_special_tokens({"pad_token": "<pad>"})
    padded.save_pretrained(root / "gpt2pad")
    text(root / "text")
    (root / "latin1.txt").write_bytes("un café, s'il vous plaît\n".encode("latin-1") * 100)
    (root / "utf16.txt").write_bytes("hello\n".encode("utf-16"))
    (root / "blob.bin").write_bytes(bytes(range(256)) * 8)
    (text(root / "with_latin1") / "notes.txt").write_bytes("naïve\n".encode("latin-1"))
    (text(root / "with_png") / "figure.png").write_bytes(PNG)
    (root / "pictures").mkdir()
    for name in ("a.png", "b.png"):
        (root / "pictures" / name).write_bytes(PNG)
    mnist(root / "counts", images=64, labels=10)
    mnist(root / "cut", cut=1000)
    mnist(root / "cut_header", cut=10)
    mnist(root / "magic", magic=0x801)
    mnist(root / "side", side=32)
    mnist(root / "label", label=12)
    return root


def cases(root):
    """(script, arguments, the error line's text, or None for a run that must finish with OK)."""
    data = ["--dataset", root / "text"]
    mn = ["--epochs", "1", "--batch-size", "8", "--data-dir"]
    return [
        (GPT2, ["--model", root / "llama256", *data], "its tokenizer has 257 tokens, its embedding 256 rows, so "
                                                      "'<|endoftext|>' (id 256) would index past it"),
        (GPT2, ["--model", root / "llama200", *data], "its embedding 200 rows, so 'Č' (id 200), 'č' (id 201), "
                                                      "'Ď' (id 202) ... would index past it"),
        (GPT2, ["--model", root / "gpt2pad", *data], "its tokenizer has 258 tokens, its embedding 257 rows, so "
                                                     "'<pad>' (id 257) would index past it"),
        (GPT2, ["--model", root / "llama320", *data, "--sample-tokens", "8"], None),  # a larger embedding is fine
        (GPT2, ["--dataset", root / "latin1.txt"], f"{root / 'latin1.txt'} is not UTF-8 text (byte 0xe9 at offset "
                                                   "6, line 1)"),
        (GPT2, ["--dataset", root / "with_latin1"], f"{root / 'with_latin1' / 'notes.txt'} is not UTF-8 text"),
        (GPT2, ["--dataset", root / "utf16.txt"], "utf16.txt is UTF-16 text, not UTF-8"),
        (GPT2, ["--dataset", root / "blob.bin"], f"no text: {root / 'blob.bin'} is binary (a NUL byte at offset 0)"),
        (GPT2, ["--dataset", root / "pictures"], f"no text: {root / 'pictures' / 'a.png'} is binary (a NUL byte at "
                                                 "offset 8), and 1 more"),
        (GPT2, ["--dataset", root / "with_png"], None),  # the text is read, the picture skipped with a note
        (RESNET, [*mn, root / "counts"], "train-images-idx3-ubyte holds 64 images but train-labels-idx1-ubyte 10 "
                                         "labels"),
        (RESNET, [*mn, root / "cut"], "t10k-images-idx3-ubyte has 1,000 bytes, but its header promises 6,288 "
                                      "(8 images)"),
        (RESNET, [*mn, root / "cut_header"], "t10k-images-idx3-ubyte is cut short: 10 bytes, less than its header"),
        (RESNET, [*mn, root / "magic"], "train-images-idx3-ubyte is not an IDX file of images: its magic number is "
                                        "0x00000801, not 0x00000803"),
        (RESNET, [*mn, root / "side"], "train-images-idx3-ubyte holds 32 x 32 images, not MNIST's 28 x 28"),
        (RESNET, [*mn, root / "label"], "train-labels-idx1-ubyte holds label 12 at index 5, outside MNIST's 0-9"),
    ]


def test_foreign_inputs_stop_every_rank_in_one_line_before_any_work(inputs, tmp_path):
    """Every case is a job of 2 ranks (tests/workers/inputs_worker.py: one torchrun launch, a fork per case)."""
    table = cases(inputs)
    runs = [(script, [*(TINY if script == GPT2 else []), *map(str, argv), "--device", "cpu", "--timeout-s", "60"],
             launch.free_port()) for script, argv, _ in table]
    (tmp_path / "cases.json").write_text(json.dumps(runs))
    res = launch.torchrun("tests/workers/inputs_worker.py", 2, [tmp_path / "cases.json", tmp_path], timeout=400,
                          device=None)
    assert res.returncode == 0, res.output
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for (script, argv, message), (code0, said), (code1, said1) in zip(table, rank0, rank1):
        case = f"{script} {' '.join(map(str, argv))}"
        assert "Traceback" not in said + said1, (case, said, said1)
        if message is None:
            assert code0 == code1 == 0 and launch.Result(code0, said, False).ok_line(), (case, said, said1)
            continue
        errors = [ln for ln in said.splitlines() if ln.startswith("error:")]
        assert code0 == code1 == 2 and len(errors) == 1 and message in errors[0], (case, code0, code1, said)
        assert "error:" not in said1, (case, said1)  # rank 0 speaks for all
        assert "data:" not in said and "step " not in said and "epoch " not in said, (case, said)  # before any work
    said = {argv[1]: said for (_, argv, _), (_, said) in zip(table, rank0)}  # by --model or --dataset
    assert "sample:" in said[inputs / "llama320"], said[inputs / "llama320"]  # ids past the tokenizer: decoded as ""
    note = next(ln for ln in said[inputs / "with_png"].splitlines() if ln.startswith("note:"))
    assert note.endswith(f"skipped 1 binary file(s): {inputs / 'with_png' / 'figure.png'}"), note


def test_a_tokenizer_past_the_embedding_under_plain_torchrun(inputs):
    """The issue's case as it met it: plain torchrun, 2 ranks, the agent included, which stops the other workers as
    soon as one exits: every rank stops together, so rank 0 has said why by then. One error line, exit status not
    0, no traceback from the script (the agent adds one of its own), no hang. (06's cases stop the same way.)"""
    argv = ["--model", inputs / "llama256", "--dataset", inputs / "text", *TINY]
    res = launch.torchrun(GPT2, 2, argv, timeout=180)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert not res.timed_out and res.returncode != 0, res.output
    assert len(errors) == 1 and "its tokenizer has 257 tokens, its embedding 256 rows" in errors[0], res.output
    assert f'{GPT2}", line' not in res.output and "data:" not in res.output, res.output
