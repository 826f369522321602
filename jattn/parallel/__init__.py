"""Sequence-parallel (ring) attention over a ``jax.sharding.Mesh``.

When one device cannot hold a sequence's activations, shard the sequence
axis over several devices. :func:`ring_attention` keeps each device's query
shard in place and passes the key/value shards around a ring of devices with
``jax.lax.ppermute``; every device merges the partial results with the
online-softmax rule, so no device ever holds more than two key/value shards::

    step s, device i:  (o, m, l) ← blockwise attention of Q_i against K_{i-s}, V_{i-s}
                       m' = max(m_acc, m),  w_acc = l_acc·e^{m_acc−m'},  w = l·e^{m−m'}
                       l' = w_acc + w,  out ← (out·w_acc + o·w) / l'

(m and l are each row's max and sum, kept apart rather than as the log-sum-exp
m + log l, which loses log l when ``|m|`` is huge; see jattn.impl.blockwise.)

The backward pass rings too: each key/value shard travels with float32
accumulators of its own dK and dV, every device adds its queries'
contribution, and one last hop returns them to their owner. Per-device
memory for a training step is O(B·T·N·H / P) on P devices.

Everything runs on JAX's SPMD machinery (``jax.shard_map`` and collective
permutes), so the same code runs on several GPUs or TPUs, and on many hosts
after ``jax.distributed.initialize()``.

Causal load balance: with a contiguous split, device i's queries see i + 1
of the P key/value shards, so under causal masking the last device does
about twice the average work and every ring step waits for it. The
``"zigzag"`` layout gives device i sequence chunks i and 2P − 1 − i (of 2P),
``"striped"`` gives it positions i, i + P, i + 2P, ...; both leave every
device the same causal work. Bring inputs into a layout with :func:`permute`
and outputs back with :func:`unpermute`; masks are always written in the
sequence's natural positions.

:func:`context_parallel_attention` picks among four strategies: the ring, one
all-gather of keys and values, Ulysses' all-to-alls (sequence for heads), and
USP, Ulysses within a group of devices and the ring across groups (two mesh
axes); :func:`explain` says what each device runs.

Shape legend as in :mod:`jattn.attention`; P is the number of devices on the
ring axis.
"""

from jattn.parallel.context import STRATEGIES as STRATEGIES
from jattn.parallel.context import context_parallel_attention as context_parallel_attention
from jattn.parallel.context import explain as explain
from jattn.parallel.context import ring_attention as ring_attention
from jattn.parallel.layouts import LAYOUTS as LAYOUTS
from jattn.parallel.layouts import permute as permute
from jattn.parallel.layouts import positions as positions
from jattn.parallel.layouts import unpermute as unpermute

__all__ = [
  "LAYOUTS",
  "STRATEGIES",
  "positions",
  "permute",
  "unpermute",
  "ring_attention",
  "context_parallel_attention",
  "explain",
]
