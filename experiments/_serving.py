"""Continuous batching over one paged cache: part 3 of experiments/bench_decode.py.

``requests`` requests of seeded random prompt and output lengths served by ``batch``
slots over one float32 paged cache whose pool holds ``pool_fraction`` of batch ×
max_length. Each iteration admits waiting requests
(first come, first served) into free slots while the pool has pages for a request's
whole prompt + output, writes one prompt chunk of up to ``prefill_chunk`` tokens for
every row still prefilling (``decode.attention`` with ``num_new``), decodes one token
for every generating row, and releases finished rows (``decode.release``). Each of
the three jitted functions has fixed shapes and is traced once (``num_new`` = 0
masks the rows it does not serve). Reports generated tokens/s, peak pages in use
against the pool, how many page allocations reused a page a finished request had
released, and the bytes a contiguous cache for the same slots would need.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np

from experiments._config import ConfigError, Section, field
from jattn import decode


@dataclasses.dataclass(frozen=True)
class ServeConfig(Section):
  """Part 3: a seeded stream of requests served by a fixed batch of slots."""

  SECTION: typing.ClassVar[str] = "serve."
  batch: int = field(16, minimum=1, doc="slots; 0 requests = skip")
  requests: int = field(64, minimum=0)
  prompt: list[int] = field(factory=lambda: [128, 2048], minimum=1, doc="[min, max] tokens")
  output: list[int] = field(factory=lambda: [32, 512], minimum=1, doc="[min, max] tokens")
  max_length: int = field(4096, minimum=1, doc="tokens a row may hold: the page table's size")
  pool_fraction: float = field(0.5, above=0, maximum=1, doc="pool pages / (batch x max pages)")
  prefill_chunk: int = field(256, minimum=1)
  seed: int = field(0, minimum=0)

  def check(self) -> None:
    for key in ("prompt", "output"):
      pair = getattr(self, key)
      if len(pair) != 2 or pair[0] > pair[1]:
        raise ConfigError(f"'serve.{key}' must be [min, max] with min <= max, got {pair}")
    if self.prompt[1] + self.output[1] > self.max_length:
      raise ConfigError(
        f"'serve.max_length' ({self.max_length}) must hold the longest request: "
        f"prompt {self.prompt[1]} + output {self.output[1]}"
      )


TRACES: collections.Counter = collections.Counter()


@functools.partial(jax.jit, donate_argnums=3)
def serve_step(q, k, v, cache, num_new, release):
  """Rows write num_new[b] of the t tokens and attend; then the rows where ``release`` is
  True are released. Returns (out, the page table before the release, the cache)."""
  TRACES[f"t={q.shape[1]}"] += 1  # runs once per trace: the loop must not retrace
  out, cache = decode.attention(q, k, v, cache, num_new=num_new)
  return out, cache.page_table, decode.release(cache, release)


@dataclasses.dataclass
class Slot:
  request: int
  prompt_left: int
  output_left: int
  pages: int


def requests(s: ServeConfig) -> tuple[np.ndarray, np.ndarray]:
  """Seeded prompt and output lengths of the stream, uniform in their [min, max]."""
  rng = np.random.default_rng(s.seed)
  prompts = rng.integers(s.prompt[0], s.prompt[1] + 1, s.requests)
  outputs = rng.integers(s.output[0], s.output[1] + 1, s.requests)
  return prompts, outputs


def serve(s: ServeConfig, prefill_tokens: tuple, *, page_size: int, bytes_per_token: int) -> dict:
  """The continuous-batching run of ``s``'s requests. ``prefill_tokens``: query (B, t, N, H),
  key and value (B, t, K, H) for B = ``s.batch`` slots and t = ``s.prefill_chunk``; there is
  no model, so every call reads these same tokens (what attention costs does not depend on
  them): prefill calls all t a row, decode calls the first. ``bytes_per_token``: one token's
  storage in the float32 pages, for the pool's and a contiguous cache's MiB."""
  prompts, outputs = requests(s)
  ps, B = page_size, s.batch
  K, H = prefill_tokens[1].shape[2:]
  M = math.ceil(s.max_length / ps)
  need = [math.ceil((p + o) / ps) for p, o in zip(prompts, outputs)]
  P = max(max(need), round(s.pool_fraction * B * M))
  empty = lambda: decode.init_paged(P, ps, B, M, K, H)
  decode_tokens = tuple(x[:, :1] for x in prefill_tokens)
  nobody = jnp.zeros((B,), bool)

  def call(tokens, num_new, release, cache):
    out, table, cache = serve_step(*tokens, cache, jnp.asarray(num_new, jnp.int32), release)
    jax.block_until_ready(out)  # a server samples the next tokens from it
    return np.asarray(table), cache

  # Compile both calls on a throwaway cache of the same shapes (not timed).
  scratch = call(prefill_tokens, np.ones(B), nobody, empty())[1]
  del scratch
  call(decode_tokens, np.ones(B), nobody, empty())

  cache = empty()
  jax.block_until_ready(cache)
  queue = collections.deque(range(s.requests))
  slots: list[Slot | None] = [None] * B
  reserved = generated = prefill_calls = decode_calls = iterations = 0
  peak = allocations = reused = 0
  ever_held: set[int] = set()
  table = np.full((B, M), -1)
  start = time.perf_counter()
  while queue or any(slots):
    iterations += 1
    # Admit first come, first served while the pool has pages for a whole request.
    for b in range(B):
      if slots[b] is None and queue and need[queue[0]] <= P - reserved:
        r = queue.popleft()
        slots[b] = Slot(r, int(prompts[r]), int(outputs[r]), need[r])
        reserved += need[r]
    writes = []  # (page table after the call's writes, rows it released)
    chunk = [min(x.prompt_left, s.prefill_chunk) if x else 0 for x in slots]
    if any(chunk):
      after, cache = call(prefill_tokens, chunk, nobody, cache)
      writes.append((after, np.zeros(B, bool)))
      prefill_calls += 1
      for x, n in zip(slots, chunk):
        if x:
          x.prompt_left -= n
    step = [int(x is not None and x.prompt_left == 0 and x.output_left > 0) for x in slots]
    if any(step):
      done = np.array(
        [n == 1 and x is not None and x.output_left == 1 for x, n in zip(slots, step)]
      )
      after, cache = call(decode_tokens, step, jnp.asarray(done), cache)
      writes.append((after, done))
      decode_calls += 1
      generated += sum(step)
      for b, n in enumerate(step):
        if n:
          slots[b].output_left -= 1  # type: ignore[union-attr]
          if done[b]:
            reserved -= slots[b].pages  # type: ignore[union-attr]
            slots[b] = None
    for after, released in writes:
      fresh = after[(table < 0) & (after >= 0)]
      allocations += fresh.size
      reused += sum(int(p) in ever_held for p in fresh)
      ever_held.update(int(p) for p in fresh)
      peak = max(peak, int(np.sum(after >= 0)))
      table = np.where(released[:, None], -1, after)
  seconds = time.perf_counter() - start
  per_token = bytes_per_token
  return dict(
    requests=s.requests,
    prompt_tokens=int(prompts.sum()),
    generated_tokens=generated,
    seconds=seconds,
    generated_per_s=generated / seconds,
    tokens_per_s=(int(prompts.sum()) + generated) / seconds,
    iterations=iterations,
    prefill_calls=prefill_calls,
    decode_calls=decode_calls,
    pool_pages=P,
    peak_pages=peak,
    page_allocations=allocations,
    pages_reused=reused,
    distinct_pages=len(ever_held),
    free_pages_at_end=int(np.sum(np.asarray(cache.free))),
    lengths_at_end=np.asarray(cache.lengths).tolist(),
    pool_mb=P * ps * per_token / 2**20,
    peak_mb=peak * ps * per_token / 2**20,
    contiguous_mb=B * s.max_length * per_token / 2**20,
    traces=dict(TRACES),
  )


def serve_table(s: dict) -> tuple[list[str], list[list[str]]]:
  """(header, rows) of the continuous-batching run."""
  rows = [
    ["generated tokens (prompt tokens)", f"{s['generated_tokens']:,} ({s['prompt_tokens']:,})"],
    ["seconds", f"{s['seconds']:.1f}"],
    ["generated tokens/s", f"{s['generated_per_s']:,.0f}"],
    ["all tokens/s (prompt + generated)", f"{s['tokens_per_s']:,.0f}"],
    [
      "iterations (prefill / decode calls)",
      f"{s['iterations']} ({s['prefill_calls']} / {s['decode_calls']})",
    ],
    ["peak pages in use / pool", f"{s['peak_pages']} / {s['pool_pages']}"],
    [
      "page allocations (of a page a finished request released)",
      f"{s['page_allocations']:,} ({s['pages_reused']:,})",
    ],
    ["pool MiB (peak in use)", f"{s['pool_mb']:,.1f} ({s['peak_mb']:,.1f})"],
    ["contiguous cache MiB (slots × max_length)", f"{s['contiguous_mb']:,.1f}"],
  ]
  return ["quantity", "value"], rows
