"""Which implementation a call runs: the implementations, the backward rules each supports,
and the rule ``implementation=None`` follows. Arguments arrive from :mod:`jattn.attention`'s
boundary; :func:`check_choices` is the one check of the two names."""

from __future__ import annotations

import jax

from jattn.impl import blockwise, xla

# Implementation name -> the backward rules it supports (first is its default).
IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {
  "xla": xla.BACKWARDS,
  "blockwise": blockwise.BACKWARDS,
  "cudnn": (),  # jax.nn's cuDNN kernel, with its own fused backward
}


BACKWARDS = ("autodiff", "custom_vjp")


_WHY_NOT = {
  ("blockwise", "autodiff"): " (JAX cannot reverse-differentiate its tile loops, whose trip "
  "counts depend on the mask, and autodiff would store every "
  "tile's probabilities, O(T·S) memory)",
}


# implementation=None picks "blockwise" once the materialised (B, N, T, S)
# float32 scores would reach this many bytes on the default backend, and
# "xla" below it. CPU: measured crossover with experiments/bench.py (README);
# accelerators: the materialised path is fast there until memory runs short.
AUTO_BLOCKWISE_BYTES = {"cpu": 8 * 2**20, "gpu": 2**30, "tpu": 2**30}


def auto(num_scores: int, backward: str | None, blocks) -> tuple[str, str]:
  """The (implementation, backward rule) ``implementation=None`` stands for, given a checked
  ``backward`` (see dot_product_attention)."""
  if blocks != (None, None):  # tiles ask for blockwise, which must support the rule
    _, rule = check_choices("blockwise", backward)
    assert rule is not None
    return "blockwise", rule
  if backward == "autodiff":
    impl = "xla"
  else:
    limit = AUTO_BLOCKWISE_BYTES.get(jax.default_backend(), AUTO_BLOCKWISE_BYTES["gpu"])
    impl = "blockwise" if 4 * num_scores >= limit else "xla"
  return impl, IMPLEMENTATIONS[impl][0] if backward is None else backward


def check_choices(implementation, backward) -> tuple[str | None, str | None]:
  """(implementation, backward) checked; (None, backward) while auto is still to choose."""
  if implementation is None:
    if backward is not None and backward not in BACKWARDS:
      raise ValueError(f"backward must be one of {list(BACKWARDS)} or None, got {backward!r}")
    return None, backward
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be one of {sorted(IMPLEMENTATIONS)} or None, got {implementation!r}"
    )
  supported = IMPLEMENTATIONS[implementation]
  if backward is None:
    return implementation, (supported[0] if supported else None)
  if backward not in BACKWARDS:
    raise ValueError(f"backward must be one of {list(BACKWARDS)} or None, got {backward!r}")
  if backward not in supported:
    rules = (
      f"supports only {list(supported)}"
      if supported
      else "has its own fused backward; leave backward=None"
    )
    raise ValueError(
      f"implementation={implementation!r} does not support "
      f"backward={backward!r}: it {rules}"
      f"{_WHY_NOT.get((implementation, backward), '')}"
    )
  return implementation, backward
