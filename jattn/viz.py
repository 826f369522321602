"""Optional plotting helper: draw attention probabilities as heatmaps.

This module needs matplotlib, which jattn does not install by default; get it
with the ``viz`` extra::

    pip install "jattn[viz]"

Importing :mod:`jattn.viz` is always fine; matplotlib is imported only when
:func:`plot_attention` is called. The figure is built from
:class:`matplotlib.figure.Figure` directly, not through ``pyplot``, so no GUI
backend is involved and nothing is left open in pyplot's figure list: save the
result with ``fig.savefig(path)``, or display it in a notebook by evaluating
it.

* :func:`plot_attention` — one heatmap per head of (T, S) or (N, T, S)
  probabilities, for example a slice of :func:`jattn.attention_weights`.

Example::

    >>> import jax, jattn
    >>> from jattn import viz
    >>> q = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))  # (B, T, N, H)
    >>> w = jattn.attention_weights(q, q, is_causal=True)       # (B, N, T, S)
    >>> fig = viz.plot_attention(w[0], tokens=["the", "cat", "sat", "down"])
    >>> len(fig.axes)                                            # 2 heads + colorbar
    3
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _checks

__all__ = [
  "plot_attention",
]

if TYPE_CHECKING:
  import matplotlib.axes
  import matplotlib.figure

MAX_LABELLED = 64
"""Axes at most this long get a tick (and label) on every row or column."""

_AXIS_LABEL_INCHES = 0.5  # per panel side: an axis label ("query", "key") and padding
_TITLE_INCHES = 0.35
_COLORBAR_INCHES = 1.1
_CHAR_EMS = 0.65  # a generous average width of one tick-label character, in ems


def plot_attention(
  weights: Any,
  tokens: Sequence[Any] | None = None,
  *,
  key_tokens: Sequence[Any] | None = None,
  titles: Sequence[Any] | None = None,
  ax: matplotlib.axes.Axes | None = None,
  cmap: Any = "viridis",
  max_cols: int = 4,
  cell_inches: float = 0.35,
) -> matplotlib.figure.Figure:
  """Heatmaps of attention probabilities, one panel per head.

  Rows are queries (the y axis, labelled "query", query 0 at the top) and
  columns are keys (the x axis, labelled "key"). Every panel shares one colour
  scale fixed to [0, 1], since the values are probabilities, with a single
  colorbar; values outside [0, 1] are drawn in the end colours.

  Ticks: an axis of at most 64 rows (or columns) gets a tick on every row
  (column), labelled with its token, or with its index when no tokens are
  given; key tokens are rotated 90°. A longer axis keeps matplotlib's default
  numeric ticks and its tokens, if any, are not drawn.

  Args:
    weights: array-like (NumPy or JAX) of real numbers, shape (T, S) for one
      head or (N, T, S) for N heads, e.g. ``jattn.attention_weights(q, k)[b]``
      (B, N, T, S → N, T, S). Drawn as float64; every value must be finite.
    tokens: optional T labels for the query rows (anything; each is passed
      through ``str``). Also labels the key columns when ``key_tokens`` is
      None, which is self-attention and needs S == T.
    key_tokens: optional S labels for the key columns (cross-attention).
    titles: optional N panel titles. Default "head 0", "head 1", ... for 3-D
      ``weights`` and no title for 2-D.
    ax: optional existing matplotlib Axes to draw into, only for 2-D
      ``weights``; the colorbar takes its space from this Axes.
    cmap: a matplotlib colormap or its name.
    max_cols: the most panels per row of the grid, >= 1.
    cell_inches: the side of one (query, key) cell in inches, > 0; sets the
      figure size (unused with ``ax``).

  Returns:
    The :class:`matplotlib.figure.Figure` drawn into (``ax.figure`` when
    ``ax`` is given). Each head is ``fig.axes[i].images[0]``.

  Raises:
    ImportError: matplotlib is not installed.
    TypeError: ``weights`` is not real-valued, or an argument has the wrong
      type.
    ValueError: a shape, length or value is wrong.

  Example::

    >>> import numpy as np
    >>> from jattn import viz
    >>> w = np.full((2, 3, 3), 1 / 3)                # (N, T, S), rows sum to 1
    >>> fig = viz.plot_attention(w, tokens="a b c".split())
    >>> fig.savefig("/tmp/attention.png")            # doctest: +SKIP
  """
  try:
    import matplotlib.axes
    import matplotlib.figure
  except ImportError as e:
    raise ImportError("jattn.viz needs matplotlib: pip install 'jattn[viz]'") from e

  w = _weights_array(weights)
  shape = w.shape
  squeeze = w.ndim == 2
  if squeeze:
    w = w[None]
  n, t, s = w.shape

  query_labels, key_labels = _axis_labels(tokens, key_tokens, shape, t, s)
  if titles is None:
    title_list = [None] if squeeze else [f"head {i}" for i in range(n)]
  else:
    title_list = _labels(
      "titles", titles, n, "N, the number of heads" if not squeeze else "1 for 2-D weights"
    )

  max_cols = _checks.integer("max_cols", max_cols, minimum=1)
  cell_inches = _checks.positive_real("cell_inches", cell_inches)

  fontsize = max(4.0, min(10.0, 0.6 * cell_inches * 72))  # tick labels: at most one per cell
  if ax is not None:
    if not squeeze:
      raise ValueError(
        f"ax draws a single head, so weights must be 2-D (T, S) with ax, got shape "
        f"{shape}; leave ax out to get one panel per head"
      )
    if not isinstance(ax, matplotlib.axes.Axes):
      raise TypeError(f"ax must be a matplotlib Axes, got {type(ax).__name__}")
    fig = ax.figure
    axes = [ax]
  else:
    fig, axes = _figure(n, t, s, max_cols, cell_inches, fontsize, query_labels, key_labels)
  image = None
  for panel, head, title in zip(axes, w, title_list):
    image = panel.imshow(
      head, cmap=cmap, vmin=0.0, vmax=1.0, aspect="equal", interpolation="nearest"
    )
    panel.set_xlabel("key")
    panel.set_ylabel("query")
    if title is not None:
      panel.set_title(title)
    if t <= MAX_LABELLED:
      panel.set_yticks(
        np.arange(t),
        query_labels if query_labels is not None else [str(i) for i in range(t)],
        fontsize=fontsize,
      )
    if s <= MAX_LABELLED:
      panel.set_xticks(
        np.arange(s),
        key_labels if key_labels is not None else [str(i) for i in range(s)],
        fontsize=fontsize,
        rotation=90 if key_labels is not None else 0,
      )
  assert image is not None  # at least one panel
  fig.colorbar(image, ax=axes, label="attention weight")
  return fig  # type: ignore[return-value]  # ax.figure of a user's Axes may be a SubFigure


def _axis_labels(
  tokens: Sequence[Any] | None,
  key_tokens: Sequence[Any] | None,
  shape: tuple[int, ...],
  t: int,
  s: int,
) -> tuple[list[str] | None, list[str] | None]:
  """The query rows' and key columns' labels (None: indices), checked against T and S; the
  query tokens label the keys too in self-attention."""
  query_labels = (
    None
    if tokens is None
    else _labels("tokens", tokens, t, "T, the query length (weights.shape[-2])")
  )
  if key_tokens is not None:
    return query_labels, _labels(
      "key_tokens", key_tokens, s, "S, the key length (weights.shape[-1])"
    )
  if query_labels is not None and s != t:
    raise ValueError(
      f"tokens label both queries and keys only for self-attention (S == T), but weights "
      f"has shape {shape} with T={t}, S={s}; pass key_tokens for "
      f"the {s} key columns"
    )
  return query_labels, query_labels


def _figure(
  n: int,
  t: int,
  s: int,
  max_cols: int,
  cell_inches: float,
  fontsize: float,
  query_labels: list[str] | None,
  key_labels: list[str] | None,
) -> tuple[Any, list[Any]]:
  """A new figure with a grid of ``n`` panels of T x S cells, and its panels: sized for the
  cells, the tick labels beside them (rotated below for keys), titles and a colorbar."""
  import matplotlib.figure

  ncols = min(n, max_cols)
  nrows = -(-n // ncols)
  # Room for the tick labels: query labels sit left of each panel, key labels
  # (rotated) below it; long axes get matplotlib's short numeric labels.
  em = fontsize / 72
  query_chars = max(map(len, query_labels)) if query_labels and t <= MAX_LABELLED else 4
  key_chars = max(map(len, key_labels)) if key_labels and s <= MAX_LABELLED else 1
  width = (
    ncols * (max(s * cell_inches, 1.0) + _AXIS_LABEL_INCHES + _CHAR_EMS * em * query_chars)
    + _COLORBAR_INCHES
  )
  height = nrows * (
    max(t * cell_inches, 1.0) + _AXIS_LABEL_INCHES + _TITLE_INCHES + _CHAR_EMS * em * key_chars
  )
  fig = matplotlib.figure.Figure(figsize=(width, height), layout="constrained")
  grid = fig.subplots(nrows, ncols, squeeze=False).ravel()
  for extra in grid[n:]:
    extra.remove()
  return fig, list(grid[:n])


def _weights_array(weights: Any) -> np.ndarray:
  """``weights`` as a finite float64 (N, T, S) or (T, S) NumPy array, or a clear error."""
  if isinstance(weights, jax.core.Tracer):
    raise TypeError(
      f"weights must be a concrete array, got a traced value of shape "
      f"{_checks.shape_of(weights)}; plot outside jit/vmap/grad"
    )
  try:
    array = np.asarray(weights)
  except ValueError as e:  # ragged nested lists
    raise ValueError(
      f"weights must be a rectangular array, got a ragged {type(weights).__name__}: {e}"
    ) from e
  dtype = array.dtype
  if dtype == np.bool_ or not (
    jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
  ):
    raise TypeError(f"weights must hold real numbers (floats or ints), got dtype {dtype}")
  if array.ndim not in (2, 3):
    raise ValueError(
      f"weights must be 2-D (T, S) for one head or 3-D (N, T, S) for N heads, got shape "
      f"{array.shape}"
    )
  if 0 in array.shape:
    raise ValueError(f"weights must have no empty dimensions, got shape {array.shape}")
  array = array.astype(np.float64)
  if not np.isfinite(array).all():
    bad = int(np.size(array) - np.isfinite(array).sum())
    raise ValueError(f"weights must be finite, got {bad} NaN or infinite values")
  return array


def _labels(name: str, labels: Any, expected: int, what: str) -> list[str]:
  """``labels`` as a list of ``expected`` strings, or a clear error."""
  if isinstance(labels, (str, bytes)):
    raise TypeError(
      f"{name} must be a sequence of labels, not a single {type(labels).__name__} "
      f"{labels!r}; split it first, e.g. {name}=text.split()"
    )
  try:
    items = list(labels)
  except TypeError:
    raise TypeError(f"{name} must be a sequence of labels, got {type(labels).__name__}") from None
  if len(items) != expected:
    raise ValueError(f"{name} must have {expected} entries ({what}), got {len(items)}")
  return [str(item) for item in items]
