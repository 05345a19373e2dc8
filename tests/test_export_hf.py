"""HF <-> Megatron conversion: logit parity, round trips, training checkpoints -> HF directories."""
import json

import pytest
import torch
import transformers
from safetensors import safe_open

from nemo_anchor.compat import hf_rope
from nemo_anchor.convert.hf_mapping import megatron_to_hf_state
from nemo_anchor.convert.megatron_state import build_model, canonical_state
from nemo_anchor.data import byte_tokenizer
from nemo_anchor.export.hf import export_hf, import_hf
from nemo_anchor.export.inference import load_checkpoint, load_hf_model
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.training.init_from_hf import init_model_from_hf

VOCAB = 259  # the byte tokenizer: 256 bytes + BOS, EOS, PAD
BOS, EOS, PAD = 256, 257, 258
HF_CONFIGS = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
              "qwen2": transformers.Qwen2Config}
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}


def llama3_scaling(factor):
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


# the model families users extend, each as a tiny random model: (HF architecture, config fields)
FAMILIES = {
    "llama2": ("llama", {"rope_theta": 10000.0}),
    "llama3": ("llama", {"rope_theta": 500000.0}),
    "llama3.1": ("llama", {"rope_theta": 500000.0, "rope_scaling": llama3_scaling(8.0)}),
    "llama3.2-tied": ("llama", {"rope_theta": 500000.0, "rope_scaling": llama3_scaling(32.0),
                                "tie_word_embeddings": True}),
    "smollm2-tied": ("llama", {"rope_theta": 100000.0, "tie_word_embeddings": True}),
    "llama-yarn": ("llama", YARN),
    "mistral-v0.3": ("mistral", {"rope_theta": 1e6, "head_dim": 24}),  # head_dim != hidden / heads
    "qwen2": ("qwen2", {"rope_theta": 10000.0}),
    "qwen2.5-tied": ("qwen2", {"rope_theta": 1e6, "tie_word_embeddings": True}),
}
DOCUMENTS = ("The capital of France is Paris.", "Rotary position embeddings rotate queries and keys.",
             "Long-context training packs several documents into one window.", "bf16 has 8 bits of mantissa.")


def save_tiny_hf(path, arch, seed=0, **extra):
    """A random 2-layer grouped-query HF model with the byte tokenizer, saved to ``path``; returned in eval mode."""
    if arch == "mistral":
        extra.setdefault("sliding_window", None)
    extra.setdefault("rope_theta", 5000.0)
    config = HF_CONFIGS[arch](vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms and biases away from their 1/0 init, so a swapped tensor shows
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    byte_tokenizer().save(path)
    return model.eval()


def sample_tokens(batch=2, length=40, seed=1):
    tokens = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = BOS
    return tokens


def text_tokens(length=40):
    """[len(DOCUMENTS), length] int64: each document as bytes after BOS, cut to ``length``."""
    return torch.tensor([[BOS, *text.encode()[: length - 1]] for text in DOCUMENTS if len(text) >= length - 1])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_megatron_logits_match_transformers(tmp_path, family):
    arch, extra = FAMILIES[family]
    hf = save_tiny_hf(tmp_path / "hf", arch, **extra)
    ours = load_checkpoint(tmp_path / "hf")
    assert ours.config.tie_embeddings == bool(extra.get("tie_word_embeddings", False))
    for tokens in (sample_tokens(), text_tokens()):
        with torch.no_grad():
            logits = ours(tokens)
            reference = hf(tokens).logits
        assert logits.dtype == torch.float32 and logits.shape == (*tokens.shape, VOCAB)
        assert (logits - reference).abs().max() <= 1e-4


def packed_window(length=64):
    """Two windows of ``length`` tokens packed from DOCUMENTS (each opened by BOS, the anchor), as
    ``collate_windows`` lays them out, and the additive ``[2, 1, T, T]`` anchor mask spelled out from the
    definition: causal, within the document or to the window's first token."""
    stream = [token for text in DOCUMENTS for token in (BOS, *text.encode())]
    starts = [0]
    for text in DOCUMENTS:
        starts.append(starts[-1] + 1 + len(text.encode()))
    tokens = torch.tensor(stream[: 2 * length]).reshape(2, length)
    cuts = sorted({*[s for s in starts if s < 2 * length], length, 2 * length})  # a window edge also ends a document
    document = torch.zeros(2 * length, dtype=torch.long)
    for index, (start, end) in enumerate(zip(cuts[:-1], cuts[1:])):
        document[start:end] = index
    document = document.reshape(2, length)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    first = torch.zeros(length, length, dtype=torch.bool)
    first[:, 0] = True
    allowed = causal & ((document[:, :, None] == document[:, None, :]) | first)
    mask = torch.zeros(2, 1, length, length).masked_fill(~allowed[:, None], float("-inf"))
    batch = {"tokens": tokens, "position_ids": torch.arange(length).expand(2, length),
             "cu_seqlens": torch.tensor(cuts, dtype=torch.int32),
             "cu_windows": torch.tensor([0, length, 2 * length], dtype=torch.int32)}
    return batch, mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_anchor_window_matches_transformers_with_the_anchor_mask(tmp_path, family):
    from nemo_anchor.model.gpt import packed_forward

    arch, extra = FAMILIES[family]
    save_tiny_hf(tmp_path / "hf", arch, **extra)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ours = load_checkpoint(tmp_path / "hf")
    assert ours.config.attention_type == "anchor"
    batch, mask = packed_window()
    assert len(batch["cu_seqlens"]) - 1 > 3  # several documents, one of them cut by the window edge
    with torch.no_grad():
        logits = packed_forward(ours.gpt, batch)
        reference = hf(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=mask).logits
        unmasked = hf(input_ids=batch["tokens"], position_ids=batch["position_ids"]).logits
    assert (logits - reference).abs().max() <= 1e-4
    assert (logits - unmasked).abs().max() > 1e-3  # the mask really cuts the later documents off


@pytest.mark.parametrize("family", ["llama2", "llama3.1", "llama3.2-tied", "qwen2", "qwen2.5-tied", "mistral-v0.3"])
def test_round_trip_hf_ours_hf_keeps_logits(tmp_path, family):
    arch, extra = FAMILIES[family]
    hf = save_tiny_hf(tmp_path / "hf", arch, **extra)
    ours = import_hf(tmp_path / "hf", tmp_path / "ours")
    assert (ours / "checkpoints" / "iter_0000000" / "metadata.json").is_file()
    assert (ours / "tokenizer" / "tokenizer.json").is_file()
    exported = export_hf(ours, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(back) is type(hf)
    for key in ("max_position_embeddings", "num_key_value_heads", "vocab_size", "tie_word_embeddings"):
        assert getattr(back.config, key) == getattr(hf.config, key), key
    assert hf_rope(back.config) == hf_rope(hf.config)  # theta and scaling
    head_dim = [getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads for c in (back.config, hf.config)]
    assert head_dim[0] == head_dim[1]
    loaded, tokenizer = load_hf_model(tmp_path / "hf")
    assert tokenizer.bos_token_id == BOS
    tokens = sample_tokens()
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, hf(tokens).logits)
        assert torch.equal(loaded(tokens).logits, hf(tokens).logits)
    files = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # staging directories renamed away


def _training_checkpoint(output_dir, model_cfg: ModelConfig, seed=0, precision="fp32"):
    """A Megatron model saved by the trainer's own engine and checkpoint writer, with the tokenizer beside it."""
    from nemo_anchor.parallel.distributed import initialize_parallel
    from nemo_anchor.run_dir import RunDir
    from nemo_anchor.training.checkpoint_saver import save_checkpoint
    from nemo_anchor.training.config import OptimConfig, RunConfig, TrainerConfig, to_yaml
    from nemo_anchor.training.engine import build_engine

    def random_weights(gpt):
        torch.manual_seed(seed)
        with torch.no_grad():
            for param in gpt.parameters():
                param.normal_(0.0, 0.2)

    config = RunConfig(output_dir=str(output_dir), model=model_cfg, trainer=TrainerConfig(precision=precision),
                       optim=OptimConfig(weight_decay=0.0))
    engine = build_engine(config, initialize_parallel(), VOCAB, initialize=random_weights)
    engine.model.zero_grad_buffer()  # one step on zero gradients creates Adam's state and moves no weight
    engine.optimizer.step()
    save_checkpoint(RunDir(output_dir), 7, engine, {"step": 7}, to_yaml(config), keep_last=1)
    byte_tokenizer().save(output_dir / "tokenizer")
    reference = build_model(model_cfg, VOCAB)  # the weights the checkpoint must hold, as fp32
    random_weights(reference)
    if precision == "bf16":  # the masters start from the bf16 parameters the weights were loaded into
        with torch.no_grad():
            for param in reference.parameters():
                param.copy_(param.bfloat16().float())
    return reference.eval()


TRAINED = {
    "llama-gqa": ModelConfig(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96,
                             num_attention_heads=4, num_query_groups=2, seq_length=256, rotary_base="auto"),
    "qwen2-tied": ModelConfig(architecture="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=96,
                              num_attention_heads=4, num_query_groups=1, seq_length=256, rotary_base="20000",
                              tie_embeddings=True),
    "llama-ntk": ModelConfig(architecture="llama", num_layers=1, hidden_size=64, ffn_hidden_size=96,
                             num_attention_heads=2, num_query_groups=2, seq_length=256, rotary_base="10000",
                             rope_scaling="ntk", rope_scaling_factor=4.0),
}


@pytest.mark.parametrize("name", list(TRAINED))
def test_training_checkpoint_exports_to_transformers(tmp_path, name):
    cfg = TRAINED[name]
    megatron = _training_checkpoint(tmp_path / "run", cfg)
    exported = export_hf(tmp_path / "run", tmp_path / "hf")  # output_dir -> its latest checkpoint

    config = json.loads((exported / "config.json").read_text())
    rope_theta, _ = hf_rope(transformers.AutoConfig.from_pretrained(exported))
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.architecture]]
    assert config["max_position_embeddings"] == cfg.seq_length
    assert rope_theta == pytest.approx(cfg.resolved_rotary_base())
    assert config["num_key_value_heads"] == cfg.num_query_groups
    assert config["bos_token_id"] == BOS and config["eos_token_id"] == EOS

    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tokens = sample_tokens()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        reference = megatron(input_ids=tokens, position_ids=positions, attention_mask=None).float()
        assert (hf(tokens).logits - reference).abs().max() <= 1e-4
        assert (load_checkpoint(tmp_path / "run")(tokens) - reference).abs().max() <= 1e-4
        in_memory, tokenizer = load_hf_model(tmp_path / "run" / "checkpoints" / "iter_0000007")
        assert (in_memory(tokens).logits - reference).abs().max() <= 1e-4

    # what a user does with the exported directory: tokenize, generate, decode, offline
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    prompt = tokenizer("anchor", return_tensors="pt")
    generated = hf.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 5)
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_bfloat16_export_and_inference(tmp_path):
    megatron = _training_checkpoint(tmp_path / "run", TRAINED["llama-gqa"], precision="bf16")
    tokens = sample_tokens()
    with torch.no_grad():  # a bf16 run's checkpoint is read back as fp32 (the optimizer's masters)
        reference = megatron(input_ids=tokens, position_ids=torch.arange(40).expand_as(tokens), attention_mask=None)
        assert (load_checkpoint(tmp_path / "run")(tokens) - reference).abs().max() <= 1e-4
    exported = export_hf(tmp_path / "run", tmp_path / "hf", dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype="auto")
    assert hf.dtype == torch.bfloat16  # from config.json
    with safe_open(exported / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.bfloat16}
    with torch.no_grad():
        logits = load_checkpoint(tmp_path / "run", dtype=torch.bfloat16)(tokens)
    assert logits.dtype == torch.float32
    assert (logits - reference).abs().max() <= 0.1 * reference.abs().max()


def test_transformer_engine_and_stacked_names_convert_like_local_ones():
    cfg = TRAINED["llama-gqa"]
    torch.manual_seed(0)
    local = {k: v for k, v in build_model(cfg, VOCAB).state_dict().items() if not k.endswith("_extra_state")}
    te_names = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    stacked = {}
    for key, value in local.items():
        if key.startswith("decoder.layers."):
            _, _, index, rest = key.split(".", 3)
            stacked.setdefault(f"decoder.layers.{te_names.get(rest, rest)}", {})[int(index)] = value
        else:
            stacked[key] = value
    stacked = {k: torch.stack([v[i] for i in sorted(v)]) if isinstance(v, dict) else v for k, v in stacked.items()}
    expected = megatron_to_hf_state(local, cfg)
    converted = megatron_to_hf_state(canonical_state(stacked, cfg.num_layers), cfg)
    assert expected.keys() == converted.keys()
    assert all(torch.equal(expected[k], converted[k]) for k in expected)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sliced_hf_reads_match_the_full_conversion(tmp_path, arch):
    """``model.init_from_hf`` reads a rank's shard from safetensors: every tensor's halves of rows and
    columns (what two tensor-parallel ranks hold, QKV groups and gate/up included) equal the whole
    HF->Megatron conversion's."""
    from nemo_anchor.convert.hf_mapping import hf_to_megatron_state
    from nemo_anchor.convert.hf_slices import sliced_state
    from nemo_anchor.convert.sources import read_model_config

    hf = save_tiny_hf(tmp_path / "hf", arch)
    cfg, _ = read_model_config(tmp_path / "hf")
    full = hf_to_megatron_state(hf.state_dict(), cfg, source="hf")
    with sliced_state(tmp_path / "hf", cfg) as lazy:
        assert lazy.keys() == full.keys()
        for name, tensor in full.items():
            assert tuple(lazy[name].shape) == tuple(tensor.shape), name
            rows, cols = tensor.shape[0] // 2, (tensor.shape[1] // 2 if tensor.dim() == 2 else None)
            for part in ((slice(0, rows),), (slice(rows, None),)):
                index = part if cols is None else (*part, slice(cols, None))
                assert torch.equal(lazy[name][index], tensor[index]), (name, index)


def test_init_model_from_hf_loads_weights_into_a_longer_context_model(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", "llama")
    cfg = ModelConfig(architecture="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                      num_query_groups=2, seq_length=1024, rotary_base="5000", norm_epsilon=1e-6)
    model = build_model(cfg, VOCAB)
    init_model_from_hf(model, tmp_path / "hf")
    tokens = sample_tokens()
    with torch.no_grad():
        ours = model(input_ids=tokens, position_ids=torch.arange(40).expand_as(tokens), attention_mask=None)
        assert (ours - hf(tokens).logits).abs().max() <= 1e-4
