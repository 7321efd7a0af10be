"""Auxiliary hidden states (the inputs of an EAGLE-3 draft head): a decoder built with
``AuxHiddenSpec`` records the residual stream entering the chosen layers, equal to HF
transformers' ``output_hidden_states`` for the same weights, for a flat batch of several
requests (one prefill pass, then a decode step through the paged cache); the final hidden
states are unchanged; a model built without the option runs the plain layer loop; bad layer
ids and families without the option are refused when the model is built."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference
from tidal.worker.attention.backend import AttentionMetadata, kv_cache_shape
from tidal.worker.attention.torch_backend import TorchAttention
from tidal.worker.models.decoder import AuxHiddenSpec

LAYERS = 8
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-aux")
    return folder, reference.make_tiny_model("llama", folder, num_hidden_layers=LAYERS)


def _load(folder, aux: AuxHiddenSpec | None):
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.loader.model_loader import load_model

    config = EngineArgs(model=str(folder), device="cpu", num_kv_blocks=64,
                        dtype="float32").create_config()
    return load_model(config.model, torch.device("cpu"), TorchAttention(), aux_hidden=aux)


def _meta(starts: list[int], counts: list[int], blocks_per_req: int) -> AttentionMetadata:
    """Requests ``i`` computing positions ``starts[i] .. starts[i] + counts[i]``, request i
    owning blocks ``i * blocks_per_req ..`` (contiguous)."""
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    seq = np.array([s + c for s, c in zip(starts, counts)], dtype=np.int32)
    table = torch.arange(len(counts) * blocks_per_req, dtype=torch.int32).view(len(counts), -1)
    slots = torch.cat([torch.arange(s, s + c) + i * blocks_per_req * BLOCK
                       for i, (s, c) in enumerate(zip(starts, counts))])
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(counts), max_query_len=max(counts),
        max_seq_len=int(seq.max()), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq), block_table=table, slot_mapping=slots,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq,
        num_decodes=sum(1 for c in counts if c == 1))


def _bind_cache(model, blocks: int) -> None:
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(kv_cache_shape(blocks, BLOCK, attn.num_kv_heads,
                                                   attn.head_dim))


def test_aux_hidden_states_match_hf(tiny_llama):
    from tidal.worker.models.eagle3 import default_aux_layer_ids

    folder, hf = tiny_llama
    layers = (0, *default_aux_layer_ids(LAYERS))  # 0: the embeddings themselves
    assert layers == (0, 2, 4, 5)
    model = _load(folder, AuxHiddenSpec(layers, max_tokens=64))
    plain = _load(folder, None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in (7, 19, 1)]
    nxt = [int(t) for t in torch.randint(0, hf.config.vocab_size, (3,), generator=g)]
    with torch.inference_mode():
        refs = [hf(torch.cat([p, torch.tensor([t])])[None], output_hidden_states=True)
                for p, t in zip(prompts, nxt)]
        for m in (model, plain):
            _bind_cache(m, 3 * 4)
        counts = [len(p) for p in prompts]
        ids = torch.cat(prompts)
        pos = torch.cat([torch.arange(n) for n in counts])
        meta = _meta([0] * 3, counts, 4)
        hidden, _ = model(ids, pos, meta)
        aux = model.aux_hidden_states[:len(ids)].clone()
        plain_hidden, _ = plain(ids, pos, meta)
        # A decode step of one token per request reads the cache the prefill wrote.
        step = _meta(counts, [1, 1, 1], 4)
        model(torch.tensor(nxt), torch.tensor(counts), step)
        aux_step = model.aux_hidden_states[:3].clone()
    assert plain.aux_hidden_states is None
    assert plain._run_layers == plain._run_layers_plain  # no per-layer check in its forward
    torch.testing.assert_close(hidden, plain_hidden, rtol=0, atol=0)
    h = hf.config.hidden_size
    assert aux.shape == (len(ids), len(layers) * h)
    rows = np.concatenate([[0], np.cumsum(counts)])
    for r, ref in enumerate(refs):
        n = counts[r]
        for k, layer in enumerate(layers):
            want = ref.hidden_states[layer][0]
            got = aux[rows[r]:rows[r + 1], k * h:(k + 1) * h]
            torch.testing.assert_close(got, want[:n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(aux_step[r, k * h:(k + 1) * h], want[n],
                                       rtol=1e-5, atol=1e-5)
    # The layers differ from one another: a mix-up of the columns would fail above.
    assert not torch.allclose(aux[:, h:2 * h], aux[:, 2 * h:3 * h], atol=1e-3)


def test_aux_hidden_states_refused_where_unsupported(tiny_llama):
    from tidal.engine_core.model_arch import arch_from_hf_dict
    from tidal.worker.models.registry import build_model

    folder, _ = tiny_llama
    # (LAYERS itself is the final hidden state, which MTP reads: tests/worker/test_mtp.py.)
    for bad in ((), (LAYERS + 1,), (-1, 2)):
        with pytest.raises(ValueError, match="layer ids"):
            _load(folder, AuxHiddenSpec(bad, max_tokens=8))
    model = _load(folder, AuxHiddenSpec((1,), max_tokens=4))
    _bind_cache(model, 4)
    with pytest.raises(ValueError, match="exceed"), torch.inference_mode():
        model(torch.zeros(5, dtype=torch.long), torch.arange(5), _meta([0], [5], 4))
    cfg = reference.tiny_hf_config("gemma2").to_dict()
    cfg["architectures"] = ["Gemma2ForCausalLM"]
    gemma = arch_from_hf_dict(cfg, "config.json")
    with pytest.raises(ValueError, match="cannot return auxiliary hidden states"):
        build_model(gemma, torch.float32, TorchAttention(), aux_hidden=AuxHiddenSpec((1,), 4))
