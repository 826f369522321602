"""Decode-step throughput, quantization error and continuous batching over jattn.decode's caches.

Three parts, one run, one model shape (default N=8 query heads, K=2 key/value heads,
H=128, float32 queries; keys and values are seeded Gaussian noise: there is no model,
only the attention and cache work of a serving loop):

1. **Decode step.** For each batch B and context of the grid, every cache is filled to
   ``context`` tokens (``decode.update`` in chunks) and one jitted one-token step is
   timed: ``decode.attention`` with the cache as its argument, returning the new cache.

       jax.nn       the usual baseline: the new token scattered into a materialised
                    (B, max_length, K, H) cache, then jax.nn.dot_product_attention of q
                    against all of it with ``key_value_seq_lengths``
       contiguous   decode.init(B, max_length, ...) float32
       paged        decode.init_paged(...) float32, pages of ``page_size`` slots
       paged-int8   the same pages stored as int8, one float32 scale per token and head

   max_length = context + ``headroom``; the paged pool holds exactly the pages of B rows
   of max_length. Every step donates its cache (``donate_argnums``), so the write is in
   place and no step copies the cache, and rewinds the lengths it advanced, so every
   call writes slot ``context`` and attends over context + 1 tokens: the same work on
   every call. The methods of one cell take turns in rounds (experiments/_timing.py:
   an untimed call, then a block of back-to-back calls lasting about ``min_seconds``,
   its median counts; the order rotates). Reports tokens/s (B / step time), the speed
   against jax.nn (jax.nn's time / the method's, median of per-round ratios), and cache
   bytes per token held: reserved bytes / tokens for the contiguous caches, bytes of
   the pages in use / tokens for the paged ones, and each format's storage bytes per
   token (int8 including its float32 scales).

2. **Quantization error.** One decode step over the same keys, values and query with
   float32 pages, int8 pages and float8_e4m3fn pages, against the float32 contiguous
   cache: max |error| and relative RMS error (‖o − o_ref‖ / ‖o_ref‖) of the output.

3. **Continuous batching** (experiments/_serving.py). ``requests`` requests of seeded
   random prompt and output lengths served by ``batch`` slots over one float32 paged
   cache: generated tokens/s, peak pages in use against the pool, page allocations that
   reused a released page, and the bytes a contiguous cache for the same slots would need.

4. **The ragged step.** One step of ``ragged.batch`` requests, ``prefilling`` of them
   bringing a prompt chunk of ``chunk`` tokens and the rest one decode token each, over
   float32 paged rows holding seeded random contexts: ``decode.attention`` on the
   requests right-padded to (B, chunk) with ``num_new``, against
   ``decode.ragged_attention`` on the same tokens packed. Tokens/s (the step's real
   tokens / its time), the speed against the padded step (median of per-round ratios),
   the query rows each computes, the cache bytes each reads (every query row gathers
   each tile some row has reached) beside each row read once, and how far their outputs
   differ.

    python -m experiments.bench_decode --config configs/bench_decode.yaml
    python -m experiments.bench_decode --batches 1 --contexts 1024 8192 --reps 3
    python -m experiments.bench_decode --quick          # tiny smoke test (the tests run it)

Prints tables and writes a JSON record under runs/ (``--out-dir``);
``python -m experiments.docs_tables --collect`` copies the newest into docs/bench/.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

from experiments import _cli, _config, _serving, _timing
from experiments._config import ConfigError, Section, field
from experiments._serving import ServeConfig, serve_table
from experiments._serving import requests as requests  # the request stream, for the tests
from experiments._timing import fmt
from jattn import decode

METHODS = ("jax.nn", "contiguous", "paged", "paged-int8")
QUANT_DTYPES = ("int8", "float8_e4m3fn")
DTYPES = {"float32": jnp.float32, "int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class QuantConfig(Section):
  """Part 2: one decode step's output error of quantized pages against float32."""

  SECTION: typing.ClassVar[str] = "quant."
  batch: int = field(4, minimum=1)
  contexts: list[int] = field(factory=lambda: [1024, 8192], minimum=1, doc="empty = skip")
  dtypes: list[str] = field(factory=lambda: list(QUANT_DTYPES), choices=QUANT_DTYPES)


@dataclasses.dataclass(frozen=True)
class RaggedConfig(Section):
  """Part 4: one continuous-batching step, ragged (packed) against padded (B, t)."""

  SECTION: typing.ClassVar[str] = "ragged."
  batch: int = field(64, minimum=1, doc="requests in the step, one per cache row")
  prefilling: int = field(4, minimum=0, doc="requests bringing a prompt chunk; the rest decode")
  chunk: int = field(128, minimum=1, doc="tokens of each prompt chunk")
  context: list[int] = field(
    factory=lambda: [128, 1024], minimum=1, doc="[low, high] tokens a row holds; empty = skip"
  )
  block_q: int = field(8, minimum=1, doc="tokens per query tile of the ragged step")
  seed: int = field(0, minimum=0)

  def check(self) -> None:
    if self.context and (len(self.context) != 2 or self.context[0] > self.context[1]):
      raise ConfigError(f"'ragged.context' must be [low, high], got {self.context}")
    if self.prefilling > self.batch:
      raise ConfigError(
        f"'ragged.prefilling' ({self.prefilling}) must be at most 'ragged.batch' ({self.batch})"
      )


@dataclasses.dataclass(frozen=True)
class Config(Section):
  """The decode-step grid (batches x contexts x methods), then parts 2 and 3."""

  heads: int = field(8, minimum=1)
  kv_heads: int = field(2, minimum=1)
  head_dim: int = field(128, minimum=1)
  batches: list[int] = field(factory=lambda: [1, 16], minimum=1)
  contexts: list[int] = field(factory=lambda: [1024, 8192, 32768], minimum=1, doc="empty = none")
  methods: list[str] = field(factory=lambda: list(METHODS), choices=METHODS)
  page_size: int = field(128, minimum=1, doc="slots per page; attention tiles are whole pages")
  headroom: int = field(256, minimum=1, doc="contiguous max_length = context + headroom")
  fill_chunk: int = field(2048, minimum=1, doc="tokens per decode.update when filling")
  reps: int = field(5, minimum=1, doc="interleaved rounds; each method's block median per round")
  min_seconds: float = field(0.1, above=0, doc="each block of calls lasts about this long")
  quant: QuantConfig = dataclasses.field(default_factory=QuantConfig)
  serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
  ragged: RaggedConfig = dataclasses.field(default_factory=RaggedConfig)
  out_dir: str = field("runs")

  def check(self) -> None:
    if self.heads % self.kv_heads:
      raise ConfigError(
        f"'heads' ({self.heads}) must be a multiple of 'kv_heads' ({self.kv_heads})"
      )


QUICK = dict(
  heads=4,
  kv_heads=2,
  head_dim=16,
  batches=[2],
  contexts=[40],
  page_size=16,
  headroom=16,
  fill_chunk=64,
  reps=2,
  min_seconds=0.01,
  quant={"batch": 2, "contexts": [40]},
  serve={
    "batch": 3,
    "requests": 8,
    "prompt": [5, 40],
    "output": [2, 12],
    "max_length": 64,
    "prefill_chunk": 16,
  },
  ragged={"batch": 5, "prefilling": 2, "chunk": 12, "context": [3, 30], "block_q": 4},
)


# --- caches and steps --------------------------------------------------------------------


def storage_bytes_per_token(cfg: Config, dtype: str) -> int:
  """Bytes one token takes in a cache of ``dtype``: K keys and values of H, plus a float32
  scale per key and value head when quantized."""
  size = np.dtype(DTYPES[dtype]).itemsize
  scales = 2 * cfg.kv_heads * 4 if dtype in QUANT_DTYPES else 0
  return 2 * cfg.kv_heads * cfg.head_dim * size + scales


def nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def new_tokens(seed, B: int, t: int, cfg: Config, *, query: bool = True):
  """Seeded Gaussian float32 query (B, t, N, H) (None unless ``query``), key and value
  (B, t, K, H) on the device. NumPy draws them: jax.random would add a compilation per
  shape, which the smoke test cannot afford."""
  rng = np.random.default_rng(seed)
  draw = lambda n: jnp.asarray(rng.standard_normal((B, t, n, cfg.head_dim), np.float32))
  q = draw(cfg.heads) if query else None
  return q, draw(cfg.kv_heads), draw(cfg.kv_heads)


def chunks(cfg: Config, B: int, context: int) -> list[tuple]:
  """The tokens every cache of a (B, context) cell is filled with: (key, value, n) chunks
  of ``fill_chunk`` slots (the last one holding n <= fill_chunk real tokens), seeded."""
  chunk = min(cfg.fill_chunk, context)
  out = []
  for i in range(math.ceil(context / chunk)):
    _, k, v = new_tokens((B, context, i), B, chunk, cfg, query=False)
    out.append((k, v, jnp.full((B,), min(chunk, context - i * chunk), jnp.int32)))
  return out


@functools.partial(jax.jit, donate_argnums=0)
def _write(cache, k, v, n):
  return decode.update(cache, k, v, num_new=n)


def fill(cache, tokens: list[tuple]):
  """The cache (donated) with ``tokens`` (from :func:`chunks`) written."""
  for k, v, n in tokens:
    cache = _write(cache, k, v, n)
  return cache


@functools.partial(jax.jit, donate_argnums=3)
def cache_step(q, k, v, cache):
  """One decode step; the lengths are rewound so the next call repeats the same work."""
  out, new = decode.attention(q, k, v, cache)
  return out, new._replace(lengths=cache.lengths)


@functools.partial(jax.jit, donate_argnums=(3, 4))
def jax_nn_step(q, k, v, keys, values, lengths):
  """The baseline: scatter the new token at ``lengths``, attend over the whole
  materialised cache up to ``lengths + 1``; lengths not advanced (as cache_step)."""
  rows = jnp.arange(q.shape[0])
  keys = keys.at[rows, lengths].set(k[:, 0])
  values = values.at[rows, lengths].set(v[:, 0])
  out = jax.nn.dot_product_attention(q, keys, values, key_value_seq_lengths=lengths + 1)
  return out, keys, values


class Stepper:
  """A zero-argument callable for _timing: one step, its donated state threaded through."""

  def __init__(self, step: Callable, inputs: tuple, state: tuple):
    self.step, self.inputs, self.state = step, inputs, state

  def __call__(self):
    out, *state = self.step(*self.inputs, *self.state)
    self.state = (*state, *self.state[len(state) :])
    return out


def make_cache(cfg: Config, method: str, B: int, context: int):
  """An empty cache for ``method`` holding B rows of context + headroom tokens."""
  S = context + cfg.headroom
  K, H = cfg.kv_heads, cfg.head_dim
  if method in ("jax.nn", "contiguous"):
    return decode.init(B, S, K, H)
  dtype = {"paged": "float32", "paged-int8": "int8", "paged-float8": "float8_e4m3fn"}[method]
  M = math.ceil(S / cfg.page_size)
  return decode.init_paged(B * M, cfg.page_size, B, M, K, H, dtype=DTYPES[dtype])


def stepper(cfg: Config, method: str, B: int, context: int, inputs: tuple, tokens) -> Stepper:
  cache = fill(make_cache(cfg, method, B, context), tokens)
  if method == "jax.nn":
    return Stepper(jax_nn_step, inputs, (cache.key, cache.value, cache.lengths))
  return Stepper(cache_step, inputs, (cache,))


def cache_row(cfg: Config, method: str, B: int, context: int, s: Stepper) -> dict:
  """Bytes the method's cache holds or reserves, per token held."""
  held = B * context
  if method == "jax.nn":
    reserved = nbytes(s.state[:2])
    return dict(cache_mb=reserved / 2**20, bytes_per_token=reserved / held, pages_in_use=None)
  cache = s.state[0]
  if isinstance(cache, decode.PagedKVCache):
    in_use = int(cache.num_pages - np.sum(np.asarray(cache.free)))
    page_bytes = nbytes((cache.key_pages, cache.value_pages, cache.key_scale, cache.value_scale))
    used = in_use * page_bytes / cache.num_pages
    return dict(cache_mb=used / 2**20, bytes_per_token=used / held, pages_in_use=in_use)
  reserved = nbytes((cache.key, cache.value))
  return dict(cache_mb=reserved / 2**20, bytes_per_token=reserved / held, pages_in_use=None)


def time_grid(cfg: Config) -> list[dict]:
  rows = []
  storage = {
    "jax.nn": "float32",
    "contiguous": "float32",
    "paged": "float32",
    "paged-int8": "int8",
  }
  for B in cfg.batches:
    for context in cfg.contexts:
      inputs, tokens = new_tokens((B, context), B, 1, cfg), chunks(cfg, B, context)
      steppers = {m: stepper(cfg, m, B, context, inputs, tokens) for m in cfg.methods}
      del tokens
      times = _timing.rounds_ms(
        {m: (s, ()) for m, s in steppers.items()}, cfg.reps, cfg.min_seconds
      )
      ref = times.get("jax.nn")
      for m, s in steppers.items():
        ms = float(np.median(times[m]))
        rows.append(
          dict(
            B=B,
            context=context,
            method=m,
            storage=storage[m],
            ms=ms,
            tokens_per_s=B / ms * 1e3,
            vs_jax_nn=None if ref is None else _timing.median_ratio(ref, times[m]),
            storage_bytes_per_token=storage_bytes_per_token(cfg, storage[m]),
            **cache_row(cfg, m, B, context, s),
          )
        )
      del steppers, times  # free this cell's caches before the next is filled
  return rows


# --- quantization error ------------------------------------------------------------------


def quant_errors(cfg: Config) -> list[dict]:
  rows = []
  B = cfg.quant.batch
  for context in cfg.quant.contexts:
    inputs, tokens = new_tokens((B, context), B, 1, cfg), chunks(cfg, B, context)
    outs = {}
    methods = ["contiguous", "paged"] + [
      {"int8": "paged-int8", "float8_e4m3fn": "paged-float8"}[d] for d in cfg.quant.dtypes
    ]
    for m in methods:
      cache = fill(make_cache(cfg, m, B, context), tokens)
      outs[m] = np.asarray(cache_step(*inputs, cache)[0], np.float64)
      del cache
    ref = outs.pop("contiguous")
    for m, out in outs.items():
      err = out - ref
      rows.append(
        dict(
          B=B,
          context=context,
          method=m,
          max_abs_error=float(np.max(np.abs(err))),
          rel_rms_error=float(np.sqrt(np.mean(err**2) / np.mean(ref**2))),
          ref_rms=float(np.sqrt(np.mean(ref**2))),
        )
      )
  return rows


# --- continuous batching -----------------------------------------------------------------


def serve(cfg: Config) -> dict | None:
  """Part 3 (experiments/_serving.py) with this config's shapes; None when there are no
  requests."""
  s = cfg.serve
  if s.requests == 0:
    return None
  tokens = new_tokens(s.seed, s.batch, s.prefill_chunk, cfg)
  per_token = storage_bytes_per_token(cfg, "float32")
  return _serving.serve(s, tokens, page_size=cfg.page_size, bytes_per_token=per_token)


# --- the ragged step ----------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnums=3)
def padded_step(q, k, v, cache, num_new):
  """decode.attention on the step's requests right-padded to (B, t); lengths rewound."""
  out, new = decode.attention(q, k, v, cache, num_new=num_new)
  return out, new._replace(lengths=cache.lengths)


@functools.partial(jax.jit, donate_argnums=3, static_argnames="block_q")
def ragged_step(q, k, v, cache, cu, *, block_q):
  """decode.ragged_attention on the step's tokens packed; lengths rewound."""
  out, new = decode.ragged_attention(q, k, v, cache, cu, block_q=block_q)
  return out, new._replace(lengths=cache.lengths)


def ragged(cfg: Config) -> dict | None:
  """Part 4: one step of ``batch`` requests, ``prefilling`` of them bringing a prompt chunk
  of ``chunk`` tokens and the rest one decode token each, over rows holding seeded random
  contexts, on float32 paged caches of the same contents: the padded (B, t) step against
  the ragged one. None when ``ragged.context`` is empty."""
  g = cfg.ragged
  if not g.context:
    return None
  rng = np.random.default_rng(g.seed)
  B, ps = g.batch, cfg.page_size
  held = rng.integers(g.context[0], g.context[1] + 1, B)
  n = np.ones(B, np.int32)
  n[rng.choice(B, g.prefilling, replace=False)] = g.chunk
  t, T = int(n.max()), int(n.sum())
  M = math.ceil((g.context[1] + g.chunk) / ps)
  q, k, v = new_tokens((g.seed, B, t), B, t, cfg)
  fill_tokens, size = [], min(cfg.fill_chunk, g.context[1])
  for i in range(math.ceil(g.context[1] / size)):
    _, fk, fv = new_tokens((g.seed, B, i), B, size, cfg, query=False)
    count = np.clip(held - i * size, 0, size).astype(np.int32)
    fill_tokens.append((fk, fv, jnp.asarray(count)))
  caches = [fill(decode.init_paged(B * M, ps, B, M, cfg.kv_heads, cfg.head_dim), fill_tokens)]
  caches.append(jax.tree.map(jnp.copy, caches[0]))
  rows = [np.arange(n[b]) for b in range(B)]
  packed = [
    jnp.asarray(np.concatenate([np.asarray(x)[b, r] for b, r in enumerate(rows)]))
    for x in (q, k, v)
  ]
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(n)]).astype(np.int32))
  steppers = {
    "padded": Stepper(padded_step, (q, k, v), (caches[0], jnp.asarray(n))),
    "ragged": Stepper(
      functools.partial(ragged_step, block_q=g.block_q), tuple(packed), (caches[1], cu)
    ),
  }
  outs = {m: np.asarray(s(), np.float64) for m, s in steppers.items()}
  padded_rows = np.concatenate([outs["padded"][b, r] for b, r in enumerate(rows)])
  agree = float(np.max(np.abs(padded_rows - outs["ragged"])))
  times = _timing.rounds_ms({m: (s, ()) for m, s in steppers.items()}, cfg.reps, cfg.min_seconds)
  # What each step reads of the cache: the blockwise reader visits a tile wherever some
  # query row has reached it and gathers it for every query row (B rows padded; the
  # ragged step's query tiles), against each row read once up to its length.
  per_token = storage_bytes_per_token(cfg, "float32")
  block_kv = min(ps * max(1, 512 // ps), M * ps)  # the paged default tile, capped at a row
  tiles = math.ceil(int((held + n).max()) / block_kv)
  query_rows = {"padded": B, "ragged": min(math.ceil(T / g.block_q) + B, T)}
  per_row = {"padded": t, "ragged": g.block_q}
  out = []
  for m in steppers:
    ms = float(np.median(times[m]))
    out.append(
      dict(
        method=m,
        ms=ms,
        tokens_per_s=T / ms * 1e3,
        vs_padded=_timing.median_ratio(times["padded"], times[m]),
        query_rows=query_rows[m] * per_row[m],
        cache_read_mb=query_rows[m] * tiles * block_kv * per_token / 2**20,
      )
    )
  return dict(
    batch=B,
    tokens=T,
    padded_to=t,
    held=[int(x) for x in held],
    needed_mb=float((held + n).sum() * per_token / 2**20),
    max_abs_diff=agree,
    rows=out,
  )


def ragged_table(r: dict) -> tuple[list[str], list[list[str]]]:
  """(header, rows) of the ragged step against the padded one."""
  header = ["step", "ms", "tokens/s", "× padded", "query rows computed", "cache MiB read"]
  rows = [
    [
      x["method"],
      f"{x['ms']:.2f}",
      f"{x['tokens_per_s']:,.0f}",
      fmt(x["vs_padded"], ".2f"),
      f"{x['query_rows']:,}",
      f"{x['cache_read_mb']:,.1f}",
    ]
    for x in r["rows"]
  ]
  return header, rows


# --- output ------------------------------------------------------------------------------


def shape_line(cfg: Config) -> str:
  return (
    f"N={cfg.heads} K={cfg.kv_heads} H={cfg.head_dim} float32 queries, page_size="
    f"{cfg.page_size}, max_length = context + {cfg.headroom}, {jax.devices()[0].platform}, "
    f"medians of {cfg.reps} interleaved rounds"
  )


def step_table(steps: list[dict]) -> tuple[list[str], list[list[str]]]:
  """(header, rows) of the decode-step cells, for the printed table and the docs alike."""
  header = ["B", "context", "method", "ms", "tokens/s", "× jax.nn", "cache MiB"]
  header += ["bytes/token held", "storage bytes/token"]
  rows = [
    [
      str(r["B"]),
      f"{r['context']:,}",
      r["method"],
      f"{r['ms']:.3f}",
      f"{r['tokens_per_s']:,.0f}",
      fmt(r["vs_jax_nn"], ".2f"),
      f"{r['cache_mb']:,.1f}",
      f"{r['bytes_per_token']:,.0f}",
      f"{r['storage_bytes_per_token']:,}",
    ]
    for r in steps
  ]
  return header, rows


def quant_table(quant: list[dict]) -> tuple[list[str], list[list[str]]]:
  """(header, rows) of the quantization errors."""
  header = ["B", "context", "cache", "max abs error", "relative RMS error", "output RMS"]
  rows = [
    [
      str(r["B"]),
      f"{r['context']:,}",
      r["method"],
      f"{r['max_abs_error']:.2e}",
      f"{r['rel_rms_error']:.2e}",
      f"{r['ref_rms']:.3g}",
    ]
    for r in quant
  ]
  return header, rows


def print_tables(cfg: Config, record: dict) -> None:
  console = Console(width=140)

  def show(title: str, table: tuple[list[str], list[list[str]]], first_left: bool = False):
    header, rows = table
    t = Table(title=title)
    for i, col in enumerate(header):
      t.add_column(col, justify="left" if first_left and i == 0 else "right")
    for row in rows:
      t.add_row(*row)
    console.print(t)

  if record["steps"]:
    show(f"Decode step: {shape_line(cfg)}", step_table(record["steps"]))
  if record["quant"]:
    show("One decode step against the float32 contiguous cache", quant_table(record["quant"]))
  if (s := record["serve"]) is not None:
    c = cfg.serve
    title = (
      f"Continuous batching: {s['requests']} requests (prompts {c.prompt[0]}–{c.prompt[1]}, "
      f"outputs {c.output[0]}–{c.output[1]} tokens) on {c.batch} slots of max_length "
      f"{c.max_length}, prefill chunks of {c.prefill_chunk}"
    )
    show(title, serve_table(s), first_left=True)
  if (r := record.get("ragged")) is not None:
    title = (
      f"One continuous-batching step: {r['batch']} requests, {cfg.ragged.prefilling} with a "
      f"prompt chunk of {cfg.ragged.chunk}, {r['tokens']} tokens (padded to {r['padded_to']}), "
      f"rows holding {cfg.ragged.context[0]}–{cfg.ragged.context[1]}; each row read once: "
      f"{r['needed_mb']:,.1f} MiB; outputs agree to {r['max_abs_diff']:.1e}"
    )
    show(title, ragged_table(r), first_left=True)


def load_config(args) -> Config:
  """configs/…yaml (``--config``), the ``--quick`` settings, the flags given, then ``--set``."""
  return _cli.load_config(
    Config,
    args,
    QUICK,
    **{
      "quant.contexts": args.quant_contexts,
      "serve.requests": args.requests,
      "ragged.context": args.ragged_context,
    },
  )


def parse_args(argv=None) -> argparse.Namespace:
  parser = _cli.parser("bench_decode", __doc__, quick="tiny shapes, 2 reps (smoke test)")
  parser.add_argument("--batches", type=int, nargs="+")
  parser.add_argument("--contexts", type=int, nargs="*", help="none: skip the decode-step grid")
  parser.add_argument("--methods", nargs="+")
  parser.add_argument("--reps", type=int)
  parser.add_argument("--page-size", dest="page_size", type=int)
  parser.add_argument(
    "--quant-contexts", dest="quant_contexts", type=int, nargs="*", help="none: skip part 2"
  )
  parser.add_argument("--requests", type=int, help="0: skip the continuous-batching run")
  parser.add_argument(
    "--ragged-context", dest="ragged_context", type=int, nargs="*", help="none: skip part 4"
  )
  parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="e.g. serve.batch=8")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  cfg = _cli.config_or_exit("bench_decode", load_config, args)
  start = time.perf_counter()
  record = dict(
    **_cli.facts("bench_decode", argv),
    config=_config.to_dict(cfg),
    steps=time_grid(cfg),
    quant=quant_errors(cfg),
    serve=serve(cfg),
    ragged=ragged(cfg),
  )
  record["seconds"] = time.perf_counter() - start
  print_tables(cfg, record)
  path = _cli.record_path(cfg.out_dir, "bench_decode", args.quick)
  _cli.write_record(path, record, f" ({record['seconds']:.0f} s)")
  return record


if __name__ == "__main__":
  main()
