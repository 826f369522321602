"""The command line and the run record shared by the experiments.

Every experiment runs as ``python -m experiments.<name>``; what their ``main``
functions have in common lives here:

- :func:`parser`: the argparse skeleton: ``prog`` and description from the script,
  ``--config`` (a YAML file under configs/), ``--quick`` (the smoke test's settings)
  and ``--out-dir`` (where the record goes); the script adds its own flags;
- :func:`load_config`: the checked config dataclass from ``--config``, the ``--quick``
  settings, the flags given and ``--set``; :func:`config_or_exit` turns a
  :class:`~experiments._config.ConfigError` into the command's error message;
- :func:`facts`, :func:`record_path`, :func:`write_record`: a run's JSON record,
  time-stamped under ``out_dir`` (relative to the repository root), with the facts
  every record carries: the command, the device, the machine and jax's version.

Configs are experiments/_config.py; timing is experiments/_timing.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax

from experiments import _config

ROOT = pathlib.Path(__file__).resolve().parent.parent
T = TypeVar("T")


def parser(
  name: str,
  doc: str,
  *,
  config: bool = True,
  quick: str | None = "tiny shapes (smoke test)",
  out_dir: str | None = "where the JSON goes (default runs/)",
  out_dir_default: str | None = None,
) -> argparse.ArgumentParser:
  """The parser of ``python -m experiments.<name>``, described by ``doc``'s first line, with
  ``--config`` (unless ``config`` is False), ``--quick`` and ``--out-dir`` (``quick`` and
  ``out_dir`` are their help; None: no such flag). A config's ``out_dir`` key gives the
  default, so the flag's is None unless ``out_dir_default`` says otherwise."""
  p = argparse.ArgumentParser(prog=f"python -m experiments.{name}", description=doc.splitlines()[0])
  if config:
    p.add_argument("--config", help="a YAML file under configs/ (flags override it)")
  if quick is not None:
    p.add_argument("--quick", action="store_true", help=quick)
  if out_dir is not None:
    p.add_argument("--out-dir", dest="out_dir", default=out_dir_default, help=out_dir)
  return p


def load_config(cls: type[T], args: argparse.Namespace, quick: Mapping, **flags: Any) -> T:
  """The checked config ``cls`` of a parsed command line. Later sources win: the YAML file
  of ``--config``; ``quick`` (the script's smoke-test settings) under ``--quick``; every
  parsed flag whose ``dest`` is a top-level key of ``cls`` (``--reps`` sets ``reps``), then
  ``flags`` (flags named otherwise or converted; dotted keys reach into sections:
  ``{"memory.lengths": [64]}``), a value of None meaning not given; then ``--set
  key=value``. Raises ConfigError naming the key."""
  keys = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
  given = {k: v for k, v in vars(args).items() if k in keys}
  return _config.load(
    cls,
    args.config,
    quick=quick if args.quick else None,
    flags=given | flags,
    overrides=getattr(args, "set", None) or (),
  )


def config_or_exit(name: str, load: Callable[[argparse.Namespace], T], args) -> T:
  """``load(args)``, or exit with ``python -m experiments.<name>: error: <why>`` when the
  config is not valid."""
  try:
    return load(args)
  except _config.ConfigError as e:
    sys.exit(f"python -m experiments.{name}: error: {e}")


def facts(name: str, argv: Sequence[str] | None) -> dict[str, str]:
  """What a record says about its run: the command (``argv``, or the process's arguments
  when None), the first JAX device, the machine (architecture, cores, OS) and jax's
  version."""
  given = sys.argv[1:] if argv is None else argv
  return dict(
    command=" ".join([f"python -m experiments.{name}", *given]),
    device=str(jax.devices()[0]),
    machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
    jax=jax.__version__,
  )


def record_path(out_dir: str, prefix: str, quick: bool, name: str | None = None) -> pathlib.Path:
  """Where a run's record goes: ``<out_dir>/<prefix>-<time>[-quick].json``, or with ``name``
  the file ``name`` in the run's own folder ``<out_dir>/<prefix>-<time>[-quick]/`` (for runs
  that write several files). A relative ``out_dir`` is taken from the repository root; the
  folder is created. ``-quick`` keeps smoke tests out of docs_tables' ``--collect``."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  run = f"{prefix}-{stamp}-quick" if quick else f"{prefix}-{stamp}"
  path = ROOT / out_dir / (f"{run}.json" if name is None else f"{run}/{name}")
  path.parent.mkdir(parents=True, exist_ok=True)
  return path


def write_record(
  path: str | pathlib.Path, record: Any, note: str = "", *, quiet: bool = False
) -> pathlib.Path:
  """Writes ``record`` as JSON (one space of indent) to ``path``, creating its folder, and
  prints ``wrote <path><note>`` unless ``quiet`` (a record rewritten as a run goes, so a run
  cut short keeps what it measured)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(record, indent=1))
  if not quiet:
    print(f"\nwrote {path}{note}")
  return path
