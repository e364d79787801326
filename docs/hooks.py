"""MkDocs hook: the reference pages made from their one source at every build, never edited by hand.

- reference/flags.md: every flag of every `inferd` subcommand, from the argument parsers (inferd.cli);
- reference/metrics.md: every Prometheus series `inferd serve` and `inferd router` export, from the
  metrics modules, with the vLLM names they are also exposed as.
- reference/models.md: the supported model families, from the registry (inferd.model.registry).

- index.md: the README, its links made relative to docs/ (one text for both front pages).

The reference pages are committed (links to them work on GitHub too); tests/test_docs.py fails when they are stale.

tests/test_docs.py imports these functions and checks the pages are complete.
"""
from __future__ import annotations

import argparse
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """name -> (its parser, the one-line help `inferd --help` shows for it)"""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (sub, helps.get(name, "")) for name, sub in action.choices.items()}
    return {}


def flags_markdown() -> str:
    from inferd.cli import build_parser

    out = ["# Command-line flags", "",
           "Generated from the argument parsers at every docs build (`docs/hooks.py`): what `inferd CMD --help` "
           "prints, one table a subcommand. A flag's YAML key (`--config`) is its long name without the dashes.", ""]
    for name, (sub, summary) in _subcommands(build_parser()).items():
        out += [f"## `inferd {name}`", "", _cell(summary), "",
                "| flag | default | what it does |", "|---|---|---|"]
        for a in sub._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flag = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}` (positional)"
            if a.choices and not isinstance(a.choices, dict):
                flag += " {" + ", ".join(str(c) for c in a.choices) + "}"
            default = "" if a.default in (None, argparse.SUPPRESS) else f"`{a.default}`"
            out.append(f"| {flag} | {_cell(default)} | {_cell((a.help or '').replace('%%', '%'))} |")
        out.append("")
    return "\n".join(out)


def metrics_markdown() -> str:
    from inferd.router.app import RouterMetrics
    from inferd.server.metrics import VLLM_NAMES, Metrics
    from inferd.server.openai.store import ResponseStore

    out = ["# Prometheus metrics", "",
           "Generated from the metrics modules at every docs build (`docs/hooks.py`). Every `inferd serve` series "
           "carries `model_name` and `engine` labels (but the server-wide ones: the HTTP requests by route, "
           "dialect and status, and the Responses API's store); the vLLM names are the same values under the "
           "names Kubernetes LLM routers read.", "",
           "## `inferd serve` (`GET /metrics`)", "", "| series | type | also exposed as | meaning |",
           "|---|---|---|---|"]
    m = Metrics("model", speculative=True, engines=1, kv_transfer=True, kv_tier=True, kv_events=True)
    m.watch_store(ResponseStore())
    for fam in m.registry.collect():
        also = ", ".join(f"`{n}`" for n in VLLM_NAMES.get(fam.name, ()))
        out.append(f"| `{fam.name}` | {fam.type} | {also} | {_cell(fam.documentation)} |")
    out += ["", "## `inferd router` (`GET /metrics`)", "", "| series | type | meaning |", "|---|---|---|"]
    for fam in RouterMetrics(["http://a", "http://b"]).registry.collect():
        out.append(f"| `{fam.name}` | {fam.type} | {_cell(fam.documentation)} |")
    return "\n".join(out) + "\n"


def models_markdown() -> str:
    from inferd.model import registry

    return "\n".join([
        "# Supported models", "",
        "Generated from `inferd.model.registry` at every docs build (`docs/hooks.py`). A family is served from "
        "a Hugging Face folder (its `config.json` names the class) or a GGUF file (its `general.architecture`); "
        "anything else is refused with one line naming these. Every family is held to `transformers` (the \"tested\" column) on tiny "
        "random weights in both forms (`tests/test_families.py`).", "",
        registry.markdown()])


def _write(path: str, text: str):
    try:
        with open(path) as f:
            if f.read() == text:  # unchanged: `mkdocs serve` must not rebuild forever
                return
    except OSError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def write_reference(docs_dir: str = HERE):
    ref = os.path.join(docs_dir, "reference")
    _write(os.path.join(ref, "flags.md"), flags_markdown())
    _write(os.path.join(ref, "metrics.md"), metrics_markdown())
    _write(os.path.join(ref, "models.md"), models_markdown())


def readme_as_home(readme: str) -> str:
    """The README is the site's home page too: one text, its links rewritten from the repository's
    root (docs/x.md) to the site's (x.md)."""
    return readme.replace("](docs/", "](")


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri == "index.md":
        with open(os.path.join(os.path.dirname(config["docs_dir"]), "README.md")) as f:
            return readme_as_home(f.read())
    return markdown


def on_pre_build(config, **kwargs):
    write_reference(config["docs_dir"])


if __name__ == "__main__":  # `python docs/hooks.py`: refresh the committed pages without a build
    write_reference()
