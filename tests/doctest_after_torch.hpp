// doctest for test files that include LibTorch first. LibTorch built with
// glog (Debian's 1.13, through c10/util/Logging.h) defines CHECK* macros
// that abort the process instead of reporting; doctest's must win, so this
// header comes after every LibTorch include. A file that implements the
// runner defines DOCTEST_CONFIG_IMPLEMENT(_WITH_MAIN) before including it.
#pragma once

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>
