"""Checkpoint formats: pure-Python parsing and planning (no torch here).

The torch-facing entry points are :mod:`gdskit.safetensors` and :mod:`gdskit.torch`.
"""
