"""``triton_decode.launch``: a launch with programmatic dependent launch (PDL) that fails where
the plain launch works turns PDL off for the process; a kernel that fails either way raises its
own error and leaves PDL on for the others. Fake kernels stand in for Triton's (no GPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs triton: triton_decode imports it")

from tidal.worker.ops import triton_decode  # noqa: E402


class _Kernel:
    """``kernel[grid](*args, **kwargs)``, recording each launch's PDL flags."""

    def __init__(self, fail_pdl: bool, fail_plain: bool) -> None:
        self.fail_pdl, self.fail_plain = fail_pdl, fail_plain
        self.launches: list[tuple[bool, bool]] = []
        self.triggers: list[bool] = []

    def __getitem__(self, grid):
        def run(*args, PDL: bool, launch_pdl: bool = False, **kwargs):
            self.launches.append((PDL, launch_pdl))
            self.triggers.append(kwargs.get("TRIGGER", False))
            # (A compiler without griddepcontrol fails on the wait and on the trigger alike.)
            if (PDL or kwargs.get("TRIGGER")) and self.fail_pdl:
                raise RuntimeError("griddepcontrol is not supported")
            if self.fail_plain:
                raise ValueError("bad argument")
        return run


@pytest.fixture(autouse=True)
def _pdl_on(monkeypatch):
    monkeypatch.setattr(triton_decode, "_PDL", True)


def test_pdl_launch_that_works_keeps_pdl():
    k = _Kernel(fail_pdl=False, fail_plain=False)
    triton_decode.launch(k, (1,), (), {}, True)
    assert k.launches == [(True, True)] and triton_decode._PDL


def test_pdl_unsupported_falls_back_and_turns_pdl_off(caplog):
    k = _Kernel(fail_pdl=True, fail_plain=False)
    triton_decode.launch(k, (1,), (), {}, True)
    assert k.launches == [(True, True), (False, False)]
    assert triton_decode._PDL is False
    assert "programmatic dependent launch failed" in caplog.text


def test_a_kernel_error_is_raised_and_pdl_stays_on():
    k = _Kernel(fail_pdl=True, fail_plain=True)
    with pytest.raises(ValueError, match="bad argument"):
        triton_decode.launch(k, (1,), (), {}, True)
    assert triton_decode._PDL is True
    plain = _Kernel(fail_pdl=False, fail_plain=True)
    with pytest.raises(ValueError):
        triton_decode.launch(plain, (1,), (), {}, False)
    assert plain.launches == [(False, False)] and triton_decode._PDL is True


def test_the_fallback_also_drops_the_trigger_of_dependents():
    """A kernel that lets its dependent launch early (``TRIGGER``) compiles griddepcontrol too:
    the plain launch goes without it, so an unsupported PDL still falls back."""
    k = _Kernel(fail_pdl=True, fail_plain=False)
    triton_decode.launch(k, (1,), (), {"TRIGGER": True}, True)
    assert k.launches == [(True, True), (False, False)] and k.triggers == [True, False]
    assert triton_decode._PDL is False


def test_the_kernel_error_keeps_the_pdl_error_as_its_cause():
    k = _Kernel(fail_pdl=True, fail_plain=True)
    with pytest.raises(ValueError) as info:
        triton_decode.launch(k, (1,), (), {}, True)
    assert isinstance(info.value.__cause__, RuntimeError)
