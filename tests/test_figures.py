"""docs/figures.py draws the figures of the README and docs/ from real runs: one is regenerated here, so its command
cannot rot. docs/diagrams.py draws the concept drawings: all are regenerated here and must equal the committed ones.
Each figure is shown on one page (the README or the docs page of its topic), beside the command that draws it."""

import os
import re
import struct
import sys
from xml.etree import ElementTree

import pytest

import launch


def png_text(path):
    """(is a PNG, its tEXt fields): the chunks read one by one, each checked against its length."""
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return False, {}
    fields, at, chunks = {}, 8, []
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        chunks.append(kind)
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            fields[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + length
    return chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks, fields


@pytest.fixture(scope="module")
def made(request, tmp_path_factory):
    """{test name: (what its drawing command printed, its folder)}, drawn ahead and side by side: the ring figure
    waits on two benchmark launches, the diagrams keep one core busy."""
    def draw(command, timeout, folders=("",)):
        def go():
            out = tmp_path_factory.mktemp("drawn")
            return [launch.run([sys.executable, *command, "--out", out / f], timeout) for f in folders], out
        return go
    with launch.ahead(request, {
            "test_the_ring_figure_is_drawn_from_two_real_runs": draw(["docs/figures.py", "ring", "--quick"], 240),
            "test_the_diagrams_are_drawn_again_the_same": draw(["docs/diagrams.py"], 120, "ab")}) as futures:
        yield futures


@pytest.mark.slow  # two benchmark runs, ~15 s
def test_the_ring_figure_is_drawn_from_two_real_runs(made, request):
    (res,), folder = made[request.node.name].result()
    assert res.returncode == 0 and "wrote" in res.output, res.output
    path = folder / "ring_busbw.png"
    valid, text = png_text(path)
    assert valid and 5_000 < path.stat().st_size < 200_000, path.stat().st_size
    assert "message size" in text["Description"] and "bus bandwidth" in text["Description"], text
    for series in ("hand-written ring, 2 ranks", "dist.all_reduce, 2 ranks", "hand-written ring, 3 ranks",
                   "dist.all_reduce, 3 ranks"):
        assert series in text["Description"], text


def shown_with_its_command(figure, command):
    """The page (README.md or docs/*.md) that shows docs/<figure>, which must be one page, naming the command."""
    pages = [launch.REPO / "README.md", *sorted((launch.REPO / "docs").glob("*.md"))]
    path = launch.REPO / "docs" / figure
    showing = [p for p in pages if f"]({os.path.relpath(path, p.parent)})" in p.read_text()]
    assert path.exists(), figure
    assert len(showing) == 1, f"docs/{figure} is shown on {[p.name for p in showing]}: one page, the topic's"
    assert command in showing[0].read_text(), f"{showing[0].name} shows docs/{figure} without `{command}`"


FIGURES = {"ring_busbw": "ring", "ddp_overlap": "overlap", "memory_per_rank": "memory", "learning_curves": "curves",
           "costmodel_scaling": "scaling", "fsdp_timeline": "fsdp"}


@pytest.mark.parametrize("name", FIGURES)
def test_every_figure_is_shown_with_its_command(name):
    shown_with_its_command(f"{name}.png", f"python docs/figures.py {FIGURES[name]}")


# Each drawing, the command that draws it, and words it must show (the SVGs keep their text as text).
DIAGRAMS = {"tree_broadcast": ("tree", ["rank 2 (src)", "round 3"]),
            "ring_steps": ("ring", ["reduce-scatter, step 3:", "all-gather, step 3:", "0+1+2"]),
            "bucket_overlap": ("buckets", ["bucket 0", "layer 6", "naive: all-reduce"]),
            "zero_shards": ("shards", ["ZeRO-1 (07)", "ZeRO-2 (07)", "FSDP (08)", "1P per rank"])}


def creator(svg):
    """The matplotlib version an SVG names as its creator."""
    return re.search(rb"Matplotlib v[^,<]+", svg).group()


def test_the_diagrams_are_drawn_again_the_same(made, request):
    runs, folder = made[request.node.name].result()
    for res in runs:
        assert res.returncode == 0 and res.output.count("wrote") == len(DIAGRAMS), res.output
    for name, (_, words) in DIAGRAMS.items():
        drawn = (folder / "a" / f"{name}.svg").read_bytes()
        root = ElementTree.fromstring(drawn)
        assert root.tag == "{http://www.w3.org/2000/svg}svg" and root.find("{http://www.w3.org/2000/svg}title").text
        text = " ".join("".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text"))
        assert all(w in text for w in words), (name, text)
        assert drawn == (folder / "b" / f"{name}.svg").read_bytes(), f"{name}: two runs differ"
        committed = (launch.REPO / "docs" / f"{name}.svg").read_bytes()
        # The same matplotlib writes the same bytes; another version may place a point differently.
        if creator(committed) == creator(drawn):
            assert drawn == committed, f"docs/{name}.svg is not what python docs/diagrams.py draws: run it again"


@pytest.mark.parametrize("name", DIAGRAMS)
def test_every_diagram_is_shown_with_its_command(name):
    shown_with_its_command(f"{name}.svg", f"python docs/diagrams.py {DIAGRAMS[name][0]}")


def test_every_image_in_docs_is_one_of_these():
    images = {p.name for p in (launch.REPO / "docs").iterdir() if p.suffix in (".png", ".svg")}
    assert images == {f"{n}.png" for n in FIGURES} | {f"{n}.svg" for n in DIAGRAMS}, "a figure no page is checked for"
