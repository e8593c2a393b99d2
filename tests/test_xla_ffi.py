"""The mirror of XLA's FFI C API against the running jaxlib, and the check at registration."""

import itertools

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from helpers import Cube

import distop
from distop._hostcalls import ffi as _ffi
from distop._hostcalls import xla_ffi as _xla_ffi

_names = (f"distop_test_target_{i}" for i in itertools.count())


def _cube_problem(backend):
    return distop.Problem(lambda x: {"f": jnp.sum(Cube()(x))}, {"x": np.arange(3.0)},
                          backend=backend)


def _fitting_report(**sizes):
    return _xla_ffi.Report((_xla_ffi.MAJOR, _xla_ffi.MINOR), {**_xla_ffi.SIZES, **sizes})


def test_the_mirror_fits_what_the_running_jaxlib_reports():
    found = _ffi._register_target(next(_names))  # a target of its own: a fresh query
    assert _xla_ffi.incompatibility(found) is None
    assert set(found.sizes) == set(_xla_ffi.SIZES)
    if found.version == (_xla_ffi.MAJOR, _xla_ffi.MINOR):
        # The version the mirror was written against: every struct is the mirror's size,
        # except the API table, of which the mirror holds a prefix.
        sizes = {**found.sizes, "XLA_FFI_Api": _xla_ffi.SIZES["XLA_FFI_Api"]}
        assert sizes == _xla_ffi.SIZES
    before = set(_ffi._sites)
    problem = _cube_problem("lean")  # (its call sites live as long as it does)
    assert problem.run()["f"] == 9.0
    assert set(_ffi._sites) - before  # (the program ran its host call on the lean path)


@pytest.mark.parametrize("ours", [(1, 0), (0, 99)], ids=["major", "minor"])
def test_an_api_version_other_than_the_mirrors_is_a_clear_error(monkeypatch, ours):
    found = _ffi._register_target(next(_names))
    monkeypatch.setattr(_xla_ffi, "MAJOR", found.version[0] + ours[0])
    monkeypatch.setattr(_xla_ffi, "MINOR", ours[1])
    monkeypatch.setattr(_ffi, "_registered", False)  # (registers again as if first)
    with pytest.raises(distop.DistopError) as caught:
        _cube_problem("lean").run()
    text = str(caught.value)
    assert f"version {_xla_ffi.MAJOR}.{_xla_ffi.MINOR}" in text
    assert f"jaxlib {jaxlib.__version__} has version {found.version[0]}.{found.version[1]}" \
        in text
    assert "lean path is unavailable" in text
    assert "Problem(..., backend='io_callback')" in text and "DISTOP_BACKEND=io_callback" in text
    assert not _ffi._registered
    # The process goes on, and the named fallback works.
    assert _cube_problem("io_callback").run()["f"] == 9.0


@pytest.mark.parametrize(("name", "change"), [("XLA_FFI_Args", 8), ("XLA_FFI_Attrs", -8),
                                              ("XLA_FFI_CallFrame", 8)])
def test_a_struct_size_that_does_not_fit_is_a_clear_error(monkeypatch, name, change):
    ours = _xla_ffi.SIZES[name] + change
    monkeypatch.setitem(_xla_ffi.SIZES, name, ours)
    monkeypatch.setattr(_ffi, "_registered", False)
    with pytest.raises(distop.DistopError,
                       match=f"its {name} is [0-9]+ bytes, [^.]*the mirror's (is )?{ours}") \
            as caught:
        _cube_problem("lean").run()
    text = str(caught.value)
    assert f"version {_xla_ffi.MAJOR}.{_xla_ffi.MINOR}" in text
    assert "backend='io_callback'" in text and "DISTOP_BACKEND=io_callback" in text
    assert _cube_problem("io_callback").run()["f"] == 9.0


def test_a_registration_without_the_metadata_query_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *args, **kwargs: None)
    with pytest.raises(distop.DistopError, match="without querying its metadata.*"
                                                 "backend='io_callback'"):
        _ffi._register_target(next(_names))


def test_the_rule_takes_newer_minor_versions_and_appended_fields():
    newer = _xla_ffi.Report((_xla_ffi.MAJOR, _xla_ffi.MINOR + 1),
                            {**_xla_ffi.SIZES, "XLA_FFI_CallFrame": 200,
                             "XLA_FFI_Api": 400})
    assert _xla_ffi.incompatibility(newer) is None
    assert _xla_ffi.incompatibility(_fitting_report()) is None
    for embedded in _xla_ffi.EMBEDDED:  # held by value: a larger one moves what follows
        grown = _fitting_report(**{embedded: _xla_ffi.SIZES[embedded] + 8})
        assert f"its {embedded} is" in _xla_ffi.incompatibility(grown)
    older = _xla_ffi.Report((_xla_ffi.MAJOR, _xla_ffi.MINOR - 1), {})
    assert "minor version" in _xla_ffi.incompatibility(older)
    assert "too small" in _xla_ffi.incompatibility(_xla_ffi.Report(None, {
        "XLA_FFI_CallFrame": 8}))
