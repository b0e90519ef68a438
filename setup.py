"""Kiln's packages, found from its folders (everything else is in pyproject.toml).

The import names differ from the folder names (``gateway/`` is ``kiln.gateway``), which
pyproject's ``packages.find`` cannot express; so every package under each folder is found here and
a new subpackage needs no listing.
"""

from setuptools import find_packages, setup

FOLDERS = {"kiln": "kiln", "kiln.gateway": "gateway", "kiln.worker": "worker", "kiln.protocol": "protocol"}

packages = []
for name, folder in FOLDERS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(where=folder)]

setup(package_dir=FOLDERS, packages=packages)
