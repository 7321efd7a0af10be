"""The architecture of a model, normalised from an HF ``config.json`` (or GGUF metadata).

This struct carries the ways the families differ, so the worker never reads raw HF configs; the
normalisers here build it, one per family shape. Which architectures exist, and which normaliser
and model class each uses, is the registry's (:mod:`~tidal.engine_core.model_registry`).
"""

from __future__ import annotations

from typing import Any

import msgspec

class ArchSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    architecture: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # Indices of the layers that use ``sliding_window``; None: every layer (Mistral). Qwen2
    # windows only layers >= max_window_layers (or those its ``layer_types`` marks).
    window_layers: tuple[int, ...] | None = None
    # Gemma: c * tanh(x / c) on the attention scores / the final logits; the query scale is
    # query_pre_attn_scalar ** -0.5; windowed layers rotate with their own rope base (Gemma 3).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    # Embedding (encoder) models only.
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    # EAGLE-3 draft heads only: the LM head's vocabulary (a subset of the target's, mapped
    # by the checkpoint's ``d2t``), the target's hidden size (the fc input is 3x it), where
    # the hidden norm sits, and the target layers whose hidden states feed the head.
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    norm_before_residual: bool = False
    aux_hidden_layer_ids: tuple[int, ...] | None = None
    # Mixture of experts (``moe_arch``); num_experts 0: a dense model. Routing: each token's
    # ``scoring_func`` scores over the experts, the best ``num_experts_per_tok`` picked among
    # the ``topk_group`` best of ``n_group`` groups (DeepSeek), their weights divided by their
    # sum when ``norm_topk_prob``, then times ``routed_scaling_factor``. ``n_shared_experts``
    # dense experts of ``shared_expert_intermediate_size`` (0: n_shared * moe size) run on
    # every token. ``moe_layers``: the layers that are MoE (None: every layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] | None = None
    # DeepSeek-V3's routing ("noaux_tc"): a group scores the sum of its two best experts, and
    # each router has an ``e_score_correction_bias`` added to the scores for the choice only.
    topk_method: str = "greedy"
    # DeepSeek-V3: multi-token-prediction layers after the decoder's, ``layers.{num_layers +
    # i}`` in the checkpoint (the ``mtp`` speculative method's drafter; not part of the model).
    num_nextn_predict_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2, ``deepseek_v2_arch``); kv_lora_rank 0: not MLA.
    # Each token caches one latent of kv_lora_rank values plus a rotated key of
    # qk_rope_head_dim shared by every head; q_lora_rank None: q is one projection, no LoRA.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        if self.num_experts == 0:
            return False
        return self.moe_layers is None or layer in self.moe_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_sliding_window(self, layer: int) -> int | None:
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    @property
    def is_embedding(self) -> bool:
        # Imported here: the registry imports this module's normalisers.
        from tidal.engine_core.model_registry import family

        return family(self.family).task == "embed"


def arch_from_hf_dict(cfg: dict[str, Any], source: str, *, draft: bool = False) -> ArchSpec:
    """Build an :class:`ArchSpec` from an HF config dict; ``source`` names the file for errors;
    ``draft``: a speculative-decoding draft head (EAGLE-3) is accepted too.

    The architecture list and each family's normaliser live in
    :mod:`~tidal.engine_core.model_registry`.
    """
    from tidal.engine_core.model_registry import arch_from_hf_dict as from_registry

    return from_registry(cfg, source, draft=draft)


def decoder_arch(cfg: dict[str, Any], *, architecture: str, family: str, source: str,
                 qkv_bias: bool | None = None, qk_norm: bool = False,
                 window_flag: str | None = "use_sliding_window") -> ArchSpec:
    """The normaliser of the Llama-shaped decoder families.

    ``qkv_bias`` None reads ``attention_bias``; ``window_flag`` names the config flag that turns
    ``sliding_window`` on for the layers Qwen2's rules pick, None when a set ``sliding_window``
    applies to every layer (Mistral).
    """
    arch = architecture
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    rope_theta, rope_scaling = _rope(cfg)
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{source}: unsupported activation {act!r} (tidal supports silu)")
    enabled = window_flag is None or bool(cfg.get(window_flag, False))
    sliding = cfg.get("sliding_window") if enabled else None
    window_layers = _qwen2_window_layers(cfg) if sliding and window_flag is not None else None
    return ArchSpec(
        architecture=arch,
        family=family,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)) if qkv_bias is None else qkv_bias,
        qk_norm=qk_norm,
        sliding_window=int(sliding) if sliding else None,
        window_layers=window_layers if sliding else None,
    )


def _qwen2_window_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    # As transformers' Qwen2Config: explicit ``layer_types`` win, else layers from
    # ``max_window_layers`` (default 28) on are windowed.
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types[:n]) if t == "sliding_attention")
    first = int(cfg.get("max_window_layers", 28))
    return tuple(range(first, n))


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 folds theta and scaling into ``rope_parameters``; older versions keep
    # ``rope_theta`` and ``rope_scaling`` apart. Accept both.
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return theta, None
        scaling["rope_type"] = kind
    return theta, scaling


def phi3_arch(cfg: dict[str, Any], *, architecture: str, family: str, source: str) -> ArchSpec:
    """The normaliser of Phi-3: the decoder's, with a set ``sliding_window`` on every layer and
    LongRoPE ("su"/"longrope"; HF's Phi3Config reads "yarn" as longrope too), whose trained
    length hub configs keep at the top level as ``original_max_position_embeddings``."""
    params = cfg.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial} is not supported "
                         "(tidal's Phi-3 rotates whole heads)")
    spec = decoder_arch(cfg, architecture=architecture, family=family, source=source,
                        qkv_bias=False, window_flag=None)
    if spec.rope_scaling is None:
        return spec
    scaling = dict(spec.rope_scaling)
    if scaling["rope_type"] not in ("su", "longrope", "yarn"):
        raise ValueError(f"{source}: unsupported rope scaling {scaling['rope_type']!r} for "
                         f"{architecture} (tidal supports longrope / su)")
    scaling["rope_type"] = "longrope"
    scaling.setdefault("original_max_position_embeddings",
                       cfg.get("original_max_position_embeddings"))
    half = spec.head_dim // 2
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or len(factors) != half:
            raise ValueError(f"{source}: rope scaling {key} must be a list of {half} numbers "
                             "(half the head size)")
    if not scaling["original_max_position_embeddings"]:
        raise ValueError(f"{source}: LongRoPE needs original_max_position_embeddings")
    return msgspec.structs.replace(spec, rope_scaling=scaling)


_GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_arch(cfg: dict[str, Any], *, architecture: str, family: str, source: str) -> ArchSpec:
    """The normaliser of Gemma 2 and Gemma 3 text. Missing keys take the defaults of HF's config
    classes (they differ between the two); layers are windowed as ``layer_types`` says, or one
    global layer in every ``sliding_window_pattern`` (2 for Gemma 2, 6 for Gemma 3)."""
    gemma3 = family == "gemma3"
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention (Gemma embedding models) is "
                         "not supported")
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{source}: unsupported hidden_activation {act!r} (tidal's Gemma "
                         "supports gelu_pytorch_tanh)")
    window = cfg.get("sliding_window", 4096)
    if not window:
        raise ValueError(f"{source}: Gemma's local layers need a sliding_window")
    n = int(cfg["num_hidden_layers"])
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if isinstance(pattern, list):  # GGUF may give one flag per layer (True: windowed)
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        every = int(pattern or (6 if gemma3 else 2))
        types = list(cfg.get("layer_types") or (
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(n)))
    if len(types) != n or any(t not in _GEMMA_LAYER_TYPES for t in types):
        raise ValueError(f"{source}: layer_types must give each of the {n} layers one of "
                         f"{', '.join(_GEMMA_LAYER_TYPES)}")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: one rope per kind of layer
        theta, scaling = _rope({"rope_parameters": params["full_attention"]})
        local_theta, local_scaling = _rope({"rope_parameters": params.get("sliding_attention")
                                            or {"rope_theta": 10000.0}})
    else:
        theta, scaling = _rope(dict(cfg, rope_theta=cfg.get("rope_theta",
                                                             1e6 if gemma3 else 10000.0)))
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq", 10000.0)), None
    if local_scaling is not None or (scaling is not None and scaling["rope_type"] != "linear"):
        raise ValueError(f"{source}: unsupported rope scaling {local_scaling or scaling} for "
                         f"{architecture} (tidal supports linear scaling of the global layers)")
    num_heads = int(cfg["num_attention_heads"])
    hidden, head_dim = int(cfg["hidden_size"]), int(cfg.get("head_dim") or 256)
    scalar = cfg.get("query_pre_attn_scalar")
    if scalar is None:
        # Hub configs always set it; GGUF files never do, and llama.cpp derives it: hidden /
        # heads for the 27B models (46 layers in Gemma 2, 62 in Gemma 3), else head_dim.
        scalar = hidden // num_heads if n == (62 if gemma3 else 46) else head_dim
    return ArchSpec(
        architecture=architecture,
        family=family,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings")
                                    or (131072 if gemma3 else 8192)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=gemma3,
        hidden_act=act,
        sliding_window=int(window),
        window_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping",
                                                   None if gemma3 else 50.0)),
        final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping",
                                                    None if gemma3 else 30.0)),
        query_pre_attn_scalar=float(scalar),
        rope_local_theta=local_theta if gemma3 else None,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def bert_arch(cfg: dict[str, Any], *, architecture: str, family: str, source: str) -> ArchSpec:
    """The normaliser of BERT encoders (embedding models)."""
    arch = architecture
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    act = cfg.get("hidden_act", "gelu")
    return ArchSpec(
        architecture=arch,
        family=family,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 512),
        hidden_act=act,
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
    )


def eagle3_arch(cfg: dict[str, Any], *, architecture: str, family: str, source: str) -> ArchSpec:
    """The normaliser of EAGLE-3 draft heads, in either published layout: a flat Llama config
    with ``draft_vocab_size`` (EAGLE's and SGLang's checkpoints; the aux layer ids, if any,
    under ``eagle_config``), or the ``speculators`` one, whose decoder layer config is nested
    as ``transformer_layer_config`` and whose hidden norm comes before the residual unless
    ``norm_before_residual`` says otherwise."""
    nested = cfg.get("transformer_layer_config")
    layer_cfg = dict(nested) if isinstance(nested, dict) else cfg
    eagle_cfg = cfg.get("eagle_config") or {}
    if eagle_cfg.get("use_aux_hidden_state") is False:
        raise ValueError(f"{source}: use_aux_hidden_state=false (an EAGLE-1 style head) is not "
                         "supported; tidal's EAGLE-3 head fuses the target's hidden states")
    layers = int(layer_cfg.get("num_hidden_layers", 1))
    if layers != 1:
        raise ValueError(f"{source}: an EAGLE-3 head of {layers} decoder layers is not "
                         "supported (tidal's has one)")
    spec = decoder_arch(dict(layer_cfg, num_hidden_layers=1), architecture=architecture,
                        family=family, source=source, qkv_bias=False)
    if spec.sliding_window is not None:
        raise ValueError(f"{source}: an EAGLE-3 head with a sliding window is not supported")
    draft_vocab = int(cfg.get("draft_vocab_size") or spec.vocab_size)
    if not 0 < draft_vocab <= spec.vocab_size:
        raise ValueError(f"{source}: draft_vocab_size {draft_vocab} must be within the "
                         f"vocabulary of {spec.vocab_size} tokens")
    target_hidden = cfg.get("target_hidden_size") or layer_cfg.get("target_hidden_size")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get(
        "eagle_aux_hidden_state_layer_ids")
    if aux is not None and (not isinstance(aux, list) or len(aux) != 3
                            or not all(isinstance(i, int) and i >= 0 for i in aux)):
        raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids must list 3 layer "
                         f"indices, got {aux!r}")
    return msgspec.structs.replace(
        spec,
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(target_hidden) if target_hidden else spec.hidden_size,
        norm_before_residual=bool(cfg.get("norm_before_residual", nested is not None)),
        aux_hidden_layer_ids=tuple(aux) if aux is not None else None,
    )


def moe_routing(cfg: dict[str, Any], *, family: str, source: str,
                num_layers: int) -> dict[str, Any]:
    """The :class:`ArchSpec` MoE fields of an HF config, in any of the published spellings:
    Mixtral (``num_local_experts``, weights always renormalised), Qwen3-MoE (``num_experts``,
    ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``) and DeepSeek
    (``n_routed_experts``, grouped top-k, shared experts, ``first_k_dense_replace``,
    ``moe_layer_freq``). An empty dict for a dense config."""
    experts = (cfg.get("num_local_experts") or cfg.get("num_experts")
               or cfg.get("n_routed_experts") or 0)
    experts = int(experts)
    if experts == 0:
        return {}
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"{source}: num_experts_per_tok must be 1..{experts} (the number of "
                         f"experts), got {cfg.get('num_experts_per_tok')!r}")
    scoring = str(cfg.get("scoring_func") or "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"{source}: unsupported scoring_func {scoring!r} (tidal supports "
                         "softmax, sigmoid)")
    method = cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"{source}: unsupported topk_method {method!r}")
    groups = int(cfg.get("n_group") or 1) if method != "greedy" else 1
    topk_groups = int(cfg.get("topk_group") or 1) if method != "greedy" else 1
    if experts % groups or not 0 < topk_groups <= groups:
        raise ValueError(f"{source}: n_group={groups} must divide the {experts} experts and "
                         f"topk_group={topk_groups} be 1..n_group")
    if family == "mixtral":
        renormalize = True  # Mixtral's router has no flag: it always renormalises
    else:
        renormalize = bool(cfg.get("norm_topk_prob", family != "qwen3_moe"))
    moe_size = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared = int(cfg.get("n_shared_experts") or 0)
    shared_size = int(cfg.get("shared_expert_intermediate_size") or 0)
    # Which layers are MoE, as each family's modeling code decides it.
    dense_only = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    if step < 1 or freq < 1:
        raise ValueError(f"{source}: decoder_sparse_step and moe_layer_freq must be >= 1")
    layers = tuple(i for i in range(num_layers)
                   if i not in dense_only and (i + 1) % step == 0
                   and i >= first_dense and i % freq == 0)
    extra = {"topk_method": "noaux_tc"} if method == "noaux_tc" else {}
    return {
        **extra,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": moe_size,
        "norm_topk_prob": renormalize,
        "scoring_func": scoring,
        "n_group": groups,
        "topk_group": topk_groups,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "n_shared_experts": shared,
        "shared_expert_intermediate_size": shared_size,
        "moe_layers": None if len(layers) == num_layers else layers,
    }


def moe_arch(cfg: dict[str, Any], *, architecture: str, family: str, source: str,
             qk_norm: bool = False) -> ArchSpec:
    """The normaliser of the Llama-shaped MoE families (Mixtral, Qwen3-MoE with ``qk_norm``):
    the decoder's attention, with the routing fields of :func:`moe_routing`. Only the keys the
    family's HF modeling code reads are read: others (DeepSeek's grouped routing, shared
    experts; for Mixtral also Qwen's layer selection and expert size) are ignored, as HF
    ignores them."""
    spec = decoder_arch(cfg, architecture=architecture, family=family, source=source,
                        qkv_bias=False, qk_norm=qk_norm,
                        window_flag=None if family == "mixtral" else "use_sliding_window")
    read = _MOE_KEYS[family]
    routing_cfg = {k: v for k, v in cfg.items() if k in read or k not in _ALL_MOE_KEYS}
    fields = moe_routing(routing_cfg, family=family, source=source,
                         num_layers=spec.num_layers)
    if not fields:
        raise ValueError(f"{source}: {architecture} needs a number of experts "
                         f"({' / '.join(sorted(k for k in read if k.endswith('experts')))})")
    return msgspec.structs.replace(spec, **fields)


# The MoE config keys each family's HF modeling code reads (``moe_arch``).
_MOE_KEYS: dict[str, frozenset[str]] = {
    "mixtral": frozenset({"num_local_experts", "num_experts_per_tok"}),
    "qwen3_moe": frozenset({"num_experts", "num_local_experts", "num_experts_per_tok",
                            "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                            "mlp_only_layers"}),
}
_ALL_MOE_KEYS = frozenset({
    "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "scoring_func", "topk_method", "n_group",
    "topk_group", "routed_scaling_factor", "n_shared_experts", "shared_expert_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace", "moe_layer_freq",
})


def deepseek_v2_arch(cfg: dict[str, Any], *, architecture: str, family: str,
                     source: str) -> ArchSpec:
    """The normaliser of DeepSeek-V2 (and V2-Lite, ``q_lora_rank`` null): multi-head latent
    attention, YaRN rope with DeepSeek's mscale, dense MLPs on the first
    ``first_k_dense_replace`` layers and routed + shared experts after them (every
    ``moe_layer_freq``-th layer), routed greedily or by groups ("group_limited_greedy").
    Missing keys take the defaults of HF's ``DeepseekV2Config``.

    DeepSeek-V3 (``family`` "deepseek_v3") differs in configuration only, as HF's
    ``DeepseekV3`` reads it: sigmoid scores with a per-router ``e_score_correction_bias`` and
    "noaux_tc" grouped top-k (whatever ``scoring_func`` / ``topk_method`` say), no
    ``moe_layer_freq``, other defaults (``DeepseekV3Config``'s), and its
    ``num_nextn_predict_layers`` MTP layers after the decoder's, classified dense / MoE by the
    same rule (``moe_layers`` covers them)."""
    v3 = family == "deepseek_v3" or family == "deepseek_mtp"
    if v3:
        method = cfg.get("topk_method") or "noaux_tc"
        if method != "noaux_tc" or (cfg.get("scoring_func") or "sigmoid") != "sigmoid":
            raise ValueError(f"{source}: {architecture} routes by sigmoid scores and noaux_tc "
                             f"top-k, got scoring_func {cfg.get('scoring_func')!r}, "
                             f"topk_method {cfg.get('topk_method')!r}")
        if cfg.get("rope_interleave", True) is False:
            raise ValueError(f"{source}: rope_interleave false is not supported for "
                             f"{architecture} (tidal rotates interleaved pairs)")
        cfg = {**_V3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None},
               "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{source}: unsupported activation {act!r} (tidal supports silu)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias is not supported for {architecture}")
    method = cfg.get("topk_method") or "greedy"
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"{source}: topk_method {method!r} is not supported for "
                         f"{architecture} (tidal supports greedy, group_limited_greedy)")
    if not v3 and (cfg.get("scoring_func") or "softmax") != "softmax":
        raise ValueError(f"{source}: {architecture} scores experts by softmax, got "
                         f"scoring_func {cfg.get('scoring_func')!r}")
    num_heads = int(cfg["num_attention_heads"])
    nope = int(cfg.get("qk_nope_head_dim", 128))
    rope_dim = int(cfg.get("qk_rope_head_dim", 64))
    v_dim = int(cfg.get("v_head_dim", 128))
    kv_rank = int(cfg.get("kv_lora_rank", 512))
    q_rank = cfg.get("q_lora_rank", 1536)
    if min(nope, rope_dim, v_dim, kv_rank) < 1 or rope_dim % 2 or (q_rank is not None
                                                                   and int(q_rank) < 1):
        raise ValueError(f"{source}: MLA sizes must be positive and qk_rope_head_dim even "
                         f"(qk_nope_head_dim={nope}, qk_rope_head_dim={rope_dim}, "
                         f"v_head_dim={v_dim}, kv_lora_rank={kv_rank}, q_lora_rank={q_rank})")
    theta, scaling = _rope(cfg)
    if scaling is not None:
        if scaling["rope_type"] != "yarn":
            raise ValueError(f"{source}: unsupported rope scaling {scaling['rope_type']!r} for "
                             f"{architecture} (tidal supports yarn)")
        if not scaling.get("factor") or not scaling.get("original_max_position_embeddings"):
            raise ValueError(f"{source}: yarn rope scaling needs factor and "
                             "original_max_position_embeddings")
    n = int(cfg["num_hidden_layers"])
    nextn = int(cfg.get("num_nextn_predict_layers") or 0) if v3 else 0
    if nextn < 0:
        raise ValueError(f"{source}: num_nextn_predict_layers must be >= 0, got {nextn}")
    # HF's DeepseekV2Config leaves norm_topk_prob off unless the config turns it on.
    routing = moe_routing(dict(cfg, norm_topk_prob=bool(cfg.get("norm_topk_prob", False))),
                          family=family, source=source, num_layers=n + nextn)
    return ArchSpec(
        architecture=architecture,
        family=family,
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n,
        num_heads=num_heads,
        # One latent "head" is cached, but every query head has its own K/V once expanded.
        num_kv_heads=num_heads,
        head_dim=nope + rope_dim,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=kv_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_dim,
        num_nextn_predict_layers=nextn,
        **routing,
    )


# HF's ``DeepseekV3Config`` defaults for the keys where they differ from V2's.
_V3_DEFAULTS: dict[str, Any] = {
    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "n_shared_experts": 1, "norm_topk_prob": True, "n_routed_experts": 256,
    "num_experts_per_tok": 8,
}
