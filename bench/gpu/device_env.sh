# Sourced by the bench/gpu/run_*_device.sh scripts (from the repository root)
# after setting NAME (the subfolder of $OUT for this script's logs): the
# environment every device call needs and the helpers they share.
#   OUT_DIR=$OUT/$NAME, LOG=$OUT_DIR/run.log, BUILD=build/cuda,
#   STEPS (default 20), PHASES (default: DEFAULT_PHASES), say MESSAGE, has PHASE.
OUT=${OUT:-/tmp/zero-device-out}
OUT_DIR=$OUT/${NAME:?set NAME before sourcing device_env.sh}
LOG=$OUT_DIR/run.log
BUILD=build/cuda
STEPS=${STEPS:-20}
PHASES=${PHASES:-${DEFAULT_PHASES:-}}
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
say() { echo "==== $(date -u +%H:%M:%S) [$((SECONDS))s] $*" | tee -a "$LOG"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

# build_targets [TARGET...]: configure the cuda preset and build (nothing
# named: every target).
build_targets() {
  say "build ${*:-all targets}"
  ( source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build "$@" ) 2>&1 | tail -5 | tee -a "$LOG"
}

# run_gpu_tests REGEX|all: ctest of the gpu tests into $OUT_DIR/ctest.log.
run_gpu_tests() {
  say "tests ${1}"
  local select
  if [ "$1" = all ]; then select=(-L gpu); else select=(-R "$1"); fi
  ctest --test-dir $BUILD "${select[@]}" --output-on-failure --timeout 500 > "$OUT_DIR/ctest.log" 2>&1
  grep -E "Test +#|tests passed|FAIL|max relative|images/s|Error|error" "$OUT_DIR/ctest.log" | head -60 | tee -a "$LOG"
}

# build_base_tree: the trainer from BASE_TREE (a `git archive` of an A/B's base
# commit, unpacked in an untracked folder of the working tree), into
# $BASE_TREE/build/cuda, with the toml++ headers that travel in .deps.
build_base_tree() {
  local base=${BASE_TREE:?set BASE_TREE to the folder with the sources of the base commit}
  ln -sfn ../.deps "$base/.deps"
  say "build base ($base)"
  ( cd "$base" && source tools/gpu-common.sh && gpu_check_prerequisites && gpu_build train ) 2>&1 | tail -2 | tee -a "$LOG"
}

# device_script_begin: what every run_*_device.sh does after sourcing this
# file: build (phase build; TARGETS: only these), load the trainer helpers
# (trainer_run.sh) and record the GPU in the log.
device_script_begin() {
  if has build; then build_targets ${TARGETS:-}; fi
  source bench/gpu/trainer_run.sh
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
}
