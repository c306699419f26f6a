// Naming GPUs by what they are (UUID, PCI bus id) and finding this process's
// ordinal of one: the part of GPU identity that needs no CUDA, so that every
// build parses and prints the names a peer sends.
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "ferry/gpu.h"
#include "fmt/format.h"
#include "fmt/ranges.h"

namespace ferry {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// "0000:18:00.0", "00000000:18:00.0" (nvidia-smi) or "18:00.0" -> packed.
std::optional<uint32_t> parse_pci_bus_id(std::string_view s) {
  unsigned domain = 0, bus = 0, device = 0, function = 0;
  char tail = 0;
  const std::string t(s);
  if (std::sscanf(t.c_str(), "%x:%x:%x.%x%c", &domain, &bus, &device, &function, &tail) == 4 ||
      (domain = 0, std::sscanf(t.c_str(), "%x:%x.%x%c", &bus, &device, &function, &tail) == 3)) {
    if (domain <= 0xffff && bus <= 0xff && device <= 0x1f && function <= 7) {
      return pack_pci_bus_id(domain, bus, device, function);
    }
  }
  return std::nullopt;
}

// "GPU-xxxxxxxx-xxxx-..." or the bare 32 hex digits, dashes ignored; "" if not one.
std::string uuid_hex(std::string_view s) {
  std::string l = lower(s);
  if (l.rfind("gpu-", 0) == 0) l = l.substr(4);
  std::string hex;
  for (char c : l) {
    if (c == '-') continue;
    if (!std::isxdigit(static_cast<unsigned char>(c))) return {};
    hex.push_back(c);
  }
  return hex.size() == 32 ? hex : std::string();
}

}  // namespace

uint32_t pack_pci_bus_id(uint32_t domain, uint32_t bus, uint32_t device, uint32_t function) {
  return (domain & 0xffff) << 16 | (bus & 0xff) << 8 | (device & 0x1f) << 3 | (function & 7);
}

std::string pci_bus_id_text(uint32_t p) {
  return fmt::format("{:04x}:{:02x}:{:02x}.{:x}", p >> 16, (p >> 8) & 0xff, (p >> 3) & 0x1f, p & 7);
}

Result<int> gpu_ordinal(std::string_view name) {
  const std::string uuid = uuid_hex(name);
  const std::optional<uint32_t> pci =
      uuid.empty() ? parse_pci_bus_id(name) : std::optional<uint32_t>();
  if (uuid.empty() && !pci) {
    return err::InvalidArgument(fmt::format(
        "'{}' names no GPU: expected a UUID (GPU-xxxxxxxx-...) or a PCI bus id (0000:18:00.0)",
        name));
  }
  auto gpus = gpu_identities();
  if (!gpus.ok()) return gpus.status();
  std::vector<std::string> seen;
  for (const GpuIdentity& g : *gpus) {
    if (!uuid.empty() ? uuid_hex(g.uuid) == uuid : parse_pci_bus_id(g.pci_bus_id) == pci) {
      return g.ordinal;
    }
    seen.push_back(fmt::format("{} {} ({})", g.ordinal, g.uuid, g.pci_bus_id));
  }
  return err::NotFound(fmt::format(
      "GPU {} is not visible in this process (CUDA_VISIBLE_DEVICES={}); it sees: {}", name,
      std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES") : "(unset)",
      fmt::join(seen, "; ")));
}

}  // namespace ferry
