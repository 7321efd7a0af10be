"""``engine-core``: run an EngineCore alone, for frontends to connect to by address.

    engine-core --model PATH --listen tcp://127.0.0.1:5555 [engine flags]
    engine-core --model PATH --listen 5555          # the same
    engine-core --model PATH                        # ipc:// in a fresh temporary directory
    engine-core --model PATH --log-level warning    # quieter (or TIDAL_LOG_LEVEL=WARNING)

Frontends connect with ``AsyncLLM.from_address(ADDRESS)``; several may share one engine. TCP
binds loopback unless the address names another host (``tcp://*:5555`` binds every interface:
there is no authentication, so only do that on a trusted network). The log shows each start-up
phase with its duration, then ``EngineCore serving at ADDRESS``. SIGTERM or Ctrl-C shut down
gracefully (connected frontends are told); the exit code is 0 then, 1 if the engine failed.

The engine flags are ``EngineArgs``' fields, spelled ``--field-name`` (``add_engine_args``
builds them, so other command lines can reuse it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.envs import log_level

logger = logging.getLogger("tidal.engine_core.cli")

# One line per EngineArgs field: what it does, its unit, and, where the default is decided at
# start-up (None), what decides it (the formatter appends fixed defaults itself).
_HELP = {
    "model": "an HF model folder (config.json + *.safetensors) or a .gguf file; default: the "
             "bundled SmolLM2-135M-Instruct",
    "tokenizer": "tokenizer folder or .gguf file; default: the model's own",
    "served_model_name": "the name the API reports (/v1/models) and accepts in requests; "
                         "default: the model's own name from its config, else its folder or "
                         "file name",
    "load_format": "where weights come from: auto (by the model's files), safetensors, gguf, "
                   "or dummy (random weights of the config's shapes)",
    "dtype": "weight and activation type: auto, float32, float16 or bfloat16 (fp32, fp16, "
             "half, bf16 too); auto is float32 on a CPU, else the checkpoint's 16-bit type",
    "task": "auto, generate or embed; auto picks embed for an embedding model",
    "seed": "seed of the worker's random generator (dummy weights; sampling without a "
            "per-request seed)",
    "max_model_len": "longest sequence, prompt plus output, in tokens; default: the model's "
                     "context length (max_position_embeddings)",
    "block_size": "tokens per KV cache block (a power of two, at most 256)",
    "gpu_memory_utilization": "fraction (0-1] of the GPU's memory the engine may use for "
                              "weights, activations and the KV cache",
    "kv_cache_memory_bytes": "bytes of KV cache, instead of what --gpu-memory-utilization "
                             "leaves; default: measured at start-up",
    "num_kv_blocks": "number of KV cache blocks, instead of measuring; default: measured at "
                     "start-up",
    "quantization": "weight quantization: fp8 (FP8 e4m3 weights with per-channel scales, "
                    "quantized as a 16/32-bit checkpoint loads; per-token activation scales) "
                    "or compressed-tensors (an FP8 checkpoint, also detected from its "
                    "config.json); awq or gptq (INT4 weight-only checkpoints, read as they "
                    "are, also detected from config.json); dense Llama/Mistral/Qwen2/Qwen3 "
                    "only; default: none",
    "fp8_group_size": "with --quantization fp8 on a 16/32-bit checkpoint: quantize each weight "
                      "row in groups of this many input channels (a power of two from 16 to "
                      "1024; 128 is usual) and activations per token and group, through the "
                      "block-wise FP8 kernels; closer to the 16-bit model than one scale per "
                      "row; default: one scale per row",
    "kv_cache_dtype": "KV cache type: auto (the model dtype) or fp8 / fp8_e4m3 (FP8 e4m3 "
                      "with per-layer K/V scales from the checkpoint, else 1.0; twice the "
                      "cached tokens); not with MLA models, encoders, draft models or the "
                      "cuda attention backend",
    "enable_prefix_caching": "reuse the KV cache of prompt prefixes shared between requests",
    "disable_hybrid_kv_cache_manager": "keep every layer's KV cache whole, sliding-window "
                                       "layers too (one KV group, as before the hybrid KV "
                                       "cache manager)",
    "prefix_hash_seed": "integer seed of the prefix-cache block hashes; default: random per "
                        "process",
    "max_num_seqs": "most sequences in one step; default: 512 on a GPU, 64 on a CPU",
    "max_num_batched_tokens": "token budget of one step; default: 8192 on a GPU, 2048 on a "
                              "CPU (chunked prefill), at least max-model-len without it",
    "enable_chunked_prefill": "split long prompts over several steps (generation models)",
    "async_scheduling": "schedule step N+1 while step N runs; default: on for generation on a "
                        "GPU with one pipeline stage, else off",
    "max_queued_requests": "most requests waiting beyond the running batch; more get 429; "
                           "default: no limit",
    "structured_outputs_backend": "grammar backend of structured outputs (response_format, "
                                  "guided_*): auto (llguidance, xgrammar for structural tags in "
                                  "xgrammar's format form), guidance or xgrammar",
    "reasoning_parser": "the model's reasoning format: qwen3, deepseek_r1 or gpt_oss; the "
                        "server splits chat outputs into reasoning_content and content, and "
                        "the engine applies a request's grammar only after the thinking and "
                        "enforces thinking_token_budget (default: none, the output is all "
                        "content)",
    "tensor_parallel_size": "worker processes (GPUs) every layer is sharded across",
    "pipeline_parallel_size": "pipeline stages (worker processes) the layers are split into",
    "data_parallel_size": "whole engines (EngineCore processes, each with its own scheduler, "
                          "KV cache and TP x PP workers) that `tidal serve` runs side by side; "
                          "each request goes to the least loaded (README: Several GPUs or "
                          "processes)",
    "data_parallel_lockstep": "data-parallel ranks step together: each step they agree (one "
                              "small gloo all-reduce) whether any has work, a rank without "
                              "any runs an empty step meanwhile, and all go idle together "
                              "(the stepping expert parallelism needs)",
    "enable_expert_parallel": "split each MoE layer's experts over the DP x TP workers (each "
                              "holds E / (DP x TP) whole experts; attention stays TP inside "
                              "each DP engine); across DP engines it steps them in lockstep, "
                              "decode steps replaying CUDA graphs the engines agree on",
    "enable_dbo": "dual batch overlap (with --enable-expert-parallel across DP engines): a "
                  "step's MoE exchange runs as two micro-batches, one's gather or reduce-"
                  "scatter in flight while the other's experts compute (attention is not "
                  "split); it pays only where the exchange is slow: on two H200s over NVLink "
                  "it measured 0.60x at decode and 0.90x on prefill steps, hence off by "
                  "default; without --dbo-token-threshold the engines measure at start-up "
                  "from which step size it pays, if any",
    "dbo_token_threshold": "--enable-dbo applies to steps of at least this many tokens over "
                           "all engines (default: measured at start-up, the smallest step "
                           "size from which the overlap made a MoE layer at least 1.05x "
                           "faster at every larger size, or none; only with --enable-dbo)",
    "all2all_backend": "how the experts' tokens move between engines with "
                       "--enable-expert-parallel and --data-parallel-size > 1: "
                       "allgather_reducescatter (every engine's tokens to every worker, its "
                       "partial sums back by reduce-scatter; decode steps in CUDA graphs) or "
                       "alltoallv (each token only to the engines holding one of its experts, "
                       "partial sums back by all-to-all; eager steps only, the decode graphs "
                       "keep the gather; not yet measured on GPUs)",
    "distributed_executor_backend": "how workers run: uni (in the engine process), mp (local "
                                    "processes), ray, or noop (no model: overhead benchmarks); "
                                    "default: uni for one worker, mp for several",
    "cpu_collectives": "how CPU workers' tensor/pipeline groups communicate: shm (one shared-"
                       "memory segment per group; CPU workers of the mp executor) or gloo "
                       "(TCP loopback); auto picks shm where it applies, else gloo",
    "device": "auto, cpu or cuda; auto picks cuda when torch sees a GPU",
    "attention_backend": "torch, triton or cuda; default: the best available on the device",
    "ops_backend": "fused ops (norms, rotary, SiLU) on a GPU: auto, torch, triton or cuda; "
                   "default: --kernel-config's ops, else auto (the CUDA extension if it builds, "
                   "else Triton, else torch)",
    "kernel_config": "JSON object of kernel choices (README: Kernel policy), e.g. "
                     "'{\"gemv\": false, \"pdl\": false}'; flags win over it, it over the "
                     "TIDAL_* variables; default: none",
    "enforce_eager": "never capture CUDA graphs (always so on a CPU)",
    "max_mixed_cudagraph_tokens": "steps that mix prompt tokens into the decodes replay CUDA "
                                  "graphs up to this many tokens (padded to a captured size); "
                                  "0 runs them eagerly; default: 2048, at most "
                                  "max-num-batched-tokens",
    "max_logprobs": "most logprobs / top_logprobs a request may ask for",
    "disable_log_stats": "no periodic stats line from the engine (and, under serve, no stat "
                         "logger plugins)",
    "cpu_threads": "torch threads of a CPU worker; default: torch's own choice",
    "logits_processors": "global logits processors applied to every request: comma-separated "
                         "entry-point names (group tidal.logits_processors) or "
                         "package.module:Class import strings; default: none",
    "hf_overrides": "JSON object merged into the model's HF config before anything reads it, "
                    "e.g. '{\"num_hidden_layers\": 2}'; default: none",
    "speculative_config": "speculative decoding as a JSON object in vLLM's field names, e.g. "
                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                          "\"prompt_lookup_max\": 4}', or method draft_model / eagle3 with "
                          "\"model\": the draft's or EAGLE-3 head's path "
                          "(README: Speculative decoding); "
                          "default: none (off)",
    "enable_lora": "serve LoRA adapters (PEFT format) next to the base model "
                   "(README: LoRA adapters)",
    "max_loras": "LoRA adapters on the device at once (one batch mixes at most this many)",
    "max_cpu_loras": "LoRA adapters kept loaded in host memory (LRU); default: --max-loras",
    "max_lora_rank": "largest LoRA rank served (8..256); device slots are sized for it",
    "kv_transfer_config": "a KV connector as a JSON object in vLLM's field names, e.g. "
                          "'{\"kv_connector\": \"OffloadingConnector\", \"kv_role\": "
                          "\"kv_both\", \"kv_buffer_size\": 4e9}' (README: KV transfer); "
                          "default: none (off)",
    "kv_offload_gb": "host-memory KV tier of this many GB: prefix blocks evicted from the KV "
                     "cache are kept there and reloaded on a hit (shorthand for the "
                     "OffloadingConnector); default: none (off)",
    "cpu_offload_gb": "GiB of each GPU worker's weights kept in pinned host memory and "
                      "streamed to the GPU layer by layer just before use (whole decoder "
                      "layers, from the last backwards); a no-op on a CPU (README: CPU "
                      "offload)",
    "pp_devices": "one device per pipeline stage, comma-separated, e.g. cuda,cpu: the last "
                  "layers run on the CPU (README: Several GPUs or processes); default: every "
                  "stage on --device",
    "tp_devices": "one device per tensor-parallel rank, comma-separated, e.g. cuda,cpu: a CPU "
                  "process holds a shard too; the all-reduce goes NCCL among the GPU ranks, "
                  "then through host memory (README: Several GPUs or processes); default: "
                  "every rank on --device",
    "compilation_config": "torch.compile as a JSON object in vLLM's field names, e.g. "
                          "'{\"mode\": 3, \"cache_dir\": \"/tmp/cc\"}', or a level: -O3 "
                          "(piecewise: Dynamo + Inductor, split at attention) or -O0 "
                          "(README: torch.compile); default: none (off, mode 0)",
}

LOG_LEVELS = ("debug", "info", "warning", "error")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help unless the help names the default itself, as
    it does where the default is decided at start-up (a ``None`` default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text:
            return text
        return super()._get_help_string(action)


def add_log_level_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default=log_level().lower(), choices=LOG_LEVELS,
                        help="log level of this process and every process it starts "
                             "(default: $TIDAL_LOG_LEVEL, else info; now %(default)s)")


def apply_log_level(level: str) -> None:
    """Make ``level`` the log level of the processes started from here on: engine and worker
    processes read ``$TIDAL_LOG_LEVEL`` when they set up their logging."""
    os.environ["TIDAL_LOG_LEVEL"] = level.upper()


def _parser_type(annotation: str) -> Any:
    """argparse ``type`` of an ``EngineArgs`` field from its (string) annotation."""
    base = annotation.replace(" | None", "").strip()
    if base.startswith("dict"):
        return json.loads
    return {"int": int, "float": float, "str": str}.get(base, str)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineArgs`` field, defaults from the dataclass."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        annotation = str(f.type)
        default = EngineArgs.__dataclass_fields__[f.name].default
        if default is dataclasses.MISSING:
            default = None  # default_factory fields (hf_overrides): unset means the factory's
        helptext = _HELP.get(f.name, "")  # tests/frontend/test_cli.py: none may be missing
        if annotation in ("bool", "bool | None"):
            # --flag / --no-flag, so a default that is on (or decided at start-up) can be
            # turned off as well as on.
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=helptext)
        else:
            # (-O3: vLLM's shorthand for --compilation-config 3)
            flags = (flag, "-O") if f.name == "compilation_config" else (flag,)
            group.add_argument(*flags, dest=f.name, type=_parser_type(annotation),
                               default=default, help=helptext)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    for name in ("hf_overrides", "kernel_config"):  # unset: the dataclass's factory
        if values.get(name) is None:
            values.pop(name)
    return EngineArgs.from_kwargs(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine-core", description="Run a tidal EngineCore for frontends to connect to.",
        formatter_class=HelpFormatter)
    parser.add_argument("--listen", default=None,
                        help="tcp://HOST:PORT, ipc://PATH or a port (loopback); port 0 picks a "
                             "free one; default: ipc:// in a temporary directory")
    add_log_level_arg(parser)
    add_engine_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tidal.engine_core.core_proc import serve, setup_logging
    from tidal.engine_core.plugins import PluginError
    from tidal.engine_core.sockets import normalize_address

    ns = build_parser().parse_args(argv)
    apply_log_level(ns.log_level)
    setup_logging("engine-core")
    start = time.perf_counter()
    try:
        args = engine_args_from(ns)
        if args.data_parallel_size > 1:
            raise ConfigError("--data-parallel-size with a standalone engine-core is not yet "
                              "supported: run `tidal serve --data-parallel-size N`, which "
                              "starts the N EngineCores itself")
        config = args.create_config()
        listen = normalize_address(ns.listen) if ns.listen else None
    except (ConfigError, ValueError, FileNotFoundError, PluginError) as exc:
        logger.error("%s", exc)
        return 2
    logger.info("start-up: config resolved in %.2f s: %s (%s, %s) on %s, executor %s",
                time.perf_counter() - start, config.model.served_model_name,
                config.model.load_format, config.model.dtype, config.runner.device,
                config.parallel.distributed_executor_backend)
    tmpdir = None
    if listen is None:
        tmpdir = tempfile.mkdtemp(prefix="tidal-engine-")
        listen = f"ipc://{tmpdir}/engine.sock"
    try:
        return serve(config, listen)
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
