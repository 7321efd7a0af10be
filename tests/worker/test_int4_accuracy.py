"""INT4 (AWQ / GPTQ) accuracy on the real SmolLM2-135M (CPU, float32 activations): the model
quantized here by plain round-to-nearest into an AWQ and a GPTQ checkpoint (groups of 128,
``int4_writer``), perplexity of the committed public-domain text through the engine's prompt
logprobs against the unquantized model's. The perplexity helper is ``test_fp8_accuracy``'s.

Issue 23 asks for 5 %; this model falls short of it, measured: 16.30 unquantized, AWQ g128
20.34 (+24.8 %), GPTQ g128 20.34 too (the same rounded values in the other layout); groups
of 32 give 19.45 (+19 %), and an MSE search of each group's clipping range did not help
(20.50). The source weights are the GGUF's Q4_1 (already 4-bit, with a free per-block minimum
that an integer zero point cannot represent), so round-to-nearest requantizes already rounded
values onto a misaligned grid, and a 135M model has little redundancy. Calibration does not
close it either: GPTQ on ~1k tokens of other public-domain text gives +29 % at g128 (+23 %
with act-order) and +14 % at g32 with act-order, and every projection kind loses 1.4-6.9 % on
its own (tools/quant_accuracy_study.py int4, tools/results/quant_accuracy_int4_smollm2_cpu.json).
This text flatters INT4: on tests/data/calibration_public_domain.txt round-to-nearest loses
56-76 % (groups of 32-128).
The bound is the measured gap with some margin: it catches weights scrambled by a wrong layout
or group mapping, not the last few percent. The engine's exactness on these formats is shown
by test_int4_model.py (tokens equal to HF transformers on the dequantized weights)."""

from __future__ import annotations

import json

import pytest

from tests.worker.int4_writer import write_int4_checkpoint
from perplexity import perplexity
from tidal.frontend import LLM


@pytest.fixture(scope="module")
def smollm2_hf_folder(smollm2_path, smollm2_tokenizer, tmp_path_factory):
    """SmolLM2 as an HF folder (config.json and tokenizer; no weights) and its weights, the
    GGUF's dequantized to float32 by tidal's GGUF reader."""
    from tidal.engine_core.gguf_config import gguf_to_hf_config
    from tidal.worker.loader.gguf_weights import iter_gguf_weights

    folder = tmp_path_factory.mktemp("smollm2-hf")
    cfg = {k: v for k, v in gguf_to_hf_config(smollm2_path).items() if not k.startswith("_")}
    (folder / "config.json").write_text(json.dumps(cfg))
    smollm2_tokenizer.save_pretrained(folder)
    return folder, dict(iter_gguf_weights(smollm2_path))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_perplexity_close_to_unquantized(smollm2_perplexity, smollm2_hf_folder, tmp_path,
                                              method):
    folder, weights = smollm2_hf_folder
    dst = tmp_path / method
    # 576 hidden features: four groups of 128 and one of 64.
    write_int4_checkpoint(folder, dst, weights, method, group_size=128, dequantize=False)
    base = smollm2_perplexity  # the unquantized SmolLM2 (float32 on a CPU)
    # (A small KV cache and batch: one prompt of ~460 tokens, and a cheaper warm-up.)
    llm = LLM(str(dst), dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=1,
              num_kv_blocks=72, max_num_batched_tokens=1024)
    try:
        quant, _ = perplexity(llm)
    finally:
        llm.shutdown()
    print(f"SmolLM2 perplexity: unquantized {base:.3f}, {method} INT4 g128 RTN {quant:.3f} "
          f"({(quant - base) / base:+.2%})")
    assert quant != base  # the weights really were quantized
    assert abs(quant - base) / base < 0.30, (quant, base)
