"""``--speculative-config``: which speculative decoding to run, in vLLM's field names.

Parsed and validated once (``SpeculativeConfig.parse``) into a frozen struct that is part of the
``EngineConfig`` (a msgspec struct like the config's other parts: the config travels to the
EngineCore process and the workers as it is).

Methods: ``ngram`` (prompt lookup: the draft is what followed the latest earlier occurrence of the
sequence's last n tokens); ``draft_model`` (``model``: a smaller model with the target's
vocabulary), ``eagle3`` (``model``: an EAGLE-3 head trained on the target's hidden states) and
``mtp`` (the target's own multi-token-prediction layer, DeepSeek-V3 style: ``model`` may be
omitted, or name the target itself). The other names vLLM knows are not built yet; they are
refused rather than silently run as something else. ``check_draft`` reads the draft's config
when the engine config is made, so an incompatible draft fails at start-up with the reason.

Acceptance (``rejection_sample_method``): ``standard`` keeps the target model's distribution
exactly (greedy: argmax match; sampled: accept / resample from the residual). ``synthetic``
accepts draft tokens at a configured rate whatever the logits, for measuring the speed envelope
(with random-weight models): its output is the drafts', not the target model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from tidal.engine_core.model_arch import ArchSpec

MAX_SPECULATIVE_TOKENS = 8
MAX_PROMPT_LOOKUP = 64
_METHODS = ("ngram", "draft_model", "eagle3", "mtp")
# Methods whose ``model`` is required (a separate draft checkpoint).
_MODEL_METHODS = ("draft_model", "eagle3")
# Methods that draft with a model on the workers (its own KV cache).
_DRAFTER_METHODS = ("draft_model", "eagle3", "mtp")
_NOT_YET = ("eagle", "medusa", "mlp_speculator", "suffix")
_REJECTION_METHODS = ("standard", "synthetic")
_KNOWN = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
          "prompt_lookup_min", "prompt_lookup_max", "prompt_lookup_on_device",
          "rejection_sample_method", "synthetic_acceptance_rate",
          "synthetic_acceptance_rates", "synthetic_acceptance_length",
          "disable_by_batch_size", "speculative_disable_by_batch_size", "disable_by_acceptance",
          "verify_token_cost", "acceptance_window", "acceptance_probe_interval")
# The off-switch (spec_off_switch.py): no drafts above 64 running requests. Measured on an
# H200 (Llama-3.1-8B shape, EAGLE-3, synthetic acceptance 0.8, k = 3, drafting every step):
# 1.33-1.35x plain decode throughput at batch 64 (1.24x in one run on a freshly started
# machine), 0.97x at 128, 0.67x at 256 (tools/results/spec_h200_llama8b_eagle3_*).
DEFAULT_DISABLE_BY_BATCH_SIZE = 64
MAX_ACCEPTANCE_WINDOW = 4096
# The n-gram lookup on the device keeps every batch row's tokens there (int32); above this
# (e.g. 1,024 rows of a 1M-token context) it stays on the host unless asked for.
MAX_NGRAM_HISTORY_BYTES = 2 << 30


def ngram_history_bytes(max_num_seqs: int, max_model_len: int) -> int:
    return max_num_seqs * max_model_len * 4


class SpeculativeConfigError(ValueError):
    """The speculative config is invalid; the message names the field."""


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    method: str
    num_speculative_tokens: int
    # draft_model / eagle3: the draft's path or hub id (resolved by ``check_draft``).
    model: str | None = None
    # What ``check_draft`` found out about the draft, for the start-up log.
    draft_summary: str = ""
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 1
    # ngram: look up the drafts on the device (a copy of the batch rows' tokens there), which
    # also lets speculative steps pipeline under async scheduling; None: decided at start-up
    # (on a GPU, where that copy takes at most 2 GiB). tidal's field, not vLLM's.
    prompt_lookup_on_device: bool | None = None
    rejection_sample_method: str = "standard"
    # Synthetic acceptance: per draft position i, the probability that draft i is accepted
    # given drafts 0..i-1 were (resolved from whichever synthetic_* field was given).
    synthetic_conditional_rates: tuple[float, ...] = ()
    # The off-switch (spec_off_switch.py): no drafts above this many running requests (None:
    # any batch), nor while the measured acceptance does not pay for verifying them.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    disable_by_acceptance: bool = True
    verify_token_cost: float = 0.1
    acceptance_window: int = 32
    acceptance_probe_interval: int = 64

    @property
    def synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    @property
    def drafts_on_device(self) -> bool:
        """The drafts stay on the workers' device between steps (a model drafter, or the
        n-gram lookup on the device): async scheduling can pipeline speculative steps."""
        return self.uses_model or bool(self.prompt_lookup_on_device)

    @property
    def uses_model(self) -> bool:
        """Drafts come from a model (a draft model, an EAGLE-3 head or the target's MTP
        layer) run on the workers."""
        return self.method in _DRAFTER_METHODS

    def describe(self) -> str:
        text = f"method {self.method}, {self.num_speculative_tokens} speculative tokens"
        if self.method == "ngram":
            text += f", prompt lookup n-grams {self.prompt_lookup_min}..{self.prompt_lookup_max}"
        elif self.model is not None:
            text += f", draft {self.model}" + (f" ({self.draft_summary})"
                                                if self.draft_summary else "")
        elif self.draft_summary:
            text += f", {self.draft_summary}"
        if self.method == "ngram":
            text += ", looked up on the device" if self.prompt_lookup_on_device else \
                ", looked up on the host"
        if self.synthetic:
            rates = ", ".join(f"{r:.3f}" for r in self.synthetic_conditional_rates)
            text += (f", SYNTHETIC acceptance (per-position conditional rates {rates}): outputs "
                     "are the drafts', not the model's; for speed measurements only")
        else:
            text += ", standard rejection sampling (the target's distribution exactly)"
        return text

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> SpeculativeConfig | None:
        """The config from ``--speculative-config``'s JSON object; None when not given."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        unknown = sorted(set(raw) - set(_KNOWN))
        if unknown:
            raise SpeculativeConfigError(
                f"--speculative-config: unknown field(s) {', '.join(unknown)} (known: "
                f"{', '.join(_KNOWN)})")
        method = raw.get("method")
        if method in _NOT_YET:
            raise SpeculativeConfigError(
                f"--speculative-config: method {method!r} is not yet implemented in tidal "
                f"(available: {', '.join(_METHODS)})")
        if method not in _METHODS:
            raise SpeculativeConfigError(
                f"--speculative-config: method must be one of {', '.join(_METHODS)}, "
                f"got {method!r}")
        model = raw.get("model")
        if method in _MODEL_METHODS:
            if not isinstance(model, str) or not model:
                raise SpeculativeConfigError(
                    f"--speculative-config: method {method!r} needs model (the "
                    f"{'draft model' if method == 'draft_model' else 'EAGLE-3 head'}'s path "
                    "or hub id)")
        if method in _DRAFTER_METHODS:
            stray = [n for n in ("prompt_lookup_min", "prompt_lookup_max") if n in raw]
            if stray:
                raise SpeculativeConfigError(
                    f"--speculative-config: {stray[0]} applies to method 'ngram' only")
        if method == "mtp":
            if model is not None and (not isinstance(model, str) or not model):
                raise SpeculativeConfigError(
                    "--speculative-config: model of method 'mtp' must be the target's path "
                    f"or hub id (or omitted), got {model!r}")
        elif method not in _MODEL_METHODS and model is not None:
            raise SpeculativeConfigError(
                f"--speculative-config: model applies to methods {', '.join(_MODEL_METHODS)}, "
                f"not {method!r}")
        draft_tp = _int(raw, "draft_tensor_parallel_size", 1)
        if "draft_tensor_parallel_size" in raw and method not in _DRAFTER_METHODS:
            raise SpeculativeConfigError(
                "--speculative-config: draft_tensor_parallel_size applies to methods "
                f"{', '.join(_DRAFTER_METHODS)}, not {method!r}")
        if draft_tp != 1:
            raise SpeculativeConfigError(
                "--speculative-config: draft_tensor_parallel_size other than 1 is not yet "
                f"implemented in tidal (got {draft_tp}): the draft runs whole on one GPU")
        k = _int(raw, "num_speculative_tokens", None)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"--speculative-config: num_speculative_tokens must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        # As vLLM: one bound given stands for both; neither means 5.
        lo_raw, hi_raw = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        lo = _int(raw, "prompt_lookup_min", hi_raw if hi_raw is not None else 5)
        hi = _int(raw, "prompt_lookup_max", lo_raw if lo_raw is not None else 5)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not 1 <= value <= MAX_PROMPT_LOOKUP:
                raise SpeculativeConfigError(
                    f"--speculative-config: {name} must be in [1, {MAX_PROMPT_LOOKUP}], "
                    f"got {value}")
        if lo > hi:
            raise SpeculativeConfigError(
                f"--speculative-config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max "
                f"({hi})")
        on_device = raw.get("prompt_lookup_on_device")
        if on_device is not None and (not isinstance(on_device, bool) or method != "ngram"):
            raise SpeculativeConfigError(
                "--speculative-config: prompt_lookup_on_device must be true, false or null, "
                f"for method 'ngram' only (got {on_device!r} with method {method!r})")
        rejection = raw.get("rejection_sample_method", "standard")
        if rejection not in _REJECTION_METHODS:
            raise SpeculativeConfigError(
                "--speculative-config: rejection_sample_method must be one of "
                f"{', '.join(_REJECTION_METHODS)}, got {rejection!r}")
        synthetic_fields = [n for n in _KNOWN if n.startswith("synthetic_") and n in raw]
        rates: tuple[float, ...] = ()
        if rejection == "synthetic":
            rates = _synthetic_rates(raw, synthetic_fields, k)
        elif synthetic_fields:
            raise SpeculativeConfigError(
                f"--speculative-config: {synthetic_fields[0]} needs rejection_sample_method "
                "'synthetic'")
        return cls(method=method, num_speculative_tokens=k, model=model, prompt_lookup_min=lo,
                   prompt_lookup_max=hi, prompt_lookup_on_device=on_device,
                   rejection_sample_method=rejection,
                   synthetic_conditional_rates=rates, **_off_switch(raw))


def _off_switch(raw: dict[str, Any]) -> dict[str, Any]:
    """The off-switch's fields; ``disable_by_batch_size`` also under vLLM's old engine-argument
    name, and null for no batch-size limit."""
    names = [n for n in ("disable_by_batch_size", "speculative_disable_by_batch_size")
             if n in raw]
    if len(names) > 1:
        raise SpeculativeConfigError(
            "--speculative-config: give disable_by_batch_size or its vLLM name "
            "speculative_disable_by_batch_size, not both")
    out: dict[str, Any] = {}
    if names and raw[names[0]] is not None:
        limit = _int(raw, names[0], None)
        if limit < 1:
            raise SpeculativeConfigError(
                f"--speculative-config: {names[0]} must be >= 1 (null: no limit), got {limit}")
        out["disable_by_batch_size"] = limit
    elif names:
        out["disable_by_batch_size"] = None
    if "disable_by_acceptance" in raw:
        flag = raw["disable_by_acceptance"]
        if not isinstance(flag, bool):
            raise SpeculativeConfigError(
                f"--speculative-config: disable_by_acceptance must be true or false, "
                f"got {flag!r}")
        out["disable_by_acceptance"] = flag
    if "verify_token_cost" in raw:
        cost = _float(raw["verify_token_cost"], "verify_token_cost")
        if not 0.0 <= cost <= 1.0:
            raise SpeculativeConfigError(
                f"--speculative-config: verify_token_cost must be in [0, 1], got {cost}")
        out["verify_token_cost"] = cost
    for name, top in (("acceptance_window", MAX_ACCEPTANCE_WINDOW),
                      ("acceptance_probe_interval", MAX_ACCEPTANCE_WINDOW)):
        if name in raw:
            value = _int(raw, name, None)
            if not 1 <= value <= top:
                raise SpeculativeConfigError(
                    f"--speculative-config: {name} must be in [1, {top}], got {value}")
            out[name] = value
    return out


def _int(raw: dict[str, Any], name: str, default: int | None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise SpeculativeConfigError(f"--speculative-config: {name} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(f"--speculative-config: {name} must be an integer, "
                                     f"got {value!r}")
    return value


def _synthetic_rates(raw: dict[str, Any], given: list[str], k: int) -> tuple[float, ...]:
    """Per-position conditional acceptance rates from exactly one of: a rate alpha (each draft
    accepted with probability alpha), vLLM's per-position unconditional rates, or vLLM's mean
    acceptance length."""
    if len(given) != 1:
        raise SpeculativeConfigError(
            "--speculative-config: rejection_sample_method 'synthetic' needs exactly one of "
            "synthetic_acceptance_rate, synthetic_acceptance_rates, synthetic_acceptance_length"
            f" (got {', '.join(given) or 'none'})")
    name = given[0]
    value = raw[name]
    if name == "synthetic_acceptance_rate":
        alpha = _float(value, name)
        if not 0.0 <= alpha <= 1.0:
            raise SpeculativeConfigError(
                f"--speculative-config: {name} must be in [0, 1], got {alpha}")
        return (alpha,) * k
    if name == "synthetic_acceptance_length":
        length = _float(value, name)
        if not 1.0 <= length <= k + 1:
            raise SpeculativeConfigError(
                f"--speculative-config: {name} must be in [1, {k + 1}], got {length}")
        # The least-variance schedule: the first drafts always, one fractional, then none.
        whole = int(length - 1.0)
        frac = (length - 1.0) - whole
        unconditional = [1.0] * whole + [frac] + [0.0] * k
        return _conditional(unconditional[:k])
    if not isinstance(value, list) or len(value) != k:
        raise SpeculativeConfigError(
            f"--speculative-config: {name} must be a list of num_speculative_tokens ({k}) "
            f"numbers, got {value!r}")
    rates = [_float(v, name) for v in value]
    if any(not 0.0 <= r <= 1.0 for r in rates) or any(
            b > a for a, b in zip(rates, rates[1:])):
        raise SpeculativeConfigError(
            f"--speculative-config: {name} must be non-increasing numbers in [0, 1], "
            f"got {rates}")
    return _conditional(rates)


def _conditional(unconditional: list[float]) -> tuple[float, ...]:
    """P(draft i accepted | drafts < i accepted) from P(drafts 0..i all accepted)."""
    out, prev = [], 1.0
    for r in unconditional:
        out.append(r / prev if prev > 0 else 0.0)
        prev = r
    return tuple(out)


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpeculativeConfigError(f"--speculative-config: {name} must be a number, "
                                     f"got {value!r}")
    return float(value)


def check_draft(spec: SpeculativeConfig, target: ArchSpec, *, target_name: str = ""
                ) -> SpeculativeConfig:
    """Read the draft's config (``spec.model``) and check it can draft for ``target``: a draft
    model shares the target's vocabulary (ids mean the same tokens: verification compares them
    one to one); an EAGLE-3 head has the target's vocabulary, a draft vocabulary within it, and
    was trained on hidden states of the target's width from layers the target has. Returns the
    config with the resolved path and a summary for the start-up log."""
    from tidal.engine_core.model_arch import arch_from_hf_dict
    from tidal.engine_core.model_source import load_hf_config, resolve_model

    if spec.method == "mtp":
        return _check_mtp(spec, target, target_name)
    if not spec.uses_model or spec.model is None:
        return spec
    where = f"--speculative-config: model {spec.model!r}"
    try:
        src = resolve_model(spec.model)
        draft = arch_from_hf_dict(load_hf_config(src), src.path, draft=True)
    except (ValueError, OSError) as exc:
        raise SpeculativeConfigError(f"{where}: {exc}") from None
    is_head = draft.family == "eagle3"
    if spec.method == "draft_model":
        if is_head:
            raise SpeculativeConfigError(
                f"{where} is an EAGLE-3 head: use method 'eagle3' for it")
        if draft.is_embedding:
            raise SpeculativeConfigError(f"{where} is an embedding model, not a draft model")
        if draft.is_mla:
            raise SpeculativeConfigError(
                f"{where}: a draft model with multi-head latent attention ({draft.architecture}"
                ") is not supported yet")
        if draft.vocab_size != target.vocab_size:
            raise SpeculativeConfigError(
                f"{where}: its vocabulary has {draft.vocab_size} tokens, the target's "
                f"{target.vocab_size}: a draft model needs the target's tokenizer")
        summary = (f"{draft.architecture}, {draft.num_layers} layers, hidden "
                   f"{draft.hidden_size}, vocabulary {draft.vocab_size}")
    else:
        if not is_head:
            raise SpeculativeConfigError(
                f"{where} is not an EAGLE-3 head ({draft.architecture}); use method "
                "'draft_model' for a standalone draft model")
        if draft.vocab_size != target.vocab_size:
            raise SpeculativeConfigError(
                f"{where}: the head's vocabulary has {draft.vocab_size} tokens, the target's "
                f"{target.vocab_size}")
        draft_vocab = draft.draft_vocab_size or draft.vocab_size
        if draft_vocab > target.vocab_size:
            raise SpeculativeConfigError(
                f"{where}: draft_vocab_size {draft_vocab} exceeds the target's vocabulary "
                f"({target.vocab_size})")
        trained_on = draft.target_hidden_size or draft.hidden_size
        if trained_on != target.hidden_size:
            raise SpeculativeConfigError(
                f"{where}: the head was trained on hidden states of size {trained_on}, the "
                f"target's are {target.hidden_size} (target_hidden_size)")
        n = target.num_layers
        layers = draft.aux_hidden_layer_ids or (2, n // 2, n - 3)
        if len(layers) != 3 or not all(0 <= i < n for i in layers):
            raise SpeculativeConfigError(
                f"{where}: its auxiliary hidden-state layers {list(layers)} must be 3 of the "
                f"target's layers 0..{n - 1}")
        summary = (f"EAGLE-3 head, hidden {draft.hidden_size}, draft vocabulary {draft_vocab} "
                   f"of {draft.vocab_size}, target hidden {trained_on}, target layers "
                   f"{list(layers)}")
    return msgspec.structs.replace(spec, model=src.path, draft_summary=summary)


def _check_mtp(spec: SpeculativeConfig, target: ArchSpec, target_name: str
               ) -> SpeculativeConfig:
    """``mtp`` drafts with the target's own multi-token-prediction layer: the target must have
    one (``num_nextn_predict_layers``) of a family tidal drafts with; a ``model`` given must be
    the target itself (same architecture and sizes). Returns the config without ``model`` and
    with a summary for the start-up log."""
    from tidal.engine_core.model_arch import arch_from_hf_dict
    from tidal.engine_core.model_registry import mtp_families
    from tidal.engine_core.model_source import load_hf_config, resolve_model

    name = f"{target_name!r} ({target.architecture})" if target_name else target.architecture
    if target.num_nextn_predict_layers < 1:
        raise SpeculativeConfigError(
            f"--speculative-config: method 'mtp' needs a target with multi-token-prediction "
            f"layers, and the model {name} has none (num_nextn_predict_layers is "
            f"{target.num_nextn_predict_layers} or missing in its config.json)")
    if target.family not in mtp_families():
        raise SpeculativeConfigError(
            f"--speculative-config: method 'mtp' for {name} is not yet implemented in tidal "
            f"(MTP layers of {', '.join(mtp_families())} targets only)")
    if spec.model is not None:
        where = f"--speculative-config: model {spec.model!r}"
        try:
            src = resolve_model(spec.model)
            given = arch_from_hf_dict(load_hf_config(src), src.path)
        except (ValueError, OSError) as exc:
            raise SpeculativeConfigError(f"{where}: {exc}") from None
        if given != target:
            raise SpeculativeConfigError(
                f"{where}: method 'mtp' drafts with the target's own MTP layer, read from "
                f"the target's checkpoint; model must be the target itself or omitted "
                f"(it is a {given.architecture}, not the target's configuration)")
    n = target.num_nextn_predict_layers
    summary = (f"MTP layer {target.num_layers} of the target (hidden {target.hidden_size}, "
               f"{n} in the checkpoint, the first used)")
    if spec.num_speculative_tokens > 1:
        summary += f", reused for each of the {spec.num_speculative_tokens} draft steps"
    return msgspec.structs.replace(spec, model=None, draft_summary=summary)
