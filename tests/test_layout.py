"""The code keeps the shape the README promises: the layout section lists every module, no module imports
another's private name, and no function of the package runs over 60 lines."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "memplan"
MODULES = sorted(p for p in PACKAGE.rglob("*.py"))
LONGEST = 60


def _layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    return section[section.index("```"):section.index("```", section.index("```") + 3)]


def test_the_readme_layout_lists_every_module_and_no_other():
    listed = set(re.findall(r"\b(\w+\.py)\b", _layout_block()))
    present = {p.name for p in MODULES} - {"__init__.py", "__main__.py"}
    assert listed - {"build_catalog.py", "snapshot.py", "__init__.py"} == present
    for folder in {p.parent.relative_to(PACKAGE).as_posix() for p in MODULES} - {"."}:
        assert f"{folder.split('/')[-1]}/" in _layout_block(), folder


def _trees():
    return [(p, ast.parse(p.read_text())) for p in MODULES]


def test_no_module_imports_a_private_name_of_another():
    """memplan's own modules only: torch's private helpers (selective.py's checkpointing) are torch's API."""
    private = [f"{p.relative_to(PACKAGE)}:{n.lineno} {a.name}" for p, tree in _trees() for n in ast.walk(tree)
               if isinstance(n, ast.ImportFrom) and ((n.module or "").startswith("memplan") or n.level)
               for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert private == []


def test_no_function_is_longer_than_a_screen():
    long = [f"{p.relative_to(PACKAGE)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p, tree in _trees() for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > LONGEST]
    assert long == []


def test_every_cited_doc_and_source_file_exists():
    """Code and docs cite docs/*.md pages and src/memplan paths: each must exist."""
    texts = [p for p in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *MODULES, *ROOT.glob("tests/*.py"),
                         *ROOT.glob("benchmarks/*.py")]]
    missing = []
    for p in texts:
        text = p.read_text()
        for cited in re.findall(r"(?<![\w/.])((?:docs|tests|benchmarks|scripts)/[\w-]+\.(?:md|py)|src/memplan/[\w/]+\.py)",
                                text):
            if not (ROOT / cited).exists():
                missing.append(f"{p.relative_to(ROOT)}: {cited}")
        for cited in re.findall(r"(?<![\w/.])((?:inputs|estimator|search|verify|cli|kernels|emit)/\w+\.py)", text):
            if not (PACKAGE / cited).exists():
                missing.append(f"{p.relative_to(ROOT)}: {cited}")
    assert missing == []
