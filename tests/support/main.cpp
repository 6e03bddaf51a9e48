// Catch2 entry point for zerotrain's tests: one intra-op thread per process, so multi-rank
// tests on a 2-core machine do not oversubscribe it; a crash prints its stack before the
// process dies, so a segfault on CI or the GPU machine (neither has a debugger) says where.
#define CATCH_CONFIG_RUNNER
#include "support/catch.hpp"
#include "support/ranks.hpp"

#include <execinfo.h>
#include <unistd.h>

#include <csignal>

#include <ATen/Parallel.h>

namespace {

extern "C" void print_stack_and_die(int sig) {
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  static const char kHeader[] = "\n*** fatal signal in a zerotrain test process; stack:\n";
  ssize_t ignored = ::write(STDERR_FILENO, kHeader, sizeof(kHeader) - 1);
  (void)ignored;
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

}  // namespace

int main(int argc, char* argv[]) {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, print_stack_and_die);
  at::set_num_threads(1);
  at::set_num_interop_threads(1);
  const int failed = Catch::Session().run(argc, argv);
  zt::test::remove_temp_dirs();
  return failed;
}
