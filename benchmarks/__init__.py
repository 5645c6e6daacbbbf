"""Measurements of this project on this machine: run each from the repository root as
``python -m benchmarks.NAME`` (``--help`` says what it measures). What they share is in
harness.py; the pages and images they generate are in docs/results/ (its README.md lists them).
"""
