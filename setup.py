# Copyright (c) Meta Platforms, Inc. and affiliates.
# This software may be used and distributed in accordance with the terms of the Llama 3 Community License Agreement.

from setuptools import find_packages, setup


def get_requirements(path: str):
    return [line.strip() for line in open(path) if line.strip() and not line.startswith("#")]


setup(
    name="llama3",
    version="0.1.0",
    description="A faithful, readable reimplementation of Meta's Llama 3 reference inference code",
    packages=find_packages(include=["llama", "llama.*"]),
    python_requires=">=3.10",
    install_requires=get_requirements("requirements.txt"),
    extras_require={"test": get_requirements("requirements-test.txt")},
)
