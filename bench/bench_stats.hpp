// What every benchmark here reports over its interleaved rounds: the median of a round's figures
// (the subject's rate, its limit's, and above all their ratio), so one noisy round moves nothing.
#pragma once

#include <algorithm>
#include <vector>

namespace zinf::bench {

// The middle value (the mean of the two middle ones for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace zinf::bench
