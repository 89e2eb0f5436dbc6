"""The reference in docs/ and the README: the site builds strictly, and everything they name exists.

The checks themselves are in docs_support; the last tests here feed them names that do not exist, so that a check
that stopped looking would fail too.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.docs import docs_support as ds
from tests.docs.docs_support import DOCS, README, ROOT, Item


def _mkdocs_build(config, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_site_builds_strictly(tmp_path):
    r = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    page = (tmp_path / "site" / "sweeps" / "index.html").read_text()
    assert "cpu_weights" in page and "generation_batch" in page          # the spec page, with its tables


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """--strict with the validation in mkdocs.yml: a link to a missing page, or to a heading that is not there,
    fails the build (checked on a copy of the docs)."""
    site = tmp_path / "src"
    shutil.copytree(DOCS, site / "docs")
    shutil.copy(ROOT / "mkdocs.yml", site / "mkdocs.yml")
    page = site / "docs" / "index.md"
    text = page.read_text()
    page.write_text(text + "\n[gone](no-such-page.md) and [lost](sweeps.md#no-such-heading)\n")
    r = _mkdocs_build(site / "mkdocs.yml", tmp_path / "out")
    assert r.returncode != 0
    assert "no-such-page.md" in r.stdout + r.stderr and "no-such-heading" in r.stdout + r.stderr


def test_every_name_in_the_docs_exists():
    errors = [e for it in ds.all_items() for e in ds.check_item(it)]
    assert not errors, "\n".join(errors)


def test_every_yaml_block_is_a_sweep_spec_fragment():
    blocks = [b for p in ds.doc_files() for b in ds.fenced_blocks(p.read_text()) if b[1] == "yaml"]
    assert len(blocks) >= 2
    errors = [e for p in ds.doc_files() for e in ds.check_spec_blocks(p)]
    assert not errors, "\n".join(errors)


def test_the_readme_links_resolve_and_it_stays_short():
    assert not ds.check_links(README), "\n".join(ds.check_links(README))
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", README.read_text()))
    assert linked == {p.name for p in DOCS.glob("*.md")}            # every page is reachable from the README
    assert len(README.read_text().splitlines()) <= 220


def _table(text: str, heading: str) -> dict[str, str]:
    """{first cell: second cell} of the table under the first heading that contains ``heading``, code spans
    unwrapped."""
    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("#") and heading in line)
    table = []
    for line in lines[start + 1:]:
        if line.startswith("#") or (table and not line.startswith("|")):
            break
        if line.startswith("|"):
            table.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return {cells[0].strip("`"): cells[1] for cells in table[2:]}        # past the header and its rule


def test_the_spec_page_lists_every_key_with_its_default():
    """docs/sweeps.md has a table per model of orchestrator/spec.py: exactly its fields, each with its default
    (a section's default: "its defaults"; a required field: "required")."""
    import yaml
    from pydantic import BaseModel

    text = (DOCS / "sweeps.md").read_text()
    models = ds.spec_models()
    assert {m.__name__ for m in models} >= {"SweepSpec", "DataSpec", "MethodSpec", "SuitesSpec", "PerplexitySpec",
                                             "TaskSpec", "LatencySpec", "ResourcesSpec"}
    for model in models:
        rows = _table(text, f"`{model.__name__}`")
        assert set(rows) == set(model.model_fields), model.__name__
        for key, field in model.model_fields.items():
            cell = rows[key]
            if field.is_required():
                assert cell == "*required*", (model.__name__, key, cell)
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                assert cell == "*its defaults*", (model.__name__, key, cell)
                continue
            m = re.fullmatch(r"`([^`]*)`", cell)
            assert m, (model.__name__, key, cell)
            assert yaml.safe_load(m.group(1)) == json.loads(json.dumps(default)), (model.__name__, key, cell)


def test_the_cli_page_documents_every_subcommand_and_flag():
    text = (DOCS / "cli.md").read_text()
    missing = []
    for path, parser in ds.walk_cli():
        if f"ctxsparse {' '.join(path)}" not in text:
            missing.append(f"ctxsparse {' '.join(path)}")
        missing += [f"ctxsparse {' '.join(path)} {o}" for o in sorted(ds.option_strings(parser))
                    if o.startswith("--") and o != "--help" and o not in text]
    assert not missing, missing


def test_the_environment_page_documents_every_variable():
    """Every CTXSPARSE_* name the code uses (C header guards aside) is on docs/environment.md, and every variable
    in its tables is used by the code."""
    text = (DOCS / "environment.md").read_text()
    used = {w for w in ds.code_words() if w.startswith("CTXSPARSE_") and not w.endswith("_H")}
    assert len(used) >= 15
    assert not sorted(used - set(re.findall(r"CTXSPARSE_[A-Z0-9_]+", text)))
    table_names = re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", text, re.M)
    assert len(table_names) >= 30
    assert not [n for n in table_names if n not in ds.code_words()]


def test_the_demo_time_is_stated_once_with_its_source():
    readme = README.read_text()
    # one figure for the demo's time, dated, with its machine: "took **N s after the install** (measured DATE on ...)"
    stated = re.findall(r"took \*\*\d+ s after the install\*\* \(measured \d{4}-\d{2}-\d{2} on [^)]+\)", readme)
    assert len(stated) == 1, stated
    assert len(re.findall(r"\d+\s*(?:s|min|minutes)\b[^.\n]*\bdemo|\bdemo\b[^.\n]*?\d+\s*(?:min|minutes)\b", readme)) <= 1
    demo_comment = "\n".join(line for line in (ROOT / "Makefile").read_text().splitlines()
                             if line.startswith("#") and "sweep" in line)
    demo_yaml = "\n".join(line for line in (ROOT / "orchestrator/sweeps/demo.yaml").read_text().splitlines()
                          if line.startswith("#"))
    for comment in (demo_comment, demo_yaml):
        assert not re.search(r"\d+\s*(min|minutes|s)\b", comment), comment


# ---------------------------------------------------------------------------------- the checks catch what they guard
@pytest.mark.parametrize("text, found", [
    ("ctxsparse generate --model m --bundle b --prompt p", False),
    ("ctxsparse generate --modle m --bundle b --prompt p", True),      # a renamed flag
    ("ctxsparse bundle export --best m --by sparsity --out d", False),
    ("ctxsparse bundel export --out d", True),                         # a misspelt subcommand
    ("python -m db export SWEEP FILE.jsonl --request-scores none", False),
    ("python -m db export SWEEP FILE.jsonl --request-score none", True),
    ("python -m db exprot SWEEP FILE.jsonl", True),
    ("python -m benchmarks.topk_mask --device cuda", False),
    ("python -m benchmarks.topk_maks --device cuda", True),
    ("python -m somebodyelses.tool", True),
    ("make test-browser", False),
    ("make tests", True),
    ("make demo TORCH_SPEC=torch==2.13.0", False),
    ("make demo TORCH_SPECS=torch==2.13.0", True),
    ("workers/methods/larosa/runtime.py", False),
    ("workers/methods/larosa/rotated.py", True),
    ("orchestrator/sweeps/h200_*.yaml", False),
    ("orchestrator/sweeps/h300_*.yaml", True),
    ("kernels.cpu_quant.TransposedParts", False),
    ("kernels.cpu_quant.TransposedPart", True),
    ("workers.sparsity.predictors.base.MLPPredictor.reads_ffn", False),
    ("workers.sparsity.predictors.base.MLPPredictor.reads_fnn", True),
    ("suites: {matmul: tf32}", False),
    ("suites: {matmull: tf32}", True),
    ("latency.cpu_weights", False),
    ("latency.cpu_weight", True),
    ("shards: N", False),
    ("shard: N", True),
    ("methods: [{name: svd, options: {target: product}}]", False),
    ("methods: [{name: svd, options: {targett: product}}]", True),
    ("methods: [{name: sdv, sparsity: [0.5]}]", True),
    ("CTXSPARSE_HOME", False),
    ("CTXSPARSE_HOMES", True),
    ("RAY_AUTH_MODE=token ray start", False),
    ("RAY_AUTHMODE=token ray start", True),
    ("--skip-local-checks", False),
    ("--skip-local-check", True),                                      # a flag alone, in a table
    ("--batch-mib 56", False),
    ("--batch-mb 56", True),
])
def test_the_checks_catch_a_wrong_name(text, found):
    errors = ds.check_item(Item("doc.md", 1, text, fenced=False))
    assert bool(errors) == found, errors


def test_a_wrong_key_in_a_yaml_block_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```yaml\nname: x\nmodels: [smollm2-135m]\nmethods: [{name: oracle, sparsity: [0.5]}]\n```\n")
    assert ds.check_spec_blocks(page) == []
    page.write_text("```yaml\nname: x\nlatency: {devices: [cpu], repeat: 3}\n```\n")
    errors = ds.check_spec_blocks(page)
    assert len(errors) == 1 and "LatencySpec has no key 'repeat'" in errors[0], errors
