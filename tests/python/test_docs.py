"""The documentation's links hold, and the README stays a front page.

Every relative link and image in README.md, docs/*.md, ops/README.md and passes/README.md must
name a file that exists, and every `#anchor` one of the target's headings, spelled as GitHub
spells them (lowercase, spaces to '-', punctuation dropped, repeats numbered). Paths to docs/
pages that source files cite must exist too. The README keeps its two commands as they are (the
main job's and the device tests' docstrings refer to "the README's" commands) and stays short.
No process, no import of smp: files only.
"""

import collections
import os
import re
import unicodedata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")

# The README's two commands, exactly: tests/python/test_main_job.py and test_devices.py name them.
INSTALL_AND_RUN = (
    "pip install -r requirements.txt && pip install --no-build-isolation -e . && "
    "torchrun --standalone --nproc_per_node=4 examples/train_gpt2.py"
)
TEST_SUITE = "bash tests/run.sh"
README_MAX_LINES = 150

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def markdown_files():
    files = [README, os.path.join(ROOT, "ops", "README.md"), os.path.join(ROOT, "passes", "README.md")]
    files += sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))
    return files


def rel(path):
    return os.path.relpath(path, ROOT)


def prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = None
    for number, line in enumerate(text.split("\n"), 1):
        match = FENCE.match(line)
        if match:
            if fenced is None:
                fenced = match.group(1)
            elif match.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            yield number, line


def github_anchor(heading):
    """GitHub's id for a heading: its rendered text, lowercased, punctuation dropped."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = INLINE_CODE.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*\*|__|\*)", "", text)  # emphasis markers (not single '_': snake_case stays)
    kept = [
        c
        for c in text.strip().lower()
        if c.isalnum() or c in "_- " or unicodedata.category(c).startswith("M")
    ]
    return "".join(kept).replace(" ", "-")


def anchors(path):
    seen = collections.Counter()
    found = set()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for _, line in prose_lines(text):
        match = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_anchor(match.group(2))
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    for _, line in prose_lines(text):  # explicit <a name="..."> / id="..." anchors
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return found


def links(path):
    """(line number, target) of every link and image in the prose (code blocks and spans skipped)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for number, line in prose_lines(text):
        line = INLINE_CODE.sub("", line)
        for match in LINK.finditer(line):
            yield number, match.group(1)
        for match in REFERENCE.finditer(line):
            yield number, match.group(1)


def broken_links(path):
    problems = []
    for number, target in links(path):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        where = f"{rel(path)}:{number}: {target}"
        if not os.path.exists(dest):
            problems.append(f"{where}: no file {rel(dest)}")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            problems.append(f"{where}: no heading '#{anchor}' in {rel(dest)}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_every_relative_link_and_anchor_resolves(path):
    assert os.path.exists(path), f"{rel(path)} is missing"
    assert broken_links(path) == []


def test_the_anchor_rules_are_githubs():
    assert github_anchor("The GPU path: `bash tests/gpu.sh`") == "the-gpu-path-bash-testsgpush"
    assert github_anchor("Explicit tensor parallelism (smp.nn, tp_register)") == (
        "explicit-tensor-parallelism-smpnn-tp_register"
    )
    assert github_anchor("Planning a layout (`python -m smp.plan`)") == "planning-a-layout-python--m-smpplan"
    assert github_anchor("**Bold** and [a link](x.md)") == "bold-and-a-link"


def test_the_checker_catches_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Only heading\n\n```\n# not a heading\n```\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#only-heading) [file](missing.md) [anchor](b.md#not-a-heading) "
        "[self](#nowhere) `[code](ignored.md)` [web](https://example.com/x#y)\n"
    )
    problems = broken_links(str(page))
    assert len(problems) == 3, problems
    assert "no file" in problems[0] and "missing.md" in problems[0]
    assert "'#not-a-heading'" in problems[1]
    assert "'#nowhere'" in problems[2]


def readme_section(title):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def test_the_readme_is_a_front_page():
    with open(README, encoding="utf-8") as f:
        lines = f.read().rstrip("\n").split("\n")
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; it is the front page (at most {README_MAX_LINES}): "
        "move the detail to a page under docs/ and link it"
    )


def test_the_readme_keeps_its_two_commands_exactly():
    section = readme_section("Two commands")
    blocks = re.findall(r"^\s*```(\w*)\n(.*?)^\s*```", section, re.M | re.S)
    assert [lang for lang, _ in blocks] == ["bash", "bash"], "one ```bash block per command"
    commands = [body.strip() for _, body in blocks]
    assert commands == [INSTALL_AND_RUN, TEST_SUITE]


def test_the_readme_links_every_docs_page():
    linked = {
        os.path.normpath(os.path.join(ROOT, target.partition("#")[0]))
        for _, target in links(README)
        if not target.startswith(EXTERNAL)
    }
    pages = [p for p in markdown_files() if p.startswith(DOCS + os.sep)]
    assert [rel(p) for p in pages if p not in linked] == []


def test_the_feature_table_gives_each_feature_one_line_and_a_link():
    rows = [r for r in readme_section("Features").split("\n") if r.startswith("|")][2:]
    assert len(rows) >= 10
    for row in rows:
        assert LINK.search(row), f"feature without a link: {row}"


def test_source_files_cite_docs_pages_that_exist():
    cited = re.compile(r"\bdocs/([\w./-]+?\.md)(#[\w-]+)?")
    problems = []
    for top in ("python", "passes", "ops", "backend", "tests", "benchmarks", "examples"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                if not name.endswith((".py", ".cpp", ".h", ".sh", ".txt")):
                    continue
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        for match in cited.finditer(line):
                            page = os.path.join(DOCS, match.group(1))
                            anchor = (match.group(2) or "#")[1:]
                            if not os.path.exists(page):
                                problems.append(f"{rel(path)}:{number}: no docs/{match.group(1)}")
                            elif anchor and anchor not in anchors(page):
                                problems.append(
                                    f"{rel(path)}:{number}: no '#{anchor}' in docs/{match.group(1)}"
                                )
    assert problems == []
