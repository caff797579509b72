// RankExchange: see rank_exchange.hpp.
#include "engine/rank_exchange.hpp"

#include <fmt/format.h>

#include "zinf/dtype.hpp"

namespace zinf {

Result<RankExchange> RankExchange::create(Device& device, Communicator& comm, Stream& stream,
                                          Event& event, std::chrono::milliseconds timeout,
                                          StickyError& sticky) {
  RankExchange x(device, comm, stream, event, timeout, sticky);
  const auto world = static_cast<std::size_t>(comm.world_size());
  ZINF_ASSIGN_OR_RETURN(x.agree_send_, DeviceBuffer::allocate(device, 8));
  ZINF_ASSIGN_OR_RETURN(x.agree_recv_, DeviceBuffer::allocate(device, 8 * world));
  x.agree_codes_.resize(world);
  return x;
}

Status RankExchange::exchange_into(const std::uint64_t* words, std::size_t count,
                                   DeviceBuffer& send, DeviceBuffer& recv, std::uint64_t* out) {
  const std::size_t bytes = count * 8;
  const auto world = static_cast<std::size_t>(comm_->world_size());
  Status st = device_->copy_h2d(send.data(), words, bytes, *stream_);
  if (st.is_ok()) {
    st = comm_->all_gather(send.data(), recv.data(), count * 2, DType::kF32, *stream_,
                           "parameter fingerprints");
  }
  if (st.is_ok()) st = device_->copy_d2h(out, recv.data(), bytes * world, *stream_);
  if (st.is_ok()) st = device_->record(*event_, *stream_);
  if (st.is_ok()) st = comm_->wait(*event_, timeout_);
  if (!st.is_ok()) {
    // The copies already queued read `words` and write `send`, `recv` and `out`, which the
    // caller frees on return; an aborted communicator fails all_gather (and wait) before the
    // stream ran them. Let the stream pass them first.
    (void)device_->synchronize(*stream_, timeout_);
  }
  return st;
}

Result<std::vector<std::uint64_t>> RankExchange::exchange(const std::uint64_t* words,
                                                          std::size_t count) {
  const std::size_t bytes = count * 8;
  const auto world = static_cast<std::size_t>(comm_->world_size());
  ZINF_ASSIGN_OR_RETURN(DeviceBuffer send, DeviceBuffer::allocate(*device_, bytes));
  ZINF_ASSIGN_OR_RETURN(DeviceBuffer recv, DeviceBuffer::allocate(*device_, bytes * world));
  std::vector<std::uint64_t> out(count * world);
  ZINF_RETURN_IF_ERROR(exchange_into(words, count, send, recv, out.data()));
  return out;
}

Status RankExchange::agree(std::string_view call, Status local) {
  const std::uint64_t mine = static_cast<std::uint64_t>(local.code());
  Status st = exchange_into(&mine, 1, agree_send_, agree_recv_, agree_codes_.data());
  if (!st.is_ok()) return sticky_->fail(st);
  if (!local.is_ok()) return local;
  for (std::size_t r = 0; r < agree_codes_.size(); ++r) {
    if (agree_codes_[r] != 0) {
      return Status::aborted(fmt::format("{}: rank {} failed ({}); see its error", call, r,
                                         code_name(static_cast<Code>(agree_codes_[r]))));
    }
  }
  return Status::ok();
}

}  // namespace zinf
