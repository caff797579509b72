// Uses the installed public headers and library as a user would; prints "zinf consumer ok".
#include <cstdio>
#include <string>
#include <zinf/dtype.hpp>
#include <zinf/status.hpp>
#include <zinf/trace.hpp>
#include <zinf/version.hpp>

int main() {
  const float value = 1.5f;
  if (zinf::bf16_to_f32(zinf::f32_to_bf16(value)) != value) return 2;
  zinf::Status status = zinf::Status::not_found("tensor 'w0' in checkpoint");
  if (status.code() != zinf::Code::kNotFound) return 3;
  zinf::Trace trace;
  { auto span = trace.span(trace.track("consumer"), "work"); }
  if (trace.event_count() != 1) return 4;
  std::printf("zinf consumer ok (zinf %s, %s)\n", zinf::version(), status.to_string().c_str());
  return 0;
}
