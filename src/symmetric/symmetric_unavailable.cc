// Builds without the CUDA toolkit: symmetric memory and the MoE exchange
// answer NotSupported, saying why.
#include "ferry/moe.h"
#include "ferry/symmetric.h"

namespace ferry {
namespace {
Status unavailable() {
  return err::NotSupported("symmetric memory: this Ferry was built without the CUDA toolkit");
}
}  // namespace

struct SymmetricMemory::Impl {};
SymmetricMemory::SymmetricMemory(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SymmetricMemory::~SymmetricMemory() = default;
Result<std::unique_ptr<SymmetricMemory>> SymmetricMemory::create(const SymmetricOptions&) {
  return unavailable();
}
std::vector<uint8_t> SymmetricMemory::card() const {
  return {};
}
Status SymmetricMemory::join(const std::vector<std::vector<uint8_t>>&) {
  return unavailable();
}
bool SymmetricMemory::joined() const {
  return false;
}
int SymmetricMemory::rank() const {
  return 0;
}
int SymmetricMemory::size() const {
  return 0;
}
int SymmetricMemory::device() const {
  return -1;
}
uint64_t SymmetricMemory::data_bytes() const {
  return 0;
}
uint32_t SymmetricMemory::signal_slots() const {
  return 0;
}
void* SymmetricMemory::local_data() const {
  return nullptr;
}
uint64_t* SymmetricMemory::local_signals() const {
  return nullptr;
}
void* SymmetricMemory::peer_data(int) const {
  return nullptr;
}
uint64_t* SymmetricMemory::peer_signals(int) const {
  return nullptr;
}
DeviceTeam SymmetricMemory::team() const {
  return {};
}
const DeviceTeam* SymmetricMemory::device_team_ptr() const {
  return nullptr;
}
const uint64_t* SymmetricMemory::device_peer_data() const {
  return nullptr;
}
const uint64_t* SymmetricMemory::device_peer_signals() const {
  return nullptr;
}
Status SymmetricMemory::device_error() const {
  return Status::Ok();
}
void SymmetricMemory::clear_device_error() {}
Status SymmetricMemory::put(int, uint64_t, const void*, uint64_t, void*) {
  return unavailable();
}
Status SymmetricMemory::signal(int, uint32_t, uint64_t, bool, void*) {
  return unavailable();
}
Status SymmetricMemory::wait(uint32_t, uint64_t, void*, uint64_t) {
  return unavailable();
}
Status SymmetricMemory::barrier(void*) {
  return unavailable();
}
uint64_t SymmetricMemory::read_signal(uint32_t) const {
  return 0;
}

Result<MoeLayout> moe_layout(const MoeConfig&, int) {
  return unavailable();
}
struct MoeExchange::Impl {
  MoeConfig config;
  MoeLayout layout;
};
MoeExchange::MoeExchange(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeExchange::~MoeExchange() = default;
Result<std::unique_ptr<MoeExchange>> MoeExchange::create(SymmetricMemory&, const MoeConfig&) {
  return unavailable();
}
Status MoeExchange::dispatch(const void*, const int64_t*, const float*, int, void*) {
  return unavailable();
}
Status MoeExchange::combine(const void*, void*, void*) {
  return unavailable();
}
int MoeExchange::dispatched_tokens() const {
  return 0;
}
const MoeConfig& MoeExchange::config() const {
  return impl_->config;
}
const MoeLayout& MoeExchange::layout() const {
  return impl_->layout;
}
void* MoeExchange::recv_x() const {
  return nullptr;
}
int32_t* MoeExchange::recv_src() const {
  return nullptr;
}
int32_t* MoeExchange::recv_count() const {
  return nullptr;
}

}  // namespace ferry
