#!/usr/bin/env bash
# The multi-GPU measurements in one unattended command (10 minutes at most), on a machine with 2 or 4 GPUs:
#   1. bench/scaling.py on 1 GPU: the weak-scaling baseline at 64k tokens, and a 32k-token row that the CP=2
#      check compares with (same data and weights);
#   2. bench/scaling.py on 2 GPUs: FSDP2, FSDP2 + EP=2 (gather dispatch, and the all-to-all dispatch it replaces),
#      the CP=2 check, HSDP, EP=2 with two pipelined chunks, CP=2 at 64k tokens per GPU, two blocks per FSDP unit;
#   3. with 4 GPUs: FSDP2, EP=4, EP=2, HSDP 2x2, EP=4 chunked, EP=4 all-to-all, CP=2 x DP=2, two blocks per unit;
#   4. train.py recipes/multi_gpu.yaml for 200 steps on all GPUs (4, or 2), profiled at steps 150-152: its curve,
#      evaluations and step-time line (bench/run_summary.py, into OUT_DIR/multi_gpu_run.md);
#   5. with the time left (>= 40 s): the sync-free expert-parallel GPU test (tests/test_parallel_expert.py, NCCL,
#      sync debug mode "error").
# Not in the default set (its own command, RUNBOOK_STAGES=pp): bench/scaling.py --pipeline-set on 2 GPUs (pp=2
# under each schedule) and on 4 (pp=4 under each schedule, pp=2 x ep=2 with 1F1B and DualPipeV).
# On a 4-GPU machine stage 1 (GPU 3) runs beside stage 2 (GPUs 0-1). Every stage has a time limit inside the total
# budget; a stage cut short keeps what it finished (scaling rows are appended as they are measured) and the next
# stage starts. RUNBOOK_STAGES=scaling (or train,tests) runs a subset, e.g. to split the set over two commands.
#
#   bench/multi_gpu_runbook.sh OUT_DIR          on the GPU machine; then copy OUT_DIR/scaling.jsonl over
#                                               bench/notes/scaling.jsonl and OUT_DIR/scaling.{md,json} into
#                                               bench/results/ (OUT_DIR/multi_gpu_run.md is the run's own record)
#   bench/multi_gpu_runbook.sh --cpu OUT_DIR    dry run on CPU (gloo, tiny model, 1, 2 and 4 processes, a few
#                                               steps): checks that every stage and output works end to end
#   RUNBOOK_GPUS=2 ...                          only the 1- and 2-GPU stages, training on 2 (also with --cpu)
#
# OUT_DIR receives: scaling.jsonl (the repository's rows plus this run's), scaling.md, scaling.json,
# multi_gpu_run.md, multi_gpu_run/ (metrics.jsonl, config.yaml, loss.png, profile tables), gpu_tests.log,
# logs/<stage>.log, topo.txt, timeline.txt.
set -uo pipefail

CPU=0
if [[ "${1:-}" == "--cpu" ]]; then CPU=1; shift; fi
OUT="${1:?usage: bench/multi_gpu_runbook.sh [--cpu] OUT_DIR}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${RUNBOOK_BUDGET_S:-570}  # seconds for everything, under the device's 10-minute limit per command

if [[ $CPU == 1 ]]; then
    NGPU=4
    export OMP_NUM_THREADS=1
    RECIPE=recipes/tiny.yaml
    SCALE=(--recipe "$RECIPE" --set train.tokens_per_microbatch=256 --doc-len 64 --warmup 1 --steps 1 --profile-steps 1)
    T_SMALL=128; T_BIG=512  # the CP check's micro-batch; CP=2 with the base tokens per GPU
    TRAIN=(recipes/tiny.yaml parallel.ep=2 train.steps=6 train.eval_every=3 logging.log_every=2
           "logging.profile_steps=[4,5]")
    BUDGET=${RUNBOOK_BUDGET_S:-2400}
    SLOW=4  # stage limits x4: a loaded 2-core CPU, not the 10-minute device limit
else
    NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
    SLOW=1
    RECIPE=recipes/multi_gpu.yaml
    SCALE=(--recipe "$RECIPE" --warmup 2 --steps 5 --profile-steps 1)
    T_SMALL=32768; T_BIG=131072
    TRAIN=(recipes/multi_gpu.yaml train.steps=200 train.eval_every=100 checkpoint.every=0 checkpoint.save_at_end=false
           "logging.profile_steps=[150,152]")
fi
if (( NGPU < 2 )); then
    echo "multi_gpu_runbook: $NGPU GPU(s) visible; it needs 2 or 4" >&2
    exit 2
fi
(( NGPU > 4 )) && NGPU=4
NGPU=${RUNBOOK_GPUS:-$NGPU}  # e.g. RUNBOOK_GPUS=2 for the 2-GPU stages only

cp bench/notes/scaling.jsonl "$OUT/scaling.jsonl"
ROWS=(--jsonl "$OUT/scaling.jsonl" --out-dir "$OUT")
{ date -u; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    > "$OUT/topo.txt" 2>&1
[[ $CPU == 0 ]] && nvidia-smi topo -m >> "$OUT/topo.txt" 2>&1

left() { echo $(( BUDGET - SECONDS )); }
# stage NAME LIMIT_S RESERVE_S DEVICES COMMAND...: run with a limit of min(LIMIT, time left - RESERVE)
stage() {
    local name=$1 limit=$(( $2 * SLOW )) reserve=$(( $3 * SLOW )) devices=$4; shift 4
    local t=$(( $(left) - reserve ))
    (( t > limit )) && t=$limit
    if (( t < 40 )); then
        echo "$(date -u +%T) $name: skipped, ${t}s left" >> "$OUT/timeline.txt"
        return 0
    fi
    echo "$(date -u +%T) $name: start, limit ${t}s" >> "$OUT/timeline.txt"
    local env=()
    [[ $CPU == 0 ]] && env=(CUDA_VISIBLE_DEVICES="$devices")
    env "${env[@]}" timeout --signal=TERM --kill-after=15 "$t" "$@" > "$OUT/logs/$name.log" 2>&1
    echo "$(date -u +%T) $name: exit $?" >> "$OUT/timeline.txt"
}
scaling() {  # scaling NAME LIMIT RESERVE DEVICES NPROC LAYOUT...
    local name=$1 limit=$2 reserve=$3 devices=$4 nproc=$5; shift 5
    local layouts=()
    for l in "$@"; do layouts+=(--layout "$l"); done
    stage "$name" "$limit" "$reserve" "$devices" torchrun --standalone --nproc_per_node="$nproc" bench/scaling.py \
        "${SCALE[@]}" "${layouts[@]}" "${ROWS[@]}"
}

ONE=(ep=1 "ep=1,train.tokens_per_microbatch=$T_SMALL")
TWO=(ep=1 ep=2 ep=2,ep_dispatch=alltoall "cp=2,ep=1,train.tokens_per_microbatch=$T_SMALL" dp_replicate=2,ep=1
     ep=2,ep_chunks=2 "cp=2,ep=1,train.tokens_per_microbatch=$T_BIG" ep=2,fsdp_unit_blocks=2)
FOUR=(ep=1 ep=4 ep=2 dp_replicate=2,ep=1 ep=4,ep_chunks=2 ep=4,ep_dispatch=alltoall
      "cp=2,ep=2,train.tokens_per_microbatch=$T_BIG" ep=4,fsdp_unit_blocks=2)
GPU_TEST=(python -m pytest -q -p no:randomly -m gpu tests/test_parallel_expert.py -k two_gpus)

want() { [[ ",${RUNBOOK_STAGES:-scaling,train,tests}," == *",$1,"* ]]; }
if want scaling; then
    if (( NGPU >= 4 )) && [[ $CPU == 0 ]]; then  # the 1-GPU baseline on GPU 3 beside the 2-GPU rows
        scaling scaling_1gpu 150 420 3 1 "${ONE[@]}" &
        scaling scaling_2gpu 170 400 0,1 2 "${TWO[@]}"
        wait
    else
        scaling scaling_1gpu 130 440 0 1 "${ONE[@]}"
        scaling scaling_2gpu 170 270 0,1 2 "${TWO[@]}"
    fi
    if (( NGPU >= 4 )); then
        scaling scaling_4gpu 160 240 0,1,2,3 4 "${FOUR[@]}"
    fi
fi

if want pp; then  # only when asked for: RUNBOOK_STAGES=pp
    PP=("${SCALE[@]}" --pipeline-set "${ROWS[@]}")
    [[ $CPU == 1 ]] && PP+=(--set model.num_hidden_layers=6)  # 8 stages (pp=4 x 2 chunks) need 6 layers
    stage scaling_pp_2gpu 240 200 0,1 torchrun --standalone --nproc_per_node=2 bench/scaling.py "${PP[@]}"
    if (( NGPU >= 4 )); then
        stage scaling_pp_4gpu 300 0 0,1,2,3 torchrun --standalone --nproc_per_node=4 bench/scaling.py "${PP[@]}"
    fi
fi

RUN=/tmp/moela_multi_gpu_run
rm -rf "$RUN"
DEVICES=$(seq -s, 0 $(( NGPU - 1 )))
if want train; then
    stage train_${NGPU}gpu 200 35 "$DEVICES" torchrun --standalone --nproc_per_node="$NGPU" train.py "${TRAIN[@]}" \
        train.run_dir="$RUN"
fi
if want tests && [[ $CPU == 0 ]]; then  # last: whatever time is left, if at least 40 s
    stage gpu_tests 150 0 0,1 "${GPU_TEST[@]}"
    cp "$OUT/logs/gpu_tests.log" "$OUT/gpu_tests.log" 2>/dev/null
fi
mkdir -p "$OUT/multi_gpu_run"
cp "$RUN"/metrics.jsonl "$RUN"/config.yaml "$RUN"/loss.png "$OUT/multi_gpu_run/" 2>/dev/null
cp "$RUN"/profile/*.txt "$OUT/multi_gpu_run/" 2>/dev/null
if [[ -f "$RUN/metrics.jsonl" ]]; then
    python bench/run_summary.py "$RUN" --gpus "$NGPU" --from-step "$([[ $CPU == 1 ]] && echo 2 || echo 20)" \
        > "$OUT/multi_gpu_run.md"
fi
python bench/scaling.py --report-only "${ROWS[@]}" > /dev/null
echo "$(date -u +%T) done in ${SECONDS}s" >> "$OUT/timeline.txt"
cat "$OUT/timeline.txt"
