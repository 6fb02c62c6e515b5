"""Packaging shim: the metadata lives in pyproject.toml; this keeps `python setup.py --version`
and setuptools-only tooling working."""
from setuptools import setup

setup()
