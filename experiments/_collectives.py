"""What a compiled SPMD program moves between devices, read from its HLO text.

For every collective in the per-device program (all-gather, all-to-all, reduce-scatter,
all-reduce, collective-permute), the bytes each device puts on the wire, by the
bandwidth-optimal algorithms' counts on a group of G devices: an all-gather or all-to-all
of a result of R bytes sends (G - 1)/G · R, a reduce-scatter (G - 1) · R (its operand is
G results), an all-reduce 2 (G - 1)/G · R, a collective-permute its whole operand (R).
A collective inside a while loop counts once per iteration (XLA's ``known_trip_count``).
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
