// Exceptions → zt_status.
#include "status.hpp"

#include <c10/util/Exception.h>

#include <filesystem>
#include <ios>
#include <new>

#include "zerotrain/error.hpp"
#include "zerotrain/log.hpp"

namespace zt::capi {

zt_status status_of(const std::exception_ptr& error, std::string& message) {
  try {
    std::rethrow_exception(error);
  } catch (const InvalidArgument& e) {
    message = e.what();
    return ZT_ERR_INVALID_ARGUMENT;
  } catch (const ConfigError& e) {
    message = e.what();
    return ZT_ERR_CONFIG;
  } catch (const IoError& e) {
    message = e.what();
    return ZT_ERR_IO;
  } catch (const DistributedError& e) {
    message = e.what();
    return ZT_ERR_DISTRIBUTED;
  } catch (const OutOfMemoryError& e) {
    message = e.what();
    return ZT_ERR_OUT_OF_MEMORY;
  } catch (const NumericError& e) {
    message = e.what();
    return ZT_ERR_NUMERIC;
  } catch (const CancelledError& e) {
    message = e.what();
    return ZT_ERR_CANCELLED;
  } catch (const std::bad_alloc&) {
    message = "out of host memory";
    return ZT_ERR_OUT_OF_MEMORY;
  } catch (const c10::Error& e) {
    const std::string full = e.what_without_backtrace();
    log_message(LogLevel::kDebug, std::string("LibTorch error: ") + e.what());
    message = full.substr(0, full.find('\n'));
    const bool oom = full.find("out of memory") != std::string::npos ||
                     full.find("can't allocate memory") != std::string::npos;
    return oom ? ZT_ERR_OUT_OF_MEMORY : ZT_ERR_INTERNAL;
  } catch (const std::filesystem::filesystem_error& e) {
    message = e.what();
    return ZT_ERR_IO;
  } catch (const std::ios_base::failure& e) {
    message = e.what();
    return ZT_ERR_IO;
  } catch (const std::exception& e) {
    message = e.what();
    return ZT_ERR_INTERNAL;
  } catch (...) {
    message = "an unknown exception";
    return ZT_ERR_INTERNAL;
  }
}

}  // namespace zt::capi
