"""docs/figures.py draws the README's figures from real runs: one is regenerated here, so its command cannot rot."""

import struct
import sys

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


def test_the_ring_figure_is_drawn_from_two_real_runs(tmp_path):
    res = launch.run([sys.executable, "docs/figures.py", "ring", "--quick", "--out", tmp_path], timeout=240)
    assert res.returncode == 0 and "wrote" in res.output, res.output
    path = tmp_path / "ring_busbw.png"
    valid, text = png_text(path)
    assert valid and 5_000 < path.stat().st_size < 200_000, path.stat().st_size
    assert "message size" in text["Description"] and "bus bandwidth" in text["Description"], text
    for series in ("hand-written ring, 2 ranks", "dist.all_reduce, 2 ranks", "hand-written ring, 3 ranks",
                   "dist.all_reduce, 3 ranks"):
        assert series in text["Description"], text


def test_the_readme_shows_every_figure_with_its_command():
    readme = (launch.REPO / "README.md").read_text()
    for name, command in (("ring_busbw", "ring"), ("ddp_overlap", "overlap"), ("memory_per_rank", "memory"),
                          ("learning_curves", "curves")):
        assert (launch.REPO / "docs" / f"{name}.png").exists(), name
        assert f"(docs/{name}.png)" in readme and f"python docs/figures.py {command}" in readme, name
