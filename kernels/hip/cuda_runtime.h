// HIP stand-in for <cuda_runtime.h> (see hip_shim.h).
#pragma once
#include "hip_shim.h"
