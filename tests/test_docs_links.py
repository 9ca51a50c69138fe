"""Links into the experiment log land: docs/experiments.md is an index, docs/experiments/*.md hold the sections.

Anchors are computed the way GitHub computes them for headings (lowercase; characters other than letters, digits,
spaces, hyphens and underscores dropped; spaces to hyphens; a repeated anchor gets -1, -2, ...), and an explicit
`<a id="...">` (or name=) in a file counts as an anchor too: the index keeps every old section's anchor that way.
No network, no imports of the project: only `git ls-files` and the files' text.
"""
from __future__ import annotations

import re
import subprocess
import unicodedata
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INDEX = REPO / "docs" / "experiments.md"
TOPICS = REPO / "docs" / "experiments"
SCANNED = (".py", ".md", ".sh", ".jinja")
SKIPPED_DIRS = (".venv/", "venv/", "runs/", "build/", "dist/", "node_modules/", ".git/")
THIS = Path(__file__).resolve()

# A path ending in experiments.md or experiments/NAME.md, with an optional #anchor; not part of a longer name.
LOG_LINK = re.compile(r"(?<![\w.\-/])((?:\.{1,2}/)*(?:[\w.\-]+/)*experiments(?:/[\w.\-]+)?\.md)(?:#([\w\-]+))?")
# A Markdown link's target: [text](target) or [text](target#anchor) or [text](#anchor).
MD_LINK = re.compile(r"\]\(([^)\s]*)\)")
HEADING = re.compile(r"(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"<a\s+[^>]*?(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)


def github_slug(text: str) -> str:
    """A heading's anchor before duplicates get their suffix, computed from its rendered text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)   # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                      # inline HTML tags
    text = text.replace("`", "").replace("*", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN"
                   or unicodedata.category(c) == "Pc")
    return kept.replace(" ", "-")


def headings(text: str) -> list[tuple[int, str, str]]:
    """(level, heading text, anchor) for every ATX heading outside fenced code, in order, with GitHub's suffixes."""
    out, seen, fence = [], {}, None
    for line in text.splitlines():
        stripped = line.lstrip()
        marker = stripped[:3]
        if marker in ("```", "~~~"):
            if fence is None:
                fence = marker
            elif marker == fence:
                fence = None
            continue
        if fence is not None or line.startswith("    "):
            continue
        m = HEADING.fullmatch(stripped) if stripped.startswith("#") else None
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.append((len(m.group(1)), m.group(2), slug if n == 0 else f"{slug}-{n}"))
    return out


@lru_cache(maxsize=None)
def anchors_of(path: Path) -> frozenset[str]:
    text = path.read_text(encoding="utf-8")
    return frozenset({a for _, _, a in headings(text)} | set(HTML_ID.findall(text)))


def scanned_files() -> list[Path]:
    """Tracked files (and new ones git does not ignore) that may point into the log."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"git ls-files failed: {exc}")
    files = []
    for rel in sorted(set(listed)):
        if not rel.endswith(SCANNED) or rel.startswith(SKIPPED_DIRS):
            continue
        path = REPO / rel
        if path.is_file() and path.resolve() != THIS:   # a file moved away but not yet committed is skipped
            files.append(path)
    return files


def resolve(source: Path, target: str) -> Path:
    """Where a link from `source` to `target` leads: docs/... from the repository root, else from the linking
    file's folder (what a Markdown link means); a non-Markdown file's bare path falls back to the root."""
    if target.startswith("docs/"):
        return (REPO / target).resolve()
    here = (source.parent / target).resolve()
    if source.suffix != ".md" and not here.exists():
        return (REPO / target).resolve()
    return here


def check(source: Path, lineno: int, target: Path, anchor: str | None, shown: str) -> str | None:
    where = f"{source.relative_to(REPO)}:{lineno}"
    if not target.is_file():
        return f"{where}: {shown}: no file {target.relative_to(REPO) if target.is_relative_to(REPO) else target}"
    if anchor and anchor not in anchors_of(target):
        return f"{where}: {shown}: no heading or <a id> '{anchor}' in {target.relative_to(REPO)}"
    return None


def test_links_into_the_experiment_log_resolve():
    """Every `experiments.md#x`, `docs/experiments.md#x`, `experiments/NAME.md#x` anywhere in the repository names
    a file that exists and an anchor it has; inside the log's own files every relative Markdown link does too."""
    log_files = {INDEX.resolve(), *(p.resolve() for p in TOPICS.glob("*.md"))}
    broken, seen_links = [], 0
    for source in scanned_files():
        in_log = source.resolve() in log_files
        for lineno, line in enumerate(source.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in LOG_LINK.finditer(line):
                seen_links += 1
                problem = check(source, lineno, resolve(source, m.group(1)), m.group(2), m.group(0))
                if problem:
                    broken.append(problem)
            if not in_log:
                continue
            for m in MD_LINK.finditer(line):   # the log's own links: same-file anchors, ../algorithm.md, ...
                target = m.group(1)
                if not target or re.match(r"[a-z][a-z0-9+.\-]*:", target) or LOG_LINK.fullmatch(target):
                    continue   # empty, a URL, or already checked above
                path, _, anchor = target.partition("#")
                dest = source.resolve() if not path else (source.parent / path).resolve()
                if dest.is_dir():
                    continue
                seen_links += 1
                problem = check(source, lineno, dest, anchor or None, target)
                if problem:
                    broken.append(problem)
    assert seen_links > 50, f"only {seen_links} links into the log found: is the pattern still right?"
    assert not broken, f"{len(broken)} broken link(s) into the experiment log:\n" + "\n".join(broken)


def index_entries() -> list[tuple[str | None, str, str]]:
    """(old anchor kept by an <a id>, topic file name, anchor) for every index link into docs/experiments/."""
    out = []
    for line in INDEX.read_text(encoding="utf-8").splitlines():
        ids = HTML_ID.findall(line)
        for m in re.finditer(r"\]\(experiments/([\w.\-]+\.md)#([\w\-]+)\)", line):
            out.append((ids[0] if ids else None, m.group(1), m.group(2)))
    return out


def test_index_lists_every_section_of_the_log():
    """The index links to every ## and ### heading of every topic file, only to headings that exist, and keeps
    each one's anchor as it was in the single-file log (an <a id> on its entry), so old links still land."""
    topics = sorted(TOPICS.glob("*.md"))
    assert topics, "docs/experiments/ has no topic files"
    entries = index_entries()
    linked = {(f, a) for _, f, a in entries}
    sections, problems = [], []
    for path in topics:
        for level, text, anchor in headings(path.read_text(encoding="utf-8")):
            if level == 1:
                continue   # the file's own title
            sections.append((path.name, text))
            if (path.name, anchor) not in linked:
                problems.append(f"{path.name}: section '{text}' (#{anchor}) is not linked from docs/experiments.md")
    for _, name, anchor in entries:
        path = TOPICS / name
        if not path.is_file():
            problems.append(f"index links to missing file experiments/{name}")
        elif anchor not in {a for lvl, _, a in headings(path.read_text(encoding="utf-8")) if lvl > 1}:
            problems.append(f"index links to experiments/{name}#{anchor}, which is no section heading there")
    # the anchors the sections had when they were one file (same order as the index: the only order that matters
    # is for repeated headings, and the index keeps the log's order within a topic)
    order = {(f, a): i for i, (_, f, a) in enumerate(entries)}
    one_file, seen = [], {}
    for name, text in sorted(sections, key=lambda s: order.get((s[0], github_slug(s[1])), len(order))):
        slug = github_slug(text)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        one_file.append(slug if n == 0 else f"{slug}-{n}")
    kept = [old for old, _, _ in entries if old]
    problems += [f"no <a id=\"{a}\"> in the index for the section that had that anchor" for a in one_file
                 if a not in kept]
    index_ids = [a for _, _, a in headings(INDEX.read_text(encoding="utf-8"))] + HTML_ID.findall(
        INDEX.read_text(encoding="utf-8"))
    problems += [f"anchor '{a}' appears twice in the index" for a in sorted({a for a in index_ids
                                                                             if index_ids.count(a) > 1})]
    assert len(sections) >= 40, f"only {len(sections)} sections in docs/experiments/: was the log cut?"
    assert not problems, f"{len(problems)} problem(s) with the experiment log's index:\n" + "\n".join(problems)
