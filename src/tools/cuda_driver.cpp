// A CUDA device's name and memory from the driver API (libcuda, loaded where torch found a
// GPU), so that no CUDA header is needed to build.

#include "tools/cuda_driver.hpp"

#include <dlfcn.h>

namespace neml2::detail {

CudaDriverQuery cuda_query(int ordinal) {
  CudaDriverQuery q;
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (!driver)
    driver = dlopen("libcuda.so.1", RTLD_LAZY);
  if (!driver)
    return q;
  using Init = int (*)(unsigned);
  using Get = int (*)(int*, int);
  using Name = int (*)(char*, int, int);
  using Memory = int (*)(std::size_t*, int);
  const auto init = reinterpret_cast<Init>(dlsym(driver, "cuInit"));
  const auto get = reinterpret_cast<Get>(dlsym(driver, "cuDeviceGet"));
  const auto name = reinterpret_cast<Name>(dlsym(driver, "cuDeviceGetName"));
  const auto memory = reinterpret_cast<Memory>(dlsym(driver, "cuDeviceTotalMem_v2"));
  int device = 0;
  if (init && get && init(0) == 0 && get(&device, ordinal) == 0) {
    char text[256] = {};
    if (name && name(text, sizeof(text), device) == 0)
      q.name = text;
    if (memory)
      (void)memory(&q.bytes, device);
  }
  return q;
}

} // namespace neml2::detail
