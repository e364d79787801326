"""The docs site: every flag of every subcommand is in the generated reference, every metric in the
metrics page, and `mkdocs build --strict` passes (broken links, missing pages and bad anchors fail)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "docs", "hooks.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_flag_of_every_subcommand_is_in_the_reference():
    from inferd.cli import build_parser

    page = hooks().flags_markdown()
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(subs) >= 9
    for name, sub in subs.items():
        section = page.split(f"## `inferd {name}`", 1)[1].split("\n## ", 1)[0]
        for a in sub._actions:
            for flag in a.option_strings:
                if flag in ("-h", "--help"):
                    continue
                assert f"`{flag}`" in section, f"inferd {name} {flag} is missing from the flag reference"
                assert a.help, f"inferd {name} {flag} has no help text"


def test_every_metric_is_in_the_reference():
    from inferd.server.metrics import VLLM_NAMES, Metrics

    page = hooks().metrics_markdown()
    for fam in Metrics("m", speculative=True, kv_transfer=True).registry.collect():
        assert f"`{fam.name}`" in page
    for names in VLLM_NAMES.values():
        assert all(f"`{n}`" in page for n in names)


def test_the_committed_reference_is_the_generated_one():
    """Committed so that links to it work where Markdown is read without a build (GitHub); every docs
    build rewrites it, so this fails only when a flag or metric changed and the page was not rebuilt."""
    h = hooks()
    for name, text in (("flags.md", h.flags_markdown()), ("metrics.md", h.metrics_markdown()),
                       ("models.md", h.models_markdown())):
        path = os.path.join(ROOT, "docs", "reference", name)
        assert open(path).read() == text, f"docs/reference/{name} is stale: run `python docs/hooks.py`"


def test_every_readme_link_is_a_page_that_exists():
    text = open(os.path.join(ROOT, "README.md")).read()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [l for l in links if not l.startswith(("http://", "https://"))]
    assert len(local) >= 10
    nav = open(os.path.join(ROOT, "mkdocs.yml")).read()
    for link in local:
        assert os.path.isfile(os.path.join(ROOT, link)), f"README links to {link}, which does not exist"
        if link.startswith("docs/"):
            assert link.removeprefix("docs/") in nav, f"{link} is not in the site's nav"


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs") or os.path.join(os.path.dirname(sys.executable), "mkdocs")
    r = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "flags" / "index.html").is_file()
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Headline results" in home and 'href="quantization/"' in home  # the README, its links rewritten
