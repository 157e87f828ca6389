"""Embedded engine on the MoE hybrids: Qwen3.5-MoE (every MLP sparse) and Qwen3-Next (its interleaved
``in_proj_qkvz`` / ``in_proj_ba``, ``norm_topk_prob: false`` and a dense ``mlp_only_layers`` layer),
4 experts, top-2 and a sigmoid-gated shared expert, one MoE MTP layer in the ``mtp.*`` layout:

* the engine loads transformers' ``save_pretrained`` folder (per-expert tensors) and the fused
  ``mlp.experts.gate_up_proj`` / ``down_proj`` form, also under ``model.language_model.``;
* logits equal transformers' ``Qwen3_5MoeForCausalLM`` / ``Qwen3NextForCausalLM`` (fp32, 1e-4),
  prefill and decode through the cache;
* the MTP chain (recurrent, an MoE layer) equals the reference written with transformers' decoder layer;
* greedy speculative decoding equals plain greedy decoding token for token (on a variant whose drafts
  are often, not always, right), sampled speculation reports the logprobs of a fresh forward.

The megatron -> engine weight sync is checked in tests/test_qwen3_moe.py (it spawns gloo ranks).
Tiny random models from tests/test_qwen3_moe.py's ``make_moe``.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from bebop_megatron.rollout.engine import SamplingParams
from bebop_megatron.rollout.modeling import CausalLMWithMTP, LMConfig, SparseMoE
from bebop_megatron.rollout.sampling import SamplingTensors
from tests.test_engine import full_mtp_distributions
from tests.test_engine_hybrid import (assert_greedy_speculation_equals_plain, assert_logits_equal_prefill_and_decode,
                                      assert_sampled_speculation_logprobs_exact)
from tests.test_qwen3_5 import IDS, hf_tensors
from tests.test_qwen3_moe import _fuse_experts, make_moe, mtp_reference

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def moe_dir(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(f"engine_{arch}")
    return arch, d, make_moe(d, arch, seed=2)


def test_config_and_both_expert_layouts_load(moe_dir):
    arch, d, _ = moe_dir
    c = LMConfig.from_hf(json.loads((d / "config.json").read_text()))
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == \
        (4, 2, 16, 24)
    assert c.num_mtp_modules == 1 and c.mtp_layout == "qwen3_next" and c.hybrid
    m = CausalLMWithMTP.from_pretrained(d)
    assert isinstance(m.mtp[0].layers[0].mlp, SparseMoE)  # the MTP layer is MoE too
    if arch == "qwen3_next":
        assert c.gdn_layout == "qwen3_next" and not c.norm_topk_prob and c.mlp_only_layers == (0,)
        assert not isinstance(m.layers[0].mlp, SparseMoE) and isinstance(m.layers[1].mlp, SparseMoE)
    else:
        assert c.gdn_layout == "qwen3_5" and c.norm_topk_prob and c.intermediate_size == 0
        assert all(isinstance(layer.mlp, SparseMoE) for layer in m.layers)
    # fused experts (transformers' in-memory form) load to the same weights, Qwen3.5-MoE's also in the
    # multimodal layout (text model under model.language_model., config under text_config)
    sd = hf_tensors(d)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in sd)  # what save_pretrained writes
    fused, cfg = _fuse_experts(sd), json.loads((d / "config.json").read_text())
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    if arch == "qwen3_5_moe":
        fused = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                 for k, v in fused.items()}
        cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": {**cfg, "model_type": "qwen3_5_moe_text"}}
    m2 = CausalLMWithMTP(LMConfig.from_hf(cfg))
    m2.load_hf_state_dict(fused, strict=True)
    mine = dict(m2.named_parameters())
    assert all(torch.equal(p, mine[n]) for n, p in m.named_parameters())


def test_logits_equal_transformers_prefill_and_decode(moe_dir):
    _, d, hf = moe_dir
    assert_logits_equal_prefill_and_decode(CausalLMWithMTP.from_pretrained(d), hf)


def test_mtp_chain_equals_transformers_reference(moe_dir):
    """The engine's MTP depths (one MoE module applied recursively, no cache) equal the chain written
    with transformers' own decoder layer, at every position where all tokens ahead exist."""
    arch, d, hf = moe_dir
    model = CausalLMWithMTP.from_pretrained(d, dtype=torch.float64)
    gamma, ids = 3, IDS[:1]
    ref = mtp_reference(hf, arch, load_file(str(d / "mtp.safetensors")), ids, gamma)
    st = SamplingTensors.build([SamplingParams(temperature=1.0)])
    ours = full_mtp_distributions(model, ids[0].tolist(), gamma, st)
    s = ids.shape[1]
    for k in range(1, gamma + 1):
        want = torch.softmax(ref[k - 1][0, : s - k].double(), -1)
        assert (ours[k] - want).abs().max() < 1e-5, (k, (ours[k] - want).abs().max())


def agreeing_drafts(model: CausalLMWithMTP, scale: float = 0.05) -> CausalLMWithMTP:
    """The random model's greedy drafts are almost never right (nothing past a rejection at depth 1
    would be exercised). Scaled-down mixers and MLPs make the trunk nearly a bigram model, and an MTP
    module that reads only the embedding of the token ahead (``eh_proj`` = [I | 0], plain ``enorm``,
    the trunk's final norm) then predicts nearly what the trunk will: some drafts at every depth are
    accepted, some rejected. Its MoE layer still runs (scaled, not removed)."""
    h = model.config.hidden_size
    m = model.mtp[0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                p.mul_(scale)
        m.eh_proj.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1))
        m.enorm.weight.zero_()
        m.final_norm.weight.copy_(model.norm.weight)
    return model


def test_greedy_speculation_equals_plain_decoding(moe_dir):
    _, d, _ = moe_dir
    model = agreeing_drafts(CausalLMWithMTP.from_pretrained(d, dtype=torch.float64))
    st = assert_greedy_speculation_equals_plain(model, "rejection", max_new_tokens=16)
    assert all(n > 0 for n in st["spec_accepted_per_depth"]) and st["spec_accept_rate"] < 0.9, st


def test_sampled_speculation_logprobs_equal_fresh_forward(moe_dir):
    _, d, _ = moe_dir
    assert_sampled_speculation_logprobs_exact(CausalLMWithMTP.from_pretrained(d, dtype=torch.float64))
