// zerotrain: the command-line front end of libzerotrain.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "commands.hpp"
#include "zerotrain/build_config.hpp"
#include "zerotrain/error.hpp"
#include "zerotrain/log.hpp"

namespace {

void usage(std::FILE* out) {
  std::fprintf(out,
               "zerotrain %s — ZeRO-sharded fine-tuning of decoder LLMs\n\n"
               "usage: zerotrain <command> [options]\n\n"
               "commands:\n"
               "  demo     run the built-in demo job (2 CPU ranks unless --nproc_per_node)\n"
               "  config   parse a DeepSpeed config + training flags and print the resolved\n"
               "           settings (--deepspeed ds.json --world_size N --hidden_size H ...)\n"
               "  launch   start N local ranks with torchrun's variables:\n"
               "           zerotrain launch --nproc_per_node N [--master_port P] -- cmd ...\n"
               "  version  print the version and the backends of this build\n",
               ZT_VERSION_STRING);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "help") == 0 ||
      std::strcmp(argv[1], "-h") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string command = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (command == "launch") return zt::cli::cmd_launch(args);
    if (command == "config") return zt::cli::cmd_config(args);
    if (command == "demo") return zt::cli::cmd_demo(args);
    if (command == "demo-rank") return zt::cli::cmd_demo_rank(args);
    if (command == "version" || command == "--version") {
      std::printf("zerotrain %s (cuda %d, nccl %d, gloo %d, torch-cuda %d)\n", ZT_VERSION_STRING,
                  ZT_WITH_CUDA, ZT_WITH_NCCL, ZT_WITH_GLOO, ZT_TORCH_CUDA);
      return 0;
    }
    std::fprintf(stderr, "zerotrain: unknown command '%s'\n\n", command.c_str());
    usage(stderr);
    return 2;
  } catch (const zt::ConfigError& e) {
    zt::log_message(zt::LogLevel::kError, e.what());
    return 2;
  } catch (const zt::InvalidArgument& e) {
    zt::log_message(zt::LogLevel::kError, e.what());
    return 2;
  } catch (const std::exception& e) {
    zt::log_message(zt::LogLevel::kError, e.what());
    return 1;
  }
}
