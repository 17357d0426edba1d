"""Coming from MPX (docs/from-mpx.md): MPX's `DynamicLossScaling` against the
wrapper, step by step, and MPX's training step against its translation.

MPX (the `mixed-precision-for-jax` package, version 0.1.8; Gräfe and Trimpe,
arXiv 2507.03312) is not a dependency: what it does is reimplemented below in
a few lines, written from its source (file and function cited in each
docstring; no upstream code is copied). The scale rule is plain Python and
NumPy float32; the gradient step is JAX and Equinox, as MPX's is.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import assert_trees_equal, standard_promotion

eqx = pytest.importorskip("equinox")

F16_MAX = 65504.0  # mpx.FLOAT16_MAX: (2 - 2**-10) * 2**15
INF = float("inf")


# ---------------------------------------------------------------------------
# MPX, from its source.


class MPXScaling:
  """mpx/_loss_scaling.py, `DynamicLossScaling`: `__init__(loss_scaling,
  min_loss_scaling, factor=2, period=2000)` and `adjust(grads_finite)`.

  On a finite step the scale is multiplied by `factor` when `counter ==
  period - 1` (kept if the product is not finite), else kept; on a
  non-finite step it is divided by `factor`, but not below
  `min_loss_scaling`. Then it is clipped to `[min_loss_scaling, 65504]`
  ("clip to maximum float16 value"), and `counter` becomes `((counter + 1) %
  period) * grads_finite`. Everything in float32, as MPX's arrays are.
  """

  def __init__(self, loss_scaling, min_loss_scaling, factor=2, period=2000):
    self.loss_scaling = np.float32(loss_scaling)
    self.min_loss_scaling = np.float32(min_loss_scaling)
    self.factor, self.period, self.counter = factor, period, 0

  def adjust(self, grads_finite):
    scale, low = self.loss_scaling, self.min_loss_scaling
    with np.errstate(over="ignore"):
      if grads_finite:
        grown = scale * np.float32(self.factor)
        grown = grown if np.isfinite(grown) else scale
        new = grown if self.counter == self.period - 1 else scale
      else:
        new = max(low, scale / np.float32(self.factor))
    self.loss_scaling = np.float32(min(max(new, low), np.float32(F16_MAX)))
    self.counter = (self.counter + 1) % self.period if grads_finite else 0
    return float(self.loss_scaling)


def mpx_scale(loss, loss_scaling):
  """mpx/_loss_scaling.py, `DynamicLossScaling.scale`: the loss times the
  scale cast to float16 (JAX's standard promotion then decides the dtype)."""
  return loss * jnp.asarray(loss_scaling, jnp.float32).astype(jnp.float16)


def mpx_cast_tree(tree, dtype):
  """mpx/_cast.py, `cast_tree`: float16, bfloat16 and float32 arrays
  (`eqx.is_array`) are cast, every other leaf is kept."""
  castable = (jnp.float16, jnp.bfloat16, jnp.float32)

  def cast(x):
    return x.astype(dtype) if eqx.is_array(x) and x.dtype in castable else x

  return jax.tree.map(cast, tree)


def mpx_force_full_precision(fn, return_dtype=jnp.float16):
  """mpx/_cast.py, `force_full_precision` (`cast_function(fn, float32,
  return_dtype)`): arguments cast to float32 by `cast_tree`; a tuple result
  has each element cast to `return_dtype`, an array result is cast, any
  other result is returned as it is."""

  def wrapped(*args, **kwargs):
    result = fn(*mpx_cast_tree(args, jnp.float32), **mpx_cast_tree(kwargs, jnp.float32))
    if type(result) is tuple:
      return tuple(mpx_cast_tree(r, return_dtype) for r in result)
    return mpx_cast_tree(result, return_dtype) if eqx.is_array(result) else result

  return wrapped


class MPXStep:
  """mpx/_grad_tools.py, `filter_value_and_grad` (with `calculate_scaled_grad`)
  followed by `optimizer_update` (with `select_tree`), for float16.

  The arguments are cast to float16 (`cast_to_half_precision`), the loss is
  scaled by `mpx_scale`, `eqx.filter_value_and_grad` differentiates the
  first argument; then `grads_finite = all_finite(grads)`, the scale is
  adjusted, and the loss and the gradients are multiplied by `float32(1 /
  loss_scaling)` of the *adjusted* scale (`unscale`). The optimizer gets
  `eqx.filter(model, eqx.is_array)` as its parameters, its update is applied
  with `eqx.apply_updates`, and `select_tree(grads_finite, new, old)` keeps
  the old model and optimizer state on a non-finite step (`lax.select` on the
  array leaves of `new`, paired with `old` by `jax.tree.map`; `new`'s other
  leaves as they are). `unscale_by_old=True` divides by the scale the loss
  was multiplied by instead (not MPX: the control).
  """

  def __init__(self, loss_fn, optimizer, scaling, *, unscale_by_old=False):
    self.optimizer, self.scaling, self.unscale_by_old = (
      optimizer,
      scaling,
      unscale_by_old,
    )

    @eqx.filter_jit
    def scaled_value_and_grad(loss_scaling, *args):
      with standard_promotion():  # MPX relies on it (float32 loss * float16 scale)
        scaled = lambda *a: mpx_scale(loss_fn(*a), loss_scaling)
        return eqx.filter_value_and_grad(scaled)(*mpx_cast_tree(args, jnp.float16))

    @eqx.filter_jit
    def update(model, opt_state, grads, grads_finite):
      with standard_promotion():  # optax's adam: int32 ** float
        params = eqx.filter(model, eqx.is_array)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
      new_model = eqx.apply_updates(model, updates)

      def select_tree(new, old):
        pick = lambda a, b: jax.lax.select(grads_finite, a, b) if eqx.is_array(a) else a
        return jax.tree.map(pick, new, old)

      return select_tree(new_model, model), select_tree(new_opt_state, opt_state)

    self._scaled_value_and_grad, self._update = scaled_value_and_grad, update

  def __call__(self, model, opt_state, *args):
    """Returns `(model, opt_state, value, grads_finite, grads)`."""
    old = self.scaling.loss_scaling
    value, grads = self._scaled_value_and_grad(jnp.float32(old), model, *args)
    grads_finite = bool(
      jax.tree.all(jax.tree.map(lambda g: jnp.isfinite(g).all(), grads))
    )
    new = np.float32(self.scaling.adjust(grads_finite))
    inv = jnp.float32(np.float32(1.0) / (old if self.unscale_by_old else new))
    with standard_promotion():  # float16 gradients * float32 -> float32
      value, grads = value * inv, jax.tree.map(lambda g: g * inv, grads)
    model, opt_state = self._update(model, opt_state, grads, jnp.asarray(grads_finite))
    return model, opt_state, value, grads_finite, grads


# ---------------------------------------------------------------------------
# The wrapper with MPX's settings, walked.


def like_mpx(tx, loss_scaling=F16_MAX, min_loss_scaling=1.0, factor=2, period=2000):
  """The wrapper whose scale follows `mpx.DynamicLossScaling(loss_scaling,
  min_loss_scaling, factor, period)` (docs/from-mpx.md's helper)."""
  return ls.dynamic_loss_scale(
    tx,
    initial_scale=loss_scaling,
    min_scale=min_loss_scaling,
    growth_interval=period,
    growth_factor=factor,
    backoff_factor=1 / factor,
    max_scale=F16_MAX,
  )


def _mpx_walk(flags, **settings):
  """MPX's scale and `counter` after each `adjust`."""
  scaling = MPXScaling(**settings)
  scales, counters = [], []
  for finite in flags:
    scales.append(scaling.adjust(finite))
    counters.append(scaling.counter)
  return scales, counters


def _our_walk(flags, **settings):
  """The wrapper's scale and `good_steps` after each jitted `tx.update`."""
  tx = like_mpx(optax.sgd(1.0), **settings)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  scales, good = [], []
  for finite in flags:
    _, state = update({"w": jnp.full(2, 1.0 if finite else INF)}, state, params)
    assert bool(ls.step_applied(state)) == finite  # MPX's grads_finite
    scales.append(float(ls.get_loss_scale(state)))
    good.append(int(state.good_steps))
  return scales, good


# docs/from-mpx.md's walk: from mpx.FLOAT16_MAX with period=2.
PAGE_FLAGS = [False, False, True, True, True, True, False, True, True, True, True]
PAGE_SCALES = [32752.0, 16376.0, 16376.0, 32752.0, 32752.0, 65504.0]
PAGE_SCALES += [32752.0, 32752.0, 65504.0, 65504.0, 65504.0]


def test_the_pages_walk_is_mpxs():
  settings = dict(loss_scaling=F16_MAX, min_loss_scaling=1.0, period=2)
  scales, counters = _mpx_walk(PAGE_FLAGS, **settings)
  assert scales == PAGE_SCALES
  assert _our_walk(PAGE_FLAGS, **settings) == (scales, counters)


def test_growth_is_clipped_at_the_float16_maximum():
  # From a power of two the scale grows to 65504, not 2**16, and backs off to
  # 65504 / 2: no longer a power of two.
  flags = [True] * 6 + [False, False] + [True] * 4
  settings = dict(loss_scaling=2.0**13, min_loss_scaling=1.0, period=2)
  scales, counters = _mpx_walk(flags, **settings)
  grows = [2.0**13, 2.0**14, 2.0**14, 2.0**15, 2.0**15, F16_MAX]
  assert scales == [*grows, 32752.0, 16376.0, 16376.0, 32752.0, 32752.0, F16_MAX]
  assert _our_walk(flags, **settings) == (scales, counters)
  # The default max_scale (2**24) would have grown past it.
  tx = ls.dynamic_loss_scale(optax.sgd(1.0), initial_scale=2.0**15, growth_interval=1)
  state = tx.init(jnp.zeros(1))
  _, state = tx.update(jnp.ones(1), state)
  assert float(ls.get_loss_scale(state)) == 2.0**16


def _random_flags(rng, n):
  """Runs of finite steps and of overflows, of random lengths."""
  flags, finite = [], bool(rng.integers(2))
  while len(flags) < n:
    flags += [finite] * int(rng.geometric(0.08 if finite else 0.4))
    finite = not finite
  return flags[:n]


def test_random_walks_match_mpx_for_power_of_two_factors():
  hit_min = hit_max = 0
  for seed in range(8):
    rng = np.random.default_rng(seed)
    settings = dict(
      loss_scaling=float(rng.choice([F16_MAX, 2.0**15, 3.0, 1.0])),
      min_loss_scaling=float(rng.choice([1.0, 2.0**-10, 0.5])),
      factor=int(rng.choice([2, 4, 8])),
      period=int(rng.integers(1, 6)),
    )
    flags = _random_flags(rng, 200)
    scales, counters = _mpx_walk(flags, **settings)
    assert _our_walk(flags, **settings) == (scales, counters), settings
    hit_min += min(scales) == settings["min_loss_scaling"]
    hit_max += max(scales) == F16_MAX
  assert hit_min and hit_max  # the walks reach both bounds


def test_a_factor_that_is_not_a_power_of_two_differs_in_the_last_bit():
  # MPX divides by `factor`, the wrapper multiplies by float32(1 / factor).
  flags = [False, True, True, False, False]
  theirs, counters = _mpx_walk(
    flags, loss_scaling=F16_MAX, min_loss_scaling=1.0, factor=3, period=2
  )
  ours, good = _our_walk(
    flags, loss_scaling=F16_MAX, min_loss_scaling=1.0, factor=3, period=2
  )
  assert theirs[0] == 21834.666015625 and ours[0] == 21834.66796875
  assert good == counters
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_mpx_minimum_must_be_a_normal_float32_and_the_start_within_the_bounds():
  # MPX takes any minimum and starting scale; the wrapper refuses what it
  # cannot keep.
  with pytest.raises(ValueError, match="min_scale"):
    like_mpx(optax.sgd(1.0), min_loss_scaling=0.0)
  with pytest.raises(ValueError, match="initial_scale"):
    like_mpx(optax.sgd(1.0), loss_scaling=2.0**16)
  # An MPX start above 65504 is inf as the float16 scale of the first step,
  # which overflows and backs off.
  with standard_promotion():
    assert not np.isfinite(mpx_scale(jnp.float32(1.0), 2.0**16))
  w = jnp.array([0.25, 0.5])
  step = MPXStep(_sum_of_squares, optax.sgd(1.0), MPXScaling(2.0**16, 1.0))
  assert not step(w, optax.sgd(1.0).init(w))[3]
  assert float(step.scaling.loss_scaling) == 2.0**15


def test_mpx_float16_max_is_float16s_largest_value():
  assert F16_MAX == (2 - 2**-10) * 2**15 == float(jnp.finfo(jnp.float16).max)


# ---------------------------------------------------------------------------
# Where the wrapper differs on purpose.


def test_mpx_scales_the_loss_by_a_float16_scale_the_wrapper_in_float32():
  loss16 = jnp.float16(4.0)
  with standard_promotion():
    theirs = mpx_scale(loss16, 2.0**15)
    assert theirs.dtype == jnp.float16 and not np.isfinite(theirs)
    # A float32 loss is multiplied in float32, but by a float16 scale.
    assert mpx_scale(jnp.float32(4.0), 2.0**15) == 2.0**17
    assert not np.isfinite(mpx_scale(jnp.float32(4.0), 2.0**16))
    # At the ceiling, any float16 loss above 1 overflows.
    assert mpx_scale(jnp.float16(1.0), F16_MAX) == F16_MAX
    assert not np.isfinite(mpx_scale(jnp.float16(1 + 2**-10), F16_MAX))
  ours = ls.scale_loss(loss16, 2.0**15)
  assert ours.dtype == jnp.float32 and float(ours) == 2.0**17
  assert float(ls.scale_loss(loss16, 2.0**20)) == 2.0**22


def _mean_square(w):
  return jnp.mean(w**2)  # float16 when `w` is


def test_a_float16_loss_mpx_returns_inf_the_wrapper_the_loss():
  w = jnp.full(64, 2.0)
  # MPX: 4 * 32768 overflows float16; the gradients (2w/64 * 32768 = 2048)
  # do not, so the step is applied, with an inf loss.
  step = MPXStep(_mean_square, optax.sgd(0.1), MPXScaling(2.0**15, 1.0))
  _, _, value, grads_finite, theirs = step(w, optax.sgd(0.1).init(w))
  assert grads_finite and not np.isfinite(value)
  tx = like_mpx(optax.sgd(0.1), loss_scaling=2.0**15)
  state = tx.init(w)
  loss, grads = ls.value_and_grad(ls.with_compute_dtype(_mean_square, jnp.float16))(
    state, w
  )
  assert loss.dtype == jnp.float32 and float(loss) == 4.0
  assert_trees_equal(ls.unscale_gradients(grads, state), theirs)
  np.testing.assert_array_equal(theirs, np.full(64, 0.0625, np.float32))
  _, state = tx.update(grads, state, w)
  assert bool(ls.step_applied(state))


def _sum_of_squares(w):
  return jnp.sum(w.astype(jnp.float32) ** 2)  # the gradient is 2w


@pytest.mark.parametrize(
  ("start", "grown", "w"),
  [(1024.0, 2048.0, [1.0, 2.0]), (2.0**15, F16_MAX, [0.25, 0.5])],
  ids=["double", "clipped"],
)
def test_on_a_growth_step_mpx_divides_by_the_grown_scale(start, grown, w):
  # "double" is the page's example: MPX returns the loss 2.5 and the
  # gradients [1, 2] for sum(w**2) at w = [1, 2].
  w = jnp.array(w)
  true, true_loss = 2 * np.asarray(w), float(np.sum(np.asarray(w) ** 2))
  # period=1: every finite step grows.
  step = MPXStep(_sum_of_squares, optax.sgd(1.0), MPXScaling(start, 1.0, period=1))
  new_w, _, value, grads_finite, theirs = step(w, optax.sgd(1.0).init(w))
  assert grads_finite and float(step.scaling.loss_scaling) == grown
  ratio = np.float32(start) * (np.float32(1.0) / np.float32(grown))
  np.testing.assert_array_equal(theirs, true * ratio)  # 1/2, or 32768/65504
  np.testing.assert_allclose(float(value), true_loss * ratio, rtol=1e-7)
  np.testing.assert_array_equal(new_w, w - true * ratio)
  if start == 1024.0:
    assert float(value) == 2.5 and theirs.tolist() == [1.0, 2.0]

  tx = like_mpx(optax.sgd(1.0), loss_scaling=start, period=1)
  state = tx.init(w)
  fn = ls.with_compute_dtype(_sum_of_squares, jnp.float16)
  loss, grads = ls.value_and_grad(fn)(state, w)
  updates, state = tx.update(grads, state, w)
  assert float(ls.get_loss_scale(state)) == grown  # the same scale after the step
  assert float(loss) == true_loss
  np.testing.assert_array_equal(updates, -true)  # the true gradient

  # The control: MPX dividing by the scale the loss was multiplied by.
  control = MPXStep(
    _sum_of_squares,
    optax.sgd(1.0),
    MPXScaling(start, 1.0, period=1),
    unscale_by_old=True,
  )
  assert_trees_equal(control(w, optax.sgd(1.0).init(w))[4], -updates)


def test_at_the_cap_mpx_growth_leaves_the_scale_and_divides_exactly():
  w = jnp.array([0.25, 0.5])
  step = MPXStep(_sum_of_squares, optax.sgd(1.0), MPXScaling(F16_MAX, 1.0, period=1))
  _, _, value, grads_finite, theirs = step(w, optax.sgd(1.0).init(w))
  assert grads_finite and float(step.scaling.loss_scaling) == F16_MAX
  np.testing.assert_allclose(theirs, [0.5, 1.0], rtol=1e-7)
  np.testing.assert_allclose(float(value), 0.3125, rtol=1e-7)


def test_on_a_back_off_step_mpx_returns_twice_the_loss():
  # The gradients overflow (2w * 65504), the scaled loss (float32) does not;
  # the step is skipped, and the loss is divided by the halved scale.
  w = jnp.array([1.0, 2.0])
  step = MPXStep(_sum_of_squares, optax.sgd(1.0), MPXScaling(F16_MAX, 1.0))
  new_w, _, value, grads_finite, _ = step(w, optax.sgd(1.0).init(w))
  assert not grads_finite and float(step.scaling.loss_scaling) == F16_MAX / 2
  np.testing.assert_allclose(float(value), 10.0, rtol=1e-7)
  assert_trees_equal(new_w, w)


# ---------------------------------------------------------------------------
# A scale above 65504: fine for a loss reduced in float32; not when the loss
# itself is a float16 value (its gradient is the scale, rounded to float16).


def _half_loss_step(tx, steps):
  """Skips of a float16 model whose float16 loss is the scale's only limit."""
  w = jnp.full(64, 0.25)
  fn = ls.with_compute_dtype(_mean_square, jnp.float16)

  @jax.jit
  def step(state):
    _, grads = ls.value_and_grad(fn)(state, w)
    _, state = tx.update(grads, state, w)
    return state

  state, skipped, scales = tx.init(w), [], []
  for _ in range(steps):
    state = step(state)
    skipped.append(not bool(ls.step_applied(state)))
    scales.append(float(ls.get_loss_scale(state)))
  return skipped, scales


def test_a_float16_loss_overflows_every_growth_past_the_float16_maximum():
  settings = dict(initial_scale=2.0**14, growth_interval=2)
  skipped, scales = _half_loss_step(
    ls.dynamic_loss_scale(optax.sgd(0.0), **settings), 9
  )
  # 2**14 -> 2**15 -> 2**16 (overflows at once) -> 2**15 -> 2**16 ...
  up, down = [2.0**14, 2.0**15, 2.0**15, 2.0**16], [2.0**15, 2.0**15, 2.0**16]
  assert scales == [*up, *down, 2.0**15, 2.0**15]
  assert skipped == [False] * 4 + [True, False, False, True, False]
  capped = ls.dynamic_loss_scale(optax.sgd(0.0), **settings, max_scale=F16_MAX)
  skipped, scales = _half_loss_step(capped, 9)
  assert not any(skipped) and scales[-1] == F16_MAX


def test_a_loss_reduced_in_float32_takes_scales_past_the_float16_maximum():
  w = jnp.full(64, 0.25)

  def float32_mean(w):
    return jnp.mean((w * w).astype(jnp.float32))

  fn = ls.with_compute_dtype(float32_mean, jnp.float16)
  for scale in (F16_MAX, 2.0**16, 2.0**20):
    tx = ls.dynamic_loss_scale(optax.sgd(0.0), initial_scale=scale)
    _, grads = ls.value_and_grad(fn)(tx.init(w), w)
    assert bool(ls.all_finite(grads)), scale


# ---------------------------------------------------------------------------
# Casting: `force_full_precision`, `cast_tree` and their translations.


def test_force_full_precision_returns_float16_by_default_with_compute_dtype_float32():
  x = jnp.array([1.0, 2.0, 3.0], jnp.float16)
  seen = []

  def softmax(x):
    seen.append(x.dtype)
    return jax.nn.softmax(x)

  assert mpx_force_full_precision(softmax)(x).dtype == jnp.float16
  assert ls.with_compute_dtype(softmax, jnp.float32)(x).dtype == jnp.float32
  both = ls.with_compute_dtype(softmax, jnp.float32, output_dtype=jnp.float16)(x)
  assert_trees_equal(both, mpx_force_full_precision(softmax)(x))
  assert seen == [jnp.float32] * 4
  as_float32 = mpx_force_full_precision(softmax, jnp.float32)(x)
  assert_trees_equal(ls.with_compute_dtype(softmax, jnp.float32)(x), as_float32)
  # The silent change: float16 code after a float32 result runs in float32.
  with standard_promotion():
    assert (ls.with_compute_dtype(softmax, jnp.float32)(x) * x).dtype == jnp.float32
    assert (mpx_force_full_precision(softmax)(x) * x).dtype == jnp.float16


def test_force_full_precision_casts_only_array_and_tuple_results():
  x = jnp.ones(2, jnp.float16)
  as_dict = lambda x: {"y": x * 2}
  assert mpx_force_full_precision(as_dict)(x)["y"].dtype == jnp.float32
  assert mpx_force_full_precision(lambda x: [x])(x)[0].dtype == jnp.float32
  assert mpx_force_full_precision(lambda x: (x, x))(x)[1].dtype == jnp.float16
  out = ls.with_compute_dtype(as_dict, jnp.float32, output_dtype=jnp.float16)(x)
  assert out["y"].dtype == jnp.float16
  # `output_dtype` is checked when the function is wrapped.
  with pytest.raises(ValueError, match=r"output_dtype=\.\.\.\)` must be a floating"):
    ls.with_compute_dtype(as_dict, jnp.float32, output_dtype=jnp.int32)


def test_with_compute_dtype_returns_aux_in_float32():
  def loss_fn(w):
    return jnp.sum(w**2), {"pred": w * 2, "n": jnp.int32(2)}

  state = like_mpx(optax.sgd(1.0), loss_scaling=8.0).init(jnp.ones(2))
  fn = ls.with_compute_dtype(loss_fn, jnp.float16)
  (loss, aux), _ = ls.value_and_grad(fn, has_aux=True)(state, jnp.ones(2))
  assert loss.dtype == aux["pred"].dtype == jnp.float32
  assert aux["n"].dtype == jnp.int32


def test_cast_tree_keeps_float64_numpy_arrays_cast_floating_casts_them():
  tree = {"a": np.ones(2), "b": jnp.ones(2), "i": jnp.arange(2)}
  theirs, ours = mpx_cast_tree(tree, jnp.float16), ls.cast_floating(tree, jnp.float16)
  assert theirs["a"].dtype == np.float64 and ours["a"].dtype == jnp.float16
  assert theirs["b"].dtype == ours["b"].dtype == jnp.float16
  assert theirs["i"].dtype == ours["i"].dtype == jnp.int32


# ---------------------------------------------------------------------------
# Integer arrays: `eqx.is_array` (MPX) and `eqx.is_inexact_array`.


class Counted(eqx.Module):
  linear: eqx.nn.Linear
  calls: jax.Array  # an int32 array that is not a parameter

  def __call__(self, x):
    return self.linear(x)


def _counted():
  return Counted(eqx.nn.Linear(3, 1, key=jax.random.key(0)), jnp.int32(7))


def _counted_loss(model, x):
  return jnp.mean(jax.vmap(model)(x).astype(jnp.float32) ** 2)


def test_an_integer_array_breaks_adam_with_mpxs_is_array_filter():
  model, x = _counted(), jnp.ones((4, 3))
  adam = optax.adam(1e-2)
  # As MPX's example initialises the optimizer: Adam gets a moment for
  # `calls`, whose gradient is None.
  with standard_promotion():
    opt_state = adam.init(eqx.filter(model, eqx.is_array))
  assert opt_state[0].mu.calls.dtype == jnp.int32
  step = MPXStep(_counted_loss, adam, MPXScaling(1024.0, 1.0))
  with pytest.raises(ValueError):
    step(model, opt_state, x)
  # SGD has no per-leaf state: MPX's step works.
  sgd = optax.sgd(0.1)
  step = MPXStep(_counted_loss, sgd, MPXScaling(1024.0, 1.0))
  new, _, _, grads_finite, grads = step(
    model, sgd.init(eqx.filter(model, eqx.is_array)), x
  )
  assert grads_finite and grads.calls is None and int(new.calls) == 7
  # Adam initialised on eqx.is_inexact_array works under MPX's step too.
  with standard_promotion():
    opt_state = adam.init(eqx.filter(model, eqx.is_inexact_array))
  step = MPXStep(_counted_loss, adam, MPXScaling(1024.0, 1.0))
  assert int(step(model, opt_state, x)[0].calls) == 7


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_the_wrapper_with_each_filter_and_an_integer_array(fused):
  model, x = _counted(), jnp.ones((4, 3))
  tx = like_mpx(optax.adam(1e-2), loss_scaling=1024.0)
  fn = ls.with_compute_dtype(_counted_loss, jnp.float16)

  def train(model, filter_spec):
    @eqx.filter_jit
    def step(model, state):
      with standard_promotion():  # optax's adam: int32 ** float
        _, grads = ls.value_and_grad(fn)(state, model, x)
        assert grads.calls is None
        params, static = eqx.partition(model, filter_spec)
        if fused:
          params, state = ls.apply_gradients(tx, grads, state, params)
          return eqx.combine(params, static), state
        updates, state = tx.update(grads, state, params)
        return eqx.apply_updates(model, updates), state

    with standard_promotion():
      state = tx.init(eqx.filter(model, filter_spec))
    for _ in range(2):
      model, state = step(model, state)
    return model

  new = train(model, eqx.is_inexact_array)
  assert int(new.calls) == 7 and new.calls.dtype == jnp.int32
  assert not np.array_equal(new.linear.weight, model.linear.weight)
  # optax 0.2.8's Adam raises a ValueError; 0.2.4's drops the integer
  # moment, and the skipped branch, which keeps the old state, no longer
  # has the applied one's structure.
  with pytest.raises(
    ValueError if _bare_adam_raises(model) else (TypeError, ValueError)
  ):
    train(model, eqx.is_array)


def _bare_adam_raises(model):
  """Whether this optax's Adam refuses an integer parameter's None gradient."""
  adam = optax.adam(1e-2)
  params = eqx.filter(model, eqx.is_array)
  grads = eqx.filter(model, eqx.is_inexact_array)
  with standard_promotion():
    state = adam.init(params)
    try:
      adam.update(grads, state, params)
    except ValueError:
      return True
  return False


# ---------------------------------------------------------------------------
# MPX's training step against its translation (docs/from-mpx.md), on a tiny
# Equinox MLP computing in float16.


def _mlp_loss(model, x, y):
  """The loss as an MPX user writes it: the model in float16 (the arguments
  arrive cast), the per-example losses in float16, their mean in float32."""
  losses = jnp.mean((jax.vmap(model)(x) - y) ** 2, axis=-1)
  return mpx_force_full_precision(jnp.mean, jnp.float32)(losses)


def _mlp_loss_translated(model, x, y):
  losses = jnp.mean((jax.vmap(model)(x) - y) ** 2, axis=-1)
  return ls.with_compute_dtype(jnp.mean, jnp.float32)(losses)


def _batches(steps):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((steps, 32, 2)).astype(np.float32)
  y = 16 * np.sin(2 * x[..., :1]) * np.cos(x[..., 1:])
  x[[3, 9], 0, 0] = np.inf  # two bad batches
  return x, y


def _translated_run(model, tx, x, y):
  @eqx.filter_jit
  def make_step(model, opt_state, x, y):
    loss_fn = ls.with_compute_dtype(_mlp_loss_translated, jnp.float16)
    loss, grads = ls.value_and_grad(loss_fn)(opt_state, model, x, y)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
    return eqx.combine(params, static), opt_state, loss

  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  models, scales, applied = [], [], []
  for xb, yb in zip(x, y, strict=True):
    model, opt_state, _ = make_step(model, opt_state, xb, yb)
    models.append(model)
    scales.append(float(ls.get_loss_scale(opt_state)))
    applied.append(bool(ls.step_applied(opt_state)))
  return models, scales, applied


def _mpx_run(model, optimizer, scaling, x, y, **kwargs):
  step = MPXStep(_mlp_loss, optimizer, scaling, **kwargs)
  opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
  models, scales, finite = [], [], []
  for xb, yb in zip(x, y, strict=True):
    model, opt_state, _, grads_finite, _ = step(model, opt_state, xb, yb)
    models.append(model)
    scales.append(float(scaling.loss_scaling))
    finite.append(grads_finite)
  return models, scales, finite


def test_the_translated_training_step_takes_mpxs_steps():
  model = eqx.nn.MLP(2, 1, width_size=8, depth=1, key=jax.random.key(0))
  x, y = _batches(12)
  tx = like_mpx(optax.sgd(0.05), period=2)  # mpx.FLOAT16_MAX, growth every 2 steps
  ours, our_scales, applied = _translated_run(model, tx, x, y)

  control = _mpx_run(
    model,
    optax.sgd(0.05),
    MPXScaling(F16_MAX, 1.0, period=2),
    x,
    y,
    unscale_by_old=True,
  )
  theirs = _mpx_run(model, optax.sgd(0.05), MPXScaling(F16_MAX, 1.0, period=2), x, y)
  # The same scales and the same skipped steps (grads_finite is step_applied).
  assert our_scales == theirs[1] == control[1]
  assert applied == theirs[2] == control[2]
  assert (
    not applied[3] and not applied[9] and sum(applied) < 10
  )  # float16 overflowed too
  grew = [i for i in range(1, 12) if our_scales[i] > our_scales[i - 1]]
  assert grew
  # MPX dividing by the scale the loss was multiplied by: the same model, bit
  # for bit. MPX as it is: the same model up to its first growth step only.
  params = lambda models: [eqx.filter(m, eqx.is_array) for m in models]
  assert_trees_equal(params(ours), params(control[0]))
  first = grew[0]
  assert_trees_equal(params(ours[:first]), params(theirs[0][:first]))
  a, b = params(ours)[first], params(theirs[0])[first]
  assert any(
    not np.array_equal(u, v)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )
