#include "etcd_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "ferry/directory.h"

extern char** environ;

namespace ferry::dtest {

std::string FindEtcd() {
  if (const char* env = std::getenv("FERRY_ETCD"); env && *env) {
    return access(env, X_OK) == 0 ? env : "";
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/etcd";
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) close(fd);
  return port;
}

EtcdServer::~EtcdServer() {
  Kill();
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

std::string EtcdServer::client_address() const {
  return "127.0.0.1:" + std::to_string(client_port_);
}

bool EtcdServer::Start(std::string* error, std::chrono::milliseconds timeout) {
  const std::string etcd = FindEtcd();
  if (etcd.empty()) {
    *error = "etcd not found (Debian package etcd-server, or set FERRY_ETCD)";
    return false;
  }
  if (dir_.empty()) {
    std::string templ = (std::filesystem::temp_directory_path() / "ferry-etcd-XXXXXX").string();
    if (!mkdtemp(templ.data())) {
      *error = std::string("mkdtemp: ") + strerror(errno);
      return false;
    }
    dir_ = templ;
    client_port_ = FreePort();
    peer_port_ = FreePort();
  }
  const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
  const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
  std::vector<std::string> argv = {etcd,
                                   "--name=ferry-test",
                                   "--data-dir=" + dir_ + "/data",
                                   "--listen-client-urls=" + client,
                                   "--advertise-client-urls=" + client,
                                   "--listen-peer-urls=" + peer,
                                   "--initial-advertise-peer-urls=" + peer,
                                   "--initial-cluster=ferry-test=" + peer,
                                   "--initial-cluster-state=new"};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  const std::string log = dir_ + "/etcd.log";
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  const int rc = posix_spawn(&pid_, etcd.c_str(), &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    pid_ = -1;
    *error = "posix_spawn " + etcd + ": " + strerror(rc);
    return false;
  }
  // Ready when the directory can open it and list engines.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  DirectoryOptions o;
  o.connect_timeout = std::chrono::milliseconds(200);
  o.request_timeout = std::chrono::milliseconds(1000);
  std::string last;
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      *error = "etcd exited at start: " + log_tail();
      return false;
    }
    auto d = Directory::open(url("ready-check"), o);
    if (d.ok() && d.value()->engines().ok()) return true;
    last = d.ok() ? "" : d.status().to_string();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  *error = "etcd did not answer within " + std::to_string(timeout.count()) + " ms (" + last +
           "): " + log_tail();
  Kill();
  return false;
}

void EtcdServer::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

void EtcdServer::WipeData() {
  std::error_code ec;
  std::filesystem::remove_all(dir_ + "/data", ec);
}

std::string EtcdServer::log_tail() const {
  std::ifstream in(dir_ + "/etcd.log");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::string out;
  for (size_t i = lines.size() > 8 ? lines.size() - 8 : 0; i < lines.size(); ++i) {
    out += lines[i] + "\n";
  }
  return out;
}

}  // namespace ferry::dtest
