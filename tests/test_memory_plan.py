"""The memory planner against what Megatron-Core's engine allocates, and ``nemo-anchor plan``."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from nemo_anchor.cli import main as cli
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.training.memory import (Layout, checkpoint_peak, plan_memory, planned_state_bytes,
                                         saved_activation_bytes)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 384
MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2, seq_length=64)

# every case of one process count in one launch: argv = JSON [[precision, tensor], ...], model, output folder,
# process count; several ranks are forked from this process once it has imported the engine (tests/forked_ranks.py)
_MEASURE = r'''
import json, sys


def measure(cases, model, out):
    import torch, torch.distributed as dist
    from nemo_anchor.model.config import ModelConfig
    from nemo_anchor.parallel.distributed import initialize_parallel
    from nemo_anchor.training.config import RunConfig, TrainerConfig
    from nemo_anchor.training.engine import build_engine, train_step
    from nemo_anchor.training.memory import state_bytes

    for precision, tensor in cases:
        ctx = initialize_parallel(tensor_parallel_size=tensor)
        config = RunConfig(model=ModelConfig(**model, tensor_model_parallel_size=tensor),
                           trainer=TrainerConfig(precision=precision, global_batch_size=ctx.data_parallel_size))
        engine = build_engine(config, ctx, 384)
        T = model["seq_length"]
        tokens = torch.randint(0, 384, (1, T))
        batch = dict(tokens=tokens, labels=tokens.roll(-1, 1), loss_mask=torch.ones(1, T),
                     position_ids=torch.arange(T)[None], cu_seqlens=torch.tensor([0, T // 3, T], dtype=torch.int32),
                     cu_windows=torch.tensor([0, T], dtype=torch.int32))
        train_step(engine, config, [batch])  # Adam's moments exist after the first step
        b = state_bytes(engine)
        rank = dist.get_rank() if dist.is_initialized() else 0
        with open(f"{out}/{precision}_tp{tensor}_rank{rank}.json", "w") as f:  # their stdout interleaves
            json.dump([rank, ctx.data_parallel_rank, b.weights, b.gradients, b.optimizer], f)
        del engine


if __name__ == "__main__":  # dist_checkpointing's spawn-context workers re-import this module
    import nemo_anchor.training.engine  # noqa: F401  (imported once, before the ranks are forked)
    from forked_ranks import run_ranks

    cases, model, out, processes = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    if processes == 1:
        measure(cases, model, out)
    else:
        run_ranks(processes, measure, cases, model, out)
'''
# (processes, precision, tensor): the cases of one process count share its launch
CASES = [(1, "bf16", 1), (1, "fp32", 1), (2, "bf16", 1), (2, "fp32", 2)]


@pytest.fixture(scope="module")
def measure(tmp_path_factory):
    """``measure(processes, precision, tensor)``: each rank's [rank, data-parallel rank, weight, gradient and
    optimizer bytes] after one step (its process count's launch runs on first use)."""
    out = tmp_path_factory.mktemp("measured")
    script = out / "measure.py"
    script.write_text(_MEASURE)
    env = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}  # the script imports tests/forked_ranks.py
    done = set()

    def ranks(processes: int, precision: str, tensor: int) -> list[list[int]]:
        if processes not in done:
            cases = [[p, t] for n, p, t in CASES if n == processes]
            proc = subprocess.run([sys.executable, str(script), json.dumps(cases), json.dumps(MODEL), str(out),
                                   str(processes)], capture_output=True, text=True, timeout=600, env=env)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done.add(processes)
        return [json.loads(path.read_text()) for path in sorted(out.glob(f"{precision}_tp{tensor}_rank*.json"))]
    return ranks


@pytest.mark.parametrize("processes,precision,tensor", CASES)
def test_planned_weight_gradient_and_optimizer_bytes_are_exact(measure, processes, precision, tensor):
    layout = Layout(processes, tensor=tensor)
    planned = planned_state_bytes(ModelConfig(**MODEL), VOCAB, layout, bf16=precision == "bf16",
                                  distributed_optimizer=True)
    measured = measure(processes, precision, tensor)
    assert len(measured) == processes
    for _, _, weights, gradients, optimizer in measured:
        assert (weights, gradients) == (planned.weights, planned.gradients)
        assert optimizer <= planned.optimizer
    assert max(row[4] for row in measured) == planned.optimizer  # the busiest rank, exactly
    if layout.data == 2:  # the distributed optimizer splits the state in halves
        assert abs(measured[0][4] - measured[1][4]) <= 0.05 * measured[0][4]


@pytest.mark.parametrize("precision,recompute", [("fp32", "none"), ("bf16", "none"), ("bf16", "full")])
def test_saved_activations_within_a_quarter_of_the_estimate(precision, recompute):
    from megatron.core.transformer.module import Float16Module

    from nemo_anchor.model.gpt import build_gpt_model
    from nemo_anchor.model.packed_seq import make_packed_seq_params
    from nemo_anchor.parallel.distributed import initialize_parallel

    initialize_parallel()
    T = 512
    cfg = ModelConfig(num_layers=3, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4, num_query_groups=2,
                      seq_length=T, recompute=recompute, attention_backend="cpu")
    gpt = build_gpt_model(cfg, VOCAB, bf16=precision == "bf16")
    model = Float16Module(gpt.config, gpt) if precision == "bf16" else gpt
    tokens = torch.randint(0, VOCAB, (1, T))
    params = make_packed_seq_params(torch.tensor([0, 100, 300, T], dtype=torch.int32),
                                    torch.tensor([0, T], dtype=torch.int32), "anchor", None)
    measured = saved_activation_bytes(model, lambda: model(input_ids=tokens, position_ids=torch.arange(T)[None],
                                                          attention_mask=None, labels=tokens, packed_seq_params=params))
    plan = plan_memory(cfg, VOCAB, Layout(1), gpu_bytes=80 << 30, micro_batch_size=1, bf16=precision == "bf16")
    assert abs(plan.activations + plan.logits - measured) <= 0.25 * measured


# host memory a checkpoint save, load and model.init_from_hf add, measured as the rise of the
# process's peak resident set (Linux: writing 5 to /proc/self/clear_refs resets the peak)
_MEASURE_CHECKPOINT = r'''
import json, sys


def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))


def peak_rise(run):
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS")
    run()
    return status("VmHWM") - before


# dist_checkpointing's spawn-context Manager re-imports this module: torch and the trainer are imported only here
if __name__ == "__main__":
    import torch

    from nemo_anchor.model.config import ModelConfig
    from nemo_anchor.model.gpt import build_gpt_model
    from nemo_anchor.parallel.distributed import initialize_parallel
    from nemo_anchor.run_dir import RunDir
    from nemo_anchor.training import checkpoint, checkpoint_saver
    from nemo_anchor.training.config import RunConfig, TrainerConfig
    from nemo_anchor.training.engine import build_engine, train_step
    from nemo_anchor.training.init_from_hf import init_model_from_hf

    model, vocab, hf_dir, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ctx = initialize_parallel()
    config = RunConfig(output_dir=out, model=ModelConfig(**model), trainer=TrainerConfig(precision="bf16",
                                                                                          global_batch_size=1))
    T = model["seq_length"]
    tokens = torch.randint(0, vocab, (1, T))
    batch = dict(tokens=tokens, labels=tokens.roll(-1, 1), loss_mask=torch.ones(1, T), position_ids=torch.arange(T)[None],
                 cu_seqlens=torch.tensor([0, T], dtype=torch.int32), cu_windows=torch.tensor([0, T], dtype=torch.int32))

    def trained_engine():  # after a step Adam's state exists: a load then adds only what it stages
        engine = build_engine(config, ctx, vocab)
        train_step(engine, config, [batch])
        return engine

    engine = trained_engine()
    save = peak_rise(lambda: checkpoint_saver.save_checkpoint(RunDir(out), 1, engine, {"step": 1}, "", keep_last=1))
    del engine
    fresh = trained_engine()
    load = peak_rise(lambda: checkpoint.load_checkpoint(RunDir(out).checkpoint(1), fresh))
    gpt = build_gpt_model(config.model, vocab)
    init = peak_rise(lambda: init_model_from_hf(gpt, hf_dir))
    with open(f"{out}/peaks.json", "w") as handle:
        json.dump({"save": save, "load": load, "init_from_hf": init}, handle)
'''


def test_checkpoint_and_init_from_hf_host_memory_match_the_plan(tmp_path):
    """What a save, a load and model.init_from_hf add to the process's peak memory, against the planner.

    The model's embedding and logits dominate (a large vocabulary), so one tensor is large next to
    the rest: a reader that held the whole model, or a writer that gathered the fp32 masters, would
    exceed the plan.
    """
    import transformers

    vocab = 32768
    model = dict(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2,
                 seq_length=64, attention_backend="cpu")
    cfg = ModelConfig(**model)
    hf_dir = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(hf_dir)  # fp32 safetensors
    script = tmp_path / "measure.py"
    script.write_text(_MEASURE_CHECKPOINT)
    env = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), json.dumps(model), str(vocab), str(hf_dir), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads((tmp_path / "run" / "peaks.json").read_text())
    planned = checkpoint_peak(cfg, vocab, Layout(1), bf16=True, distributed_optimizer=True)
    written = sum(f.stat().st_size for f in (tmp_path / "run" / "checkpoints" / "iter_0000001").iterdir())
    assert abs(written - planned.save) <= 0.01 * planned.save, (written, planned)  # what the writer stages
    # the interpreter's own allocations (metadata, pickles), and 32 MiB more that one four-lane run of the suite
    # measured on the load (101 MB; 67.5 MB alone and beside two busy loops): still far below a reader that held
    # the model's fp32 weights (72 MB here) or its optimizer state beside the plan
    slack = 48 << 20
    assert measured["save"] <= 0.25 * planned.save, (measured, planned)  # the trainer's process gathers nothing
    assert measured["load"] <= 1.15 * planned.load + slack, (measured, planned)
    assert measured["init_from_hf"] <= 1.15 * planned.init_from_hf + slack, (measured, planned)


def _paper_config(tmp_path, **model):
    source = yaml.safe_load((REPO / "configs" / "paper" / "llama2-7b-128k.yaml").read_text())
    source["model"].update(model)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(source))
    return path


def test_plan_exit_status_names_the_fix(tmp_path, capsys):
    fits = cli(["plan", "--config", str(REPO / "configs" / "paper" / "llama2-7b-128k.yaml"), "--gpus", "8",
                "--gpu-memory", "80", "--json"])
    report = json.loads(capsys.readouterr().out)
    # an "80 GB" H100 offers 79.11 GiB, of which 5% stay free for the allocator
    assert report["gpu_bytes"] == int(79.11 * 2 ** 30) and report["headroom"] == int(0.05 * report["gpu_bytes"])
    assert fits == 0 and report["fits"] and report["total"] + report["headroom"] <= report["gpu_bytes"]
    assert report["layout"] == {"gpus": 8, "tensor": 1, "pipeline": 1, "context": 8}
    # the same run without activation recompute does not fit; the planner names the change that does
    too_big = _paper_config(tmp_path, recompute="none", recompute_num_layers=None)
    assert cli(["plan", "--config", str(too_big), "--gpus", "8", "--gpu-memory", "80"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "smallest change that fits: model.recompute=full model.recompute_num_layers=" in out
    suggested = out.rsplit("model.recompute_num_layers=", 1)[1].split()[0]
    assert cli(["plan", "--config", str(too_big), "--gpus", "8", "--gpu-memory", "80", "model.recompute=full",
                f"model.recompute_num_layers={suggested}"]) == 0


def test_plan_rejects_a_layout_that_does_not_divide_the_gpus(capsys):
    assert cli(["plan", "--config", str(REPO / "configs" / "paper" / "llama2-7b-128k.yaml"), "--gpus", "6",
                "--gpu-memory", "80"]) == 2
    assert "error: --gpus 6 is not a multiple of tensor x pipeline x context parallel size" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "paper").glob("*.yaml")), ids=lambda p: p.name)
def test_every_paper_config_fits_the_papers_hardware(path):
    assert cli(["plan", "--config", str(path), "--gpus", "8", "--gpu-memory", "80"]) == 0


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "paper").glob("*.yaml")), ids=lambda p: p.name)
def test_every_paper_config_recomputes_what_the_planner_gives(path):
    """The file's recompute is the planner's fewest for 8x H100 80GB (what the NeMo and Bridge presets are built with)."""
    from nemo_anchor.training.config import load_config
    from nemo_anchor.training.presets import paper_run

    run = load_config(path)
    assert paper_run(path.stem).model == run.model
    assert "--gpu-memory h100-80gb` -> " in path.read_text()  # the header says how it fits


def test_gpu_cards_and_nominal_sizes():
    from nemo_anchor.training.memory import GIB, gpu_memory

    assert gpu_memory("80")[0] == gpu_memory("h100-80gb")[0] == int(79.11 * GIB)
    assert "measured" in gpu_memory("H100-80GB")[1] and "not measured" in gpu_memory("h200")[1]
    assert gpu_memory("a100-80gb")[0] == int(79.15 * GIB) and gpu_memory("b200")[0] > gpu_memory("h200")[0]
    assert gpu_memory(40)[0] == int(40 * 79.11 / 80 * GIB)
    with pytest.raises(ValueError, match="neither a GPU"):
        gpu_memory("v100-16gb")


def test_all_gather_keeps_every_layers_keys_and_values_and_the_anchor_adds_none():
    """Under context-parallel all_gather every stored layer keeps the window's gathered K/V; every backend merges
    the anchor through the log-sum-exp, so anchor mode keeps no K/V beyond that."""
    from dataclasses import replace

    model = ModelConfig(num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_query_groups=2,
                        seq_length=4096, context_parallel_size=2, attention_type="intra_doc")
    options = dict(gpu_bytes=80 << 30, micro_batch_size=1, bf16=True)
    layout = Layout(2, context=2)
    kv_row = 2 * 2 * 32 * 2  # K and V of one token: 2 kv heads x 32 dims in bf16
    a2a = plan_memory(replace(model, cp_comm_type="a2a"), VOCAB, layout, **options)
    gathered = plan_memory(replace(model, cp_comm_type="all_gather"), VOCAB, layout, **options)
    assert a2a.kv_extra == 0 and gathered.kv_extra == 4 * 4096 * kv_row
    for backend in ("auto", "flash", "fa3", "fa4", "torch_varlen"):
        anchored = replace(model, cp_comm_type="a2a", attention_type="anchor", attention_backend=backend)
        assert plan_memory(anchored, VOCAB, layout, **options).kv_extra == 0
    with pytest.raises(ValueError, match="model.attention_backend='te': .*copy K and V in every layer"):
        replace(model, attention_type="anchor", attention_backend="te")
    # fusions save SwiGLU's two ffn-sized intermediates per layer and the fp32 copy of the logits
    fused = plan_memory(model, VOCAB, layout, **options, fusions=True)
    unfused = plan_memory(model, VOCAB, layout, **options)
    assert unfused.activations - fused.activations == pytest.approx(4 * 2048 * 2 * 512 * 2, abs=64)
    assert unfused.logits - fused.logits == pytest.approx(2048 * VOCAB * 4, abs=64)
