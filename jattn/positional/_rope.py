"""Rotary position embeddings (RoPE): frequencies, context scalings, rope and Rotary."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks
from jattn.positional._arrays import _compute_dtype, _float_array, _positions_array

SCALING_KINDS = ("linear", "ntk", "llama3", "yarn")
"""The values :attr:`RopeScaling.kind` accepts."""


# --------------------------------------------------------------------------- RoPE scaling


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How RoPE stretches to contexts longer than it was trained on.

  Each kind rewrites the inverse frequencies ``θ_i = base ** (-2i / R)``,
  ``i = 0 .. R/2 - 1``, of a rotary dimension R (formulas as in Hugging Face
  transformers ``modeling_rope_utils.py``, ``_compute_*_parameters``); the
  wavelength of channel pair i is ``λ_i = 2π / θ_i``.

  * ``"linear"`` — position interpolation (Chen et al., 2023, kaiokendev):
    positions are divided by ``factor``, i.e. ``θ_i / factor``.
  * ``"ntk"`` — NTK-aware base change (bloc97): ``base' = base · factor **
    (R / (R - 2))``, so the lowest frequency is divided by exactly ``factor``
    and the highest is unchanged. Needs R > 2. (Static, not "dynamic" NTK.)
  * ``"llama3"`` — Llama 3.1's rule (Meta's ``apply_scaling``): with ``L =
    original_max_position``, ``λ_i < L / high_freq_factor`` keeps ``θ_i``;
    ``λ_i > L / low_freq_factor`` uses ``θ_i / factor``; in between
    ``(1 - s) θ_i / factor + s θ_i`` with ``s = (L / λ_i - low_freq_factor) /
    (high_freq_factor - low_freq_factor)``.
  * ``"yarn"`` — YaRN "NTK-by-parts" (Peng et al., 2023), as in the
    reference code (jquesnelle/yarn, Hugging Face): the pair index where
    ``λ_i`` fits ``β`` rotations into L is ``d(β) = R ln(L / (2π β)) / (2 ln
    base)``; ``low = d(beta_fast)``, ``high = d(beta_slow)`` (floored and
    ceiled when ``truncate``, then clipped to [0, R - 1]); ``γ_i = clip((i -
    low) / (high - low), 0, 1)``, linear in the pair index i; the frequency is
    ``(1 - γ_i) θ_i + γ_i θ_i / factor``. :func:`rope` also multiplies the
    rotated channels of its output by :attr:`output_scale` (YaRN's
    ``mscale = 0.1 ln(factor) + 1``, or ``attention_factor`` if given); applied
    to both queries and keys this scales their logits by ``mscale²``, the
    paper's ``1/t``. Pass-through channels (``rotary_fraction < 1``) are not
    scaled, as in Hugging Face.

  Attributes:
    kind: one of ``"linear"``, ``"ntk"``, ``"llama3"``, ``"yarn"``.
    factor: context extension ratio, >= 1 (1 leaves RoPE unchanged).
    original_max_position: L, the context length the model was trained with
      (Hugging Face's ``original_max_position_embeddings``); llama3 and yarn.
    low_freq_factor, high_freq_factor: llama3's band edges, 0 < low < high.
    beta_fast, beta_slow: yarn's ramp ends in rotations over L, beta_fast >
      beta_slow > 0.
    attention_factor: yarn's output scale; None means ``0.1 ln(factor) + 1``.
    truncate: yarn: floor/ceil the ramp ends to whole pair indices (the
      reference code and Hugging Face's default; gpt-oss uses False).
  """

  kind: str
  factor: float
  original_max_position: int = 8192
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  truncate: bool = True

  def __post_init__(self) -> None:
    if not isinstance(self.kind, str):
      raise TypeError(f"kind must be a str, one of {list(SCALING_KINDS)}, got {self.kind!r}")
    if self.kind not in SCALING_KINDS:
      raise ValueError(f"kind must be one of {list(SCALING_KINDS)}, got {self.kind!r}")
    fields = {}
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
      value = _checks.real(name, getattr(self, name))
      if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
      fields[name] = value
    if fields["factor"] < 1:
      raise ValueError(
        f"factor must be >= 1 (the ratio by which the context grows), got {fields['factor']}"
      )
    fields["original_max_position"] = _checks.integer(
      "original_max_position", self.original_max_position, minimum=1
    )
    if not 0 < fields["low_freq_factor"] < fields["high_freq_factor"]:
      raise ValueError(
        f"low_freq_factor ({fields['low_freq_factor']}) and high_freq_factor "
        f"({fields['high_freq_factor']}) must satisfy 0 < low_freq_factor < "
        f"high_freq_factor"
      )
    if not 0 < fields["beta_slow"] < fields["beta_fast"]:
      raise ValueError(
        f"beta_fast ({fields['beta_fast']}) and beta_slow ({fields['beta_slow']}) "
        f"must satisfy beta_fast > beta_slow > 0"
      )
    if self.attention_factor is not None:
      value = _checks.real("attention_factor", self.attention_factor)
      if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"attention_factor must be a positive finite number or None, got {value}")
      if self.kind != "yarn":
        raise ValueError(f"attention_factor applies only to kind='yarn', got kind={self.kind!r}")
      fields["attention_factor"] = value
    if not isinstance(self.truncate, (bool, np.bool_)):
      raise TypeError(f"truncate must be a bool, got {self.truncate!r}")
    fields["truncate"] = bool(self.truncate)
    for name, value in fields.items():  # normalised to Python floats/ints: hashable, comparable
      object.__setattr__(self, name, value)

  @property
  def output_scale(self) -> float:
    """What :func:`rope` multiplies rotated channels by: YaRN's mscale, else 1."""
    if self.kind != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return self.attention_factor
    return 0.1 * math.log(self.factor) + 1.0


def _scaled_frequencies(rotary_dim: int, base: float, scaling: RopeScaling | None) -> np.ndarray:
  """(R/2,) float64 inverse frequencies; arguments already validated."""
  exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
  inv_freq = base**-exponents
  if scaling is None:
    return inv_freq
  factor = scaling.factor
  match scaling.kind:
    case "linear":
      return inv_freq / factor
    case "ntk":
      return (base * factor ** (rotary_dim / (rotary_dim - 2))) ** -exponents
    case "llama3":
      old = scaling.original_max_position
      low, high = scaling.low_freq_factor, scaling.high_freq_factor
      wavelen = 2 * math.pi / inv_freq
      smooth = (old / wavelen - low) / (high - low)
      medium = (1 - smooth) * inv_freq / factor + smooth * inv_freq
      return np.where(
        wavelen < old / high, inv_freq, np.where(wavelen > old / low, inv_freq / factor, medium)
      )
    case "yarn":

      def correction_dim(rotations: float) -> float:
        return (
          rotary_dim
          * math.log(scaling.original_max_position / (rotations * 2 * math.pi))
          / (2 * math.log(base))
        )

      low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
      if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
      low, high = max(low, 0), min(high, rotary_dim - 1)
      if low == high:
        high += 0.001  # as the reference code: avoids 0 / 0
      ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
      return (1 - ramp) * inv_freq + ramp * inv_freq / factor
    case _:
      raise ValueError(f"unknown scaling kind {scaling.kind!r}")


def _check_base(base: Any) -> float:
  return _checks.positive_real("base", base)


def _check_fraction(rotary_fraction: Any) -> float:
  rotary_fraction = _checks.real("rotary_fraction", rotary_fraction)
  if not 0 < rotary_fraction <= 1:
    raise ValueError(f"rotary_fraction must be in (0, 1], got {rotary_fraction}")
  return rotary_fraction


def _check_scaling(scaling: Any) -> RopeScaling | None:
  if scaling is not None and not isinstance(scaling, RopeScaling):
    raise TypeError(
      f"scaling must be a jattn.positional.RopeScaling or None, got {type(scaling).__name__}"
    )
  return scaling


def _check_rotary_dim(rotary_dim: int, scaling: RopeScaling | None, *, context: str) -> None:
  if rotary_dim < 2 or rotary_dim % 2:
    raise ValueError(f"{context} gives rotary_dim={rotary_dim}; it must be even and >= 2")
  if scaling is not None and scaling.kind == "ntk" and rotary_dim == 2:
    raise ValueError(
      f"scaling kind 'ntk' needs rotary_dim > 2 (its base change divides by "
      f"rotary_dim - 2); {context} gives rotary_dim=2"
    )


def _rotary_dim(head_dim: int, rotary_fraction: float, scaling: RopeScaling | None) -> int:
  rotary_dim = int(head_dim * rotary_fraction)
  _check_rotary_dim(
    rotary_dim,
    scaling,
    context=(f"rotary_fraction ({rotary_fraction}) times the head dimension H ({head_dim})"),
  )
  return rotary_dim


# --------------------------------------------------------------------------- RoPE


def rope_frequencies(
  rotary_dim: int, *, base: float = 10_000.0, scaling: RopeScaling | None = None
) -> np.ndarray:
  """RoPE's inverse frequencies ``θ_i = base ** (-2i / R)``, rewritten by ``scaling``.

  Args:
    rotary_dim: R, the number of rotated channels, even and >= 2.
    base: RoPE's θ base (10 000 in the paper, 500 000 in Llama 3).
    scaling: optional :class:`RopeScaling`.

  Returns:
    (R/2,) NumPy float32 array; pair i rotates by ``position · θ_i`` radians.
  """
  rotary_dim = _checks.integer("rotary_dim", rotary_dim)
  base, scaling = _check_base(base), _check_scaling(scaling)
  _check_rotary_dim(rotary_dim, scaling, context=f"rotary_dim ({rotary_dim})")
  return _scaled_frequencies(rotary_dim, base, scaling).astype(np.float32)


def rope(
  x: jax.typing.ArrayLike,
  positions: jax.typing.ArrayLike,
  *,
  base: float = 10_000.0,
  rotary_fraction: float = 1.0,
  scaling: RopeScaling | None = None,
) -> jax.Array:
  """Rotary position embeddings (Su et al., 2021) applied to queries or keys.

  The first ``R = int(H · rotary_fraction)`` channels rotate, the rest pass
  through unchanged. Pairs follow "rotate half" (GPT-NeoX, Llama, Gemma, Hugging
  Face): channel i pairs with channel ``i + R/2``, for ``i < R/2``, and turns by
  ``position · θ_i`` (see :func:`rope_frequencies`)::

      y[i]       = x[i] cos(p θ_i) - x[i + R/2] sin(p θ_i)
      y[i + R/2] = x[i + R/2] cos(p θ_i) + x[i] sin(p θ_i)

  (Checkpoints with interleaved pairs (2i, 2i + 1), as Meta's original Llama
  code, need their q/k projection columns permuted first.) Applied to both q
  and k, the logit ``<rope(q, m), rope(k, n)>`` depends on m - n only. With a
  YaRN ``scaling`` the rotated channels are also multiplied by
  :attr:`RopeScaling.output_scale`.

  Args:
    x: (B, T, N, H) or (T, N, H), floating dtype.
    positions: int or float array (T,), (1, T) or (B, T) for (B, T, N, H)
      input; (T,) for (T, N, H). May be traced; only its shape is checked.
    base: RoPE's θ base, > 0.
    rotary_fraction: share of the H channels that rotate, in (0, 1];
      ``int(H · rotary_fraction)`` must be even and >= 2.
    scaling: optional :class:`RopeScaling` for longer contexts.

  Returns:
    The rotated array, shaped and typed like ``x``. Angles, sines and cosines
    are computed in float32 (float64 when ``x`` is float64).
  """
  x = _float_array("x", x)
  positions = _positions_array(positions)
  base, rotary_fraction = _check_base(base), _check_fraction(rotary_fraction)
  scaling = _check_scaling(scaling)
  if x.ndim not in (3, 4):
    raise ValueError(f"x must have shape (B, T, N, H) or (T, N, H), got {tuple(x.shape)}")
  T, H = x.shape[-3], x.shape[-1]
  if x.ndim == 4:
    B = x.shape[0]
    if tuple(positions.shape) not in ((T,), (1, T), (B, T)):
      raise ValueError(
        f"positions must have shape (T,)=({T},), (1, T)=(1, {T}) or (B, T)="
        f"({B}, {T}) for x of shape (B, T, N, H)={tuple(x.shape)}, got "
        f"{tuple(positions.shape)}"
      )
  elif tuple(positions.shape) != (T,):
    raise ValueError(
      f"positions must have shape (T,)=({T},) for x of shape (T, N, H)="
      f"{tuple(x.shape)}, got {tuple(positions.shape)}"
    )
  rotary_dim = _rotary_dim(H, rotary_fraction, scaling)
  # NumPy inputs go to the jitted _rotate as they are: jnp.asarray here would stage a copy
  # program of its own for every new shape.
  return _rotate(x, positions, rotary_dim=rotary_dim, base=base, scaling=scaling)


@functools.partial(jax.jit, static_argnames=("rotary_dim", "base", "scaling"))
def _rotate(
  x: jax.Array, positions: jax.Array, *, rotary_dim: int, base: float, scaling: RopeScaling | None
) -> jax.Array:
  """``rope`` on validated arrays: x (..., T, N, H), positions (T,) or (B', T).

  Jitted, so that a call outside jit runs one program rather than a dozen operations, each
  compiled for its first shape."""
  compute = _compute_dtype(x.dtype)
  half = rotary_dim // 2
  inv_freq = jnp.asarray(_scaled_frequencies(rotary_dim, base, scaling), compute)
  # positions (T,) -> (1, T, 1, 1) (or (T, 1, 1) for rank-3 x); (B', T) -> (B', T, 1, 1).
  pos = positions.reshape((1,) * (x.ndim - 2 - positions.ndim) + positions.shape + (1, 1))
  angles = pos.astype(compute) * inv_freq.reshape((1,) * (x.ndim - 1) + (half,))
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if scaling is not None and scaling.output_scale != 1.0:
    cos, sin = cos * scaling.output_scale, sin * scaling.output_scale
  x1 = x[..., :half].astype(compute)
  x2 = x[..., half:rotary_dim].astype(compute)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  if rotary_dim == x.shape[-1]:
    return rotated
  return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


@dataclasses.dataclass(frozen=True)
class Rotary:
  """RoPE settings for modules (``rope=Rotary(...)``); calling it applies :func:`rope`.

  Example::

      >>> import jax.numpy as jnp
      >>> from jattn import positional
      >>> r = positional.Rotary(base=500_000.0, scaling=positional.RopeScaling("llama3", 8.0))
      >>> r.check_head_dim(64)
      >>> r(jnp.ones((5, 2, 64)), jnp.arange(5)).shape
      (5, 2, 64)
  """

  base: float = 10_000.0
  rotary_fraction: float = 1.0
  scaling: RopeScaling | None = None

  def __post_init__(self) -> None:
    object.__setattr__(self, "base", _check_base(self.base))
    object.__setattr__(self, "rotary_fraction", _check_fraction(self.rotary_fraction))
    _check_scaling(self.scaling)

  def __call__(self, x: jax.typing.ArrayLike, positions: jax.typing.ArrayLike) -> jax.Array:
    """``rope(x, positions)`` with these settings; x (B, T, N, H) or (T, N, H)."""
    return rope(
      x, positions, base=self.base, rotary_fraction=self.rotary_fraction, scaling=self.scaling
    )

  def check_head_dim(self, head_dim: int) -> None:
    """Raise ValueError unless these settings can rotate heads of size ``head_dim``."""
    head_dim = _checks.integer("head_dim", head_dim, minimum=1)
    _rotary_dim(head_dim, self.rotary_fraction, self.scaling)
