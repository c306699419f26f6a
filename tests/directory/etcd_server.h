// A real etcd server for the directory tests: Debian's etcd-server binary on
// loopback, on free ports, with its data in a temporary directory, logging to
// a file there. Killed (SIGKILL) and restarted on the same ports by the tests.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>

namespace ferry::dtest {

// Path of the etcd binary: $FERRY_ETCD, else `etcd` on PATH; "" when absent.
std::string FindEtcd();

// A free TCP port on 127.0.0.1 (bound, read, closed).
int FreePort();

class EtcdServer {
 public:
  EtcdServer() = default;
  ~EtcdServer();  // SIGKILL, reap, delete the data directory
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  // Picks ports and a data directory on the first call; starts etcd and waits
  // until it answers (at most `timeout`). False with *error set otherwise.
  bool Start(std::string* error, std::chrono::milliseconds timeout = std::chrono::seconds(20));
  // SIGKILL and reap: the store disappears without a goodbye.
  void Kill();
  // Deletes the data directory (the next Start is an empty cluster).
  void WipeData();
  bool running() const { return pid_ > 0; }

  std::string client_address() const;  // "127.0.0.1:<port>"
  std::string url(const std::string& prefix) const {
    return "etcd://" + client_address() + "/" + prefix;
  }
  std::string log_tail() const;  // the last lines etcd wrote (for failures)

 private:
  pid_t pid_ = -1;
  int client_port_ = 0;
  int peer_port_ = 0;
  std::string dir_;  // holds data/ and etcd.log
};

}  // namespace ferry::dtest
