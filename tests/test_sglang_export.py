"""`bebop convert megatron-to-hf` writes a Qwen3.5 / Qwen3.5-MoE / Qwen3-Next folder whose recurrent MTP
layer SGLang 0.5.23's NEXTN draft loads: checked against SGLang's own source (the pinned wheel,
cached like tests/test_sglang_types.py does; its runtime cannot import on CPU, so nothing of it runs
except its pure name-mapping functions, compiled from their source).

What SGLang does, and where (paths inside the wheel):

* ``sglang/srt/configs/model_config.py``, ``ModelConfig._config_draft_model``: for a draft, rewrites
  ``architectures[0]`` ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (and the multimodal
  ``*ForConditionalGeneration``) -> ``Qwen3_5ForCausalLMMTP``, ``Qwen3NextForCausalLM`` ->
  ``Qwen3NextForCausalLMMTP``, and sets ``num_nextn_predict_layers = 1`` itself (it never reads
  ``mtp_num_hidden_layers``).
* ``sglang/srt/models/qwen3_5_mtp.py``, ``Qwen3_5ForCausalLMMTP.__init__`` / ``.load_weights``: ``fc``,
  ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden`` and ``model`` = a one-layer
  ``Qwen3_5ForCausalLM`` (``sglang/srt/models/qwen3_5.py``) with ``full_attention_interval = 1``, so
  ``mtp.layers.0`` is a gated full-attention layer. ``load_weights`` keeps names containing ``mtp``,
  maps ``mtp.`` -> ``model.`` (``model.fc``/``model.pre_fc`` back to the top), drops ``.self_attn``,
  stacks q/k/v -> ``qkv_proj`` and gate/up -> ``gate_up_proj``, and maps per-expert
  ``experts.{e}.{gate,up,down}_proj`` through ``FusedMoE.make_expert_params_mapping``
  (``sglang/srt/layers/moe/fused_moe_triton/layer.py``) onto ``experts.w13_weight`` / ``w2_weight``.
* ``sglang/srt/models/qwen3_next_mtp.py``, ``Qwen3NextForCausalLMMTP``: the same modules over
  ``Qwen3NextModel``; its ``load_weights`` is ``Qwen3NextForCausalLM.load_weights(is_mtp=True)``
  (``sglang/srt/models/qwen3_next.py``), which maps the three head tensors by exact name and
  ``mtp`` -> ``model`` for the rest (an unknown name is a KeyError there).
* MoE blocks: ``Qwen2MoeSparseMoeBlock`` / ``Qwen2MoeMLP`` in ``sglang/srt/models/qwen2_moe.py``.
* Config: ``sglang/srt/configs/qwen3_next.py``, ``Qwen3NextConfig.layers_block_type`` derives every
  layer's kind from ``full_attention_interval`` (``layer_types`` is not read), and the attention layers
  read ``rope_theta`` / ``partial_rotary_factor`` from the top level.

The draft's parameter names are derived from those constructors (``self.<attr> = <Layer>(...)``) and
the real ``load_weights`` source is run over them with recording stand-ins for the weight loaders: an
exported tensor passes only if SGLang's own mapping lands it on a draft parameter, and every draft
parameter (but the embedding and LM head, which SGLang shares from the target) must be loaded.
"""

from __future__ import annotations

import ast
import enum
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import run_distributed
from tests.test_sglang_types import _ensure_sources
from tests.tiny_models import tiny_hybrid_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = "sglang/srt/models/"
SOURCES = (MODELS + "qwen3_5_mtp.py", MODELS + "qwen3_next_mtp.py", MODELS + "qwen3_5.py", MODELS + "qwen3_next.py",
           MODELS + "qwen2_moe.py", "sglang/srt/layers/moe/fused_moe_triton/layer.py",
           "sglang/srt/configs/model_config.py", "sglang/srt/configs/qwen3_next.py")
DRAFT_FILES = {"Qwen3_5ForCausalLMMTP": MODELS + "qwen3_5_mtp.py",
               "Qwen3NextForCausalLMMTP": MODELS + "qwen3_next_mtp.py"}
ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
SHARED_WITH_TARGET = {"model.embed_tokens.weight", "lm_head.weight"}  # set_embed_and_head / target lm_head
LEAF = re.compile(r"(Linear|RMSNorm|Embedding|LMHead)$")


# ------------------------------------------------------------------ SGLang's source, read statically


class SGLangSource:
    """Classes, module constants and functions of the pinned SGLang files, by AST."""

    def __init__(self, src: Path):
        self.trees = {f: ast.parse((src / f).read_text(), filename=f) for f in SOURCES}
        self.classes: dict[str, tuple[ast.ClassDef, str]] = {}
        for f, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, (node, f))

    def method(self, cls: str, name: str) -> ast.FunctionDef:
        node = self.classes[cls][0]
        return next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)

    def module_assign(self, f: str, name: str) -> ast.expr:
        return next(n.value for n in self.trees[f].body
                    if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets))

    def entry_classes(self, f: str) -> set[str]:
        v = self.module_assign(f, "EntryClass")
        return {e.id for e in (v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v])}

    def draft_architectures(self) -> dict[str, str]:
        """``ModelConfig._config_draft_model``: target ``architectures[0]`` -> the draft's."""
        fn = next(n for n in ast.walk(self.trees["sglang/srt/configs/model_config.py"])
                  if isinstance(n, ast.FunctionDef) and n.name == "_config_draft_model")
        out = {}
        for node in ast.walk(fn):
            if not isinstance(node, ast.If):
                continue
            targets = set()
            for c in ast.walk(node.test):
                if isinstance(c, ast.Compare) and ast.unparse(c.left) == "self.hf_config.architectures[0]":
                    for comp in c.comparators:
                        elts = comp.elts if isinstance(comp, (ast.List, ast.Tuple, ast.Set)) else [comp]
                        targets |= {e.value for e in elts if isinstance(e, ast.Constant)}
            for st in node.body:  # the rewrite made directly by this branch
                if (isinstance(st, ast.Assign) and ast.unparse(st.targets[0]) == "self.hf_config.architectures[0]"
                        and isinstance(st.value, ast.Constant)):
                    out.update({t: st.value.value for t in targets})
        return out

    def compiled(self, fn: ast.FunctionDef, ns: dict) -> Callable:
        """SGLang's function compiled from its source, without decorators or annotations."""
        fn = ast.parse(ast.unparse(fn)).body[0]  # a copy
        fn.decorator_list, fn.returns = [], None
        for a in fn.args.args + fn.args.kwonlyargs:
            a.annotation = None
        exec(compile(ast.Module(body=[fn], type_ignores=[]), "<sglang>", "exec"), ns)
        return ns[fn.name]

    # -------------------------------------------------------------- the draft's parameters

    def expert_param_names(self) -> set[str]:
        """``FusedMoE``'s parameters, from the names ``make_expert_params_mapping`` maps onto."""
        mapping = self.make_expert_params_mapping()(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
                                                    ckpt_up_proj_name="up_proj", num_experts=1)
        return {p[len("experts."):] + "weight" for p, *_ in mapping}

    def make_expert_params_mapping(self) -> Callable:
        fn = self.method("FusedMoE", "make_expert_params_mapping")
        f = self.compiled(fn, {})
        return lambda **kw: f(None, **kw)

    def layers_block_type(self, num_hidden_layers: int, full_attention_interval: int) -> list[str]:
        """``Qwen3NextConfig.layers_block_type`` (the Qwen3.5 text configs subclass it) run on these values."""
        tree = self.trees["sglang/srt/configs/qwen3_next.py"]
        enum_src = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HybridLayerType")
        ns: dict = {"enum": enum}
        exec(compile(ast.Module(body=[enum_src], type_ignores=[]), "<sglang>", "exec"), ns)
        prop = self.compiled(self.method("Qwen3NextConfig", "layers_block_type"), ns)
        return prop(SimpleNamespace(num_hidden_layers=num_hidden_layers,
                                    full_attention_interval=full_attention_interval))

    def params(self, cls: str, moe: bool, prefix: str = "") -> set[str]:
        """Parameter names of ``cls`` built from its ``__init__``: ``self.<attr> = <Linear|RMSNorm|
        Embedding|LMHead>(...)`` is ``<attr>.weight``, a known module class recurses, the MoE experts
        are FusedMoE's, ``make_(pp_)layers`` builds one layer of the kind ``layers_block_type`` gives for
        ``full_attention_interval = 1`` (what the MTP drafts set), and ``mlp`` is the MoE block or the
        dense MLP."""
        node, f = self.classes[cls]
        init = self.method(cls, "__init__")
        alias = {t.id: ast.unparse(n.value) for n in ast.walk(init) if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, (ast.Name, ast.Attribute))}
        found: dict[str, list[str]] = {}
        for n in ast.walk(init):
            if not (isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)):
                continue
            tgt = n.targets[0]
            attr = (tgt.elts[0] if isinstance(tgt, ast.Tuple) else tgt)
            if not (isinstance(attr, ast.Attribute) and ast.unparse(attr.value) == "self"):
                continue
            for callee in self._callees(n.value, cls, alias):
                found.setdefault(attr.attr, []).append(callee)
        out = set()
        for attr, callees in found.items():
            if attr == "mlp":
                want = "Qwen2MoeSparseMoeBlock" if moe else "Qwen2MoeMLP"
                assert want in callees, (cls, callees)
                callees = [want]
            for c in callees:
                if c in ("make_pp_layers", "make_layers"):
                    kind = self.layers_block_type(1, 1)[0]
                    table = self.module_assign(f, "ALL_DECODER_LAYER_TYPES")
                    layer = next(v.id for k, v in zip(table.keys, table.values) if k.value == kind)
                    out |= self.params(layer, moe, f"{prefix}layers.0.")
                elif c == "<FusedMoE>":
                    out |= {f"{prefix}{attr}.{p}" for p in self.expert_param_names()}
                elif c in self.classes and c != cls:
                    out |= self.params(c, moe, f"{prefix}{attr}.")
                elif LEAF.search(c):
                    out.add(f"{prefix}{attr}.weight")
                elif c == "Parameter":
                    out.add(f"{prefix}{attr}")
        return out

    def _callees(self, call: ast.Call, cls: str, alias: dict) -> list[str]:
        func = call.func
        if isinstance(func, ast.Call):  # get_moe_impl_class(quant_config)(...)
            return ["<FusedMoE>"] if ast.unparse(func.func) == "get_moe_impl_class" else []
        name = alias.get(ast.unparse(func), ast.unparse(func)).rsplit(".", 1)[-1]
        if isinstance(func, ast.Attribute) and ast.unparse(func.value) == "self":  # a builder method
            try:
                m = self.method(cls, name)
            except StopIteration:
                return []
            return [c for r in ast.walk(m) if isinstance(r, ast.Return) and isinstance(r.value, ast.Call)
                    for c in self._callees(r.value, cls, alias)]
        return [name]

    # -------------------------------------------------------------- the draft's weight loader

    def draft_loader(self, draft: str, ns: dict) -> Callable:
        """(self, weights) -> SGLang's own ``load_weights`` of the draft class, compiled from source with
        ``ns`` as its globals (the caller provides ``default_weight_loader`` and ``logger``)."""
        fn = self.method(draft, "load_weights")
        calls_super = any(isinstance(n, ast.Call) and ast.unparse(n.func) == "super().load_weights"
                          and any(k.arg == "is_mtp" and k.value.value is True for k in n.keywords)
                          for n in ast.walk(fn))
        kv = self.module_assign(MODELS + "qwen3_5.py", "QWEN3_5_KV_SCALE_MAPPER")
        subs = ast.literal_eval(next(k.value for k in kv.keywords if k.arg == "orig_to_new_substr"))

        def kv_scales(weights):  # WeightsMapper(orig_to_new_substr=...).apply
            for name, w in weights:
                for a, b in subs.items():
                    name = name.replace(a, b)
                yield name, w

        ns.update(FusedMoE=SimpleNamespace(make_expert_params_mapping=self.make_expert_params_mapping()),
                  QWEN3_5_KV_SCALE_MAPPER=SimpleNamespace(apply=kv_scales), _use_aiter=False)
        if calls_super:  # Qwen3NextForCausalLMMTP: the base class's loader with is_mtp=True
            base = self.classes[draft][0].bases[0].id
            f = self.compiled(self.method(base, "load_weights"), ns)
            return lambda self_, weights: f(self_, weights, is_mtp=True)
        return self.compiled(fn, ns)

    def config_reads(self, cls: str, moe: bool, seen: Optional[set] = None) -> set[str]:
        """``config.<key>`` attributes read (without a getattr default) by ``cls.__init__`` and the
        module classes it builds."""
        seen = set() if seen is None else seen
        if cls in seen or cls not in self.classes:
            return set()
        seen.add(cls)
        init = self.method(cls, "__init__")
        out = {n.attr for n in ast.walk(init) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id in ("config", "mtp_config") and isinstance(n.ctx, ast.Load)}
        for n in ast.walk(init):
            if isinstance(n, ast.Call):
                for c in self._callees(n, cls, {}):
                    if c == "make_pp_layers" or c == "make_layers":
                        table = self.module_assign(self.classes[cls][1], "ALL_DECODER_LAYER_TYPES")
                        out |= self.config_reads(table.values[0].id, moe, seen)  # "attention" first
                    elif c in ("Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP"):
                        if (c == "Qwen2MoeSparseMoeBlock") == moe:
                            out |= self.config_reads(c, moe, seen)
                    elif c in self.classes:
                        out |= self.config_reads(c, moe, seen)
        return out


@pytest.fixture(scope="module")
def sgl() -> SGLangSource:
    return SGLangSource(_ensure_sources(SOURCES))


# ------------------------------------------------------------------ our export


def _export_worker(rank, world, out_root):
    """Export each tiny arch the way ``megatron_to_hf`` does (same Shapes, same folder writer)."""
    from bebop_megatron.convert.hf_megatron import iter_hf_buckets, write_hf_folder
    from bebop_megatron.convert.layout import Shapes
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed

    platform = initialize_distributed(1, 1, seed=0, force_cpu=True)
    for arch in ARCHS:
        cfg = tiny_hybrid_config(arch)
        model = build_model(cfg, platform, initialize=True)
        shapes = Shapes.from_config(cfg, 1, "qwen3_next" if cfg.model.mtp_recurrent else "deepseek")
        write_hf_folder(iter_hf_buckets(model, shapes), cfg, shapes, Path(out_root) / arch)
    return True


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sglang_export")
    run_distributed(_export_worker, 1, str(root))
    out = {}
    for arch in ARCHS:
        d = root / arch
        tensors = {}
        for f in sorted(d.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        out[arch] = (json.loads((d / "config.json").read_text()), tensors)
    return out


# ------------------------------------------------------------------ the checks


def draft_of(sgl: SGLangSource, config: dict) -> str:
    draft = sgl.draft_architectures().get(config["architectures"][0])
    assert draft is not None, f"SGLang has no NEXTN draft for {config['architectures'][0]}"
    assert draft in sgl.entry_classes(DRAFT_FILES[draft]), draft
    return draft


class Loader:
    """Runs SGLang's draft ``load_weights`` on one tensor at a time over the draft's parameter names."""

    def __init__(self, sgl: SGLangSource, config: dict):
        self.draft = draft_of(sgl, config)
        self.moe = "num_experts" in config
        self.params = sgl.params(self.draft, self.moe)
        self.hits: list[str] = []
        ns = {"default_weight_loader": lambda param, *_a: self.hits.append(param.pname),
              "logger": SimpleNamespace(warning_once=lambda *a, **k: None, warning=lambda *a, **k: None)}
        self.fn = sgl.draft_loader(self.draft, ns)
        self.config = SimpleNamespace(**config)

    def load(self, name: str, t: torch.Tensor) -> list[str]:
        """Draft parameters SGLang loads ``name`` into (empty: skipped, unknown or refused)."""
        self.hits.clear()
        params = {n: SimpleNamespace(pname=n, weight_loader=lambda param, *_a, **_k: self.hits.append(param.pname))
                  for n in self.params}
        self_ = SimpleNamespace(config=self.config, named_parameters=lambda: list(params.items()),
                                modules=lambda: [], enable_shared_expert_fusion=False, num_fused_shared_experts=0)
        try:
            self.fn(self_, [(name, t)])
        except KeyError:  # Qwen3-Next's loader indexes params_dict directly: an unknown name
            return []
        return list(self.hits)


def sglang_mtp_problems(sgl: SGLangSource, config: dict, tensors: dict) -> list[str]:
    """Everything SGLang's NEXTN draft would not load from this export (empty: all loads)."""
    ld = Loader(sgl, config)
    problems, loaded = [], set()
    for name, t in sorted(tensors.items()):
        if "mtp" not in name:
            continue
        hits = ld.load(name, t)
        if not hits:
            problems.append(f"not loaded by {ld.draft}: {name}")
        loaded |= set(hits)
    missing = ld.params - loaded - SHARED_WITH_TARGET
    problems += [f"{ld.draft} parameter never loaded: {p}" for p in sorted(missing)]
    return problems


# config keys SGLang gets from elsewhere: the two that the MTP drafts overwrite on their own copy of the
# config before building the layer (the target's are checked below), and the multimodal wrapper's
NOT_FROM_CONFIG_JSON = {"num_hidden_layers", "full_attention_interval", "text_config"}
# read on branches that the other model kind takes (``config.model_type`` picks the dense MLP or the MoE
# block; line ~1847 of qwen3_5.py reads num_experts_per_tok only for a fused all-reduce of the target)
BRANCH_ONLY = {"dense": {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "shared_expert_intermediate_size", "norm_topk_prob"},
               "Qwen3_5MoeForCausalLM": {"intermediate_size"}}


def sglang_config_problems(sgl: SGLangSource, config: dict) -> list[str]:
    draft = draft_of(sgl, config)
    moe = "num_experts" in config
    props = {n.name for n in sgl.classes["Qwen3NextConfig"][0].body if isinstance(n, ast.FunctionDef)
             and any(ast.unparse(d) == "property" for d in n.decorator_list)}  # computed, e.g. layers_block_type
    reads = sgl.config_reads(draft, moe) - NOT_FROM_CONFIG_JSON - props
    reads -= BRANCH_ONLY.get(config["architectures"][0], set()) | (set() if moe else BRANCH_ONLY["dense"])
    # the target's layer kinds: Qwen3NextConfig.layers_block_type reads these two from the top level
    block = sgl.method("Qwen3NextConfig", "layers_block_type")
    reads |= {n.attr for n in ast.walk(block) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self"}
    problems = [f"config.json lacks {k!r}, which SGLang reads" for k in sorted(reads) if k not in config]
    if "full_attention_interval" in config and "layer_types" in config:
        kinds = sgl.layers_block_type(config["num_hidden_layers"], config["full_attention_interval"])
        ours = ["attention" if t == "full_attention" else t for t in config["layer_types"]]
        if kinds != ours:
            problems.append(f"SGLang builds layers {kinds}, the export holds {ours}")
    if draft == "Qwen3_5ForCausalLMMTP":  # qwen3_5.py: model_type picks the MLP (else a ValueError)
        moe_types = ast.literal_eval(sgl.module_assign(MODELS + "qwen3_5.py", "_QWEN3_5_MOE_TEXT_MODEL_TYPES"))
        if not (config.get("model_type") in moe_types if moe else config.get("model_type") == "qwen3_5_text"):
            problems.append(f"model_type {config.get('model_type')!r} builds no {'MoE' if moe else 'dense'} layer")
    if config["rope_parameters"]["rope_theta"] != config.get("rope_theta", 10000):  # Qwen3-Next's getattr default
        problems.append("rope_theta differs from the one SGLang's Qwen3-Next attention reads")
    return problems


@pytest.mark.parametrize("arch", ARCHS)
def test_sglang_nextn_draft_loads_every_exported_mtp_tensor(sgl, exported, arch):
    config, tensors = exported[arch]
    assert config["architectures"][0] in sgl.draft_architectures()
    assert sum("mtp" in n for n in tensors) > 5
    assert sglang_mtp_problems(sgl, config, tensors) == []
    assert sglang_config_problems(sgl, config) == []


def test_sglang_check_refuses_other_layouts(sgl, exported):
    """The check can fail: DeepSeek / megatron names, a dropped tensor and a missing key are caught."""
    config, tensors = exported["qwen3_5_moe"]
    for old, new in [("mtp.fc.weight", "mtp.eh_proj.weight"),  # DeepSeek's head name under mtp.
                     ("mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attention.linear_qkv.weight"),
                     ("mtp.layers.0.mlp.experts.1.up_proj.weight", "mtp.layers.0.mlp.experts.1.linear_fc1.weight"),
                     ("mtp.norm.weight", "model.layers.2.shared_head.norm.weight")]:  # DeepSeek layout: skipped
        bad = dict(tensors)
        bad[new] = bad.pop(old)
        problems = sglang_mtp_problems(sgl, config, bad)
        assert problems and all(old not in p or "never loaded" in p for p in problems), (new, problems)
    dropped = {k: v for k, v in tensors.items() if k != "mtp.pre_fc_norm_hidden.weight"}
    assert sglang_mtp_problems(sgl, config, dropped) == ["Qwen3_5ForCausalLMMTP parameter never loaded: "
                                                          "pre_fc_norm_hidden.weight"]
    no_interval = {k: v for k, v in config.items() if k != "full_attention_interval"}
    assert any("full_attention_interval" in p for p in sglang_config_problems(sgl, no_interval))
    cfg_next, _ = exported["qwen3_next"]
    assert any("rope_theta" in p for p in sglang_config_problems(sgl, {k: v for k, v in cfg_next.items()
                                                                        if k != "rope_theta"}))
    dense = dict(config, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(AssertionError, match="no NEXTN draft"):
        draft_of(sgl, dense)
