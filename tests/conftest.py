"""Test configuration: 8 fake CPU devices, strict dtype promotion."""

import os

# Before JAX initialises: multi-device tests run on 8 fake CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _speed_blocker  # noqa: F401 (before lossscale: LOSSSCALE_BLOCK_SPEED)
import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")

# A hang anywhere (a collective waiting forever, a deadlock) ends the run
# with every thread's stack, well before CI's own limit would end it with
# none. The whole suite takes about 7 minutes on 2 cores.
SUITE_LIMIT_S = float(os.environ.get("LOSSSCALE_SUITE_LIMIT_S", 25 * 60))


def pytest_configure(config):
  import _backstop

  # Here pytest is not capturing: fd 2 is the terminal (or CI's log), which
  # the backstop keeps a copy of for when the tests' output is captured.
  _backstop.arm(SUITE_LIMIT_S, os.dup(2))


def pytest_unconfigure(config):
  import _backstop

  _backstop.disarm()


def pytest_collection_modifyitems(items):
  """Docstring examples that show `jax.shard_map` skip on a JAX without it;
  tests of the speed layer's formulations skip under `LOSSSCALE_PLAIN=1`."""
  from lossscale import _wrapper

  if {"split", "finite", "order"} != _wrapper.TRICKS:
    plain = pytest.mark.skip(reason="a speed-layer formulation: LOSSSCALE_PLAIN")
    for item in items:
      if item.get_closest_marker("speed_layer"):
        item.add_marker(plain)
  if hasattr(jax, "shard_map"):
    return
  skip = pytest.mark.skip(reason="shows `jax.shard_map`, which this JAX does not have")
  for item in items:
    examples = getattr(getattr(item, "dtest", None), "examples", ())
    if any("jax.shard_map" in example.source for example in examples):
      item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
  """Names the stack under test (`make test` runs the newest and the oldest)."""
  from importlib import metadata

  def version(name):
    try:
      return metadata.version(name)
    except metadata.PackageNotFoundError:
      return "not installed"

  names = ("jax", "jaxlib", "optax", "flax")
  stack = ", ".join(f"{n} {version(n)}" for n in names)
  terminalreporter.write_line(f"stack: {stack}")
