"""Attention implementations. Each takes normalised, validated arguments."""
