# zero-plan's command line: --json output parses and carries the numbers,
# --fit answers with its exit status, and bad sizes are errors naming the option.
# cmake -DZERO_PLAN=path/to/zero-plan -DTINY_CONFIG=tiny_unet.json -P check_zero_plan.cmake

function(run_plan out_var rc_var err_var)
  execute_process(COMMAND ${ZERO_PLAN} ${ARGN} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  set(${out_var} "${out}" PARENT_SCOPE)
  set(${rc_var} "${rc}" PARENT_SCOPE)
  set(${err_var} "${err}" PARENT_SCOPE)
endfunction()

# expect("what went wrong" <if() condition>)
macro(expect message)
  if(NOT (${ARGN}))
    message(FATAL_ERROR "zero-plan check failed: ${message}")
  endif()
endmacro()

# A plan as JSON: the SDXL trainer's stage-2 batch-8 run (measured 70.79 GiB between steps).
run_plan(out rc err --unet-config sdxl-base --stage 2 --ema --batch 8 --checkpointing --json)
expect("plan exit status ${rc}: ${err}" rc EQUAL 0)
string(JSON params GET "${out}" model parameters)
expect("parameters ${params}" params EQUAL 2567463684)
string(JSON units GET "${out}" model units)
expect("units ${units}" units EQUAL 9)
string(JSON at_end GET "${out}" gpu_bytes total_at_step_end)
math(EXPR at_end_mib "${at_end} / 1048576")
# 70.79 GiB = 72489 MiB; within 10%.
expect("between-steps ${at_end_mib} MiB vs 72489 MiB measured" at_end_mib GREATER 65240 AND at_end_mib LESS 79738)
string(JSON optimizer GET "${out}" gpu_bytes optimizer_state)
expect("AdamW state ${optimizer} bytes (2 x 4 x padded elements)" optimizer EQUAL 20539731968)

# The readable table by default.
run_plan(out rc err --unet-config sdxl-base --stage 3 --offload-optimizer --world-size 8 --ema)
expect("table exit status ${rc}: ${err}" rc EQUAL 0)
string(FIND "${out}" "per host (8 ranks, pinned memory)" at)
expect("table without the per-host section:\n${out}" NOT at EQUAL -1)
string(FIND "${out}" "total, peak" at)
expect("table without a total:\n${out}" NOT at EQUAL -1)

# A UNet config file and a bare parameter count.
run_plan(out rc err --unet-config ${TINY_CONFIG} --json)
expect("tiny config exit status ${rc}: ${err}" rc EQUAL 0)
string(JSON source GET "${out}" activation_model)
string(FIND "${source}" "extrapolated" at)
expect("tiny activations should be marked extrapolated: ${source}" NOT at EQUAL -1)
run_plan(out rc err --params 7e9 --world-size 16 --stage 3 --json)
expect("--params exit status ${rc}: ${err}" rc EQUAL 0)
string(JSON params GET "${out}" model parameters)
expect("--params 7e9 gave ${params}" params EQUAL 7000000000)

# --fit: 24 GiB fits with the optimizer offloaded; 4 GiB fits nothing (exit 3).
run_plan(out rc err --unet-config sdxl-base --ema --fit 24GiB --json)
expect("--fit 24GiB exit status ${rc}: ${err}" rc EQUAL 0)
string(JSON fits GET "${out}" fits)
expect("--fit 24GiB: nothing fits?" fits)
string(JSON offload GET "${out}" best config offload_optimizer)
expect("--fit 24GiB should offload the optimizer" offload)
run_plan(out rc err --unet-config sdxl-base --ema --fit 4GiB)
expect("--fit 4GiB exit status ${rc}, expected 3" rc EQUAL 3)
string(FIND "${out}" "nothing fits 4.00 GiB" at)
expect("--fit 4GiB output:\n${out}" NOT at EQUAL -1)

# Parameter offload: stage 3 with the optimizer offloaded, else a clear error.
run_plan(out rc err --unet-config sdxl-base --ema --stage 3 --offload-optimizer --offload-params --checkpointing --json)
expect("--offload-params exit status ${rc}: ${err}" rc EQUAL 0)
string(JSON on_gpu GET "${out}" gpu_bytes params)
expect("--offload-params: params on the GPU ${on_gpu}" on_gpu EQUAL 0)
run_plan(out rc err --unet-config sdxl-base --stage 2 --offload-optimizer --offload-params)
expect("--offload-params at stage 2 exit status ${rc}" rc EQUAL 1)
string(FIND "${err}" "offload_params needs stage 3 with offload_optimizer" at)
expect("--offload-params at stage 2 message: ${err}" NOT at EQUAL -1)

# Errors name the option.
run_plan(out rc err --unet-config sdxl-base --fit 24XB)
expect("--fit 24XB exit status ${rc}" rc EQUAL 1)
string(FIND "${err}" "--fit: expected a size such as 24GiB" at)
expect("--fit 24XB message: ${err}" NOT at EQUAL -1)
run_plan(out rc err --unet-config sdxl-base --fit 24GiB --host-memory lots)
expect("--host-memory lots exit status ${rc}" rc EQUAL 1)
string(FIND "${err}" "--host-memory: expected a size" at)
expect("--host-memory message: ${err}" NOT at EQUAL -1)
run_plan(out rc err --unet-config sdxl-base --fit 0)
expect("--fit 0 exit status ${rc}" rc EQUAL 1)
string(FIND "${err}" "--fit: must be more than 0 bytes" at)
expect("--fit 0 message: ${err}" NOT at EQUAL -1)
run_plan(out rc err --params 1e9 --unet-config sdxl-base)
expect("--params with --unet-config should be refused" NOT rc EQUAL 0)
run_plan(out rc err --unet-config no-such-model)
expect("unknown --unet-config exit status ${rc}" rc EQUAL 1)
string(FIND "${err}" "--unet-config: 'no-such-model'" at)
expect("--unet-config message: ${err}" NOT at EQUAL -1)
message(STATUS "zero-plan command line: all checks passed")
