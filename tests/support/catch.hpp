// Include this instead of <catch2/catch.hpp>. Debian's LibTorch is built with glog, whose CHECK
// macro would silently replace Catch's (turning failed checks into aborts and passing ones
// into uncounted no-ops) in any file that includes a LibTorch header after Catch. Pulling glog
// in first and then letting Catch define CHECK keeps Catch's meaning everywhere.
#pragma once

#include <c10/util/Logging.h>

#undef CHECK

#include <catch2/catch.hpp>
