// RankExchange: see rank_exchange.hpp.
#include "engine/rank_exchange.hpp"

#include <fmt/format.h>

#include "zinf/dtype.hpp"

namespace zinf {

Result<std::vector<std::uint64_t>> RankExchange::exchange(const std::uint64_t* words,
                                                          std::size_t count) {
  const std::size_t bytes = count * 8;
  const auto world = static_cast<std::size_t>(comm_.world_size());
  ZINF_ASSIGN_OR_RETURN(DeviceBuffer send, DeviceBuffer::allocate(device_, bytes));
  ZINF_ASSIGN_OR_RETURN(DeviceBuffer recv, DeviceBuffer::allocate(device_, bytes * world));
  ZINF_RETURN_IF_ERROR(device_.copy_h2d(send.data(), words, bytes, stream_));
  ZINF_RETURN_IF_ERROR(comm_.all_gather(send.data(), recv.data(), count * 2, DType::kF32, stream_,
                                        "parameter fingerprints"));
  std::vector<std::uint64_t> out(count * world);
  ZINF_RETURN_IF_ERROR(device_.copy_d2h(out.data(), recv.data(), out.size() * 8, stream_));
  ZINF_RETURN_IF_ERROR(device_.record(event_, stream_));
  ZINF_RETURN_IF_ERROR(comm_.wait(event_, timeout_));
  return out;
}

Status RankExchange::agree(std::string_view call, Status local) {
  const std::uint64_t mine = static_cast<std::uint64_t>(local.code());
  Result<std::vector<std::uint64_t>> all = exchange(&mine, 1);
  if (!all.is_ok()) return sticky_.fail(all.status());
  if (!local.is_ok()) return local;
  for (int r = 0; r < comm_.world_size(); ++r) {
    if ((*all)[static_cast<std::size_t>(r)] != 0) {
      return Status::aborted(
          fmt::format("{}: rank {} failed ({}); see its error", call, r,
                      code_name(static_cast<Code>((*all)[static_cast<std::size_t>(r)]))));
    }
  }
  return Status::ok();
}

}  // namespace zinf
