"""Names every docstring example may use without importing them, for
``pytest --doctest-modules jattn`` (what .ci/run runs): the examples read as the
API reference shows them, where ``masks.causal()`` means ``jattn.masks.causal()``."""

import pytest


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jattn
  from jattn import masks, scores

  doctest_namespace.update(jax=jax, jnp=jnp, np=np, jattn=jattn, masks=masks, scores=scores)
