"""The one list of model architectures tidal serves.

Each :class:`ModelFamily` names the HF architectures it serves, the worker class that implements
it (a ``"module:Class"`` string, imported only in the worker, because ``engine_core`` never
imports worker code), the function that turns an HF ``config.json`` dict into an
:class:`~tidal.engine_core.model_arch.ArchSpec`, what the family can do, and, where llama.cpp
defines the family, how its GGUF files map onto HF names. Config parsing
(:mod:`~tidal.engine_core.model_arch`), GGUF metadata (:mod:`~tidal.engine_core.gguf_config`),
GGUF weights (``worker/loader/gguf_weights.py``) and model construction
(``worker/models/registry.py``) all ask this module; none keeps a list of its own.

Adding a family: one file in ``worker/models/`` and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any, Literal

import msgspec

from tidal.engine_core.model_arch import (
    ArchSpec,
    bert_arch,
    decoder_arch,
    deepseek_v2_arch,
    eagle3_arch,
    gemma_arch,
    moe_arch,
    phi3_arch,
)

# ``normalise(cfg, architecture=..., family=..., source=...)``: ``source`` names the config file
# in error messages.
Normaliser = Callable[..., ArchSpec]
# "draft": a speculative-decoding draft head, never served on its own.
Task = Literal["generate", "embed", "draft"]

# llama.cpp's names for the tensors outside the blocks -> HF parameter names.
LLAMA_GGUF_TOP_TENSORS: Mapping[str, str] = MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})

# llama.cpp's per-block tensor stem (``blk.{i}.{stem}.weight``) -> HF module under
# ``model.layers.{i}``.
LLAMA_GGUF_BLOCK_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
})


@dataclass(frozen=True, slots=True)
class GGUFFamily:
    """How llama.cpp's GGUF files of one ``general.architecture`` map onto an HF checkpoint."""

    arch: str  # GGUF ``general.architecture``
    hf_architecture: str  # written to the config's ``architectures``; must be in the family
    model_type: str
    # llama.cpp's converter interleaves each Q/K head's rotary halves for the "normal" rope
    # layout (llama); NEOX-layout families (Qwen) are stored in HF order.
    permuted_qk: bool = False
    top_tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_TOP_TENSORS)
    block_tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_BLOCK_TENSORS)
    # ``{arch}.{suffix}`` metadata key -> HF config key, copied when the file has it.
    metadata_keys: Mapping[str, str] = field(default_factory=dict)
    # HF config keys the metadata cannot express but the family fixes (e.g. ``hidden_act``).
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Subtracted from every ``*_norm`` weight on load: llama.cpp stores ``(1 + w)``-style
    # RMSNorm weights (Gemma) with the 1 already added.
    norm_weight_offset: float = 0.0
    # This mapping is for the files of ``arch`` whose metadata has ``{arch}.expert_count``:
    # llama.cpp writes Mixtral as ``llama`` with experts.
    with_experts: bool = False


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str  # ``ArchSpec.family``
    architectures: tuple[str, ...]  # HF ``architectures`` names this family serves
    model_class: str  # "module:Class", constructed as ``Class(arch, dtype, impl, tp, pp)``
    normalise: Normaliser
    task: Task = "generate"
    # False: a config asking for a sliding window is rejected rather than silently attended in
    # full.
    supports_sliding_window: bool = False
    gguf: GGUFFamily | None = None


_DECODER = "tidal.worker.models.decoder:DecoderForCausalLM"
_GEMMA = "tidal.worker.models.gemma2:Gemma2ForCausalLM"


def _moe_gguf(arch: str, hf_architecture: str, model_type: str, ffn: str,
              **kwargs: Any) -> GGUFFamily:
    # llama.cpp's router (``ffn_gate_inp``) and the experts' weights, stacked [E, ...] in one
    # tensor each; the model loads those as a whole (``*_exps`` are not HF names).
    return GGUFFamily(
        arch, hf_architecture, model_type,
        block_tensors=MappingProxyType({
            **LLAMA_GGUF_BLOCK_TENSORS,
            "ffn_gate_inp": f"{ffn}.gate",
            "ffn_gate_exps": f"{ffn}.experts.gate_exps",
            "ffn_up_exps": f"{ffn}.experts.up_exps",
            "ffn_down_exps": f"{ffn}.experts.down_exps",
        }),
        **kwargs,
    )


def _gemma_gguf(arch: str, hf_architecture: str) -> GGUFFamily:
    # llama.cpp stores Gemma's norms with the 1 added, names the extra norms of each block
    # (its ffn_norm is the pre-feed-forward one), keeps rope in HF order, and leaves the local
    # rope base and, in Gemma 3, the window pattern at the defaults the normaliser also uses.
    return GGUFFamily(
        arch, hf_architecture, "gemma3_text" if arch == "gemma3" else arch,
        block_tensors=MappingProxyType({
            **LLAMA_GGUF_BLOCK_TENSORS,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        }),
        metadata_keys=MappingProxyType({
            "attention.sliding_window": "sliding_window",
            "attention.sliding_window_pattern": "sliding_window_pattern",
            "attn_logit_softcapping": "attn_logit_softcapping",
            "final_logit_softcapping": "final_logit_softcapping",
        }),
        config_defaults=MappingProxyType({"hidden_activation": "gelu_pytorch_tanh"}),
        norm_weight_offset=1.0,
    )

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", ("LlamaForCausalLM",), _DECODER, decoder_arch,
                supports_sliding_window=True,
                gguf=GGUFFamily("llama", "LlamaForCausalLM", "llama", permuted_qk=True)),
    # Mistral's window applies whenever the config sets one (no ``use_sliding_window`` flag).
    ModelFamily("mistral", ("MistralForCausalLM",), _DECODER,
                partial(decoder_arch, window_flag=None), supports_sliding_window=True),
    ModelFamily("qwen2", ("Qwen2ForCausalLM",), _DECODER, partial(decoder_arch, qkv_bias=True),
                supports_sliding_window=True,
                gguf=GGUFFamily("qwen2", "Qwen2ForCausalLM", "qwen2")),
    ModelFamily("qwen3", ("Qwen3ForCausalLM",), _DECODER, partial(decoder_arch, qk_norm=True),
                supports_sliding_window=True,
                gguf=GGUFFamily("qwen3", "Qwen3ForCausalLM", "qwen3")),
    # llama.cpp keeps Phi-3's fused q/k/v and gate/up as they are (NEOX rotary, not permuted).
    # LongRoPE files carry their factors as rope_factors_* tensors, which fail as unknown.
    ModelFamily("phi3", ("Phi3ForCausalLM",), "tidal.worker.models.phi3:Phi3ForCausalLM",
                phi3_arch, supports_sliding_window=True,
                gguf=GGUFFamily("phi3", "Phi3ForCausalLM", "phi3", block_tensors=MappingProxyType({
                    **LLAMA_GGUF_BLOCK_TENSORS, "attn_qkv": "self_attn.qkv_proj",
                    "ffn_up": "mlp.gate_up_proj"}),
                    metadata_keys={"attention.sliding_window": "sliding_window"})),
    # Gemma 3 text is Gemma 2's code with q/k norms and a local rope base (config only).
    ModelFamily("gemma2", ("Gemma2ForCausalLM",), _GEMMA, gemma_arch,
                supports_sliding_window=True,
                gguf=_gemma_gguf("gemma2", "Gemma2ForCausalLM")),
    ModelFamily("gemma3", ("Gemma3ForCausalLM",), _GEMMA, gemma_arch,
                supports_sliding_window=True,
                gguf=_gemma_gguf("gemma3", "Gemma3ForCausalLM")),
    # Mixture of experts on the Llama decoder: Mixtral (a set window applies to every layer;
    # llama.cpp writes it as ``llama`` with experts, Q/K permuted) and Qwen3-MoE (q/k norms).
    ModelFamily("mixtral", ("MixtralForCausalLM",),
                "tidal.worker.models.mixtral:MixtralForCausalLM", moe_arch,
                supports_sliding_window=True,
                gguf=_moe_gguf("llama", "MixtralForCausalLM", "mixtral", "block_sparse_moe",
                               permuted_qk=True, with_experts=True, metadata_keys={
                                   "expert_count": "num_local_experts",
                                   "expert_used_count": "num_experts_per_tok",
                                   "attention.sliding_window": "sliding_window"})),
    # llama.cpp always renormalises Qwen3-MoE's top-k weights (its files carry no flag).
    ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",),
                "tidal.worker.models.qwen3_moe:Qwen3MoeForCausalLM",
                partial(moe_arch, qk_norm=True),
                gguf=_moe_gguf("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", "mlp",
                               metadata_keys={
                                   "expert_count": "num_experts",
                                   "expert_used_count": "num_experts_per_tok",
                                   "expert_feed_forward_length": "moe_intermediate_size"},
                               config_defaults={"norm_topk_prob": True})),
    # DeepSeek-V2 / V2-Lite: multi-head latent attention (a latent KV cache) and routed +
    # shared experts. Safetensors only (llama.cpp's deepseek2 files are not mapped yet).
    ModelFamily("deepseek_v2", ("DeepseekV2ForCausalLM",),
                "tidal.worker.models.deepseek_v2:DeepseekV2ForCausalLM", deepseek_v2_arch),
    # DeepSeek-V3 / R1: V2's layers with sigmoid + bias "noaux_tc" routing; the checkpoint's
    # multi-token-prediction layers (``num_nextn_predict_layers``) are the ``mtp`` speculative
    # method's drafter (``deepseek_mtp``, built by the worker next to the target, never served).
    ModelFamily("deepseek_v3", ("DeepseekV3ForCausalLM",),
                "tidal.worker.models.deepseek_v3:DeepseekV3ForCausalLM", deepseek_v2_arch),
    ModelFamily("deepseek_mtp", ("DeepSeekMTPModel",),
                "tidal.worker.models.deepseek_mtp:DeepseekMTP", deepseek_v2_arch, task="draft"),
    ModelFamily("bert", ("BertModel", "BertForMaskedLM"),
                "tidal.worker.models.bert:BertEmbeddingModel", bert_arch, task="embed"),
    # EAGLE-3 draft heads for Llama-shaped targets, as EAGLE / SGLang, vLLM and the
    # ``speculators`` library name them.
    ModelFamily("eagle3", ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM",
                           "Eagle3Speculator"),
                "tidal.worker.models.eagle3:Eagle3ForCausalLM", eagle3_arch, task="draft"),
)


def _index() -> tuple[dict[str, ModelFamily], dict[str, ModelFamily], dict[str, ModelFamily],
                      dict[str, ModelFamily]]:
    by_name: dict[str, ModelFamily] = {}
    by_arch: dict[str, ModelFamily] = {}
    by_plain_gguf: dict[str, ModelFamily] = {}
    by_gguf_experts: dict[str, ModelFamily] = {}  # ``GGUFFamily.with_experts`` mappings
    for fam in FAMILIES:
        # A duplicate would make lookups depend on list order; fail at import instead.
        if fam.name in by_name:
            raise ValueError(f"model family {fam.name!r} registered twice")
        by_name[fam.name] = fam
        for arch in fam.architectures:
            if arch in by_arch:
                raise ValueError(f"architecture {arch!r} registered by {by_arch[arch].name!r} "
                                 f"and {fam.name!r}")
            by_arch[arch] = fam
        if fam.gguf is not None:
            by_gguf = by_gguf_experts if fam.gguf.with_experts else by_plain_gguf
            if fam.gguf.arch in by_gguf:
                raise ValueError(f"GGUF architecture {fam.gguf.arch!r} registered twice")
            if fam.gguf.hf_architecture not in fam.architectures:
                raise ValueError(f"{fam.name}: GGUF hf_architecture "
                                 f"{fam.gguf.hf_architecture!r} is not one of its architectures")
            by_gguf[fam.gguf.arch] = fam
    return by_name, by_arch, by_plain_gguf, by_gguf_experts


_BY_NAME, _BY_ARCH, _BY_GGUF, _BY_GGUF_EXPERTS = _index()


def register_family(fam: ModelFamily) -> None:
    """Add a model family from outside tidal (a ``tidal.general_plugins`` plugin, which runs in
    every process, so the worker finds it too). Its ``model_class`` is an import string the
    worker imports. An architecture or name tidal already serves is refused, not replaced."""
    if _BY_NAME.get(fam.name) == fam:
        return  # the same registration again (a plugin run twice in one process)
    if fam.name in _BY_NAME:
        raise ValueError(f"model family {fam.name!r} is already registered")
    taken = [arch for arch in fam.architectures if arch in _BY_ARCH]
    if taken:
        raise ValueError(f"architecture(s) {', '.join(taken)} already served by "
                         f"{_BY_ARCH[taken[0]].name!r}")
    if ":" not in fam.model_class:
        raise ValueError(f"model_class must be an import string 'package.module:Class', got "
                         f"{fam.model_class!r}")
    _BY_NAME[fam.name] = fam
    for arch in fam.architectures:
        _BY_ARCH[arch] = fam


def register_model(architecture: str, model_class: str, *,
                   config_like: str = "LlamaForCausalLM") -> ModelFamily:
    """vLLM's ``ModelRegistry.register_model(architecture, "pkg.module:Class")``: serve HF
    configs naming ``architecture`` with ``model_class`` (constructed as the built-in families
    are: ``Class(arch, dtype, impl, tp, pp)``). Its ``config.json`` is read as that of the
    built-in architecture ``config_like`` (the same normaliser, task and window support)."""
    base = _BY_ARCH.get(config_like)
    if base is None:
        raise ValueError(f"config_like={config_like!r} is not an architecture tidal serves; "
                         f"known: {', '.join(supported_architectures())}")
    fam = ModelFamily(architecture, (architecture,), model_class, base.normalise,
                      task=base.task, supports_sliding_window=base.supports_sliding_window)
    register_family(fam)
    return fam


def family(name: str) -> ModelFamily:
    """The family an :class:`ArchSpec` names (``arch.family``)."""
    fam = _BY_NAME.get(name)
    if fam is None:
        raise ValueError(f"no model family {name!r}; known: {', '.join(sorted(_BY_NAME))}")
    return fam


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def gguf_architectures() -> list[str]:
    return sorted(_BY_GGUF.keys() | _BY_GGUF_EXPERTS.keys())


def family_for_architectures(archs: list[str]) -> tuple[str, ModelFamily] | None:
    """The first of an HF config's ``architectures`` tidal serves, with its family."""
    for arch in archs:
        fam = _BY_ARCH.get(arch)
        if fam is not None:
            return arch, fam
    return None


def gguf_family(gguf_arch: str | None, experts: bool = False) -> GGUFFamily | None:
    """The mapping of GGUF files of ``gguf_arch``; ``experts``: the file's metadata has an
    expert count, which picks the arch's ``with_experts`` mapping where there is one."""
    if gguf_arch is None:
        return None
    fam = (_BY_GGUF_EXPERTS.get(gguf_arch) if experts else None) or _BY_GGUF.get(gguf_arch)
    return fam.gguf if fam is not None else None


# A target family -> the family of its multi-token-prediction drafter (``mtp`` method).
_MTP_DRAFTERS: dict[str, str] = {"deepseek_v3": "deepseek_mtp"}


def mtp_families() -> tuple[str, ...]:
    """The target families whose MTP layers tidal can draft with."""
    return tuple(_MTP_DRAFTERS)


def mtp_arch(target: ArchSpec) -> ArchSpec:
    """The ``ArchSpec`` of ``target``'s MTP drafter: the target's sizes (the layer is one of
    the target's kind), under its drafter family (built by the worker, never served)."""
    name = _MTP_DRAFTERS.get(target.family)
    if name is None:
        raise ValueError(f"{target.architecture}: no multi-token-prediction drafter for family "
                         f"{target.family!r} (tidal has them for {', '.join(_MTP_DRAFTERS)})")
    return msgspec.structs.replace(target, family=name,
                                   architecture=family(name).architectures[0])


def arch_from_hf_dict(cfg: dict[str, Any], source: str, *, draft: bool = False) -> ArchSpec:
    """Build an :class:`ArchSpec` from an HF config dict; ``source`` names the file for errors.
    A draft head's config (an EAGLE-3 checkpoint) is accepted only with ``draft``."""
    archs = list(cfg.get("architectures") or [])
    found = family_for_architectures(archs)
    if found is None:
        raise ValueError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"tidal supports {', '.join(supported_architectures())}"
        )
    arch, fam = found
    if fam.task == "draft" and not draft:
        raise ValueError(f"{source}: {arch} is a speculative-decoding draft head (EAGLE-3), "
                         "not a model to serve on its own; name it as the speculative "
                         "config's draft model")
    spec = fam.normalise(cfg, architecture=arch, family=fam.name, source=source)
    if spec.sliding_window is not None and not fam.supports_sliding_window:
        raise ValueError(
            f"{source}: {arch} sets sliding_window={spec.sliding_window}, which tidal's "
            f"{fam.name} implementation does not support"
        )
    return spec
