// The target side of the two-process GPU tests and bench: starts
// ferry_tcp_gpu_peer (see tcp_gpu_peer.cc) with a buffer size, reads its
// "ready META GPU_DESC HOST_DESC" line, then talks to it line by line.
#pragma once

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace gputest {

// $FERRY_TCP_GPU_PEER if set, else ferry_tcp_gpu_peer beside the running
// executable if there is one, else `fallback`.
inline std::string peer_program(const std::string& fallback) {
  if (const char* e = std::getenv("FERRY_TCP_GPU_PEER"); e != nullptr && *e != 0) return e;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    std::string dir(self, static_cast<size_t>(n));
    dir.resize(dir.rfind('/') + 1);
    const std::string beside = dir + "ferry_tcp_gpu_peer";
    if (access(beside.c_str(), X_OK) == 0) return beside;
  }
  return fallback;
}

class TargetProcess {
 public:
  TargetProcess() = default;
  TargetProcess(const TargetProcess&) = delete;
  TargetProcess& operator=(const TargetProcess&) = delete;
  ~TargetProcess() {
    if (to_) {
      std::fputs("exit\n", to_);
      std::fclose(to_);
    }
    if (from_) std::fclose(from_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }

  // Starts `program bytes`; false with *error set if it does not come up.
  bool start(const std::string& program, size_t bytes, std::string* error) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) {
      *error = std::string("pipe: ") + std::strerror(errno);
      return false;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    const std::string size = std::to_string(bytes);
    char* argv[] = {const_cast<char*>(program.c_str()), const_cast<char*>(size.c_str()), nullptr};
    const int rc = posix_spawn(&pid_, program.c_str(), &fa, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    if (rc != 0) {
      close(in[1]);
      close(out[0]);
      pid_ = -1;
      *error = "cannot start " + program + ": " + std::strerror(rc);
      return false;
    }
    to_ = fdopen(in[1], "w");
    from_ = fdopen(out[0], "r");
    const std::string ready = line();
    if (ready.rfind("ready ", 0) != 0) {
      *error = "target process said: " + ready;
      return false;
    }
    for (size_t pos = 0; pos < ready.size();) {
      size_t sp = ready.find(' ', pos);
      if (sp == std::string::npos) sp = ready.size();
      fields_.push_back(ready.substr(pos, sp - pos));
      pos = sp + 1;
    }
    return true;
  }

  pid_t pid() const { return pid_; }
  // Kills the process (SIGKILL) and reaps it.
  void kill_now() {
    if (to_) std::fclose(to_);
    if (from_) std::fclose(from_);
    to_ = from_ = nullptr;
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

  // "ready", metadata, GPU descriptor, host descriptor (hex).
  const std::vector<std::string>& ready_fields() const { return fields_; }

  // Sends one command line and returns the answer line.
  std::string ask(const std::string& cmd) {
    std::fputs((cmd + "\n").c_str(), to_);
    std::fflush(to_);
    return line();
  }

 private:
  std::string line() {
    char buf[8192];
    if (!std::fgets(buf, sizeof buf, from_)) return "<target process exited>";
    std::string s(buf);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }

  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
  std::vector<std::string> fields_;
};

}  // namespace gputest
