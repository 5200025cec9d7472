"""Every package of the project is in the distribution: a wheel or image built with
``pip install .`` (the Dockerfile's) imports what the checkout imports."""

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_top_level_package_is_included():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    missing = [name for name in packages if not any(fnmatch.fnmatch(name, i) for i in include)]
    assert not missing, f"packages left out of pyproject.toml's include: {missing}"
