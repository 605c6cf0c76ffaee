# The train-config fuzzer's dictionary names every table and key that the
# trainer's option table accepts, so that options added later are fuzzed too.
# cmake -DOPTIONS=examples/sdxl/train_config_options.cpp -DDICT=tests/fuzz/train_config.dict -P check_train_config_dict.cmake

foreach(var IN ITEMS OPTIONS DICT)
  if(NOT EXISTS "${${var}}")
    message(FATAL_ERROR "check_train_config_dict: ${var} '${${var}}' does not exist")
  endif()
endforeach()
file(READ "${OPTIONS}" options_text)
file(STRINGS "${DICT}" dict_lines)
# Entries such as {"zero", "offload_params", ... in options_of().
string(REGEX MATCHALL "\\{\"[a-z_]+\", \"[a-z_0-9]+\"" entries "${options_text}")
list(LENGTH entries entry_count)
if(entry_count LESS 50)
  message(FATAL_ERROR "check_train_config_dict: found ${entry_count} options in ${OPTIONS}; "
                      "expected the option table of options_of() (has its format changed?)")
endif()
set(missing "")
foreach(entry IN LISTS entries)
  string(REGEX MATCH "\\{\"([a-z_]+)\", \"([a-z_0-9]+)\"" _ "${entry}")
  foreach(word IN ITEMS "\"[${CMAKE_MATCH_1}]\"" "\"${CMAKE_MATCH_2}\"")
    list(FIND dict_lines "${word}" at)
    if(at EQUAL -1)
      list(APPEND missing "${word}")
    endif()
  endforeach()
endforeach()
list(REMOVE_DUPLICATES missing)
if(missing)
  list(JOIN missing " " missing_text)
  message(FATAL_ERROR "${DICT} lacks these tables or keys of ${OPTIONS}: ${missing_text}")
endif()
message(STATUS "${DICT}: all ${entry_count} options and their tables are in the dictionary")
