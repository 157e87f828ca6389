"""``bebop`` command line: one sub-command per job."""

from __future__ import annotations

import argparse
import logging
import sys

from bebop_megatron.config import Config, ConfigError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), e.g. --set model.mtp_num_layers=3")


def _train_mtp(args) -> int:
    cfg = Config.load(args.config, args.overrides)  # config errors surface before the heavy imports
    from bebop_megatron.parallel import destroy_distributed, is_logging_rank
    from bebop_megatron.training.train_mtp import train_mtp

    try:
        summary = train_mtp(cfg)
        if is_logging_rank() and summary.get("exited_early"):
            print(f"\nStopped after train.exit_interval={cfg.train.exit_interval} steps (checkpointed); "
                  f"rerun the same command to resume. Output: {summary['output_dir']}")
        elif is_logging_rank() and summary["mtp"]["steps_run"] == 0:
            print(f"\nNothing to do: {summary['output_dir']} already holds a finished run "
                  f"(step {summary['mtp']['step']}). Remove it or set --set train.output_dir=... to start over.")
            print(f"  checkpoint:  {summary['mtp']['checkpoint']}")
        elif is_logging_rank():
            last = summary["mtp"]["last"]
            first = summary["mtp"]["first"]
            print(f"\nMTP training done ({cfg.mtp.loss}, γ={cfg.model.mtp_num_layers}).")
            print(f"  acceptance α (mean over depths): {first.get('mtp/accept_rate', 0):.3f} -> "
                  f"{last.get('mtp/accept_rate', 0):.3f}")
            print(f"  expected accepted drafts / verify step: {first.get('mtp/expected_accepted', 0):.3f} -> "
                  f"{last.get('mtp/expected_accepted', 0):.3f}")
            print(f"  checkpoint:  {summary['mtp']['checkpoint']}")
            print(f"  tensorboard: tensorboard --logdir {summary['output_dir']}")
            print(f"  summary:     {summary['output_dir']}/summary.json")
    finally:
        destroy_distributed()
    return 0


def _rl(args) -> int:
    cfg = Config.load(args.config, args.overrides)  # config errors surface before the heavy imports
    from bebop_megatron.parallel import destroy_distributed
    from bebop_megatron.rl.trainer import rl_train

    try:
        s = rl_train(cfg)
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            return 0
        if s.get("exited_early"):
            print(f"\nStopped at step {s['step']}/{cfg.rl.steps} (checkpointed); rerun the same command to resume. "
                  f"Output: {cfg.rl.output_dir}")
            return 0
        print(f"\nRL done: {s['step']} steps, mtp_strategy={cfg.rl.mtp_strategy}, mode={cfg.rl.mode}.")
        print(f"  held-out reward: {s.get('reward_before', float('nan')):.3f} -> {s.get('reward_after', float('nan')):.3f} "
              f"(exact answers {s.get('exact_before', float('nan')):.3f} -> {s.get('exact_after', float('nan')):.3f}, "
              f"{cfg.rl.eval_prompts} prompts)")
        fb, fa = s.get("eval_exact_by_task_before") or {}, s.get("eval_exact_by_task_after") or {}
        if fa:
            print("  per family: " + ", ".join(f"{t} {fb.get(t, float('nan')):.3f} -> {x:.3f}" for t, x in fa.items()))
        if s.get("train_reward_first_step") is not None:
            print(f"  training reward: {s['train_reward_first_step']:.3f} (first step) -> "
                  f"{s['train_reward_last_steps']:.3f} (mean of the last steps)")
        if s.get("accept_rate_last_steps") is not None:
            a0 = s.get("accept_rate_first_step")  # None: the first step verified no drafts (adaptive γ)
            print(f"  draft acceptance: {'n/a' if a0 is None else f'{a0:.3f}'} -> {s['accept_rate_last_steps']:.3f}; "
                  f"tokens per verify step {s['tokens_per_verify_last_steps']:.2f}")
        tr = s.get("train_reward_trend")
        if tr and tr.get("slope") is not None:
            print(f"  training reward trend: {tr['slope']:+.4f} ± {tr['se']:.4f} per step (OLS slope ± SE, n={tr['n']})")
            per = {t: f for t, f in (s.get("train_reward_trend_by_task") or {}).items() if f.get("slope") is not None}
            if per:
                print("  ... per family: " + ", ".join(f"{t} {f['slope']:+.4f} ± {f['se']:.4f}" for t, f in per.items()))
        fit, part = s.get("acceptance_vs_entropy_fit"), s.get("acceptance_vs_entropy_partial")
        if fit and fit.get("slope") is not None:
            print(f"  acceptance vs entropy: slope {fit['slope']:.3f}, r² {fit['r2']:.2f} "
                  f"({s['acceptance_vs_entropy_plot']})")
        if part and part.get("slope_entropy") is not None:
            print(f"  ... at fixed response length (partial fit): {part['slope_entropy']:.3f} ± "
                  f"{part['se_entropy']:.3f} per nat")
        if s.get("curves_plot"):
            print(f"  curves: {s['curves_plot']} (reward, entropy, acceptance, tokens per verify)")
        b = s.get("speculation_benchmark")
        if b:
            print(f"  rollout speed (batch {b['batch']}): {b['no_spec']['tokens_per_s']:.0f} tok/s without speculation, "
                  f"{b['mtp_spec']['tokens_per_s']:.0f} tok/s with MTP speculation "
                  f"({b['speedup']:.2f}x, median of {b.get('repeats', 1)} interleaved runs; "
                  f"{b['mtp_spec']['tokens_per_verify']:.2f} tokens per verify step)")
            if "adaptive" in b:
                print(f"  ... with adaptive γ (rl.adaptive_gamma): {b['adaptive']['tokens_per_s']:.0f} tok/s "
                      f"({b['speedup_adaptive']:.2f}x, mean γ per round {b['adaptive'].get('mean_gamma', 0):.2f})")
        print(f"  tensorboard: tensorboard --logdir {cfg.rl.output_dir}/tensorboard")
        print(f"  summary:     {cfg.rl.output_dir}/summary.json")
    finally:
        destroy_distributed()
    return 0


def _serve(args) -> int:
    from bebop_megatron.rollout.server import serve

    try:
        serve(args)
    except ValueError as e:  # a model/flag combination that cannot serve (named in the message)
        print(f"bebop serve: error: {e}", file=sys.stderr)
        return 2
    return 0


def _convert(args) -> int:
    from bebop_megatron.convert.hf_megatron import hf_to_megatron, megatron_to_hf

    if args.direction == "hf-to-megatron":
        res = hf_to_megatron(args.input, args.output, args.tp, args.pp, args.mtp_layers, args.vocab_multiple,
                             args.overwrite)
        print(f"converted {res['tensors']} HF tensors -> {res['output']} (TP={res['tp']}, PP={res['pp']}, "
              f"γ={res['mtp_layers']} MTP layers)")
        if res["fresh_mtp_layers"]:
            print("note: the Hugging Face model has no MTP weights; the MTP layers are freshly initialised "
                  "(train them with `bebop train-mtp --set train.load=...`)")
    else:
        res = megatron_to_hf(args.input, args.output, dtype=args.dtype, overwrite=args.overwrite)
        print(f"exported {res['tensors']} tensors from {res['checkpoint']} -> {res['output']} "
              f"({res['files']} safetensors file(s))")
    return 0


def _quiet_libraries() -> None:
    """megatron-core logs every parameter name at INFO and warns that TE/apex are absent on CPU."""
    import warnings

    logging.getLogger("megatron").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    for pattern in (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*",
                    ".*full scope is deprecated.*", ".*TorchDistLoadShardedStrategy.*"):
        warnings.filterwarnings("ignore", message=pattern)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    _quiet_libraries()
    parser = argparse.ArgumentParser(prog="bebop", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train-mtp", help="train MTP heads (trunk frozen) with ce/kl/tv/e2e_tv")
    _add_config_args(p)
    p.set_defaults(func=_train_mtp)
    p = sub.add_parser("rl", help="asynchronous GRPO with MTP-speculative rollouts")
    _add_config_args(p)
    p.set_defaults(func=_rl)
    p = sub.add_parser("convert", help="Hugging Face <-> megatron dist checkpoints")
    p.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"])
    p.add_argument("--input", required=True, help="HF folder, or a megatron checkpoint / run folder")
    p.add_argument("--output", required=True)
    p.add_argument("--tp", type=int, default=1, help="hf-to-megatron: tensor-parallel size of the output")
    p.add_argument("--pp", type=int, default=1, help="hf-to-megatron: pipeline-parallel size of the output")
    p.add_argument("--mtp-layers", type=int, default=None,
                   help="hf-to-megatron: γ MTP layers (default: the HF model's; fresh ones if it has none)")
    p.add_argument("--vocab-multiple", type=int, default=128, help="megatron make_vocab_size_divisible_by")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="megatron-to-hf: dtype of the exported tensors")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_convert)

    p = sub.add_parser("serve", help="SGLang-compatible HTTP server on the embedded engine")
    from bebop_megatron.rollout.server import add_serve_args

    add_serve_args(p)
    p.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"bebop: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not isinstance(e, _user_error_types()):
            raise
        print(f"bebop: error: {e}", file=sys.stderr)
        return 2


# Errors a user can fix (data, checkpoint, path, optional dependency), named by their home modules.
_USER_ERRORS = {"bebop_megatron.checkpointing": "CheckpointMismatch", "bebop_megatron.convert.layout": "ConversionError",
                "bebop_megatron.data": "DataError", "bebop_megatron.model.spec": "MissingOptionalDependency",
                "bebop_megatron.rollout.bridge": "RolloutError"}


def _user_error_types() -> tuple[type, ...]:
    """The user-error classes of the modules this command loaded. A module that was never imported
    cannot have raised, so `bebop serve` need not import megatron-core (~4 s) just to name its errors."""
    found = [getattr(sys.modules[m], name) for m, name in _USER_ERRORS.items() if m in sys.modules]
    return (FileNotFoundError, *found)


if __name__ == "__main__":
    sys.exit(main())
