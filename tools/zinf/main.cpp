// zinf: the command line. Subcommands register themselves (command.hpp); see `zinf --help`.
#include <CLI/CLI.hpp>

#include "command.hpp"
#include "zinf/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{"zinf: train models larger than GPU memory (ZeRO-Infinity as a C++ library)"};
  app.set_version_flag("--version", std::string("zinf ") + zinf::version());
  app.require_subcommand(1);
  for (const auto& command : zinf::cli::registered_commands()) command.setup(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return zinf::cli::exit_code();
}
