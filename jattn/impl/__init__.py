"""Attention implementations. Each takes normalised, validated arguments."""

__all__: list[str] = []  # the implementations are its modules, one row of the table each
