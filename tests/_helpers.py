"""What several test modules share: tree assertions, one reference model of
the scale rule, the dtype-promotion context and device meshes.

The reference model is written independently of `lossscale`: plain Python
counters and NumPy float32, following the rule as docs/how-it-works.md states
it. Every test that checks a trajectory of scales compares against it.
"""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import lossscale as ls

INF, NAN = float("inf"), float("nan")
I32_MAX = 2**31 - 1


def standard_promotion():
  """optax's own optimizers (adam's `int32 ** float`, MultiSteps' division by
  a count) need JAX's standard dtype promotion; the suite runs strict."""
  return jax.numpy_dtype_promotion("standard")


# ---------------------------------------------------------------------------
# Tree assertions.


def _numpy(x):
  """A NumPy view of any leaf (typed PRNG keys as their key data)."""
  if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def _dtype(x):
  return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _paired_leaves(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b), (
    f"tree structures differ:\n{jax.tree.structure(a)}\n{jax.tree.structure(b)}"
  )
  for (path, x), y in zip(
    jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
  ):
    where = jax.tree_util.keystr(path) or "<root>"
    x_dtype, y_dtype = _dtype(x), _dtype(y)
    assert x_dtype == y_dtype, f"{where}: dtype {x_dtype} != {y_dtype}"
    yield where, x, y


def assert_trees_equal(a, b, *, weak_type=False):
  """Same structure, and every leaf the same dtype and the same bits.

  Bits, not values: `-0.0` differs from `0.0` and a NaN equals only the same
  NaN. `weak_type=True` also compares JAX's weak-type flags (what `lax.cond`
  and a checkpoint round trip must keep).
  """
  for where, x, y in _paired_leaves(a, b):
    xs, ys = _numpy(x), _numpy(y)
    assert xs.shape == ys.shape, f"{where}: shape {xs.shape} != {ys.shape}"
    assert xs.tobytes() == ys.tobytes(), f"{where}: bits differ:\n{xs}\n{ys}"
    if weak_type:
      wx, wy = getattr(x, "weak_type", False), getattr(y, "weak_type", False)
      assert wx == wy, f"{where}: weak_type {wx} != {wy}"


def assert_trees_close(a, b, *, rtol=2e-6, atol=1e-7):
  """Same structure and dtypes, every leaf within `rtol`/`atol`."""
  for where, x, y in _paired_leaves(a, b):
    np.testing.assert_allclose(
      _numpy(x), _numpy(y), rtol=rtol, atol=atol, err_msg=where
    )


# ---------------------------------------------------------------------------
# One reference model of the scale rule.


@dataclasses.dataclass(frozen=True)
class ScaleRule:
  """The settings of `dynamic_loss_scale`, with its defaults."""

  initial_scale: float = 2.0**15
  growth_interval: int = 2000
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  hysteresis: int = 1
  min_scale: float = 1.0
  max_scale: float = 2.0**24
  reset_hysteresis_on_backoff: bool = False

  def tx(self, inner=None, **kwargs):
    """`dynamic_loss_scale` with these settings around `inner` (`sgd(1)` if
    omitted); `kwargs` adds the other arguments (`axis_name`, `enabled`)."""
    inner = optax.sgd(1.0) if inner is None else inner
    return ls.dynamic_loss_scale(inner, **dataclasses.asdict(self), **kwargs)

  def start(self):
    """The state's counters after `init`, as `reference_rule` takes them."""
    return (self.initial_scale, 0, self.hysteresis, 0, 0)


def reference_rule(rule, finite_flags, start=None):
  """Runs the scale rule one step at a time, in NumPy float32.

  `start` is `(scale, good_steps, hysteresis_left, skipped_steps,
  consecutive_skips)` (`rule.start()` if omitted); returns that tuple after
  every step. A finite step counts a good step and grows the scale by
  `growth_factor` (at most `max_scale`; not at all when the product overflows
  float32, as in TF 1.x, TF 2.x and PyTorch) once `growth_interval` good steps
  have passed, refilling the hysteresis; a non-finite one is skipped,
  clears the good steps and spends one unit of hysteresis, and once none is
  left backs the scale off by `backoff_factor` (at least `min_scale`), on
  every later non-finite step too, unless `reset_hysteresis_on_backoff`
  refills it. Counters saturate at the int32 maximum.
  """
  f32 = np.float32
  scale, good, h, skipped, consecutive = start or rule.start()
  scale = f32(scale)
  out = []
  with np.errstate(over="ignore"):  # scale * growth may overflow to inf
    for finite in finite_flags:
      if finite:
        good = min(good + 1, I32_MAX)
        consecutive = 0
        if good >= rule.growth_interval:
          product = f32(scale * f32(rule.growth_factor))
          if np.isfinite(product):  # past float32's range the scale stays
            scale = min(product, f32(rule.max_scale))
          good, h = 0, rule.hysteresis
      else:
        skipped = min(skipped + 1, I32_MAX)
        consecutive = min(consecutive + 1, I32_MAX)
        good, h = 0, max(h - 1, 0)
        if h <= 0:
          scale = max(f32(scale * f32(rule.backoff_factor)), f32(rule.min_scale))
          if rule.reset_hysteresis_on_backoff:
            h = rule.hysteresis
      out.append((scale, good, h, skipped, consecutive))
  return out


def reference_scales(rule, finite_flags):
  """The scale after each step, as Python floats."""
  return [float(s[0]) for s in reference_rule(rule, finite_flags)]


def scale_history(tx, finite_flags):
  """The scale after each of a run of jitted `tx.update` calls, as Python
  floats: one gradient of ones for a finite step, of infs for another."""
  params = {"w": jnp.zeros(2, jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  history = []
  for finite in finite_flags:
    grads = {"w": jnp.full(2, 1.0 if finite else INF, jnp.float32)}
    _, state = update(grads, state, params)
    history.append(float(state.loss_scale))
  return history


# ---------------------------------------------------------------------------
# Devices and compiled collectives.


def make_mesh(shape=(8,), names=("batch",)):
  """A mesh over the first `prod(shape)` devices (tests/conftest.py sets 8)."""
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def stack(tree, n=8):
  """`tree` with a leading axis of `n` identical copies (pmap's input)."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), tree)


_COLLECTIVE = re.compile(
  r"=\s*(\([^)]*\)|\S+)\s+"
  r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def collectives(hlo_text):
  """The collectives of compiled HLO text: a Counter of `(op, operand shapes)`,
  the shapes sorted and without layouts (`("all-reduce", ("f32[3]",))`)."""
  found = collections.Counter()
  for shape, op in _COLLECTIVE.findall(hlo_text):
    shape = re.sub(r"\{[^}]*\}", "", shape).strip("()")
    found[op, tuple(sorted(s.strip() for s in shape.split(", ")))] += 1
  return found


_TRUE_FALSE = r"true_computation=%?([\w.-]+), false_computation=%?([\w.-]+)"


def collectives_per_run(hlo_text):
  """`collectives(hlo_text)` of one run of the program: of each conditional,
  only its costliest branch is counted (one branch runs), and so once.

  Branches are named in `branch_computations={...}` (or true/false
  computations); a collective inside a branch is counted through it.
  """
  computations = {}
  name = None
  for line in hlo_text.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      computations[name] = []
    elif name is not None:
      computations[name].append(line)
  branch_sets = []
  for lines in computations.values():
    for line in lines:
      m = re.search(r"branch_computations=\{([^}]*)\}", line)
      if m:
        branch_sets.append([b.strip().lstrip("%") for b in m.group(1).split(",")])
      m = re.search(
        r"true_computation=%?([\w.-]+), false_computation=%?([\w.-]+)", line
      )
      if m:
        branch_sets.append([m.group(1), m.group(2)])
  in_branch = {b for branches in branch_sets for b in branches}
  found = collections.Counter()
  for comp, lines in computations.items():
    if comp not in in_branch:
      found += collectives("\n".join(lines))
  for branches in branch_sets:
    per_branch = [collectives("\n".join(computations.get(b, []))) for b in branches]
    found += max(per_branch, key=lambda c: sum(c.values()))
  return found


def elements(shape):
  """How many elements an HLO shape string holds (`"f32[8,1]"`: 8)."""
  dims = re.findall(r"\d+", shape.split("[", 1)[1])
  return int(np.prod([int(d) for d in dims]))


def bytes_accessed(compiled):
  """XLA's cost-model bytes of a compiled step (a list on older jaxlib)."""
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  return analysis["bytes accessed"]


# ---------------------------------------------------------------------------
# Counting XLA compilations (the same event on the newest and oldest JAX).

_COMPILATIONS = []
jax.monitoring.register_event_duration_secs_listener(
  lambda event, *_, **__: (
    _COMPILATIONS.append(event)
    if event == "/jax/core/compile/backend_compile_duration"
    else None
  )
)


class CompilationCounter:
  """How many XLA compilations happened since it was made (`.count`)."""

  def __init__(self):
    self._start = len(_COMPILATIONS)

  @property
  def count(self):
    return len(_COMPILATIONS) - self._start


def primitive_count(closed_jaxpr, name):
  """How many times primitive `name` runs in `closed_jaxpr`, calls
  (`jax.jit` inside the traced function) counted once per call site;
  branches of a `cond` are not looked into."""
  count = 0
  for eqn in closed_jaxpr.eqns:
    if eqn.primitive.name == name:
      count += 1
    inner = eqn.params.get("jaxpr")
    if eqn.primitive.name in ("pjit", "jit") and inner is not None:
      count += primitive_count(inner, name)
  return count


def recording_wrapper():
  """`(tx, seen)`: a `dynamic_loss_scale` of an identity-like inner optimizer
  whose `jax.debug.callback` appends every gradient it is fed to `seen`."""
  seen = []

  def record(updates, state, params=None):
    del params
    jax.debug.callback(lambda g: seen.append(np.asarray(g)), updates)
    return updates, state

  inner = optax.GradientTransformation(lambda p: optax.EmptyState(), record)
  return ls.dynamic_loss_scale(inner), seen


def pure_callback_logger():
  """`(tx, seen)`: an identity transformation whose update passes the
  updates through `jax.pure_callback` (no effect: it runs only where its
  result is used), which appends a copy of each to `seen`."""
  seen = []

  def host(x):
    seen.append(np.asarray(x).copy())
    return np.asarray(x)

  def log(updates, state, params=None):
    del params
    shape = jax.ShapeDtypeStruct(updates.shape, updates.dtype)
    return jax.pure_callback(host, shape, updates, vmap_method="sequential"), state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), log), seen
