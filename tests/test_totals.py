"""Distributed variables, check_totals and built-in collectives in a single process
(the cases of tests/mpi/test_distributed.py, which run under MPI too)."""

import contextlib
import fractions
import inspect
import io
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mpi_tests

import distop


@pytest.mark.parametrize("case", mpi_tests("test_distributed"))
def test_case(case):
    case()


def test_check_totals_options_and_table():
    problem = distop.Problem(lambda x: {"y": jnp.sin(x), "z": jnp.sum(x ** 2)},
                             {"x": np.arange(3.0)})
    for form in ("central", "forward", "backward"):
        out = io.StringIO()
        results = problem.check_totals(form=form, out_stream=out, step=1e-7, atol=1e-6)
        assert set(results) == {("y", "x"), ("z", "x")}
        r = results["z", "x"]
        assert r.ok and r.inconsistent_ranks == [] and r.abs_error <= r.allowed
        np.testing.assert_allclose(r.J, [[0.0, 2.0, 4.0]])
        text = out.getvalue()
        assert "of" in text and "J_fd" in text and "abs error" in text and "z" in text
        assert "allowed" in text and "worst" in text
    quiet = io.StringIO()
    problem.check_totals(out_stream=quiet, show_only_incorrect=True)
    assert "z " not in quiet.getvalue()
    assert problem.check_totals(out_stream=None, of="y", wrt="x")["y", "x"].J_fd.shape == (3, 3)
    with pytest.raises(ValueError, match="form='sideways'"):
        problem.check_totals(form="sideways")


def test_check_totals_prints_to_stdout_as_it_is_when_called(capsys):
    problem = distop.Problem(lambda x: {"z": jnp.sum(x ** 2)}, {"x": np.arange(3.0)})
    problem.check_totals()
    assert "J_fd" in capsys.readouterr().out  # pytest's capture, made after import
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        problem.check_totals()
    assert "J_fd" in out.getvalue() and "J_fd" not in capsys.readouterr().out
    # the signature shows the default as sys.stdout (annotated: `out_stream: Any = ...`)
    shown = inspect.signature(distop.Problem.check_totals).parameters["out_stream"]
    assert repr(shown.default) == "sys.stdout", shown


def test_check_totals_flags_a_wrong_vjp():
    class Wrong(distop.DistributedOperator):
        def forward(self, comm, x):
            return x ** 2

        def vjp(self, comm, y_bar, x):
            return 3 * x * y_bar

    problem = distop.Problem(lambda x: {"y": Wrong()(x)}, {"x": np.ones(2)})
    out = io.StringIO()
    r = problem.check_totals(out_stream=out)["y", "x"]
    assert not r.ok and "FAILED" in out.getvalue()
    with pytest.raises(distop.DerivativeCheckError, match=r"\('y', 'x'\)"):
        problem.check_totals(out_stream=None, raise_on_error=True)
    assert issubclass(distop.DerivativeCheckError, ValueError)


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_check_totals_perturbs_in_a_loop_where_only_its_perturbations_cannot_vmap(backend):
    # The operator inside lax.cond gets no cotangent (stop_gradient): compute_totals
    # vmaps nothing through it, the perturbations do. With ordered callbacks
    # (io_callback) JAX cannot vmap them, and they run one per iteration; the lean
    # path's calls carry no effect, and vmap.
    from helpers import RowScale
    from jax import lax

    def model(x):
        inside = lax.cond(x.sum() > 0, RowScale(2.0), lambda v: v, lax.stop_gradient(x))
        return {"f": jnp.sum(x ** 2) + 0.0 * jnp.sum(inside)}

    problem = distop.Problem(model, {"x": np.arange(3.0)}, backend=backend)
    if backend == "io_callback":
        with pytest.warns(UserWarning, match="^fd: the model has an operator inside lax.cond"):
            r = problem.check_totals(out_stream=None)["f", "x"]
    else:
        r = problem.check_totals(out_stream=None)["f", "x"]  # (a warning is an error here)
    assert r.ok
    np.testing.assert_allclose(r.J, [[0.0, 2.0, 4.0]])


def test_check_totals_says_where_finite_differences_err_more_than_rtol():
    def model(x):
        return {"y": jnp.sum(x ** 2)}

    def wrong(x):  # a gradient 1% off: 2.02 x
        return {"y": Wrong(0.01)(x)}

    # float32 at float64's step of 1e-6: the rounding of y(x +- h) swamps the
    # difference, so the entries cannot be judged: they fail, and the note names a step
    single = distop.Problem(model, {"x": np.ones(3, np.float32)})
    out = io.StringIO()
    r = single.check_totals(out_stream=out, step=1e-6)["y", "x"]
    note = re.search(r"central differences at step=1e-06 carry an error of about (\S+) "
                     r"\(rounding (\S+), truncation (\S+)\), .* more than rtol=1e-06; "
                     r"entries within their allowance only by that error cannot be judged, "
                     r"and fail. About step=(\S+) would make it less.", out.getvalue())
    assert note, out.getvalue()
    assert float(note.group(2)) > 10 * float(note.group(3))  # rounding, not truncation
    assert not r.ok and np.max(r.fd_error) > 0.02 * np.max(np.abs(r.J))
    better = float(note.group(4))
    assert 1e-3 <= better <= 1e-1, better
    # float32's default step (1e-3) passes the right gradient and fails a 1% error
    assert single.check_totals(out_stream=None)["y", "x"].ok
    bad = distop.Problem(wrong, {"x": np.ones(3, np.float32)})
    assert not bad.check_totals(out_stream=None)["y", "x"].ok
    assert not bad.check_totals(out_stream=None, step=better)["y", "x"].ok
    out = io.StringIO()
    assert single.check_totals(out_stream=out, step=better, rtol=1e-3)["y", "x"].ok
    assert "carry an error" not in out.getvalue(), out.getvalue()
    # a float32 output named as a float64 input is rounded as the output
    same = distop.Problem(lambda x: {"x": jnp.sum(x.astype(jnp.float32) ** 2)},
                          {"x": np.ones(3)})
    assert np.max(same.check_totals(out_stream=None, step=1e-6)["x", "x"].fd_error) > 0.02
    # one-sided differences at a large step: the truncation, seen, gives a smaller step
    double = distop.Problem(model, {"x": np.ones(3)})
    out = io.StringIO()
    double.check_totals(form="forward", step=1e-2, out_stream=out)
    note = re.search(r"forward differences at step=0.01 carry .* truncation (\S+)\).* "
                     r"About step=(\S+) would make it less", out.getvalue())
    assert note and float(note.group(1)) > 1e-3 and float(note.group(2)) < 1e-6, (
        out.getvalue())
    for options in [{}, dict(form="backward", step=1e-7, rtol=1e-5), dict(form="forward")]:
        out = io.StringIO()
        assert double.check_totals(out_stream=out, **options)["y", "x"].ok
        assert "carry an error" not in out.getvalue(), out.getvalue()


class Wrong(distop.DistributedOperator):
    """y = sum(x**2) with a gradient off by the fraction `off`: (2 + 2 off) x."""

    off: float

    def output_spec(self, x):
        return jax.ShapeDtypeStruct((), x.dtype)

    def forward(self, comm, x):
        return np.asarray(np.sum(x ** 2), x.dtype)

    def vjp(self, comm, y_bar, x):
        return np.asarray((2 + 2 * self.off) * x * y_bar, x.dtype)


def test_check_totals_passes_a_right_gradient_of_a_large_objective():
    # f near 1e7 with derivatives from 2e6 to 0.5: f(x +- h) round by about 1e7 eps,
    # which the differences of the smallest derivative carry, far beyond rtol |J|
    c, w = np.array([3.0, -2.0, 0.5]), np.array([1e6, 1e3, 1.0])
    b = np.array([4.0, -1.0, 0.75])

    def model(b):
        return {"f": jnp.sum(w * (b - c) ** 2) + 1e7}

    problem = distop.Problem(model, {"b": b})
    out = io.StringIO()
    r = problem.check_totals(out_stream=out, rtol=1e-6)["f", "b"]
    assert r.ok and r.abs_error <= r.allowed, out.getvalue()
    np.testing.assert_allclose(r.J, [2 * w * (b - c)])
    # the tolerance alone would fail it: the finite differences' own error decides
    assert np.any(np.abs(r.J - r.J_fd) > 1e-8 + 1e-6 * np.abs(r.J_fd)), r
    # the printed row is the deciding entry, with J and J_fd there
    row = next(line for line in out.getvalue().splitlines() if line.startswith("f "))
    i, j = r.worst
    assert f"({i}, {j})" in row and f"{r.J[i, j]:.4e}" in row and f"{r.allowed:.2e}" in row
    # a gradient wrong by 1e-4 of its largest entry still fails, at that entry
    wrong = distop.Problem(lambda b: {"f": model(b)["f"] + Shifted(2e2)(b)}, {"b": b})
    out = io.StringIO()
    r = wrong.check_totals(out_stream=out, rtol=1e-6)["f", "b"]
    assert not r.ok and r.worst == (0, 0) and r.abs_error > r.allowed, out.getvalue()
    assert "<-- FAILED" in out.getvalue()
    with pytest.raises(distop.DerivativeCheckError, match=r"at \(0, 0\): J .* > allowed"):
        wrong.check_totals(out_stream=None, raise_on_error=True)


class Shifted(distop.DistributedOperator):
    """y = 0 with a gradient `d` in its first entry: a wrong derivative of size d."""

    d: float

    def output_spec(self, x):
        return jax.ShapeDtypeStruct((), x.dtype)

    def forward(self, comm, x):
        return np.zeros((), x.dtype)

    def vjp(self, comm, y_bar, x):
        found = np.zeros_like(x)
        found[0] = self.d * y_bar
        return found


def test_check_totals_refuses_a_step_or_tolerance_that_is_not_a_number_it_can_use():
    problem = distop.Problem(lambda x: {"y": jnp.sum(x ** 2)}, {"x": np.ones(2)})
    for options, text in [(dict(step=0.0), r"step=0.0\): expected a positive number"),
                          (dict(step=-1e-6), r"step=-1e-06\): expected a positive"),
                          (dict(step="1e-6"), r"step='1e-6'\): expected a positive"),
                          (dict(atol=-1.0), r"atol=-1.0\): expected a non-negative"),
                          (dict(rtol=float("nan")), r"rtol=nan\): expected a non-negative"),
                          (dict(step=True), r"step=True\): expected a positive")]:
        with pytest.raises(ValueError, match=rf"check_totals\({text}"):
            problem.check_totals(out_stream=None, **options)
    assert problem.check_totals(out_stream=None, step=np.float32(1e-4), atol=0)["y", "x"].ok
    r = problem.check_totals(out_stream=None, step=fractions.Fraction(1, 10 ** 6))["y", "x"]
    assert r.ok and r.J_fd.dtype == np.float64
    # a step so large that the differences overflow: not ok (inf or NaN), and the note
    # after the table is computed without overflowing
    out = io.StringIO()
    r = problem.check_totals(out_stream=out, step=1e200)["y", "x"]
    assert not r.ok and not np.isfinite(r.J_fd).any() and "FAILED" in out.getvalue()


class _Wave(distop.DistributedOperator):
    """y = sin(x) x, with a vjp and a jvp, batched."""

    batched_vjp = batched_jvp = True

    def forward(self, comm, x):
        return np.sin(x) * x

    def vjp(self, comm, y_bar, x, batched=False):
        return y_bar * (np.cos(x) * x + np.sin(x))

    def jvp(self, comm, x_dot, x, batched=False):
        return x_dot * (np.cos(x) * x + np.sin(x))


def test_forward_sweeps_give_the_reverse_sweeps_totals():
    op = _Wave()

    def model(u, k):
        v = jax.lax.scan(lambda c, _: (op(c) * k, None), u, None, length=3)[0]
        return {"y": v, "s": jnp.sum(op(v) ** 2) * k}

    problem = distop.Problem(model, {"u": np.linspace(0.1, 0.9, 4), "k": np.array(0.7)})
    reverse = problem.compute_totals()
    for direction in ("fwd", "auto"):
        for mode in ("batched", "loop", "unrolled"):
            for return_format in ("global", "local"):
                J = problem.compute_totals(direction=direction, mode=mode,
                                           return_format=return_format)
                assert set(J) == set(reverse)
                for key in reverse:
                    np.testing.assert_allclose(J[key], reverse[key], rtol=1e-12)
    _, J = problem.run_and_compute_totals("s", "u", direction="fwd")
    np.testing.assert_allclose(J["s", "u"], reverse["s", "u"], rtol=1e-12)
    with pytest.raises(ValueError, match=r"direction='sideways'\): expected one of"):
        problem.compute_totals(direction="sideways")


def test_forward_sweeps_need_every_operator_to_have_a_jvp():
    class NoJvp(distop.DistributedOperator):
        def forward(self, comm, x):
            return 2 * x

        def vjp(self, comm, y_bar, x):
            return 2 * y_bar

    problem = distop.Problem(lambda u: {"y": NoJvp()(u)}, {"u": np.ones(3)})
    np.testing.assert_array_equal(problem.compute_totals()["y", "u"], 2 * np.eye(3))
    with pytest.raises(distop.MissingMethodError, match=r"NoJvp does not implement jvp.*"
                                                        r"direction='fwd'"):
        problem.compute_totals(direction="fwd")
    # auto picks reverse for one row, so no jvp is needed
    problem2 = distop.Problem(lambda u: {"s": jnp.sum(NoJvp()(u))}, {"u": np.ones(3)})
    np.testing.assert_array_equal(problem2.compute_totals(direction="auto")["s", "u"],
                                  2 * np.ones((1, 3)))


class Stencil(distop.DistributedOperator):
    """y = x[:-2] + middle x[1:-1] + x[2:]: a cancellation of larger terms where middle
    is -2 (the vjp takes `middle` as given: a wrong Jacobian where it differs)."""

    middle: float = -2.0

    def output_spec(self, x):
        return jax.ShapeDtypeStruct((x.shape[0] - 2,), x.dtype)

    def forward(self, comm, x):
        return x[:-2] - 2 * x[1:-1] + x[2:]

    def vjp(self, comm, y_bar, x):
        x_bar = np.zeros_like(x)
        x_bar[:-2] += y_bar
        x_bar[1:-1] += self.middle * y_bar
        x_bar[2:] += y_bar
        return x_bar


@pytest.mark.parametrize("bits", [32, 64])
def test_an_exact_jacobian_of_a_cancellation_passes_at_the_default_settings(bits):
    x = np.arange(1.0, 2.3, 0.25)  # [1, 1.25, ..., 2.25]: y = 0, its terms about 2
    with jax.enable_x64(bits == 64):
        dtype = np.float32 if bits == 32 else np.float64
        for model in (lambda x: {"y": x[:-2] - 2 * x[1:-1] + x[2:]},
                      lambda x: {"y": Stencil()(x)}):
            problem = distop.Problem(model, {"x": x.astype(dtype)})
            r = problem.check_totals(out_stream=None)["y", "x"]
            assert r.ok, (r.abs_error, r.allowed)
            # at a step the rounding does not swamp, the allowance is small
            r = problem.check_totals(out_stream=None, step=1e-2 if bits == 32 else 1e-6)
            assert r["y", "x"].ok and r["y", "x"].allowed < 1e-3
        for middle, step in [(2.0, 1e-6), (-1.98, 1e-2 if bits == 32 else 1e-6)]:
            wrong = distop.Problem(lambda x: {"y": Stencil(middle)(x)},  # noqa: B023
                                   {"x": x.astype(dtype)})
            r = wrong.check_totals(out_stream=None, step=step)["y", "x"]
            assert not r.ok, (middle, step, r.abs_error, r.allowed)


class Slow(distop.DistributedOperator):
    """x ** 2, each call slowed by `pause` seconds (a long check)."""

    pause = 0.05

    def forward(self, comm, x):
        time.sleep(self.pause)
        return x ** 2

    def vjp(self, comm, y_bar, x):
        time.sleep(self.pause)
        return 2 * x * y_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_long_check_totals_shows_its_progress(monkeypatch):
    from distop._diagnostics import progress as _progress

    monkeypatch.setattr(_progress, "AFTER", 0.0)  # (as if the check had run long)
    monkeypatch.setattr(_progress, "EVERY", 0.05)
    monkeypatch.setattr(_progress, "TICK", 0.05)
    problem = distop.Problem(lambda x: {"y": jnp.sum(Slow()(x))}, {"x": np.arange(3.0)})
    out = io.StringIO()
    assert all(r.ok for r in problem.check_totals(out_stream=out).values())
    lines = out.getvalue().splitlines()
    steps = [line for line in lines if line.startswith("check_totals: step ")]
    assert steps and all(re.fullmatch(r"check_totals: step [1-4] of 4, .*; \d+ s so far", s)
                         for s in steps), lines
    assert any("evaluating 12 perturbed points" in s for s in steps), steps
    assert "J_fd" in out.getvalue()  # (the table, after the progress)

    bar = Terminal()
    problem.check_totals(out_stream=bar)
    shown = bar.getvalue()
    assert "\rcheck_totals [" in shown and "] 4/4 " in shown, shown  # (finished)
    assert "\n" not in shown.split("J_fd")[0].split("\r")[1], shown  # (one line, redrawn)

    quiet = io.StringIO()
    problem.check_totals(out_stream=quiet, progress=False)
    assert "check_totals: step" not in quiet.getvalue() and "J_fd" in quiet.getvalue()


def test_short_work_shows_no_progress():
    problem = distop.Problem(lambda x: {"z": jnp.sum(x ** 2)}, {"x": np.arange(3.0)})
    out = Terminal()
    problem.check_totals(out_stream=out)
    assert "check_totals [" not in out.getvalue() and "step" not in out.getvalue()
