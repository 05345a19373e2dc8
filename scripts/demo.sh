#!/usr/bin/env bash
# The main job on the embedded default, on the CPU: build the corpus (Python's own standard
# library: code and docs), train a BPE tokenizer and pack 1024-token windows, train a tiny
# Llama-shaped model with AnchorAttention, export it to Hugging Face and generate from it, then run
# the paper's BF16 RoPE probe and a short RULER-style evaluation.
#
#   bash scripts/demo.sh            # everything under runs/demo (re-running resumes / reuses)
#   DEMO_STEPS=50 bash scripts/demo.sh
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"

RUN="${DEMO_DIR:-runs/demo}"
STEPS="${DEMO_STEPS:-300}"
mkdir -p "$RUN"
step() { printf '\n=== %s\n' "$*"; }

if [ ! -f "$RUN/corpus.jsonl" ]; then
  step "1/6 corpus: the Python standard library's code and documentation (offline)"
  python -m nemo_anchor.data.corpus --output "$RUN/corpus.jsonl" --max-bytes 8000000
fi
if [ ! -f "$RUN/packed/metadata.json" ]; then
  step "2/6 pack: train a 4096-token BPE, pack 1024-token windows (anchor = BOS), hold out 2%"
  nemo-anchor pack --input "$RUN/corpus.jsonl" --tokenizer train-bpe:4096 --seq-length 1024 \
    --valid-fraction 0.02 --shuffle --output "$RUN/packed" --overwrite
fi

step "3/6 train: $STEPS steps, attention_type=anchor, fp32 on this CPU (resumes if $RUN/train has checkpoints)"
nemo-anchor train --config configs/demo.yaml output_dir="$RUN/train" data.path="$RUN/packed" \
  data.valid_path="$RUN/packed/valid" trainer.max_steps="$STEPS"

step "4/6 export to Hugging Face and generate with transformers (offline, no custom code)"
nemo-anchor export-hf "$RUN/train" "$RUN/hf" --overwrite
HF_HUB_OFFLINE=1 python - "$RUN/hf" <<'EOF'
import sys

import transformers

model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
inputs = tokenizer("def ", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=48, do_sample=False)
print(f"{type(model).__name__} generates:\n{tokenizer.decode(out[0], skip_special_tokens=True)}")
EOF

step "5/6 probe: does BF16 break RoPE's relative property on this model? (paper Section 2, Figure 1)"
nemo-anchor probe --checkpoint "$RUN/train" --output "$RUN/probe" --overwrite --data "$RUN/packed/valid" \
  --num-sequences 4 --sequence-length 512 --max-length 1024

step "6/6 evaluate: RULER-style needle/variable-tracking tasks and perplexity by position"
nemo-anchor eval --checkpoint "$RUN/train" --output "$RUN/eval" --lengths 1024 --num-samples 2 --max-new-tokens 32 \
  --overwrite --perplexity-data "$RUN/packed/valid" --perplexity-length 1024 --perplexity-windows 8

cat <<EOF

Done. Everything is under $RUN:
  corpus + packed data    $RUN/corpus.jsonl, $RUN/packed (stats.json, document_lengths.png)
  training run            $RUN/train (config.yaml, metrics.jsonl, tensorboard/, checkpoints/)
  Hugging Face model      $RUN/hf
  BF16 RoPE probe         $RUN/probe (probe.json, PNG plots)
  evaluation              $RUN/eval (eval.json, plot)
TensorBoard: tensorboard --logdir $RUN/train/tensorboard
EOF
