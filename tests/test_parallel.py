"""TP=2 equals TP=1 for all four MTP losses (forward and grads), and PP=2 through megatron-core's
pipeline schedule equals PP=1. Real gloo process groups, 2 spawned ranks."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.tiny_models import tiny_config

LOSSES = ["ce", "kl", "tv", "e2e_tv"]


def _batch(seed, b=2, s=16, vocab=100):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s + 1), generator=g)
    mask = torch.ones(b, s)
    mask[0, -3:] = 0
    return ids[:, :-1], ids[:, 1:], mask, torch.arange(s).repeat(b, 1)


def _run_losses(model, detach):
    """Forward/backward each loss through megatron DDP + finalize_model_grads (as training does:
    that is where replicated QK-norm grads are summed over TP and grads averaged over DP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from bebop_megatron.model.tp_layout import gather_full

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    tokens, labels, mask, pos = _batch(7)
    out = {}
    for loss_type in LOSSES:
        model.mtp_loss_type = loss_type
        model.mtp_detach_trunk = detach
        ddp.zero_grad_buffer()
        token_loss = ddp(tokens, pos, None, labels=labels, loss_mask=mask)
        main = (token_loss * mask).sum() / mask.sum()
        main.backward()
        finalize_model_grads([ddp])
        metrics = model.mtp_metrics.reduce()
        grads = gather_full(model, {n: p.main_grad for n, p in model.named_parameters()})
        out[loss_type] = {"main": main.item(), "mtp_loss": metrics["mtp/loss"],
                          "alpha": [metrics[f"mtp/alpha_{k}"] for k in (1, 2)], "grads": grads}
    return out


def _tp_worker(rank, world, tie, detach):
    from megatron.core import parallel_state

    from bebop_megatron.model import build_model
    from bebop_megatron.model.tp_layout import load_full_state_dict
    from bebop_megatron.parallel import initialize_distributed

    cfg = tiny_config(tie_word_embeddings=tie)
    platform = initialize_distributed(1, 1, seed=11)
    torch.manual_seed(0)
    model1 = build_model(cfg, platform)
    full = {n: p.detach().clone() for n, p in model1.named_parameters()}
    ref = _run_losses(model1, detach)
    parallel_state.destroy_model_parallel()

    cfg.parallel.tensor_model_parallel_size = 2
    platform = initialize_distributed(2, 1, seed=11)
    model2 = build_model(cfg, platform)
    load_full_state_dict(model2, full)
    got = _run_losses(model2, detach)
    report = {}
    for loss_type in LOSSES:
        r, g = ref[loss_type], got[loss_type]
        gdiff = max((r["grads"][n] - g["grads"][n]).abs().max().item() for n in r["grads"])
        gscale = max(r["grads"][n].abs().max().item() for n in r["grads"])
        mtp_gnorm = sum(r["grads"][n].abs().sum().item() for n in r["grads"] if n.startswith("mtp."))
        report[loss_type] = dict(main=abs(r["main"] - g["main"]), mtp=abs(r["mtp_loss"] - g["mtp_loss"]),
                                 alpha=max(abs(a - b) for a, b in zip(r["alpha"], g["alpha"])),
                                 grad=gdiff, gscale=gscale, mtp_gnorm=mtp_gnorm)
    return report


@pytest.mark.parametrize("tie,detach", [(True, True), (False, False)])
def test_tp2_equals_tp1_all_losses(tie, detach):
    reports = run_distributed(_tp_worker, 2, tie, detach)
    for rep in reports:
        for loss_type, r in rep.items():
            assert r["main"] < 1e-5 and r["mtp"] < 1e-5 and r["alpha"] < 1e-5, (loss_type, r)
            assert r["grad"] < 1e-5, (loss_type, r)
            assert r["mtp_gnorm"] > 0, loss_type


def _pp_worker(rank, world, tie, ckpt_dir):
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from bebop_megatron.data import Batch
    from bebop_megatron.model import build_model
    from bebop_megatron.parallel import initialize_distributed
    from bebop_megatron.training.step import train_iteration

    cfg = tiny_config(num_layers=4, tie_word_embeddings=tie)
    batches = [Batch(*_batch(100 + i)) for i in range(3)]

    def run(model):
        # the training path: megatron DDP + finalize_model_grads (syncs the MTP stage's embedding copy)
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        model.config.finalize_model_grads_func = finalize_model_grads
        loss_sum, ntok, _, _ = train_iteration([ddp], None, batches, seq_length=16)
        metrics = model.mtp_metrics.reduce() if parallel_state.is_pipeline_last_stage() else {}
        return loss_sum / max(ntok, 1), metrics, {n: p.main_grad.clone() for n, p in model.named_parameters()}

    platform = initialize_distributed(1, 1, seed=3)
    torch.manual_seed(0)
    model1 = build_model(cfg, platform)
    full = {n: p.detach().clone() for n, p in model1.named_parameters()}
    ref_loss, ref_metrics, ref_grads = run(model1)
    parallel_state.destroy_model_parallel()

    cfg.parallel.pipeline_model_parallel_size = 2
    platform = initialize_distributed(1, 2, seed=3)
    model2 = build_model(cfg, platform)
    offset = get_transformer_layer_offset(model2.config)

    def global_name(name):
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            return f"decoder.layers.{int(i) + offset}.{rest}"
        return name

    with torch.no_grad():
        for n, p in model2.named_parameters():
            p.copy_(full[global_name(n)])
    loss, metrics, grads = run(model2)

    # PP=2 checkpoint round trip (tied embeddings put an embedding copy on the MTP stage)
    from bebop_megatron.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint

    save_checkpoint(ckpt_dir, 1, model2)
    model3 = build_model(cfg, platform)
    load_checkpoint(latest_checkpoint(ckpt_dir), model3)
    ckpt_equal = all(torch.equal(a, b) for a, b in zip(model2.parameters(), model3.parameters()))
    grad_diff = max((grads[n] - ref_grads[global_name(n)]).abs().max().item() for n in grads)
    grad_scale = max(g.abs().max().item() for g in grads.values())
    out = {"stage": parallel_state.get_pipeline_model_parallel_rank(), "grad_diff": grad_diff,
           "grad_scale": grad_scale, "names": sorted(grads), "ckpt_equal": ckpt_equal}
    if parallel_state.is_pipeline_last_stage():
        out.update(loss=loss, ref_loss=ref_loss, mtp=metrics["mtp/loss"], ref_mtp=ref_metrics["mtp/loss"],
                   alpha=metrics["mtp/accept_rate"], ref_alpha=ref_metrics["mtp/accept_rate"])
    return out


@pytest.mark.parametrize("tie", [False, True])
def test_pp2_schedule_equals_pp1(tie, tmp_path):
    r0, r1 = run_distributed(_pp_worker, 2, tie, str(tmp_path / "ck"))
    assert r0["ckpt_equal"] and r1["ckpt_equal"]
    assert r0["stage"] == 0 and r1["stage"] == 1
    assert not any(n.startswith("mtp.") for n in r0["names"]) and any(n.startswith("mtp.") for n in r1["names"])
    assert abs(r1["loss"] - r1["ref_loss"]) < 1e-5, r1
    assert abs(r1["mtp"] - r1["ref_mtp"]) < 1e-5, r1
    assert abs(r1["alpha"] - r1["ref_alpha"]) < 1e-5, r1
    assert r0["grad_diff"] < 1e-5 and r1["grad_diff"] < 1e-5, (r0["grad_diff"], r1["grad_diff"])
    assert r0["grad_scale"] > 0 and r1["grad_scale"] > 0
