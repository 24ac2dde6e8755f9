// The host launcher of the emulated kernels (tests/kernel/*_emu.cc): runs body() as gx * gy
// blocks of `threads` CPU threads, one block at a time, through the stand-in
// tests/kernel/emu/freetoken/cuda_common.cuh. After each block every thread meets at `next`,
// whose completion gives the next block fresh barriers (a thread that left the kernel early
// dropped out of the old ones).
#pragma once

#include <thread>

#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace emu {

template <typename F>
void launch(unsigned gx, unsigned gy, unsigned threads, F body) {
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> lanes(threads);
  BlockState state{nullptr, &warps, lanes.data()};
  auto fresh = [&]() noexcept {
    all = std::make_unique<std::barrier<>>(threads);
    warps.clear();
    for (unsigned w = 0; w * 32 < threads; ++w)
      warps.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - w * 32)));
    state.all = all.get();
  };
  fresh();
  std::barrier next(threads, fresh);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      thread_idx = {t, 0, 0};
      block_dim = {threads, 1, 1};
      grid_dim = {gx, gy, 1};
      block = &state;
      for (unsigned b = 0; b < gx * gy; ++b) {
        block_idx = {b % gx, b / gx, 0};
        body();
        warps[t / 32]->arrive_and_drop();
        all->arrive_and_drop();
        next.arrive_and_wait();
      }
    });
  }
  for (auto& th : pool) th.join();
}

}  // namespace emu
}  // namespace freetoken
