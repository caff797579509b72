// What train_lm shows and writes: the progress bar, the loss curve as CSV and SVG, and the
// summary table.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace train_lm {

struct CurvePoint {
  std::int64_t step = 0;
  double train_loss = 0;
  std::optional<double> val_loss;  // only on steps with a validation
  double tokens_per_s = 0;
};

// "step,train_loss,val_loss,tokens_per_s" and one line a point; val_loss is empty where the step
// had no validation. Returns false (with `error` naming the path) when the file cannot be written.
bool write_curve_csv(const std::string& path, const std::vector<CurvePoint>& points,
                     std::string* error);

// A self-contained SVG: train loss (thin line), validation loss (dots and thicker line), axes with
// ticks, the title given, in nats per byte against steps. A point whose train_loss is NaN (the
// validation before the first step) adds only its validation loss.
bool write_curve_svg(const std::string& path, const std::vector<CurvePoint>& points,
                     const std::string& title, std::string* error);

// One line that rewrites itself on a terminal ("\r"), or is printed every `line_every` calls
// otherwise, so that logs of a piped run stay short.
class ProgressBar {
 public:
  ProgressBar(std::FILE* out, std::int64_t total_steps, bool enabled);
  // `extra` follows the loss on the line (for example the last validation loss).
  void update(std::int64_t step, double loss, double tokens_per_s, double elapsed_s,
              const std::string& extra);
  // Ends the line the bar is on, so that other output starts on a fresh one.
  void finish_line();

 private:
  std::FILE* out_;
  std::int64_t total_;
  bool enabled_;
  bool tty_;
  bool open_line_ = false;
};

// A plain text table: headers, then rows; the first column left-aligned, the rest right-aligned.
std::string format_table(const std::vector<std::string>& headers,
                         const std::vector<std::vector<std::string>>& rows);

}  // namespace train_lm
