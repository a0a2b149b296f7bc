"""README.md is the front door and docs/ holds one page per feature: the README stays short and
gives the test command, every relative link (and its #anchor) resolves, every docs page can be
reached from the README, and every engine argument and every `nanovllm serve` flag is documented.
The names come from the real Config and the real argument parser, so a new one without docs fails."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_CHARS = 6000

FENCED_CODE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text without code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCED_CODE.sub("", text))


def relative_links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]     # http:, https:, mailto:


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, -N for repeats."""
    repeats: dict[str, int] = {}
    slugs = set()
    for heading in HEADING.findall(FENCED_CODE.sub("", path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(f"{slug}-{repeats[slug]}" if slug in repeats else slug)
        repeats[slug] = repeats.get(slug, 0) + 1
    return slugs


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text) <= README_MAX_CHARS, f"README.md has {len(text)} characters; move detail into docs/"
    # .ci/run and CI run the test command the README gives
    command = "python -m pytest -q -n 2 --dist loadfile"
    assert f"```bash\n{command}\n```" in text and f"\n{command}\n" in (REPO / ".ci" / "run").read_text()
    assert "(docs/throughput_vs_floor.png)" in text


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading with that anchor in {linked.name})")
    assert not broken, f"{path.relative_to(REPO)} links to: {broken}"


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = set(), [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.exists():
            continue
        reached.add(page)
        todo += [(page.parent / t.partition("#")[0]).resolve() for t in relative_links(page) if t.partition("#")[0]]
    unreached = [p.name for p in DOCS.glob("*.md") if p.resolve() not in reached]
    assert not unreached, f"docs pages no link leads to from README.md: {unreached}"


def documented_in_table(path: Path) -> set[str]:
    """The `names` in the first cell of every table row of a page."""
    names = set()
    for line in path.read_text().splitlines():
        if line.startswith("|"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def test_every_engine_argument_is_in_the_engine_args_table():
    pytest.importorskip("uvicorn")
    from nanovllm.serve.cli import engine_arg_fields   # the rule Config.from_engine_args and the CLI share
    names = [field.name for field in engine_arg_fields()]
    assert "max_model_len" in names and "hf_config" not in names
    missing = sorted(set(names) - documented_in_table(DOCS / "engine_args.md"))
    assert not missing, f"engine arguments without a row in docs/engine_args.md: {missing}"


def test_every_serve_flag_is_in_the_serving_page():
    pytest.importorskip("uvicorn")
    from nanovllm.serve.cli import build_parser
    flags = [flag for action in build_parser()._actions for flag in action.option_strings if flag.startswith("--")]
    assert "--max-model-len" in flags and "--api-key" in flags
    text = (DOCS / "serving.md").read_text()
    missing = [flag for flag in flags if not re.search("`" + re.escape(flag) + r"[` ]", text)]
    assert not missing, f"nanovllm serve flags not written as `--flag` in docs/serving.md: {missing}"
