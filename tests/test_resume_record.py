"""One resume record for NeMo's and Bridge's front doors (``nemo_anchor.training.resume.run_record``): built from the
Megatron config a door trains with (here NeMo's), under ``nemo-anchor train``'s own config keys and values, so the
three doors compare a resume by the same names. Skipped without NeMo."""
import pytest
from omegaconf import OmegaConf

from nemo_anchor.training import resume
from nemo_anchor.training.config import load_config
from tiny_runs import pack_texts  # tests/tiny_runs.py

pytest.importorskip("nemo.collections.llm", reason="NeMo is not installed")


def test_a_doors_record_speaks_nemo_anchor_trains_config(tmp_path):
    from nemo_anchor.nemo.config import AnchorLlamaConfig

    data = pack_texts(tmp_path)
    ours = load_config(None, [f"output_dir={tmp_path / 'run'}", f"data.path={data}", "model.num_layers=3",
                              "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
                              "model.ffn_hidden_size=96", "model.seq_length=64", "model.vocab_size=300"])
    m, t, o = ours.model, ours.trainer, ours.optim
    nemo = AnchorLlamaConfig(  # the same model, as a NeMo recipe configures it
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups, seq_length=m.seq_length,
        vocab_size=m.vocab_size, rotary_base=m.resolved_rotary_base(), init_method_std=m.init_method_std,
        layernorm_epsilon=m.norm_epsilon, share_embeddings_and_output_weights=m.tie_embeddings,
        attention_type=m.attention_type, bf16=t.precision == "bf16", apply_rope_fusion=False)
    record = resume.run_record(
        nemo, data_path=data, valid_path=None, global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size, max_steps=t.max_steps,
        optim={"lr": o.lr, "min_lr": o.min_lr, "weight_decay": o.weight_decay, "clip_grad": o.clip_grad,
               "beta1": o.beta1, "beta2": o.beta2, "eps": o.eps, "warmup_steps": o.warmup_steps,
               "schedule": o.schedule})
    trainer_config = resume.flatten(OmegaConf.to_container(OmegaConf.structured(ours)))
    recorded = resume.flatten(record["config"])
    assert set(recorded) <= set(trainer_config), sorted(set(recorded) - set(trainer_config))
    # every key the trainer sets equals its value (None: decided by the architecture; "auto": resolved)
    resolved = {"model.rotary_base": str(m.resolved_rotary_base()), "data.path": str(data)}
    compared = {key: value for key, value in recorded.items() if trainer_config[key] is not None}
    assert len(compared) > 20
    for key, value in compared.items():
        assert value == resolved.get(key, trainer_config[key]), (key, value, trainer_config[key])
    assert record["data"]["fingerprint"] == resume.dataset_fingerprint(data)
    assert record["data"]["files"]["path"] == str(data.resolve())
