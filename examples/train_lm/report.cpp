#include "report.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

namespace train_lm {
namespace {

bool write_file(const std::string& path, const std::string& contents, std::string* error) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (file) file << contents;
  if (file) file.flush();
  if (!file) {
    *error = "cannot write " + path + ": " + std::strerror(errno);
    return false;
  }
  return true;
}

std::string fixed(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", digits, value);
  return buffer;
}

// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `ticks` ticks over `span`.
double tick_step(double span, int ticks) {
  const double raw = span / ticks;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  const double mantissa = raw / power;
  return (mantissa < 1.5 ? 1 : mantissa < 3.5 ? 2 : mantissa < 7.5 ? 5 : 10) * power;
}

}  // namespace

bool write_curve_csv(const std::string& path, const std::vector<CurvePoint>& points,
                     std::string* error) {
  std::string text = "step,train_loss,val_loss,tokens_per_s\n";
  for (const CurvePoint& p : points) {
    text += std::to_string(p.step) + "," + fixed(p.train_loss, 6) + "," +
            (p.val_loss ? fixed(*p.val_loss, 6) : std::string()) + "," + fixed(p.tokens_per_s, 1) +
            "\n";
  }
  return write_file(path, text, error);
}

bool write_curve_svg(const std::string& path, const std::vector<CurvePoint>& points,
                     const std::string& title, std::string* error) {
  constexpr double kWidth = 720, kHeight = 420;
  constexpr double kLeft = 64, kRight = 20, kTop = 40, kBottom = 50;
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  std::int64_t max_step = 1;
  double lo = 1e30, hi = -1e30;
  for (const CurvePoint& p : points) {
    max_step = std::max(max_step, p.step);
    if (!std::isnan(p.train_loss)) {
      lo = std::min(lo, p.train_loss);
      hi = std::max(hi, p.train_loss);
    }
    if (p.val_loss) {
      lo = std::min(lo, *p.val_loss);
      hi = std::max(hi, *p.val_loss);
    }
  }
  if (points.empty()) lo = 0, hi = 6;
  lo = std::floor(std::max(0.0, lo - 0.1) * 2) / 2;
  hi = std::ceil((hi + 0.1) * 2) / 2;
  if (hi <= lo) hi = lo + 1;
  auto x_of = [&](double step) { return kLeft + plot_w * step / double(max_step); };
  auto y_of = [&](double loss) { return kTop + plot_h * (hi - loss) / (hi - lo); };

  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << kHeight
      << "\" viewBox=\"0 0 " << kWidth << " " << kHeight
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kWidth / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">"
      << title << "</text>\n";
  // Grid and ticks.
  const double y_step = tick_step(hi - lo, 6);
  for (double v = std::ceil(lo / y_step) * y_step; v <= hi + 1e-9; v += y_step) {
    svg << "<line x1=\"" << kLeft << "\" x2=\"" << kLeft + plot_w << "\" y1=\"" << y_of(v)
        << "\" y2=\"" << y_of(v) << "\" stroke=\"#ddd\"/>\n"
        << "<text x=\"" << kLeft - 6 << "\" y=\"" << y_of(v) + 4 << "\" text-anchor=\"end\">"
        << fixed(v, y_step < 1 ? 1 : 0) << "</text>\n";
  }
  const double x_step = tick_step(double(max_step), 8);
  for (double s = 0; s <= double(max_step) + 1e-9; s += x_step) {
    svg << "<line x1=\"" << x_of(s) << "\" x2=\"" << x_of(s) << "\" y1=\"" << kTop << "\" y2=\""
        << kTop + plot_h << "\" stroke=\"#eee\"/>\n"
        << "<text x=\"" << x_of(s) << "\" y=\"" << kTop + plot_h + 16
        << "\" text-anchor=\"middle\">" << fixed(s, 0) << "</text>\n";
  }
  svg << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << plot_w << "\" height=\""
      << plot_h << "\" fill=\"none\" stroke=\"#444\"/>\n"
      << "<text x=\"" << kLeft + plot_w / 2 << "\" y=\"" << kHeight - 10
      << "\" text-anchor=\"middle\">step</text>\n"
      << "<text transform=\"translate(16," << kTop + plot_h / 2
      << ") rotate(-90)\" text-anchor=\"middle\">loss (nats per byte)</text>\n";
  // The curves.
  svg << "<polyline fill=\"none\" stroke=\"#7aa6d6\" stroke-width=\"1\" points=\"";
  for (const CurvePoint& p : points) {
    if (std::isnan(p.train_loss)) continue;
    svg << fixed(x_of(double(p.step)), 1) << "," << fixed(y_of(p.train_loss), 1) << " ";
  }
  svg << "\"/>\n<polyline fill=\"none\" stroke=\"#d9534f\" stroke-width=\"2\" points=\"";
  for (const CurvePoint& p : points) {
    if (p.val_loss) {
      svg << fixed(x_of(double(p.step)), 1) << "," << fixed(y_of(*p.val_loss), 1) << " ";
    }
  }
  svg << "\"/>\n";
  for (const CurvePoint& p : points) {
    if (p.val_loss) {
      svg << "<circle cx=\"" << fixed(x_of(double(p.step)), 1) << "\" cy=\""
          << fixed(y_of(*p.val_loss), 1) << "\" r=\"3\" fill=\"#d9534f\"/>\n";
    }
  }
  // Legend.
  const double lx = kLeft + plot_w - 150, ly = kTop + 16;
  svg << "<line x1=\"" << lx << "\" x2=\"" << lx + 24 << "\" y1=\"" << ly << "\" y2=\"" << ly
      << "\" stroke=\"#7aa6d6\"/><text x=\"" << lx + 30 << "\" y=\"" << ly + 4
      << "\">train loss</text>\n"
      << "<line x1=\"" << lx << "\" x2=\"" << lx + 24 << "\" y1=\"" << ly + 18 << "\" y2=\""
      << ly + 18 << "\" stroke=\"#d9534f\" stroke-width=\"2\"/><text x=\"" << lx + 30 << "\" y=\""
      << ly + 22 << "\">validation loss</text>\n";
  svg << "</svg>\n";
  return write_file(path, svg.str(), error);
}

ProgressBar::ProgressBar(std::FILE* out, std::int64_t total_steps, bool enabled)
    : out_(out), total_(total_steps), enabled_(enabled), tty_(isatty(fileno(out)) != 0) {}

void ProgressBar::update(std::int64_t step, double loss, double tokens_per_s, double elapsed_s,
                         const std::string& extra) {
  if (!enabled_) return;
  const bool last = step == total_;
  // Without a terminal, a line every 10% keeps a log readable.
  const std::int64_t every = std::max<std::int64_t>(1, total_ / 10);
  if (!tty_ && !last && step % every != 0) return;
  constexpr int kBarWidth = 24;
  const int filled = int(double(kBarWidth) * double(step) / double(total_));
  std::string bar(std::size_t(filled), '#');
  bar.resize(kBarWidth, '.');
  const double eta_s = step > 0 ? elapsed_s * double(total_ - step) / double(step) : 0;
  std::fprintf(out_, "%s[%s] step %lld/%lld  loss %.3f  %s  %.*f tok/s  ETA %.0fs   ",
               tty_ ? "\r" : "", bar.c_str(), static_cast<long long>(step),
               static_cast<long long>(total_), loss, extra.c_str(), tokens_per_s < 100 ? 1 : 0,
               tokens_per_s, eta_s);
  if (!tty_) std::fputc('\n', out_);
  open_line_ = tty_;
  std::fflush(out_);
}

void ProgressBar::finish_line() {
  if (open_line_) std::fputc('\n', out_);
  open_line_ = false;
}

std::string format_table(const std::vector<std::string>& headers,
                         const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> widths(headers.size());
  for (std::size_t c = 0; c < headers.size(); ++c) widths[c] = headers[c].size();
  for (const auto& row : rows) {
    for (std::size_t c = 0; c < row.size() && c < widths.size(); ++c) {
      widths[c] = std::max(widths[c], row[c].size());
    }
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string text;
    for (std::size_t c = 0; c < widths.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      const std::string pad(widths[c] - cell.size(), ' ');
      text += c == 0 ? cell + pad : "  " + pad + cell;
    }
    while (!text.empty() && text.back() == ' ') text.pop_back();
    return text + "\n";
  };
  std::string text = line(headers);
  std::size_t total = 0;
  for (std::size_t w : widths) total += w + 2;
  text += std::string(total - 2, '-') + "\n";
  for (const auto& row : rows) text += line(row);
  return text;
}

}  // namespace train_lm
