"""Run an ablation: pack once per packing, train each variant, measure each, report.

Everything that can be checked is checked before the first training step: variant names, every
variant's config, the packed data (held-out windows enough for the evaluation, RULER prompts that
fit the lengths). Re-running the same command skips finished variants (training and
measurement), resumes an interrupted one from its latest checkpoint (the trainer's own resume),
and trains the rest.
"""
from __future__ import annotations

import hashlib
import json
import shlex
import shutil

import torch

from nemo_anchor.ablation import plots, report
from nemo_anchor.ablation.config import AblationConfig
from nemo_anchor.ablation.measure import Measurement, measure_variant, probe_settings
from nemo_anchor.ablation.plan import AblationPlan
from nemo_anchor.ablation.variants import Variant
from nemo_anchor.data import PackedDataset, load_tokenizer, pack
from nemo_anchor.data.layout import METADATA_FILE
from nemo_anchor.atomic import atomic_file
from nemo_anchor.evaluation.outputs import write_json
from nemo_anchor.evaluation.runner import EvalSettings, build_prompts
from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor.training.config import to_yaml


def prepare(plan: AblationPlan) -> Measurement:
    """Check the plan, pack the documents (once per packing), write each variant's run.yaml.

    Returns the measurement every variant gets. Raises ValueError naming the bad key or value.
    """
    plan.check_variants()
    plan.compare_with_recorded()
    plan.root.mkdir(parents=True, exist_ok=True)
    pack_documents(plan)
    measurement = _measurement(plan)
    _check_eval_inputs(plan, measurement)
    plan.record()
    for variant in plan.variants:
        with atomic_file(plan.run_config_file(variant)) as tmp:
            tmp.write_text(to_yaml(plan.run_config(variant)))
    return measurement


def pack_documents(plan: AblationPlan) -> None:
    """``DIR/data/<packing>``: the same documents, tokenizer and held-out split; only the packing option differs.

    The tag and interleave packings reuse the plain packing's tokenizer, so a trained BPE is trained once.
    Data packed by an earlier attempt with other pack settings (possible only before any training:
    afterwards the plan refuses changes) is packed again.
    """
    p = plan.config.pack
    settings = {"seq_length": plan.config.model.seq_length, "pack": plan.shared_settings()["pack"]}
    record = plan.root / "data" / "settings.json"
    if record.is_file() and json.loads(record.read_text()) != settings:
        print(f"pack settings changed since {record} was written: packing again", flush=True)
        shutil.rmtree(plan.root / "data")
    write_json(record, settings)
    tokenizer = p.tokenizer
    for packing in plan.packings:
        target = plan.data_dir(packing)
        if not (target / METADATA_FILE).is_file():  # pack() writes atomically: a directory there is complete
            print(f"packing {packing} windows into {target}", flush=True)
            pack(p.inputs, tokenizer, target, p.options(plan.config.model.seq_length, packing), overwrite=True)
        if packing == "plain":
            tokenizer = load_tokenizer(target)


def _measurement(plan: AblationPlan) -> Measurement:
    c, e = plan.config, plan.config.eval
    settings = EvalSettings(
        tasks=tuple(e.tasks), lengths=tuple(c.ruler_lengths()), num_samples=e.num_samples, seed=e.seed,
        max_new_tokens=e.max_new_tokens, perplexity_data=(str(plan.valid_dir),),
        perplexity_length=c.model.seq_length, perplexity_windows=e.perplexity_windows,
        perplexity_buckets=e.perplexity_buckets)
    probe = probe_settings(e.probe_sequences, e.probe_sequence_length, c.model.seq_length)
    return Measurement(settings, probe, e.last_k, e.dtype, e.device, str(plan.valid_dir))


def _check_eval_inputs(plan: AblationPlan, measurement: Measurement) -> None:
    """Enough held-out windows and RULER prompts that fit, before anything trains."""
    from transformers import AutoTokenizer

    e = plan.config.eval
    held_out = len(PackedDataset(plan.valid_dir))
    for key in ("perplexity_windows", "probe_sequences"):
        if getattr(e, key) > held_out:
            raise ValueError(f"eval.{key}={getattr(e, key)}: the held-out split {plan.valid_dir} has only "
                             f"{held_out} windows; raise pack.valid_fraction or lower eval.{key}")
    if measurement.eval.tasks:
        tokenizer = AutoTokenizer.from_pretrained(plan.data_dir("plain") / "tokenizer")
        try:
            build_prompts(tokenizer, measurement.eval, measurement.eval.lengths)
        except ValueError as err:
            raise ValueError(f"eval.lengths={list(measurement.eval.lengths)} / eval.tasks: {err}") from None


def checkpoint_steps(config: AblationConfig) -> list[int]:
    """The steps of the last K regular checkpoints (every save_every steps and the last step)."""
    t, c = config.trainer, config.checkpoint
    regular = sorted({*range(c.save_every, t.max_steps + 1, c.save_every), t.max_steps} if c.save_every
                     else {t.max_steps})
    return regular[-config.eval.last_k:]


def is_trained(plan: AblationPlan, variant: Variant) -> bool:
    saved = RunDir(plan.output_dir(variant)).list_checkpoints()
    return bool(saved) and checkpoint_step(saved[-1]) >= plan.config.trainer.max_steps


def train_variant(plan: AblationPlan, variant: Variant) -> bool:
    """Train (or resume) one variant in this process; True when it was stopped by SIGTERM/SIGINT."""
    from nemo_anchor.training.loop import Trainer

    trainer = Trainer(plan.run_config(variant))
    if trainer.resumed_from is None:
        write_json(plan.start_file(variant), {
            "init_from_hf": plan.config.model.init_from_hf, "seed": plan.config.trainer.seed,
            "weights_sha256": weights_digest(trainer.engine.model)})
    return trainer.fit().stopped_by_signal


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of this rank's parameters, in order, as raw bytes: equal digests = identical starting weights."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def measure(plan: AblationPlan, variant: Variant, measurement: Measurement) -> dict:
    """The variant's measurements, from ``eval.json`` when it was measured with the same settings."""
    steps = checkpoint_steps(plan.config)
    run = RunDir(plan.output_dir(variant))
    missing = [step for step in steps if not run.checkpoint(step).is_dir()]
    if missing:
        raise ValueError(f"{run.checkpoints} lacks the checkpoints of steps {missing} to average over "
                         f"(eval.last_k={plan.config.eval.last_k}); raise checkpoint.keep_last and retrain")
    key = measurement.key(steps)
    path = plan.eval_file(variant)
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return stored["result"]
    print(f"measuring {variant.name} at steps {steps}", flush=True)
    result = measure_variant(run.root, steps, measurement)
    write_json(path, {"key": key, "result": result})
    return result


def launch_commands(plan: AblationPlan, nproc_per_node: int, nnodes: int) -> list[str]:
    """One ``torchrun`` command per variant still to train (run.yaml files written by :func:`prepare`)."""
    launcher = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}"]
    if nnodes > 1:
        launcher += ["--node-rank=$NODE_RANK", "--rdzv-backend=c10d", "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"]
    return [" ".join([*launcher, "-m", "nemo_anchor.cli", "train", "--config",
                      shlex.quote(str(plan.run_config_file(variant)))])
            for variant in plan.variants if not is_trained(plan, variant)]


def run_ablation(plan: AblationPlan) -> int:
    """Prepare, train what is not trained, measure, write DIR/ablation.{json,md} and the plots.

    Returns 0, or EXIT_INTERRUPTED when a variant's training was stopped by SIGTERM/SIGINT (its
    checkpoint is saved; the same command resumes it).
    """
    from nemo_anchor.training.preemption import EXIT_INTERRUPTED

    measurement = prepare(plan)
    for variant in plan.variants:
        if is_trained(plan, variant):
            print(f"{variant.name}: already trained to step {plan.config.trainer.max_steps}, skipped", flush=True)
            continue
        print(f"=== training {variant.name} ({variant.attention_type}, {variant.packing} packing)", flush=True)
        if train_variant(plan, variant):
            print(f"{variant.name} interrupted: run the same command again to resume it", flush=True)
            return EXIT_INTERRUPTED
    measured = {variant.name: measure(plan, variant, measurement) for variant in plan.variants}
    write_report(plan, assemble(plan, measured))
    return 0


def assemble(plan: AblationPlan, measured: dict[str, dict]) -> dict:
    """The content of ablation.json."""
    from omegaconf import OmegaConf

    c = plan.config
    starts = {v.name: json.loads(plan.start_file(v).read_text()) if plan.start_file(v).is_file() else None
              for v in plan.variants}
    digests = {start["weights_sha256"] for start in starts.values() if start is not None}
    variants = {
        v.name: {"attention_type": v.attention_type, "packing": v.packing, "data": str(plan.data_dir(v.packing)),
                 "valid_data": str(plan.valid_dir), "output_dir": str(plan.output_dir(v)), "start": starts[v.name],
                 **measured[v.name]}
        for v in plan.variants}
    reference = plan.variants[0].name
    return {
        "reference": reference,
        "steps": c.trainer.max_steps,
        "last_k": c.eval.last_k,
        "checkpoint_steps": checkpoint_steps(c),
        "start": f"model.init_from_hf={c.model.init_from_hf}" if c.model.init_from_hf else
                 f"random init, trainer.seed={c.trainer.seed}",
        # None when some variant was trained by a torchrun launch (no digest recorded)
        "same_start": len(digests) == 1 if None not in starts.values() else None,
        "variants": variants,
        "comparisons": report.compare(variants, reference),
        "noise_rule": report.NOISE_RULE,
        "config": OmegaConf.to_container(OmegaConf.structured(c)),
    }


def write_report(plan: AblationPlan, content: dict) -> None:
    write_json(plan.root / "ablation.json", content)
    with atomic_file(plan.root / "ablation.md") as tmp:
        tmp.write_text(report.markdown(content))
    plots.plot_loss_curves(content, plan.root / "loss_curves.png")
    plots.plot_ruler(content, plan.root / "ruler_vs_length.png")
    plots.plot_perplexity(content, plan.root / "perplexity_by_position.png")
    print(report.markdown(content))
    print(f"wrote {plan.root / 'ablation.json'}, {plan.root / 'ablation.md'} and the plots", flush=True)
