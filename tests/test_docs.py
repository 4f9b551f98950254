"""The README, WORKSHOP.md and docs/ as a reader meets them: the front door stays short, every link lands, and
every command shown runs as written (the script exists and its own parser takes the flags), checked without
launching anything."""

import os
import re
import shlex
import sys

import pytest

import launch
from conftest import load_script

REPO = launch.REPO
README_MAX_LINES = 250
PAGES = [REPO / "README.md", REPO / "WORKSHOP.md", REPO / "exercises" / "README.md", REPO / "benchmarks" / "README.md",
         *sorted((REPO / "docs").glob("*.md"))]
COMMAND_PAGES = [REPO / "README.md", REPO / "WORKSHOP.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```+|~~~+)(.*)$")


def split_fences(text):
    """(prose lines, [(language, code lines)]): what a reader sees as text, and each fenced block apart."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if block is None and fence:
            block = (fence.group(2).strip().lower(), [])
        elif block is not None and fence and not fence.group(2).strip():
            blocks.append(block)
            block = None
        elif block is not None:
            block[1].append(line)
        else:
            prose.append(line)
    return prose, blocks


def slug(heading):
    """GitHub's anchor for a heading: its rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path):
    """Every #anchor a link into this page may name: its headings (GitHub numbers repeats -1, -2, ...) and ids."""
    prose, _ = split_fences(path.read_text())
    found, seen = set(), {}
    for line in prose:
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return found


def links(path):
    """The relative targets of the page's links and images, outside code (a link shown as code is not followed)."""
    prose, _ = split_fences(path.read_text())
    text = re.sub(r"`[^`\n]*`", "", "\n".join(prose))
    targets = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    targets += re.findall(r"<(?:a|img)\s[^>]*(?:href|src)=\"([^\"]+)\"", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not ours


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    assert page.exists(), f"{page.relative_to(REPO)} is missing"
    broken = []
    for target in links(page):
        name, _, anchor = target.partition("#")
        dest = (page.parent / name).resolve() if name else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading or id '{anchor}' in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n  " + "\n  ".join(dict.fromkeys(broken))


def test_slug_follows_githubs_rule():
    assert slug("08_fsdp.py: fully sharded data parallel by hand, equal to `fully_shard`") == \
        "08_fsdppy-fully-sharded-data-parallel-by-hand-equal-to-fully_shard"
    assert slug("ZeRO-2's transients: below ZeRO-1 on every model") == "zero-2s-transients-below-zero-1-on-every-model"
    assert slug("See [the docs](docs/x.md) & more") == "see-the-docs--more"


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, over {README_MAX_LINES}: depth to docs/"


def test_the_first_hour_is_on_the_readmes_first_screen():
    """Quick start runs the main job, then the five first-hour commands in order, 01 first, in the first 60 lines."""
    _, blocks = split_fences("\n".join((REPO / "README.md").read_text().splitlines()[:60]))
    shown = [found[0] for _, code in blocks for line in code if (found := script_and_args(line))]
    first_hour = ["01_send_recv.py", "02_broadcast.py", "03_all_reduce.py", "04_sampler.py", "05_manual_ddp_gpt2.py"]
    assert shown[0] == "05_manual_ddp_gpt2.py" and shown[1:6] == first_hour, shown


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()
          if ln.strip().startswith("pip install")]
    assert len(ci) == 1, ci
    _, blocks = split_fences((REPO / "README.md").read_text())
    shown = [ln.strip() for _, code in blocks for ln in code if "requirements-dev.txt" in ln and "pytest" in ln]
    assert shown == ci, f"README shows {shown}, .ci/run runs {ci}: keep them the same, character for character"


def commands(path):
    """Each torchrun/python command a page shows: lines of its shell blocks (continuations joined), `$ ` lines of
    its other blocks, and inline code spans that start with torchrun or python."""
    prose, blocks = split_fences(path.read_text())
    found = []
    for language, code in blocks:
        joined = "\n".join(code).replace("\\\n", " ").splitlines()
        for line in joined:
            line = line.strip()
            if language in ("bash", "sh", "shell", "console", "") and not line.startswith("$ "):
                found.append(line)
            elif line.startswith("$ "):
                found.append(line[2:])
    for span in re.findall(r"`([^`\n]+)`", "\n".join(prose)):  # a span naming a .py: a command, not a fragment
        if re.match(r"(\w+=\S+\s+)*(torchrun|python3?)\s", span) and re.search(r"\.py\b", span):
            found.append(span)
    return [c for c in found if c]


def script_and_args(command):
    """(script, its arguments, the world size its ranks see) of a torchrun or python command, or None for other
    commands (pip, ruff, ./x.sh)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    while words and (re.match(r"\w+=", words[0]) or words[0] in ("timeout", "env")):
        words = words[2:] if words[0] == "timeout" else words[1:]  # VAR=value and `timeout N` before the command
    for i, word in enumerate(words):  # `cmd && torchrun ...`: the part that launches
        if word in ("&&", "||", ";", "|"):
            return script_and_args(shlex.join(words[i + 1:]))
    if not words:
        return None
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser
        try:
            args = get_args_parser().parse_args(words[1:])
        except SystemExit:
            return ("torchrun", words[1:], 0)  # torchrun's own flags are wrong: reported as such
        if args.module or args.no_python:
            return None
        count = [int(n) if n.isdigit() else 2 for n in (args.nproc_per_node, args.nnodes.split(":")[-1])]  # N: 2
        return args.training_script, args.training_script_args, count[0] * count[1]
    if words[0] in ("python", "python3") and len(words) > 1 and not words[1].startswith("-"):
        return words[1], words[2:], 1
    return None


LOADED = {}  # (script, world size): the module, loaded once


def parse_error(script, argv, world=1):
    """Why the script's own parse_args rejects argv (its usage error or argparse's exit), or None. The script is
    loaded as rank 0 of `world` ranks would load it (a flag like 02's --src is checked against WORLD_SIZE)."""
    if (script, world) not in LOADED:
        ranks = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        saved = {name: os.environ.pop(name, None) for name in ranks}
        os.environ.update(ranks if world > 1 else {})  # plain python: no torchrun variables at all
        try:
            LOADED[script, world] = load_script(script)
        finally:
            for name, value in saved.items():
                os.environ.pop(name, None)
                if value is not None:
                    os.environ[name] = value
    module, saved = LOADED[script, world], sys.argv
    sys.argv = [script, *argv]
    try:
        module.parse_args()
    except SystemExit as e:  # --help exits 0; argparse's own errors exit 2
        return None if e.code in (0, None) else f"exit {e.code}"
    except Exception as e:  # the scripts raise their UsageError for a bad flag
        return f"{type(e).__name__}: {e}"
    finally:
        sys.argv = saved
    return None


def test_every_command_shown_names_a_script_and_flags_it_takes(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)  # the commands are run from the repository root
    bad, checked = [], 0
    for page in COMMAND_PAGES:
        for command in commands(page):
            found = script_and_args(command)
            if found is None:
                continue
            script, argv, world = found
            where = f"{page.relative_to(REPO)}: {command}"
            if script == "torchrun":
                bad.append(f"{where}\n    torchrun does not take these flags")
            elif not (REPO / script).is_file():
                bad.append(f"{where}\n    no file {script}")
            elif re.fullmatch(r"\d\d_\w+\.py", script):
                error = parse_error(script, argv, world)
                if error:
                    bad.append(f"{where}\n    {script}'s parser says {error}")
            checked += 1
    assert checked >= 20, f"only {checked} commands found: is the extraction broken?"
    assert not bad, "\n".join(bad)


def test_the_command_reader_sees_what_a_shell_would_run():
    assert script_and_args("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 "
                           "05_manual_ddp_gpt2.py --out ckpt   # a comment") == \
        ("05_manual_ddp_gpt2.py", ["--out", "ckpt"], 2)
    assert script_and_args("pip install -r requirements.txt && torchrun --nproc_per_node=4 05_manual_ddp_gpt2.py") == \
        ("05_manual_ddp_gpt2.py", [], 4)
    assert script_and_args("timeout 300 python 07_zero.py --stage 2") == ("07_zero.py", ["--stage", "2"], 1)
    assert script_and_args("python -m pytest -x") is None
    assert parse_error("07_zero.py", ["--stage", "3"]) and parse_error("07_zero.py", ["--stage", "2"]) is None
    assert parse_error("02_broadcast.py", ["--src", "2"], 3) is None  # --src is checked against the world size
    assert parse_error("02_broadcast.py", ["--src", "2"], 2)
