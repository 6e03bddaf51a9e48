// Catch2 entry point for zerotrain's tests: one intra-op thread per process, so multi-rank
// tests on a 2-core machine do not oversubscribe it.
#define CATCH_CONFIG_RUNNER
#include "support/catch.hpp"

#include <ATen/Parallel.h>

int main(int argc, char* argv[]) {
  at::set_num_threads(1);
  at::set_num_interop_threads(1);
  return Catch::Session().run(argc, argv);
}
