"""Package discovery: ``ftitan/`` plus ``kernels/`` installed as ``ftitan.kernels``.

Everything else lives in pyproject.toml; this file only exists because that
mapping (a top-level folder becoming a subpackage) cannot be discovered there.
"""

from setuptools import find_packages, setup

kernels = find_packages(include=["kernels", "kernels.*"])
setup(
    packages=find_packages(include=["ftitan", "ftitan.*"]) + ["ftitan." + p for p in kernels],
    package_dir={"ftitan." + p: p.replace(".", "/") for p in kernels},
)
