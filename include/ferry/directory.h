// A metadata directory: engines find each other by name instead of passing
// engine.metadata() and descriptors around by hand.
//
//   auto dir = ferry::Directory::open("etcd://10.0.0.5:2379/job-17").value();
//   dir->publish_engine("decode-3", engine->metadata());          // claims the name
//   dir->publish("decode-3", "kv-pool", desc.to_bytes());          // a descriptor under it
//   auto meta = dir->lookup_engine("prefill-0", std::chrono::seconds(30));  // waits for it
//   auto peer = engine->connect(*meta);
//
// Everything a Directory publishes lives under one etcd lease that a background
// thread keeps alive: when the process dies its entries vanish within the lease
// ttl, and a name held by a live engine is refused to everyone else. If the
// store goes away, lookups fail naming the endpoint, the keep-alive retries,
// and when the store answers again a lost lease is granted anew and every
// entry put back. Back end and key layout: docs/directory.md.
//
// Thread safety: every method may be called from any thread concurrently.
// Callbacks: none. The destructor revokes the lease (entries vanish at once).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry {

struct DirectoryOptions {
  // Lease time-to-live: a dead publisher's entries vanish within this.
  std::chrono::seconds lease_ttl{10};
  // Bound on connecting to the store, and on each request as a whole.
  std::chrono::milliseconds connect_timeout{1000};
  std::chrono::milliseconds request_timeout{3000};
  // publish_engine on a name held by another live engine: wait up to this long
  // for it to be released (its lease revoked or expired) before refusing. A
  // restarted engine sets it to lease_ttl + a little to take its old name back.
  std::chrono::milliseconds claim_wait{0};
  // Shown to whoever is refused the name; "" = "pid <pid> on <hostname>".
  std::string holder;
  // etcd's HTTP gateway prefix ("/v3", "/v3beta"); "" = chosen from the
  // server's /version (3.4+ → /v3, 3.3 → /v3beta).
  std::string gateway_prefix;
};

class Directory {
 public:
  // url: "etcd://host:port[,host:port...]/prefix" (prefix optional, default
  // "ferry"; segments of [A-Za-z0-9._-]). Fails with PeerDisconnected naming
  // every endpoint when none answers.
  static Result<std::unique_ptr<Directory>> open(std::string_view url,
                                                 const DirectoryOptions& options = {});
  ~Directory();
  Directory(const Directory&) = delete;
  Directory& operator=(const Directory&) = delete;

  // Claims `name` for this directory's lease and stores the engine metadata.
  // Refused with PermissionDenied naming the holder if another live lease holds
  // it (after waiting claim_wait); publishing a name this directory already
  // holds replaces its metadata.
  Status publish_engine(std::string_view name, ByteView metadata);
  // The metadata published under `name`. NotFound when absent; with wait > 0
  // polls until it appears and then answers Timeout naming the name.
  Result<Bytes> lookup_engine(std::string_view name,
                              std::chrono::milliseconds wait = std::chrono::milliseconds(0));

  // Stores bytes (a RemoteDescriptor, or anything small) under `key` of an
  // engine name this directory holds (publish_engine first), same lease.
  Status publish(std::string_view name, std::string_view key, ByteView value);
  Result<Bytes> lookup(std::string_view name, std::string_view key,
                       std::chrono::milliseconds wait = std::chrono::milliseconds(0));

  // Gives a held name up: its metadata and every key under it are deleted.
  Status unpublish_engine(std::string_view name);
  // Names of every engine published now (sorted).
  Result<std::vector<std::string>> engines();

  // Ok while the lease is alive and every entry is in the store; otherwise why
  // not (store unreachable since when, lease lost, a name taken by another).
  Status health() const;
  // The endpoint answering now ("127.0.0.1:2379") and the key prefix.
  std::string endpoint() const;
  std::string prefix() const;
  // The lease id (0 before anything was published).
  int64_t lease_id() const;

  class Impl;

 private:
  explicit Directory(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Names and keys: 1 … 128 characters of [A-Za-z0-9._-], not "." or "..".
// InvalidArgument naming `what` ("engine name", "key") and the value otherwise.
Status validate_directory_name(std::string_view what, std::string_view value);

// --- engine helpers (until EngineConfig carries a directory) ---------------

// Looks `name` up (waiting up to `wait`) and connects the engine to it.
Result<PeerId> connect_by_name(Engine& engine, Directory& directory, std::string_view name,
                               std::chrono::milliseconds wait = std::chrono::milliseconds(0));
// Publishes a descriptor under (name, key) and decodes one looked up.
Status publish_descriptor(Directory& directory, std::string_view name, std::string_view key,
                          const RemoteDescriptor& descriptor);
Result<RemoteDescriptor> lookup_descriptor(
    Directory& directory, std::string_view name, std::string_view key,
    std::chrono::milliseconds wait = std::chrono::milliseconds(0));

}  // namespace ferry
