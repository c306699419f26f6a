// An allocator for the objects made once per call (a Transfer, a transport's
// job) through std::allocate_shared: freed blocks of one size are kept in a
// short per-thread list and handed out again. With 16 calls in flight a
// waiter frees a burst of them at once, more than glibc's per-thread cache
// holds (7 a size), and most frees then took malloc's slow path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>

namespace ferry {

namespace detail {

// The address of a thread_local, computed once: in a shared library GCC
// otherwise calls __tls_get_addr again at each use (~11 instructions each).
template <class T>
inline T* tls_address(T& v) {
  T* p = &v;
  asm("" : "+r"(p));
  return p;
}

template <size_t kSize, size_t kAlign>
class BlockCache {
 public:
  static void* take() {
    List& l = *tls_address(list);
    if (Node* n = l.head) {
      l.head = n->next;
      --l.count;
      return n;
    }
    return ::operator new(kSize);
  }
  static void give(void* p) {
    List& l = *tls_address(list);
    if (l.count < kMaxCached) {
      if (!l.owner_registered) register_owner(l);
      l.head = new (p) Node{l.head};
      ++l.count;
      return;
    }
    // Unsized: clang (the fuzz build) has no sized deallocation by default.
    ::operator delete(p);
  }

 private:
  // Enough for a thread's calls in flight; a thread that only frees (a
  // progress thread) holds at most this many blocks.
  static constexpr uint32_t kMaxCached = 64;
  struct Node {
    Node* next;
  };
  // Trivially destructible, so reaching it costs one TLS lookup and no
  // guard; Owner (registered once per thread) frees what it holds.
  struct List {
    Node* head;
    uint32_t count;
    bool owner_registered;
  };
  struct Owner {
    ~Owner() {
      while (Node* n = list.head) {
        list.head = n->next;
        ::operator delete(n);
      }
      list.count = kMaxCached;  // what this thread frees later goes to operator delete
    }
  };
  [[gnu::noinline]] static void register_owner(List& l) {
    thread_local Owner owner;
    (void)owner;
    l.owner_registered = true;
  }
  static inline thread_local List list{nullptr, 0, false};
  static_assert(kSize >= sizeof(Node) && kAlign >= alignof(Node) &&
                kAlign <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);
};

}  // namespace detail

template <class T>
struct BlockCacheAllocator {
  using value_type = T;
  BlockCacheAllocator() = default;
  template <class U>
  BlockCacheAllocator(const BlockCacheAllocator<U>&) {}

  T* allocate(size_t n) {
    if (n != 1) return static_cast<T*>(::operator new(n * sizeof(T)));
    return static_cast<T*>(detail::BlockCache<sizeof(T), alignof(T)>::take());
  }
  void deallocate(T* p, size_t n) {
    if (n != 1) {
      ::operator delete(p);
      return;
    }
    detail::BlockCache<sizeof(T), alignof(T)>::give(p);
  }
  template <class U>
  bool operator==(const BlockCacheAllocator<U>&) const {
    return true;
  }
};

}  // namespace ferry
