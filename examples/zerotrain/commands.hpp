// The `zerotrain` program's subcommands. Each returns the process exit code.
#pragma once

#include <string>
#include <vector>

namespace zt::cli {

using Args = std::vector<std::string>;

int cmd_launch(const Args& args);  // zerotrain launch --nproc_per_node N [--] command...
int cmd_config(const Args& args);  // zerotrain config [training flags] [--world_size N] ...
int cmd_demo(const Args& args);    // zerotrain demo [--nproc_per_node N] [training flags]
int cmd_demo_rank(const Args& args);  // one rank of the demo job (started by cmd_demo)

/// argv[0] of this process, resolved (for re-launching itself).
std::string self_path();

}  // namespace zt::cli
