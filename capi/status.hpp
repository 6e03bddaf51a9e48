// The one mapping from what the library throws to the C API's status codes and messages.
#pragma once

#include <exception>
#include <string>

#include "zerotrain/zerotrain.h"

namespace zt::capi {

/// The status for the exception `error` and the message the host gets: zerotrain's own errors
/// by their type; out of memory (std::bad_alloc, LibTorch's CUDA "out of memory" and CPU
/// "can't allocate memory") → ZT_ERR_OUT_OF_MEMORY; file-system and stream failures →
/// ZT_ERR_IO; other LibTorch errors → ZT_ERR_INTERNAL with their first line only (the whole
/// text, backtrace included, goes to the log at debug level); anything else → ZT_ERR_INTERNAL.
zt_status status_of(const std::exception_ptr& error, std::string& message);

}  // namespace zt::capi
