// What both kernels need to use AMX tiles on Linux (included where a kernel's AMX code is compiled).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace fafo_amx {

inline bool ready() {  // Linux hands out the tile registers on request, once per process
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {  // palette 1: per tile, its rows and bytes per row
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t tile_rows[16] = {};
};

}  // namespace fafo_amx
