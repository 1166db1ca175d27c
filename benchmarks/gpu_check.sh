#!/usr/bin/env bash
# The GPU check of issue 9, prepared for a machine with a CUDA GPU (about 3-5 minutes):
# calibrate the GPU, then run the quick validation sweep on it (GPU-sized kernels and the compiled
# fp32 training steps of mlp and cs336-lm). Writes gpu.json (the calibrated device entry),
# validate.json and validate.png into ${OUT:-.}. Not yet run: no GPU was lent to the session that
# wrote it (see docs/roofline.md).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
python -m symcost.cli calibrate --device cuda --name gpu --out "$out/gpu.json"
python -m symcost.cli validate --hardware cuda --quick --attempts 2 --devices-file "$out/gpu.json" --device gpu \
    --plot "$out/validate.png" --json > "$out/validate.json" || true
python - "$out/validate.json" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
for r in v["kernels"]:
    print(f"{r['kernel']:<45} predicted {r['predicted'] * 1e3:9.3f} ms  measured {r['measured'] * 1e3:9.3f} ms  ratio {r['ratio']:.2f}")
print("failures:", v["failures"])
PY
