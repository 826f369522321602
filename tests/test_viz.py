"""jattn.viz.plot_attention: what it draws, where, and what it refuses."""

import builtins
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import viz

# matplotlib is imported by the tests that draw (and by jattn.viz when it draws), not at
# collection, which every test worker pays for the whole suite.
pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("matplotlib") is None, reason="jattn.viz draws with matplotlib"
)


def _figure_class():
  import matplotlib.figure

  return matplotlib.figure.Figure


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _probabilities(*shape, seed=0):
  """Random rows that sum to one, float64."""
  x = np.random.default_rng(seed).random(shape)
  return x / x.sum(-1, keepdims=True)


def _panels(fig):
  """The heatmap axes (the colorbar's axes hold no image)."""
  return [ax for ax in fig.axes if ax.images]


def _colorbars(fig):
  return [ax for ax in fig.axes if not ax.images]


def _ticklabels(axis):
  return [label.get_text() for label in axis.get_ticklabels()]


def test_2d_draws_one_panel_with_the_weights_and_no_title():
  w = _probabilities(3, 5)
  fig = viz.plot_attention(w)
  assert isinstance(fig, _figure_class())
  (panel,) = _panels(fig)
  np.testing.assert_array_equal(panel.images[0].get_array(), w)
  assert panel.get_title() == ""
  assert panel.get_xlabel() == "key" and panel.get_ylabel() == "query"
  assert len(_colorbars(fig)) == 1


def test_3d_draws_one_panel_per_head_in_order_with_default_titles():
  w = _probabilities(3, 4, 4)
  fig = viz.plot_attention(w)
  panels = _panels(fig)
  assert len(panels) == 3
  assert [p.get_title() for p in panels] == ["head 0", "head 1", "head 2"]
  for panel, head in zip(panels, w):
    np.testing.assert_array_equal(panel.images[0].get_array(), head)


def test_grid_has_at_most_max_cols_columns_and_drops_unused_cells():
  fig = viz.plot_attention(_probabilities(5, 2, 2), max_cols=2)
  panels = _panels(fig)
  assert len(panels) == 5 and len(fig.axes) == 6  # five heads and one colorbar, no blanks
  columns = {p.get_subplotspec().colspan.start for p in panels}
  rows = {p.get_subplotspec().rowspan.start for p in panels}
  assert columns == {0, 1} and rows == {0, 1, 2}


def test_custom_titles():
  fig = viz.plot_attention(_probabilities(2, 3, 3), titles=["local", "global"])
  assert [p.get_title() for p in _panels(fig)] == ["local", "global"]
  fig = viz.plot_attention(_probabilities(3, 3), titles=["only"])
  assert [p.get_title() for p in _panels(fig)] == ["only"]


def test_colour_scale_is_zero_to_one_for_every_panel_and_the_colorbar():
  # Values well inside (0, 1): autoscaling would have chosen other limits.
  w = np.full((2, 3, 3), 0.3)
  w[1, 0, 0] = 0.6
  fig = viz.plot_attention(w)
  for panel in _panels(fig):
    assert panel.images[0].get_clim() == (0.0, 1.0)
  (cbar,) = _colorbars(fig)
  assert cbar.get_ylim() == (0.0, 1.0)


def test_self_attention_tokens_label_queries_on_y_and_keys_on_x():
  tokens = ["the", "cat", "sat", 4]
  fig = viz.plot_attention(_probabilities(2, 4, 4), tokens)
  for panel in _panels(fig):
    assert _ticklabels(panel.yaxis) == ["the", "cat", "sat", "4"]
    assert _ticklabels(panel.xaxis) == ["the", "cat", "sat", "4"]
    assert list(panel.get_yticks()) == [0, 1, 2, 3]
    assert {label.get_rotation() for label in panel.get_xticklabels()} == {90.0}


def test_cross_attention_key_tokens_label_the_columns():
  fig = viz.plot_attention(_probabilities(2, 3), ["q0", "q1"], key_tokens=("k0", "k1", "k2"))
  (panel,) = _panels(fig)
  assert _ticklabels(panel.yaxis) == ["q0", "q1"]
  assert _ticklabels(panel.xaxis) == ["k0", "k1", "k2"]
  # key_tokens alone: queries get their indices.
  fig = viz.plot_attention(_probabilities(2, 3), key_tokens=["a", "b", "c"])
  (panel,) = _panels(fig)
  assert _ticklabels(panel.yaxis) == ["0", "1"]
  assert _ticklabels(panel.xaxis) == ["a", "b", "c"]


def test_without_tokens_every_row_and_column_gets_its_index():
  fig = viz.plot_attention(_probabilities(2, 3))
  (panel,) = _panels(fig)
  assert _ticklabels(panel.yaxis) == ["0", "1"]
  assert _ticklabels(panel.xaxis) == ["0", "1", "2"]


def test_long_axes_keep_default_ticks_instead_of_one_per_token():
  t = viz.MAX_LABELLED + 1
  tokens = [f"tok{i}" for i in range(t)]
  fig = viz.plot_attention(_probabilities(t, t), tokens, cell_inches=0.05)
  (panel,) = _panels(fig)
  assert len(panel.get_xticks()) < t and len(panel.get_yticks()) < t
  assert not set(_ticklabels(panel.xaxis)) & set(tokens)
  # A short query axis next to a long key axis is still labelled in full.
  fig = viz.plot_attention(_probabilities(2, t), ["a", "b"], key_tokens=tokens, cell_inches=0.05)
  (panel,) = _panels(fig)
  assert _ticklabels(panel.yaxis) == ["a", "b"]
  assert len(panel.get_xticks()) < t and not set(_ticklabels(panel.xaxis)) & set(tokens)


def test_jax_arrays_and_lists_work():
  w = jnp.asarray(_probabilities(2, 3, 3), jnp.float32)
  fig = viz.plot_attention(w)
  for panel, head in zip(_panels(fig), np.asarray(w)):
    np.testing.assert_allclose(panel.images[0].get_array(), head)
  fig = viz.plot_attention(w.astype(jnp.bfloat16))
  assert _panels(fig)[0].images[0].get_array().dtype == np.float64
  fig = viz.plot_attention([[1, 0], [0.5, 0.5]])
  np.testing.assert_array_equal(_panels(fig)[0].images[0].get_array(), [[1, 0], [0.5, 0.5]])


def test_attention_weights_output_plots():
  import jattn

  q = jnp.asarray(np.random.default_rng(1).normal(size=(1, 3, 2, 4)), jnp.float32)
  w = jattn.attention_weights(q, q, is_causal=True)  # (B, N, T, S)
  fig = viz.plot_attention(w[0], ["a", "b", "c"])
  panels = _panels(fig)
  assert len(panels) == 2
  np.testing.assert_allclose(panels[1].images[0].get_array(), np.asarray(w[0, 1]), rtol=1e-6)
  assert panels[0].images[0].get_array()[0, 1] == 0  # causal: query 0 cannot see key 1


def test_ax_draws_into_the_given_axes_and_returns_its_figure():
  fig = _figure_class()()
  left, right = fig.subplots(1, 2)
  w = _probabilities(2, 2)
  out = viz.plot_attention(w, ["x", "y"], ax=right, titles=["mine"])
  assert out is fig
  assert not left.images and len(right.images) == 1
  np.testing.assert_array_equal(right.images[0].get_array(), w)
  assert right.get_title() == "mine"
  assert _ticklabels(right.yaxis) == ["x", "y"]
  assert len(fig.axes) == 3  # the two axes and a colorbar


def test_savefig_writes_a_png(tmp_path):
  fig = viz.plot_attention(_probabilities(2, 3, 3), ["a", "b", "c"])
  path = tmp_path / "a.png"
  fig.savefig(path)
  data = path.read_bytes()
  assert data.startswith(PNG_SIGNATURE) and len(data) > len(PNG_SIGNATURE)


def test_figure_size_follows_cells_and_grid():
  small = viz.plot_attention(_probabilities(4, 4), cell_inches=0.2).get_size_inches()
  large = viz.plot_attention(_probabilities(4, 4), cell_inches=0.4).get_size_inches()
  assert (large > small).all()
  one_row = viz.plot_attention(_probabilities(4, 3, 3), max_cols=4).get_size_inches()
  two_rows = viz.plot_attention(_probabilities(4, 3, 3), max_cols=2).get_size_inches()
  assert two_rows[0] < one_row[0] and two_rows[1] > one_row[1]


def test_missing_matplotlib_is_a_clear_import_error(monkeypatch):
  real_import = builtins.__import__

  def no_matplotlib(name, *args, **kwargs):
    if name == "matplotlib" or name.startswith("matplotlib."):
      raise ImportError(f"No module named {name!r}")
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_matplotlib)
  with pytest.raises(ImportError, match=r"pip install 'jattn\[viz\]'") as info:
    viz.plot_attention(_probabilities(2, 2))
  assert isinstance(info.value.__cause__, ImportError)


def test_traced_weights_are_refused():
  with pytest.raises(TypeError, match="weights must be a concrete array"):
    jax.jit(viz.plot_attention)(jnp.ones((2, 2)))


_W2 = _probabilities(3, 3)
_W3 = _probabilities(2, 3, 3)
_NAN = np.array([[0.5, np.nan], [0.5, 0.5]])


@pytest.mark.parametrize(
  "args, kwargs, error, match",
  [
    ((np.ones(3),), {}, ValueError, r"weights must be 2-D .* got shape \(3,\)"),
    ((np.ones((1, 2, 2, 2)),), {}, ValueError, r"got shape \(1, 2, 2, 2\)"),
    ((np.float64(0.5),), {}, ValueError, r"got shape \(\)"),
    ((np.ones((0, 3)),), {}, ValueError, r"no empty dimensions, got shape \(0, 3\)"),
    ((np.ones((2, 3, 0)),), {}, ValueError, r"no empty dimensions, got shape \(2, 3, 0\)"),
    (([[0.5, 0.5], [1.0]],), {}, ValueError, "weights must be a rectangular array"),
    ((np.ones((2, 2), complex),), {}, TypeError, "weights must hold real numbers.*complex"),
    ((np.ones((2, 2), bool),), {}, TypeError, "weights must hold real numbers.*bool"),
    ((np.array([["a", "b"], ["c", "d"]]),), {}, TypeError, "weights must hold real numbers"),
    (
      (np.array([[0.5, None], [1, 0]], object),),
      {},
      TypeError,
      "weights must hold real numbers.*object",
    ),
    ((_NAN,), {}, ValueError, "weights must be finite, got 1 NaN"),
    ((np.array([[np.inf, 0.0], [0.5, 0.5]]),), {}, ValueError, "weights must be finite"),
    ((_W2, ["a", "b"]), {}, ValueError, r"tokens must have 3 entries \(T, .*\), got 2"),
    ((_W3, "abc"), {}, TypeError, "tokens must be a sequence of labels, not a single str"),
    ((_W3, 3), {}, TypeError, "tokens must be a sequence of labels, got int"),
    ((_W2,), {"key_tokens": ["a", "b"]}, ValueError, r"key_tokens must have 3 entries \(S, "),
    (
      (_probabilities(2, 3), ["a", "b"]),
      {},
      ValueError,
      r"self-attention \(S == T\).*T=2, S=3; pass key_tokens",
    ),
    ((_W3,), {"titles": ["one"]}, ValueError, r"titles must have 2 entries \(N, .*\), got 1"),
    ((_W2,), {"titles": ["a", "b"]}, ValueError, r"titles must have 1 entries \(1 for 2-D"),
    ((_W3,), {"max_cols": 0}, ValueError, "max_cols must be >= 1, got 0"),
    ((_W3,), {"max_cols": 1.5}, TypeError, "max_cols must be an int"),
    ((_W3,), {"cell_inches": 0}, ValueError, "cell_inches must be a positive finite number"),
    ((_W3,), {"cell_inches": -0.1}, ValueError, "cell_inches must be a positive finite number"),
    ((_W3,), {"cell_inches": float("inf")}, ValueError, "cell_inches must be a positive finite"),
    ((_W3,), {"cell_inches": "big"}, TypeError, "cell_inches must be a real number"),
  ],
)
def test_bad_inputs_are_refused_with_a_message_naming_the_argument(args, kwargs, error, match):
  with pytest.raises(error, match=match):
    viz.plot_attention(*args, **kwargs)


def test_ax_is_refused_with_3d_weights_and_non_axes():
  fig = _figure_class()()
  ax = fig.subplots()
  with pytest.raises(
    ValueError, match=r"weights must be 2-D \(T, S\) with ax, got shape \(2, 3, 3\)"
  ):
    viz.plot_attention(_W3, ax=ax)
  assert not ax.images
  with pytest.raises(TypeError, match="ax must be a matplotlib Axes, got Figure"):
    viz.plot_attention(_W2, ax=fig)
