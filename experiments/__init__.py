"""Experiments built on jattn: benchmarks, demos and the toy training study."""
