"""Ring attention against the number of devices: memory per device, step time, causal balance.

At one total length T (= S), float32 inputs (B, T, N, H) with K = N heads, for
each device count P of ``devices`` the script builds a one-axis mesh of the
first P devices, shards the sequence over it and compiles one training step
ahead of time: ``jax.value_and_grad`` of sum(ring_attention(q, k, v)²) with
respect to q, k and v (``jattn.parallel.ring_attention``, contiguous layout,
causal per the config). It records

- the bytes per device XLA allocates for the step, arguments + outputs +
  temporaries − aliased bytes, from the compiled program's memory analysis
  (XLA reports these per device for an SPMD program), and the temporaries
  alone: ring attention should hold O(B·T·N·H / P) per device, so
  per-device bytes × P / bytes at P = 1 stays near 1.0;
- the median wall time of the step over ``reps`` calls after one warm-up.

In the same run it measures the same training step of
``jax.nn.dot_product_attention`` on one device with the same (unsharded)
inputs, and prints every row's memory and time as a ratio against it.

At the timed length a few tile-sized temporaries (B·N·block_q·block_kv floats
each, whatever P) are a large part of each device's memory, so a second table
compiles the same step at ``memory_length`` (64k: nothing runs, so lengths far
past what this machine could execute are fine) and reports per-device bytes
for jax.nn and jattn blockwise on one device and for the ring at every P, with
each P's bytes relative to P/2's (0.5 = halving with twice the devices).

Simulated CPU devices (``--xla_force_host_platform_device_count``) share the
machine's cores, so step time does not fall with P here: it shows the ring's
overhead, not its speed-up. Memory per device is the quantity that scales.

Causal load balance, computed from the masks alone (experiments/_ring_balance.py): for
every layout at the largest P, max/mean across devices of the tiles the blockwise kernel
visits and of the exact (query, key) pairs (1.0 = even), next to the measured step time
of each layout at the largest P (inputs permuted outside the timed step) relative to
contiguous.

    python -m experiments.bench_parallel --config configs/bench_parallel.yaml
    python -m experiments.bench_parallel --length 2048 --devices 1 2 4 8 --layouts zigzag
    python -m experiments.bench_parallel --quick     # tiny smoke test (CI)

Writes ``runs/parallel-<time>/parallel.json``. Memory is in MiB (2**20 bytes), in
the tables and in the JSON's ``mb`` and ``temp_mb`` alike.
"""

from __future__ import annotations

import os

# XLA reads the flag when JAX starts its CPU backend, so it is set before JAX is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import jattn  # noqa: E402
from experiments import _cli, _collectives, _config, _timing  # noqa: E402
from experiments._config import ConfigError, Section, field  # noqa: E402
from experiments._ring_balance import balance  # noqa: E402
from experiments._ring_balance import work_per_device as work_per_device  # noqa: E402
from experiments._timing import fmt  # noqa: E402
from jattn import parallel  # noqa: E402
from jattn.impl import blockwise as _blockwise  # noqa: E402  internal: default tile sizes

AXIS = "sp"
# The strategies' masks, at total length T: causal; packed documents (four of T/4, causal
# within each, as segment ids); a causal sliding window of T/8 keys.
STRATEGY_MASKS = ("causal", "documents", "window")


@dataclasses.dataclass(frozen=True)
class Config(Section):
  """The ring's device counts and layouts at one length, and the compile-only memory table."""

  batch: int = field(1, minimum=1)
  heads: int = field(8, minimum=1)
  head_dim: int = field(64, minimum=1)
  length: int = field(8192, minimum=1, doc="total sequence length T, split over the devices")
  devices: list[int] = field(factory=lambda: [1, 2, 4, 8], minimum=1, doc="P, increasing")
  causal: bool = field(True)
  layouts: list[str] = field(
    factory=lambda: list(parallel.LAYOUTS), choices=parallel.LAYOUTS, doc="timed at the largest P"
  )
  reps: int = field(3, minimum=1, doc="median of this many calls after one warm-up call")
  block_q: int | None = field(None, minimum=1, doc="null: the backend's blockwise default")
  block_kv: int | None = field(None, minimum=1)
  memory_length: int | None = field(
    65536, minimum=1, doc="the compile-only memory table at this T (null: skip it)"
  )
  strategies: list[str] = field(
    factory=lambda: list(parallel.STRATEGIES),
    choices=parallel.STRATEGIES,
    doc="context_parallel_attention's strategies, compared at the largest P",
  )
  strategy_masks: list[str] = field(
    factory=lambda: list(STRATEGY_MASKS), choices=STRATEGY_MASKS, doc="the masks they run"
  )
  usp_ulysses: int = field(
    2, minimum=1, doc="USP: devices of its Ulysses axis (the rest of the largest P rings)"
  )
  out_dir: str = field("runs")

  def check(self) -> None:
    if "ulysses" in self.strategies and self.heads % max(self.devices or [1]):
      raise ConfigError(
        f"'heads' ({self.heads}) must divide by the largest P ({max(self.devices)}) for the "
        "ulysses strategy, which splits the heads over the devices"
      )
    P = max(self.devices or [1])
    if "usp" in self.strategies and (P % self.usp_ulysses or self.heads % self.usp_ulysses):
      raise ConfigError(
        f"'usp_ulysses' ({self.usp_ulysses}) must divide the largest P ({P}) and 'heads' "
        f"({self.heads}) for the usp strategy"
      )
    if not self.devices or any(a >= b for a, b in zip(self.devices, self.devices[1:])):
      raise ConfigError(f"'devices' must be a non-empty increasing list, got {self.devices}")
    for P in self.devices:
      if self.memory_length and self.memory_length % P:
        raise ConfigError(f"'memory_length' ({self.memory_length}) must split into {P} parts")
      parts = 2 * P if "zigzag" in self.layouts else P
      if self.length % parts:
        raise ConfigError(
          f"'length' ({self.length}) must split into {parts} equal parts for P={P}"
          + (" (zigzag: two chunks per device)" if parts != P else "")
        )


QUICK = dict(
  heads=4,  # Ulysses splits the heads over the largest P
  head_dim=8,
  length=64,
  devices=[1, 2, 4],
  reps=1,
  block_q=8,
  block_kv=8,
  memory_length=64,  # the timed length: the memory table gets the timed programs from the cache
  strategy_masks=["documents"],
)


# --- training steps -------------------------------------------------------------------


def inputs(cfg: Config) -> tuple[np.ndarray, ...]:
  """q, k, v (B, T, N, H) float32 on the host, natural order."""
  rng = np.random.default_rng(0)
  shape = (cfg.batch, cfg.length, cfg.heads, cfg.head_dim)
  return tuple(rng.standard_normal(shape, np.float32) for _ in range(3))


def ring_step(cfg: Config, mesh: Mesh, layout: str):
  """jit(value_and_grad) of sum(ring_attention(q, k, v)²) in q, k and v."""
  return _step("ring", cfg.causal, cfg.block_q, cfg.block_kv, mesh, layout)


def reference_step(cfg: Config):
  """The same training step with jax.nn.dot_product_attention (materialised scores)."""
  return _step("jax.nn", cfg.causal)


def blockwise_step(cfg: Config):
  """The same training step with single-device jattn blockwise attention."""
  return _step("blockwise", cfg.causal, cfg.block_q, cfg.block_kv)


@functools.cache
def _step(
  method: str,
  causal: bool,
  block_q: int | None = None,
  block_kv: int | None = None,
  mesh: Mesh | None = None,
  layout: str = "contiguous",
):
  """The jitted step, built once per settings: a table that compiles a step for shapes and
  shardings another table already compiled it for gets XLA's program from JAX's cache."""

  def attend(q, k, v):
    match method:
      case "jax.nn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
      case "blockwise":
        return jattn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="blockwise", block_q=block_q, block_kv=block_kv
        )
      case "ring":
        return parallel.ring_attention(
          q,
          k,
          v,
          mesh=mesh,
          axis_name=AXIS,
          is_causal=causal,
          layout=layout,
          block_q=block_q,
          block_kv=block_kv,
        )
      case _:
        raise ValueError(f"unknown method {method!r}")

  loss = lambda q, k, v: jnp.sum(jnp.square(attend(q, k, v)))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def device_bytes(compiled) -> dict | None:
  """Per-device bytes of one call: arguments + outputs + temporaries − aliases, and the
  temporaries alone (None if the backend won't say)."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  alias = int(getattr(m, "alias_size_in_bytes", 0) or 0)
  total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - alias
  return dict(total=int(total), temp=int(m.temp_size_in_bytes))


def measure(step, args, reps: int) -> dict:
  """Compile ``step`` ahead of time for ``args``; its per-device memory and median time."""
  compiled = step.lower(*args).compile()
  nbytes = device_bytes(compiled)
  ms = _timing.block_ms(compiled, args, reps)
  return dict(
    mb=None if nbytes is None else nbytes["total"] / 2**20,
    temp_mb=None if nbytes is None else nbytes["temp"] / 2**20,
    ms=ms,
  )


def shard(host: tuple[np.ndarray, ...], mesh: Mesh) -> list[jax.Array]:
  """The sequence split over every axis of ``mesh`` (USP's two: ring major)."""
  spec = NamedSharding(mesh, PartitionSpec(None, mesh.axis_names, None, None))
  return [jax.device_put(x, spec) for x in host]


def mesh_of(P: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:P]), (AXIS,))


ULYSSES = "uly"  # USP's Ulysses axis


def strategy_mesh(cfg: Config, P: int, strategy: str) -> tuple[Mesh, int]:
  """The mesh of ``strategy`` at ``P`` devices and the ring's size (the layout's P): USP's
  two axes (P / usp_ulysses ring steps over groups of usp_ulysses devices), one otherwise."""
  if strategy != "usp":
    return mesh_of(P), P
  u = cfg.usp_ulysses
  grid = np.array(jax.devices()[:P]).reshape(P // u, u)
  return Mesh(grid, (AXIS, ULYSSES)), P // u


def measure_devices(cfg: Config, host, on_row=lambda row: None) -> list[dict]:
  """One row per device count: the contiguous ring's per-device memory and step time."""
  rows = []
  for P in cfg.devices:
    mesh = mesh_of(P)
    row = dict(
      P=P,
      layout="contiguous",
      **measure(ring_step(cfg, mesh, "contiguous"), shard(host, mesh), cfg.reps),
    )
    rows.append(row)
    on_row(row)
  base = rows[0]["mb"] if rows and rows[0]["P"] == 1 else None
  for r in rows:
    r["mb_x_P_vs_P1"] = None if base is None or r["mb"] is None else r["mb"] * r["P"] / base
  return rows


def measure_layouts(
  cfg: Config, host, P: int, contiguous: dict, on_row=lambda row: None
) -> list[dict]:
  """Step time of each layout at ``P`` devices (inputs permuted outside the timed step); the
  contiguous row is the one already measured for the memory table."""
  rows = []
  mesh = mesh_of(P)
  for layout in cfg.layouts:
    if layout == "contiguous":
      row = dict(
        P=P, layout=layout, mb=contiguous["mb"], temp_mb=contiguous["temp_mb"], ms=contiguous["ms"]
      )
    else:
      permuted = tuple(parallel.permute(x, layout, P) for x in host)
      row = dict(
        P=P, layout=layout, **measure(ring_step(cfg, mesh, layout), shard(permuted, mesh), cfg.reps)
      )
      on_row(row)
    row["time_vs_contiguous"] = row["ms"] / contiguous["ms"]
    rows.append(row)
  return rows


def _strategy_step(cfg: Config, mesh: Mesh, strategy: str, mask: str, layout: str):
  """jit(value_and_grad) of sum(context_parallel_attention(q, k, v)²) in q, k and v."""
  T, P = cfg.length, mesh.shape[AXIS]  # the layout's P: the ring's size under USP
  axis_name = (AXIS, ULYSSES) if strategy == "usp" else AXIS
  kw: dict = dict(is_causal=True)
  if mask == "documents":
    ids = np.repeat(np.arange(4, dtype=np.int32), T // 4)[None].repeat(cfg.batch, 0)
    kw["segment_ids"] = parallel.permute(ids, layout, P)
  elif mask == "window":
    kw["local_window_size"] = (T // 8, 0)
  tiles = {} if strategy == "ulysses" else dict(block_q=cfg.block_q, block_kv=cfg.block_kv)

  def loss(q, k, v):
    out = parallel.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name=axis_name, strategy=strategy, layout=layout, **tiles, **kw
    )
    return jnp.sum(out**2)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def measure_strategies(cfg: Config, host, P: int, on_row=lambda row: None) -> list[dict]:
  """Each strategy and mask at ``P`` devices: what a training step sends per device, by
  collective, and how much of it can overlap a whole loop step of compute (read from the
  compiled program, :mod:`experiments._collectives`), its
  per-device memory and its time. Ring, USP and all-gather take the zig-zag layout
  (balanced causal work; USP's over its ring), Ulysses the contiguous one (whole sequences
  on every device)."""
  rows = []
  for mask in cfg.strategy_masks:
    for strategy in cfg.strategies:
      mesh, ring = strategy_mesh(cfg, P, strategy)
      layout = "contiguous" if strategy == "ulysses" else "zigzag"
      args = shard(tuple(parallel.permute(x, layout, ring) for x in host), mesh)
      step = _strategy_step(cfg, mesh, strategy, mask, layout)
      compiled = step.lower(*args).compile()
      text = compiled.as_text()
      sent, free = _collectives.traffic(text), _collectives.overlappable(text)
      nbytes = device_bytes(compiled)
      row = dict(
        P=P,
        strategy=strategy,
        mesh=dict(mesh.shape) if strategy == "usp" else None,
        mask=mask,
        layout=layout,
        sent_mb={k: v / 2**20 for k, v in sorted(sent.items())},
        sent_total_mb=sum(sent.values()) / 2**20,
        overlap_mb=sum(free.values()) / 2**20,
        mb=None if nbytes is None else nbytes["total"] / 2**20,
        ms=_timing.block_ms(compiled, args, cfg.reps),
      )
      rows.append(row)
      on_row(row)
  return rows


def print_strategies_table(cfg: Config, rows) -> None:
  P = rows[0]["P"] if rows else max(cfg.devices)
  shard_mb = cfg.batch * cfg.length // P * cfg.heads * cfg.head_dim * 4 / 2**20
  print(
    f"\ncontext_parallel_attention's strategies at P={P}, T={cfg.length}, training step; MiB "
    f"each device sends per step by collective (one K or V shard is {shard_mb:.2f} MiB):\n"
  )
  print(
    "| mask | strategy | layout | MiB sent per device | by collective | of which can overlap "
    "a step | MiB per device | ms |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["sent_mb"].items() if v >= 0.005) or "none"
    name = r["strategy"] + (" " + "×".join(map(str, r["mesh"].values())) if r["mesh"] else "")
    print(
      f"| {r['mask']} | {name} | {r['layout']} | {r['sent_total_mb']:.2f} | {kinds} "
      f"| {r['overlap_mb']:.2f} | {_mb(r['mb'])} | {r['ms']:.1f} |"
    )


def memory_at_length(cfg: Config, T: int) -> list[dict]:
  """Per-device bytes of the training step at length ``T``, from compilation alone (nothing
  runs, so T can be far past what this machine could execute): the ring at every P, and on
  one device jattn blockwise and jax.nn with the same inputs."""

  def compiled_mb(step, mesh, spec):
    sharding = NamedSharding(mesh, spec)
    arg = jax.ShapeDtypeStruct(
      (cfg.batch, T, cfg.heads, cfg.head_dim), np.float32, sharding=sharding
    )
    nbytes = device_bytes(step.lower(arg, arg, arg).compile())
    return (None, None) if nbytes is None else (nbytes["total"] / 2**20, nbytes["temp"] / 2**20)

  rows = []
  one = mesh_of(1)
  for name, step in (("jax.nn", reference_step(cfg)), ("blockwise", blockwise_step(cfg))):
    mb, temp = compiled_mb(step, one, PartitionSpec())
    rows.append(dict(method=name, P=1, mb=mb, temp_mb=temp))
  for P in cfg.devices:
    mb, temp = compiled_mb(
      ring_step(cfg, mesh_of(P), "contiguous"), mesh_of(P), PartitionSpec(None, AXIS, None, None)
    )
    rows.append(dict(method="ring", P=P, mb=mb, temp_mb=temp))
  ring = {r["P"]: r for r in rows if r["method"] == "ring"}
  for r in ring.values():
    half = ring.get(r["P"] // 2)
    r["vs_half_P"] = (
      None
      if r["P"] == 1 or half is None or not half["mb"] or r["mb"] is None
      else r["mb"] / half["mb"]
    )
  return rows


# --- output ---------------------------------------------------------------------------


def _mb(x):
  """MiB (2**20 bytes) to four significant digits: readable for the quick run's kilobytes too."""
  return fmt(x, ".4g")


def _ratio(a, b):
  return None if a is None or not b else a / b


def print_memory_table(cfg: Config, rows) -> None:
  print(
    f"\nMemory per device at T={cfg.memory_length} from compilation alone (nothing runs), "
    "same step and shapes otherwise:\n"
  )
  print("| method | P | MiB per device | temp MiB | × MiB at P/2 |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['method']} | {r['P']} | {_mb(r['mb'])} | {_mb(r['temp_mb'])} "
      f"| {fmt(r.get('vs_half_P'), '.3f')} |"
    )


def print_tables(cfg: Config, blocks, ref: dict, rows, layouts, work) -> None:
  kind = "causal" if cfg.causal else "non-causal"
  print(
    f"\nB={cfg.batch} N=K={cfg.heads} H={cfg.head_dim} T={cfg.length} float32 {kind} "
    f"training step (value_and_grad in q, k, v), {jax.devices()[0].platform}, tiles "
    f"{blocks[0]}x{blocks[1]}; reference: jax.nn.dot_product_attention on one device: "
    f"{_mb(ref['mb'])} MiB, {ref['ms']:.1f} ms"
  )
  print(
    f"\nThe {max(cfg.devices)} simulated devices share this machine's {os.cpu_count()} "
    "CPU cores: step time does not fall with P here; memory per device is what scales.\n"
  )
  print(
    "| P | MiB per device | × P / MiB at P=1 | temp MiB | step ms | × jax.nn MiB | × jax.nn ms |"
  )
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['P']} | {_mb(r['mb'])} | {fmt(r['mb_x_P_vs_P1'], '.3f')} "
      f"| {_mb(r['temp_mb'])} | {r['ms']:.1f} | {fmt(_ratio(r['mb'], ref['mb']), '.3f')} "
      f"| {_ratio(r['ms'], ref['ms']):.3f} |"
    )
  P = max(cfg.devices)
  print(
    f"\ncausal work per device at P={P} (max/mean across devices, 1.0 = even; "
    f"contiguous: pairs → (2P-1)/P = {(2 * P - 1) / P:.3f} for T/P ≫ 1, whole shards "
    f"2P/(P+1) = {2 * P / (P + 1):.3f}) and step time per layout:\n"
  )
  print(
    "| layout | tiles max/mean | pairs max/mean | total tiles | MiB per device | step ms "
    "| × contiguous ms | × jax.nn ms |"
  )
  print("|---|---|---|---|---|---|---|---|")
  times = {r["layout"]: r for r in layouts}
  for w in work:
    t = times[w["layout"]]
    print(
      f"| {w['layout']} | {w['tiles_max_over_mean']:.3f} | {w['pairs_max_over_mean']:.3f} "
      f"| {w['total_tiles']:.0f} | {_mb(t['mb'])} | {t['ms']:.1f} "
      f"| {t['time_vs_contiguous']:.3f} | {_ratio(t['ms'], ref['ms']):.3f} |"
    )


def load_config(args) -> Config:
  """configs/…yaml (``--config``), the ``--quick`` settings, then the flags given."""
  return _cli.load_config(Config, args, QUICK)


def parse_args(argv=None) -> argparse.Namespace:
  parser = _cli.parser(
    "bench_parallel", __doc__, out_dir="parent of the run folder (default runs/)"
  )
  parser.add_argument("--length", type=int, help="total sequence length T")
  parser.add_argument("--devices", type=int, nargs="+", help="device counts P, increasing")
  parser.add_argument("--layouts", nargs="+", help=f"from {list(parallel.LAYOUTS)}")
  parser.add_argument("--reps", type=int)
  return parser.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  cfg = _cli.config_or_exit("bench_parallel", load_config, args)
  if len(jax.devices()) < max(cfg.devices):
    raise RuntimeError(
      f"devices={cfg.devices} needs {max(cfg.devices)} devices but JAX sees "
      f"{len(jax.devices())}; set XLA_FLAGS=--xla_force_host_platform_device_count="
      f"{max(cfg.devices)} before JAX is imported (this script sets 8 unless XLA_FLAGS "
      "already names the flag)"
    )
  path = _cli.record_path(cfg.out_dir, "parallel", args.quick, "parallel.json")
  defaults = _blockwise.default_blocks(jax.default_backend())
  blocks = (cfg.block_q or defaults[0], cfg.block_kv or defaults[1])
  host = inputs(cfg)

  def show(r):
    print(
      f"P={r['P']} {r['layout']:>10}: {r['ms']:10.1f} ms {_mb(r['mb']):>10} MiB per device",
      flush=True,
    )

  one = NamedSharding(mesh_of(1), PartitionSpec())  # as the memory table places them
  ref = measure(reference_step(cfg), [jax.device_put(x, one) for x in host], cfg.reps)
  print(f"jax.nn on one device: {ref['ms']:10.1f} ms {_mb(ref['mb']):>10} MiB", flush=True)
  rows = measure_devices(cfg, host, on_row=show)
  P = max(cfg.devices)
  layouts = measure_layouts(cfg, host, P, rows[-1], on_row=show)
  work = balance(cfg.layouts, cfg.length, P, blocks, causal=cfg.causal)
  print_tables(cfg, blocks, ref, rows, layouts, work)
  strategies = measure_strategies(
    cfg,
    host,
    P,
    on_row=lambda r: print(
      f"P={P} {r['strategy']:>10} {r['mask']:>9}: {r['ms']:10.1f} ms "
      f"{r['sent_total_mb']:8.2f} MiB sent per device",
      flush=True,
    ),
  )
  print_strategies_table(cfg, strategies)
  memory = []
  if cfg.memory_length:
    memory = memory_at_length(cfg, cfg.memory_length)
    print_memory_table(cfg, memory)
  record = dict(
    **_cli.facts("bench_parallel", argv),
    config=_config.to_dict(cfg),
    blocks=list(blocks),
    num_devices=len(jax.devices()),
    cpu_count=os.cpu_count(),
    reference=ref,
    rows=rows,
    layouts=layouts,
    balance=work,
    strategies=strategies,
    memory=memory,
  )
  _cli.write_record(path, record)
  record["path"] = str(path)
  return record


if __name__ == "__main__":
  main()
