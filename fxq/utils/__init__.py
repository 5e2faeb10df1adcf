"""Helpers that are not part of the quantization pipeline."""
