"""The repository speaks for itself: citations of docs/design.md name sections that exist, links
between the Markdown pages resolve, the package has no import circles, and the text speaks of the
project, not of how it was built (no work-log words)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".json", ".txt", ""}
FOLDERS = ("specdec_jax", "tests", "docs", "experiments", "configs", "scripts", ".ci")


def text_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts]
    return files


def design_sections() -> set[int]:
    text = (ROOT / "docs" / "design.md").read_text()
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, re.MULTILINE)}


CITATION = re.compile(r"design\.md,?\s+sections?\s+(\d+(?:\s*(?:-|,|and)\s*\d+)*)", re.IGNORECASE)


def cited_sections(text: str) -> list[int]:
    """Section numbers of every "docs/design.md section N" (or "sections 2-4, 9", "sections 3 and 9")."""
    numbers = []
    for match in CITATION.finditer(" ".join(text.split())):  # citations may wrap across lines
        for part in re.split(r"\s*(?:,|and)\s*", match.group(1)):
            lo, _, hi = part.partition("-")
            numbers += range(int(lo), int(hi or lo) + 1)
    return numbers


def test_citation_parser_reads_ranges_lists_and_wrapped_lines():
    assert cited_sections("see docs/design.md sections 2-4, 9 and docs/design.md\nsection 11.") == [2, 3, 4, 9, 11]
    assert cited_sections("(docs/design.md sections 3 and 9)") == [3, 9]


def test_every_design_citation_names_an_existing_section():
    sections = design_sections()
    assert sections == set(range(1, len(sections) + 1)), f"design.md sections are not numbered 1..N: {sections}"
    dangling, total = [], 0
    for path in text_files():
        cited = cited_sections(path.read_text(errors="replace"))
        total += len(cited)
        dangling += [f"{path.relative_to(ROOT)}: section {n}" for n in cited if n not in sections]
    assert total > 20, "the code should cite its design doc"
    assert not dangling, "citations of docs/design.md sections that do not exist:\n" + "\n".join(dangling)


def test_no_citation_of_a_file_outside_the_repository():
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in text_files() if p.name != "test_repository.py"
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           if "DESIGN section" in line or "shared/DESIGN" in line]
    assert not bad, "citations of a design file the repository does not have: " + ", ".join(bad)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(markdown: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", markdown.read_text(), re.MULTILINE):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_markdown_links_resolve():
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "experiments" / "README.md"]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # an external URL
                continue
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (function-level imports too:
    a circle hidden inside a function is still a circle)."""
    modules = {}
    for path in (ROOT / "specdec_jax").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges.add(full if full in modules else base)
        graph[name] = (edges & modules.keys()) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, found, counter = {}, {}, [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_circle_finder_finds_a_hidden_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_package_has_no_import_circles():
    graph = import_graph()
    assert "specdec_jax.engine.calibration" in graph["specdec_jax.engine.generation"]  # the parser sees imports
    assert circles(graph) == []


WORK_LOG = re.compile(r"\bsess" + r"ions?\b|\bissues? ?#?\d+", re.IGNORECASE)


@pytest.mark.parametrize("folder", ["README.md", *FOLDERS])
def test_text_speaks_of_the_project_not_of_its_work_log(folder):
    files = [p for p in text_files() if p.relative_to(ROOT).parts[0] == folder]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in files
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if WORK_LOG.search(line)]
    assert not hits, "work-log words (issue numbers, work periods) in the repository:\n" + "\n".join(hits)
