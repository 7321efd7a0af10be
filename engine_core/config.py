"""The engine's one configuration object.

``EngineArgs`` holds what the user asked for; ``EngineArgs.create_config()`` resolves defaults
against the model and the machine, validates everything once, and returns an ``EngineConfig``:
frozen msgspec structs, so the same object travels to the EngineCore process and the workers.
Start-up may fill in the number of KV blocks (measured by the workers); that produces a new frozen
config (``with_num_blocks``), never a mutation.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tidal.engine_core.compilation_config import (
    CompilationConfig,
    build_compilation_config,
)
from tidal.engine_core.compilation_config import check_combination as check_compilation
from tidal.engine_core.cpu_offload_config import CPUOffloadConfigError, cpu_offload_bytes
from tidal.engine_core.expert_parallel_config import (
    ExpertParallelConfigError,
    check_all2all_backend,
    check_dbo_threshold,
    check_expert_parallel,
)
from tidal.engine_core.kernel_config import KernelConfig, build_kernel_config
from tidal.engine_core.kv_cache_dtype import (
    KVCacheDtypeError,
    check_fp8_kv_supported,
    resolve_kv_cache_dtype,
)
from tidal.engine_core.kv_groups import KVLayout, layout_for
from tidal.engine_core.kv_transfer_config import (
    KVTransferConfig,
    KVTransferConfigError,
    build_kv_transfer_config,
)
from tidal.engine_core.lora_config import LoRAConfig, LoRAConfigError, build_lora_config
from tidal.engine_core.model_arch import ArchSpec, arch_from_hf_dict
from tidal.engine_core.model_source import eos_token_ids, load_hf_config, resolve_model
from tidal.engine_core.pp_devices import PPDevicesError, check_mixed, resolve_pp_devices
from tidal.engine_core.quantization_config import (
    QuantConfig,
    QuantConfigError,
    build_quant_config,
)
from tidal.engine_core.speculative_config import (
    MAX_NGRAM_HISTORY_BYTES,
    SpeculativeConfig,
    SpeculativeConfigError,
    check_draft,
    ngram_history_bytes,
)
from tidal.engine_core.tp_devices import TPDevicesError, check_mixed_tp, resolve_tp_devices

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16"}
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


class ConfigError(ValueError):
    """The requested configuration is impossible; the message says which value and why."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    format: str  # "hf" | "gguf" (where the files are)
    load_format: str  # "safetensors" | "gguf" | "dummy" (how weights are produced)
    tokenizer: str
    served_model_name: str
    dtype: str
    arch: ArchSpec
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    chat_template: str | None = None
    task: str = "generate"  # "generate" | "embed"
    seed: int = 0
    # FP8 weights (quantization_config.py); None: the weights stay in ``dtype``.
    quantization: QuantConfig | None = None

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None  # forced by the user, or measured at start-up
    enable_prefix_caching: bool = True
    prefix_hash_seed: int | None = None  # None: a random seed per process
    # Every layer's KV kept whole, sliding-window layers too (one KV group: kv_groups).
    disable_hybrid_kv_cache_manager: bool = False
    # "auto" (the model dtype) | "fp8_e4m3" (kv_cache_dtype.py: per-layer K/V scales).
    cache_dtype: str = "auto"


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    max_queued_requests: int | None = None
    # Constrained decoding's grammar backend (engine_core/structured_output): auto (per
    # request: spec.choose_backend) | guidance | xgrammar.
    structured_outputs_backend: str = "auto"
    # The model's reasoning format (reasoning_formats.py): grammars apply after the thinking,
    # thinking budgets force its end. None: no reasoning parser.
    reasoning_parser: str | None = None


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # "uni" | "mp" | "ray" | "noop" (no model)
    # How CPU workers' groups communicate: "shm" (worker/distributed/shm_collectives.py; CPU
    # ranks of one host, the mp executor) or "gloo"; resolved from --cpu-collectives.
    cpu_collectives: str = "gloo"
    # Data parallelism: this many EngineCores, each a whole engine (scheduler, KV cache,
    # workers); ``data_parallel_rank`` is this one's (frontend/dp_engines.py).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # The ranks step together (engine_core/dp_lockstep.py), agreeing over a gloo group whose
    # rendezvous store listens on loopback at ``data_parallel_port`` (set by whoever starts
    # the ranks).
    data_parallel_lockstep: bool = False
    data_parallel_port: int = 0
    # MoE experts split over the DP x TP workers (worker/layers/moe_ep.py; checked by
    # expert_parallel_config.py); across DP engines it implies the lockstep.
    enable_expert_parallel: bool = False
    # Dual batch overlap (expert parallelism across engines): steps of at least
    # ``dbo_token_threshold`` tokens over all engines exchange in two micro-batches (0: the
    # threshold measured at start-up, worker/layers/moe_ep.py).
    enable_dbo: bool = False
    dbo_token_threshold: int = 0
    # How the experts' tokens move between engines (expert_parallel_config.ALL2ALL_BACKENDS).
    all2all_backend: str = "allgather_reducescatter"
    # The device of each pipeline stage (--pp-devices, pp_devices.py); empty: every stage on
    # the engine's device.
    pp_devices: tuple[str, ...] = ()
    # The device of each tensor-parallel rank (--tp-devices, tp_devices.py); empty: every rank
    # on the engine's device.
    tp_devices: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The global rank that samples and replies: tensor rank 0 of the last stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


class RunnerConfig(msgspec.Struct, frozen=True, kw_only=True):
    device: str  # "cpu" | "cuda"
    attention_backend: str | None = None  # None: the best available (= kernels.attention_backend)
    enforce_eager: bool = False
    max_cudagraph_batch: int = 512
    # Mixed (prefill + decode) steps of up to this many tokens replay CUDA graphs too; 0: eager.
    max_mixed_graph_tokens: int = 0
    max_logprobs: int = 20
    cpu_threads: int | None = None  # torch intra-op threads of a CPU worker; None: torch's default
    # Global logits processors (worker/sample/logits_processors.py): entry-point names or
    # "package.module:Class" import strings, applied to every request.
    logits_processors: tuple[str, ...] = ()
    # Every kernel choice (kernel_config.py); each worker resolves it against its device.
    kernels: KernelConfig = msgspec.field(default_factory=KernelConfig)
    # torch.compile of the model (compilation_config.py); mode 0 (off) by default.
    compilation: CompilationConfig = msgspec.field(default_factory=CompilationConfig)
    # Bytes of each GPU worker's weights kept in pinned host memory (worker/cpu_offload.py).
    cpu_offload_bytes: int = 0


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    runner: RunnerConfig
    # Speculative decoding (speculative_config.py); None: off.
    speculative: SpeculativeConfig | None = None
    # LoRA adapters (lora_config.py); None: --enable-lora is off.
    lora: LoRAConfig | None = None
    # KV transfer (kv_transfer_config.py): a KV connector; None: off.
    kv_transfer: KVTransferConfig | None = None
    # The EngineCore's periodic stats line (stats_logger.py); --disable-log-stats turns it off.
    log_stats: bool = True

    def kv_layout(self) -> KVLayout:
        """How the layers share the KV cache (groups by attention type: ``kv_groups``)."""
        return layout_for(self.model.arch, not self.cache.disable_hybrid_kv_cache_manager,
                          self.model.max_model_len)

    def with_num_blocks(self, num_blocks: int) -> EngineConfig:
        capacity = num_blocks * self.cache.block_size
        layout = self.kv_layout()
        if layout.hybrid:
            # A lone request shrinks its prompt chunks until they fit (the scheduler), so it
            # needs room for one token at a time; without chunked prefill for a whole prompt.
            chunk = 1 if self.scheduler.enable_chunked_prefill else self.model.max_model_len
            need = layout.blocks_per_seq(self.model.max_model_len, self.cache.block_size, chunk)
            if num_blocks < need:
                raise ConfigError(
                    f"the KV cache has {num_blocks} blocks but one sequence of max_model_len "
                    f"{self.model.max_model_len} needs {need} over its {layout.num_groups} KV "
                    "group(s): give the cache more memory (--gpu-memory-utilization / "
                    "kv_cache_memory_bytes) or lower --max-model-len")
        elif capacity < self.model.max_model_len:
            raise ConfigError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
                f"{self.cache.block_size}) but max_model_len is {self.model.max_model_len}: "
                "give the cache more memory (--gpu-memory-utilization / kv_cache_memory_bytes) "
                "or lower --max-model-len"
            )
        cache = msgspec.structs.replace(self.cache, num_blocks=num_blocks)
        return msgspec.structs.replace(self, cache=cache)

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the EngineCore keeps in flight: one per pipeline stage keeps every stage busy;
        async scheduling needs one more step than the one running."""
        return max(self.parallel.pipeline_parallel_size,
                   2 if self.scheduler.async_scheduling else 1)

    @property
    def max_blocks_per_seq(self) -> int:
        bs = self.cache.block_size
        return (self.model.max_model_len + bs - 1) // bs


@dataclass(slots=True)
class EngineArgs:
    """Everything a user can set; names follow vLLM's flags."""

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    task: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    quantization: str | None = None  # fp8 | compressed-tensors (quantization_config.py)
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 (kv_cache_dtype.py)
    # With --quantization fp8 on a 16/32-bit checkpoint: a weight scale per output row and
    # this many input channels, activations per token and as many (the block-wise FP8 path);
    # None: one scale per row, activations per token.
    fp8_group_size: int | None = None
    enable_prefix_caching: bool = True
    prefix_hash_seed: int | None = None
    disable_hybrid_kv_cache_manager: bool = False
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None  # None: on for generation on CUDA with one stage
    max_queued_requests: int | None = None
    structured_outputs_backend: str = "auto"  # auto | guidance | xgrammar
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1 | gpt_oss (reasoning_formats.py)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_lockstep: bool = False
    enable_expert_parallel: bool = False
    # Dual batch overlap of the experts' exchange between engines (worker/layers/moe_ep.py),
    # in steps of at least this many tokens over all engines (None: 128; only with enable_dbo).
    enable_dbo: bool = False
    dbo_token_threshold: int | None = None
    # How the experts' tokens move between engines with expert parallelism (vLLM's field):
    # "allgather_reducescatter" or "alltoallv" (worker/layers/moe_ep.py).
    all2all_backend: str = "allgather_reducescatter"
    distributed_executor_backend: str | None = None
    cpu_collectives: str = "auto"  # auto | shm | gloo
    device: str = "auto"
    attention_backend: str | None = None
    ops_backend: str | None = None
    # The kernel section as JSON (kernel_config.py); flags above win over it, it over $TIDAL_*.
    kernel_config: dict[str, Any] = field(default_factory=dict)
    enforce_eager: bool = False
    max_mixed_cudagraph_tokens: int | None = None
    max_logprobs: int = 20
    disable_log_stats: bool = False
    cpu_threads: int | None = None
    # Global logits processors, comma-separated entry-point names / "pkg.mod:Class" strings.
    logits_processors: str | None = None
    # Applied to the model's HF config before anything reads it (e.g. shapes for benchmarks).
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding as vLLM's JSON object (speculative_config.py); None: off.
    speculative_config: dict[str, Any] | None = None
    # LoRA adapters (lora_config.py): slots on the device, the host LRU, the largest rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    # KV transfer as vLLM's JSON object (kv_transfer_config.py), or --kv-offload-gb's shorthand
    # for the host-memory KV tier; None: off.
    kv_transfer_config: dict[str, Any] | None = None
    kv_offload_gb: float | None = None
    # torch.compile as vLLM's JSON object, or a level (-O3) (compilation_config.py); None: off.
    compilation_config: dict[str, Any] | int | None = None
    # GiB of each GPU worker's weights kept in pinned host memory (worker/cpu_offload.py).
    cpu_offload_gb: float = 0.0
    # One device per pipeline stage, comma-separated (pp_devices.py); None: all on --device.
    pp_devices: str | None = None
    # One device per tensor-parallel rank, comma-separated (tp_devices.py); None: all on --device.
    tp_devices: str | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def create_config(self) -> EngineConfig:
        from tidal.engine_core.plugins import load_general_plugins

        load_general_plugins()  # (once per process) a plugin may register the model's family
        src = resolve_model(self.model)
        hf = load_hf_config(src)
        hf.update(self.hf_overrides)
        arch = arch_from_hf_dict(hf, src.path)
        device = _resolve_device(self.device)
        try:  # (--device auto follows the stages' devices)
            device, pp_devices = resolve_pp_devices(self.pp_devices, self.device, device,
                                                    self.pipeline_parallel_size)
            device, tp_devices = resolve_tp_devices(self.tp_devices, self.device, device,
                                                    self.tensor_parallel_size, pp_devices)
        except (PPDevicesError, TPDevicesError) as exc:
            raise ConfigError(str(exc)) from None

        load_format = self.load_format
        if load_format not in _LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {_LOAD_FORMATS}, got {load_format!r}")
        if load_format == "auto":
            load_format = "gguf" if src.format == "gguf" else "safetensors"
        if load_format == "gguf" and src.format != "gguf":
            raise ConfigError(f"load_format='gguf' but {src.path} is not a .gguf file")

        task = self.task
        if task == "auto":
            task = "embed" if arch.is_embedding else "generate"
        if task not in ("generate", "embed"):
            raise ConfigError(f"task must be 'auto', 'generate' or 'embed', got {task!r}")
        if task == "generate" and arch.is_embedding:
            raise ConfigError(f"{arch.architecture} is an embedding model; use task='embed'")

        max_model_len = self.max_model_len or arch.max_position_embeddings
        if max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_model_len > arch.max_position_embeddings and arch.rope_scaling is None:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's context of "
                f"{arch.max_position_embeddings} tokens (max_position_embeddings in {src.path})"
            )

        try:
            quantization = build_quant_config(self.quantization, hf, arch.family,
                                              dummy=load_format == "dummy",
                                              fp8_group_size=self.fp8_group_size)
        except QuantConfigError as exc:
            raise ConfigError(f"--quantization: {exc}") from None
        model = ModelConfig(
            path=src.path,
            format=src.format,
            load_format=load_format,
            tokenizer=self.tokenizer or src.path,
            served_model_name=self.served_model_name or src.name,
            dtype=_resolve_dtype(self.dtype, hf, device),
            arch=arch,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids(src, hf),
            bos_token_id=hf.get("bos_token_id"),
            chat_template=hf.get("_chat_template"),
            task=task,
            seed=self.seed,
            quantization=quantization,
        )
        cache = self._cache_config()
        if task == "embed":
            # Encoders attend both ways: a prompt is computed in one step, never chunked, and
            # nothing is cached between steps.
            cache = msgspec.structs.replace(cache, enable_prefix_caching=False)
        scheduler = self._scheduler_config(max_model_len, device, task)
        parallel = self._parallel_config(arch)
        parallel = msgspec.structs.replace(parallel, pp_devices=pp_devices,
                                           tp_devices=tp_devices)
        parallel = msgspec.structs.replace(parallel, cpu_collectives=_resolve_cpu_collectives(
            self.cpu_collectives, parallel, device))
        kernels = build_kernel_config(self.kernel_config,
                                      attention_backend=self.attention_backend
                                      or _platform_attention_backend(device),
                                      ops=self.ops_backend)
        compilation = build_compilation_config(self.compilation_config)
        runner = RunnerConfig(
            device=device,
            attention_backend=kernels.attention_backend,
            # (--tp-devices: the hierarchical all-reduce waits on the host, which no CUDA
            # graph can hold, so mixed ranks run eagerly.)
            enforce_eager=(self.enforce_eager or device == "cpu" or bool(tp_devices)
                           or compilation.cudagraph_mode == "NONE"),
            max_cudagraph_batch=min(512, scheduler.max_num_seqs),
            max_mixed_graph_tokens=self._mixed_graph_tokens(scheduler),
            max_logprobs=self.max_logprobs,
            cpu_threads=self.cpu_threads,
            logits_processors=_global_logits_processors(
                self.logits_processors, task, self.speculative_config is not None),
            kernels=kernels,
            compilation=compilation,
        )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        # (With speculative decoding, async scheduling pipelines only the steps that neither
        # verify nor propose drafts: ``EngineCore._inflight_limit``.)
        speculative = self._speculative_config(task, scheduler, parallel, arch)
        if speculative is not None and speculative.method == "ngram" \
                and speculative.prompt_lookup_on_device is None:
            size = ngram_history_bytes(scheduler.max_num_seqs, max_model_len)
            speculative = msgspec.structs.replace(speculative, prompt_lookup_on_device=(
                device == "cuda" and size <= MAX_NGRAM_HISTORY_BYTES))
        # A draft model or EAGLE-3 head stays 16-bit under a quantized target; MTP layers are
        # read from the target's own checkpoint, quantized or not, so not (yet) with it.
        if quantization is not None and speculative is not None and speculative.method == "mtp":
            raise ConfigError(f"--quantization: {quantization.method.upper()} with speculative "
                              "method 'mtp' (MTP layers of the quantized checkpoint) is not yet "
                              "implemented in tidal; a draft model or an EAGLE-3 head works")
        try:
            lora = build_lora_config(
                self.enable_lora, self.max_loras, self.max_cpu_loras, self.max_lora_rank,
                arch=arch, task=task, quantized=quantization is not None,
                speculative=speculative is not None,
                pipeline_parallel_size=parallel.pipeline_parallel_size)
        except LoRAConfigError as exc:
            raise ConfigError(str(exc)) from None
        try:
            kv_transfer = build_kv_transfer_config(self.kv_transfer_config, self.kv_offload_gb)
        except KVTransferConfigError as exc:
            raise ConfigError(str(exc)) from None
        if kv_transfer is not None and parallel.data_parallel_size > 1:
            # Every rank would get the same connector config: the same kv_port bound by each,
            # and (lockstep) a busy loop that does not poll transfers.
            raise ConfigError("--data-parallel-size > 1 with a KV connector is not yet "
                              "supported (each rank would need its own kv_port)")
        check_compilation(compilation, task=task,
                          pipeline_parallel_size=parallel.pipeline_parallel_size,
                          device=device, enforce_eager=self.enforce_eager,
                          max_num_tokens=max(scheduler.max_num_batched_tokens,
                                             scheduler.max_num_seqs))
        try:
            expert_parallel = check_expert_parallel(
                enabled=self.enable_expert_parallel, enable_dbo=self.enable_dbo, arch=arch,
                tensor_parallel_size=parallel.tensor_parallel_size,
                pipeline_parallel_size=parallel.pipeline_parallel_size,
                data_parallel_size=parallel.data_parallel_size, compiled=compilation.enabled,
                speculative=speculative is not None, lora=lora is not None)
            dbo_threshold = check_dbo_threshold(self.dbo_token_threshold,
                                                enable_dbo=self.enable_dbo)
            all2all = check_all2all_backend(self.all2all_backend,
                                            expert_parallel=expert_parallel,
                                            data_parallel_size=parallel.data_parallel_size,
                                            enable_dbo=self.enable_dbo)
        except ExpertParallelConfigError as exc:
            raise ConfigError(str(exc)) from None
        parallel = msgspec.structs.replace(parallel, enable_expert_parallel=expert_parallel,
                                           enable_dbo=self.enable_dbo,
                                           dbo_token_threshold=dbo_threshold,
                                           all2all_backend=all2all)
        try:
            check_mixed(pp_devices, tensor_parallel_size=parallel.tensor_parallel_size,
                        backend=parallel.distributed_executor_backend,
                        data_parallel_size=parallel.data_parallel_size,
                        compiled=compilation.enabled, kv_transfer=kv_transfer is not None)
            check_mixed_tp(tp_devices, pipeline_parallel_size=parallel.pipeline_parallel_size,
                           backend=parallel.distributed_executor_backend,
                           data_parallel_size=parallel.data_parallel_size, dtype=model.dtype,
                           compiled=compilation.enabled, kv_transfer=kv_transfer is not None,
                           expert_parallel=expert_parallel, speculative=speculative is not None,
                           lora=lora is not None)
            offload = cpu_offload_bytes(
                self.cpu_offload_gb, gpu_stages=device == "cuda",
                quantized=quantization is not None, compiled=compilation.enabled,
                lora=lora is not None, embedding=task == "embed")
        except (PPDevicesError, TPDevicesError, CPUOffloadConfigError) as exc:
            raise ConfigError(str(exc)) from None
        runner = msgspec.structs.replace(runner, cpu_offload_bytes=offload)
        config = EngineConfig(
            model=model, cache=cache, scheduler=scheduler, parallel=parallel, runner=runner,
            speculative=speculative, lora=lora, kv_transfer=kv_transfer,
            log_stats=not self.disable_log_stats,
        )
        if kv_transfer is not None:
            from tidal.engine_core.kv_transfer.connector_registry import check_connector

            try:
                check_connector(config)  # the name resolves; the connector takes this engine
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if cache.cache_dtype != "auto":
            try:
                check_fp8_kv_supported(
                    is_mla=arch.is_mla, task=task, attention_backend=kernels.attention_backend,
                    speculative_uses_model=speculative is not None and speculative.uses_model)
            except KVCacheDtypeError as exc:
                raise ConfigError(str(exc)) from None
        if speculative is not None and speculative.uses_model \
                and config.kv_layout().num_groups > 1:
            raise ConfigError(f"--speculative-config: method {speculative.method!r} with a "
                              "target of sliding-window layers (several KV cache groups) is "
                              "not yet implemented in tidal")
        if cache.num_blocks is not None:
            config = config.with_num_blocks(cache.num_blocks)
        return config

    def _speculative_config(self, task: str, scheduler: SchedulerConfig,
                            parallel: ParallelConfig, arch: ArchSpec
                            ) -> SpeculativeConfig | None:
        try:
            spec = SpeculativeConfig.parse(self.speculative_config)
            if spec is not None and spec.uses_model:
                spec = check_draft(spec, arch, target_name=self.model or "")
        except SpeculativeConfigError as exc:
            raise ConfigError(str(exc)) from None
        if spec is None:
            return None
        if spec.uses_model and parallel.tensor_parallel_size > 1:
            raise ConfigError(f"--speculative-config: method {spec.method!r} with tensor "
                              "parallelism is not yet implemented in tidal")
        if task != "generate":
            raise ConfigError("--speculative-config applies to generation, not task "
                              f"{task!r}")
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("--speculative-config does not combine with pipeline "
                              "parallelism yet")
        if scheduler.max_num_batched_tokens < scheduler.max_num_seqs * 2:
            # Not an error: steps just verify fewer drafts when the budget runs short.
            logger.info("max_num_batched_tokens %d leaves little room for draft tokens of %d "
                        "sequences", scheduler.max_num_batched_tokens, scheduler.max_num_seqs)
        return spec

    def _cache_config(self) -> CacheConfig:
        bs = self.block_size
        if bs < 1 or bs > 256 or bs & (bs - 1):
            raise ConfigError(f"block_size must be a power of two in [1, 256], got {bs}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(
                f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}"
            )
        try:
            cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype)
        except KVCacheDtypeError as exc:
            raise ConfigError(str(exc)) from None
        return CacheConfig(
            block_size=bs,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_hash_seed=self.prefix_hash_seed,
            disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
            cache_dtype=cache_dtype,
        )

    def _mixed_graph_tokens(self, scheduler: SchedulerConfig) -> int:
        value = self.max_mixed_cudagraph_tokens
        if value is None:
            value = 2048
        elif value < 0:
            raise ConfigError(f"max_mixed_cudagraph_tokens must be >= 0, got {value}")
        return min(value, scheduler.max_num_batched_tokens)

    def _scheduler_config(self, max_model_len: int, device: str, task: str) -> SchedulerConfig:
        chunked = self.enable_chunked_prefill and task == "generate"
        budget = self.max_num_batched_tokens
        if budget is not None and budget < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {budget}")
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            # 512 on a GPU: the largest decode batch with a CUDA graph, so a burst of a
            # thousand requests starts in two waves instead of four. A step never holds more
            # sequences than tokens.
            max_num_seqs = min(512 if device == "cuda" else 64, budget or 1 << 30)
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if budget is None:
            budget = (8192 if device == "cuda" else 2048) if chunked else max(max_model_len, 2048)
            budget = max(budget, max_num_seqs)
        if not chunked and budget < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled, so long prompts could never "
                "be scheduled: raise max_num_batched_tokens, lower max_model_len, or enable "
                "chunked prefill"
            )
        if budget < max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({max_num_seqs})"
            )
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            # Measured on an H100 (nano-vllm workload 17.3k vs 14.9k tok/s); on a CPU the step
            # itself dominates and overlap buys nothing.
            async_scheduling = (device == "cuda" and task == "generate"
                                and self.pipeline_parallel_size == 1)
        if async_scheduling and self.pipeline_parallel_size > 1:
            raise ConfigError("async_scheduling does not combine with pipeline parallelism: the "
                              "first stage would embed tokens the last stage has not sampled "
                              "yet (pipeline stages already overlap their batches)")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        return SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            async_scheduling=async_scheduling,
            max_queued_requests=self.max_queued_requests,
            structured_outputs_backend=check_backend(self.structured_outputs_backend),
            reasoning_parser=_check_reasoning_parser(self.reasoning_parser),
        )

    def _parallel_config(self, arch: ArchSpec) -> ParallelConfig:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp < 1 or pp < 1:
            raise ConfigError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if arch.num_heads % tp:
            raise ConfigError(
                f"tensor_parallel_size {tp} must divide the number of attention heads "
                f"({arch.num_heads})"
            )
        if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
            raise ConfigError(
                f"tensor_parallel_size {tp} and the number of KV heads ({arch.num_kv_heads}) "
                "must divide one another"
            )
        if pp > arch.num_layers:
            raise ConfigError(
                f"pipeline_parallel_size {pp} exceeds the number of layers ({arch.num_layers})"
            )
        backend = self.distributed_executor_backend or ("uni" if tp * pp == 1 else "mp")
        # "noop" runs no model at all (one fixed token per step): for overhead benchmarks.
        if backend not in ("uni", "mp", "ray", "noop"):
            raise ConfigError(
                f"distributed_executor_backend must be uni, mp, ray or noop, got {backend!r}"
            )
        if backend in ("uni", "noop") and tp * pp > 1:
            raise ConfigError("the in-process executor runs one worker; use 'mp' or 'ray'")
        dp = self.data_parallel_size
        if not 1 <= dp <= MAX_DATA_PARALLEL_SIZE:
            raise ConfigError(f"data_parallel_size must be between 1 and "
                              f"{MAX_DATA_PARALLEL_SIZE}, got {dp}")
        if self.data_parallel_lockstep and dp == 1:
            raise ConfigError("--data-parallel-lockstep needs --data-parallel-size > 1")
        if dp > 1 and backend == "ray":
            raise ConfigError("--data-parallel-size > 1 with the ray executor is not yet "
                              "supported (the ranks are local processes; use 'mp')")
        return ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp,
            distributed_executor_backend=backend, data_parallel_size=dp,
            # (Experts across engines: every rank must join every step's exchange.)
            data_parallel_lockstep=self.data_parallel_lockstep or (
                self.enable_expert_parallel and dp > 1 and arch.num_experts > 0),
            enable_expert_parallel=self.enable_expert_parallel,
        )


# Each rank is a process with its own sockets to every API server: bounded like any input.
MAX_DATA_PARALLEL_SIZE = 64

STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance", "xgrammar")


def check_backend(name: str) -> str:
    """The grammar backend for ``--structured-outputs-backend`` (``auto`` picks one per
    request: structured_output/spec.py). xgrammar is an optional dependency."""
    if name in ("auto", "guidance"):
        return name
    if name == "xgrammar":
        import importlib.util

        if importlib.util.find_spec("xgrammar") is None:
            raise ConfigError("--structured-outputs-backend xgrammar needs the xgrammar "
                              "package (pip install 'tidal[xgrammar]'); auto and guidance "
                              "work without it")
        return name
    raise ConfigError("--structured-outputs-backend must be one of "
                      f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, got {name!r}")


def _global_logits_processors(value: str | None, task: str,
                              speculative: bool) -> tuple[str, ...]:
    """``--logits-processors``, each checked to import here (the worker imports it again)."""
    from tidal.engine_core.plugins import LOGITS_PROCESSORS, PluginError, import_string, load_plugin

    names = tuple(n.strip() for n in (value or "").split(",") if n.strip())
    if names and task != "generate":
        raise ConfigError("--logits-processors: an embedding model samples nothing")
    if names and speculative:
        raise ConfigError("--logits-processors with --speculative-config is not yet "
                          "implemented in tidal")
    for name in names:
        try:
            import_string(name) if ":" in name else load_plugin(LOGITS_PROCESSORS, name)
        except PluginError as exc:
            raise ConfigError(f"--logits-processors: {exc}") from None
    return names


def _platform_attention_backend(device: str) -> str | None:
    """The platform's default attention backend (None: the kernel policy's choice)."""
    from tidal.engine_core.plugins.platform import platform_for

    return platform_for(device).default_attention_backend


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        from tidal.engine_core.plugins import PluginError
        from tidal.engine_core.plugins.platform import current_platform

        try:  # a platform plugin that reports itself available, else CUDA, else the CPU
            return current_platform().device_type
        except PluginError as exc:
            raise ConfigError(str(exc)) from None
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA GPU is visible to torch")
    return device


def _resolve_dtype(dtype: str, hf: dict[str, Any], device: str) -> str:
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if dtype == "auto":
        if device == "cpu":
            # Half-precision matmuls are slow or unsupported on many CPUs.
            return "float32"
        ckpt = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").replace("torch.", "")
        return "bfloat16" if ckpt == "float32" else ckpt if ckpt in _DTYPES else "bfloat16"
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be auto or one of {_DTYPES}, got {dtype!r}")
    return dtype


def _check_reasoning_parser(name: str | None) -> str | None:
    from tidal.engine_core.reasoning_formats import reasoning_format

    try:
        reasoning_format(name)
    except ValueError as exc:
        raise ConfigError(f"--reasoning-parser: {exc}") from None
    return name


CPU_COLLECTIVES = ("auto", "shm", "gloo")


def _resolve_cpu_collectives(choice: str, parallel: ParallelConfig, device: str) -> str:
    """``--cpu-collectives``: auto is shared memory where every rank is a CPU process of this
    host (device cpu, the mp executor), else gloo."""
    if choice not in CPU_COLLECTIVES:
        raise ConfigError(f"cpu_collectives must be one of {', '.join(CPU_COLLECTIVES)}, got "
                          f"{choice!r}")
    # (Stages on mixed devices, --pp-devices: the pipeline group carries host tensors only.)
    possible = ((device == "cpu" or bool(parallel.pp_devices) or bool(parallel.tp_devices))
                and parallel.distributed_executor_backend == "mp")
    if choice == "shm" and not possible:
        where = (f"the {parallel.distributed_executor_backend} executor" if device == "cpu"
                 else f"{device} workers")
        raise ConfigError(f"--cpu-collectives shm: not yet supported with {where} "
                          "(shared-memory collectives join CPU workers of one host, started by "
                          "the mp executor)")
    if choice == "gloo":
        return "gloo"
    return "shm" if possible else "gloo"
