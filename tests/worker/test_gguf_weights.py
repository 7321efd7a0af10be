"""GGUF tensors -> HF-named float32 tensors, checked against transformers' own GGUF loader.

Two kinds of files: the real SmolLM2-135M checkpoint (Q4_1 / Q8_0 / F32), and tiny synthetic
files for each supported architecture, written here with ``gguf.GGUFWriter`` from random
HF-layout tensors stored as F32, F16 and Q8_0. For the synthetic files there are two references:
transformers loading the same file, and the original random tensors themselves (exact for F32,
exact after an fp16 round trip for F16, within quantization error for Q8_0), which checks the
llama Q/K un-permutation independently of transformers.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tidal.engine_core.gguf_config import gguf_to_hf_config
from tidal.worker.loader.gguf_weights import gguf_tensor_names, iter_gguf_weights

def _hf_model(path: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    # transformers rebuilds gguf's tensor-name map (a pure function of architecture and layer
    # count) once per submodule: ~400 times for SmolLM2, over half of its load time here.
    # Caching it speeds the reference up without changing what it loads.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )


# --- the real checkpoint ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path, smollm2_hf) -> tuple[Path, dict[str, torch.Tensor]]:
    """The real file and transformers' float32 state dict for it (loaded once per session:
    test_model_golden compares outputs against the same model)."""
    return smollm2_path, smollm2_hf.state_dict()


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers(
    smollm2: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, hf_state = smollm2
    # Tied embeddings: transformers exposes lm_head.weight as the embedding; the file lacks it.
    assert torch.equal(hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"])
    expected_names = set(hf_state) - {"lm_head.weight"}

    seen: list[str] = []
    start = time.perf_counter()
    for name, tensor in iter_gguf_weights(path):
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == hf_state[name].shape, name
        assert torch.equal(tensor, hf_state[name]), name
        seen.append(name)
    elapsed = time.perf_counter() - start

    assert len(seen) == len(set(seen))
    assert set(seen) == expected_names
    assert gguf_tensor_names(path) == seen
    print(f"iterated {len(seen)} SmolLM2 tensors (with comparisons) in {elapsed:.2f}s")


# --- synthetic files ----------------------------------------------------------------------

# Rotated over the 2-D tensors so every file holds each type; 1-D tensors alternate F32/F16.
_MATRIX_TYPES = (QType.F32, QType.F16, QType.Q8_0)
_VECTOR_TYPES = (QType.F32, QType.F16)


@dataclass(frozen=True)
class Spec:
    arch: str
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # None: hidden // heads and no attention.key_length key
    vocab: int = 96
    qkv_bias: bool = False
    qk_norm: bool = False
    tied: bool = False
    vocab_from_tokens: bool = False  # vocabulary size from the token list, not metadata
    # Per HF name: store as this type instead of the rotation's choice.
    type_overrides: dict[str, QType] = field(default_factory=dict)
    # Raw GGUF-named tensors added as-is (F32).
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def real_head_dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


@dataclass(frozen=True)
class Synthetic:
    path: Path
    originals: dict[str, np.ndarray]  # HF name -> float32 tensor in HF layout, pre-storage
    types: dict[str, QType]  # HF name -> how it was stored


def _hf_shapes(spec: Spec) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, d = spec.hidden, spec.real_head_dim
    yield "model.embed_tokens.weight", (spec.vocab, h)
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_proj.weight", (spec.heads * d, h)
        yield f"{p}.self_attn.k_proj.weight", (spec.kv_heads * d, h)
        yield f"{p}.self_attn.v_proj.weight", (spec.kv_heads * d, h)
        if spec.qkv_bias:
            yield f"{p}.self_attn.q_proj.bias", (spec.heads * d,)
            yield f"{p}.self_attn.k_proj.bias", (spec.kv_heads * d,)
            yield f"{p}.self_attn.v_proj.bias", (spec.kv_heads * d,)
        if spec.qk_norm:
            yield f"{p}.self_attn.q_norm.weight", (d,)
            yield f"{p}.self_attn.k_norm.weight", (d,)
        yield f"{p}.self_attn.o_proj.weight", (h, spec.heads * d)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.mlp.gate_proj.weight", (spec.intermediate, h)
        yield f"{p}.mlp.up_proj.weight", (spec.intermediate, h)
        yield f"{p}.mlp.down_proj.weight", (h, spec.intermediate)
    yield "model.norm.weight", (h,)
    if not spec.tied:
        yield "lm_head.weight", (spec.vocab, h)


# The test's own HF -> GGUF naming (the llama.cpp convention), kept apart from the module's.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def _to_llama_cpp_rotary_layout(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: each head's two halves interleaved."""
    rows = w.shape[0]
    split = w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:])
    return split.swapaxes(1, 2).reshape(w.shape)


def _encode(data: np.ndarray, qtype: QType) -> tuple[np.ndarray, QType | None]:
    if qtype == QType.F32:
        return data.astype(np.float32), None
    if qtype == QType.F16:
        return data.astype(np.float16), None
    if qtype == QType.F64:
        return data.astype(np.float64), None
    return gguf.quants.quantize(data, qtype), qtype


def write_synthetic(tmp_path: Path, spec: Spec, seed: int = 0) -> Synthetic:
    rng = np.random.default_rng(seed)
    path = tmp_path / f"tiny-{spec.arch}.gguf"
    writer = gguf.GGUFWriter(str(path), spec.arch)
    _write_metadata(writer, spec)
    matrix_types = itertools.cycle(_MATRIX_TYPES)
    vector_types = itertools.cycle(_VECTOR_TYPES)
    originals: dict[str, np.ndarray] = {}
    types: dict[str, QType] = {}
    for name, shape in _hf_shapes(spec):
        is_norm = name.endswith("norm.weight")
        values = rng.standard_normal(shape).astype(np.float32) * 0.1
        original = (values + 1.0 if is_norm else values).astype(np.float32)
        qtype = next(matrix_types) if len(shape) == 2 else next(vector_types)
        qtype = spec.type_overrides.get(name, qtype)
        stored = original
        if spec.arch == "llama" and ".q_proj." in name:
            stored = _to_llama_cpp_rotary_layout(original, spec.heads)
        elif spec.arch == "llama" and ".k_proj." in name:
            stored = _to_llama_cpp_rotary_layout(original, spec.kv_heads)
        data, raw_dtype = _encode(stored, qtype)
        writer.add_tensor(_gguf_name(name), data, raw_dtype=raw_dtype)
        originals[name], types[name] = original, qtype
    for gguf_name, data in spec.extra_tensors.items():
        writer.add_tensor(gguf_name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Synthetic(path=path, originals=originals, types=types)


def _write_metadata(writer: gguf.GGUFWriter, spec: Spec) -> None:
    writer.add_block_count(spec.layers)
    writer.add_context_length(512)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(1_000_000.0 if spec.arch.startswith("qwen") else 10_000.0)
    if spec.arch == "llama":
        writer.add_rope_dimension_count(spec.real_head_dim)
    if spec.head_dim is not None:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_tokenizer_model("gpt2")
    if spec.vocab_from_tokens:
        writer.add_token_list([f"tok{i}" for i in range(spec.vocab)])
    else:
        writer.add_vocab_size(spec.vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template("{{ messages[0]['content'] }}")


def _check_against_originals(synthetic: Synthetic, ours: dict[str, torch.Tensor]) -> None:
    for name, original in synthetic.originals.items():
        qtype = synthetic.types[name]
        got = ours[name].numpy()
        assert got.shape == original.shape, name
        if qtype == QType.F32:
            np.testing.assert_array_equal(got, original, err_msg=name)
        elif qtype == QType.F16:
            rounded = original.astype(np.float16).astype(np.float32)
            np.testing.assert_array_equal(got, rounded, err_msg=name)
        else:  # Q8_0: one fp16 scale per 32 values, 8-bit codes
            np.testing.assert_allclose(got, original, rtol=0, atol=3e-3, err_msg=name)


# Fields that define the network; transformers' config must agree with ours on each.
_ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def _check_config_against_hf(ours: dict[str, Any], hf_config: Any) -> None:
    for key in _ARCH_FIELDS:
        assert ours[key] == getattr(hf_config, key), key
    # Qwen2's HF config has no head_dim attribute; it derives it like this.
    hf_head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    assert ours["head_dim"] == hf_head_dim
    rope = getattr(hf_config, "rope_parameters", None) or {}
    assert ours["rope_theta"] == rope.get("rope_theta", getattr(hf_config, "rope_theta", None))


SPECS = {
    "llama": Spec(arch="llama", vocab_from_tokens=True),
    "qwen2": Spec(arch="qwen2", qkv_bias=True, tied=True),
    # head_dim 128 != 64 / 4: transformers reads no head_dim from qwen3 GGUF metadata but its
    # Qwen3Config default is 128, so it can load this file and serve as the reference.
    "qwen3": Spec(arch="qwen3", qk_norm=True, head_dim=128, vocab_from_tokens=True),
}


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_synthetic_matches_transformers(tmp_path: Path, arch: str) -> None:
    spec = SPECS[arch]
    synthetic = write_synthetic(tmp_path, spec)
    assert set(synthetic.types.values()) >= {QType.F32, QType.F16, QType.Q8_0}

    ours = dict(iter_gguf_weights(synthetic.path))
    assert list(ours) == gguf_tensor_names(synthetic.path)
    assert set(ours) == set(synthetic.originals)
    assert all(t.dtype == torch.float32 for t in ours.values())
    _check_against_originals(synthetic, ours)

    model = _hf_model(synthetic.path)
    hf_state = model.state_dict()
    expected = set(hf_state) - ({"lm_head.weight"} if spec.tied else set())
    assert set(ours) == expected
    for name, tensor in ours.items():
        assert torch.equal(tensor, hf_state[name]), name

    config = gguf_to_hf_config(synthetic.path)
    _check_config_against_hf(config, model.config)
    assert config["head_dim"] == spec.real_head_dim
    assert config["tie_word_embeddings"] is spec.tied


def test_qwen3_odd_head_dim_matches_originals(tmp_path: Path) -> None:
    """Qwen3 with head_dim 48 (!= hidden/heads = 16, != transformers' default of 128).

    transformers cannot load this file: it takes no head_dim from qwen3 GGUF metadata and falls
    back to Qwen3Config's 128. The reference is therefore the original random tensors.
    """
    spec = Spec(arch="qwen3", qk_norm=True, head_dim=48)
    synthetic = write_synthetic(tmp_path, spec)
    ours = dict(iter_gguf_weights(synthetic.path))
    assert set(ours) == set(synthetic.originals)
    _check_against_originals(synthetic, ours)
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 48, 64)
    assert ours["model.layers.0.self_attn.k_norm.weight"].shape == (48,)
    assert gguf_to_hf_config(synthetic.path)["head_dim"] == 48


def test_llama_unpermutes_q_and_k_with_their_own_head_counts(tmp_path: Path) -> None:
    # All F32 so the round trip through llama.cpp's layout must be bit-exact; 8 query heads
    # over 2 kv heads makes a mix-up of the two head counts visible.
    names = [name for name, _ in _hf_shapes(Spec(arch="llama", heads=8, kv_heads=2))]
    spec = Spec(
        arch="llama", heads=8, kv_heads=2, type_overrides={name: QType.F32 for name in names}
    )
    synthetic = write_synthetic(tmp_path, spec)
    ours = dict(iter_gguf_weights(synthetic.path))
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.1.self_attn.{proj}.weight"
        assert torch.equal(ours[name], torch.from_numpy(synthetic.originals[name]))


def test_rope_freqs_tensor_is_not_yielded(tmp_path: Path) -> None:
    spec = Spec(arch="llama", extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    synthetic = write_synthetic(tmp_path, spec)
    names = [name for name, _ in iter_gguf_weights(synthetic.path)]
    assert set(names) == set(synthetic.originals)
    assert gguf_tensor_names(synthetic.path) == names


# --- errors -------------------------------------------------------------------------------


def test_unsupported_tensor_type_names_file_tensor_and_type(tmp_path: Path) -> None:
    spec = Spec(arch="llama", type_overrides={"model.layers.1.mlp.up_proj.weight": QType.F64})
    synthetic = write_synthetic(tmp_path, spec)
    # Checked by the call itself, before any tensor is read, though the bad one comes late.
    with pytest.raises(ValueError) as excinfo:
        iter_gguf_weights(synthetic.path)
    message = str(excinfo.value)
    assert str(synthetic.path) in message
    assert "blk.1.ffn_up.weight" in message
    assert "F64" in message
    with pytest.raises(ValueError, match="F64"):
        gguf_tensor_names(synthetic.path)


def test_unknown_tensor_name_is_an_error(tmp_path: Path) -> None:
    fused = np.zeros((3 * 64, 64), dtype=np.float32)
    spec = Spec(arch="llama", extra_tensors={"blk.0.attn_qkv.weight": fused})
    synthetic = write_synthetic(tmp_path, spec)
    with pytest.raises(ValueError) as excinfo:
        iter_gguf_weights(synthetic.path)
    assert str(synthetic.path) in str(excinfo.value)
    assert "blk.0.attn_qkv.weight" in str(excinfo.value)


def test_unknown_architecture_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for call in (lambda: iter_gguf_weights(path), lambda: gguf_tensor_names(path)):
        with pytest.raises(ValueError) as excinfo:
            call()
        assert str(path) in str(excinfo.value)
        assert "'gpt2'" in str(excinfo.value)


def test_truncated_file_is_an_error(tmp_path: Path) -> None:
    synthetic = write_synthetic(tmp_path, Spec(arch="qwen2"))
    data = synthetic.path.read_bytes()
    synthetic.path.write_bytes(data[: len(data) - 1024])
    with pytest.raises(ValueError, match="truncated"):
        for _ in iter_gguf_weights(synthetic.path):
            pass


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\x00" * 256)
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_tensor_names(path)


def test_family_tensor_map_and_norm_offset_come_from_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A family's own tensor names and llama.cpp's "1 + w" norm storage (Gemma) are registry
    # data: renamed as the family says, and only ``*_norm`` weights shifted back.
    from tidal.engine_core import model_registry as reg

    base = reg.family("llama")
    blocks = {**reg.LLAMA_GGUF_BLOCK_TENSORS, "post_ffw_norm": "post_feedforward_layernorm"}
    spec = reg.GGUFFamily("llama", "LlamaForCausalLM", "llama", block_tensors=blocks,
                          norm_weight_offset=1.0)
    monkeypatch.setitem(reg._BY_GGUF, "llama", reg.ModelFamily(
        base.name, base.architectures, base.model_class, base.normalise, gguf=spec))

    rng = np.random.default_rng(0)
    stored = {
        "token_embd.weight": rng.standard_normal((16, 32), dtype=np.float32),
        "output_norm.weight": rng.standard_normal(32, dtype=np.float32),
        "blk.0.attn_norm.weight": rng.standard_normal(32, dtype=np.float32),
        "blk.0.post_ffw_norm.weight": rng.standard_normal(32, dtype=np.float32),
    }
    path = tmp_path / "family.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_head_count(2)
    for name, data in stored.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = dict(iter_gguf_weights(path))
    assert torch.equal(ours["model.embed_tokens.weight"],
                       torch.from_numpy(stored["token_embd.weight"]))
    for gguf_name, hf_name in (("output_norm.weight", "model.norm.weight"),
                               ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                               ("blk.0.post_ffw_norm.weight",
                                "model.layers.0.post_feedforward_layernorm.weight")):
        assert torch.equal(ours[hf_name], torch.from_numpy(stored[gguf_name] - np.float32(1)))
    # The stock llama map has no post_ffw_norm: the same file is refused without the family's.
    monkeypatch.setitem(reg._BY_GGUF, "llama", base)
    with pytest.raises(ValueError, match="post_ffw_norm"):
        iter_gguf_weights(path)
