"""jattn: attention for JAX.

``jattn.dot_product_attention`` is a drop-in superset of
``jax.nn.dot_product_attention`` with index-function masks
(:mod:`jattn.masks`, sparse patterns included), score modifiers
(:mod:`jattn.scores`), dropout on the attention weights (:mod:`jattn.dropout`),
sequence-parallel ring attention over a device mesh (:mod:`jattn.parallel`)
and a choice of backward rule. Around it: ``jattn.linear_attention``
(kernelised, O(T)), :mod:`jattn.hopfield` (modern Hopfield retrieval) and
:mod:`jattn.viz` (attention heat maps, with the ``viz`` extra).
"""

from jattn import decode as decode
from jattn import dropout as dropout
from jattn import hopfield as hopfield
from jattn import linear as linear
from jattn import masks as masks
from jattn import parallel as parallel
from jattn import positional as positional
from jattn import scores as scores
from jattn import testing as testing
from jattn import viz as viz  # plots; imports matplotlib only when called
from jattn._validate.options import Options as Options
from jattn.attention import attention_weights as attention_weights
from jattn.attention import dot_product_attention as dot_product_attention
from jattn.attention import explain as explain
from jattn.impl.select import Choice as Choice
from jattn.linear import linear_attention as linear_attention
from jattn.masks import Mask as Mask
from jattn.qk_clip import qk_clip_scales as qk_clip_scales
from jattn.scores import ScoreFn as ScoreFn
from jattn.varlen import varlen_attention as varlen_attention

__all__ = [
  "dot_product_attention",
  "attention_weights",
  "explain",
  "Choice",
  "Options",
  "linear_attention",
  "qk_clip_scales",
  "varlen_attention",
  "Mask",
  "ScoreFn",
  "decode",
  "dropout",
  "hopfield",
  "linear",
  "masks",
  "parallel",
  "positional",
  "scores",
  "testing",
  "viz",
]

__version__ = "0.1.0"
