"""Packages of specgate: the top-level folders installed under one namespace.

engine/ -> specgate.engine, gateway/ -> specgate.gateway, ... (setuptools' package-dir mapping), so
`pip install specgate` puts no module named `engine`, `bench` or `migrations` into site-packages.
Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = ("engine", "gateway", "policies", "migrations", "bench")

packages: list[str] = []
package_dir: dict[str, str] = {}
for folder in FOLDERS:
    package_dir[f"specgate.{folder}"] = folder
    packages += [f"specgate.{folder}", *(f"specgate.{folder}.{p}" for p in find_packages(folder))]

setup(packages=packages, package_dir=package_dir)
