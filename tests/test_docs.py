"""Every Python snippet in the README and the book map runs as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/book-map.md", "docs/distributed.md", "docs/modern-attention.md",
        "docs/attention-variants.md", "docs/heads.md"]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_snippets_run(doc, tmp_path, monkeypatch):
    path = ROOT / doc
    blocks = python_blocks(path)
    assert blocks, f"{doc} has no python snippets"
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    namespace: dict = {}
    # Blocks build on each other, like cells of a notebook.
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{doc}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{doc} block {i} failed: {e!r}\n{block}") from e


def test_readme_setup_commands_are_the_two_ci_runs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    setup = re.search(r"## Set up.*?```bash\n(.*?)```", text, flags=re.S).group(1)
    lines = [line for line in setup.splitlines() if line.strip()]
    assert len(lines) == 2
    assert "python -m pytest" in lines[1]
    assert "grep -m1 -E '^pip install .*python -m pytest' README.md" in (
        ROOT / ".ci" / "run"
    ).read_text()
