# cmake -DSOURCE=... -DWORK=... -DGENERATOR=... -DNVCC=... -P check_configure.cmake
# Configures zero with ZERO_WITH_CUDA=ON against the CPU-only LibTorch that
# the calling build found, once with ZERO_WITH_TORCH=AUTO and once with ON
# (tests, benches and examples off: only the LibTorch decision is under test).
set(failures 0)
function(configure torch_mode out_var rc_var)
  set(dir ${WORK}/${torch_mode})
  file(REMOVE_RECURSE ${dir})
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${SOURCE} -B ${dir} -G ${GENERATOR}
      -DZERO_WITH_CUDA=ON -DZERO_WITH_TORCH=${torch_mode} -DCMAKE_CUDA_COMPILER=${NVCC}
      -DCMAKE_CUDA_ARCHITECTURES=90a "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}"
      -DZERO_BUILD_TESTS=OFF -DZERO_BUILD_BENCH=OFF -DZERO_BUILD_EXAMPLES=OFF
    OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  # CMake wraps messages at 80 columns: compare with single spaces.
  string(REGEX REPLACE "[ \n]+" " " text "${out}${err}")
  set(${out_var} "${text}" PARENT_SCOPE)
  set(${rc_var} ${rc} PARENT_SCOPE)
endfunction()
# expect(WHAT CONDITION...): CONDITION as if() takes it.
function(expect what)
  if(${ARGN})
    message(STATUS "ok   ${what}")
  else()
    message(STATUS "FAIL ${what}")
    math(EXPR n "${failures} + 1")
    set(failures ${n} PARENT_SCOPE)
  endif()
endfunction()

configure(AUTO text rc)
string(FIND "${text}" "is built without CUDA, and this build has ZERO_WITH_CUDA=ON; zero::torch, the SDXL example" said_why)
string(FIND "${text}" "zero: CUDA ON, LibTorch OFF" left_out)
expect("AUTO: configure succeeds (exit ${rc})" rc EQUAL 0)
expect("AUTO: the warning says the LibTorch has no CUDA and what is left out" NOT said_why EQUAL -1)
expect("AUTO: LibTorch OFF in the CUDA build" NOT left_out EQUAL -1)
if(failures GREATER 0)
  message(STATUS "AUTO output: ${text}")
endif()

configure(ON text rc)
string(FIND "${text}" "ZERO_WITH_TORCH=ON: the LibTorch found" named)
string(FIND "${text}" "is built without CUDA" reason)
string(FIND "${text}" "Point CMAKE_PREFIX_PATH at a CUDA LibTorch" fix)
expect("ON: configure fails (exit ${rc})" NOT rc EQUAL 0)
expect("ON: the error names the option and the reason" NOT named EQUAL -1 AND NOT reason EQUAL -1)
expect("ON: the error says how to get a CUDA LibTorch" NOT fix EQUAL -1)
if(failures GREATER 0)
  message(STATUS "ON output: ${text}")
  message(FATAL_ERROR "${failures} check(s) failed")
endif()
file(REMOVE_RECURSE ${WORK})
