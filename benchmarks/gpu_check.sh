#!/usr/bin/env bash
# The GPU check of issues 9 and 29, prepared for a machine with a CUDA GPU (about 4-6 minutes,
# under 10 by the timeouts below): calibrate the GPU (peaks, bandwidth and the performance model's
# efficiency table: eager GEMM sweep over the SMs, bandwidth, launch overhead, the device's time
# per kernel boundary (kernel_gap: back-to-back tiny kernels queued behind a sleep, CUDA events;
# and the same from a CUDA graph, in fit), AdamW foreach;
# docs/performance-model.md), check that --devices-file reads the file it wrote (mfu prints the
# predicted step beside the bound), then run the quick validation sweep on it (GPU-sized kernels
# and the compiled fp32 training steps of mlp and cs336-lm). Writes gpu.json (the calibrated
# device entry), mfu.json, validate.json and validate.png into ${OUT:-.}. Not yet run: no GPU was
# lent to the sessions that wrote it (see docs/roofline.md, docs/performance-model.md).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
timeout 300 python -m symcost.cli calibrate --device cuda --name gpu --out "$out/gpu.json"
python - "$out/gpu.json" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))["gpu"]["efficiency"]
print("efficiency:", {k: v for k, v in e.items() if k != "fit"})
g = e["fit"]["kernel_gap"]
print(f"kernel boundary: {g['kernel_gap'] * 1e6:.2f} us per kernel on the stream, {g['graph'] * 1e6:.2f} us "
      f"in a CUDA graph ({g['kernels']} kernels; published H100: 2.1 and 1.3 us, docs/performance-model.md)")
PY
timeout 60 python -m symcost.cli mfu mlp --devices-file "$out/gpu.json" --device gpu --tokens-per-second 1e5 \
    --set B=8 S=512 D=2048 L=4 --json > "$out/mfu.json"
timeout 240 python -m symcost.cli validate --hardware cuda --quick --attempts 2 --devices-file "$out/gpu.json" --device gpu \
    --plot "$out/validate.png" --json > "$out/validate.json" || true
python - "$out/validate.json" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
for r in v["kernels"]:
    print(f"{r['kernel']:<45} predicted {r['predicted'] * 1e3:9.3f} ms  measured {r['measured'] * 1e3:9.3f} ms  ratio {r['ratio']:.2f}")
print("failures:", v["failures"])
PY
