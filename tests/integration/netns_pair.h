// Two network namespaces joined by a veth pair, for the tests that stand two
// engines on two "hosts" (netns_test.cc) or cut the link between them
// (link_cut_test.cc). Link-local addresses (169.254.77.0/24) inside the
// namespaces only: nothing is sent on the host's own interfaces. Names carry
// the test process's pid, so two tests running at once do not collide.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "test_util.h"

namespace ferry::itest {

// Runs a command to completion; its exit code (-1 if it could not run).
inline int RunCommand(const std::vector<std::string>& argv, std::string* out = nullptr) {
  using namespace std::chrono_literals;
  std::string error;
  auto c = ChildProcess::Spawn(argv, &error, /*capture_stderr=*/true);
  if (!c) {
    if (out) *out = error;
    return -1;
  }
  c->CloseStdin();
  std::string text;
  while (auto line = c->ReadLine(10s)) text += *line + "\n";
  auto st = c->Wait(10s);
  if (out) *out = text;
  if (!st || !WIFEXITED(*st)) return -1;
  return WEXITSTATUS(*st);
}

class NetnsPair {
 public:
  NetnsPair() {
    const std::string tag = std::to_string(getpid() % 100000);
    ns_[0] = "ferryA" + tag;
    ns_[1] = "ferryB" + tag;
    veth_[0] = "fva" + tag;
    veth_[1] = "fvb" + tag;
  }
  ~NetnsPair() { Destroy(); }
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  // Empty on success, else why it cannot be done here.
  std::string Create() {
    if (geteuid() != 0) return "not running as root (network namespaces need CAP_SYS_ADMIN)";
    std::string out;
    if (RunCommand({"ip", "-V"}, &out) != 0) return "iproute2 ('ip') is not installed";
    Destroy();  // leftovers of a crashed earlier run with the same pid
    for (int i = 0; i < 2; ++i) {
      if (RunCommand({"ip", "netns", "add", ns_[i]}, &out) != 0) {
        return "'ip netns add' failed (no CAP_SYS_ADMIN/CAP_NET_ADMIN?): " + out;
      }
    }
    if (RunCommand({"ip", "link", "add", veth_[0], "type", "veth", "peer", "name", veth_[1]},
                   &out) != 0) {
      return "cannot create a veth pair: " + out;
    }
    for (int i = 0; i < 2; ++i) {
      const std::string addr = Address(i) + "/24";
      const std::vector<std::vector<std::string>> steps = {
          {"ip", "link", "set", veth_[i], "netns", ns_[i]},
          {"ip", "-n", ns_[i], "addr", "add", addr, "dev", veth_[i]},
          {"ip", "-n", ns_[i], "link", "set", veth_[i], "up"},
          {"ip", "-n", ns_[i], "link", "set", "lo", "up"},
      };
      for (const auto& s : steps) {
        if (RunCommand(s, &out) != 0)
          return "setting up " + ns_[i] + " failed at '" + s[1] + " " + s[2] + "': " + out;
      }
    }
    return "";
  }

  void Destroy() {
    for (int i = 0; i < 2; ++i) (void)RunCommand({"ip", "netns", "del", ns_[i]});
    (void)RunCommand({"ip", "link", "del", veth_[0]});  // only if never moved
  }

  // Takes side i's end of the veth down (up: back up). Down, neither side's
  // packets cross: the other end loses its carrier too.
  std::string SetLink(int i, bool up) {
    std::string out;
    if (RunCommand({"ip", "-n", ns_[i], "link", "set", veth_[i], up ? "up" : "down"}, &out) != 0) {
      return "'ip link set " + veth_[i] + (up ? " up" : " down") + "' failed: " + out;
    }
    return "";
  }

  static std::string Address(int i) { return i == 0 ? "169.254.77.1" : "169.254.77.2"; }
  std::vector<std::string> Wrapper(int i) const { return {"ip", "netns", "exec", ns_[i]}; }

 private:
  std::string ns_[2], veth_[2];
};

}  // namespace ferry::itest
