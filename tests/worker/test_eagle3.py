"""The EAGLE-3 draft head (``models.eagle3``) and its proposer, against a plain-torch forward
written here from the published description (fc over three target hidden states; one layer
attending over [input_layernorm(embed), hidden_norm(hidden)]; final norm; a draft-vocabulary
LM head mapped by ``d2t``), on random weights saved in both published checkpoint layouts
(EAGLE / SGLang ``midlayer.*`` without an embedding, ``speculators`` ``layers.0.*`` with a
nested layer config and the norm before the residual). The proposer's chain of drafts for a
tidal target equals the reference chain fed by HF transformers' hidden states of the same
target; with temperature > 0 it returns the head's distributions over the target vocabulary.
Loading refuses unknown or missing tensors, a head is refused as a model to serve, and dummy
weights load."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import reference
from tidal.worker.attention.torch_backend import TorchAttention

TARGET_LAYERS = 8
H, HEADS, KV_HEADS, INTER = 64, 4, 2, 96
VOCAB, DRAFT_VOCAB = 384, 96
EPS, THETA = 1e-5, 10000.0
K = 3
BLOCK = 16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3-target")
    return folder, reference.make_tiny_model("llama", folder, num_hidden_layers=TARGET_LAYERS)


def _head_tensors(layout: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5) * 1.5

    def norm():
        return 1 + 0.3 * torch.randn(H, generator=g)

    d = H // HEADS
    layer = {
        "self_attn.q_proj.weight": w(HEADS * d, 2 * H),
        "self_attn.k_proj.weight": w(KV_HEADS * d, 2 * H),
        "self_attn.v_proj.weight": w(KV_HEADS * d, 2 * H),
        "self_attn.o_proj.weight": w(H, HEADS * d),
        "mlp.gate_proj.weight": w(INTER, H),
        "mlp.up_proj.weight": w(INTER, H),
        "mlp.down_proj.weight": w(H, INTER),
        "input_layernorm.weight": norm(),
        "hidden_norm.weight": norm(),
        "post_attention_layernorm.weight": norm(),
    }
    # A draft vocabulary of scattered target ids: target = draft + d2t[draft].
    ids = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    prefix = "midlayer." if layout == "eagle" else "layers.0."
    out = {prefix + k: v for k, v in layer.items()}
    out.update({"fc.weight": w(H, 3 * H), "norm.weight": norm(),
                "lm_head.weight": w(DRAFT_VOCAB, H, scale=0.5),
                "d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": t2d})
    if layout == "speculators":
        out["embed_tokens.weight"] = torch.randn(VOCAB, H, generator=g)
    return out


def _head_config(layout: str) -> dict:
    llama = {"hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
             "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "vocab_size": VOCAB,
             "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 512,
             "hidden_act": "silu", "tie_word_embeddings": False}
    if layout == "eagle":
        return {**llama, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": H,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6],
                                 "use_aux_hidden_state": True}}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": {**llama, "model_type": "llama"},
            "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": None}


@pytest.fixture(scope="module", params=["eagle", "speculators"])
def head(request, tmp_path_factory):
    layout = request.param
    folder = tmp_path_factory.mktemp(f"eagle3-{layout}")
    tensors = _head_tensors(layout, seed=5 if layout == "eagle" else 6)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_head_config(layout)))
    return layout, folder, tensors


# --- the reference, in plain torch --------------------------------------------------------------


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, pos):
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


class RefHead:
    """EAGLE-3's head over a whole sequence of (token, hidden) inputs at positions 0..n-1."""

    def __init__(self, t: dict[str, torch.Tensor], layout: str, target_embed: torch.Tensor):
        p = "midlayer." if layout == "eagle" else "layers.0."
        self.t = {k.removeprefix(p): v for k, v in t.items()}
        self.embed = t.get("embed_tokens.weight", target_embed)
        self.norm_before_residual = layout == "speculators"
        self.target_ids = torch.arange(DRAFT_VOCAB) + t["d2t"]

    def fc(self, aux):
        return aux @ self.t["fc.weight"].T

    def __call__(self, tokens, hidden):
        """(logits over the draft vocabulary, output before the final norm), every row."""
        t, n, d = self.t, len(tokens), H // HEADS
        x = _rms(self.embed[tokens], t["input_layernorm.weight"])
        hn = _rms(hidden, t["hidden_norm.weight"])
        residual = hn if self.norm_before_residual else hidden
        a = torch.cat([x, hn], -1)
        pos = torch.arange(n)
        q = _rope((a @ t["self_attn.q_proj.weight"].T).view(n, HEADS, d), pos)
        k = _rope((a @ t["self_attn.k_proj.weight"].T).view(n, KV_HEADS, d), pos)
        v = (a @ t["self_attn.v_proj.weight"].T).view(n, KV_HEADS, d)
        k = k.repeat_interleave(HEADS // KV_HEADS, 1)
        v = v.repeat_interleave(HEADS // KV_HEADS, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, -1)
        r = o @ t["self_attn.o_proj.weight"].T + residual
        m = _rms(r, t["post_attention_layernorm.weight"])
        m = (F.silu(m @ t["mlp.gate_proj.weight"].T) * (m @ t["mlp.up_proj.weight"].T)) \
            @ t["mlp.down_proj.weight"].T
        pre = m + r
        return _rms(pre, t["norm.weight"]) @ t["lm_head.weight"].T, pre

    def chain(self, tokens, aux, k):
        """Greedy drafts: row t of the prompt holds token t + 1 (the last: the target's
        sample) and the fused target state of row t; each draft then enters at the next
        position with the previous row's pre-norm output."""
        toks, hid = list(tokens), self.fc(aux)
        drafts = []
        for _ in range(k):
            logits, pre = self(torch.tensor(toks), hid)
            tok = int(self.target_ids[logits[-1].argmax()])
            drafts.append(tok)
            toks.append(tok)
            hid = torch.cat([hid, pre[-1:]])
        return drafts, logits


# --- tests ----------------------------------------------------------------------------------------


def _target_config(folder):
    from tidal.engine_core.config import EngineArgs

    return EngineArgs(model=str(folder), device="cpu", num_kv_blocks=64,
                      dtype="float32").create_config()


def _load_head(folder, target_cfg, load_format="auto"):
    from tidal.worker.loader.model_loader import load_model
    from tidal.worker.spec_decode.draft_proposer import draft_model_config

    cfg = draft_model_config(str(folder), target_cfg.model, load_format=load_format)
    return load_model(cfg, torch.device("cpu"), TorchAttention())


def test_eagle3_chain_matches_reference(target, head):
    from tidal.worker.loader.model_loader import load_model
    from tidal.worker.models.decoder import AuxHiddenSpec
    from tidal.worker.models.eagle3 import aux_layer_ids
    from tidal.worker.spec_decode.draft_proposer import (
        Eagle3Proposer,
        make_batch,
        shift_in_next_tokens,
    )

    layout, folder, tensors = head
    target_folder, hf = target
    tcfg = _target_config(target_folder)
    model = _load_head(folder, tcfg)
    assert model.has_embeddings == (layout == "speculators")
    assert model.arch.norm_before_residual == (layout == "speculators")
    layers = aux_layer_ids(model.arch, TARGET_LAYERS)
    assert layers == ((1, 4, 6) if layout == "eagle" else (2, 4, 5))
    tgt = load_model(tcfg.model, torch.device("cpu"), TorchAttention(),
                     aux_hidden=AuxHiddenSpec(layers, max_tokens=64))
    proposer = Eagle3Proposer(model, K, tgt, max_model_len=512)
    assert proposer.kv_bytes_per_block(BLOCK) == 2 * BLOCK * KV_HEADS * (H // HEADS) * 4
    blocks_per_req = 4
    proposer.bind_kv_cache(2 * blocks_per_req, BLOCK)
    for attn in tgt.attention_layers():
        attn.kv_cache = torch.zeros(2, 2 * blocks_per_req, BLOCK, KV_HEADS, H // HEADS)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (11, 23)]
    counts = np.array([len(p) for p in prompts])
    table = torch.arange(2 * blocks_per_req, dtype=torch.int32).view(2, -1)
    ids = torch.cat(prompts)
    with torch.inference_mode():
        step = make_batch(ids, counts, np.zeros(2, np.int64), table, BLOCK)
        hidden, _ = tgt(ids, step.positions, step.meta)
        nxt = tgt.compute_logits(hidden[step.last_rows]).argmax(-1)
        aux = tgt.aux_hidden_states[:len(ids)].clone()
    batch = make_batch(shift_in_next_tokens(ids, step.last_rows, nxt), counts,
                       np.zeros(2, np.int64), table, BLOCK, hidden=aux)
    out = proposer.propose(batch)
    assert out.token_ids.shape == (2, K) and out.probs is None

    ref = RefHead(tensors, layout, hf.model.embed_tokens.weight.detach())
    with torch.no_grad():
        for r, prompt in enumerate(prompts):
            hs = hf(prompt[None], output_hidden_states=True)
            assert int(hs.logits[0, -1].argmax()) == int(nxt[r])
            ref_aux = torch.cat([hs.hidden_states[i][0] for i in layers], -1)
            torch.testing.assert_close(aux[batch.meta.query_start_loc_cpu[r]:][:len(prompt)],
                                       ref_aux, rtol=1e-5, atol=1e-5)
            shifted = [*prompt[1:].tolist(), int(nxt[r])]
            drafts, _ = ref.chain(shifted, ref_aux, K)
            assert out.token_ids[r].tolist() == drafts, f"request {r}"
            # The drafts are target ids outside the first DRAFT_VOCAB: d2t was applied.
            assert all(bool(ref.target_ids.eq(t).any()) for t in drafts)

    # The head's forward on its own, row by row, against the reference (logits, pre-norm).
    with torch.inference_mode():
        n = len(prompts[0])
        single = make_batch(batch.input_ids[:n], counts[:1], np.zeros(1, np.int64), table[:1],
                            BLOCK)
        normed, pre = model(single.input_ids, single.positions, single.meta,
                            model.combine_hidden_states(aux[:n]))
        logits = model.compute_logits(normed)
    want_logits, want_pre = ref(single.input_ids, ref.fc(aux[:n]))
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pre, want_pre, rtol=1e-4, atol=1e-4)

    # Temperature > 0: each draft is drawn from softmax(logits / T) over the draft ids, which
    # is returned scattered onto the target vocabulary; a greedy row gets a one-hot.
    temp = torch.tensor([0.0, 0.8])
    batch.temperature, batch.all_greedy = temp, False
    batch.generator = torch.Generator().manual_seed(3)
    out = proposer.propose(batch)
    assert out.probs.shape == (2, K, VOCAB)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(2, K))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ref.target_ids] = False
    assert float(out.probs[:, :, outside].abs().max()) == 0.0
    assert out.token_ids[0].tolist() == ref.chain(
        [*prompts[0][1:].tolist(), int(nxt[0])],
        torch.cat([hf(prompts[0][None], output_hidden_states=True).hidden_states[i][0]
                   for i in layers], -1), K)[0]
    assert torch.equal(out.probs[0], F.one_hot(out.token_ids[0], VOCAB).float())
    # Row 1: the reference's logits along the drawn chain give the returned q at every step.
    p1 = prompts[1]
    with torch.no_grad():
        hs = hf(p1[None], output_hidden_states=True)
        ref_aux = torch.cat([hs.hidden_states[i][0] for i in layers], -1)
        toks, hid = [*p1[1:].tolist(), int(nxt[1])], ref.fc(ref_aux)
        for s in range(K):
            logits, pre = ref(torch.tensor(toks), hid)
            q = torch.softmax(logits[-1] / 0.8, -1)
            torch.testing.assert_close(out.probs[1, s, ref.target_ids], q, rtol=1e-4,
                                       atol=1e-5)
            drawn = int(out.token_ids[1, s])
            assert float(out.probs[1, s, drawn]) > 0
            toks.append(drawn)
            hid = torch.cat([hid, pre[-1:]])


def test_eagle3_checkpoint_errors_and_dummy(target, head, tmp_path):
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.loader.model_loader import ModelLoadError

    layout, folder, tensors = head
    tcfg = _target_config(target[0])
    # A head is not a model to serve.
    with pytest.raises(ValueError, match="draft head"):
        EngineArgs(model=str(folder), device="cpu").create_config()
    # Random weights: every parameter of the head, own embedding and LM head.
    dummy = _load_head(folder, tcfg, load_format="dummy")
    assert dummy.has_embeddings and dummy.has_lm_head
    assert dummy.fc.weight.shape == (H, 3 * H) and dummy.lm_head.weight.shape == (DRAFT_VOCAB, H)
    assert dummy.midlayer.self_attn.qkv_proj.weight.shape == (2 * H, 2 * H)  # (q+k+v) x 2H
    for broken, match in (
        ({**tensors, "midlayer.extra.weight": torch.zeros(2)}, "midlayer.extra.weight"),
        ({k: v for k, v in tensors.items() if k != "fc.weight"}, "fc.weight"),
        ({**tensors, "d2t": torch.zeros(DRAFT_VOCAB + 1, dtype=torch.int64)}, "d2t"),
    ):
        bad = tmp_path / f"bad-{match}"
        bad.mkdir()
        save_file(broken, str(bad / "model.safetensors"))
        (bad / "config.json").write_text(json.dumps(_head_config(layout)))
        with pytest.raises(ModelLoadError, match=match.replace(".", r"\.")):
            _load_head(bad, tcfg)


def test_eagle3_config_normaliser():
    from tidal.engine_core.model_arch import arch_from_hf_dict
    from tidal.worker.models.eagle3 import aux_layer_ids

    flat = _head_config("eagle")
    arch = arch_from_hf_dict(flat, "c.json", draft=True)
    assert (arch.family, arch.draft_vocab_size, arch.target_hidden_size) == ("eagle3", 96, H)
    assert (arch.aux_hidden_layer_ids, arch.norm_before_residual) == ((1, 4, 6), False)
    nested = arch_from_hf_dict(_head_config("speculators"), "c.json", draft=True)
    assert (nested.hidden_size, nested.num_kv_heads, nested.norm_before_residual) == (H, 2, True)
    assert nested.target_hidden_size == H and nested.aux_hidden_layer_ids is None
    assert aux_layer_ids(nested, 32) == (2, 16, 29)
    with pytest.raises(ValueError, match="0..4"):
        aux_layer_ids(arch, 5)  # the checkpoint's layer 6 is past a 5-layer target
    for bad, match in (({"num_hidden_layers": 2}, "2 decoder layers"),
                       ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
                       ({"draft_vocab_size": VOCAB + 1}, "draft_vocab_size"),
                       ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, "3 layer")):
        with pytest.raises(ValueError, match=match):
            arch_from_hf_dict({**flat, **bad}, "c.json", draft=True)
