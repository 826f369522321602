"""What a compiled SPMD program moves between devices, read from its HLO text.

For every collective in the per-device program (all-gather, all-to-all, reduce-scatter,
all-reduce, collective-permute), the bytes each device puts on the wire, by the
bandwidth-optimal algorithms' counts on a group of G devices: an all-gather or all-to-all
of a result of R bytes sends (G - 1)/G · R, a reduce-scatter (G - 1) · R (its operand is
G results), an all-reduce 2 (G - 1)/G · R, a collective-permute its whole operand (R).
A collective inside a while loop counts once per iteration (XLA's ``known_trip_count``).

:func:`overlappable` reads which collectives can overlap a whole step of compute: those in a
loop body whose result no instruction of the same iteration uses (it only leaves the body,
for the next iteration), as a ring's key/value shard does, travelling while the step
attends to the shard it holds. A collective whose result the same computation uses (an
all-gather of the keys the attention reads, an all-to-all before and after it) waits for,
or makes wait, the compute around it, unless a scheduler splits that compute.
"""

from __future__ import annotations

import math
import re

_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}
KINDS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_WHILE = re.compile(r"\bwhile\(.*body=%?([\w.\-]+).*known_trip_count\D*(\d+)")


def _bytes(shapes: str) -> int:
  """Total bytes of the array shapes written in ``shapes`` (a shape or a tuple of them)."""
  return sum(
    _DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
    for t, dims in _SHAPE.findall(shapes)
  )


def _group_size(line: str) -> int:
  """G, the devices in each replica group of the collective on ``line`` (1 if unknown)."""
  if m := re.search(r"replica_groups=\{\{([0-9,]*)\}", line):
    return len(m.group(1).split(","))
  if m := re.search(r"replica_groups=\[([0-9,]+)\]<=", line):
    return int(m.group(1).split(",")[-1])
  # Newer XLA names the mesh and the axes each group spans: mesh['x'=4,'y'=2] {'y'}.
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
    sizes = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2)))
  return 1


def traffic(hlo: str) -> dict[str, float]:
  """Bytes each device sends per call of the program, by collective kind (absent: none)."""
  trips: dict[str, int] = {}
  for m in _WHILE.finditer(hlo):
    trips[m.group(1)] = int(m.group(2))
  out: dict[str, float] = {}
  computation = ""
  for line in hlo.splitlines():
    if header := _COMPUTATION.match(line):
      computation = header.group(1)
      continue
    op = _OP.match(line)
    if not op:
      continue
    result, kind, start, _ = op.groups()
    if start:  # an async start's result is (operands..., result): the last shape
      result = _SHAPE.findall(result)[-1]
      result = f"{result[0]}[{result[1]}]"
    G = _group_size(line)
    share, R = (G - 1) / G, _bytes(result)  # compiled HLO writes only the result's shape
    sent = {
      "all-gather": share * R,
      "all-to-all": share * R,
      "reduce-scatter": share * G * R,  # the operand is G results
      "all-reduce": 2 * share * R,
      "collective-permute": float(R),
    }[kind]
    out[kind] = out.get(kind, 0.0) + sent * trips.get(computation, 1)
  return out


_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")


def overlappable(hlo: str) -> dict[str, float]:
  """Bytes each device sends per call, by collective kind, in collectives that can overlap a
  whole loop step (see the module docstring); counted as :func:`traffic` counts them."""
  trips: dict[str, int] = {}
  for m in _WHILE.finditer(hlo):
    trips[m.group(1)] = int(m.group(2))
  free: dict[str, float] = {}
  computation = ""
  body: list[tuple[bool, str, str, str, str]] = []

  def close() -> None:
    if computation not in trips:  # not a loop body
      return
    users: dict[str, list[tuple[bool, str]]] = {}
    for root, _name, op, rest, _ in body:
      for operand in re.findall(r"%([\w.\-]+)", rest.split("),")[0]):
        users.setdefault(operand, []).append((root, op))
    for _, name, op, _, line in body:
      kind = op.removesuffix("-start")
      if kind not in KINDS or op.endswith("-done"):
        continue
      result = name
      if op.endswith("-start"):  # the value is its -done's
        done = [n for _, n, o, r, _ in body if o.endswith("-done") and f"%{name}" in r]
        result = done[0] if done else name
      # Used only by the body's root tuple (or a copy into it): carried to the next step.
      if all(root or o in ("copy", "tuple") for root, o in users.get(result, [])):
        single = traffic("\n".join(("ENTRY %x {", line, "}")))  # this collective once
        free[kind] = free.get(kind, 0.0) + sum(single.values()) * trips[computation]

  for line in hlo.splitlines():
    if header := _COMPUTATION.match(line):
      close()
      computation, body = header.group(1), []
      continue
    if instruction := _INSTRUCTION.match(line):
      root, name, op, rest = instruction.groups()
      body.append((root is not None, name, op, rest, line))
  close()
  return free
