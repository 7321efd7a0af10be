"""Speculative decoding against plain decoding, both in the same run: output tokens/s, the speedup,
and the mean acceptance length, per batch size.

    python tools/bench_spec.py                                  # SmolLM2 (CPU or GPU), n-gram
    python tools/bench_spec.py --batches 1,8,64,256 --k 4 --out spec.json
    python tools/bench_spec.py --shape llama-3.1-8b --method synthetic --alpha 0.8 --k 3
    python tools/bench_spec.py --smoke                          # tiny random model, seconds
    python tools/bench_spec.py --shape llama-3.1-8b --method draft_model --draft-shape llama-3.2-1b
    python tools/bench_spec.py --shape llama-3.1-8b --method eagle3 \
        --draft-shape eagle3-llama-3.1-8b --k 3 --batches 1,8,32
    python tools/bench_spec.py --model meta-llama/Llama-3.1-8B-Instruct --method eagle3 \
        --draft-model yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --workload edit
    python tools/bench_spec.py --smoke --method draft_model     # (or eagle3) on a CPU
    python tools/bench_spec.py --shape deepseek-v3-lite-mtp --method mtp --k 1 --batches 1,8,32
    python tools/bench_spec.py --smoke --method mtp             # tiny DeepSeek-V3 + MTP, CPU

Workloads (``--workload``): ``edit`` asks the model to rewrite a source file of this repository
with a small change (prompt lookup finds most of the answer in the prompt: issue 21's n-gram
workload); ``repeat`` is a prompt of a repeated token pattern (what random-weight models need for
the n-gram lookup to find drafts, e.g. with ``--method synthetic``).

Methods: ``ngram`` verifies with standard rejection sampling (greedy here, so the output is the
plain run's; the tool checks that); ``synthetic`` accepts each draft with probability
``--alpha`` whatever the model says (vLLM's benchmarking mode: the output is not the model's), to
measure the speed envelope of a given acceptance rate. ``draft_model`` drafts with a smaller
model of the target's vocabulary, ``eagle3`` with an EAGLE-3 head: ``--draft-model`` (a
checkpoint) or ``--draft-shape`` (random weights of a published shape, with a ``--shape`` target:
a dummy draft's drafts are rarely accepted, so these measure the drafting and verify costs; a
real head and target measure the speedup). ``mtp`` drafts with the target's own
multi-token-prediction layer (a DeepSeek-V3-shaped target: ``--shape deepseek-v3-lite-mtp``
with dummy weights, or a real checkpoint with ``--model``); ``--synthetic-alpha`` applies to it
too.

Both sides run in their own engine, side by side: one warm-up pass each, then ``--repeats``
timed passes of ``B`` requests of ``--max-tokens`` tokens, the two sides' passes interleaved;
tokens/s = output tokens / wall time of a pass (median).
The mean acceptance length counts the target's own token of each verify step (vLLM's
convention): 1 + accepted drafts / drafts.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))

logger = logging.getLogger("bench_spec")

EDIT_SOURCE = REPO / "engine_core" / "request.py"


def edit_prompt(lines: int) -> str:
    code = "\n".join(EDIT_SOURCE.read_text().splitlines()[:lines])
    return ("Here is a Python file:\n\n```python\n" + code + "\n```\n\nRewrite the whole file "
            "with the method `check_stop` renamed to `should_stop`; change nothing else.\n\n"
            "```python\n")


def repeat_prompt_ids(vocab: int, n: int = 64) -> list[int]:
    pattern = [(7 * i + 3) % min(vocab, 500) + 1 for i in range(9)]
    return (pattern * (n // len(pattern) + 1))[:n]


# Draft shapes for dummy drafts (HF configs of the released checkpoints).
DRAFT_SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B: Llama-3.1-8B's tokenizer, a draft model for it.
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 128001,
        "bos_token_id": 128000, "hidden_act": "silu",
    },
    # The EAGLE-3 head of Llama-3.1-8B-Instruct (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B).
    "eagle3-llama-3.1-8b": {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "vocab_size": 128256, "draft_vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    },
    # For --smoke: the tiny Llama's vocabulary and width (384, 64).
    "tiny-draft": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 384,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "hidden_act": "silu",
    },
    "tiny-eagle3": {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "vocab_size": 384,
        "draft_vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    },
}


def spec_config(args: argparse.Namespace) -> dict[str, Any]:
    # The envelope at every batch and acceptance, unless --off-switch: the off-switch would
    # measure plain decoding where speculation does not pay.
    off = {} if args.off_switch else {"disable_by_batch_size": None,
                                      "disable_by_acceptance": False}
    if args.method in ("draft_model", "eagle3", "mtp"):
        cfg = {"method": args.method, "num_speculative_tokens": args.k, **off}
        if args.method != "mtp":  # (mtp's layer is in the target's checkpoint)
            cfg["model"] = args.draft_path
        if args.synthetic_alpha is not None:  # every chain drafts k: the envelope
            cfg.update(rejection_sample_method="synthetic",
                       synthetic_acceptance_rate=args.synthetic_alpha)
        return cfg
    cfg: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": args.k,
                           "prompt_lookup_min": args.lookup_min,
                           "prompt_lookup_max": args.lookup_max, **off}
    if args.method == "synthetic":
        cfg.update(rejection_sample_method="synthetic", synthetic_acceptance_rate=args.alpha)
    return cfg


class Side:
    """One engine (plain or speculative) and what its passes measured."""

    def __init__(self, model: str, engine_kw: dict[str, Any]) -> None:
        from tidal.frontend import LLM

        self.llm = LLM(model, **engine_kw)
        self.counts = [0, 0]  # drafts, accepted
        core = self.llm.engine.core
        record = core.stats_logger.record

        def counting(stats, *a):
            self.counts[0] += stats.spec_num_drafts
            self.counts[1] += stats.spec_num_accepted_tokens
            return record(stats, *a)

        core.stats_logger.record = counting
        self.rates: list[float] = []
        self.outputs: list[list[int]] | None = None

    def run(self, prompts: list[Any], params: Any) -> None:
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        self.rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
        self.outputs = [o.outputs[0].token_ids for o in outs]

    def report(self) -> dict[str, Any]:
        drafts, accepted = self.counts
        return {"tokens_per_s": statistics.median(self.rates), "runs_tokens_per_s": self.rates,
                "mean_acceptance_length": (1 + accepted / drafts) if drafts else None,
                "drafts": drafts, "accepted": accepted}


def run_batch(model: str, engine_kw: dict[str, Any], spec_kw: dict[str, Any],
              prompts: list[Any], batch: int, max_tokens: int, repeats: int,
              ignore_eos: bool, sequential: bool = False
              ) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Both engines side by side, their timed passes interleaved (a busy machine slows both
    alike rather than one side's passes); ``sequential``: one engine after the other (two
    8B-sized engines with batch-256 graphs do not fit one GPU together)."""
    from tidal.engine_core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    kws = [engine_kw, {**engine_kw, **spec_kw}]

    def warm(side: Side) -> None:
        side.llm.generate(batch_prompts[:2], SamplingParams(max_tokens=8, temperature=0.0),
                          use_tqdm=False)
        side.counts[:] = [0, 0]

    sides: list[Side] = []
    if sequential:
        import gc

        for kw in kws:
            side = Side(model, kw)
            try:
                warm(side)
                for _ in range(repeats):
                    side.run(batch_prompts, params)
            finally:
                side.llm.shutdown()
            side.llm = None  # type: ignore[assignment]
            sides.append(side)
            gc.collect()
            _empty_cuda_cache()
    else:
        sides = [Side(model, kw) for kw in kws]
        try:
            for side in sides:
                warm(side)
            for _ in range(repeats):
                for side in sides:
                    side.run(batch_prompts, params)
        finally:
            for side in sides:
                side.llm.shutdown()
    plain, spec = sides
    return plain.report(), spec.report(), plain.outputs == spec.outputs


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path; default: the bundled SmolLM2")
    p.add_argument("--shape", default=None, help="bench_common shape with dummy weights")
    p.add_argument("--smoke", action="store_true",
                   help="tiny random Llama (mtp: a tiny dummy DeepSeek-V3), CPU-sized run")
    p.add_argument("--workload", choices=("edit", "repeat"), default=None,
                   help="default: edit for a real model, repeat for dummy/tiny ones")
    p.add_argument("--method", choices=("ngram", "synthetic", "draft_model", "eagle3", "mtp"),
                   default="ngram")
    p.add_argument("--draft-model", default=None,
                   help="draft_model / eagle3: the draft's (head's) checkpoint or hub id")
    p.add_argument("--draft-shape", choices=sorted(DRAFT_SHAPES), default=None,
                   help="draft_model / eagle3: a dummy draft of this shape (random weights: "
                        "needs a dummy target, --shape or --smoke)")
    p.add_argument("--alpha", type=float, default=0.8, help="synthetic acceptance rate")
    p.add_argument("--synthetic-alpha", type=float, default=None,
                   help="draft_model / eagle3 / mtp: accept each draft with this probability "
                        "(vLLM's synthetic mode) instead of verifying")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=5)
    p.add_argument("--batches", default="1", help="comma-separated batch sizes, e.g. 1,8,64,256")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--edit-lines", type=int, default=40, help="source lines in the edit prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-gib", type=int, default=None,
                   help="KV cache of each side, GiB; default: 16 on a GPU, 2 on a CPU")
    p.add_argument("--engine-args", default="{}", help="JSON of extra engine arguments")
    p.add_argument("--off-switch", action="store_true",
                   help="keep the automatic off-switch's defaults (by batch size and measured "
                        "acceptance) instead of speculating at every step")
    p.add_argument("--sequential", action="store_true",
                   help="run the plain engine, then the speculative one (not side by side): "
                        "for shapes whose two engines do not fit the GPU together")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import reference

    engine_kw: dict[str, Any] = json.loads(args.engine_args)
    tmp = Path(tempfile.mkdtemp(prefix="tidal-bench-spec-"))
    if args.smoke and args.method == "mtp":  # a target with an MTP layer, dummy weights
        args.shape = "tiny-deepseek-v3-mtp"
    if args.smoke and args.method != "mtp":
        model = str(tmp / "tiny")
        reference.make_tiny_model("llama", Path(model))
        engine_kw.setdefault("skip_tokenizer_init", True)
        workload, max_tokens = args.workload or "repeat", args.max_tokens or 32
    elif args.shape:
        from bench_common import write_model_dir

        model = write_model_dir(args.shape, tmp)
        engine_kw.setdefault("load_format", "dummy")
        engine_kw.setdefault("max_model_len", 2048)  # a whole context need not fit the pool
        engine_kw.setdefault("skip_tokenizer_init", True)
        workload, max_tokens = args.workload or "repeat", args.max_tokens or 128
    else:
        path = args.model or reference.smollm2_gguf()
        if path is None:
            p.error("no --model and SmolLM2 is not installed")
        model = str(path)
        workload, max_tokens = args.workload or "edit", args.max_tokens or 160
    args.draft_path = None
    if args.method in ("draft_model", "eagle3"):
        if args.draft_model:
            args.draft_path = args.draft_model
        elif args.draft_shape or args.smoke:
            shape = args.draft_shape or ("tiny-draft" if args.method == "draft_model"
                                         else "tiny-eagle3")
            folder = tmp / "draft"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(DRAFT_SHAPES[shape]))
            args.draft_path = str(folder)
            # (A dummy draft means dummy weights for the target too: one load_format.)
            engine_kw["load_format"] = "dummy"
        else:
            p.error(f"--method {args.method} needs --draft-model or --draft-shape")
    batches = [int(b) for b in args.batches.split(",")]
    engine_kw.setdefault("max_num_seqs", max(batches))
    # Two engines live side by side in this process: each gets a fixed KV pool, not a share of
    # the GPU measured while the other one holds its own.
    if args.kv_gib is None:
        import torch

        args.kv_gib = 16 if torch.cuda.is_available() else 2
    engine_kw.setdefault("kv_cache_memory_bytes", args.kv_gib << 30)
    if workload == "edit":
        if engine_kw.get("skip_tokenizer_init"):
            p.error("the edit workload needs the model's tokenizer")
        prompts: list[Any] = [edit_prompt(args.edit_lines)]
        ignore_eos = False
    else:
        from tidal.engine_core.config import EngineArgs

        vocab = EngineArgs(model=model, **{k: v for k, v in engine_kw.items()
                                           if k != "skip_tokenizer_init"}
                           ).create_config().model.vocab_size
        prompts = [{"prompt_token_ids": repeat_prompt_ids(vocab)}]
        ignore_eos = True

    results: dict[str, Any] = {"model": model, "workload": workload, "method": args.method,
                               "speculative_config": spec_config(args),
                               "max_tokens": max_tokens, "batches": {}}
    for batch in batches:
        plain, spec, same = run_batch(model, engine_kw,
                                      {"speculative_config": spec_config(args)}, prompts,
                                      batch, max_tokens, args.repeats, ignore_eos,
                                      args.sequential)
        row = {"plain": plain, "spec": spec,
               "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
               "greedy_output_identical": same}
        if args.method != "synthetic" and args.synthetic_alpha is None and not same:
            logger.warning("batch %d: speculative output differs from the plain run", batch)
        results["batches"][batch] = row
        print(f"batch {batch:4d}: plain {plain['tokens_per_s']:9.1f} tok/s, spec "
              f"{spec['tokens_per_s']:9.1f} tok/s, speedup {row['speedup']:.2f}x, mean "
              f"acceptance length {spec['mean_acceptance_length'] or 0:.2f}, identical "
              f"{same}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
