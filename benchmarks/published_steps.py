"""Predict the published GPU training steps of docs/validation.md with the performance model.

Each run below is a published measurement (docs/validation.md, "Step-time runs": the source, the
recipe and how the step time is derived from the published tokens/s or s/iteration) and the
exact symcost command that expresses its recipe. The script runs each command with ``--json``,
reads the predicted step (``parallel.step.predicted.step_seconds`` of ``report --dp --gpu``,
``pipeline.step.predicted.step_seconds`` of ``report --pp --gpu`` (the whole step of m micro-batches),
or ``predicted.step_seconds`` of ``time --device`` for one device) and the roofline bound beside it,
and writes ``tests/data/published-steps.json`` (what tests/test_published_steps.py checks the
docs table and the CLI against). Nothing here is fitted: the published figure is only compared.

    SYMCOST_CACHE_DIR=/tmp/cache python benchmarks/published_steps.py            # runs missing ids
    python benchmarks/published_steps.py --only TT1 MG6 --force                  # re-run some
    python benchmarks/published_steps.py --table                                 # print the markdown table

Takes 30 s to 3 min per command on two busy cores (the traces of an 8B model at S = 8192).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "published-steps.json"

L8 = "tests/data/configs/llama-3-8b.json"
TT = "--shard fsdp --precision fp32 --fsdp-mp bf16 --ac selective"
GB = ("hf:gpt_bigcode --config n_embd=512 n_layer=12 n_head=8 n_positions=1024 multi_query=false attn_pdrop=0.1 "
      "resid_pdrop=0.1 embd_pdrop=0.1 vocab_size=50304")
L13 = ("hf:llama --config hidden_size=5120 num_hidden_layers=40 num_attention_heads=40 num_key_value_heads=40 "
       "intermediate_size=13824 vocab_size=32000 max_position_embeddings=4096")
L3B = ("hf:llama --config hidden_size=3072 num_hidden_layers=28 num_attention_heads=24 num_key_value_heads=8 "
       "intermediate_size=8192 vocab_size=128256 tie_word_embeddings=true max_position_embeddings=131072")

#: torchtitan's own Llama 3 (tests/data/torchtitan_llama.py: its rotary embedding at 9dec370, the
#: commit of its published runs) at llama3_configs["8B"]: its compiled runs (TT2, TT5, AO1) compile
#: each block with the checkpoint inside (apply_ac, then apply_compile), which transformers' Llama
#: cannot: PyTorch's torch.compile(fullgraph=True) of its checkpointed decoder layer raises "HOP:
#: Unsafe side effect" (the kernels package's forward wrapper writes a global while compiling)
TTL = "tests/data/torchtitan_llama.py:rope_spec"
TT8B = "H=32 D=128 L=32 K=8 V=128256"
#: torchtune's Llama 3.2 3B with its chunked output and chunked cross entropy (tests/data/torchtune_llama.py)
TN3B = "tests/data/torchtune_llama.py:spec"
TN3B_SIZES = "H=24 D=128 L=28 K=8 F=8192 V=128256"

MG = "megatron-gpt --shard ddp --ac full --precision megatron-fp16"
#: Megatron-LM's small-GPT functional tests (MG6, MG7, MG9, MG10) set neither --overlap-grad-reduce nor
#: --overlap-param-gather (their model_config.yaml, docs/validation.md Per-run notes), whose defaults are
#: False (megatron/training/arguments.py): the gradient reduction runs after the backward, not under it
NO_OVERLAP = "--overlap none"
NS = "V=51200 S=2048 B=4 --gpu a100-80gb"
#: Megatron-LM's per-iteration work (passes/megatron_iteration.py) needs the run's own flags (the ones it
#: reads: --clip-grad, --log-interval, --log-params-norm, --log-num-zeros-in-grad, --loss-scale,
#: --no-check-for-nan-in-loss-and-grad, --no-gradient-accumulation-fusion); each set is its recipe's, file and commit in docs/validation.md
#: (Per-run notes). The small-GPT functional tests MG6-MG9 (model_config.yaml at NVIDIA/Megatron-LM
#: d98e8a6): both logs on, clipping 1.0, a log every iteration; no --loss-scale, so MG7's fp16 runs the
#: dynamic scale; all set --no-gradient-accumulation-fusion (every gradient added into the main-grad buffer)
MGA_SMALL = ('--megatron-args "--log-params-norm --log-num-zeros-in-grad --clip-grad 1.0 --log-interval 1 '
             '--no-gradient-accumulation-fusion"')
#: gpt3_7b_tp4_pp1_memory_speed (MG1, MG2; the same model_config.yaml): the same, a log every 2 iterations
MGA_7B = ('--megatron-args "--log-params-norm --log-num-zeros-in-grad --clip-grad 1.0 --log-interval 2 '
          '--no-gradient-accumulation-fusion"')
#: MG1/MG2's recipe (gpt3_7b_tp4_pp1_memory_speed) sets --overlap-grad-reduce and --overlap-param-gather:
#: symcost's --overlap full (the default under megatron-* is none, Megatron's own)
OVERLAP_7B = "--overlap full"
#: Narayanan et al. 2021 publish no flags of their runs; Megatron-LM's own GPT-3 example of the paper's
#: code (examples/pretrain_gpt3_175B.sh at a8d172b, 2021-04-28: TP 8 x PP 16, --fp16, dynamic scale)
#: sets --clip-grad 1.0 --log-interval 10 and neither log of norms nor zeros; that code has no
#: gradient-accumulation fusion (megatron/model/distributed.py adds every gradient into main_grad), which
#: is what --no-gradient-accumulation-fusion says
MGA_2021 = '--megatron-args "--clip-grad 1.0 --log-interval 10 --no-gradient-accumulation-fusion"'
#: Megatron-Bridge's qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config (067f987): optimizer.clip_grad 1.0,
#: logger.log_interval 10 (_pretrain_common), log_params_norm and log_num_zeros_in_grad left at their
#: False defaults, ddp.check_for_nan_in_grad True; src/megatron/bridge/recipes/qwen/h100/qwen3_moe.py
#: (067f987, lines 204-220) dispatches with moe_token_dispatcher_type "flex", moe_flex_dispatcher_backend
#: "hybridep" (docs/performance-model.md, "DeepEP's and HybridEP's dispatch")
MGA_BR1 = ('--megatron-args "--clip-grad 1.0 --log-interval 10 --moe-token-dispatcher-type flex '
           '--moe-flex-dispatcher-backend hybridep"')
#: ... and its _pretrain_common (src/megatron/bridge/recipes/common.py, 0eca073) sets
#: DistributedDataParallelConfig(overlap_grad_reduce=True, overlap_param_gather=True): --overlap full
OVERLAP_BR1 = "--overlap full"


def paper_step(hidden: int, layers: int, gpus: int, batch: int, tflops: float, s: int = 2048, V: int = 51200) -> float:
    """Narayanan et al. 2021 (arXiv:2104.04473) eq. (3): F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))
    FLOPs per iteration (recomputation included); the step is F / (TFLOP/s per GPU · GPUs)."""
    F = 96 * batch * s * layers * hidden ** 2 * (1 + s / (6 * hidden) + V / (16 * layers * hidden))
    return F / (tflops * 1e12 * gpus)


#: Table 1 rows N1-N10: (hidden, layers, GPUs, global batch, TFLOP/s per GPU)
NTABLE = {"N1": (2304, 24, 32, 512, 137), "N2": (3072, 30, 64, 512, 138), "N3": (4096, 36, 128, 512, 142),
          "N4": (6144, 40, 256, 1024, 135), "N5": (8192, 48, 512, 1536, 138), "N6": (10240, 60, 1024, 1792, 140),
          "N7": (12288, 80, 1536, 2304, 148), "N8": (16384, 96, 1920, 2160, 155),
          "N9": (20480, 105, 2520, 2520, 163), "N10": (25600, 128, 3072, 3072, 163)}
NSTEP = {k: round(paper_step(*v), 4) for k, v in NTABLE.items()}

#: id -> (symcost command after ``symcost``, published step seconds, the published figure it is
#: derived from[, micro-batches per step K]). With K > 1 (gradient accumulation: GBS / (B · DP)) the
#: command runs with ``--accumulate K`` and the predicted step is ``parallel.step.accumulated``: K
#: micro-batches composed as the engine runs them (DDP / Megatron reduce the gradients once per
#: step, FSDP2 every micro-batch, the optimizer step once; symcost/passes/accumulation.py).
RUNS: dict[str, tuple] = {
    "TT1": (f"report {L8} --dp 8 {TT} --set B=2 S=8192 --gpu h100-sxm", 2.843, "5,762 tok/s/GPU"),
    "TT4": (f"report {L8} --dp 128 {TT} --set B=2 S=8192 --gpu h100-sxm", 2.923, "5,605 tok/s/GPU"),
    "TT2": (f"report {TTL} --dp 8 {TT} --compile --set B=2 S=8192 {TT8B} --gpu h100-sxm", 2.457, "6,667 tok/s/GPU"),
    "TT5": (f"report {TTL} --dp 128 {TT} --compile --set B=2 S=8192 {TT8B} --gpu h100-sxm", 2.515,
            "6,514 tok/s/GPU"),
    "AO1": (f"report {TTL} --dp 8 {TT} --compile --set B=1 S=8192 {TT8B} --gpu h100-sxm", 1.332, "6,150 tok/s/GPU"),
    "P2": (f"report {L8} --dp 64 {TT} --set B=1 S=8192 --gpu a100-80gb", 2.755, "2,973 WPS"),
    "P4": (f"report {L13} --dp 64 --shard fsdp --precision fp32 --fsdp-mp bf16 --set B=2 S=4096 --gpu a100-80gb",
           3.789, "2,162 WPS"),
    "P5": (f"report {L13} --dp 64 {TT} --set B=2 S=4096 --gpu a100-80gb", 4.303, "1,904 WPS"),
    "TN1": (f"time {L3B} --precision bf16-true --set B=2 S=4096 --device a100-80gb --tokens 8192 --mfu 0.5", 1.158,
            "7,075 tok/s"),
    "TN2": (f"time {L3B} --precision bf16-true --compile --set B=2 S=4096 --device a100-80gb --tokens 8192 --mfu 0.5",
            0.9104, "8,998 tok/s"),
    # torchtune compiles each layer, then wraps it in full AC (the checkpoint outside the compiled
    # layer), and compiles the loss's upcast + cross entropy; --compile --ac full compiles the
    # checkpoint inside the block, as torchtitan does, and runs the loss eager
    "TN3": (f"time {TN3B} --precision bf16-true --compile --set B=2 S=4096 {TN3B_SIZES} --device a100-80gb --tokens 8192 "
            "--mfu 0.5", 0.893, "9,174 tok/s"),
    "TN4": (f"time {TN3B} --precision bf16-true --compile --ac full --set B=2 S=4096 {TN3B_SIZES} --device a100-80gb "
            "--tokens 8192 --mfu 0.5", 1.136, "7,210 tok/s"),
    "MG6": (f"report {GB} --dp 8 --shard zero1 --precision megatron-bf16 --set B=4 S=1024 --gpu h100-sxm {NO_OVERLAP} "
            f"{MGA_SMALL}", 0.05288, "0.05288 s/iteration"),
    "MG9": (f"report {GB} --dp 8 --shard ddp --ac full --precision megatron-bf16 --set B=4 S=1024 --gpu h100-sxm "
            f"{NO_OVERLAP} {MGA_SMALL}", 0.10978, "0.10978 s/iteration"),
    "MG1": ("report tests/data/megatron/mg7b.json --dp 2 --shard zero1 --tp 4 --precision megatron-bf16 --set B=2 "
            f"S=8192 --gpu h100-sxm {OVERLAP_7B} {MGA_7B}", 1.11493, "1.11493 s/iteration", 2),
    "MG2": ("report tests/data/megatron/mg7b.json --dp 2 --shard zero1 --tp 4 --precision megatron-bf16 --set B=2 "
            f"S=8192 --gpu a100-80gb {OVERLAP_7B} {MGA_7B}", 2.596, "2.596 s/iteration", 2),
    "MG7": ("report megatron-gpt --dp 2 --shard ddp --tp 4 --precision megatron-fp16 --set H=8 D=64 L=12 V=50688 B=4 "
            f"S=1024 --gpu h100-sxm {NO_OVERLAP} {MGA_SMALL}", 0.20575, "0.20575 s/iteration", 4),
    "MG10": (f"report {GB.replace('50304', '50432')} --dp 4 --shard fsdp --tp 2 --precision fp32 --fsdp-mp bf16 "
             f"--loss megatron --set B=4 S=1024 --gpu h100-sxm {NO_OVERLAP}", 0.15847, "0.15847 s/iteration", 2),    "P3": ("report tests/data/configs/llama-3-70b.json --dp 64 --shard fsdp --precision fp32 --fsdp-mp bf16 --ac full "
           "--set B=1 S=8192 --gpu a100-80gb", 24.75, "331 WPS"),
    # Narayanan et al. 2021 Table 1: the micro-batch is not published; B = 4 is assumed (K = GBS / (DP · 4))
    "N1": (f"report {MG} --dp 32 --set H=24 D=96 L=24 {NS} {MGA_2021}", NSTEP["N1"], "137 TFLOP/s/GPU (paper's F)", 4),
    "N2": (f"report {MG} --dp 32 --tp 2 --set H=32 D=96 L=30 {NS} {MGA_2021}", NSTEP["N2"], "138 TFLOP/s/GPU (paper's F)", 4),
    "N3": (f"report {MG} --dp 32 --tp 4 --set H=32 D=128 L=36 {NS} {MGA_2021}", NSTEP["N3"], "142 TFLOP/s/GPU (paper's F)", 4),
    "N4": (f"report {MG} --dp 32 --tp 8 --set H=48 D=128 L=40 {NS} {MGA_2021}", NSTEP["N4"], "135 TFLOP/s/GPU (paper's F)", 8),
    # pipelines (report --pp: the whole step of m = GBS / (DP · B) micro-batches, K = 1). MG8: Megatron's
    # local DDP, 1F1B, 4 micro-batches per DP rank, no gradient-reduce overlap (Per-run notes)
    "MG8": (f"report {GB} --pp 4 --dp 2 --shard ddp --precision megatron-bf16 --microbatches 4 --set B=4 S=1024 "
            f"--gpu h100-sxm {NO_OVERLAP} {MGA_SMALL}", 0.10226, "0.10226 s/iteration"),
    # Narayanan et al. 2021 Table 1 with pipelines: B = 4 assumed as for N1-N4 (m = GBS / (DP · 4)), 1F1B
    # (Table 1 states neither); Megatron-LM 2021 all-reduces the gradients after the whole
    # forward-backward (megatron/training.py train_step at a8d172b, 2021-04-28): --overlap none
    "N5": (f"report {MG} --pp 2 --dp 32 --tp 8 --microbatches 12 {NO_OVERLAP} --set H=64 D=128 L=48 {NS} {MGA_2021}",
           NSTEP["N5"], "138 TFLOP/s/GPU (paper's F)"),
    "N6": (f"report {MG} --pp 4 --dp 32 --tp 8 --microbatches 14 {NO_OVERLAP} --set H=80 D=128 L=60 {NS} {MGA_2021}",
           NSTEP["N6"], "140 TFLOP/s/GPU (paper's F)"),
    "N7": (f"report {MG} --pp 8 --dp 24 --tp 8 --microbatches 24 {NO_OVERLAP} --set H=96 D=128 L=80 {NS} {MGA_2021}",
           NSTEP["N7"], "148 TFLOP/s/GPU (paper's F)"),
    # 1,920 A100s: DP 15 x TP 8 x PP 16, m = 2160 / (15 · 4) = 36 (B = 4 assumed as above)
    "N8": (f"report {MG} --pp 16 --dp 15 --tp 8 --microbatches 36 {NO_OVERLAP} --set H=128 D=128 L=96 {NS} {MGA_2021}",
           NSTEP["N8"], "155 TFLOP/s/GPU (paper's F)"),
    # torchtitan's DeepSeek-V3 16B (the shapes of DeepSeek-V2-Lite) with EP 8 on 8 H100s: FSDP over
    # dp_shard = ep = 8 (efsdp 1, symcost's --dp 1), selective-op AC, B = 4 (inferred: PR #1792's value)
    "TM1": (f"report tests/data/configs/deepseek-v2-lite.json --ep 8 --dp 1 {TT} --set B=4 S=4096 --gpu h100-sxm",
            1.456, "11,254 tok/s/GPU"),
    # Megatron-Bridge's Qwen3-30B-A3B on 16 H100s (docs/validation.md BR1): EP 16 over Megatron's DP 16
    # (expert-data-parallel 1: symcost's --dp 1), its distributed optimizer (--shard zero1), BF16, no
    # recompute, B 1, GBS 1024: K = 1024 / 16 = 64 micro-batches (the gradients reduced once per step). Not
    # modelled: its HybridEP dispatcher (all_to_all_single here), CUDA graphs, EP overlap
    "BR1": ("report tests/data/configs/qwen3-30b-a3b.json --ep 16 --dp 1 --shard zero1 --precision megatron-bf16 "
            f"--set B=1 S=4096 --gpu h100-sxm {OVERLAP_BR1} {MGA_BR1}", 20.14729,
            "20.14729 s/iteration (published: s/step)", 64),
}


def run_one(rid: str) -> dict:
    cmd, published, figure, *k = RUNS[rid]
    k = k[0] if k else 1
    if k > 1:
        cmd = f"{cmd} --accumulate {k}"
    t0 = time.time()
    p = subprocess.run(["symcost", *shlex.split(cmd), "--json"], capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        return {"id": rid, "command": f"symcost {cmd} --json", "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    d = json.loads(p.stdout)
    if cmd.startswith("report") and " --pp " in cmd:  # (the pipeline's whole step: predicted beside the bound)
        st = d["pipeline"]["step"]
        pred, bound, mfu = st["predicted"]["step_seconds"], st["step_seconds"], st["predicted"]["mfu_predicted"]
    elif cmd.startswith("report"):
        st = d["parallel"]["step"]
        pred, bound, mfu = st["predicted"]["step_seconds"], st["step_seconds"], st["predicted"]["mfu_predicted"]
    else:
        pr = d["predicted"]
        pred, bound, mfu = pr["step_seconds"], pr["bound_seconds"], pr["mfu_predicted"]
    micro = pred
    if k > 1:  # (one optimizer step of K micro-batches as the engine runs them)
        acc = d["parallel"]["step"]["accumulated"]
        pred, bound = acc["step_seconds"], acc["bound_seconds"]
        mfu = mfu * micro * k / pred  # (K micro-batches' model FLOPs over the K-step: was one micro-batch's step)
    return {"micro_batches": k, "predicted_micro_seconds": micro, "id": rid, "command": f"symcost {cmd} --json", "published_seconds": published, "published": figure,
            "predicted_seconds": pred, "bound_seconds": bound, "mfu_predicted": mfu,
            "error": pred / published - 1, "bound_error": bound / published - 1, "wall_s": round(time.time() - t0)}


def table(rows: list[dict]) -> str:
    out = ["| id | measured step s (published) | bound s | predicted s | predicted MFU | error (predicted) | "
           "error (bound) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r['id']} | {r['published_seconds']:.4g} ({r['published']}) | {r['bound_seconds']:.4g} | "
                   f"{r['predicted_seconds']:.4g} | {100 * r['mfu_predicted']:.1f}% | {100 * r['error']:+.1f}% | "
                   f"{100 * r['bound_error']:+.1f}% |")
    errs = [abs(r["error"]) for r in rows]
    out.append("")
    out.append(f"{len(rows)} runs: median |error| {100 * statistics.median(errs):.1f}%, worst "
               f"{100 * max(errs):.1f}%; within 15%: {sum(e <= 0.15 for e in errs)}, within 30%: "
               f"{sum(e <= 0.30 for e in errs)}")
    out.append("")
    out.append("Commands (each printed the predicted and bound step read above; K micro-batches: the step of "
               "--accumulate K):")
    out.append("")
    for r in rows:
        k = f" (K = {r['micro_batches']})" if r["micro_batches"] > 1 else ""
        out.append(f"- {r['id']}{k}: `{r['command']}`")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT, help="the results file (default tests/data/published-steps.json)")
    a = ap.parse_args()
    out = a.out
    data = json.loads(out.read_text()) if out.exists() else {"runs": []}
    have = {r["id"]: r for r in data["runs"]}
    if not a.table:
        for rid in a.only or list(RUNS):
            if rid in have and not a.force and "error" in have[rid] and "predicted_seconds" in have[rid]:
                continue
            r = run_one(rid)
            print(json.dumps(r), flush=True)
            have[rid] = r
            data["runs"] = [have[k] for k in RUNS if k in have]
            out.write_text(json.dumps(data, indent=1) + "\n")
    rows = [have[k] for k in RUNS if k in have and "predicted_seconds" in have[k]]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
