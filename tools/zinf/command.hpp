// How a `zinf` subcommand plugs into the command line.
//
// A command file defines a setup function that adds its subcommand (with options and a callback)
// to the app, and registers it with ZINF_COMMAND. The callback sets the process exit code
// through set_exit_code(). Output conventions: a readable table by default, one JSON object on
// stdout with --json; errors are one line on stderr starting "zinf: ".
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/size_text.hpp"

namespace zinf::cli {

using CommandSetup = void (*)(CLI::App& app);

struct CommandRegistrar {
  CommandRegistrar(const char* name, CommandSetup setup);
};

struct RegisteredCommand {
  const char* name;
  CommandSetup setup;
};
std::vector<RegisteredCommand>& registered_commands();

// Returns the subcommand `name` of `app`, creating it (with `description`) if it is not there yet,
// so two files can add `zinf bench adam` and `zinf bench step` under one `bench`.
CLI::App* group(CLI::App& app, const std::string& name, const std::string& description);

void set_exit_code(int code);
int exit_code();

// Prints "zinf: <message>" on stderr and sets the exit code to 1.
void fail(std::string_view message);

// A plain text table: a header row and right-aligned numeric columns.
class Table {
 public:
  explicit Table(std::vector<std::string> headers) : headers_(std::move(headers)) {}
  void add_row(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print() const;

 private:
  std::vector<std::string> headers_;
  std::vector<std::vector<std::string>> rows_;
};

// Prints one JSON object on one line to stdout.
void print_json(const nlohmann::json& object);

// Sizes like "4GiB", "48GB", "256M" and counts like "256M" or "7B" params (decimal), the
// library's one grammar for both (base/size_text.hpp).
using zinf::parse_size;
std::string format_bytes(double bytes);

// The median of v (the mean of the two middle values for an even count); v not empty.
double median(std::vector<double> v);

}  // namespace zinf::cli

#define ZINF_COMMAND_CONCAT_INNER_(a, b) a##b
#define ZINF_COMMAND_CONCAT_(a, b) ZINF_COMMAND_CONCAT_INNER_(a, b)
#define ZINF_COMMAND(name, setup)                                                               \
  static ::zinf::cli::CommandRegistrar ZINF_COMMAND_CONCAT_(zinf_command_registrar_, __LINE__)( \
      name, setup)
