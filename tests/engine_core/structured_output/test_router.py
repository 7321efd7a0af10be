"""The backend router (``router.BackendRouter``): while one backend is built, a step's advance
and fill go straight to it, with the same result as the backend's own calls; once a second
is built, each matcher goes to its own backend again."""

from __future__ import annotations

import importlib.util

import numpy as np

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.sampling_params import StructuredOutputsParams
from tidal.engine_core.structured_output.router import BackendRouter


def test_one_backend_goes_straight_and_two_are_sorted_out(tiny_smol_path):
    model = EngineArgs(model=str(tiny_smol_path), device="cpu").create_config().model
    router = BackendRouter(model, "auto")
    guidance = router.backend("guidance")
    assert router._only is guidance
    spec = StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]{1,3}")
    template = guidance.compile(spec)
    ours = [template.deep_copy() for _ in range(3)]
    theirs = [template.deep_copy() for _ in range(3)]
    digit = model.vocab_size  # the first token the grammar takes twice in a row (a digit)
    for i in range(model.vocab_size):
        if template.validate_tokens([i, i]) == 2:
            digit = i
            break
    assert digit < model.vocab_size
    assert router.advance([(m, digit) for m in ours]) == guidance.advance(
        [(m, digit) for m in theirs]) == [True] * 3
    assert router.advance([(ours[0], digit)]) == [True]  # one matcher: its own call
    assert guidance.advance([(theirs[0], digit)]) == [True]
    words = (model.vocab_size + 31) // 32
    got, want = np.zeros((3, words), np.int32), np.zeros((3, words), np.int32)
    router.fill(ours, got)
    guidance.fill(theirs, want)
    assert (got == want).all() and got.any()

    if importlib.util.find_spec("xgrammar") is None:
        print("xgrammar is not installed: the two-backend half is not run")
        return
    xgr = router.backend("xgrammar")
    assert router._only is None
    other = xgr.compile(spec)
    mixed = [ours[0], other, ours[1]]
    out = np.zeros((3, words), np.int32)
    router.fill(mixed, out)
    alone = np.zeros((1, words), np.int32)
    xgr.fill([other], alone)
    assert (out[1] == alone[0]).all() and (out[0] == got[0]).all()
