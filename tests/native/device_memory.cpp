// A CPU allocator standing in for an accelerator's memory in tests: it counts the bytes of every CPU tensor
// allocated after it is installed, on any thread, keeps their peak, and raises torch.OutOfMemoryError when an
// allocation would take the count past a cap. Allocations made inside a host scope (set per thread) are host memory,
// not the pseudo-device's: not counted and never refused. It allocates through the CPU allocator it replaces.

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

namespace {

thread_local int host_scope_depth = 0;

class DeviceMemory final : public c10::Allocator {
 public:
  c10::Allocator* base = nullptr;
  c10::DeleterFnPtr base_deleter = nullptr;
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> cap{-1};
  std::mutex mutex;
  std::unordered_map<void*, int64_t> counted_bytes;

  // Blocks are simple (context == data), as raw_allocate and some kernels require: their sizes are kept by address.
  c10::DataPtr allocate(size_t nbytes) override {
    const int64_t counted = host_scope_depth == 0 ? static_cast<int64_t>(nbytes) : 0;
    if (counted) {
      const int64_t now = live.fetch_add(counted) + counted;
      const int64_t limit = cap.load();
      if (limit >= 0 && now > limit) {
        live.fetch_sub(counted);
        TORCH_CHECK_WITH(
            OutOfMemoryError, false, "hf-paged test device: out of memory allocating ", nbytes, " bytes with ",
            now - counted, " of ", limit, " bytes in use");
      }
      int64_t seen = peak.load();
      while (now > seen && !peak.compare_exchange_weak(seen, now)) {
      }
    }
    c10::DataPtr inner = base->allocate(nbytes);
    void* data = inner.get();
    base_deleter = inner.get_deleter();
    inner.release_context();
    if (data != nullptr) {
      std::lock_guard<std::mutex> guard(mutex);
      counted_bytes[data] = counted;
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  static void release(void* data);

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

DeviceMemory memory;

void DeviceMemory::release(void* data) {
  if (data == nullptr) {
    return;
  }
  {
    std::lock_guard<std::mutex> guard(memory.mutex);
    auto found = memory.counted_bytes.find(data);
    memory.live.fetch_sub(found->second);
    memory.counted_bytes.erase(found);
  }
  memory.base_deleter(data);
}

void install(int64_t cap) {
  if (memory.base == nullptr) {
    memory.base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&memory, /*priority=*/100);
  }
  memory.cap.store(cap);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("install", &install, "count CPU allocations from now on, refusing those past cap bytes (-1: no cap)");
  module.def("live", [] { return memory.live.load(); }, "bytes counted and not yet freed");
  module.def("peak", [] { return memory.peak.load(); }, "highest live bytes since the last reset");
  module.def("reset_peak", [] { memory.peak.store(memory.live.load()); }, "the peak starts again from the live bytes");
  module.def("enter_host_scope", [] { ++host_scope_depth; }, "this thread's allocations are host memory from now on");
  module.def("exit_host_scope", [] { --host_scope_depth; }, "ends enter_host_scope");
}
