#!/usr/bin/env bash
# The GPU check: `oppo-jax bench` of sync, intra, inter and oppo on one H100/H200-class GPU,
# Qwen2.5-0.5B-shaped random bf16 models and long-tailed lengths up to 1024 tokens
# (configs/bench_longtail_gpu.yaml). Budget: 8 minutes, compilation included.
#
#   benchmarks/gpu_bench.sh [--smoke] [--out DIR] [--steps N] [--warmup N] [--attention K]
#                           [--compact on|off|auto] [--schedules sync,oppo]
#
# --attention: model.attention (default auto: cuDNN flash attention on the GPU for the bf16
# models, the ragged decode kernel for decode steps, each row reading only its own keys, and
# the segment attention for the packed update's rows; xla runs XLA's kernel for everything,
# e.g. to compare, or where cuDNN rejects a shape; ragged: the two Pallas kernels, XLA for the
# rest). `--attention ragged` beside `--attention xla` measures what they save
# (docs/PROJECTIONS.md §4b, §4e).
# --compact: pipeline.compact_slots (default auto: the backend's default, off on a GPU). The
# simulator projects that slot compaction pays on accelerators too at long responses
# (docs/PROJECTIONS.md §4); a run with `--compact on --out runs/gpu_bench_compact` beside the
# default one measures it.
# --schedules: the schedules to bench, sync among them (default: all four).
#
# Needs nothing downloaded: the models are random weights built from the preset, the prompts
# random token ids. The project is not installed: the script puts the repository on
# PYTHONPATH and runs `python -m oppo_jax.cli` with the interpreter in $PYTHON (default: the
# repository's .venv/bin/python if there is one, else python3), which must already have jax
# with its CUDA plugin (jax[cuda], preinstalled on the GPU machine) and the project's other
# dependencies (`pip install -e . --no-deps` adds only the project itself; a missing module
# is named before anything runs).
#
# --smoke: the same path on the CPU with the `tiny` preset and a few short steps (a test runs
# it, so the GPU path never breaks silently). Without --smoke the script exits 3, saying so,
# when jax sees no GPU.
#
# Carried-admission shapes compile when first met (--no-precompile): up front, all 28 of them
# for four models would take much of the budget; the summary counts the measured steps that
# compiled. Writes DIR/bench.json (default runs/gpu_bench), DIR/ragged_check.json (the Pallas
# kernels' check, run first: see below), DIR/summary.txt and prints its one line.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOKE=0
OUT=""
STEPS=""
WARMUP=""
ATTENTION=auto
COMPACT=auto
SCHEDULES=sync,intra,inter,oppo
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) SMOKE=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --attention) ATTENTION="$2"; shift 2 ;;
    --compact) COMPACT="$2"; shift 2 ;;
    --schedules) SCHEDULES="$2"; shift 2 ;;
    -h|--help) sed -n '2,36p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_bench.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

missing=$("$PYTHON" - <<'EOF'
import importlib.util
mods = ["jax", "flax", "optax", "orbax.checkpoint", "numpy", "yaml", "omegaconf", "jaxtyping",
        "tqdm", "tokenizers", "transformers", "safetensors", "matplotlib"]
print(" ".join(m for m in mods if importlib.util.find_spec(m.split(".")[0]) is None))
EOF
)
if [[ -n "$missing" ]]; then
  echo "gpu_bench.sh: $PYTHON lacks: $missing (install them, then rerun)" >&2
  exit 2
fi

CONFIG="$ROOT/configs/bench_longtail_gpu.yaml"
SET=(model.attention="$ATTENTION")
case "$COMPACT" in
  on) SET+=(pipeline.compact_slots=true) ;;
  off) SET+=(pipeline.compact_slots=false) ;;
  auto) ;;
  *) echo "gpu_bench.sh: --compact takes on, off or auto, not $COMPACT" >&2; exit 2 ;;
esac
if [[ $SMOKE == 1 ]]; then
  # Same config and code path on the CPU: tiny preset, short responses, a few steps.
  export JAX_PLATFORMS=cpu
  SET+=(model.preset=tiny model.dtype=float32 model.param_dtype=float32 model.remat=none
       rollout.batch_size=4 rollout.max_prompt_len=16 rollout.max_response_len=64
       rollout.length_median=8 rollout.length_p99=56 data.random_prompt_len=[4,16]
       ppo.grad_accum_steps=1 pipeline.chunk_size=8 pipeline.overcommit=4
       pipeline.overcommit_max=4)
  OUT="${OUT:-runs/gpu_bench_smoke}"
  STEPS="${STEPS:-2}"
  WARMUP="${WARMUP:-1}"
else
  backend=$("$PYTHON" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo none)
  if [[ "$backend" != "gpu" && "$backend" != "cuda" ]]; then
    echo "gpu_bench.sh: jax sees no GPU (default backend: $backend); run it on a machine with" \
         "an NVIDIA GPU and jax[cuda], or use --smoke for the CPU check" >&2
    exit 3
  fi
  OUT="${OUT:-runs/gpu_bench}"
  STEPS="${STEPS:-5}"
  WARMUP="${WARMUP:-2}"
fi

# The Pallas kernels (model.attention auto or ragged runs them on the GPU: the ragged decode
# attention and the packed update's segment attention) first: correct against float32
# references, and timed beside XLA's attention (benchmarks/ragged_check.py).
# If it fails, auto measures with cuDNN's decode attention instead (the summary says so;
# xla under --smoke);
# an explicit --attention ragged stops here. ($RAGGED_CHECK replaces the check script: tests.)
mkdir -p "$OUT"
RAGGED_NOTE=""
if [[ "$ATTENTION" == auto || "$ATTENTION" == ragged ]]; then
  CHECK=(--out "$OUT/ragged_check.json")
  [[ $SMOKE == 1 ]] && CHECK+=(--smoke)
  if ! "$PYTHON" "${RAGGED_CHECK:-$ROOT/benchmarks/ragged_check.py}" "${CHECK[@]}"; then
    if [[ "$ATTENTION" == ragged ]]; then
      echo "gpu_bench.sh: the ragged decode kernel failed its check (above)" >&2
      exit 4
    fi
    FALLBACK=cudnn  # the GPU's kernels before the ragged one (the CPU has no cuDNN: xla)
    [[ $SMOKE == 1 ]] && FALLBACK=xla
    echo "gpu_bench.sh: the ragged decode kernel failed its check (above); measuring with" \
         "model.attention=$FALLBACK instead" >&2
    SET[0]=model.attention=$FALLBACK
    RAGGED_NOTE=" | ragged check FAILED: attention $FALLBACK"
  fi
fi

start=$(date +%s)
"$PYTHON" -m oppo_jax.cli bench "$CONFIG" --out "$OUT" --steps "$STEPS" --warmup "$WARMUP" \
  --no-precompile --schedules "$SCHEDULES" \
  ${SET[@]+--set "${SET[@]}"}
elapsed=$(( $(date +%s) - start ))

"$PYTHON" - "$OUT" "$elapsed" "$RAGGED_NOTE" <<'EOF'
import json, sys
out, elapsed, note = sys.argv[1], int(sys.argv[2]), sys.argv[3]
r = json.loads(open(f"{out}/bench.json").read())
s, shares = r["schedules"], r["sync_stage_shares"]
device = r["machine"]["devices"][0]
speed = " | ".join(f"{n} {v:.2f}x" for n, v in r["speedup_vs_sync"].items() if v is not None)
compiled = sum(x["measured_steps_that_compiled"] for x in s.values())
measured = sum(len(x["records"]) for x in s.values())
line = (
    f"gpu_bench: {device} | sync {s['sync']['step_time_median_s']:.3f} s/step (median) | {speed}"
    f" | sync decode+scoring {shares['decode_plus_scoring']:.2f}"
    f" | oppo measured/ideal {r['measured_over_ideal']['oppo']:.2f}"
    f" | {compiled}/{measured} measured steps compiled | {elapsed} s | {out}/bench.json{note}"
)
open(f"{out}/summary.txt", "w").write(line + "\n")
print(line)
EOF
