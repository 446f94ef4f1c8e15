#!/usr/bin/env bash
# GPU check for the strategy overlays (not run in CI: needs one CUDA device).
#   bash benchmarks/gpu_check.sh [STEPS]        # default 4 optimiser steps per strategy
# Runs configs/grpo.yaml (built-in tiny model, no hub access needed) in bf16-mixed on 1 GPU under DDP, FSDP2
# (ModelParallelStrategy), DeepSpeed ZeRO-2 and ZeRO-3 (installing the `deepspeed` extra first), checks
# that each run's exported `policy/` folder reloads in plain transformers and generates, and prints a
# summary table. Exit status 0 only if every row passed. Env: PY (python), OUT (run folder), TIMEOUT (s/run).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
TIMEOUT=${TIMEOUT:-600}
STEPS=${1:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" \
  || exit 2

DS_INSTALL=ok
mkdir -p "$(dirname "$OUT")"
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  "$PY" -m pip install --quiet -e '.[deepspeed]' > "$OUT.deepspeed-install.log" 2>&1 || DS_INSTALL=failed
fi

reload_check() {  # $1: export folder -> prints "ok" or the error's last line
  "$PY" - "$1" <<'PYEOF' 2>&1 | tail -1
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tok = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok("50318=", return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
assert out.shape[1] > ids.shape[1] and all(torch.isfinite(p).all() for p in model.parameters())
print("ok")
PYEOF
}

ROWS=()
FAILED=0
run() {  # $1: name, $2: overlay ("" for none)
  local name=$1 overlay=$2 log="$OUT/$1.log" start rc secs folder status reload
  mkdir -p "$OUT"
  if [[ $name == deepspeed* && $DS_INSTALL != ok ]]; then
    ROWS+=("$(printf '%-16s %-6s %8s %-8s %s' "$name" SKIP - - "deepspeed install failed: $OUT.deepspeed-install.log")")
    FAILED=1; return
  fi
  start=$(date +%s)
  timeout -k 10 "$TIMEOUT" "$PY" -m lightning_rl.cli fit --config configs/grpo.yaml ${overlay:+--config "$overlay"} \
    --trainer.accelerator gpu --trainer.devices 1 --trainer.precision bf16-mixed \
    --trainer.max_steps "$STEPS" --trainer.val_check_interval "$STEPS" --trainer.limit_val_batches 1 \
    --trainer.num_sanity_val_steps 0 --trainer.enable_checkpointing false --trainer.enable_progress_bar false \
    --trainer.logger.init_args.save_dir "$OUT" --trainer.logger.init_args.name "$name" \
    --trainer.logger.init_args.version run > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  folder="$OUT/$name/run/policy"
  if [[ $rc -eq 0 && -d $folder ]]; then reload=$(reload_check "$folder"); else reload="no export"; fi
  if [[ $rc -eq 0 && $reload == ok ]]; then status=PASS; else status=FAIL; FAILED=1; fi
  [[ $rc -ne 0 ]] && reload="$reload; fit rc=$rc, see $log: $(grep -m1 -E 'Error|error:' "$log" | cut -c1-80)"
  ROWS+=("$(printf '%-16s %-6s %8s %-8s %s' "$name" "$status" "${secs}s" "$rc" "$reload")")
}

rm -rf "$OUT"
run ddp configs/strategy/ddp.yaml
run fsdp2 configs/strategy/fsdp2.yaml
run deepspeed_zero2 configs/strategy/deepspeed_zero2.yaml
run deepspeed_zero3 configs/strategy/deepspeed_zero3.yaml

echo
printf '%-16s %-6s %8s %-8s %s\n' strategy status time fit_rc "export reloads in transformers"
for row in "${ROWS[@]}"; do echo "$row"; done
exit $FAILED
