"""The docs' references resolve: every relative Markdown link in README.md and docs/*.md names an existing file, and
no doc cites a docs/data file that is not there (a file that is gone is cited with the commit that holds it:
"docs/data/x.json at 42a8524")."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
#: Written by ``python -m k3_ops.bench plan`` (the launch table as a picture and as Markdown) and committed with the
#: run that made them; a checkout without them yet still links them from docs/kernels.md.
GENERATED = {ROOT / "docs" / "launch_table.png", ROOT / "docs" / "launch_table.md"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DATA = re.compile(r"(?<![\w/.-])(?:docs/)?data/([\w.-]+)(?![\w.-])(?!`?\s+at\s+`?[0-9a-f]{7})")


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def links(text: str) -> list[str]:
    """The relative targets of a Markdown text's links and images, without their #fragments (code blocks skipped)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or a place in the same file
        out.append(target.split("#", 1)[0])
    return out


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_relative_links_resolve(doc):
    missing = [t for t in links(doc.read_text()) if (doc.parent / t).resolve() not in GENERATED
               and not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_cited_data_files_exist(doc):
    cited = {name.rstrip(".") for name in DATA.findall(doc.read_text())}
    missing = sorted(name for name in cited if not (ROOT / "docs" / "data" / name).exists())
    assert not missing, f"{doc.relative_to(ROOT)} cites docs/data files that are not there: {missing}"


def test_link_parser_finds_what_it_must():
    text = ("[a](docs/kernels.md) ![p](launch_table.png) [s](#here) [u](https://example.org/x) "
            "[f](attn_res.md#errors)\n```\n[c](not/a/link.md)\n```\n")
    assert links(text) == ["docs/kernels.md", "launch_table.png", "attn_res.md"]
    cited = ("data/mix.json, `docs/data/fused.json`, docs/data/old.json at 42a8524, `docs/data/x.txt` at `42a8524`, "
             "docs/data/layer.json.")
    assert sorted(DATA.findall(cited)) == ["fused.json", "layer.json.", "mix.json"]
