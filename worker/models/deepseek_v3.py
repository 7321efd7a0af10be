"""DeepSeek-V3 (and R1): DeepSeek-V2's layers (``models.deepseek_v2``) under V3's configuration.

What differs is read from the config (``model_arch.deepseek_v2_arch`` with family
``deepseek_v3``): the router scores experts by sigmoid, chooses them with each router's
``mlp.gate.e_score_correction_bias`` added (the weights stay the unbiased scores) among the
``topk_group`` groups whose two best experts sum highest ("noaux_tc"), renormalises and scales
by ``routed_scaling_factor``; q goes through its LoRA (``q_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj``) as V2's does, and YaRN rope and its softmax scale are V2's too.

The checkpoint's multi-token-prediction layers, ``model.layers.{num_hidden_layers + i}.*``, are
not part of this model (the loader skips layers past the decoder's): they are the ``mtp``
speculative method's drafter (``models.deepseek_mtp``), which reads this model's final hidden
state (``AuxHiddenSpec`` with layer ``num_layers``).
"""

from __future__ import annotations

import torch

from tidal.worker.models.decoder import AuxHiddenSpec
from tidal.worker.models.deepseek_v2 import DeepseekV2ForCausalLM


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    # The final hidden state only (the MTP drafter's input): see ``_init_aux_hidden``.
    supports_aux_hidden_states = True

    def _init_aux_hidden(self, spec: AuxHiddenSpec, dtype: torch.dtype) -> None:
        if any(i != self.arch.num_layers for i in spec.layers):
            raise ValueError(f"{self.arch.architecture}: EAGLE-3 heads for DeepSeek targets "
                             "are not supported yet (the target records only its final hidden "
                             "state, for the mtp method)")
        super()._init_aux_hidden(spec, dtype)
