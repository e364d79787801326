"""pyproject.toml as the build backend reads it at `pip install`: no deprecation warning of ours in a
newcomer's install log (setuptools dropped `project.license` as a table on 2027-02-18), and the
licence shipped as a file. Read by the setuptools this environment has, in process (no index, no
build); `pip install -e .` in a fresh venv runs the same code under pip."""
import pathlib
import re
import tomllib
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_setuptools_reads_the_project_without_a_warning(monkeypatch):
    from setuptools import __version__ as have
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    need = re.fullmatch(r"setuptools>=(\d+)", project["build-system"]["requires"][0])
    assert need and int(need.group(1)) >= 77  # the first to take an SPDX string and license-files
    if int(have.split(".")[0]) < int(need.group(1)):  # pip's isolated build fetches a newer one
        pytest.skip(f"setuptools {have} here cannot read what {need.group(0)} reads")
    monkeypatch.chdir(ROOT)  # license-files are found from the project's root, as pip runs the backend
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.metadata.license_files == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
