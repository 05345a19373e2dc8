"""NeMo 2 glue on the CPU: anchor configs build and train, YAML reaches the model, recipes, NeMo 2 export.

NeMo is imported once, by the module-scoped ``llm`` fixture (about 20 s); without NeMo installed
every test here is skipped.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SEQ = 64


@pytest.fixture(scope="module")
def llm():
    llm = pytest.importorskip("nemo.collections.llm")
    from nemo_anchor.parallel.distributed import initialize_parallel

    initialize_parallel()
    return llm


def tiny(config_class, **overrides):
    sizes = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                 seq_length=SEQ, rotary_base=10_000, vocab_size=259, use_cpu_initialization=True,
                 gradient_accumulation_fusion=False)
    return config_class(**{**sizes, **overrides})


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A packed dataset of real text (several documents per 64-token window) with the byte tokenizer."""
    from nemo_anchor.data import PackOptions, pack

    root = tmp_path_factory.mktemp("packed")
    corpus = root / "docs.jsonl"
    words = Path(__file__).read_text().split()
    lines = [json.dumps({"text": " ".join(words[i:i + 3 + i % 9])}) for i in range(0, 400, 7)]
    corpus.write_text("\n".join(lines) + "\n")
    pack([corpus], "byte", root / "data", PackOptions(seq_length=SEQ))
    return root / "data"


@pytest.fixture(scope="module")
def nemo_run_dir(llm, packed, tmp_path_factory):
    """A NeMo LlamaModel with our config, its first packed batch, and a NeMo 2 checkpoint directory of it."""
    from megatron.core import dist_checkpointing
    from nemo import lightning as nl
    from nemo.lightning.io.pl import TrainerContext

    from nemo_anchor.nemo.config import AnchorLlamaConfig
    from nemo_anchor.nemo.data import AnchorPackedDataModule

    data = AnchorPackedDataModule(str(packed), seq_length=SEQ, micro_batch_size=2, global_batch_size=2,
                                  num_workers=0)
    torch.manual_seed(0)
    model = llm.LlamaModel(tiny(AnchorLlamaConfig), tokenizer=data.tokenizer)
    model.configure_model()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight would show in the logits
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    checkpoint = tmp_path_factory.mktemp("nemo2") / "step=1"
    (checkpoint / "weights").mkdir(parents=True)
    dist_checkpointing.save(model.module.sharded_state_dict(prefix="module."), str(checkpoint / "weights"))
    TrainerContext(model=model, trainer=nl.Trainer(accelerator="cpu", devices=1), extra={}).io_dump(
        checkpoint / "context", yaml_attrs=["model"])
    return model, next(iter(data.train_dataloader())), checkpoint


def test_anchor_config_puts_our_core_attention_in_the_model(llm):
    from nemo_anchor.model.core_attention import AnchorCoreAttention
    from nemo_anchor.nemo.config import AnchorMistralConfig, AnchorQwen2Config

    for config_class, mask, has_bias in ((AnchorQwen2Config, "intra_doc", True), (AnchorMistralConfig, "full", False)):
        attention_type = {"intra_doc": "intra_doc_reset", "full": "full"}[mask]
        module = tiny(config_class, attention_type=attention_type).configure_model(None)
        core = [m for m in module.modules() if isinstance(m, AnchorCoreAttention)]
        assert len(core) == 2 and {c.mask for c in core} == {mask}
        assert any(k.endswith("linear_qkv.bias") for k in module.state_dict()) == has_bias
    with pytest.raises(ValueError, match="unknown attention_type 'sliding'"):
        tiny(AnchorQwen2Config, attention_type="sliding")
    with pytest.raises(ValueError, match="attention_kernel='te': .*copy K and V in every layer"):
        tiny(AnchorQwen2Config, attention_type="anchor", attention_kernel="te")
    with pytest.raises(ValueError, match=r"attention_kernel='flash2': choose one of \('auto'"):
        tiny(AnchorQwen2Config, attention_kernel="flash2")


def test_packed_batch_trains_through_nemo_steps_with_the_anchor_mask(nemo_run_dir):
    """NeMo's data and forward steps on a packed batch equal, token by token, the HF model run on
    each document alone behind the anchor, at the document's own positions in the window."""
    import transformers

    from nemo_anchor.export.hf import export_hf

    model, batch, checkpoint = nemo_run_dir
    assert len(batch["cu_seqlens"]) > len(batch["cu_windows"])  # windows do hold several documents
    step_batch = model.config.data_step_fn(iter([batch]))
    loss = model.forward_step(step_batch)
    assert loss.shape == batch["tokens"].shape

    hf_dir = export_hf(checkpoint, checkpoint.parent / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    bounds = batch["cu_seqlens"].tolist()
    tokens, labels = batch["tokens"].flatten(), batch["labels"].flatten()
    with torch.no_grad():
        for start, end in zip(bounds, bounds[1:]):
            window_start = start - start % SEQ
            keep = [window_start] * (start != window_start) + list(range(start, end))
            logits = hf(input_ids=tokens[keep][None], position_ids=(torch.tensor(keep) - window_start)[None]).logits
            expected = F.cross_entropy(logits[0, -(end - start):], labels[start:end], reduction="none")
            assert (loss.flatten()[start:end] - expected).abs().max() <= 1e-4, (start, end)

    (loss * batch["loss_mask"]).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and sum(g.abs().sum() for g in grads) > 0


def test_nemos_own_packed_sequence_batch_is_refused_by_our_data_step(llm, tmp_path):
    """NeMo's packed fine-tuning data (GPTSFTPackedDataset, collated by NeMo itself) marks sequences, not windows
    that begin with their anchor: our configs' data step refuses it in one line, naming it."""
    import types

    import numpy as np
    from nemo.collections.llm.gpt.data.core import GPTSFTPackedDataset

    from nemo_anchor.nemo.config import AnchorLlamaConfig

    packs = [{"input_ids": list(range(1, 41)), "loss_mask": [1] * 40, "seq_start_id": [0, 9, 25]}]
    np.save(tmp_path / "training.npy", np.array(packs, dtype=object))
    # the prompt fields only satisfy the constructor's checks of unpacked data; packed data is used as it is
    dataset = GPTSFTPackedDataset(str(tmp_path / "training.npy"), types.SimpleNamespace(eos_id=0), max_seq_length=SEQ,
                                  prompt_template="{input} {output}", label_key="output", truncation_field="input")
    batch = dataset.collate_fn([dataset[0]])
    assert batch["cu_seqlens"][0, :int(batch["cu_seqlens_argmin"])].tolist() == [0, 8, 23, 37, 48]  # padded to 16s
    refusal = r"a packed fine-tuning batch \(NeMo's or Megatron-Bridge's GPTSFTPackedDataset.*AnchorPackedDataModule"
    with pytest.raises(ValueError, match=refusal) as error:
        tiny(AnchorLlamaConfig).data_step_fn(iter([batch]))
    assert "\n" not in str(error.value)


def test_nemo2_checkpoint_exports_to_transformers(nemo_run_dir):
    import transformers

    from nemo_anchor.export.hf import export_hf

    model, batch, checkpoint = nemo_run_dir
    hf_dir = export_hf(checkpoint, checkpoint.parent / "hf-again")
    assert (hf_dir / "tokenizer.json").is_file()  # NeMo's tokenizer artifact travelled along
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert hf.config.rope_theta == model.config.rotary_base and hf.config.max_position_embeddings == SEQ
    # NeMo pads the 259-token vocabulary to 384 rows; the HF model has the tokenizer's rows, as NeMo's own
    # exporters give it
    tokens = batch["tokens"][:, :24]
    with torch.no_grad():
        ours = model.module(tokens, torch.arange(24).expand_as(tokens), None)
        assert (hf(tokens).logits - ours).abs().max() <= 1e-4


@pytest.mark.parametrize("vocab_from", ["config", "tokenizer"])
def test_nemo2_export_drops_the_rows_nemo_pads_the_vocabulary_with(nemo_run_dir, tmp_path, vocab_from):
    """NeMo pads the embedding and output layer (make_vocab_size_divisible_by x TP rows); the HF model gets the
    config's vocab_size rows (or, with vocab_size null, the tokenizer's, which NeMo padded), as NeMo's own
    exporters give it, and the same logits."""
    import shutil

    import transformers
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from nemo_anchor.convert.sources import read_dist_checkpoint
    from nemo_anchor.export.hf import export_hf

    model, batch, checkpoint = nemo_run_dir
    vocab = model.config.vocab_size
    padded = tmp_path / "padded" / "step=1"
    shutil.copytree(checkpoint / "context", padded / "context")
    if vocab_from == "tokenizer":
        model_yaml = padded / "context" / "model.yaml"
        assert f"  vocab_size: {vocab}\n" in model_yaml.read_text()
        model_yaml.write_text(model_yaml.read_text().replace(f"  vocab_size: {vocab}\n", "  vocab_size: null\n"))
    tensors = read_dist_checkpoint(checkpoint / "weights", prefix="module.")
    rows = {"embedding.word_embeddings.weight", "output_layer.weight"}
    tensors = {key: torch.cat([t, torch.randn(384 - vocab, t.shape[1])]) if key in rows else t
               for key, t in tensors.items()}
    (padded / "weights").mkdir()
    dist_checkpointing.save({f"module.{key}": ShardedTensor.from_rank_offsets(f"module.{key}", t.contiguous())
                             for key, t in tensors.items()}, str(padded / "weights"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(padded, tmp_path / "hf")).eval()
    assert hf.config.vocab_size == vocab
    assert hf.get_input_embeddings().weight.shape[0] == hf.get_output_embeddings().weight.shape[0] == vocab
    tokens = batch["tokens"][:, :24]
    with torch.no_grad():
        ours = model.module(tokens, torch.arange(24).expand_as(tokens), None)
        assert (hf(tokens).logits - ours).abs().max() <= 1e-4


def test_nemo_yaml_attention_type_reaches_the_built_model(llm, tmp_path):
    """What `nemo llm pretrain --factory F --yaml FILE` resolves (NeMo-Run's LazyEntrypoint), built."""
    import fiddle as fdl
    from nemo_run.cli.lazy import LazyEntrypoint

    from nemo_anchor.model.core_attention import AnchorCoreAttention

    sizes = "\n".join(f"    {k}: {v}" for k, v in dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
        seq_length=SEQ, vocab_size=259, use_cpu_initialization="true", gradient_accumulation_fusion="false").items())
    cases = {  # factory -> YAML
        "nemo_anchor.nemo.recipes.anchor_llama3_8b": f"model:\n  config:\n    attention_type: intra_doc_reset\n{sizes}\n",
        # a stock NeMo recipe, its model config swapped for ours by `_target_`
        "llama3_8b": f"model:\n  config:\n    _target_: nemo_anchor.nemo.config.AnchorLlama3Config8B\n"
                     f"    attention_type: intra_doc_reset\n{sizes}\n",
    }
    for factory, text in cases.items():
        (tmp_path / "run.yaml").write_text(text)
        recipe = LazyEntrypoint(llm.pretrain, factory=factory, yaml=str(tmp_path / "run.yaml")).resolve()
        model = fdl.build(recipe.model)
        model.configure_model()
        assert model.config.attention_type == "intra_doc_reset"
        cores = [m for m in model.module.modules() if isinstance(m, AnchorCoreAttention)]
        assert len(cores) == 2 and all(c.mask == "intra_doc" for c in cores), factory


def test_recipes_build_the_papers_runs(llm, packed):
    import fiddle as fdl
    from nemo import lightning as nl

    from nemo_anchor.model.config import paper_rotary_base
    from nemo_anchor.nemo import recipes
    from nemo_anchor.nemo.config import PRESETS, AnchorSmolLM2Config135M
    from nemo_anchor.nemo.data import AnchorPackedDataModule

    factories = (recipes.anchor_llama2_7b, recipes.anchor_llama3_8b, recipes.anchor_mistral_7b_v03,
                 recipes.anchor_qwen15_1p8b)
    assert ({f(data_path="x").model.config.__fn_or_cls__ for f in factories} | {AnchorSmolLM2Config135M}
            == set(PRESETS.values()))
    recipe = recipes.anchor_llama2_7b(data_path=str(packed), seq_length=SEQ)
    assert recipe.__fn_or_cls__ is llm.pretrain
    config = recipe.model.config
    assert (config.attention_type, config.seq_length, config.rotary_base) == ("anchor", SEQ, paper_rotary_base(SEQ))
    assert recipes.anchor_llama2_7b().model.config.rotary_base == 1e7  # 128K: Table 1

    trainer = recipe.trainer
    # the devices are the training process's to decide (tests/test_launch.py): nothing of this machine's
    assert (trainer.max_steps, trainer.devices, trainer.accelerator) == (2000, 8, "auto")
    assert trainer.strategy.context_parallel_size == 8
    # every paper preset is its configs/paper file with the planner's recompute, not a copy
    from nemo_anchor.training.presets import paper_run

    for factory, config_name in zip(factories, ("llama2-7b-128k", "llama3-8b-128k", "mistral-7b-v0.3-128k",
                                                "qwen1.5-1.8b-128k")):
        built, paper = factory(data_path="x"), paper_run(config_name).model
        strategy, model = built.trainer.strategy, built.model.config
        assert (strategy.tensor_model_parallel_size, strategy.context_parallel_size) == (
            paper.tensor_model_parallel_size, paper.context_parallel_size), config_name
        planned = paper.recompute_num_layers if paper.recompute == "full" else None
        assert getattr(model, "recompute_num_layers", None) == planned, config_name
    assert recipes.anchor_llama2_7b(seq_length=65_536).model.config.recompute_num_layers == paper_run(
        "llama2-7b-64k").model.recompute_num_layers
    assert trainer.plugins.precision is None and config.cross_entropy_loss_fusion is None  # decided at launch
    assert not trainer.strategy.ddp.average_in_collective  # gloo's AVG reduce-scatter sums (pytorch#162338)
    assert config.calculate_per_token_loss
    assert isinstance(fdl.build(trainer.strategy), nl.MegatronStrategy)
    optim = fdl.build(recipe.optim)
    assert optim.lr_scheduler is None  # the paper's constant learning rate
    optim = optim.config
    assert (optim.lr, optim.weight_decay, optim.adam_beta1, optim.adam_beta2) == (2e-5, 0.1, 0.9, 0.95)
    data = fdl.build(recipe.data)
    assert isinstance(data, AnchorPackedDataModule) and data.global_batch_size == 8
    with pytest.raises(ValueError, match="repack it or change seq_length"):
        AnchorPackedDataModule(str(packed), seq_length=2 * SEQ)


def test_megatron_bridge_is_optional():
    pytest.importorskip("nemo")
    try:
        import megatron.bridge  # noqa: F401
    except Exception:  # noqa: BLE001 - what the module itself guards against
        with pytest.raises(ImportError, match="needs Megatron-Bridge"):
            import nemo_anchor.bridge  # noqa: F401
    else:
        from nemo_anchor.bridge import AnchorGPTModelProvider

        assert AnchorGPTModelProvider(num_layers=1, hidden_size=64, num_attention_heads=4).attention_type == "anchor"


CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "nemo"


@pytest.mark.parametrize("name,factory", [
    ("anchor_llama2_7b_128k.yaml", "nemo_anchor.nemo.recipes.anchor_llama2_7b"),
    ("anchor_llama2_7b_64k.yaml", "nemo_anchor.nemo.recipes.anchor_llama2_7b(seq_length=65536)"),
    ("stock_llama3_8b_with_anchor.yaml", "llama3_8b"),
])
def test_shipped_nemo_yaml_files_resolve(llm, name, factory):
    from nemo_run.cli.lazy import LazyEntrypoint

    from nemo_anchor.model.config import paper_rotary_base
    from nemo_anchor.nemo.config import AnchorConfigMixin

    recipe = LazyEntrypoint(llm.pretrain, factory=factory, yaml=str(CONFIGS / name)).resolve()
    config = recipe.model.config
    assert issubclass(config.__fn_or_cls__, AnchorConfigMixin) and config.attention_type == "anchor"
    assert recipe.data.seq_length == config.seq_length
    if factory.startswith("nemo_anchor"):
        assert config.rotary_base == paper_rotary_base(config.seq_length)
        assert recipe.resume.restore_config.path == "/ckpt/llama2-7b-nemo"


def test_hf_import_writes_every_weight_or_names_the_one_it_cannot(llm, tiny_byte_llama, tmp_path):
    """On Megatron's local spec NeMo's own Llama importer leaves the layer norms at 1.0; ours writes
    them (local names), and refuses, naming it, a target weight the HF model has nothing for."""
    import transformers

    from nemo_anchor.nemo import AnchorLlamaConfig, AnchorLlamaModel
    from nemo_anchor.nemo.hf_io import UnmappedWeightError
    from nemo_anchor.nemo.models import AnchorHFLlamaImporter

    hf_dir = tiny_byte_llama(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    importer = AnchorHFLlamaImporter(str(hf_dir))
    config = importer.config
    assert isinstance(config, AnchorLlamaConfig) and (config.num_layers, config.hidden_size) == (1, 16)

    model = AnchorLlamaModel(config)
    model.configure_model()
    importer.convert_state(hf, model)
    ours = model.module.state_dict()
    assert "decoder.layers.0.input_layernorm.weight" in ours  # the local spec's name
    for hf_name, name in (("model.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.weight"),
                          ("model.layers.0.post_attention_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight"),
                          ("model.norm.weight", "decoder.final_layernorm.weight")):
        assert torch.equal(ours[name], hf.state_dict()[hf_name]), name

    with_qk_norm = AnchorLlamaModel(tiny(AnchorLlamaConfig, num_layers=1, hidden_size=16, ffn_hidden_size=32,
                                         num_attention_heads=2, num_query_groups=1, qk_layernorm=True))
    with_qk_norm.configure_model()
    with pytest.raises(UnmappedWeightError, match=r"unwritten: .*decoder\.layers\.0\.self_attention\.q_layernorm\.weight"):
        importer.convert_state(hf, with_qk_norm)


def _drop_tensor(hf_dir: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    weights = hf_dir / "model.safetensors"
    tensors = load_file(weights)
    del tensors[name]
    save_file(tensors, weights, metadata={"format": "pt"})


def _edit_config(hf_dir: Path, **changes) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("fault,expected", [
    ("missing", r"the weights lack tensor model\.layers\.0\.mlp\.down_proj\.weight of shape \(16, 32\), which "
                r".*config\.json \(num_hidden_layers=1\) needs"),
    ("extra layer", r"the weights lack tensor model\.layers\.1\.\S+ of shape \(\d+,( \d+)?\), which "
                    r".*config\.json \(num_hidden_layers=2\) needs"),
    ("shape", r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape \((32, 16|16, 32)\) in the weights, but "
              r".*config\.json \(intermediate_size=48\) makes it \((48, 16|16, 48)\)"),
], ids=["missing-tensor", "config-has-a-layer-more", "config-shape"])
def test_nemo_import_refuses_hf_weights_that_disagree_with_their_config(llm, tiny_byte_llama, tmp_path, fault,
                                                                         expected):
    """``llm.import_ckpt`` (what ``nemo llm import`` runs): transformers would fill the tensor or layer at random;
    the import is refused naming the tensor, its shapes and the config.json key, and writes nothing."""
    from nemo_anchor.nemo import AnchorLlamaConfig, AnchorLlamaModel

    hf_dir = tiny_byte_llama(tmp_path / "hf")
    if fault == "missing":
        _drop_tensor(hf_dir, "model.layers.0.mlp.down_proj.weight")
    elif fault == "extra layer":
        _edit_config(hf_dir, num_hidden_layers=2)
    else:
        _edit_config(hf_dir, intermediate_size=48)
    with pytest.raises(ValueError, match=expected):
        llm.import_ckpt(model=AnchorLlamaModel(AnchorLlamaConfig()), source=f"hf://{hf_dir}",
                        output_path=tmp_path / "nemo")
    assert not (tmp_path / "nemo").exists()


def test_nemo_export_refuses_weights_that_disagree_with_the_checkpoint_config(llm, packed, tmp_path):
    """A NeMo 2 checkpoint whose context says one layer more than its weights hold: ``llm.export_ckpt`` names
    the layer count instead of NeMo's advice to load less strictly (``ckpt_load_strictness``)."""
    from megatron.core import dist_checkpointing
    from nemo import lightning as nl
    from nemo.lightning.io.pl import TrainerContext

    from nemo_anchor.nemo import AnchorLlamaConfig, AnchorLlamaModel
    from nemo_anchor.nemo.data import AnchorPackedDataModule

    data = AnchorPackedDataModule(str(packed), seq_length=SEQ, num_workers=0)
    model = AnchorLlamaModel(tiny(AnchorLlamaConfig), tokenizer=data.tokenizer)
    model.configure_model()
    checkpoint = tmp_path / "nemo2"
    (checkpoint / "weights").mkdir(parents=True)
    dist_checkpointing.save(model.module.sharded_state_dict(prefix="module."), str(checkpoint / "weights"))
    TrainerContext(model=model, trainer=nl.Trainer(accelerator="cpu", devices=1), extra={}).io_dump(
        checkpoint / "context", yaml_attrs=["model"])
    assert llm.export_ckpt(path=checkpoint, target="hf", output_path=tmp_path / "hf").is_dir()  # intact: exports

    model_yaml = checkpoint / "context" / "model.yaml"
    model_yaml.write_text(model_yaml.read_text().replace("num_layers: 2", "num_layers: 3"))
    (checkpoint / "context" / "io.json").write_text(
        (checkpoint / "context" / "io.json").read_text().replace('"num_layers": 2', '"num_layers": 3'))
    with pytest.raises(ValueError, match=r"stacks \(2,\) layers, the model config has num_layers=3") as refused:
        llm.export_ckpt(path=checkpoint, target="hf", output_path=tmp_path / "hf-again")
    assert "strict" not in str(refused.value) and not (tmp_path / "hf-again").exists()


def test_checkpoints_that_name_the_old_mixin_module_still_load(llm, tmp_path):
    """Contexts saved before the mixin moved to nemo_anchor.training.mixin name nemo_anchor.nemo.mixin for the
    functions a config holds (here the layer spec); NeMo still rebuilds the same config from them."""
    from nemo import lightning as nl
    from nemo.lightning import io
    from nemo.lightning.io.pl import TrainerContext

    from nemo_anchor.nemo.config import AnchorLlamaConfig
    from nemo_anchor.nemo.models import AnchorLlamaModel
    from nemo_anchor.training.mixin import anchor_layer_spec

    model = AnchorLlamaModel(tiny(AnchorLlamaConfig, transformer_layer_spec=anchor_layer_spec))
    TrainerContext(model=model, trainer=nl.Trainer(accelerator="cpu", devices=1), extra={}).io_dump(
        tmp_path / "context", yaml_attrs=["model"])
    context = tmp_path / "context" / "io.json"
    text = context.read_text()
    assert '"module": "nemo_anchor.training.mixin", "name": "anchor_layer_spec"' in text
    context.write_text(text.replace("nemo_anchor.training.mixin", "nemo_anchor.nemo.mixin"))
    config = io.load_context(str(tmp_path), subpath="model.config")
    assert config.transformer_layer_spec is anchor_layer_spec
    assert (config.num_layers, config.attention_type) == (model.config.num_layers, model.config.attention_type)


@pytest.mark.parametrize("where", ["log_dir", "explicit_log_dir"])
def test_a_refused_run_writes_nothing_into_the_holders_log_directory(llm, tmp_path, where):
    """NeMo's logger setup opens its log files and writes task.json in the log directory; the lock comes first, so
    a run refused while another holds the directory leaves every file there as it was."""
    from nemo import lightning as nl

    from nemo_anchor.nemo.run_guard import AnchorNeMoLogger
    from nemo_anchor.run_dir import RunDir
    from nemo_anchor.run_lease import RunClaim, RunDirInUse

    held = tmp_path / "runs" / "anchor"
    holder = RunClaim(RunDir(held))
    try:
        (held / "nemo_log_globalrank-0_localrank-0.txt").write_text("the holder's log\n")
        (held / "task.json").write_text("{}")
        before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in held.iterdir()}
        options = {"log_dir": {"log_dir": str(tmp_path / "runs"), "name": "anchor"},
                   "explicit_log_dir": {"explicit_log_dir": str(held)}}[where]
        logger = AnchorNeMoLogger(**options, tensorboard=None, ckpt=None)
        trainer = nl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
        with pytest.raises(RunDirInUse, match="is in use by another training run"):
            logger.setup(trainer, resume_if_exists=True, task_config=object())
        assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in held.iterdir()} == before
    finally:
        holder.release(failed=False)


def test_the_logger_holds_the_lock_where_other_runs_look_for_it(llm, tmp_path):
    """NeMo moves the files it finds in a log directory into run_N/ when training starts; the lock the logger
    took there is not among them."""
    from nemo import lightning as nl

    from nemo_anchor.nemo import run_guard
    from nemo_anchor.run_dir import LOCK_FILE

    directory = tmp_path / "runs" / "anchor"
    directory.mkdir(parents=True)
    (directory / "nemo_log_globalrank-0_localrank-0.txt").write_text("an earlier run's log\n")
    logger = run_guard.AnchorNeMoLogger(log_dir=str(tmp_path / "runs"), name="anchor", tensorboard=None, ckpt=None)
    trainer = nl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    app_state = logger.setup(trainer, resume_if_exists=True)
    try:
        assert (directory / LOCK_FILE).is_file()
        assert [Path(f).name for f in app_state.files_to_move] == ["nemo_log_globalrank-0_localrank-0.txt"]
    finally:
        run_guard._claim(app_state.log_dir).release(failed=False)


def test_nemos_preemption_plugin_beside_the_recipe_is_refused_in_one_line(llm, packed):
    """NeMo-Run's PreemptionPlugin adds NeMo's PreemptionCallback (SIGTERM) to the recipe, beside its AnchorPreemption:
    its handler would replace ours for SIGTERM on rank 0 (ignored on the others), it exits 0 after its save (the job
    reads as finished and is not requeued) and reads its flag on CUDA. The run is refused before it trains, naming
    the plugin and what to do instead."""
    import fiddle as fdl
    import nemo_run as run
    from nemo.lightning.run.plugins import PreemptionPlugin

    from nemo_anchor.nemo import recipes
    from nemo_anchor.nemo.run_guard import AnchorPreemption

    recipe = recipes.anchor_smollm2_135m(data_path=str(packed), seq_length=SEQ)
    executor = run.SlurmExecutor(account="me", tunnel=run.LocalTunnel(job_dir=""))
    PreemptionPlugin(preempt_time=120).setup(recipe, executor)
    assert executor.signal == "15@120"  # the plugin's part on the executor: SIGTERM 2 min before the limit
    trainer = fdl.build(recipe.trainer)
    ours = next(callback for callback in trainer.callbacks if isinstance(callback, AnchorPreemption))
    with pytest.raises(ValueError, match=r"^trainer.callbacks has NeMo's PreemptionCallback \(nemo.lightning.run."
                                         r"plugins.PreemptionPlugin adds it\) .*: drop the plugin and set the "
                                         r"executor's signal \(signal=\"USR1@120\"\)$"):
        ours.setup(trainer, None, "fit")
